"""The master's server side (``shardcache master``): the pure lease state machine
(:mod:`.state`), its journal and stores (:mod:`.journal`, :mod:`.store_sqlite`,
:mod:`.store_etcd`), leadership through etcd (:mod:`.election`, :mod:`.etcd`), the service that
ties them (:mod:`.service`) and the HTTP API (:mod:`.app`). Trainer-side code never imports it.
"""

from loader.master.server.app import run_forever
from loader.master.server.settings import MasterSettings

__all__ = ["MasterSettings", "run_forever"]
