"""MPI semantics over the transport: communicators, requests, ops (never imports UCX)."""

from ..tags import ANY_SOURCE, ANY_TAG, TAG_UB
from . import elastic
from .collectives import IN_PLACE
from .communicator import Comm, World
from .elastic import PeerFailed, PeerJoined
from .ops import (
    BAND,
    BOR,
    BXOR,
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
    Op,
)
from .request import Request, Status

__all__ = ["ANY_SOURCE", "ANY_TAG", "BAND", "BOR", "BXOR", "IN_PLACE", "LAND", "LOR", "LXOR",
           "MAX", "MAXLOC", "MIN", "MINLOC", "NO_OP", "PROD", "REPLACE", "SUM", "TAG_UB", "Comm",
           "Op", "PeerFailed", "PeerJoined", "Request", "Status", "World", "elastic"]
