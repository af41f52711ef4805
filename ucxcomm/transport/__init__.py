"""UCX as objects: workers, endpoints with raw tags, one-sided memory, the progress
engine and the transport policy; the only package that touches UCX (through its
``_ucx`` module). It knows nothing of ranks, communicators or connections.

The UCX-backed modules load on first use of a name below, so that ``ucxcomm.comm`` can
import the contract (:mod:`ucxcomm.transport.base`) without loading them.

``listen``, ``connect``, ``default_worker`` and the connection types are those of
:mod:`ucxcomm.pipes` (the package above this one), offered here too because the public
contract names them ``ucxcomm.transport.listen``/``connect``: looked up by name on first
use, so this package never imports the one above it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .endpoint import Endpoint
    from .worker import Worker

__all__ = ["Batch", "BufferPool", "Connection", "Endpoint", "Listener", "Signal",
           "StreamReader", "StreamWriter", "Worker", "connect", "default_worker", "listen"]

_HOME = {"Endpoint": ".endpoint", "Worker": ".worker"}
#: The contract's names that live in ucxcomm.pipes.
_PIPES = frozenset(__all__) - set(_HOME)


def __getattr__(name: str) -> Any:  # PEP 562
    if name in _PIPES:
        return getattr(importlib.import_module("ucxcomm.pipes"), name)
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home, __name__), name)
