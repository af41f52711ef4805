"""Collective fingerprints: every rank of a collective learns every other rank's call.

Each collective call (``UCXCOMM_CHECK_COLLECTIVES``, on by default) sends, as its first
message to every other rank on the call's tag (communicator, collective context, source,
sequence number), a 32-byte fingerprint::

    magic u8 | form u8 | kind u8 | device u8 | op u32 | root i32 | dtype u32 |
    count i64 | own i64

followed, for the collectives whose ranks pass per-rank counts (``Gatherv`` and
``Scatterv`` at the root, ``Allgatherv``, ``Alltoallv``, ``Reduce_scatter``), by those
counts (int64 each). Every rank receives every other rank's first message before it
writes anything into a receive buffer, so every rank holds every call and reaches the
same verdict (:func:`verdict`): either all go on, or all raise
:class:`~ucxcomm.CollectiveMismatch` naming the ranks and their calls; the messages of the
call are all consumed either way, so the communicator stays usable.

Three forms (``form``), chosen from what the fingerprint holds, so ranks that agree on
the call agree on the form:

* **combined**: the small exchanges of host memory (``Allreduce``, ``Bcast``,
  ``Allgather``, ``Alltoall``, ``Reduce_scatter_block`` of at most ``SMALL_MAX`` bytes
  per message, 2 to ``SMALL_MAX_RANKS`` ranks): the fingerprint and the data go in one
  message per pair (``comm/_fast.pyx`` and ``comm/small.py``), received into scratch,
  checked, then copied or folded. ``Bcast``'s non-roots send their fingerprint alone.
* **shm**: the mid-size collectives of host memory that the node's shared-memory engine
  serves (``comm/shm.py``): the fingerprint goes in the call's arrival record in shared
  memory, and no message carries it (a rank on another path is found by a tag probe).
* **general**: everything else: a round of fingerprints (:meth:`Chan.check
  <ucxcomm.comm.algorithms.Chan.check>`) before the algorithm runs.

``device`` (host 0, GPU 1) only explains a form mismatch; it is not compared.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import CollectiveMismatch
from . import ops, trace

__all__ = ["COMBINED", "GENERAL", "HDR", "MAGIC", "SHM", "SMALL_MAX", "capacity", "describe",
           "make", "only_form_differs", "op_code", "verdict"]

#: Bytes of a fingerprint's fixed part.
HDR = 32
#: Largest data part of a combined-form message: the small paths' limit per message
#: (``comm.small.SMALL_MAX``).
SMALL_MAX = 8192
#: Largest communicator with the combined form (``comm.small.SMALL_MAX_RANKS``).
SMALL_MAX_RANKS = 32
MAGIC = 0xC5
GENERAL = 1
COMBINED = 2
SHM = 3
_FP = struct.Struct("<BBBBIiIqq")
assert _FP.size == HDR

#: Kinds whose fingerprint carries per-rank counts, and what they mean.
_VEC_KINDS = frozenset(trace.KIND[k] for k in ("Gatherv", "Scatterv", "Allgatherv",
                                               "Alltoallv", "Reduce_scatter"))
#: The built-in ops' codes: the only ones every rank can name (another rank's own op or
#: callable is shown by its code, so that every rank prints the same text).
_BUILTIN_OPS: dict[int, str] = {}


def capacity(size: int) -> int:
    """Bytes a rank's first message of a collective may take on a communicator of
    ``size`` ranks (any form, any kind: never truncated; beyond ``SMALL_MAX_RANKS``
    every call takes the general form, whose longest fingerprint carries 2 counts per
    rank)."""
    if size > SMALL_MAX_RANKS:
        return HDR + 16 * size
    return HDR + max(SMALL_MAX, 16 * size)


def op_code(op: Any) -> int:
    """A 32-bit code of a reduction: an Op's name, a callable's qualified name; 0: none."""
    if op is None:
        return 0
    name = getattr(op, "name", None)
    if not isinstance(name, str) or not hasattr(op, "pyfunc"):
        mod = getattr(op, "__module__", "") or ""
        name = f"{mod}.{getattr(op, '__qualname__', type(op).__name__)}"
    return zlib.crc32(name.encode()) or 1


for _op in vars(ops).values():  # (every rank can name the built-in ops it never used)
    if isinstance(_op, ops.Op):
        _BUILTIN_OPS[op_code(_op)] = _op.name


def dtype_code(dtype: Any) -> int:
    """A 32-bit code of a dtype: its kind letter and item size (0: objects)."""
    if dtype is None:
        return 0
    dt = np.dtype(dtype)
    return (ord(dt.kind) << 24) | (dt.itemsize & 0xFFFFFF)


def make(kind: str, form: int = GENERAL, op: Any = None, root: int = -1, dtype: Any = None,
         count: int = -1, own: int = -1, vec: Sequence[int] = (), device: int = 0) -> bytes:
    """The fingerprint of this rank's call (``vec``: its per-rank counts, if any)."""
    head = _FP.pack(MAGIC, form, trace.KIND[kind], device, op_code(op), root,
                    dtype_code(dtype), count, own)
    if vec:
        return head + np.asarray(vec, dtype="<i8").tobytes()
    return head


