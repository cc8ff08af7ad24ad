"""Many tenants on one node: an S3 endpoint that enforces IAM as AWS does, in its own process
(moto's server patched by ``tests/support/moto_sigv4.py``: stock moto answers presigned requests
with a 500 once it enforces IAM), holding two tenants' buckets, their users, the node daemon's own
user and a role, with IAM enforced from then on; node daemons and per-tenant sidecars on it.

The endpoint cannot be the session's shared ``s3_server``: IAM enforcement (``/moto-api/reset-auth``)
is global to a moto process, and every other test signs with ``testing``/``testing``, which an
enforcing server refuses.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import boto3
from botocore.config import Config

from bench.servers import MotoServer
from tests.support.daemons import DaemonProcess
from tests.support.datasets import make_tar
from tests.support.processes import free_port

__all__ = [
    "ACCOUNT",
    "EMPTY_KEY",
    "NO_CREDENTIALS",
    "ODD_KEY",
    "REGION",
    "SHARD",
    "SHARDS",
    "TENANTS",
    "A",
    "B",
    "Creds",
    "IamS3",
    "LauncherServer",
    "Node",
    "Serve",
    "SigV4MotoServer",
    "add_user",
    "iam_lifted",
    "start_iam_s3",
    "start_launcher",
    "start_serve",
    "tenant_node",
    "tenant_objects",
]

ACCOUNT = "123456789012"  # moto's default account: every ARN below lives in it
REGION = "us-east-1"
TENANTS = {"alice": "tenant-a", "bob": "tenant-b"}
# moto's administrator during setup; refused (InvalidAccessKeyId) once IAM is enforced.
_ADMIN = ("testing", "testing")
SHARDS = 4
# Keys S3 clients get wrong: a 0-byte object, and spaces plus unicode (percent-encoded on the wire).
EMPTY_KEY = "train/empty.bin"
ODD_KEY = "train/a b é.tar"
A, B = "tenant-a", "tenant-b"  # the two tenants' buckets
SHARD = "train/shard-000000.tar"
# A pod without credentials (over tests/conftest.py's test ones).
NO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SESSION_TOKEN": ""}

# (access key id, secret) or (access key id, secret, session token)
Creds = tuple[str, str] | tuple[str, str, str]


def _config() -> Config:
    # s3v4: boto3 presigns SigV2 for a custom endpoint otherwise, which the patched server refuses
    # as AWS does. One attempt: a 403 is the answer under test, not a fault to retry.
    return Config(
        signature_version="s3v4",
        s3={"addressing_style": "path"},
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=5,
        read_timeout=10,
    )


def _client(service: str, endpoint: str, creds: Creds) -> Any:
    token = creds[2] if len(creds) == 3 else None
    return boto3.client(
        service,
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=creds[0],
        aws_secret_access_key=creds[1],
        aws_session_token=token,
        config=_config(),
    )


@dataclass(frozen=True)
class IamS3:
    """The IAM-enforcing endpoint and what was put in it. ``users`` maps alice, bob and node to
    (access key id, secret); ``objects`` maps (bucket, key) to the bytes stored there."""

    EMPTY_KEY: ClassVar[str] = EMPTY_KEY
    ODD_KEY: ClassVar[str] = ODD_KEY

    endpoint: str
    region: str
    account: str
    users: Mapping[str, tuple[str, str]]
    objects: Mapping[tuple[str, str], bytes]
    reader_a_arn: str
    log: Path

    def arn(self, user: str) -> str:
        return f"arn:aws:iam::{self.account}:user/{user}"

    def creds(self, who: str | Creds) -> Creds:
        return self.users[who] if isinstance(who, str) else who

    def env(self, who: str | Creds) -> dict[str, str]:
        """The environment a process needs to act as ``who`` (a user name or credentials) against
        this endpoint, and nothing of this machine's AWS setup: merge it over ``os.environ``."""
        creds = self.creds(who)
        return {
            "AWS_ACCESS_KEY_ID": creds[0],
            "AWS_SECRET_ACCESS_KEY": creds[1],
            # Empty is "none" to botocore; tests/conftest.py exports a session token for every test.
            "AWS_SESSION_TOKEN": creds[2] if len(creds) == 3 else "",
            "AWS_SECURITY_TOKEN": "",
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,  # what the AWS C++ SDK (pyarrow, s3torchconnector) reads
            "AWS_ENDPOINT_URL": self.endpoint,
            # Service-specific endpoints win over AWS_ENDPOINT_URL: pin them too.
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ENDPOINT_URL_STS": self.endpoint,
            "AWS_CONFIG_FILE": "/dev/null",
            "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
            "AWS_EC2_METADATA_DISABLED": "true",  # no 1 s probe of 169.254.169.254 on a miss
        }

    def client(self, who: str | Creds, service: str = "s3") -> Any:
        """A boto3 client acting as ``who``: SigV4 (presigned URLs too), path style, one attempt."""
        return _client(service, self.endpoint, self.creds(who))

    def assume_reader_a(self, session_name: str = "tenancy-test", policy: dict[str, Any] | None = None) -> tuple[str, str, str]:
        """Temporary credentials for role reader-a (tenant-a read-only), by STS AssumeRole as alice;
        ``policy``: a session policy, which narrows the session further (enforced: moto_sigv4.py)."""
        extra = {"Policy": json.dumps(policy)} if policy is not None else {}
        answer = self.client("alice", "sts").assume_role(RoleArn=self.reader_a_arn, RoleSessionName=session_name,
                                                         DurationSeconds=900, **extra)
        c = answer["Credentials"]
        return c["AccessKeyId"], c["SecretAccessKey"], c["SessionToken"]


