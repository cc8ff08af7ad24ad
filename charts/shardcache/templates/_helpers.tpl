{{/*
Names, labels and shared values. Object names are FULLNAME-COMPONENT; every object carries the
app.kubernetes.io/* labels plus app.kubernetes.io/component.
*/}}

{{- define "shardcache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "shardcache.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Component object name: (dict "ctx" $ "component" "node") */}}
{{- define "shardcache.componentName" -}}
{{- printf "%s-%s" (include "shardcache.fullname" .ctx) .component }}
{{- end }}

{{- define "shardcache.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of a component: (dict "ctx" $ "component" "node"). Never change these: selectors are immutable. */}}
{{- define "shardcache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shardcache.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of a component's objects: (dict "ctx" $ "component" "node"). */}}
{{- define "shardcache.labels" -}}
helm.sh/chart: {{ include "shardcache.chart" .ctx }}
{{ include "shardcache.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: shardcache
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The component image: (dict "ctx" $ "repository" "" "tag" "") with overrides. */}}
{{- define "shardcache.image" -}}
{{- $repo := default .ctx.Values.image.repository .repository }}
{{- $tag := default (default .ctx.Chart.AppVersion .ctx.Values.image.tag) .tag }}
{{- if and .ctx.Values.image.digest (not .repository) (not .tag) }}
{{- printf "%s@%s" $repo .ctx.Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}
{{- end }}

{{- define "shardcache.serviceAccountName" -}}
{{- $sa := index .ctx.Values .component "serviceAccount" }}
{{- if $sa.create }}
{{- default (include "shardcache.componentName" .) $sa.name }}
{{- else }}
{{- default "default" $sa.name }}
{{- end }}
{{- end }}

{{/* Container paths are fixed; only host paths are configurable (the injected sidecar uses the same). */}}
{{- define "shardcache.socketMount" -}}/run/shardcache{{- end }}
{{- define "shardcache.cacheMount" -}}/var/cache/shardcache{{- end }}
{{- define "shardcache.originMount" -}}/var/lib/shardcache-origin{{- end }}

{{/* Whether hostpath-mode pods get short-circuit reads by file handle (the daemon serves them on
handles.sock next to daemon.sock). By handle, not by path: no pod mounts the node cache, so per-tenant
reads (node.auth.mode sigv4) and an ephemeral cache allow them too. */}}
{{- define "shardcache.shortCircuit" -}}
{{- if .Values.webhook.sidecar.shortCircuit }}true{{ else }}false{{ end }}
{{- end }}

{{- define "shardcache.handlesSocket" -}}{{ include "shardcache.socketMount" . }}/handles.sock{{- end }}

{{/* The Service restricted-mode sidecars reach their node's daemon through (internalTrafficPolicy Local). */}}
{{- define "shardcache.localServiceName" -}}
{{- include "shardcache.componentName" (dict "ctx" . "component" "local") }}
{{- end }}

{{- define "shardcache.restrictedUpstream" -}}
{{- printf "tcp://%s.%s.svc:%d" (include "shardcache.localServiceName" .) .Release.Namespace (int .Values.node.port) }}
{{- end }}

{{/* The other injection mode than webhook.sidecar.mode. */}}
{{- define "shardcache.otherMode" -}}
{{- if eq .Values.webhook.sidecar.mode "restricted" }}hostpath{{ else }}restricted{{ end }}
{{- end }}

{{/*
Namespaces injected in one mode: (dict "ctx" $ "mode" "restricted"). The injected namespaces, and
of those the ones whose label shardcache.io/mode names this mode (or, for webhook.sidecar.mode, not
the other one): one webhook entry per mode, since an AdmissionReview carries no namespace labels.
Namespaces that enforce Pod Security baseline or restricted (label pod-security.kubernetes.io/enforce)
refuse every hostPath: they are the "pod-security" entry's alone, injected in restricted mode
whatever they or their pods ask (the webhook's /mutate/pod-security path).
*/}}
{{- define "shardcache.modeNamespaceSelector" -}}
{{- $selector := include "shardcache.injectedNamespaceSelector" .ctx | fromYaml }}
{{- $levels := list "baseline" "restricted" }}
{{- $expressions := list }}
{{- if eq .mode "pod-security" }}
{{- $expressions = list (dict "key" "pod-security.kubernetes.io/enforce" "operator" "In" "values" $levels) }}
{{- else }}
{{- $expression := dict "key" "shardcache.io/mode" "operator" "In" "values" (list .mode) }}
{{- if eq .mode .ctx.Values.webhook.sidecar.mode }}
{{- $expression = dict "key" "shardcache.io/mode" "operator" "NotIn" "values" (list (include "shardcache.otherMode" .ctx)) }}
{{- end }}
{{- $expressions = list $expression (dict "key" "pod-security.kubernetes.io/enforce" "operator" "NotIn" "values" $levels) }}
{{- end }}
{{- $_ := set $selector "matchExpressions" (concat ($selector.matchExpressions | default list) $expressions) }}
{{- toYaml $selector }}
{{- end }}

{{/*
Namespaces the admission policy guards: admissionPolicy.namespaceSelector, else the injected ones;
never kube-system nor the release's own (the node daemon's hostPath volumes live there).
*/}}
{{- define "shardcache.policyNamespaceSelector" -}}
{{- $selector := deepCopy (.Values.admissionPolicy.namespaceSelector | default .Values.webhook.namespaceSelector | default dict) }}
{{- $never := dict "key" "kubernetes.io/metadata.name" "operator" "NotIn" "values" (list "kube-system" .Release.Namespace) }}
{{- $_ := set $selector "matchExpressions" (append ($selector.matchExpressions | default list) $never) }}
{{- toYaml $selector }}
{{- end }}

{{/* Native sidecars: forced by webhook.nativeSidecar, or auto from the cluster version. */}}
{{- define "shardcache.nativeSidecar" -}}
{{- $v := .Values.webhook.nativeSidecar }}
{{- if eq (toString $v) "auto" }}
{{- if semverCompare ">=1.29.0-0" .Capabilities.KubeVersion.Version }}true{{ else }}false{{ end }}
{{- else if $v }}true{{ else }}false{{ end }}
{{- end }}

{{/*
Whether the admission policy is rendered: "true" when admissionPolicy.enabled and the cluster
serves ValidatingAdmissionPolicy (discovery says so, or Kubernetes 1.30+, where it is GA: what
`helm template` assumes without --api-versions). Enabled on an older cluster, rendering fails and
says what to do, rather than install the chart without the policy that keeps pods in injected
namespaces away from the node's host paths and privileges.
*/}}
{{- define "shardcache.admissionPolicy.rendered" -}}
{{- if .Values.admissionPolicy.enabled }}
{{- if or (.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy") (semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version) }}true
{{- else }}
{{- fail (printf "admissionPolicy.enabled is true but Kubernetes %s serves no ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1, 1.30+): without it a pod in an injected namespace could mount the node cache by hostPath, run privileged or add capabilities. Upgrade the cluster to 1.30+, or set admissionPolicy.enabled=false and enforce the same rules with your own policy engine (docs: the chart README, Multi-tenant clusters)" .Capabilities.KubeVersion.Version) }}
{{- end }}
{{- end }}
{{- end }}

{{- define "shardcache.webhook.serviceName" -}}
{{- include "shardcache.componentName" (dict "ctx" . "component" "webhook") }}
{{- end }}

{{- define "shardcache.webhook.tlsSecretName" -}}
{{- if eq .Values.webhook.tls.mode "secret" }}
{{- required "webhook.tls.secret.name is required when webhook.tls.mode is secret" .Values.webhook.tls.secret.name }}
{{- else }}
{{- printf "%s-tls" (include "shardcache.webhook.serviceName" .) }}
{{- end }}
{{- end }}

{{/* DNS names the webhook certificate must carry (the API server dials SERVICE.NAMESPACE.svc). */}}
{{- define "shardcache.webhook.dnsNames" -}}
{{- $svc := include "shardcache.webhook.serviceName" . }}
{{- $ns := .Release.Namespace }}
- {{ $svc }}
- {{ $svc }}.{{ $ns }}
- {{ $svc }}.{{ $ns }}.svc
- {{ $svc }}.{{ $ns }}.svc.cluster.local
{{- end }}

{{/* Namespaces the webhook injects: webhook.namespaceSelector, else all but kube-system and the release's. */}}
{{- define "shardcache.injectedNamespaceSelector" -}}
{{- if .Values.webhook.namespaceSelector }}
{{- toYaml .Values.webhook.namespaceSelector }}
{{- else -}}
matchExpressions:
  - key: kubernetes.io/metadata.name
    operator: NotIn
    values:
      - kube-system
      - {{ .Release.Namespace }}
{{- end }}
{{- end }}

{{/* Training namespaces (NetworkPolicies): networkPolicy.trainingNamespaceSelector, else the injected ones. */}}
{{- define "shardcache.trainingNamespaceSelector" -}}
{{- if .Values.networkPolicy.trainingNamespaceSelector }}
{{- toYaml .Values.networkPolicy.trainingNamespaceSelector }}
{{- else }}
{{- include "shardcache.injectedNamespaceSelector" . }}
{{- end }}
{{- end }}

{{/* The Secret holding the master's bearer token (key "token"): the user's, or the chart's. */}}
{{- define "shardcache.master.tokenSecretName" -}}
{{- default (printf "%s-token" (include "shardcache.componentName" (dict "ctx" . "component" "master"))) .Values.master.auth.existingSecret }}
{{- end }}

{{- define "shardcache.master.tokenDir" -}}/etc/shardcache/master-token{{- end }}

{{/* The Secret of the tenants' master tokens (one key per namespace in master.auth.tenants). */}}
{{- define "shardcache.master.tenantsSecretName" -}}
{{- printf "%s-tenants" (include "shardcache.componentName" (dict "ctx" . "component" "master")) }}
{{- end }}

{{- define "shardcache.master.tenantsDir" -}}/etc/shardcache/master-tenants{{- end }}

{{/* The Secret the node daemons sign their reads from each other with (key "secret"): the user's, or the chart's. */}}
{{- define "shardcache.node.peerSecretName" -}}
{{- default (printf "%s-peer-secret" (include "shardcache.componentName" (dict "ctx" . "component" "node"))) .Values.node.cluster.peerSecret.existingSecret }}
{{- end }}

{{- define "shardcache.node.peerSecretDir" -}}/etc/shardcache/peer-secret{{- end }}

{{/* The headless Service FULLNAME-node: every daemon's pod IP is one of its A records (--peers-dns). */}}
{{- define "shardcache.node.peersDNS" -}}
{{- printf "%s.%s.svc.%s" (include "shardcache.componentName" (dict "ctx" . "component" "node")) .Release.Namespace .Values.node.cluster.dnsDomain }}
{{- end }}

{{- define "shardcache.master.url" -}}
{{- printf "http://%s.%s.svc:%d" (include "shardcache.componentName" (dict "ctx" . "component" "master")) .Release.Namespace (int .Values.master.port) }}
{{- end }}

{{/* Cross-field checks the schema cannot express; each fails with what to change. */}}
{{- define "shardcache.validate" -}}
{{- if and .Values.master.enabled (eq .Values.master.state.type "sqlite") (gt (int .Values.master.replicas) 1) }}
{{- fail "master.replicas > 1 needs master.state.type=etcd: SQLite state allows a single master" }}
{{- end }}
{{- if and .Values.master.enabled (eq .Values.master.state.type "etcd") (not .Values.master.state.etcd.endpoints) }}
{{- fail "master.state.etcd.endpoints is required when master.state.type is etcd (e.g. [etcd.db.svc:2379])" }}
{{- end }}
{{- if and .Values.node.enabled (eq .Values.node.origin.type "file") (not .Values.node.origin.file.hostPath) }}
{{- fail "node.origin.file.hostPath is required when node.origin.type is file" }}
{{- end }}
{{- if and .Values.node.enabled (eq .Values.node.auth.mode "sigv4") (ne .Values.node.origin.type "s3") }}
{{- fail "node.auth.mode=sigv4 checks each caller against an S3 origin (its IAM and STS), which a file origin does not have: set node.auth.mode=none (any pod that reaches a daemon then reads every dataset under node.origin.file.hostPath)" }}
{{- end }}
{{- if and .Values.node.enabled .Values.node.tenantQuota (ne .Values.node.auth.mode "sigv4") }}
{{- fail "node.tenantQuota needs node.auth.mode=sigv4: without it the daemon knows no tenants; set node.auth.mode=sigv4 or node.tenantQuota=\"\"" }}
{{- end }}
{{- if and .Values.node.enabled .Values.node.auth.stsEndpoint (or (ne .Values.node.auth.mode "sigv4") (ne .Values.node.auth.identity "sts")) }}
{{- fail "node.auth.stsEndpoint is used only with node.auth.mode=sigv4 and node.auth.identity=sts: set those, or node.auth.stsEndpoint=\"\"" }}
{{- end }}
{{- if and .Values.webhook.enabled (eq .Values.webhook.tls.mode "secret") (not .Values.webhook.tls.secret.caBundle) }}
{{- fail "webhook.tls.secret.caBundle (base64 PEM of the CA that signed the Secret's certificate) is required when webhook.tls.mode is secret" }}
{{- end }}
{{- end }}

{{/* The group of the node daemon's unix sockets (shardcache serve --socket-group): node.socketGroup,
else 8600, the injector's default (sidecar.k8s.inject.SOCKET_GID), which the webhook's sidecars run in. */}}
{{- define "shardcache.node.socketGroup" -}}
{{- $group := .Values.node.socketGroup | default 8600 -}}
{{- if kindIs "float64" $group -}}{{- $group = int64 $group -}}{{- end -}}{{/* YAML numbers: 1e+06 otherwise */}}
{{- if not (regexMatch "^[0-9]{1,10}$" (toString $group)) -}}
{{- fail (printf "node.socketGroup must be a numeric group id such as 8600, not %v" $group) -}}
{{- end -}}
{{- toString $group -}}
{{- end }}
