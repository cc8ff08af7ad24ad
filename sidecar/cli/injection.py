"""The injection flags shared by ``shardcache inject`` and ``shardcache webhook``, so that both
commands inject exactly the same way: :func:`add_injection_flags` describes the injected sidecar,
:func:`injection_config` turns the flags' values into the :class:`~sidecar.k8s.inject.InjectConfig`."""

from __future__ import annotations

import argparse
import os

from sidecar.cli.util import UserError, add_flag, env_name, parse_gid
from sidecar.k8s.inject import DEFAULT_IMAGE, MODES, InjectConfig, InjectionError

__all__ = ["add_injection_flags", "injection_config"]


def _bool_default(flag: str, default: bool) -> bool:
    raw = os.environ.get(env_name(flag))
    if raw is None:
        return default
    return raw.strip().lower() in {"1", "true", "yes", "on"}


def add_injection_flags(parser: argparse.ArgumentParser) -> None:
    """Flags that describe the injected sidecar."""
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
    add_flag(parser, "--socket-group", default=str(defaults["socket_group"].default), metavar="GID",
             help="the node daemon's --socket-group: hostpath-mode sidecars run with it as their group "
             "(runAsGroup) to connect to its 0660 sockets; '' for none (a daemon whose sockets are 0666)")
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


def injection_config(args: argparse.Namespace) -> InjectConfig:
    """Build the :class:`~sidecar.k8s.inject.InjectConfig` from parsed flags (UserError if invalid)."""
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
            socket_group=parse_gid(args.socket_group, "--socket-group"),
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