class SigV4MotoServer(MotoServer):
    """``tests/support/moto_sigv4.py`` (moto's server, patched) as a server process, its log at
    ``log``; IAM is not enforced until told."""

    name = "patched moto server"
    credentials: ClassVar[Mapping[str, str]] = {}

    def __init__(self, log: Path) -> None:
        super().__init__(log.parent, in_memory=False)
        self.log = log

    def module(self) -> str:
        # -m, not the file path: a script would put tests/support/ first on the server's sys.path.
        return "tests.support.moto_sigv4"


@dataclass
class LauncherServer:
    """The patched moto server, running (IAM not enforced until told)."""

    endpoint: str
    proc: subprocess.Popen[bytes]
    log: Path

    def client(self, creds: Creds, service: str = "s3") -> Any:
        return _client(service, self.endpoint, creds)


@contextmanager
def start_launcher(log: Path) -> Iterator[LauncherServer]:
    """Start the patched moto server on a free port, wait until it answers, stop it on exit."""
    with SigV4MotoServer(log) as server:
        assert server.proc is not None
        yield LauncherServer(server.endpoint, server.proc, log)


def _reset_auth(endpoint: str, free_actions: str) -> None:
    """``POST /moto-api/reset-auth``: the next ``free_actions`` requests skip IAM, then IAM is enforced."""
    # Not urllib's default form type: werkzeug would parse the body as a form and moto read b"".
    headers = {"Content-Type": "text/plain"}
    request = urllib.request.Request(endpoint + "/moto-api/reset-auth", data=free_actions.encode(), headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=10) as resp:
        answer = json.loads(resp.read())
    if answer.get("status") != "ok":
        raise RuntimeError(f"moto refused reset-auth {free_actions!r}: {answer}")


@contextmanager
def iam_lifted(iam: IamS3) -> Iterator[Callable[[str], Any]]:
    """IAM not enforced inside, for a test module's own set-up: yields a maker of moto's
    administrator's clients (by service name); enforced again on exit."""
    _reset_auth(iam.endpoint, "inf")
    try:
        yield lambda service: _client(service, iam.endpoint, _ADMIN)
    finally:
        _reset_auth(iam.endpoint, "0")


def _policy(*statements: dict[str, Any]) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": list(statements)})


def _read(bucket: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return (
        {"Effect": "Allow", "Action": "s3:GetObject", "Resource": f"arn:aws:s3:::{bucket}/*"},
        {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}"},
    )


def tenant_objects(bucket: str, index: int) -> dict[str, bytes]:
    """A tenant's objects: small WebDataset shards (3 samples each, distinct per bucket, so a
    cross-tenant mix-up shows), a 0-byte object and a key with spaces and unicode."""
    objects = {f"train/shard-{i:06d}.tar": make_tar(3, 512, seed=index * 100 + i, first=i * 3) for i in range(SHARDS)}
    objects[EMPTY_KEY] = b""
    objects[ODD_KEY] = make_tar(2, 256, seed=index * 100 + 99)
    return objects


def _populate(endpoint: str) -> tuple[dict[str, tuple[str, str]], dict[tuple[str, str], bytes], str]:
    s3 = _client("s3", endpoint, _ADMIN)
    iam = _client("iam", endpoint, _ADMIN)
    objects: dict[tuple[str, str], bytes] = {}
    for index, bucket in enumerate(TENANTS.values()):
        s3.create_bucket(Bucket=bucket)
        for key, data in tenant_objects(bucket, index).items():
            s3.put_object(Bucket=bucket, Key=key, Body=data)
            objects[(bucket, key)] = data

    users: dict[str, tuple[str, str]] = {}
    grants = {name: _policy(*_read(bucket)) for name, bucket in TENANTS.items()}
    grants["node"] = _policy({"Effect": "Allow", "Action": "s3:*", "Resource": "*"})  # the node daemon's own credentials
    for name, document in grants.items():
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName="s3", PolicyDocument=document)
        key = iam.create_access_key(UserName=name)["AccessKey"]
        users[name] = (key["AccessKeyId"], key["SecretAccessKey"])

    # reader-a: tenant-a read-only, assumable by alice only (the trust policy and alice's own grant).
    trust = _policy({"Effect": "Allow", "Action": "sts:AssumeRole", "Principal": {"AWS": f"arn:aws:iam::{ACCOUNT}:user/alice"}})
    role_arn = iam.create_role(RoleName="reader-a", AssumeRolePolicyDocument=trust)["Role"]["Arn"]
    iam.put_role_policy(RoleName="reader-a", PolicyName="s3", PolicyDocument=_policy(*_read("tenant-a")))
    iam.put_user_policy(UserName="alice", PolicyName="assume", PolicyDocument=_policy({"Effect": "Allow", "Action": "sts:AssumeRole", "Resource": role_arn}))
    return users, objects, role_arn


