"""The mutating admission webhook: AdmissionReview v1 in, JSONPatch out, over TLS.

The Kubernetes API server POSTs an ``AdmissionReview`` to ``/mutate`` for every opted-in pod (the
MutatingWebhookConfiguration's objectSelector sends only pods labelled
``shardcache.io/inject: "true"``); :func:`review` runs the pure :func:`sidecar.k8s.inject.inject` on
the object and answers with the JSONPatch between the two. Nothing here has side effects, so the
configuration declares ``sideEffects: None`` and dry-run requests are answered the same way.

The path says the namespace's injection mode: ``/mutate/hostpath`` and ``/mutate/restricted``
(``/mutate``: ``--mode``), and ``/mutate/pod-security`` for namespaces that enforce Pod Security
``baseline`` or ``restricted``, where hostPath volumes are refused: restricted mode whatever the
pod or the namespace's ``shardcache.io/mode`` asks, with a warning that says why. An
AdmissionReview carries the namespace's name but not its labels, and this webhook calls no API,
so the chart registers one webhook entry per mode, each with a ``namespaceSelector`` on the label
``shardcache.io/mode`` and its own path: that works on every cluster, managed ones included (no
API server flag, no RBAC). A pod's ``shardcache.io/mode``
annotation still wins over its namespace's.

When an object cannot be injected (malformed, conflicting, a bad annotation) the answer follows
``--failure-policy``: ``ignore`` admits the object unchanged with a warning that ``kubectl``
prints; ``fail`` refuses it with the reason. A pod injected other than it asked (its
``shardcache.io/sidecar-image`` is not on the allow-list, so the default image runs) is admitted
with the patch and a warning, under either policy. A request that is not an AdmissionReview at
all gets HTTP 400; the API server then applies the configuration's own failurePolicy.

TLS certificates are reloaded when their files change (cert-manager renews them in place): a new
``SSLContext`` is built off the event loop and handed to new connections from the SNI callback,
so connections in flight keep the old one and nothing is shared between threads mid-handshake.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import json
import logging
import signal
import ssl
import time
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from sidecar.errors import SidecarError
from sidecar.k8s.inject import MODES, InjectConfig, InjectionError, Mode, Outcome, guard_ephemeral_containers, inject
from sidecar.k8s.patch import json_patch
from wire.errors import BodyTooLarge, InvalidBody
from wire.web import ConnectionGuard, ConnectionLimits, GuardedSite, decode_json_object, error_middleware, read_body

__all__ = [
    "WebhookSettings",
    "WebhookError",
    "TLSReloader",
    "build_app",
    "review",
    "run",
    "serve",
]

log = logging.getLogger("shardcache.webhook")

ADMISSION_API = "admission.k8s.io/v1"
FailurePolicy = Literal["ignore", "fail"]
# Kubernetes truncates longer warnings; keep ours whole and readable.
MAX_WARNING_CHARS = 256


class WebhookError(SidecarError):
    """The webhook cannot start (bad flags, unreadable or invalid TLS files)."""


@dataclass(frozen=True)
class WebhookSettings:
    """Everything ``shardcache webhook`` needs, built once from its flags."""

    host: str = "0.0.0.0"
    """Address to listen on."""
    port: int = 8443
    """TCP port to listen on (HTTPS)."""
    tls_cert: Path = Path("/etc/shardcache/tls/tls.crt")
    """PEM certificate (chain) presented to the API server."""
    tls_key: Path = Path("/etc/shardcache/tls/tls.key")
    """PEM private key of ``tls_cert``."""
    failure_policy: FailurePolicy = "ignore"
    """What to answer for an object that cannot be injected: admit it unchanged with a warning
    (ignore) or refuse it (fail). Keep it equal to the configuration's failurePolicy."""
    max_request_bytes: int = 8 * 1024 * 1024
    """Largest AdmissionReview accepted; larger requests get 413 (etcd caps objects at 1.5 MiB)."""
    tls_reload_interval: float = 30.0
    """Seconds between checks of the TLS files for a renewed certificate."""
    inject: InjectConfig = field(default_factory=InjectConfig)
    """How pods are injected."""
    connections: ConnectionLimits = field(default_factory=lambda: ConnectionLimits(max_connections=256))
    """Header-read (and TLS handshake) and idle timeouts and connections at once: only the API
    servers connect, a few each."""


# ----------------------------------------------------------------------------- the pure part


@dataclass(frozen=True)
class Verdict:
    """The answer to one HTTP request: status code, JSON body, and the outcome for metrics."""

    status: int
    body: dict[str, Any]
    kind: str = "unknown"
    result: str = "invalid"


