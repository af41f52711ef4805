"""The ucxcomm exception hierarchy (DESIGN.md section 4)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "AuthenticationError",
    "BootstrapError",
    "ClosedError",
    "CollectiveError",
    "CollectiveMismatch",
    "CommTimeoutError",
    "PeerFailure",
    "ProtocolError",
    "Revoked",
    "TruncationError",
    "UcxCommError",
    "UnsupportedError",
    "WindowError",
    "copy_of",
]


class UcxCommError(Exception):
    """Base class of every error ucxcomm raises on purpose."""


class ClosedError(UcxCommError):
    """The communicator, window or endpoint was closed by *this* process."""


class PeerFailure(UcxCommError):
    """A peer died or its endpoint broke; the operation cannot complete.

    Attributes
    ----------
    peer : int or None
        The rank (or transport-level peer label) that failed, when known.
    operations : tuple of ucxcomm.comm.trace.Op
        What the failure interrupted, from this process's flight recorder: its
        operations in flight on (or failed by) the dead peer, and its collectives in
        flight, when the error was raised (empty where none were recorded).
    """

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.operations: tuple[Any, ...] = ()


class ProtocolError(PeerFailure):
    """The peer sent something our protocol does not allow (a malformed header, a
    batch or signal of another size than announced, a forged remote key, more batches
    than its credits): refused before anything was allocated for it or handed over.

    A :class:`PeerFailure`: code that handles a peer going away handles a misbehaving
    one too. What it says is about the peer, never about this process's input.
    """


def copy_of(exc: PeerFailure) -> PeerFailure:
    """A new exception of ``exc``'s type, message and peer: what is kept to be raised
    by every later call is raised as a copy (an instance raised again and again holds
    every frame it passed through, and what they reference)."""
    return type(exc)(str(exc), peer=exc.peer)


class Revoked(UcxCommError):
    """The communicator was revoked (``Comm.revoke``, by this or any other member): its
    pending and later operations raise this; ``agree``, ``shrink`` and ``close`` still
    work on it (docs/elastic.md)."""


class CommTimeoutError(UcxCommError, TimeoutError):
    """An operation given ``timeout=`` did not complete in time."""


class CollectiveError(UcxCommError):
    """An object collective failed on another rank (its op raised, its object did not
    pickle or did not unpickle there): raised on every rank whose result depended on
    that part, instead of waiting for data that will never come. The rank where it
    failed raises the original exception.

    Attributes
    ----------
    rank : int
        The rank of the communicator where it failed.
    cause : str
        What happened there (``"TypeError: ..."``).
    """

    def __init__(self, message: str, rank: int = -1, cause: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.cause = cause


class CollectiveMismatch(UcxCommError):
    """The ranks of a collective did not make the same call (another collective, count,
    dtype, op or root; per-rank counts that disagree; a buffer collective on one rank
    and an object collective on another): raised on every rank of that collective, with
    the same text everywhere, before anything was written into a receive buffer. The
    communicator stays usable for the next collective the ranks agree on.

    Attributes
    ----------
    calls : dict of int to str
        Each rank's call, as its fingerprint describes it (``"Allreduce(float64[4],
        SUM)"``).
    seq : int
        The collective's sequence number on the communicator.
    """

    def __init__(self, message: str, calls: dict[int, str] | None = None,
                 seq: int = -1) -> None:
        super().__init__(message)
        self.calls = dict(calls or {})
        self.seq = seq

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.calls, self.seq))


class TruncationError(UcxCommError):
    """The incoming message was larger than the receive buffer.

    The message has been consumed. The buffer holds its first ``len(buffer)`` bytes,
    except after an ``Irecv``/``Sendrecv`` posted before the message arrived: UCX
    matched it on arrival and the buffer is left unwritten (MPI leaves the buffer
    undefined on overflow).

    Attributes
    ----------
    nbytes : int
        Size of the message on the wire.
    capacity : int
        Size of the receive buffer.
    """

    def __init__(self, message: str, nbytes: int = 0, capacity: int = 0,
                 status: object = None) -> None:
        super().__init__(message)
        self.nbytes = nbytes
        self.capacity = capacity
        self.status = status


class BootstrapError(UcxCommError):
    """The world cannot be formed (missing variable, unreachable store, bad token)."""


class WindowError(UcxCommError):
    """Out-of-range displacement or wrong dtype/size for a one-sided operation."""


class UnsupportedError(UcxCommError, NotImplementedError):
    """A capability is absent here (for example a GPU buffer without CUDA support)."""


class AuthenticationError(UcxCommError):
    """A rank-less connection (``ucxcomm.transport.listen``/``connect``) failed the
    listener's token check: wrong or missing token on one side. The connection is
    closed on both sides; the listener's handler never saw it."""
