"""Transport layer in one process: two real UCX workers talking over real UCX."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest

from ucxcomm import ClosedError, PeerFailure
from ucxcomm.transport import Worker
from ucxcomm.transport.base import FULL_MASK

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def pair():
    a, b = Worker(), Worker()
    ep = a.connect(b.address, peer="b")
    yield a, b, ep
    await a.close()
    await b.close()


async def test_endpoint_send_recv(pair):
    a, b, ep = pair
    src = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: rendezvous
    dst = np.empty_like(src)
    back = b.connect(a.address)
    recv = asyncio.ensure_future(back.recv(dst, tag=9))
    await ep.send(src, tag=9)
    await recv
    assert np.array_equal(src, dst)
    lanes = ep.transports()
    assert lanes and all(isinstance(t, str) and isinstance(d, str) for t, d in lanes)


async def test_masked_worker_recv_and_matched_probe(pair):
    _a, b, ep = pair
    # Worker-level receive that matches any tag in 0x1200..0x12ff.
    out = np.zeros(4, np.int32)
    fut = b.tag_recv(b.recv_ptr(out), 0x1200, mask=FULL_MASK ^ 0xFF)
    await ep.send(np.array([1, 2, 3, 4], np.int32), tag=0x12AB)
    if fut is not None:
        await b.complete(fut)
    assert out.tolist() == [1, 2, 3, 4]
    # Matched probe: size and sender tag learned before the buffer is chosen.
    await ep.send(b"x" * 1000, tag=0x77)
    res = b.recv_alloc(0x70, FULL_MASK ^ 0xF, None)
    stag, nbytes, arr = res if type(res) is tuple else await b.complete(res)
    assert (stag, nbytes) == (0x77, 1000) and bytes(arr) == b"x" * 1000
    # recv_into with a too-small buffer: consumed whole, prefix kept
    await ep.send(bytes(range(100)), tag=5)
    small = bytearray(10)
    res = b.recv_into(b.recv_ptr(small), 5, FULL_MASK, None)
    stag, nbytes, cap = res if type(res) is tuple else await b.complete(res)
    assert (nbytes, cap) == (100, 10) and small == bytes(range(10))
    assert b.probe(5, FULL_MASK) is None


async def test_cancel_unmatched_probe_receive(pair):
    _a, b, ep = pair
    buf = bytearray(8)
    fut = b.recv_into(b.recv_ptr(buf), 42, FULL_MASK, None)
    assert not isinstance(fut, tuple)
    assert b.cancel(fut) is True
    assert fut.cancelled()
    await ep.send(b"12345678", tag=42)
    res = b.recv_into(b.recv_ptr(bytearray(8)), 42, FULL_MASK, None)
    res = res if type(res) is tuple else await b.complete(res)
    assert res[1] == 8 and buf == bytearray(8)  # the cancelled buffer was never written


async def test_endpoint_isend_is_one_compiled_call_that_knows_closing(pair):
    """Endpoint.isend is the engine's per-endpoint sender (issue 10: no Python frame per
    send); it follows the endpoint: a closed endpoint refuses before touching UCX."""
    _a, b, ep = pair
    func = getattr(ep.isend, "__func__", ep.isend)
    assert type(func).__name__ == "cython_function_or_method", type(func)
    fut = ep.isend(b"abcd", 7)
    if fut is not None:
        await _a.complete(fut)
    res = b.recv_into(b.recv_ptr(bytearray(4)), 7, FULL_MASK, None)
    res = res if type(res) is tuple else await b.complete(res)
    assert res[1] == 4
    ep.abort()
    with pytest.raises(ClosedError):
        ep.isend(b"abcd", 7)


async def test_dead_peer_fails_pending_ops(pair, monkeypatch):
    from ucxcomm.transport import worker as worker_mod

    monkeypatch.setattr(worker_mod, "PEER_GRACE_S", 0.0)
    a, b, ep = pair
    fut = b.recv_into(b.recv_ptr(bytearray(8)), 1, FULL_MASK, frozenset({"a"}))
    b.fail_peer("a")
    with pytest.raises(PeerFailure):
        await asyncio.wait_for(b.complete(fut), 10)
    a.fail_peer("b")
    with pytest.raises(PeerFailure):
        ep.isend(b"x", 1)


async def test_close_fails_pending_and_later_ops():
    a = Worker()
    fut = a.recv_into(a.recv_ptr(bytearray(4)), 3, FULL_MASK, None)
    await a.close()
    with pytest.raises(ClosedError):
        await fut
    with pytest.raises(ClosedError):
        a.recv_into(a.recv_ptr(bytearray(4)), 3, FULL_MASK, None)
    await a.close()  # idempotent
    a.abort()


async def test_bad_buffers_rejected_before_io(pair):
    _a, b, ep = pair
    with pytest.raises(ValueError):
        ep.isend(np.zeros((4, 4))[:, ::2], 1)
    with pytest.raises(ValueError):
        b.recv_ptr(b"read-only")
    with pytest.raises(TypeError):
        ep.isend(object(), 1)
    assert b.probe(1, FULL_MASK) is None


async def test_cancel_posted_worker_receive(pair):
    """A posted (non-probe) receive is withdrawn from UCP's expected queue on cancel."""
    _a, b, ep = pair
    buf = bytearray(8)
    fut = b.tag_recv(b.recv_ptr(buf), 55)
    assert fut is not None
    assert b.cancel(fut) is False  # cancellation completes asynchronously...
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(b.complete(fut), 10)  # ...UCS_ERR_CANCELED cancels fut
    assert fut.cancelled()  # (not an error nobody retrieves: issue 15, defect 3)
    await ep.send(b"abcdefgh", tag=55)
    other = bytearray(8)
    fut2 = b.tag_recv(b.recv_ptr(other), 55)
    if fut2 is not None:
        await asyncio.wait_for(b.complete(fut2), 10)
    assert other == b"abcdefgh" and buf == bytearray(8)


