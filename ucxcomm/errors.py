"""The ucxcomm exception hierarchy (DESIGN.md section 4)."""

from __future__ import annotations

__all__ = [
    "BootstrapError",
    "ClosedError",
    "CommTimeoutError",
    "PeerFailure",
    "TruncationError",
    "UcxCommError",
    "UnsupportedError",
    "WindowError",
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
    """

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class CommTimeoutError(UcxCommError, TimeoutError):
    """An operation given ``timeout=`` did not complete in time."""


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
