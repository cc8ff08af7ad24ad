"""A trainer process for the elastic tests: reads a dynamic ShardLoader until its job finishes and
appends one JSON line per delivered sample to ``out`` with unbuffered appends, so a ``kill -9``
loses nothing that was delivered. The loader's lease log (DEBUG) goes to ``log``.

    python -m tests.support.trainer_proc '{"url": ..., "job": ..., "master": ..., "trainer": ..., ...}'
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

__all__ = ["main"]


def main() -> int:
    cfg = json.loads(sys.argv[1])
    handler = logging.FileHandler(cfg["log"])
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("loader").setLevel(logging.DEBUG)

    from loader import ShardLoader

    loader = ShardLoader(
        cfg["url"], job=cfg["job"], master=cfg["master"], epochs=cfg["epochs"], lease_ttl_s=cfg["ttl"],
        trainer=cfg["trainer"], seed=cfg.get("seed", 0),
    )
    fd = os.open(cfg["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for _ in range(10_000):  # one iteration per epoch; bounded
        for sample in loader:
            shard = sample["__url__"].rsplit("/", 1)[-1]
            os.write(fd, (json.dumps({"e": loader.epoch, "s": shard, "k": sample["__key__"]}) + "\n").encode())
            time.sleep(cfg["delay"])
        if loader.finished:
            break
    os.write(fd, b'{"done": true}\n')
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