def review(raw: bytes, settings: WebhookSettings, mode: Mode | None = None, *, pod_security: bool = False) -> Verdict:
    """Answer one AdmissionReview request body, injecting in ``mode`` (None: the configuration's)
    unless the pod's annotation says otherwise; ``pod_security``: the namespace enforces Pod
    Security baseline or restricted, so restricted mode whatever is asked
    (:attr:`~sidecar.k8s.inject.InjectConfig.hostpath_forbidden`). Pure: no I/O, never raises."""
    try:
        payload = decode_json_object(raw, what="an AdmissionReview object")
    except InvalidBody as exc:
        return _bad_request(str(exc))
    if payload.get("apiVersion") != ADMISSION_API or payload.get("kind") != "AdmissionReview":
        return _bad_request(
            f"expected apiVersion {ADMISSION_API} kind AdmissionReview, got "
            f"{payload.get('apiVersion')!r} {payload.get('kind')!r}: set admissionReviewVersions: [v1]"
        )
    request = payload.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str) or not request["uid"]:
        return _bad_request("AdmissionReview.request with a uid is required")
    uid = request["uid"]
    kind_info = _dict(request.get("kind"))
    kind = str(kind_info.get("kind") or "unknown")
    operation = request.get("operation")
    obj = request.get("object")

    if operation not in ("CREATE", "UPDATE") or obj is None:
        return _allow(uid, kind, "ignored")
    if operation == "UPDATE" and kind == "Pod" and request.get("subResource") == "ephemeralcontainers":
        return _answer(uid, kind, request, obj, guard_ephemeral_containers, settings.failure_policy)
    if operation == "UPDATE" and (kind == "Pod" or (kind == "Job" and kind_info.get("group") == "batch")):
        # Immutable once created: a pod's containers and volumes, a Job's pod template. A patch
        # would make the API server refuse the update itself (Kueue unsuspending a Job, a label
        # edit); injection happens at CREATE.
        return _allow(uid, kind, "ignored")
    if isinstance(obj, dict):
        # AdmissionReview objects carry their TypeMeta, but fill it from request.kind if absent.
        group = str(kind_info.get("group") or "")
        version = str(kind_info.get("version") or "")
        obj = {"apiVersion": f"{group}/{version}" if group else version, "kind": kind, **obj}
    config = settings.inject if mode is None or mode == settings.inject.mode else replace(settings.inject, mode=mode)
    if pod_security:
        config = replace(config, hostpath_forbidden=True)
    return _answer(uid, kind, request, obj, lambda o: inject(o, config, require_label=True), settings.failure_policy)


def _answer(uid: str, kind: str, request: dict[str, Any], obj: Any, change: Callable[[Any], tuple[Any, Outcome]],
            policy: FailurePolicy) -> Verdict:
    """Run ``change`` (a pure injection) on ``obj`` and answer with the patch, its warnings, or
    the failure policy's answer to an error."""
    try:
        new, outcome = change(obj)
    except InjectionError as exc:
        return _refuse_or_warn(uid, kind, _describe(request), str(exc), policy)
    except RecursionError:
        return _refuse_or_warn(uid, kind, _describe(request), "object is nested too deeply", policy)
    except Exception as exc:  # a bug must not take admission down with it: answer, log, go on
        log.exception("internal error injecting %s", _describe(request))
        return _refuse_or_warn(uid, kind, _describe(request), f"internal error: {exc!r}", policy)
    if outcome.result != "injected":
        return _allow(uid, kind, outcome.result)
    patch = json_patch(obj, new)
    response: dict[str, Any] = {
        "uid": uid,
        "allowed": True,
        "patchType": "JSONPatch",
        "patch": base64.b64encode(json.dumps(patch, separators=(",", ":")).encode()).decode(),
    }
    what = _printable(_describe(request))
    if outcome.warnings:
        # Injected, but not quite as asked (an image that is not allowed): kubectl prints these.
        response["warnings"] = [_warning(f"shardcache: {what}: {_printable(text)}") for text in outcome.warnings]
        for text in outcome.warnings:
            log.warning("%s: %s", what, _printable(text))
    log.info("injected %s (%d patch operations)", what, len(patch))
    return Verdict(200, _envelope(response), kind, "injected")


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _describe(request: dict[str, Any]) -> str:
    kind_info = _dict(request.get("kind"))
    meta = _dict(_dict(request.get("object")).get("metadata"))
    name = request.get("name") or meta.get("name") or (f"{meta.get('generateName')}*" if meta.get("generateName") else "?")
    namespace = request.get("namespace") or meta.get("namespace") or ""
    return f"{str(kind_info.get('kind') or 'object').lower()} {namespace + '/' if namespace else ''}{name}"


