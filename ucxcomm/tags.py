"""Every 64-bit UCX tag ucxcomm sends: the one owner of both tag spaces.

**Communicators** map (communicator context, source rank, user tag) to a tag, most
significant first::

    | context (20 bits) | source rank in the communicator (20 bits) | tag (24 bits) |

Each communicator id ``cid`` owns four contexts (``cid * 4 + kind``): user
point-to-point, its split rendezvous requests (large messages between ranks of one
host), internal collectives and object payload frames. The last communicator id's
contexts are not any communicator's: ``CTL_CTX`` carries the split rendezvous's
control messages. User
messages therefore never collide with internal traffic, and communicators never
cross-match. Code builds these tags with :func:`make_tag` / :func:`with_source`, masks
with :func:`make_mask` (or :data:`FULL_MASK`) and reads them with :func:`split_tag`. The
tag field is the lowest one, so ``make_tag(cid, kind, source, 0) | tag`` equals
``make_tag(cid, kind, source, tag)`` for a checked ``0 <= tag <= TAG_UB``: hot paths
keep such a base and OR the user tag in.

**Connections** (:mod:`ucxcomm.pipes`) put the receiving side's namespace in the upper 32
bits (:func:`conn_tag`) and their own layout in the lower 32: user tags up to
:data:`CONN_USER_TAG_MAX`, then an object's first message (:data:`CONN_OBJ`) and its
frames, then control messages (signals, region keys, the handshake's check) and the
streams' tags. A worker that carries connections carries nothing else.
"""
from __future__ import annotations

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "FULL_MASK",
    "KIND_COLL",
    "KIND_FRAMES",
    "KIND_P2P",
    "KIND_SPLIT",
    "MAX_CID",
    "MAX_RANKS",
    "SPLIT_BIT",
    "TAG_UB",
    "conn_tag",
    "context_of",
    "make_mask",
    "make_tag",
    "sender_prefixes",
    "split_tag",
    "with_source",
]

ANY_SOURCE = -1
ANY_TAG = -1

TAG_BITS = 24
SRC_BITS = 20
CTX_BITS = 20
TAG_UB = (1 << TAG_BITS) - 1
MAX_RANKS = 1 << SRC_BITS
MAX_CID = (1 << (CTX_BITS - 2)) - 2  # (the last one's contexts carry CTL_CTX)

KIND_P2P = 0
#: A point-to-point message's same-host split rendezvous request (the transport's
#: ``_ucp`` engine): one bit above ``KIND_P2P``, so that a point-to-point receive
#: (:func:`make_mask` with ``kind=KIND_P2P``) matches both.
KIND_SPLIT = 1
KIND_COLL = 2
KIND_FRAMES = 3

#: Mask that matches every bit: one exact tag.
FULL_MASK = (1 << 64) - 1

#: The context of the split rendezvous's control messages between a world's ranks
#: (the engine's; no communicator has it: ``MAX_CID`` stops one short).
CTL_CTX = (1 << CTX_BITS) - 1

_SRC_SHIFT = TAG_BITS
_CTX_SHIFT = TAG_BITS + SRC_BITS
_TAG_MASK = TAG_UB
_SRC_MASK = (MAX_RANKS - 1) << _SRC_SHIFT
_CTX_MASK = ((1 << CTX_BITS) - 1) << _CTX_SHIFT


def make_tag(cid: int, kind: int, source: int, tag: int) -> int:
    """The UCX tag of a message from ``source`` in context ``(cid, kind)`` with ``tag``."""
    return (((cid << 2) | kind) << _CTX_SHIFT) | (source << _SRC_SHIFT) | tag


def with_source(value: int, source: int) -> int:
    """``value`` (a tag made with source 0) with its source field set to ``source``."""
    return value | (source << _SRC_SHIFT)


#: The context bit that tells a point-to-point message from its split rendezvous
#: request (``KIND_SPLIT``); point-to-point receives leave it unmatched.
SPLIT_BIT = 1 << _CTX_SHIFT


def make_mask(source: int, tag: int, kind: int = -1) -> int:
    """Mask for a receive; ``ANY_SOURCE``/``ANY_TAG`` leave their field unmatched, and
    a receive of ``kind=KIND_P2P`` matches split rendezvous requests too."""
    mask = _CTX_MASK & ~SPLIT_BIT if kind == KIND_P2P else _CTX_MASK
    if source != ANY_SOURCE:
        mask |= _SRC_MASK
    if tag != ANY_TAG:
        mask |= _TAG_MASK
    return mask


#: A received tag ``>> SENDER_SHIFT`` names its communicator context and source rank.
SENDER_SHIFT = _SRC_SHIFT


def sender_prefixes(cid: int, source: int) -> list[int]:
    """The values ``tag >> SENDER_SHIFT`` of every tag that ``source`` sends in
    communicator ``cid`` (each context kind): how the transport's counters tell whose
    a received message is."""
    return [(((cid << 2) | kind) << SRC_BITS) | source
            for kind in (KIND_P2P, KIND_SPLIT, KIND_COLL, KIND_FRAMES)]


def context_of(cid: int) -> tuple[int, int]:
    """``(value, mask)``: the bits every tag of communicator ``cid`` holds (all its
    contexts), and the mask that selects them."""
    shift = _CTX_SHIFT + 2
    return cid << shift, ((1 << (CTX_BITS - 2)) - 1) << shift


def cid_of(value: int) -> int:
    """The communicator context of a received UCX tag."""
    return (value & _CTX_MASK) >> (_CTX_SHIFT + 2)


def split_tag(value: int) -> tuple[int, int]:
    """``(source, tag)`` of a received UCX tag."""
    return (value & _SRC_MASK) >> _SRC_SHIFT, value & _TAG_MASK


# ------------------------------------------------------------------- connections
#: Largest user tag on a connection; the low 32 bits from 2**31 up are ucxcomm's own.
CONN_USER_TAG_MAX = (1 << 31) - 1
#: An object's first message; its payload frames follow on ``CONN_OBJ + 1 + seq``.
CONN_OBJ = 1 << 31
#: How many frame sequence numbers a connection cycles through.
CONN_FRAME_SEQS = (1 << 30) - 1
_CONN_CTL = 3 << 30  # control messages (above every object frame tag):
CONN_SIGNAL = _CONN_CTL  # put-with-signal notifications
CONN_REGION = _CONN_CTL + 1  # region keys sent with send_region
CONN_HELLO = _CONN_CTL + 2  # the connection handshake's check of the data path
CONN_STREAM = _CONN_CTL + 16  # + 4 * stream id + message kind (pipes/stream.py)
#: Largest stream id.
CONN_MAX_STREAM = ((1 << 32) - CONN_STREAM) // 4 - 1
#: The bits of a connection tag that name its namespace.
CONN_NS_MASK = 0xFFFFFFFF << 32


def conn_tag(namespace: int, low: int) -> int:
    """The UCX tag of ``low`` (one of the layout's 32-bit values) in ``namespace``."""
    return (namespace << 32) | low