def _unpack(fp: bytes) -> tuple[int, ...] | None:
    if len(fp) < HDR or fp[0] != MAGIC:
        return None
    return _FP.unpack_from(fp)


def _dtype_name(code: int) -> str:
    if code == 0:
        return "object"
    kind, size = chr(code >> 24), code & 0xFFFFFF
    if kind not in "biufcmMOSUV" or not 0 < size <= 1 << 16:
        return f"dtype code {code:#010x}"  # (a peer's bytes: never parsed as a dtype)
    try:
        return np.dtype(f"{kind}{size}").name
    except Exception:
        return f"{kind}{size}"


def describe(fp: bytes, size: int = 0) -> str:
    """``Allreduce(float64[4], SUM)``, ``Bcast(int32[8], root=0)``, ``barrier()``..."""
    f = _unpack(fp)
    if f is None:
        return "a message that is not a collective's fingerprint"
    kind, device, op, root, dt, count = f[2], f[3], f[4], f[5], f[6], f[7]
    name = trace.KINDS[kind] if kind < len(trace.KINDS) else f"kind {kind}"
    args = []
    if name != "barrier":
        shape = f"[{count}]" if count >= 0 else ""
        if dt or name[0].isupper():
            args.append(f"{_dtype_name(dt)}{shape}")
    if kind in _VEC_KINDS and len(fp) >= HDR + 8:
        args.append(f"counts={_vec(fp)}")
    if op:
        args.append(_BUILTIN_OPS.get(op, f"op {op:#010x}"))
    if kind in trace.ROOTED and root >= 0:
        args.append(f"root={root}")
    if device:
        args.append("GPU memory")
    return f"{name}({', '.join(args)})"


def _common(f: tuple[int, ...]) -> tuple[int, ...]:
    """What every rank's call must share: form, kind, op, root, dtype, count."""
    return (f[1], f[2], f[4], f[5], f[6], f[7])


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def verdict(fps: Sequence[bytes], what: str, seq: int) -> CollectiveMismatch | None:
    """None when the calls whose fingerprints ``fps`` are (one per rank, in rank order)
    match, else the error every rank raises (the same on every rank: each holds every
    fingerprint)."""
    parsed = [_unpack(fp) for fp in fps]
    size = len(fps)
    calls = {q: describe(fp) for q, fp in enumerate(fps)}
    bad = [q for q, f in enumerate(parsed) if f is None]
    if bad:
        return CollectiveMismatch(
            f"collective #{seq}: {_ranks(bad)} sent a message that is not a "
            "collective fingerprint (is UCXCOMM_CHECK_COLLECTIVES the same on every rank?)",
            calls=calls, seq=seq)
    groups: dict[tuple[int, ...], list[int]] = {}
    for q, f in enumerate(parsed):
        assert f is not None
        groups.setdefault(_common(f), []).append(q)
    if len(groups) > 1:
        order = sorted(groups.values(), key=lambda rs: (len(rs), -rs[0]))
        first = order[0]
        others = "; ".join(f"{_ranks(rs)} called {calls[rs[0]]}" for rs in order[1:])
        why = ""
        heads = [_common(parsed[rs[0]]) for rs in order]  # type: ignore[arg-type]
        if len({h[0] for h in heads}) > 1 and len({h[1:] for h in heads}) == 1:
            if len({f[3] for f in parsed if f is not None}) > 1:
                why = (" (collectives of host and GPU memory do not mix: pass the same "
                       "kind of memory on every rank)")
            else:
                why = (" (a rank could not use this host's shared memory, see its log: "
                       "the communicator takes the network path from now on)")
        return CollectiveMismatch(
            f"collective #{seq} does not match: {_ranks(first)} called "
            f"{calls[first[0]]} where {others}{why}", calls=calls, seq=seq)
    f0 = parsed[0]
    assert f0 is not None
    kind = f0[2]
    if kind not in _VEC_KINDS:
        return None
    problem = _counts_problem(trace.KINDS[kind], parsed, fps, size, f0[5])
    if problem is None:
        return None
    return CollectiveMismatch(f"collective #{seq}, {what}: {problem}", calls=calls, seq=seq)


