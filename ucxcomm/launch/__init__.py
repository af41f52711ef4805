"""N processes become one world: launcher env detection, bootstrap store, `ucxcomm run`."""

from .bootstrap import WorldSpec, detect, finalize, init
from .ports import free_port
from .store import StoreClient, StoreServer

__all__ = ["StoreClient", "StoreServer", "WorldSpec", "detect", "finalize", "free_port",
           "init"]