def test_unclosed_worker_is_released_at_loop_shutdown():
    """asyncio.run cancels the progress task at teardown: the worker aborts itself."""
    box = {}

    async def main():
        box["w"] = Worker()
        box["fut"] = box["w"].recv_into(box["w"].recv_ptr(bytearray(4)), 1, FULL_MASK, None)

    asyncio.run(main())
    assert box["w"].closed
    assert isinstance(box["fut"].exception(), ClosedError)


MMAP_PROBE = r"""
import asyncio, ctypes, sys
import numpy as np
from ucxcomm.transport import Worker

async def main():
    w = Worker()
    await w.close()

asyncio.run(main())
libc = ctypes.CDLL(None)
libc.sbrk.restype = ctypes.c_void_p
a = np.ones(4 << 20, np.uint8)
del a  # glibc raises its dynamic mmap threshold here unless it is pinned
b = np.ones(4 << 20, np.uint8)
print("heap" if b.ctypes.data < libc.sbrk(0) else "mmap")
"""


@pytest.mark.parametrize("threshold,where", [(None, "mmap"), ("0", "heap")])
def test_worker_pins_the_mmap_threshold(threshold, where):
    """Large buffers stay mmap'ed after a worker starts (heap buffers move 3-4x slower
    through CMA); UCXCOMM_MMAP_THRESHOLD=0 leaves glibc's dynamic threshold alone."""
    env = {k: v for k, v in os.environ.items() if k != "UCXCOMM_MMAP_THRESHOLD"}
    if threshold is not None:
        env["UCXCOMM_MMAP_THRESHOLD"] = threshold
    proc = subprocess.run([sys.executable, "-c", MMAP_PROBE], capture_output=True,
                          text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == where


async def test_endpoint_error_callback_records_only_failed_endpoints(pair):
    """Endpoints from worker addresses carry ucxcomm's UCX error callback (a peer dying
    mid CMA copy used to abort the process, tests/test_faults.py); its record of failed
    endpoints names none of a healthy pair, nor the 0 of a closed ucxx endpoint (which
    matched the record's empty slots, so closing one looked like closing a failed one)."""
    from ucxcomm.transport import _ucx

    a, b, ep = pair
    back = b.connect(a.address)
    got = bytearray(1)
    recv = asyncio.ensure_future(back.recv(got, tag=5))
    await ep.send(b"x", tag=5)
    await recv
    assert got == b"x"
    assert not _ucx.ucp.ep_failed(ep._handle) and not _ucx.ucp.ep_failed(back._handle)
    assert not _ucx.ucp.ep_failed(0)


def test_rdma_endpoints_to_other_hosts_get_peer_error_handling(monkeypatch):
    """Regression (issue 14, soft-RoCE VMs): without UCX peer error handling a queue pair
    error (this host's link went down) made UCX abort the process. Endpoints to a peer
    known to be on another host get it when the plan found RDMA; all others keep it off
    (shared memory and CMA)."""
    from ucxcomm.transport import _ucx

    seen = []
    real = _ucx.endpoint_from_address

    def spy(worker, address, peer=None, *, error_handling=False):
        seen.append(error_handling)
        return real(worker, address, peer, error_handling=error_handling)

    monkeypatch.setattr(_ucx, "endpoint_from_address", spy)

    async def main():
        w = Worker()
        try:
            for other_host, rdma in ((False, False), (True, False), (False, True),
                                     (True, True)):
                monkeypatch.setattr(w._plan, "rdma", rdma)
                w.connect(w.address, peer=0, other_host=other_host).abort()
        finally:
            w.abort()

    asyncio.run(main())
    assert seen == [False, False, False, True]


_STREAM_ORDER = r'''
import sys, types
calls = []
# Stand-ins that record what a real cupy / torch would synchronize.
fake = types.ModuleType("cupy")
fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(
    streamSynchronize=calls.append, deviceSynchronize=lambda: calls.append("device")))
sys.modules["cupy"] = fake
class Stream:
    def __init__(self, device):
        self.device = device
    def synchronize(self):
        calls.append(("torch", self.device))
faketorch = types.ModuleType("torch")
faketorch.cuda = types.SimpleNamespace(current_stream=Stream)
sys.modules["torch"] = faketorch
from ucxcomm.transport import _ucx
_ucx.load()

class Device:  # GPU memory as cupy describes it (CUDA Array Interface v3)
    def __init__(self, **extra):
        self.__cuda_array_interface__ = dict(shape=(4,), typestr="<f4", data=(4096, False),
                                             version=3, strides=None, **extra)

class Tensor(Device):  # a torch CUDA tensor: interface v2, no stream
    __module__ = "torch"
    device = "cuda:1"

t = _ucx.ucp.target(Device(stream=7), False, True)  # a send: waits for stream 7
assert t[0] == 4096 and t[1] == 16 and t[3], t
_ucx.ucp.target(Device(stream=1), True, True)  # a receive: the legacy default stream
_ucx.ucp.target(Device(stream=None), False, True)  # the producer says: ready
_ucx.ucp.target(Tensor(), True, True)  # torch's current stream on the tensor's device
_ucx.ucp.target(Device(), False, True)  # another v2 producer: the whole device
print("SYNCED", calls)
'''


def test_gpu_targets_wait_for_the_producers_stream():
    """Regression (found on an H200, 2026-12-04): GPU memory went to UCX without waiting
    for the stream that produced it, so ``comm.Isend(cupy.arange(n) + rank, ...)`` sent
    stale data (3 ranks: wrong data or a wrong truncated prefix on every one of six tries;
    tests/spmd/p2p_cases.py ``gpu_stream_order`` checks it on a GPU). A GPU target now
    synchronizes the stream its CUDA Array Interface names, for sends and receives alike
    (torch tensors name none: torch's current stream; other such producers: the device).
    No GPU here: a child process stands a recording module in for cupy (UCX is real)."""
    proc = subprocess.run([sys.executable, "-c", _STREAM_ORDER], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SYNCED [7, 1, ('torch', 'cuda:1'), 'device']" in proc.stdout, \
        proc.stdout + proc.stderr


def test_spinning_waiters_yield_only_when_ranks_outnumber_cores():
    """UCXCOMM_SPIN_YIELD=auto: yielding every spin turn is needed with more ranks than
    cores (8 B Allreduce at 4 ranks on 2 cores: 7.6 us with it, 340 us without) and costs
    ~0.15 us per message otherwise, so auto decides from the host's rank count."""
    from ucxcomm.transport.worker import spin_yield

    cores = len(os.sched_getaffinity(0))
    assert spin_yield({"UCXCOMM_LOCAL_SIZE": str(cores + 1)}) is True
    assert spin_yield({"UCXCOMM_LOCAL_SIZE": str(cores)}) is False
    assert spin_yield({"UCXCOMM_LOCAL_SIZE": "1"}) is False
    assert spin_yield({}) is True  # not known: the safe choice
    assert spin_yield({"UCXCOMM_LOCAL_SIZE": "1", "UCXCOMM_SPIN_YIELD": "yes"}) is True
    assert spin_yield({"UCXCOMM_LOCAL_SIZE": "64", "UCXCOMM_SPIN_YIELD": "no"}) is False
    # Bound one per core (ucxcomm run --bind-to core): each rank's affinity is one core,
    # so only the ranks sharing it count.
    bound = {"UCXCOMM_LOCAL_SIZE": "2", "UCXCOMM_RANKS_PER_CORE": "1"}
    assert spin_yield(bound, "max 100000") is False
    assert spin_yield(dict(bound, UCXCOMM_RANKS_PER_CORE="2"), "max 100000") is True
    # ... unless a CPU quota allows fewer CPUs than the host has ranks (review).
    assert spin_yield(bound, "100000 100000") is True
    assert spin_yield(bound, "200000 100000") is False


def test_usable_cores_honours_a_cgroup_cpu_quota():
    """A container limited to 1.5 CPUs sees every host CPU in its affinity: the quota
    decides (review of UCXCOMM_SPIN_YIELD=auto)."""
    from ucxcomm.transport.worker import usable_cores

    cores = len(os.sched_getaffinity(0))
    assert usable_cores("max 100000\n") == cores
    assert usable_cores("150000 100000\n") == min(cores, 2)
    assert usable_cores("50000 100000") == 1
    assert usable_cores("garbage") == cores
