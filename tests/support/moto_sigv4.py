"""moto's server with SigV4 checked the way AWS checks it once IAM is enforced.

A drop-in for ``python -m moto.server`` (same arguments)::

    python -m tests.support.moto_sigv4 -H 127.0.0.1 -p PORT      # or: python tests/support/moto_sigv4.py ...

then create users and policies and ``POST /moto-api/reset-auth`` with body ``0`` to enforce IAM
(``tests/support/tenancy.py`` does all of it). The patches must run inside the server process:
patching moto in the pytest process does not reach a server started as a subprocess.

What stock moto 5.2.1 gets wrong once it enforces IAM, each fixed below by the patch that names it:

1. ``moto/iam/access_control.py`` ``IAMRequestBase.__init__`` reads ``self._headers["Authorization"]``
   unconditionally. A presigned request (or an anonymous one) has no such header; werkzeug raises
   ``KeyError('HTTP_AUTHORIZATION')`` and the server answers a bare HTML 500, for S3 and STS alike.
   moto has no code at all for the ``X-Amz-Credential``/``X-Amz-Signature`` query parameters.
2. ``moto/moto_server/werkzeug_app.py`` ``DomainDispatcherApplication.infer_service_region_host``
   takes the service from the Authorization header only, so a presigned
   ``GET /?Action=GetCallerIdentity&X-Amz-...`` is dispatched to the default service, S3.
3. ``moto/core/responses.py`` ``BaseResponse.get_access_key`` knows the header (and SigV2's
   ``AWSAccessKeyId``) only: a presigned GetCallerIdentity answers ``arn:aws:sts::123456789012:user/moto``.
4. ``moto/core/authorization.py`` ``ActionAuthenticatorMixin._authenticate_and_authorize_action``
   rebuilds the canonical request from ``self.uri``, werkzeug's URL, whose query is already decoded
   (``%2F`` -> ``/``, ``%20`` -> space). Clients sign the encoded form, so every request with an
   encoded character in its key or query gets 403 SignatureDoesNotMatch: plain boto3
   ``list_objects_v2(Prefix="train/")``, ``get_object(Key="a b.tar")``, every presigned URL.
5. ``IAMRequestBase._create_aws_request`` hashes ``self._body or self._data`` as the payload: with
   no body that is the parsed query dict, so a header-signed ``GET /?Action=...`` (STS) is refused.
6. No date is checked anywhere: a header signature or presigned URL is good forever.
7. ``moto/iam/access_control.py`` ``IAMRequestBase.check_action_permitted`` ignores the session
   policy of AssumeRole's ``Policy``: AWS grants a session what both the role's policies and the
   session policy allow, moto what the role's do.
8. The same check asks nothing of KMS for a read of an SSE-KMS object. AWS asks ``kms:Decrypt`` on
   the object's key of a GET, which returns the bytes, and not of a HEAD, which returns metadata
   (https://docs.aws.amazon.com/AmazonS3/latest/userguide/UsingKMSEncryption.html: "to download an
   object encrypted with an AWS KMS key, the requester needs kms:Decrypt").

The fixes: the canonical request is built from the raw request target (werkzeug's ``RAW_URI``),
its query canonicalized as AWS does (each name and value percent-decoded, re-encoded RFC 3986,
sorted: botocore's own code); presigned requests are verified with botocore's query signers; STS
is routed and identified by ``X-Amz-Credential``; AWS's date rules apply (``_check_signature``);
a request with no SigV4 credential, or an incomplete presigned URL, gets AWS's answer instead of a
500 (``_init``). A presigned non-S3 request is accepted with either payload hash in use by AWS's
own SDKs (``_check_signature``: botocore signs UNSIGNED-PAYLOAD through awscrt).

While IAM is not enforced (moto's default) requests are authorized as before; two things differ:
a presigned non-S3 request reaches its own service instead of S3 (2), and a presigned request is
attributed to its own access key (3), as AWS does.

Not modelled: presigned URLs dated in the future, the session token's own expiry capping a
presigned URL, ``x-amz-*`` headers sent unsigned (S3 refuses them, moto and this patch accept them);
an unsigned GET or HEAD of an existing private object is refused (403) by moto's own ACL check in
``S3Response._key_response``, before IAM, with an empty body where S3 sends AccessDenied.
"""

from __future__ import annotations

