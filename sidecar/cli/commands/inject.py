"""``shardcache inject``: add the shardcache sidecar to Kubernetes manifests, offline.

Also home of the injection flags shared with ``shardcache webhook`` (:func:`add_injection_flags`,
:func:`injection_config`), so both commands inject exactly the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from sidecar.cli.util import EXIT_USAGE, RawDefaultsFormatter, UserError, add_flag, env_name

__all__ = ["register", "run", "add_injection_flags", "injection_config"]

EXAMPLES = """\
examples:
  # inject a Deployment and apply it
  shardcache inject -f deploy.yaml | kubectl apply -f -

  # inject what is running now (a kind: List) and re-apply it
  kubectl get deploy,job -n training -o yaml | shardcache inject -f - | kubectl apply -f -

  # a Kubeflow PyTorchJob, as a regular container for a cluster older than 1.29
  shardcache inject --no-native-sidecar -f pytorchjob.yaml > pytorchjob.injected.yaml

  # honour shardcache.io/sidecar-image annotations naming the mirror's images (others: a warning)
  shardcache inject --allow-sidecar-image 'mirror.local/shardcache:*' -f job.yaml

  # a namespace that enforces Pod Security restricted: no hostPath, the chart's node-local Service
  shardcache inject --mode restricted --restricted-upstream tcp://sc-shardcache-local.shardcache.svc:8600 -f job.yaml