def only_form_differs(fps: Sequence[bytes]) -> bool:
    """Whether the calls ``fps`` differ in their form alone, between the shared-memory
    form and another, on the same kind of memory (a rank that could not use the node's
    shared memory: ``comm/shm.py``)."""
    parsed = [_unpack(fp) for fp in fps]
    if any(f is None for f in parsed):
        return False
    heads = {(f[2], f[4], f[5], f[6], f[7], f[3]) for f in parsed}  # type: ignore[index]
    forms = {f[1] for f in parsed}  # type: ignore[index]
    return len(heads) == 1 and len(forms) > 1 and SHM in forms


def _vec(fp: bytes) -> list[int]:
    """The per-rank counts after the fixed part (whole int64s only: a message is
    hostile until it checks out)."""
    n = (len(fp) - HDR) // 8
    return np.frombuffer(fp, "<i8", n, HDR).tolist() if n > 0 else []


def _counts_problem(name: str, parsed: list[Any], fps: Sequence[bytes], size: int,
                    root: int) -> str | None:
    """The first disagreement between the ranks' per-rank counts, in words."""
    own = [f[8] for f in parsed]
    want = {"Alltoallv": 2 * size, "Gatherv": 0, "Scatterv": 0}.get(name, size)
    for q, fp in enumerate(fps):
        if want and len(_vec(fp)) != want:
            return f"rank {q} sent {len(_vec(fp))} counts, {want} expected"
    if name in ("Allgatherv", "Reduce_scatter"):
        vecs = [_vec(fp) for fp in fps]
        for q in range(1, size):
            if vecs[q] != vecs[0]:
                return (f"rank {q} passed counts {vecs[q]} where rank 0 passed {vecs[0]}")
        if name == "Allgatherv":
            for q in range(size):
                if own[q] != vecs[0][q]:
                    return f"rank {q} sends {own[q]} elements, the counts say {vecs[0][q]}"
        return None
    if name in ("Gatherv", "Scatterv"):
        counts = _vec(fps[root])
        if len(counts) != size:
            return f"the root (rank {root}) sent no counts"
        for q in range(size):
            if q == root:
                continue
            if name == "Gatherv" and own[q] != counts[q]:
                return (f"rank {q} sends {own[q]} elements to the root (rank {root}), "
                        f"which expects {counts[q]}")
            if name == "Scatterv" and counts[q] > own[q]:
                return (f"the root (rank {root}) sends {counts[q]} elements to rank {q}, "
                        f"whose receive buffer holds {own[q]}")
        return None
    # Alltoallv: each rank's send counts, then its receive counts.
    vecs = [_vec(fp) for fp in fps]
    for p in range(size):
        for q in range(size):
            sent, expected = vecs[p][q], vecs[q][size + p]
            if p != q and sent != expected:
                return (f"rank {p} sends {sent} elements to rank {q}, which expects "
                        f"{expected} from it")
    return None
