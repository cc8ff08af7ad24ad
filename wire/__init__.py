"""The rules both sides of the wire share: the node daemon and CLI (``sidecar``) and the trainer
side and master (``loader``). Each rule has one module here: object and address naming
(:mod:`.names`), datasets and manifests (:mod:`.dataset`), S3 XML (:mod:`.s3xml`), what an S3
error answer means (:mod:`.s3errors`), retries (:mod:`.retry`), the epoch shuffle
(:mod:`.shuffle`), the small HTTP client (:mod:`.httpclient`) and the aiohttp request plumbing of
the three servers (:mod:`.web`).

It imports nothing of ours, and nothing heavier than the stdlib but in :mod:`.web` (aiohttp),
which only servers import. Importing the package itself loads no submodule.
"""

__all__: list[str] = []
