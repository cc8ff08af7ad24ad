"""What the tests share, one module per kind of thing; ``conftest.py`` files hold only fixtures,
and no test imports a conftest or another test module.

- ``processes``: the repository, the interpreter, free ports, real processes started and stopped
- ``waits``: waiting on a condition (never on a fixed sleep), HTTP readiness
- ``threads``: servers on a thread of the test process (so the blocking-call guard sees their loop)
- ``s3``: the moto S3 server and S3 clients
- ``daemons``: the daemon's settings and ``shardcache serve`` processes, alone or peered
- ``masters``: ``shardcache master`` processes, etcd, job specs, trainer threads
- ``proxies``: the fault-injecting S3 proxy and a TCP forwarder
- ``handles``: the app container's side of the daemon's handle socket
- ``cli``: the CLI run plain, piped or under a pty
- ``datasets``, ``shards``, ``client_dataset``, ``compare``: test data and comparisons
- ``k8s``, ``controlplane``, ``tenancy``, ``clusterbed``, ``torchrun``: each area's own machinery
- ``moto_sigv4``, ``trainer_proc``: programs the tests run as processes (``python -m``)

The servers are built on :mod:`bench.servers`, so tests and benchmarks start each one the same way.
"""

__all__: list[str] = []