import datetime as dt
import inspect
import sys
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import moto
import moto.iam.access_control as ac
from botocore.auth import UNSIGNED_PAYLOAD, S3SigV4QueryAuth, SigV4Auth, SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from moto.core.authorization import ActionAuthenticatorMixin
from moto.core.exceptions import _RESTError
from moto.core.responses import BaseResponse
from moto.moto_server.werkzeug_app import DomainDispatcherApplication
from werkzeug.exceptions import HTTPException

__all__ = ["MAX_EXPIRES", "SKEW", "main"]

# AWS's windows: a header signature is good for +/- 15 min around X-Amz-Date; a presigned S3 URL
# for X-Amz-Expires seconds, at most 7 days; a presigned STS request for 15 min whatever it says.
SKEW = dt.timedelta(minutes=15)
MAX_EXPIRES = 7 * 24 * 3600
# The patches reach into moto internals; they were written against these versions.
TESTED_MOTO = ("5.2",)

# What S3 answers a SigV2 request in a SigV4-only region, and an incomplete presigned URL.
_SIGV2_REFUSED = "The authorization mechanism you have provided is not supported. Please use AWS4-HMAC-SHA256."
_PRESIGN_INCOMPLETE = (
    "Query-string authentication version 4 requires the X-Amz-Algorithm, X-Amz-Credential, X-Amz-Signature, "
    "X-Amz-Date, X-Amz-SignedHeaders, and X-Amz-Expires parameters."
)
_PRESIGN_PARAMS = ("X-Amz-Algorithm", "X-Amz-Credential", "X-Amz-Signature", "X-Amz-Date", "X-Amz-SignedHeaders", "X-Amz-Expires")

F = TypeVar("F", bound=Callable[..., Any])
_ORIGINALS: dict[tuple[type, str], Any] = {}


def _replaces(owner: type, name: str, params: tuple[str, ...]) -> Callable[[F], F]:
    """Install the decorated function as ``owner.name``, keeping moto's own in ``_ORIGINALS``.

    ``params`` are the parameter names of moto's function this patch was written against: when a
    moto release changes them the server refuses to start rather than answer 500s at random."""

    def install(function: F) -> F:
        original = owner.__dict__.get(name)
        found = tuple(inspect.signature(original).parameters) if callable(original) else None
        if found != params:
            raise SystemExit(
                f"tests/support/moto_sigv4.py: moto {moto.__version__} changed {owner.__module__}.{owner.__qualname__}.{name} "
                f"(parameters {found}, the patch expects {params}); review the patch against this moto, "
                f"or install moto {' / '.join(v + '.x' for v in TESTED_MOTO)}"
            )
        _ORIGINALS[(owner, name)] = original
        setattr(owner, name, function)
        return function

    return install


def _original(owner: type, name: str) -> Any:
    return _ORIGINALS[(owner, name)]


# -- error documents ----------------------------------------------------------------------------


class _QueryError(_RESTError):
    """The query protocol's (STS, IAM) XML error document; moto's own errors use the same base."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(code, message)
        self.code = status


class _S3Error(HTTPException):
    """S3's ``<Error>`` document with the status given. moto's S3 errors take their status from the
    error shapes of botocore's service model, which has none for RequestTimeTooSkewed and the like."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__()
        self.code = status
        self.description = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message><RequestId>moto-sigv4</RequestId></Error>"
        )

    def get_headers(self, environ: Any = None, scope: Any = None) -> list[tuple[str, str]]:
        return [("Content-Type", "application/xml")]

    def get_body(self, environ: Any = None, scope: Any = None) -> str:
        return self.description or ""


def _refuse(request: ac.IAMRequestBase, status: int, code: str, message: str) -> Exception:
    # By the request class, not the credential scope: an anonymous request has no scope.
    return (_S3Error if isinstance(request, ac.S3IAMRequest) else _QueryError)(status, code, message)


# -- small parsers ------------------------------------------------------------------------------


