"""``shardcache inject``: add the shardcache sidecar to Kubernetes manifests, offline (with the
injection flags of :mod:`sidecar.cli.injection`, shared with ``shardcache webhook``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from sidecar.cli.injection import add_injection_flags, injection_config
from sidecar.cli.util import EXIT_USAGE, RawDefaultsFormatter, UserError
from sidecar.k8s.inject import InjectionError, inject_documents

__all__ = ["register", "run"]

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
    # Here, not at the top: PyYAML takes ~20 ms to import, which `shardcache --help` need not pay.
    from sidecar.k8s.yamldocs import dump_documents, load_documents

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
