"""The one mapping from (communicator context, source rank, user tag) to a 64-bit UCX tag.

Layout, most significant first::

    | context (20 bits) | source rank in the communicator (20 bits) | tag (24 bits) |

Each communicator id ``cid`` owns four contexts (``cid * 4 + kind``): user
point-to-point, internal collectives, object payload frames, and one spare. User
messages therefore never collide with internal traffic, and communicators never
cross-match.

This module is the only place that knows the field widths and positions; everything
else builds tags with :func:`make_tag` / :func:`with_source`, masks with
:func:`make_mask` (or :data:`FULL_MASK`) and reads them with :func:`split_tag`. The
tag field is the lowest one, so ``make_tag(cid, kind, source, 0) | tag`` equals
``make_tag(cid, kind, source, tag)`` for a checked ``0 <= tag <= TAG_UB``: hot paths
keep such a base and OR the user tag in.
"""

from __future__ import annotations

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "FULL_MASK",
    "KIND_COLL",
    "KIND_FRAMES",
    "KIND_P2P",
    "MAX_CID",
    "MAX_RANKS",
    "TAG_UB",
    "make_mask",
    "make_tag",
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
MAX_CID = (1 << (CTX_BITS - 2)) - 1

KIND_P2P = 0
KIND_COLL = 1
KIND_FRAMES = 2

#: Mask that matches every bit: one exact tag.
FULL_MASK = (1 << 64) - 1

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


def make_mask(source: int, tag: int) -> int:
    """Mask for a receive; ``ANY_SOURCE``/``ANY_TAG`` leave their field unmatched."""
    mask = _CTX_MASK
    if source != ANY_SOURCE:
        mask |= _SRC_MASK
    if tag != ANY_TAG:
        mask |= _TAG_MASK
    return mask


def split_tag(value: int) -> tuple[int, int]:
    """``(source, tag)`` of a received UCX tag."""
    return (value & _SRC_MASK) >> _SRC_SHIFT, value & _TAG_MASK
