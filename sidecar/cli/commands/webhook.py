"""``shardcache webhook``: the mutating admission webhook that injects the sidecar."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sidecar.cli.injection import add_injection_flags, injection_config
from sidecar.cli.util import (
    EXIT_UNAVAILABLE,
    RawDefaultsFormatter,
    UserError,
    add_connection_flags,
    add_flag,
    connection_limits,
    parse_size,
)
from wire.errors import InvalidName
from wire.names import parse_listen

__all__ = ["register", "run", "settings_from_args", "webhook_listen"]

EXAMPLES = """\
examples:
  # what the Helm chart runs (TLS files from the chart's Secret)
  shardcache webhook --listen tcp://0.0.0.0:8443 \\
      --tls-cert /etc/shardcache/tls/tls.crt --tls-key /etc/shardcache/tls/tls.key \\
      --failure-policy ignore --sidecar-image ghcr.io/shardcache/shardcache:0.1.0

  # a cluster older than Kubernetes 1.29: inject a regular container
  shardcache webhook --no-native-sidecar --tls-cert tls.crt --tls-key tls.key

  # pods may pick the mirror's images with shardcache.io/sidecar-image; trainers get the master token
  shardcache webhook --allow-sidecar-image 'mirror.local/shardcache:*' \
      --master-token-secret shardcache-master-token --tls-cert tls.crt --tls-key tls.key

Endpoints (HTTPS): POST /mutate (AdmissionReview v1, in --mode), POST /mutate/hostpath and
/mutate/restricted (that mode: the chart points one webhook entry per mode at them, each with a
namespaceSelector on the label shardcache.io/mode), GET /healthz, /readyz, /metrics. A pod's
shardcache.io/mode annotation wins over the path.
Only pods labelled shardcache.io/inject: "true" are injected. --failure-policy says what to answer
for a pod that cannot be injected (bad annotation, conflicting volume or port): ignore admits it
unchanged with a warning kubectl prints, fail refuses it. Set it to the MutatingWebhookConfiguration's
failurePolicy (the Helm chart does). A shardcache.io/sidecar-image annotation naming an image that
--allow-sidecar-image does not allow is ignored: the pod gets --sidecar-image and a warning. TLS files
are re-read when they change (cert-manager renewals). The sidecar gets the AWS credentials of the
pod's first app container that has any, as with 'shardcache inject'; run with reinvocationPolicy
IfNeeded (the chart does) so credentials a later webhook adds to the pod reach the sidecar too.
"""


def webhook_listen(text: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` (``[::]:8443`` for IPv6) → (host, port): TLS over TCP only, since the
    API server calls the webhook through a Service, never a unix socket."""
    try:
        address = parse_listen(text)
    except InvalidName:
        address = None
    if address is None or address.kind != "tcp" or not address.host:
        raise UserError(
            f"invalid --listen {text!r}: use tcp://HOST:PORT with a port between 1 and 65535, e.g. tcp://0.0.0.0:8443"
        )
    return address.host, address.port


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "webhook",
        help="run the Kubernetes admission webhook that injects the sidecar",
        description="Mutating admission webhook (AdmissionReview v1 over TLS) that injects the shardcache sidecar "
        "into pods labelled shardcache.io/inject: \"true\". Same injection as 'shardcache inject'.",
        formatter_class=RawDefaultsFormatter,
        epilog=EXAMPLES,
    )
    add_flag(parser, "--listen", default="tcp://0.0.0.0:8443", metavar="tcp://HOST:PORT", help="HTTPS listen address")
    add_flag(parser, "--tls-cert", default="/etc/shardcache/tls/tls.crt", metavar="FILE", help="PEM certificate (chain)")
    add_flag(parser, "--tls-key", default="/etc/shardcache/tls/tls.key", metavar="FILE", help="PEM private key")
    add_flag(
        parser, "--failure-policy", default="ignore", type=str.lower, choices=["ignore", "fail"],
        help="answer for a pod that cannot be injected: admit unchanged with a warning (ignore) or refuse (fail)",
    )
    add_flag(parser, "--max-request-size", default="8MiB", metavar="SIZE", help="largest AdmissionReview accepted (413 beyond)")
    add_flag(parser, "--tls-reload-interval", default=30.0, type=float, metavar="SECONDS",
             help="how often to check the TLS files for a renewed certificate")
    add_connection_flags(parser, max_connections=256)
    add_injection_flags(parser)
    parser.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> Any:
    from sidecar.k8s.webhook import WebhookSettings

    host, port = webhook_listen(args.listen)
    max_bytes = parse_size(args.max_request_size)
    if not 64 * 1024 <= max_bytes <= 256 * 1024 * 1024:
        raise UserError(f"invalid --max-request-size {args.max_request_size!r}: use between 64KiB and 256MiB")
    if not 0.05 <= float(args.tls_reload_interval) <= 3600:
        raise UserError("invalid --tls-reload-interval: use between 0.05 and 3600 seconds")
    return WebhookSettings(
        host=host,
        port=port,
        tls_cert=Path(args.tls_cert),
        tls_key=Path(args.tls_key),
        failure_policy=args.failure_policy,
        max_request_bytes=max_bytes,
        tls_reload_interval=float(args.tls_reload_interval),
        inject=injection_config(args),
        connections=connection_limits(args),
    )


def run(args: argparse.Namespace) -> int:
    from sidecar.k8s.webhook import WebhookError
    from sidecar.k8s.webhook import run as serve

    settings = settings_from_args(args)
    try:
        serve(settings)
    except WebhookError as exc:
        raise UserError(str(exc)) from exc
    except OSError as exc:  # the port is taken, or the address is not ours
        raise UserError(f"cannot listen on {args.listen}: {exc.strerror or exc}", exit_code=EXIT_UNAVAILABLE) from exc
    return 0
