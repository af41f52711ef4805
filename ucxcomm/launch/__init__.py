"""N processes become one world: launcher env detection, bootstrap store, `ucxcomm run`."""

from .bootstrap import WorldSpec, detect, finalize, init
from .store import StoreClient, StoreServer

__all__ = ["StoreClient", "StoreServer", "WorldSpec", "detect", "finalize", "init"]
