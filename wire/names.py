"""Names both sides agree on: buckets, object keys, object URLs, ``file://`` origin paths,
xxh3-128 digests, ids (warm-ups, jobs) and listen/connect addresses.

Everything hostile is refused here, before any origin or file system is touched: NUL and control
characters, ``.``/``..`` path segments (traversal on ``file://`` origins), absolute paths and
over-long names. Every refusal is an :class:`~wire.errors.InvalidName` whose message says what to
write instead; each side words it for its users at its own boundary.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, TypeGuard

from wire.errors import InvalidName

__all__ = [
    "DAEMON_PORT",
    "MAX_GID",
    "ID_PATTERN",
    "ID_RULE",
    "Address",
    "is_id",
    "is_xxh3_128",
    "origin_object_path",
    "parse_connect",
    "parse_listen",
    "parse_object_url",
    "split_origin_path",
    "validate_bucket",
    "validate_id",
    "validate_key",
    "validate_prefix",
    "validate_xxh3_128",
    "warmup_id",
]

# S3's rules, plus underscores and upper case that MinIO/Ceph legacy buckets allow.
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")
_MAX_KEY_BYTES = 1024


def validate_bucket(bucket: str) -> str:
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise InvalidName(f"invalid bucket name {bucket[:80]!r}: use 2-255 letters, digits, '.', '-' or '_'")
    return bucket


def _check_text(text: str, what: str, allow_empty: bool) -> None:
    if not text and not allow_empty:
        raise InvalidName(f"empty {what}")
    if len(text.encode("utf-8", "surrogatepass")) > _MAX_KEY_BYTES:
        raise InvalidName(f"{what} longer than {_MAX_KEY_BYTES} bytes")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text):
        raise InvalidName(f"{what} contains NUL or control characters")
    if "\\" in text:
        raise InvalidName(f"{what} contains a backslash")
    if text.startswith("/"):
        raise InvalidName(f"{what} must not start with '/'")
    if any(part in (".", "..") for part in text.split("/")):
        raise InvalidName(f"{what} contains a '.' or '..' path segment")


def validate_key(key: str) -> str:
    # A key may end with '/': S3 folder markers (the console, s3fs and rclone write them) are
    # objects like any other. On a file:// origin such a key names a directory, which is no
    # object there (404 NoSuchKey at the origin's boundary), not a malformed request.
    _check_text(key, "object key", allow_empty=False)
    return key


def validate_prefix(prefix: str) -> str:
    _check_text(prefix, "prefix", allow_empty=True)
    return prefix


def parse_object_url(url: str, file_root: str | None = None) -> tuple[str, str]:
    """``s3://bucket/key`` (or ``file:///root/bucket/key`` under ``file_root``) → (bucket, key)."""
    if url.startswith("s3://"):
        rest = url[5:]
    elif url.startswith("file://") and file_root is not None:
        split = split_origin_path(url[7:], file_root)
        if split is None:
            raise InvalidName(f"{url!r} is not under this daemon's origin {file_root!r}")
        return validate_bucket(split[0]), split[1]
    else:
        raise InvalidName(f"unsupported object URL {url[:120]!r}: use s3://bucket/key")
    bucket, _, key = rest.partition("/")
    return validate_bucket(bucket), key


# -- file:// origins ------------------------------------------------------------------------------


def split_origin_path(path: str, root: str) -> tuple[str, str] | None:
    """``/root/bucket/rest`` → ``("bucket", "rest")``: under a ``file://`` origin the first path
    component below the root is the bucket and the rest is the key (or prefix).

    None when ``path`` is not under ``root``; the bucket is ``""`` when ``path`` is the root itself
    (each caller words both refusals for its users, and validates the bucket where it must).
    """
    base = root.rstrip("/") + "/"
    if not (path + "/").startswith(base):
        return None
    bucket, _, rest = path[len(base):].partition("/")
    return bucket, rest


def origin_object_path(root: str, bucket: str, key: str) -> str:
    """The file of ``bucket``/``key`` under a ``file://`` origin's ``root`` (both validated, so
    the path cannot leave the bucket's directory by its name; symlinks are the origin's check)."""
    return f"{root.rstrip('/')}/{validate_bucket(bucket)}/{validate_key(key)}"


# -- digests and ids ------------------------------------------------------------------------------

# The manifest's writer emits lower case (xxhash's hexdigest); readers accept either case and
# normalise, since a digest typed or produced by another tool may well be upper case.
_XXH3_128_RE = re.compile(r"[0-9a-fA-F]{32}")

ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
"""Warm-up ids and job names: safe in a URL path segment, a file name and a metric label."""
ID_RULE = "1-128 characters of letters, digits, '.', '_' or '-', starting with a letter or digit"
_ID_RE = re.compile(ID_PATTERN)
_NOT_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def is_xxh3_128(text: object) -> TypeGuard[str]:
    """Whether ``text`` is an xxh3-128 digest: 32 hex digits, either case."""
    return isinstance(text, str) and _XXH3_128_RE.fullmatch(text) is not None


def validate_xxh3_128(text: object, what: str = "xxh3_128") -> str:
    """``text`` as a lower-case xxh3-128 digest, or :class:`InvalidName` naming ``what``."""
    if not is_xxh3_128(text):
        raise InvalidName(f"{what} must be 32 hex digits")
    return text.lower()


def is_id(text: object) -> TypeGuard[str]:
    """Whether ``text`` is a valid id (:data:`ID_PATTERN`); fullmatch, so no trailing newline."""
    return isinstance(text, str) and _ID_RE.fullmatch(text) is not None


