"""UCX as objects: workers, endpoints, listeners, one-sided memory; the only package
that touches UCX (through its ``_ucx`` module).

The UCX-backed modules load on first use of a name below, so that ``ucxcomm.comm`` can
import the contract (:mod:`ucxcomm.transport.base`) without loading them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .endpoint import Endpoint, Signal
    from .listener import Listener, connect, default_worker, listen
    from .pool import BufferPool
    from .stream import Batch, StreamReader, StreamWriter
    from .worker import Worker

__all__ = ["Batch", "BufferPool", "Endpoint", "Listener", "Signal", "StreamReader",
           "StreamWriter", "Worker", "connect", "default_worker", "listen"]

_HOME = {"Endpoint": ".endpoint", "Signal": ".endpoint", "Listener": ".listener",
         "connect": ".listener", "default_worker": ".listener", "listen": ".listener",
         "Worker": ".worker", "BufferPool": ".pool", "Batch": ".stream",
         "StreamReader": ".stream", "StreamWriter": ".stream"}


def __getattr__(name: str) -> Any:  # PEP 562
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home, __name__), name)
