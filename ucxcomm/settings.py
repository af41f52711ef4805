"""Every ``UCXCOMM_*`` environment variable: declared, documented and parsed here only.

Library code asks :func:`get` for a setting (an explicit keyword argument, where one
exists, wins over the variable); a malformed value raises ``ValueError`` naming the
variable. docs/settings.md lists the same table (tests/test_settings.py keeps the two
in step). Variables only ``ucxcomm run`` sets for its ranks are marked ``launcher``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["SETTINGS", "Setting", "get"]


def _number(text: str, kind: type, low: float | None = None, strict: bool = False) -> Any:
    try:
        value = kind(text.strip())
    except ValueError:
        raise ValueError(f"must be {'an integer' if kind is int else 'a number'}") from None
    if low is not None and not (value > low if strict else value >= low):  # nan fails
        raise ValueError(f"must be {'>' if strict else '>='} {low}")
    return value


def _int(text: str) -> int:
    return int(_number(text, int))


def _nonneg_int(text: str) -> int:
    return int(_number(text, int, 0))


def _port(text: str) -> int:
    value = int(_number(text, int, 1))
    if value > 65535:
        raise ValueError("must be a TCP port (1-65535)")
    return value


def _nonneg_float(text: str) -> float:
    return float(_number(text, float, 0))


def _pos_float(text: str) -> float:
    return float(_number(text, float, 0, strict=True))


def _trace_depth(text: str) -> int:
    value = int(_number(text, int, 0))
    if value > 65535:
        raise ValueError("must be at most 65535")
    return value


def _shm_slot(text: str) -> int:
    n = int(text)
    if not 4096 <= n <= 1 << 24 or n % 4096:
        raise ValueError("4096 to 16777216, a multiple of 4096")
    return n


def _shm_slots(text: str) -> int:
    n = int(text)
    if not 2 <= n <= 64:
        raise ValueError("2 to 64")
    return n


def _yes_no(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "y", "yes", "true", "on"):
        return True
    if value in ("0", "n", "no", "false", "off"):
        return False
    raise ValueError("must be yes or no")


def _text(text: str) -> str:
    return text


def _choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return value

    return parse


def _bool_or_auto(text: str) -> Any:
    value = text.strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("1", "y", "yes", "true", "on"):
        return True
    if value in ("0", "n", "no", "false", "off"):
        return False
    raise ValueError("must be auto, yes or no")


def _ucx_library(text: str) -> str:
    value = text.strip()
    if value.lower() in ("auto", "wheel", "system", "mpich"):
        return value.lower()
    if value.startswith(("/", ".", "~")):
        return value
    raise ValueError("must be auto, wheel, system, mpich or the path of a UCX install")


def _devices(text: str) -> list[str] | None:
    return [d.strip() for d in text.split(",") if d.strip()] or None


@dataclass(frozen=True)
class Setting:
    """One ``UCXCOMM_*`` variable."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    launcher: bool = False  # set by ``ucxcomm run`` for its ranks


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    # transport policy (init(transport=, tag_offload=, devices=) win)
    Setting("UCXCOMM_TRANSPORT", _choice("auto", "rdma", "tcp"), "auto",
            "auto: RDMA when present, else TCP + shared memory; rdma: fail without "
            "RDMA; tcp: never RDMA"),
    Setting("UCXCOMM_TAG_OFFLOAD", _bool_or_auto, "auto",
            "hardware tag matching on capable mlx5 devices (auto, yes, no)"),
    Setting("UCXCOMM_DEVICES", _devices, None,
            "comma-separated UCX network devices (UCX_NET_DEVICES), e.g. mlx5_0:1"),
    Setting("UCXCOMM_UCX", _ucx_library, "auto",
            "the UCX library to load: auto (a verbs-capable UCX that pip installed when an "
            "RDMA port is active and the wheel's has no verbs), wheel, system, mpich (the "
            "rdma extra's) or a path (libucp file, its directory or prefix)"),
    Setting("UCXCOMM_TM_THRESH", _nonneg_int, None,
            "bytes: UCX_TM_THRESH when tag offload is on"),
    Setting("UCXCOMM_TM_MAX_BB_SIZE", _nonneg_int, None,
            "bytes: UCX_TM_MAX_BB_SIZE when tag offload is on"),
    # progress and memory
    Setting("UCXCOMM_SPIN_US", _nonneg_float, 200.0,
            "microseconds a waiter spins before sleeping on the worker's descriptor "
            "(0: never spin)"),
    Setting("UCXCOMM_SPIN_YIELD", _bool_or_auto, "auto",
            "whether a spinning waiter gives its core away (sched_yield) on every turn; "
            "auto: for ranks bound by ucxcomm run --bind-to core, when ranks share this "
            "rank's CPU (UCXCOMM_RANKS_PER_CORE > 1) or this host's ranks outnumber a "
            "cgroup CPU quota; otherwise when this host's ranks (UCXCOMM_LOCAL_SIZE) "
            "outnumber the cores this process may run on (affinity, capped by a cgroup CPU "
            "quota), or their number is unknown"),
    Setting("UCXCOMM_RMA_SPIN_US", _nonneg_float, 200.0,
            "microseconds the RMA progress thread keeps polling after activity"),
    Setting("UCXCOMM_MMAP_THRESHOLD", _int, 1 << 20,
            "bytes: glibc mmap threshold pinned when a worker starts (0 or less: leave "
            "malloc alone)"),
    Setting("UCXCOMM_POOL_MB", _nonneg_int, 512,
            "MiB of received object payload buffers kept for reuse"),
    # bootstrap (init(timeout=, rank=, size=, store=) win)
    Setting("UCXCOMM_TIMEOUT", _pos_float, 120.0, "seconds: deadline to form the world"),
    Setting("UCXCOMM_TRACE_DEPTH", _trace_depth, 64,
            "operations each process's flight recorder keeps (1-65535; those still in "
            "flight are never overwritten): comm.trace(), ucxcomm status; 0 turns it off "
            "(about 25-45 ns per operation, docs/debugging.md)"),
    Setting("UCXCOMM_P2P_SPLIT", _nonneg_int, 262144,
            "bytes: from this size a point-to-point message between ranks of one host "
            "takes the split rendezvous (the sender writes half into the receive buffer "
            "with process_vm_writev while the receiver reads the other half); 0: never "
            "(UCX's own rendezvous: the receiver copies it all)"),
    Setting("UCXCOMM_HOST_LABEL", _text, None,
            "appended to this rank's host identity: ranks whose labels differ count as "
            "different hosts (no shared-memory engine between them; the hierarchical "
            "collectives group ranks by host), e.g. to try the multi-host paths on one "
            "machine or to group ranks by socket; it never joins real hosts"),
    Setting("UCXCOMM_SHM", _yes_no, True,
            "collectives of a communicator whose ranks share one host use the node's "
            "shared-memory engine for mid-size host buffers (comm/shm.py); must be the "
            "same on every rank"),
    Setting("UCXCOMM_SHM_DIRECT", _yes_no, True,
            "the shared-memory engine's single-copy mode: readers copy straight out of "
            "the writer's buffer (process_vm_readv, where ptrace permission allows it); "
            "no: every byte goes through the segments"),
    Setting("UCXCOMM_SHM_PUSH", _yes_no, True,
            "single-copy mode, Bcast and Gather from 64 KiB a message: the writer "
            "copies a share of each reader's bytes into the reader's buffer "
            "(process_vm_writev) while the reader copies the rest; no: readers copy "
            "everything"),
    Setting("UCXCOMM_SHM_SLOT", _shm_slot, 131072,
            "bytes of one slot of the shared-memory engine's ring (4096-16777216, a "
            "multiple of 4096; the same on every rank)"),
    Setting("UCXCOMM_SHM_SLOTS", _shm_slots, 8,
            "slots in each rank's ring of the shared-memory engine (2-64; the same on "
            "every rank)"),
    Setting("UCXCOMM_CHECK_COLLECTIVES", _yes_no, True,
            "every collective carries a fingerprint of its call (kind, count, dtype, op, "
            "root) and ranks whose calls differ all raise CollectiveMismatch; must be the "
            "same on every rank; 0 turns the check off (docs/debugging.md)"),
    Setting("UCXCOMM_JOB_DIR", _text, None,
            "the job's directory of flight-recorder files (ucxcomm status reads them)",
            launcher=True),
    Setting("UCXCOMM_LIVENESS_S", _pos_float, 30.0,
            "seconds: a rank whose host stops answering (network cut, power off) is "
            "declared dead after about this long (TCP keepalive on the store connections)"),
    Setting("UCXCOMM_TOKEN", _text, "",
            "the job's shared secret for the bootstrap store (ucxcomm run makes one)"),
    Setting("UCXCOMM_PORT", _port, None,
            "bootstrap store port under Slurm, torchrun or single-host MPI launchers"),
    Setting("UCXCOMM_STORE", _text, None,
            "host:port of the bootstrap store (Open MPI/MPICH across hosts; set by "
            "ucxcomm run)"),
    Setting("UCXCOMM_RANK", _int, None, "this process's rank", launcher=True),
    Setting("UCXCOMM_SIZE", _int, None, "number of ranks", launcher=True),
    Setting("UCXCOMM_LOCAL_RANK", _int, None, "rank on this host", launcher=True),
    Setting("UCXCOMM_LOCAL_SIZE", _int, None, "ranks on this host", launcher=True),
    Setting("UCXCOMM_RANKS_PER_CORE", _int, None,
            "ranks bound to this rank's CPU (ucxcomm run --bind-to core)", launcher=True),
    Setting("UCXCOMM_RESTART_COUNT", _nonneg_int, 0,
            "how many times this rank was restarted (ucxcomm run --elastic --max-restarts): "
            "above 0, init() waits to join the running job through Comm.grow "
            "(docs/elastic.md)", launcher=True),
    # building and CI
    Setting("UCXCOMM_UCX_PREFIX", _text, None,
            "install time: build against the UCX headers under this prefix instead of "
            "the libucx wheel's"),
    Setting("UCXCOMM_WERROR", _text, None,
            "install time: compile the C extension with -Werror (CI sets 1)"),
    Setting("UCXCOMM_VENV", _text, None, "ci/*.sh: the virtual environment to use "
            "(default .venv)"),
    Setting("UCXCOMM_DOCKER_REQUIRED", _text, None,
            "ci/docker-cluster.sh, ci/softroce/run: 1 = fail, not skip, without root or an "
            "engine, or (soft-RoCE containers phase) without the image ucxcomm:test (.ci/run)"),
    Setting("UCXCOMM_DOCKER_BASE", _text, None,
            "ci/docker-cluster.sh: the base image to build on (default: python:3.11-slim, "
            "else one made from Debian packages)"),
    Setting("UCXCOMM_PROGS", _text, None,
            "docker/compose.yaml: a host directory mounted at /progs in the TCP ranks"),
)}


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value of setting ``name`` from ``env`` (default ``os.environ``), parsed, or
    its default when unset or empty.

    Raises
    ------
    ValueError
        The variable is set to something its setting cannot parse (the message names
        the variable and the value).
    KeyError
        ``name`` is not a declared setting (a bug).
    """
    setting = SETTINGS[name]
    text = (os.environ if env is None else env).get(name)
    if text is None or text == "":
        return setting.default
    try:
        return setting.parse(text)
    except ValueError as exc:
        raise ValueError(f"{name}={text!r}: {exc}") from None
