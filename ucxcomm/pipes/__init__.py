"""Rank-less endpoints for programs without a launcher: a listener and the clients that
connect to it (client/server pipelines, services), built on :mod:`ucxcomm.transport`.

``listen(handler, port, *, host, token, insecure)`` and ``connect(host, port, *, token)``
make :class:`Connection` objects: buffers with user tags, objects (``send_obj``), array
streams with backpressure (``stream_writer``/``stream_reader`` and their
:class:`BufferPool`), region keys and put-with-signal. The connection is authenticated
with a shared token (docs/security.md); see docs/pipelines.md.

These names are also offered by :mod:`ucxcomm.transport` (``ucxcomm.transport.listen``,
``connect``...: the public contract predates this package). The UCX-backed modules load
on first use of a name, as in :mod:`ucxcomm.transport`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connection import Connection, Signal
    from .listener import Listener, connect, default_worker, listen
    from .pool import BufferPool
    from .stream import Batch, StreamReader, StreamWriter

__all__ = ["Batch", "BufferPool", "Connection", "Listener", "Signal", "StreamReader",
           "StreamWriter", "connect", "default_worker", "listen"]

#: Where each name lives (loaded on first use).
HOME = {"Connection": ".connection", "Signal": ".connection", "Listener": ".listener",
        "connect": ".listener", "default_worker": ".listener", "listen": ".listener",
        "BufferPool": ".pool", "Batch": ".stream", "StreamReader": ".stream",
        "StreamWriter": ".stream"}


def __getattr__(name: str) -> Any:  # PEP 562
    home = HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home, __name__), name)
