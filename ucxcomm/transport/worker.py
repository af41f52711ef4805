"""``Worker``: one UCX worker per process, progressed on the asyncio event loop.

Progress model (measured choices, see docs/design.md):

* While operations are pending the progress task spins: ``worker.progress()``, then
  polls every pending operation, yielding to the event loop between rounds. This is
  what keeps small-message latency near ucxx's polling mode.
* After ``spin_us`` microseconds without a completion (or with nothing pending) it
  drains the worker, ``arm()``s it and sleeps on the worker's epoll descriptor through
  ``loop.add_reader``; an idle rank blocked in ``recv`` uses (almost) no CPU.
* Completions are delivered by resolving asyncio futures directly on the loop thread:
  no notifier thread, no cross-thread hop.

Receives that must report the sender and the size (everything the comm layer does) use
a *matched probe*: ``tag_probe(remove=True)`` then ``tag_recv_with_handle`` into a buffer
chosen once the size is known, so a message of unknown size is received exactly once.
Pending probes are polled in posting order, which gives MPI's matching order.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from .._buffers import BufferSpec
from ..errors import ClosedError, PeerFailure, UnsupportedError
from . import _ucx

__all__ = ["Worker"]

log = logging.getLogger(__name__)

FULL_MASK = (1 << 64) - 1

#: Default spin window before sleeping on the epoll descriptor.
DEFAULT_SPIN_US = 200.0
#: Fallback wake-up while sleeping: UCX may not always signal the descriptor
#: (ucxx's BlockingMode guards against the same thing).
IDLE_WAKE_S = 0.05
#: After a peer is declared dead, what already arrived from it is still delivered for
#: this long before its pending operations fail.
PEER_GRACE_S = 0.05


class _Op:
    """One pending transport operation, polled by the progress task."""

    __slots__ = ("alloc", "buf", "done", "future", "length", "mask", "peek", "peers", "req",
                 "sender_tag", "settled", "tag")

    def __init__(self, future: asyncio.Future, peers: frozenset | None) -> None:
        self.future = future
        self.peers = peers
        self.req: Any = None
        self.buf: Any = None  # keeps the memory alive while UCX may touch it
        self.tag = 0
        self.mask = FULL_MASK
        self.alloc: Callable[[int, int], Any] | None = None  # probe ops only
        self.sender_tag = 0
        self.length = 0
        self.done = False
        self.peek = False  # probe ops that only watch (do not consume)
        self.settled: asyncio.Future | None = None

    def mark_settled(self) -> None:
        self.done = True
        if self.settled is not None and not self.settled.done():
            self.settled.set_result(None)


class Worker:
    """A UCX context + worker driven by the running asyncio loop.

    Parameters
    ----------
    config : dict, optional
        UCX options for the context (``{"TLS": "tcp,self"}``); ``UCX_*`` environment
        variables still apply.
    spin_us : float, optional
        How long to spin while operations are pending before sleeping on the epoll
        descriptor (``UCXCOMM_SPIN_US``, default 200).

    Raises
    ------
    RuntimeError
        No running event loop.
    UcxCommError
        UCX could not create the context or worker.
    """

    def __init__(self, config: dict[str, str] | None = None, *,
                 spin_us: float | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._context = _ucx.create_context(config)
        self._worker = _ucx.create_worker(self._context)
        self._fd = self._worker.epoll_file_descriptor
        if spin_us is None:
            spin_us = float(os.environ.get("UCXCOMM_SPIN_US", DEFAULT_SPIN_US))
        self._spin_s = spin_us * 1e-6
        self._reqs: list[_Op] = []  # UCX requests in flight (order irrelevant)
        self._probes: list[_Op] = []  # matched-probe receives, in posting order
        self._graveyard: list[Any] = []  # (request, buffer) of cancelled/abandoned ops
        self._dead: dict[Any, tuple[float, BaseException]] = {}
        self._sleeper: asyncio.Future | None = None
        self._closed = False
        self._task = self._loop.create_task(self._progress_loop(), name="ucxcomm-progress")
        self.endpoints: list[Any] = []

    # ------------------------------------------------------------------ info
    @property
    def address(self) -> bytes:
        """This worker's UCX address (give it to peers so they can connect)."""
        return bytes(self._worker.address)

    @property
    def cuda_support(self) -> bool:
        return bool(self._context.cuda_support)

    @property
    def closed(self) -> bool:
        return self._closed

    def info(self) -> str:
        return str(self._worker.info)

    # ------------------------------------------------------------ endpoints
    def connect(self, address: bytes, peer: Any = None) -> Any:
        """An :class:`Endpoint` to the worker whose address is ``address``.

        UCX peer error handling is deliberately off: it would pin the endpoint to TCP
        and lose shared memory/CMA; dead peers are detected out of band
        (:meth:`fail_peer`).
        """
        from .endpoint import Endpoint

        self._check_open()
        ucx_ep = self._worker.create_endpoint_from_worker_address(
            _ucx.address_from_bytes(address), False)
        ep = Endpoint(self, ucx_ep, peer)
        self.endpoints.append(ep)
        return ep

    # ------------------------------------------------------------ operations
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the worker is closed")

    def _wrap(self, spec: BufferSpec) -> Any:
        if spec.device and not self.cuda_support:
            raise UnsupportedError("a GPU buffer was given but this UCX context has no CUDA "
                                   "support (install ucxcomm[gpu] on a CUDA machine)")
        return _ucx.Array(spec.obj)

    def _dead_error(self, peers: Iterable | None) -> BaseException | None:
        if not self._dead or peers is None:
            return None
        now = time.monotonic()
        for p in peers:
            entry = self._dead.get(p)
            if entry is not None and now >= entry[0]:
                return entry[1]
        return None

    def submit_request(self, req: Any, buf: Any, peers: frozenset | None) -> asyncio.Future | None:
        """Track a UCX request; ``None`` when it already completed (fast path)."""
        if req.completed:
            try:
                req.check_error()
            except Exception as exc:
                raise _ucx.translate_error(exc, _first(peers)) from exc
            return None
        fut = self._loop.create_future()
        op = _Op(fut, peers)
        op.req, op.buf = req, buf
        self._reqs.append(op)
        self._kick()
        return fut

    def tag_send(self, ucx_ep: Any, spec: BufferSpec, tag: int,
                 peers: frozenset | None) -> asyncio.Future | None:
        self._check_open()
        err = self._dead_error(peers)
        if err is not None:
            raise err
        arr = self._wrap(spec)
        req = ucx_ep.tag_send(arr, _ucx.make_tag(tag))
        return self.submit_request(req, (arr, spec.obj), peers)

    def tag_recv(self, spec: BufferSpec, tag: int, mask: int = FULL_MASK,
                 peers: frozenset | None = None) -> asyncio.Future | None:
        """Worker-level receive with a tag mask (no sender/size reported)."""
        self._check_open()
        arr = self._wrap(spec)
        req = self._worker.tag_recv(arr, _ucx.make_tag(tag), _ucx.make_tag_mask(mask))
        return self.submit_request(req, (arr, spec.obj), peers)

    def probe(self, tag: int, mask: int) -> tuple[int, int] | None:
        """Non-destructive probe: ``(sender_tag, nbytes)`` of the first match, or None."""
        self._check_open()
        self._worker.progress()
        res = self._worker.tag_probe(_ucx.make_tag(tag), _ucx.make_tag_mask(mask), False)
        if not res.matched:
            return None
        return res.sender_tag.value, res.length

    def probe_wait(self, tag: int, mask: int, peers: frozenset | None) -> asyncio.Future:
        """Resolve to ``(sender_tag, nbytes)`` once a matching message is there (not consumed)."""
        self._check_open()
        fut = self._loop.create_future()
        op = _Op(fut, peers)
        op.tag, op.mask, op.peek = tag, mask, True
        self._probes.append(op)
        self._kick()
        return fut

    def probe_recv(self, tag: int, mask: int, alloc: Callable[[int, int], BufferSpec],
                   peers: frozenset | None) -> asyncio.Future:
        """Receive the first message matching (tag, mask) into ``alloc(nbytes, sender_tag)``.

        The future resolves to ``(sender_tag, nbytes, spec)``. ``alloc`` runs once the
        message is matched and may raise; the message is then still consumed (into a
        scratch buffer) before the error propagates.
        """
        self._check_open()
        fut = self._loop.create_future()
        op = _Op(fut, peers)
        op.tag, op.mask, op.alloc = tag, mask, alloc
        if not self._probes and self._try_match(op):
            if op.done:
                return fut
            self._reqs.append(op)
        else:
            self._probes.append(op)
        self._kick()
        return fut

    def _try_match(self, op: _Op) -> bool:
        res = self._worker.tag_probe(_ucx.make_tag(op.tag), _ucx.make_tag_mask(op.mask),
                                     not op.peek)
        if not res.matched:
            return False
        if op.peek:
            op.done = True
            if not op.future.done():
                op.future.set_result((res.sender_tag.value, res.length))
            return True
        op.sender_tag, op.length = res.sender_tag.value, res.length
        assert op.alloc is not None
        try:
            spec = op.alloc(op.length, op.sender_tag)
            arr = self._wrap(spec)
        except BaseException as exc:  # consume the message, then report
            scratch = bytearray(op.length)
            arr, spec = _ucx.Array(scratch), None
            if not op.future.done():
                op.future.set_exception(exc)
            op.done = True
            req = self._worker.tag_recv_with_handle(arr, res)
            self._graveyard.append((req, scratch))
            return True
        op.req = self._worker.tag_recv_with_handle(arr, res)
        op.buf = (arr, spec)
        if op.req.completed:
            self._finish(op)
        return True

    def _finish(self, op: _Op) -> None:
        op.mark_settled()
        req, op.req = op.req, None
        fut = op.future
        try:
            req.check_error()
        except Exception as exc:
            if not fut.done():
                fut.set_exception(_ucx.translate_error(exc, _first(op.peers)))
            return
        if fut.done():
            return
        if op.alloc is not None:
            fut.set_result((op.sender_tag, op.length, op.buf[1]))
        else:
            fut.set_result(None)

    def cancel(self, fut: asyncio.Future) -> bool:
        """Withdraw the receive behind ``fut`` if it has not matched a message yet.

        Returns True when nothing was (or will be) received for it. An operation that
        already matched (or any send) keeps running in the background so that the
        message moves whole; await :meth:`settle` to know when UCX no longer touches
        its buffer.
        """
        for i, op in enumerate(self._probes):
            if op.future is fut:
                del self._probes[i]
                op.done = True
                if not fut.done():
                    fut.cancel()
                return True
        return False

    async def settle(self, fut: asyncio.Future) -> None:
        """Return once the UCX request behind ``fut`` has finished (ok, failed or not)."""
        for op in self._reqs:
            if op.future is fut:
                if op.settled is None:
                    op.settled = self._loop.create_future()
                await asyncio.shield(op.settled)
                return

    # ----------------------------------------------------------- peer failure
    def fail_peer(self, peer: Any, exc: PeerFailure | None = None) -> None:
        """Declare ``peer`` dead: its pending operations fail with PeerFailure.

        What it sent before dying is still delivered for a short grace period.
        """
        if peer in self._dead:
            return
        if exc is None:
            exc = PeerFailure(f"peer {peer} failed", peer=peer)
        self._dead[peer] = (time.monotonic() + PEER_GRACE_S, exc)
        self._loop.call_later(PEER_GRACE_S * 1.5, self._kick)
        self._kick()

    def is_dead(self, peer: Any) -> bool:
        return peer in self._dead

    # ------------------------------------------------------------- progress
    def _kick(self) -> None:
        s = self._sleeper
        if s is not None and not s.done():
            s.set_result(None)

    def _poll(self) -> int:
        """Poll every pending operation once; returns how many finished."""
        finished = 0
        if self._reqs:
            keep = []
            for op in self._reqs:
                req = op.req
                if req is not None and req.completed:
                    self._finish(op)
                    finished += 1
                elif self._dead and (err := self._dead_error(op.peers)) is not None:
                    self._abandon(op, err)
                    finished += 1
                else:
                    keep.append(op)
            self._reqs = keep
        if self._probes:
            keep = []
            for op in self._probes:
                if op.future.done():  # cancelled by its awaiter
                    finished += 1
                elif self._try_match(op):
                    finished += 1
                    if not op.done:
                        self._reqs.append(op)
                elif self._dead and (err := self._dead_error(op.peers)) is not None:
                    op.done = True
                    op.future.set_exception(err)
                    finished += 1
                else:
                    keep.append(op)
            self._probes = keep
        return finished

    def _abandon(self, op: _Op, err: BaseException) -> None:
        op.mark_settled()
        self._graveyard.append((op.req, op.buf))
        op.req = None
        if not op.future.done():
            op.future.set_exception(err)

    async def _progress_loop(self) -> None:
        worker = self._worker
        loop_time = time.perf_counter
        try:
            while not self._closed:
                if not (self._reqs or self._probes):
                    await self._sleep()
                    continue
                deadline = loop_time() + self._spin_s
                while self._reqs or self._probes:
                    worker.progress()
                    if self._poll():
                        deadline = loop_time() + self._spin_s
                    elif loop_time() > deadline:
                        await self._sleep()
                        deadline = loop_time() + self._spin_s
                        continue
                    await asyncio.sleep(0)
                # Let the woken waiters run (and post their next operation) first.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception:  # pragma: no cover - a bug; make it loud
            log.exception("ucxcomm progress loop crashed")
            raise

    async def _sleep(self) -> None:
        worker = self._worker
        while worker.progress_once():
            pass
        if self._poll():
            return
        if not worker.arm():
            return  # events arrived meanwhile: progress again
        loop = self._loop
        fut = loop.create_future()
        self._sleeper = fut
        loop.add_reader(self._fd, _wake, fut)
        handle = loop.call_later(IDLE_WAKE_S, _wake, fut)
        try:
            await fut
        finally:
            self._sleeper = None
            loop.remove_reader(self._fd)
            handle.cancel()

    # ---------------------------------------------------------------- close
    def abort(self) -> None:
        """Stop at once: pending operations fail with ClosedError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._task.cancel()
        err = ClosedError("the worker was closed")
        for op in self._reqs + self._probes:
            op.mark_settled()
            if not op.future.done():
                op.future.set_exception(err)
                # Nobody may be awaiting this future any more: mark it retrieved.
                op.future.exception()
        self._reqs, self._probes = [], []
        for ep in self.endpoints:
            ep._closed = True
        try:
            self._worker.cancel_inflight_requests()
        except Exception:  # pragma: no cover
            log.debug("cancel_inflight_requests failed", exc_info=True)

    async def close(self) -> None:
        """Flush what is in flight (briefly), then release. Idempotent."""
        if self._closed:
            return
        deadline = time.monotonic() + 1.0
        while self._reqs and time.monotonic() < deadline:
            self._worker.progress()
            self._poll()
            await asyncio.sleep(0)
        self.abort()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):
            pass


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _first(peers: frozenset | None) -> Any:
    if peers and len(peers) == 1:
        return next(iter(peers))
    return None
