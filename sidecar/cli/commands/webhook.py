"""``shardcache webhook``: the mutating admission webhook that injects the sidecar."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sidecar.cli.util import EXIT_UNAVAILABLE, RawDefaultsFormatter, UserError, add_flag, parse_size
from sidecar.cli.commands.inject import add_injection_flags, injection_config

__all__ = ["register", "run", "settings_from_args", "parse_listen"]

EXAMPLES = """\
examples:
  # what the Helm chart runs (TLS files from the chart's Secret)
  shardcache webhook --listen tcp://0.0.0.0:8443 \\
      --tls-cert /etc/shardcache/tls/tls.crt --tls-key /etc/shardcache/tls/tls.key \\
      --failure-policy ignore --sidecar-image ghcr.io/shardcache/shardcache:0.1.0

  # a cluster older than Kubernetes 1.29: inject a regular container
  shardcache webhook --no-native-sidecar --tls-cert tls.crt --tls-key tls.key

Endpoints (HTTPS): POST /mutate (AdmissionReview v1), GET /healthz, /readyz, /metrics.
Only pods labelled shardcache.io/inject: "true" are injected. --failure-policy says what to answer
for a pod that cannot be injected (bad annotation, conflicting volume or port): ignore admits it
unchanged with a warning kubectl prints, fail refuses it. Set it to the MutatingWebhookConfiguration's
failurePolicy (the Helm chart does). TLS files are re-read when they change (cert-manager renewals).
"""


def parse_listen(text: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` (``[::]:8443`` for IPv6) → (host, port)."""
    raw = text.strip()
    if not raw.startswith("tcp://"):
        raise UserError(f"invalid --listen {text!r}: use tcp://HOST:PORT, e.g. tcp://0.0.0.0:8443")
    hostport = raw[len("tcp://") :]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535 or not host:
        raise UserError(f"invalid --listen {text!r}: use tcp://HOST:PORT with a port between 1 and 65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


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
    add_flag(parser, "--tls-reload-interval", default=30.0, type=float, metavar="SECONDS", help="how often to check the TLS files for a renewed certificate")
    add_injection_flags(parser)
    parser.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> Any:
    from sidecar.k8s.webhook import WebhookSettings

    host, port = parse_listen(args.listen)
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
    )


def run(args: argparse.Namespace) -> int:
    from sidecar.k8s.webhook import WebhookError, run as serve

    settings = settings_from_args(args)
    try:
        serve(settings)
    except WebhookError as exc:
        raise UserError(str(exc)) from exc
    except OSError as exc:  # the port is taken, or the address is not ours
        raise UserError(f"cannot listen on {args.listen}: {exc.strerror or exc}", exit_code=EXIT_UNAVAILABLE) from exc
    return 0