Every pod template in the input is injected (Pod, Deployment, StatefulSet, DaemonSet, ReplicaSet,
Job, CronJob, Kubeflow PyTorchJob/TFJob/MPIJob... replica specs) except those labelled
shardcache.io/inject: "false"; --labelled-only injects only those labelled "true", as the webhook
does. Other documents pass through unchanged. Injecting twice changes nothing. A report of what
was done goes to stderr; with an error nothing is written and the exit status is 2. A pod's
shardcache.io/mode annotation (hostpath or restricted) overrides --mode; a pod that already has
the sidecar keeps the mode it was injected with. An annotation
shardcache.io/sidecar-image naming an image that is neither --sidecar-image nor allowed by
--allow-sidecar-image is ignored (the default image is used) with a warning on stderr.
The sidecar signs its reads with the pod's own AWS credentials: it gets those of the pod's first
app container that has any (AWS_* credential-chain variables but AWS_ENDPOINT_URL, envFrom Secrets,
and read-only the mounts of the IRSA / Pod Identity token and of the credential files), except
names it already sets.
"""


def _bool_default(flag: str, default: bool) -> bool:
    raw = os.environ.get(env_name(flag))
    if raw is None:
        return default
    return raw.strip().lower() in {"1", "true", "yes", "on"}


def add_injection_flags(parser: argparse.ArgumentParser) -> None:
    """Flags that describe the injected sidecar (shared by inject and webhook)."""
    from sidecar.k8s.inject import DEFAULT_IMAGE, MODES, InjectConfig

    defaults = InjectConfig.__dataclass_fields__
    # No SHARDCACHE_MODE: that variable is `shardcache serve --mode`'s (node or sidecar).
    add_flag(parser, "--mode", default=defaults["mode"].default, choices=list(MODES), env=False,
             help="how the sidecar reaches the node daemon: hostpath (the daemon's socket directory, read-only; "
             "short-circuit reads by file handle) or restricted (no hostPath: the node-local Service of "
             "--restricted-upstream, a sidecar that Pod Security 'restricted' admits); a pod's "
             "shardcache.io/mode annotation wins")
    add_flag(parser, "--sidecar-image", default=DEFAULT_IMAGE, metavar="IMAGE", help="sidecar container image")
    add_flag(parser, "--image-pull-policy", default="IfNotPresent", choices=["Always", "IfNotPresent", "Never"], help="sidecar imagePullPolicy")
    parser.add_argument(
        "--native-sidecar",
        action=argparse.BooleanOptionalAction,
        default=_bool_default("--native-sidecar", True),
        help="inject a native sidecar (init container with restartPolicy: Always, Kubernetes >= 1.29) so Jobs "
        "complete; --no-native-sidecar injects a regular container for older clusters "
        f"[env {env_name('--native-sidecar')}]",
    )
    add_flag(parser, "--sidecar-port", default=defaults["port"].default, type=int, metavar="PORT",
             help="port of the sidecar's localhost endpoint (SHARDCACHE_ENDPOINT)")
    add_flag(parser, "--socket-host-dir", default=defaults["socket_host_dir"].default, metavar="DIR",
             help="host directory holding the node daemon's sockets (hostpath mode mounts it read-only into the sidecar)")
    add_flag(parser, "--restricted-upstream", default=defaults["restricted_upstream"].default, metavar="tcp://HOST:PORT",
             help="the node daemon for restricted-mode sidecars: a Service with internalTrafficPolicy Local selecting "
             "the daemons (the chart's RELEASE-shardcache-local)")
    parser.add_argument(
        "--short-circuit",
        action=argparse.BooleanOptionalAction,
        default=_bool_default("--short-circuit", True),
        help="short-circuit reads by file handle in hostpath mode: the sidecar passes the app containers open "
        "descriptors of the cached objects they may read over a pod-local socket (SHARDCACHE_HANDLES); no pod "
        f"mounts the node cache [env {env_name('--short-circuit')}]",
    )
    add_flag(parser, "--pod-cache-size", default=defaults["pod_cache_size"].default, metavar="QUANTITY",
             help="emptyDir size of the standalone cache used when the node has no daemon")
    for flag, attr in (
        ("--sidecar-cpu-request", "cpu_request"),
        ("--sidecar-cpu-limit", "cpu_limit"),
        ("--sidecar-memory-request", "memory_request"),
        ("--sidecar-memory-limit", "memory_limit"),
    ):
        add_flag(parser, flag, default=defaults[attr].default or "", metavar="QUANTITY", help=f"sidecar {attr.replace('_', ' ')} ('' for none)")
    parser.add_argument(
        "--sidecar-env", action="append", default=[], metavar="NAME=VALUE",
        help="environment variable of the sidecar, e.g. AWS_ENDPOINT_URL=http://minio:9000 for its standalone "
        "cache on nodes without a daemon; repeatable",
    )
    add_flag(parser, "--startup-timeout", default=defaults["startup_timeout_seconds"].default, type=int, metavar="SECONDS",
             help="how long app containers wait for the sidecar to be ready")
    add_flag(parser, "--allow-sidecar-image", action="append", default=[], metavar="IMAGE",
             help="an image the shardcache.io/sidecar-image annotation may choose besides --sidecar-image: an exact "
             "reference, or a prefix ending in /* (any image under it), :* (any tag) or @* (any digest); repeatable. "
             "Other annotated images are ignored with a warning (the sidecar mounts the node's socket directory)")
    add_flag(parser, "--master-token-secret", default=defaults["master_token_secret"].default, metavar="NAME",
             help="Secret in the pod's namespace whose key 'token' the app containers get as SHARDCACHE_MASTER_TOKEN "
             "(an optional reference: pods start without it); '' for none. The default is the chart's, for a "
             "release named shardcache")


def injection_config(args: argparse.Namespace) -> Any:
    """Build the :class:`~sidecar.k8s.inject.InjectConfig` from parsed flags (UserError if invalid)."""
    from sidecar.k8s.inject import InjectConfig, InjectionError

    env = []
    for item in args.sidecar_env:
        name, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"invalid --sidecar-env {item!r}: use NAME=VALUE")
        env.append((name, value))
    try:
        return InjectConfig(
            mode=args.mode,
            image=args.sidecar_image,
            image_pull_policy=args.image_pull_policy,
            native_sidecar=bool(args.native_sidecar),
            port=int(args.sidecar_port),
            socket_host_dir=args.socket_host_dir,
            restricted_upstream=args.restricted_upstream,
            short_circuit=bool(args.short_circuit),
            pod_cache_size=args.pod_cache_size,
            cpu_request=args.sidecar_cpu_request or None,
            cpu_limit=args.sidecar_cpu_limit or None,
            memory_request=args.sidecar_memory_request or None,
            memory_limit=args.sidecar_memory_limit or None,
            startup_timeout_seconds=int(args.startup_timeout),
            env=tuple(env),
            allowed_sidecar_images=tuple(args.allow_sidecar_image),
            master_token_secret=args.master_token_secret or None,
        )
    except (InjectionError, ValueError) as exc:
        raise UserError(str(exc)) from exc


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inject",
        help="add the shardcache sidecar to Kubernetes manifests (offline, like linkerd inject)",
        description="Read Kubernetes YAML, write it back to stdout with the shardcache sidecar and "
        "SHARDCACHE_ENDPOINT added to every pod template: in hostpath mode with the daemon's socket directory "
        "(read-only, the sidecar only) and file handles on a pod-local socket (SHARDCACHE_HANDLES), in "
        "restricted mode with no hostPath at all.",
        formatter_class=RawDefaultsFormatter,
        epilog=EXAMPLES,
    )
    parser.add_argument(
        "-f", "--filename", action="append", required=True, metavar="FILE",
        help="YAML or JSON file, directory of them (*.yaml, *.yml, *.json), or - for stdin; repeatable",
    )
    parser.add_argument(
        "--labelled-only", action="store_true",
        help='inject only pod templates labelled shardcache.io/inject: "true" (what the webhook does)',
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no report on stderr (warnings are still printed)")
    add_injection_flags(parser)
    parser.set_defaults(func=run)


def _read_sources(names: list[str]) -> list[tuple[str, str]]:
    sources: list[tuple[str, str]] = []
    for name in names:
        if name == "-":
            sources.append(("<stdin>", sys.stdin.read()))
            continue
        path = Path(name)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in {".yaml", ".yml", ".json"} and p.is_file())
            if not files:
                raise UserError(f"{name}: no *.yaml, *.yml or *.json files in this directory")
        else:
            files = [path]
        for file in files:
            try:
                sources.append((str(file), file.read_text(encoding="utf-8")))
            except FileNotFoundError:
                raise UserError(f"{file}: no such file") from None
            except (OSError, UnicodeDecodeError) as exc:
                raise UserError(f"{file}: cannot read: {exc}") from exc
    return sources


def run(args: argparse.Namespace) -> int:
    from sidecar.k8s.inject import InjectionError, dump_documents, inject_documents, load_documents

    config = injection_config(args)
    docs: list[Any] = []
    outcomes = []
    # All or nothing: read and inject everything before writing, so a pipe into `kubectl apply`
    # never applies half a bundle.
    for source, text in _read_sources(args.filename):
        try:
            loaded = load_documents(text, source)
            injected, done = inject_documents(loaded, config, require_label=args.labelled_only)
        except InjectionError as exc:
            message = str(exc) if str(exc).startswith(source) else f"{source}: {exc}"
            raise UserError(message, exit_code=EXIT_USAGE) from exc
        docs.extend(injected)
        outcomes.extend(done)
    sys.stdout.write(dump_documents(docs))
    sys.stdout.flush()
    # Warnings even with --quiet: the output is not what its author asked for.
    for outcome in outcomes:
        for warning in outcome.warnings:
            print(f"warning: {outcome.kind.lower()}/{outcome.name}: {warning}", file=sys.stderr)
    if not args.quiet:
        for outcome in outcomes:
            print(outcome.describe(), file=sys.stderr)
        if not any(o.result in ("injected", "unchanged") for o in outcomes):
            print("warning: no pod template was injected", file=sys.stderr)
    return 0
