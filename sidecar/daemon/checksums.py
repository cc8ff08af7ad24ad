"""What the origin vouches for: the checksum a fill is verified against, and how to compute it.

S3 stores a full-object additional checksum with objects uploaded by current SDKs (CRC64NVME,
CRC32C, CRC32, SHA-1 or SHA-256) and answers it as ``x-amz-checksum-<algorithm>`` when a HEAD or
a *non-ranged* GET carries ``x-amz-checksum-mode: ENABLED`` (S3 and MinIO answer none on a
ranged GET), which is why a fill starts with a non-ranged GET. Two kinds are not checkable
against the whole body here:

- a *composite* checksum of a multipart upload (``x-amz-checksum-type: COMPOSITE``, a value
  ending ``-N``): the checksum of the parts' checksums, which needs the part layout;
- an ETag that is not an MD5: a multipart upload's (``"<hex>-N"``), and any object encrypted
  with SSE-KMS or SSE-C (its ETag is 32 hex digits of something else).

Otherwise a single-part object's ETag is the MD5 of its bytes (S3, MinIO, Ceph RGW, moto,
s3rver), verified when :attr:`VerifySettings.etag_md5` is on. A CRC is preferred to MD5 where
both exist: awscrt's CRC64NVME and CRC32C run at 12-18 GB/s on this project's 2-core VM and
ISA-L's CRC32 (python-isal) at 12-19 GB/s, where MD5 runs at 0.86 GB/s (1.2 CPU-s/GB). ``zlib.crc32``
(2.4 GB/s here, 0.42 CPU-s/GB: as much as the rest of a fill) and awscrt's CRC32 (2.7 GB/s) were
measured and not taken. Since December 2024 S3 stores a CRC64NVME for every new object uploaded
without a checksum of its own, so on S3 the fast path is the common one.

An object verified in no way (no checksum, composite, non-MD5 ETag, MD5 verification off, or a
file origin) is cached as *unverified*: its entry, ``/stats`` and the metrics say so.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = [
    "ALGORITHMS",
    "CHECKSUM_HEADERS",
    "OriginChecksum",
    "VerifySettings",
    "Verifier",
    "checksum_headers",
    "key_encrypted",
    "vouched",
]

# In order of preference: the fastest to compute first (see the module docstring).
ALGORITHMS = ("crc64nvme", "crc32c", "crc32", "sha256", "sha1")
_CHECKSUM_PREFIX = "x-amz-checksum-"
CHECKSUM_HEADERS = frozenset(f"{_CHECKSUM_PREFIX}{name}" for name in ALGORITHMS) | {"x-amz-checksum-type"}
"""The answer headers that carry an object's additional checksum (lower case)."""

_DIGEST_BYTES = {"crc64nvme": 8, "crc32c": 4, "crc32": 4, "sha256": 32, "sha1": 20}
_MD5_ETAG = re.compile(r'^"?([0-9a-fA-F]{32})"?$')
_KMS = ("aws:kms", "aws:kms:dsse")


@dataclass(frozen=True)
class VerifySettings:
    etag_md5: bool = True
    """Verify an object that carries no full-object checksum against its ETag, where the ETag is
    an MD5 (single-part, not SSE-KMS/SSE-C). MD5 costs 1.2 CPU-s/GB here; on by default because
    the objects without an additional checksum are those uploaded before SDKs computed one
    (boto3 before 1.36) or by tools that never do, and a fill from a far store moves at most a
    few hundred MB/s per object, below the ~400 MB/s MD5 caps one fill at here (README: Benchmarks, the
    daemon_bench cold tables; Design, "Every cached byte vouched for")."""


@dataclass(frozen=True)
class OriginChecksum:
    """One value the origin vouches for: ``algorithm`` (one of :data:`ALGORITHMS` or ``md5``)
    over the whole object, ``expected`` as the origin sent it (base64, or the ETag's hex)."""

    algorithm: str
    expected: str

    def verifier(self) -> Verifier:
        return Verifier(self)


def checksum_headers(headers: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The additional-checksum headers of an origin's answer, names lower-cased, to be kept with
    the object and answered again to clients that ask (``x-amz-checksum-mode: ENABLED``)."""
    return tuple((name.lower(), value.strip()) for name, value in headers if name.lower() in CHECKSUM_HEADERS)


def key_encrypted(headers: Iterable[tuple[str, str]]) -> bool:
    """Whether an answer's headers say SSE-KMS or SSE-C: then the ETag is no MD5 of the bytes."""
    lower = {name.lower(): value for name, value in headers}
    return (
        lower.get("x-amz-server-side-encryption", "").strip().lower() in _KMS
        or "x-amz-server-side-encryption-customer-algorithm" in lower
    )


def vouched(checksums: Iterable[tuple[str, str]], etag: str, key_encrypted: bool,
            settings: VerifySettings) -> OriginChecksum | None:
    """The full-object checksum to verify a fill against, or ``None`` if the origin vouches for
    nothing checkable. ``checksums`` are :func:`checksum_headers`; ``key_encrypted`` says the
    object is SSE-KMS or SSE-C (:func:`key_encrypted`), whose ETag is no MD5."""
    found = dict(checksums)
    if found.get("x-amz-checksum-type", "FULL_OBJECT").upper() != "COMPOSITE":
        for algorithm in ALGORITHMS:
            value = found.get(f"{_CHECKSUM_PREFIX}{algorithm}")
            if value and "-" not in value and _decodes(value, _DIGEST_BYTES[algorithm]):
                return OriginChecksum(algorithm, value)
    if not settings.etag_md5:
        return None
    match = _MD5_ETAG.match(etag.strip())
    if match is None or key_encrypted:  # multipart ("<hex>-N"), not an S3 ETag, or SSE-KMS/SSE-C
        return None
    return OriginChecksum("md5", match.group(1).lower())


def _decodes(value: str, size: int) -> bool:
    try:
        return len(base64.b64decode(value, validate=True)) == size
    except (binascii.Error, ValueError):
        return False


class Verifier:
    """The running checksum of one fill, fed the object's bytes in order (by the cache writer,
    as its prefix grows) and checked once at the end."""

    def __init__(self, checksum: OriginChecksum) -> None:
        self.checksum = checksum
        self.algorithm = checksum.algorithm
        self._crc = 0
        self._hash = hashlib.new(checksum.algorithm) if checksum.algorithm in ("md5", "sha1", "sha256") else None
        self._crc_of: Callable[[bytes | memoryview, int], int] | None = None
        if checksum.algorithm == "crc32":
            from isal import isal_zlib  # ISA-L's CRC32: see the module docstring

            self._crc_of = isal_zlib.crc32
        elif checksum.algorithm in ("crc32c", "crc64nvme"):
            from awscrt import checksums as crt  # hardware CRC (PCLMUL/ARM CRC): see the module docstring

            self._crc_of = crt.crc32c if checksum.algorithm == "crc32c" else crt.crc64nvme

    def update(self, data: bytes | memoryview) -> None:
        if self._crc_of is not None:
            self._crc = self._crc_of(data, self._crc)
        else:
            assert self._hash is not None
            self._hash.update(data)

    def actual(self) -> str:
        """The computed value, spelled as the origin spells the expected one."""
        if self._hash is not None:
            digest = self._hash.digest()
            return digest.hex() if self.algorithm == "md5" else base64.b64encode(digest).decode()
        return base64.b64encode(self._crc.to_bytes(_DIGEST_BYTES[self.algorithm], "big")).decode()

    def matches(self) -> bool:
        return self.actual() == self.checksum.expected