def validate_id(text: object, what: str = "id") -> str:
    if not is_id(text):
        raise InvalidName(f"invalid {what} {str(text)[:80]!r}: use {ID_RULE}")
    return text


def warmup_id(objects: Iterable[tuple[str, str, str | None]], name: str = "w") -> str:
    """The id of a warm-up of ``(bucket, key, xxh3_128)`` objects: a hash of what it asks for,
    independent of order, so asking again for the same objects is the same job (re-attach).
    ``name`` is a readable prefix (e.g. the dataset's last path component), cut to id characters.

    The CLI names its jobs with it and the daemon names the jobs that come without an id, so the
    two must compute it alike: this is the one place.
    """
    # xxhash is a hard dependency of both sides; imported here so that importing this module
    # stays stdlib-only (the loader's trainer side imports it).
    import xxhash

    canon = sorted((bucket, key, digest or "") for bucket, key, digest in objects)
    digest = xxhash.xxh3_64_hexdigest(json.dumps(canon, separators=(",", ":")).encode())
    readable = _NOT_ID_CHARS.sub("-", name).strip("-._")[:40] or "w"
    return f"{readable}-{digest}"


# -- addresses ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Address:
    """Where a server listens or a client connects: a unix socket, or a TCP host and port."""

    kind: Literal["unix", "tcp"]
    host: str = ""
    """TCP: a host name or IP literal, without brackets; "" (listeners only) is every interface."""
    port: int = 0
    """TCP: 1-65535; 0 for a unix socket."""
    path: str = ""
    """unix: the socket's absolute path."""
    tls: bool = False
    """``https://`` (clients that speak it)."""
    base: str = ""
    """The URL's path prefix, "" or ``/x`` without a trailing slash (clients that allow one)."""

    @property
    def url(self) -> str:
        """``unix:///path.sock`` or ``http(s)://host:port[/base]``."""
        if self.kind == "unix":
            return "unix://" + self.path
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}{self.base}"


DAEMON_PORT = 8600
MAX_GID = 2**32 - 2
"""The largest group id a socket may be given (``--socket-group``): (gid_t)-1 means "unchanged"
to chown(2)."""
"""The node daemon's TCP port when an address names none."""

_UNIX_HINT = "unix:///path.sock"
_LISTEN_HINT = f"tcp://HOST:PORT (tcp://[::]:PORT for IPv6) or {_UNIX_HINT}"


def _socket_path(rest: str, address: str, what: str) -> str:
    path = urllib.parse.unquote(rest)
    if not path.startswith("/") or "\x00" in path:
        raise InvalidName(f"invalid {what} {address!r}: a unix socket needs an absolute path, {_UNIX_HINT}")
    return path


def _host_port(rest: str, address: str, what: str, hint: str) -> tuple[str, int | None, str]:
    """``host[:port][/path]`` → (host, port or None, path); an IPv6 host is in brackets."""
    bad = InvalidName(f"invalid {what} {address!r}: use {hint}, with a port between 1 and 65535")
    if any(ch in rest for ch in "@?#") or any(ord(ch) <= 0x20 or ord(ch) == 0x7F for ch in rest):
        raise bad
    try:
        parts = urllib.parse.urlsplit("//" + rest)
        port = parts.port
    except ValueError:  # a port that is no number or out of range, an unclosed '['
        raise bad from None
    if port is not None and not 1 <= port <= 65535:
        raise bad
    if port is None and parts.netloc.endswith(":"):
        raise bad
    return parts.hostname or "", port, parts.path


def parse_listen(address: str) -> Address:
    """A server's listen address: ``tcp://HOST:PORT`` (``tcp://:PORT`` or ``tcp://0.0.0.0:PORT``
    for every interface) or ``unix:///path.sock``."""
    text = address.strip()
    if text.startswith("unix://"):
        return Address("unix", path=_socket_path(text[len("unix://"):], address, "listen address"))
    if text.startswith("tcp://"):
        host, port, path = _host_port(text[len("tcp://"):], address, "listen address", _LISTEN_HINT)
        if port is None or path:
            raise InvalidName(f"invalid listen address {address!r}: use {_LISTEN_HINT}")
        return Address("tcp", host, port)
    raise InvalidName(f"invalid listen address {address!r}: use {_LISTEN_HINT}")


def parse_connect(
    address: str, default_port: int | None = None, *, schemes: tuple[str, ...] = ("http", "tcp"), base_path: bool = False
) -> Address:
    """A client's server address: ``unix:///path.sock``, ``SCHEME://host[:port]`` for each of
    ``schemes`` (``http``, ``https``, ``tcp``; ``tcp`` means plain HTTP) or a bare ``host[:port]``.

    A missing port is ``default_port`` (else 443 for https, 80 for http). A path after the host
    is refused unless ``base_path`` (a server behind a path prefix); a trailing slash is ignored.
    """
    text = address.strip()
    hint = " or ".join([*(f"{scheme}://host:port" for scheme in schemes), _UNIX_HINT])
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    if scheme == "unix":
        return Address("unix", path=_socket_path(rest.rstrip("/") or rest, address, "address"))
    if scheme and scheme not in schemes:
        raise InvalidName(f"invalid address {address!r}: use {hint}")
    host, port, path = _host_port(rest, address, "address", hint)
    path = path.rstrip("/")
    if not host or (path and not base_path):
        raise InvalidName(f"invalid address {address!r}: use {hint}")
    tls = scheme == "https"
    if port is None:
        port = default_port or (443 if tls else 80)
    return Address("tcp", host, port, tls=tls, base=path)