@contextmanager
def start_iam_s3(log: Path) -> Iterator[IamS3]:
    """A fresh patched moto server with the tenants set up, then IAM enforced; stopped on exit.
    For fixtures of any scope (``iam_s3`` below is per module)."""
    with start_launcher(log) as server:
        # Explicitly free during setup, whatever INITIAL_NO_AUTH_ACTION_COUNT the environment holds.
        _reset_auth(server.endpoint, "inf")
        users, objects, role_arn = _populate(server.endpoint)
        _reset_auth(server.endpoint, "0")  # IAM enforced from here on, for every request
        yield IamS3(
            endpoint=server.endpoint,
            region=REGION,
            account=ACCOUNT,
            users=MappingProxyType(users),
            objects=MappingProxyType(objects),
            reader_a_arn=role_arn,
            log=log,
        )


def add_user(iam: IamS3, name: str, *statements: dict[str, Any]) -> tuple[str, str]:
    """A new IAM user ``name`` with ``statements`` as its only policy, on an endpoint that already
    enforces IAM (for a module's own principals: each module gets a fresh endpoint); its key."""
    _reset_auth(iam.endpoint, "inf")  # the administrator is refused while IAM is enforced
    try:
        client = _client("iam", iam.endpoint, _ADMIN)
        client.create_user(UserName=name)
        client.put_user_policy(UserName=name, PolicyName="s3", PolicyDocument=_policy(*statements))
        key = client.create_access_key(UserName=name)["AccessKey"]
    finally:
        _reset_auth(iam.endpoint, "0")
    return key["AccessKeyId"], key["SecretAccessKey"]


class Serve(DaemonProcess):
    """A ``shardcache serve`` process of these tests (a node daemon or a pod's sidecar) with the
    calls they make to it; its cache is ``cache``."""

    def __init__(self, tmp: Path, name: str, args: list[str], env: dict[str, str]) -> None:
        self.cache = tmp / f"cache-{name}"
        super().__init__(["--cache-dir", str(self.cache), "--cache-size", "1GiB", "--min-free", "0", "--retries", "1", *args],
                         tmp / f"{name}.log", env)

    def client(self) -> Any:
        # The client's own credentials do not matter: the sidecar proves with the pod's.
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="x",
                            aws_secret_access_key="x", config=Config(retries={"total_max_attempts": 1},
                                                                     s3={"addressing_style": "path"}))

    def json(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            text = exc.read()
            try:
                return exc.code, json.loads(text)
            except ValueError:
                return exc.code, text.decode()

    def raw(self, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
        request = urllib.request.Request(self.url + path, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return resp.status, resp.read(), resp.headers
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(), exc.headers


def start_serve(tmp: Path, name: str, args: list[str], env: dict[str, str]) -> Serve:
    """``shardcache serve`` named ``name`` (its log and cache in ``tmp``), ready."""
    return Serve(tmp, name, args, env).start()


@dataclass
class Node:
    daemon: Serve
    sock: Path
    sidecars: dict[str, Serve]


def tenant_node(tmp: Path, iam: IamS3, extra: list[str], tenants: dict[str, Any], auth: str = "sigv4") -> Iterator[Node]:
    """A node daemon (``--auth``) on ``iam``'s endpoint with the node's credentials and a sidecar per
    tenant (name -> user, credentials, or None: none at all), stopped when the generator ends."""
    tmp.mkdir(parents=True, exist_ok=True)
    sock = tmp / f"daemon-{free_port()}.sock"
    daemon = start_serve(tmp, "daemon", ["--listen", f"unix://{sock}", "--s3-endpoint", iam.endpoint, "--auth", auth, *extra],
                    iam.env("node"))
    sidecars: dict[str, Serve] = {}
    try:
        for name, who in tenants.items():
            env = iam.env(who) if who is not None else {**iam.env("node"), **NO_CREDENTIALS}
            sidecars[name] = start_serve(tmp, f"sidecar-{name}", ["--mode", "sidecar", "--upstream", f"unix://{sock}",
                                                              "--s3-endpoint", iam.endpoint], env)
        yield Node(daemon, sock, sidecars)
    finally:
        for serve in [*sidecars.values(), daemon]:
            serve.stop()