def _amz_date(value: str) -> dt.datetime:
    return dt.datetime.strptime(value, "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.UTC)


def _query_pairs(query: str) -> list[tuple[str, str]]:
    """The query's names and values, percent-decoded. Not ``+`` as a space: AWS does not."""
    pairs = []
    for part in query.split("&") if query else []:
        name, _, value = part.partition("=")
        pairs.append((unquote(name), unquote(value)))
    return pairs


def _presigned(request: ac.IAMRequestBase) -> dict[str, str] | None:
    """The X-Amz-* query parameters of a presigned request (set by ``_init``), None otherwise."""
    value: dict[str, str] | None = request.__dict__.get("_sigv4_presigned")
    return value


# -- 4: the raw request target, not werkzeug's decoded URL ----------------------------------------


@_replaces(BaseResponse, "setup_class", ("self", "request", "full_url", "headers", "use_raw_body"))
def _setup_class(self: BaseResponse, request: Any, full_url: str, headers: Any, use_raw_body: bool = False) -> None:
    _original(BaseResponse, "setup_class")(self, request, full_url, headers, use_raw_body)
    environ = getattr(request, "environ", None)
    # RAW_URI: the request target exactly as the client sent it (werkzeug's dev server sets it).
    self.__dict__["_sigv4_raw_uri"] = environ.get("RAW_URI") if environ else None


@_replaces(ActionAuthenticatorMixin, "_authenticate_and_authorize_action", ("self", "iam_request_cls", "resource"))
def _authorize(self: Any, iam_request_cls: type, resource: str = "*") -> None:
    original = _original(ActionAuthenticatorMixin, "_authenticate_and_authorize_action")
    raw = self.__dict__.get("_sigv4_raw_uri")
    if not raw:
        return original(self, iam_request_cls, resource)
    saved, self.uri = self.uri, raw  # moto builds the IAM request's path (and query) from self.uri
    try:
        return original(self, iam_request_cls, resource)
    finally:
        self.uri = saved


# -- 1, 5, 6: query auth, requests without SigV4, GET payloads, dates -----------------------------


@_replaces(ac.IAMRequestBase, "__init__", ("self", "account_id", "method", "path", "data", "body", "headers", "action"))
def _init(
    self: ac.IAMRequestBase,
    account_id: str,
    method: str,
    path: str,
    data: dict[str, str],
    body: bytes,
    headers: dict[str, str],
    action: str,
) -> None:
    query = dict(_query_pairs(urlsplit(path).query))
    self.__dict__["_sigv4_presigned"] = None
    authorization = headers.get("Authorization")
    if authorization is None and "X-Amz-Credential" in query:
        missing = [name for name in _PRESIGN_PARAMS if name not in query]
        if missing:  # AWS's answer; moto would KeyError (500) further on
            raise _refuse(self, 400, "AuthorizationQueryParametersError", _PRESIGN_INCOMPLETE + f" (missing: {', '.join(missing)})")
        self.__dict__["_sigv4_presigned"] = query
        headers = dict(headers.items())  # werkzeug's headers are read-only
        # The rest of moto reads the key, scope and signature from this header.
        headers["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={query['X-Amz-Credential']}, "
            f"SignedHeaders={query.get('X-Amz-SignedHeaders', 'host')}, Signature={query.get('X-Amz-Signature', '')}"
        )
        if "X-Amz-Security-Token" in query:  # temporary credentials: moto looks for the header
            headers["X-Amz-Security-Token"] = query["X-Amz-Security-Token"]
    elif authorization is None:
        if "AWSAccessKeyId" in query:  # a SigV2 presigned URL (boto3's default with a custom endpoint)
            raise _refuse(self, 400, "InvalidRequest", _SIGV2_REFUSED + " (boto3: Config(signature_version='s3v4'))")
        if isinstance(self, ac.S3IAMRequest):  # anonymous: AWS answers 403, moto a KeyError 500
            raise _refuse(self, 403, "AccessDenied", "Access Denied")
        raise _refuse(self, 403, "MissingAuthenticationToken", "Request is missing Authentication Token")
    elif not authorization.startswith("AWS4-HMAC-SHA256 "):  # SigV2 header: moto would IndexError
        raise _refuse(self, 400, "InvalidRequest", _SIGV2_REFUSED)
    _original(ac.IAMRequestBase, "__init__")(self, account_id, method, path, data, body, headers, action)


@_replaces(ac.IAMRequestBase, "_create_aws_request", ("self",))
def _create_aws_request(self: ac.IAMRequestBase) -> AWSRequest:
    parts = urlsplit(self._path)
    pairs = _query_pairs(parts.query)
    presigned = _presigned(self)
    if presigned is not None:
        signed = presigned.get("X-Amz-SignedHeaders", "host").split(";")
        timestamp = presigned["X-Amz-Date"]
        pairs = [(k, v) for k, v in pairs if k != "X-Amz-Signature"]  # the one parameter not signed
    else:
        signed = self._get_string_between("SignedHeaders=", ",", self._headers["Authorization"]).split(";")
        timestamp = self._headers["X-Amz-Date"]
    headers = {k: v for k, v in self._headers.items() if k.lower() in signed}
    # 5: with no body the payload is empty, not the parsed query (a form POST keeps its body).
    data: Any = self._body or (b"" if self._method in ("GET", "HEAD", "DELETE") else self._data)
    # params as a list of pairs: botocore canonicalizes them as AWS does (RFC 3986, sorted by the
    # encoded name, repeated names kept); the path stays raw (S3 signs it as sent).
    request = AWSRequest(method=self._method, url=parts.path, headers=headers, data=data, params=pairs)
    request.context["timestamp"] = timestamp
    return request


@_replaces(ac.IAMRequestBase, "check_signature", ("self",))
def _check_signature(self: ac.IAMRequestBase) -> None:
    """AWS's date rules, then moto's signature check.

    S3: a header signature is good for 15 min either side (403 RequestTimeTooSkewed); a presigned
    URL until X-Amz-Date + X-Amz-Expires (403 AccessDenied "Request has expired"), X-Amz-Expires
    being at most 7 days (400 AuthorizationQueryParametersError). Other services (STS): 403
    SignatureDoesNotMatch "Signature expired" past 15 min, presigned or not (STS ignores
    X-Amz-Expires; aws-iam-authenticator's tokens rely on it)."""
    now = dt.datetime.now(dt.UTC)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    presigned = _presigned(self)
    s3 = isinstance(self, ac.S3IAMRequest)
    if presigned is not None:
        signed_at = _amz_date(presigned["X-Amz-Date"])
        expires = int(presigned.get("X-Amz-Expires", "0"))
        if s3:
            if expires > MAX_EXPIRES:
                raise _refuse(self, 400, "AuthorizationQueryParametersError", "X-Amz-Expires must be less than a week (in seconds) that is 604800")
            if now > signed_at + dt.timedelta(seconds=expires):
                raise _refuse(self, 403, "AccessDenied", "Request has expired")
        elif now > signed_at + SKEW:
            raise _refuse(self, 403, "SignatureDoesNotMatch", f"Signature expired: {presigned['X-Amz-Date']} is now earlier than {stamp} - 15 min.")
    else:
        date = self._headers.get("X-Amz-Date")
        if date and abs(now - _amz_date(date)) > SKEW:
            if s3:
                raise _refuse(self, 403, "RequestTimeTooSkewed", "The difference between the request time and the current time is too large.")
            raise _refuse(self, 403, "SignatureDoesNotMatch", f"Signature expired: {date} is out of {stamp} +/- 15 min.")
    if presigned is not None and not s3:
        # Two payload hashes are in use for presigned non-S3 requests: botocore's Python signer
        # and the Go SDK (aws-iam-authenticator) hash the empty body, the form AWS STS's own
        # error text names (boto/boto3#756); awscrt, which botocore signs with whenever it is
        # installed (as here: a project dependency), signs UNSIGNED-PAYLOAD. Accept either.
        given = presigned.get("X-Amz-Signature", "")
        for unsigned in (False, True):
            self.__dict__["_sigv4_unsigned_payload"] = unsigned
            if self._calculate_signature() == given:
                return
        self._raise_signature_does_not_match()
        return
    _original(ac.IAMRequestBase, "check_signature")(self)


class _UnsignedPayloadQueryAuth(SigV4QueryAuth):
    """A presigned non-S3 request as awscrt signs it (see ``_check_signature``)."""

    def payload(self, request: AWSRequest) -> str:
        return UNSIGNED_PAYLOAD


def _query_signer(cls: type) -> None:
    """1: verify a presigned request with botocore's query signer (UNSIGNED-PAYLOAD for S3, the
    X-Amz-* parameters in the canonical query), a header-signed one as moto does."""

    @_replaces(cls, "_create_auth", ("self", "credentials"))
    def _create_auth(self: ac.IAMRequestBase, credentials: Credentials) -> SigV4Auth:
        presigned = _presigned(self)
        if presigned is None:
            return _original(cls, "_create_auth")(self, credentials)
        if cls is ac.S3IAMRequest:
            signer: type[SigV4QueryAuth] = S3SigV4QueryAuth
        else:
            signer = _UnsignedPayloadQueryAuth if self.__dict__.get("_sigv4_unsigned_payload") else SigV4QueryAuth
        return signer(credentials, self._service, self._region, expires=int(presigned.get("X-Amz-Expires", "0")))


_query_signer(ac.S3IAMRequest)
_query_signer(ac.IAMRequest)


# -- 2: route a presigned non-S3 request by its credential scope ----------------------------------


@_replaces(DomainDispatcherApplication, "infer_service_region_host", ("self", "environ", "path"))
def _infer(self: DomainDispatcherApplication, environ: dict[str, Any], path: str) -> str | None:
    if not environ.get("HTTP_AUTHORIZATION"):
        credential = dict(parse_qsl(environ.get("QUERY_STRING", ""))).get("X-Amz-Credential", "")
        if credential.count("/") == 4:
            _, _, region, service, _ = credential.split("/")
            if service != "s3":  # S3 is the default already, with its own bucket/host rules
                return f"{service}.{region}.amazonaws.com"
    return _original(DomainDispatcherApplication, "infer_service_region_host")(self, environ, path)


# -- 3: the caller of a presigned request ---------------------------------------------------------


@_replaces(BaseResponse, "get_access_key", ("self",))
def _get_access_key(self: BaseResponse) -> str:
    if "Authorization" not in self.headers:
        credential = self.querystring.get("X-Amz-Credential")
        if credential:
            return str(credential[0]).split("/")[0]
    return _original(BaseResponse, "get_access_key")(self)


# -- 7, 8: session policies; kms:Decrypt for the GET of an SSE-KMS object --------------------------


def _permitted(policies: list[Any], action: str, resource: str) -> bool:
    """moto's own evaluation of ``policies``: one allows, none denies."""
    permitted = False
    for policy in policies:
        result = ac.IAMPolicy(policy).is_action_permitted(action, resource)
        if result == ac.PermissionResult.DENIED:
            return False
        permitted = permitted or result == ac.PermissionResult.PERMITTED
    return permitted


def _session_policy(request: ac.IAMRequestBase) -> str | None:
    """The ``Policy`` the caller's AssumeRole passed, if it is an assumed role's with one."""
    key = request._access_key
    if not isinstance(key, ac.AssumedRoleAccessKey):
        return None
    for role in ac.sts_backends[request.account_id][ac.get_partition(request._region)].assumed_roles:
        if role.access_key_id == key._access_key_id:
            return str(role.policy) if role.policy else None
    return None


def _kms_key_read(request: ac.IAMRequestBase, resource: str) -> str | None:
    """The KMS key ARN of the SSE-KMS object that ``request`` GETs (its bytes), else None."""
    if not isinstance(request, ac.S3IAMRequest) or request._method != "GET" or request._action != "s3:GetObject":
        return None
    bucket, _, key = resource.partition(":::")[2].partition("/")
    if not key:
        return None
    from moto.s3.models import s3_backends

    try:
        found = s3_backends[request.account_id][ac.get_partition(request._region)].get_object(bucket, key)
    except Exception:  # no bucket: S3's own answer follows
        return None
    if found is None or found.encryption != "aws:kms" or not found.kms_key_id:
        return None
    key_id = str(found.kms_key_id)
    return key_id if key_id.startswith("arn:") else f"arn:aws:kms:{request._region}:{request.account_id}:key/{key_id}"


@_replaces(ac.IAMRequestBase, "check_action_permitted", ("self", "resource"))
def _check_action_permitted(self: ac.IAMRequestBase, resource: str) -> None:
    _original(ac.IAMRequestBase, "check_action_permitted")(self, resource)
    if self._action == "sts:GetCallerIdentity":  # always allowed, as moto has it
        return
    session = _session_policy(self)
    if session is not None and not _permitted([session], self._action, resource):
        self._raise_access_denied()
    kms_key = _kms_key_read(self, resource)
    if kms_key is not None and not (
        _permitted(self._access_key.collect_policies(), "kms:Decrypt", kms_key)
        and (session is None or _permitted([session], "kms:Decrypt", kms_key))
    ):
        self._raise_access_denied()


def main(argv: list[str]) -> None:
    if not moto.__version__.startswith(TESTED_MOTO):
        print(f"tests/support/moto_sigv4.py: written against moto {TESTED_MOTO}, running {moto.__version__}", file=sys.stderr)
    from moto.server import main as moto_main

    moto_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
