"""ucxcomm: async MPI-like communication over UCX for host (numpy) and GPU (cupy) buffers.

Importing this package has no side effects: UCX is loaded by :func:`init`.
"""

from . import errors
from .comm import (
    ANY_SOURCE,
    ANY_TAG,
    BAND,
    BOR,
    BXOR,
    IN_PLACE,
    LAND,
    LOR,
    LXOR,
    MAX,
    MAXLOC,
    MIN,
    MINLOC,
    NO_OP,
    PROD,
    REPLACE,
    SUM,
    TAG_UB,
    Comm,
    Op,
    PeerFailed,
    PeerJoined,
    Request,
    Status,
)
from .comm.window import Win
from .errors import (
    AuthenticationError,
    BootstrapError,
    ClosedError,
    CollectiveError,
    CollectiveMismatch,
    CommTimeoutError,
    PeerFailure,
    ProtocolError,
    Revoked,
    TruncationError,
    UcxCommError,
    UnsupportedError,
    WindowError,
)
from .launch.bootstrap import finalize, init

__version__ = "0.1.0"


def __getattr__(name: str):  # PEP 562: `ucxcomm.transport`/`.pipes` without importing eagerly
    if name in ("transport", "pipes"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ucxcomm' has no attribute {name!r}")


__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "BAND",
    "BOR",
    "BXOR",
    "IN_PLACE",
    "LAND",
    "LOR",
    "LXOR",
    "MAX",
    "MAXLOC",
    "MIN",
    "MINLOC",
    "NO_OP",
    "PROD",
    "REPLACE",
    "SUM",
    "TAG_UB",
    "AuthenticationError",
    "BootstrapError",
    "ClosedError",
    "CollectiveError",
    "CollectiveMismatch",
    "Comm",
    "CommTimeoutError",
    "Op",
    "PeerFailed",
    "PeerFailure",
    "PeerJoined",
    "ProtocolError",
    "Request",
    "Revoked",
    "Status",
    "TruncationError",
    "UcxCommError",
    "UnsupportedError",
    "Win",
    "WindowError",
    "__version__",
    "errors",
    "finalize",
    "init",
]