def _printable(text: str) -> str:
    """``text`` as one line of printable ASCII: ``kubectl`` prints warnings to a terminal, and the
    object's names reach us before the API server validates them (``generateName``)."""
    return "".join(c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii") for c in text)


def _refuse_or_warn(uid: str, kind: str, what: str, reason: str, policy: FailurePolicy) -> Verdict:
    what, reason = _printable(what), _printable(reason)
    log.warning("cannot inject %s: %s", what, reason)
    if policy == "fail":
        response = {
            "uid": uid,
            "allowed": False,
            "status": {"code": 400, "reason": "BadRequest", "message": f"shardcache: cannot inject {what}: {reason}"},
        }
        return Verdict(200, _envelope(response), kind, "refused")
    warning = _warning(f"shardcache: sidecar not injected into {what}: {reason}")
    return Verdict(200, _envelope({"uid": uid, "allowed": True, "warnings": [warning]}), kind, "error-ignored")


def _warning(text: str) -> str:
    return text if len(text) <= MAX_WARNING_CHARS else text[: MAX_WARNING_CHARS - 3] + "..."


def _allow(uid: str, kind: str, result: str) -> Verdict:
    return Verdict(200, _envelope({"uid": uid, "allowed": True}), kind, result)


def _envelope(response: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": ADMISSION_API, "kind": "AdmissionReview", "response": response}


def _bad_request(message: str) -> Verdict:
    return Verdict(400, {"error": message})


# ----------------------------------------------------------------------------- TLS


def _pair_digest(cert: Path, key: Path) -> bytes:
    # What the pair holds, not when it was written: a Secret resync or a rename of identical bytes
    # touches the files without renewing anything, and must not count as (or cause) a reload.
    # Reads follow symlinks, as a Secret volume's ..data swap needs; two small files per interval.
    return hashlib.sha256(cert.read_bytes() + b"\0" + key.read_bytes()).digest()


def _load_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    for path in (cert, key):
        if not path.is_file():
            raise WebhookError(f"TLS file {path} not found: mount the webhook's TLS Secret or pass --tls-cert/--tls-key")
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise WebhookError(f"cannot load TLS certificate {cert} with key {key}: {exc}") from exc
    return context


class TLSReloader:
    """Serves the newest valid certificate; see the module docstring for how it swaps."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert = cert
        self.key = key
        # Blocking file reads: this runs before the event loop starts.
        self._current = _load_context(cert, key)
        try:
            self._digest = _pair_digest(cert, key)
        except OSError as exc:
            raise WebhookError(f"cannot read TLS files {cert}, {key}: {exc}") from exc
        self.server_context = self._current
        self.server_context.sni_callback = self._pick
        self.reloads = 0

    def _pick(self, sslobj: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        # Called for every handshake, SNI sent or not.
        current = self._current
        if current is not context:
            sslobj.context = current

    async def check(self) -> bool:
        """Reload if the files changed; a half-written or invalid pair keeps the old one."""
        try:
            digest = await asyncio.to_thread(_pair_digest, self.cert, self.key)
        except OSError as exc:
            log.warning("cannot read TLS files (keeping the current certificate): %s", exc)
            return False
        if digest == self._digest:
            return False
        try:
            context = await asyncio.to_thread(_load_context, self.cert, self.key)
            after = await asyncio.to_thread(_pair_digest, self.cert, self.key)
        except (WebhookError, OSError) as exc:
            # cert-manager writes the pair in one Secret update, but we may see it mid-swap: retry.
            log.warning("renewed TLS files not usable yet (keeping the current certificate): %s", exc)
            return False
        if after != digest:
            # The files changed between the digest and the load (a swap in progress): the context
            # may hold a pair the digest does not name, and the next check would reload it again
            # (counted twice; seen in CI). Take it once the files hold still.
            return False
        self._current = context
        self._digest = digest
        self.reloads += 1
        log.info("reloaded TLS certificate from %s", self.cert)
        return True

    async def watch(self, interval: float, on_reload: Callable[[], None] = lambda: None) -> None:
        while True:
            await asyncio.sleep(interval)
            if await self.check():
                on_reload()


# ----------------------------------------------------------------------------- the server


class WebhookMetrics:
    """Prometheus metrics of one webhook app, in its own registry (tests run several apps)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.admissions = Counter(
            "shardcache_webhook_admissions_total",
            "Admission requests answered, by object kind and result",
            ["kind", "result"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "shardcache_webhook_admission_duration_seconds",
            "Time to answer one admission request",
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.tls_reloads = Counter(
            "shardcache_webhook_tls_reloads_total", "TLS certificates reloaded from disk", registry=self.registry
        )


POD_SECURITY_PATH = "/mutate/pod-security"
SETTINGS_KEY = web.AppKey("settings", WebhookSettings)
METRICS_KEY = web.AppKey("metrics", WebhookMetrics)
TLS_KEY = web.AppKey("tls", TLSReloader)


async def _mutate(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS_KEY]
    raw_mode = request.match_info.get("mode")
    mode: Mode | None = next((m for m in MODES if m == raw_mode), None)
    pod_security = request.path == POD_SECURITY_PATH
    metrics = request.app[METRICS_KEY]
    started = time.perf_counter()
    if request.content_type != "application/json":
        return web.json_response({"error": "Content-Type must be application/json"}, status=415)
    body = await read_body(request, settings.max_request_bytes)
    # JSON decoding, injection and encoding of a multi-megabyte object take milliseconds of CPU:
    # keep the loop free for health checks and other reviews.
    verdict = await asyncio.to_thread(functools.partial(review, body, settings, mode, pod_security=pod_security))
    data = await asyncio.to_thread(json.dumps, verdict.body)
    metrics.admissions.labels(verdict.kind, verdict.result).inc()
    metrics.duration.observe(time.perf_counter() - started)
    return web.Response(status=verdict.status, text=data, content_type="application/json")


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app[METRICS_KEY]
    return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _guarded(name: str, coro: Any) -> None:
    """Run a background loop; log a crash instead of losing it silently."""
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("background task %s crashed", name)


async def _tls_watch(app: web.Application) -> AsyncIterator[None]:
    tls = app.get(TLS_KEY)
    task = None
    if tls is not None:
        name = "shardcache-webhook-tls-reload"
        watch = tls.watch(app[SETTINGS_KEY].tls_reload_interval, app[METRICS_KEY].tls_reloads.inc)
        task = asyncio.create_task(_guarded(name, watch), name=name)
    yield
    if task is not None:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task


def _error_answer(request: web.Request, exc: Exception) -> web.Response:
    """The webhook's one error answer, ``{"error": message}`` like its 400s: the API server logs
    it and applies the configuration's failurePolicy."""
    if isinstance(exc, BodyTooLarge):
        return web.json_response({"error": str(exc)}, status=413)
    if isinstance(exc, web.HTTPException):
        return web.json_response({"error": f"{exc.reason}: {request.method} {request.path[:200]}"}, status=exc.status)
    return web.json_response({"error": "internal error in the admission webhook; see its log"}, status=500)


def build_app(settings: WebhookSettings, tls: TLSReloader | None = None) -> web.Application:
    """The webhook's aiohttp application; ``tls`` (if given) is watched for renewed files."""
    errors = error_middleware(_error_answer, known=(BodyTooLarge,), log=log)
    # read_body() bounds /mutate itself; client_max_size stays aiohttp's cap for anything else.
    app = web.Application(client_max_size=settings.max_request_bytes, middlewares=[errors])
    app[SETTINGS_KEY] = settings
    app[METRICS_KEY] = WebhookMetrics()
    if tls is not None:
        app[TLS_KEY] = tls
    app.cleanup_ctx.append(_tls_watch)
    app.router.add_post("/mutate", _mutate)
    # One path per mode (the chart's webhook entries, one per namespaceSelector); another word is a 404.
    app.router.add_post(f"/mutate/{{mode:{'|'.join(MODES)}}}", _mutate)
    # Namespaces that enforce Pod Security baseline or restricted (the chart's entry selects them
    # by their pod-security.kubernetes.io/enforce label): restricted mode, whatever is asked.
    app.router.add_post(POD_SECURITY_PATH, _mutate)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _healthz)
    app.router.add_get("/metrics", _metrics)
    return app


async def serve(settings: WebhookSettings, tls: TLSReloader, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set, then answer the requests in flight (up to 10 s)."""
    app = build_app(settings, tls)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=10,
                           **settings.connections.runner_args())
    await runner.setup()
    try:
        site = GuardedSite(runner, ConnectionGuard(settings.connections, log), host=settings.host,
                           port=settings.port, ssl_context=tls.server_context, reuse_address=True)
        await site.start()
        log.info(
            "admission webhook listening on https://%s:%d/mutate (mode %s; /mutate/hostpath, /mutate/restricted; "
            "failure policy %s, %s sidecar, image %s, other images allowed: %s)",
            settings.host,
            site.port,
            settings.inject.mode,
            settings.failure_policy,
            "native" if settings.inject.native_sidecar else "container",
            settings.inject.image,
            ", ".join(settings.inject.allowed_sidecar_images) or "none",
        )
        await stop.wait()
    finally:
        await runner.cleanup()


def run(settings: WebhookSettings) -> None:
    """Serve until SIGTERM/SIGINT (graceful: requests in flight are answered)."""
    tls = TLSReloader(settings.tls_cert, settings.tls_key)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(settings, tls, stop)

    asyncio.run(main())
