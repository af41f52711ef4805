"""``ucxcomm status --store HOST:PORT``: a job's flight records through its bootstrap store.

Locally, ``ucxcomm status`` reads the ranks' recorders from shared memory
(:mod:`ucxcomm.comm.trace`). For a job on other hosts, each rank answers through the
store it formed its world with: a daemon thread (:func:`serve`, started once the world
is formed) holds its own authenticated store connection and waits for requests; a
request is generation ``n`` of the counter ``status/gen``, announced by setting
``status/req/<n>``; each rank answers with two copies of its recorder (``status/rank<r>/
<n>``: the reader keeps the records both copies agree on, like the local reader) and
blanks its previous answer, so the store holds one answer per rank. The thread needs no
help from the rank's event loop or main thread (a rank spinning in compiled code, or
blocked in a torch call, releases the interpreter lock), and the store is the job's own:
only holders of its token ask or answer.

:func:`ask` is the client side: it returns a :class:`~ucxcomm.comm.trace.Job` that
``trace.report``/``trace.as_json`` print as they print a local one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import threading
import time
from typing import Any

from ..comm import trace
from .store import StoreClient

__all__ = ["ask", "serve"]

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")


def _answer(world: Any) -> bytes:
    """This rank's recorder, read twice (length-prefixed copies)."""
    rec = world.recorder
    a = rec.snapshot()
    b = rec.snapshot()
    return _LEN.pack(len(a)) + a + b


class _Server:
    def __init__(self, world: Any, host: str, port: int, token: str) -> None:
        self.world, self.host, self.port, self.token = world, host, port, token
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task | None = None
        self.thread = threading.Thread(target=self._main, name="ucxcomm-status",
                                       daemon=True)

    def _main(self) -> None:
        loop = self.loop = asyncio.new_event_loop()
        try:
            self.task = loop.create_task(self._serve())
            loop.run_until_complete(self.task)
        except (asyncio.CancelledError, Exception) as exc:  # (the store went away)
            log.debug("status responder of rank %d ends: %r", self.world.rank, exc)
        finally:
            loop.close()

    async def _serve(self) -> None:
        client = await StoreClient.connect(self.host, self.port, self.token, 30.0)
        rank = self.world.rank
        try:
            if rank == 0:
                await client.set("status/size", str(self.world.size).encode())
            k = await client.add("status/gen", 0) + 1
            prev = None
            while not self.world.closed:
                await client.get(f"status/req/{k}", None)
                # Answer the newest request only (earlier ones were answered or are stale).
                k = max(k, await client.add("status/gen", 0))
                await client.set(f"status/rank{rank}/{k}", _answer(self.world))
                if prev is not None:
                    await client.set(f"status/rank{rank}/{prev}", b"")
                prev, k = k, k + 1
        finally:
            await client.close()

    def stop(self) -> None:
        loop, task = self.loop, self.task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # (its loop already ended)
                loop.call_soon_threadsafe(task.cancel)


def serve(world: Any, host: str, port: int, token: str) -> None:
    """Answer ``ucxcomm status --store`` for ``world``'s rank from a daemon thread,
    until the world closes (``world.status_stop``)."""
    server = _Server(world, host, port, token)
    world.status_stop = server.stop
    server.thread.start()


async def ask(host: str, port: int, token: str, timeout: float = 1.0) -> trace.Job:
    """The job's ranks' flight records, from those that answer within ``timeout``
    seconds (a rank that does not answer is left out of the job)."""
    deadline = time.monotonic() + timeout
    client = await StoreClient.connect(host, port, token, timeout)
    try:
        size = int(await client.get("status/size", timeout))
        n = await client.add("status/gen", 1)
        await client.set(f"status/req/{n}", b"")
        ranks = []
        for r in range(size):
            left = deadline - time.monotonic()
            try:  # (past the deadline: only answers already there)
                data = await client.get(f"status/rank{r}/{n}", max(left, 0.001))
            except Exception:  # (no answer in time: this rank is left out)
                continue
            try:
                (m,) = _LEN.unpack_from(data)
                head, ops = trace.parse(data[4:4 + m], data[4 + m:])
            except (ValueError, struct.error):
                continue
            ranks.append(trace.Rank(head["rank"], head["size"], head["pid"], True, ops,
                                    head["lost"], f"store {host}:{port}, rank {r}"))
        meta = {"store": f"{host}:{port}", "size": size, "answered": len(ranks)}
        return trace.Job(f"store {host}:{port}", meta, ranks)
    finally:
        await client.close()
