"""torch.distributed with the ucxcomm backend, checked against gloo on the same inputs.

``python torch_prog.py SCENARIO`` on every rank, under ``ucxcomm run`` or with torchrun's
variables set; prints ``TORCH-OK SCENARIO rank R`` when the rank's checks pass.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import ucxcomm.torch
from ucxcomm.torch import PeerFailureError, WorkTimeoutError

R = dist.ReduceOp
warnings.filterwarnings("ignore", category=FutureWarning)  # (deprecated aliases we test)


def inputs(shape, dtype, salt=0):
    """This rank's input for a check: deterministic in (rank, salt)."""
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + salt)
    shape = (shape,) if isinstance(shape, int) else shape
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(-50 if dtype.is_signed else 0, 100, shape, generator=g).to(dtype)


def same(a, b, what):
    """Equal for integers (and exact float cases), allclose otherwise."""
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{what}[{i}]")
        return
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype.is_floating_point or a.dtype.is_complex:
        tol = 1e-2 if a.dtype in (torch.bfloat16, torch.float16) else 1e-5
        assert torch.allclose(a, b, rtol=tol, atol=tol), (what, a, b)
    else:
        assert torch.equal(a, b), (what, a, b)


def check(what, fn, gloo):
    """Run ``fn(group)`` with ucxcomm (the default group) and with gloo; compare."""
    mine, ref = fn(None), fn(gloo)
    same(mine, ref, what)


def scenario_ops(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "ucxcomm"

    # all_reduce: every supported op, integer (exact) and float dtypes, small and large
    # (recursive doubling below 64 KiB, ring above).
    cases = [(torch.int64, [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]),
             (torch.int32, [R.SUM, R.MAX, R.BXOR]),
             (torch.uint8, [R.BAND, R.BOR, R.MIN]),
             (torch.float32, [R.SUM, R.PRODUCT, R.MIN, R.MAX]),
             (torch.float64, [R.SUM, R.MIN])]
    for dtype, ops in cases:
        for n in (7, 40_000):
            for op in ops:
                x = inputs(n, dtype, salt=n)
                if op == R.PRODUCT:
                    x = x % 3 + 1 if not dtype.is_floating_point else x.abs() + 0.5
                    x = x[:7]

                def ar(group, x=x, op=op):
                    t = x.clone()
                    dist.all_reduce(t, op=op, group=group)
                    return t
                check(f"all_reduce {dtype} {op} {n}", ar, gloo)
    # AVG (gloo has none: against its SUM / size); bfloat16; complex.
    x = inputs(1000, torch.float32, 5)
    t = x.clone()
    dist.all_reduce(t, op=R.AVG)
    ref = x.clone()
    dist.all_reduce(ref, group=gloo)
    same(t, ref / size, "all_reduce AVG")
    for dtype in (torch.bfloat16, torch.float16, torch.complex64):
        check(f"all_reduce {dtype}", lambda g, dtype=dtype: _ar(inputs(300, dtype, 6), g), gloo)
    # async_op, the Work's future (DDP's path) and result().
    t = inputs(20_000, torch.float32, 7)
    ref = t.clone()
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    (res,) = fut.wait()
    assert work.is_completed() and work.is_success() and torch.equal(res, t)
    dist.all_reduce(ref, group=gloo)
    same(t, ref, "async all_reduce")
    # Several operations in flight at once, waited in reverse.
    xs = [inputs(100 * (i + 1), torch.float64, 20 + i) for i in range(5)]
    mine = [x.clone() for x in xs]
    works = [dist.all_reduce(m, async_op=True) for m in mine]
    for w in reversed(works):
        w.wait()
    check("overlapped all_reduce", lambda g: [_ar(x, g) for x in xs] if g else mine, gloo)
    # all_reduce_coalesced
    check("all_reduce_coalesced", lambda g: _coalesced(
        [inputs(5, torch.float32, 30), inputs(9, torch.float32, 31)], g), gloo)

    for root in range(size):
        check(f"broadcast root {root}", lambda g, root=root: _bcast(
            inputs(33, torch.int64, 40), root, g), gloo)
        check(f"broadcast bf16 root {root}", lambda g, root=root: _bcast(
            inputs(33, torch.bfloat16, 41), root, g), gloo)

        def red(g, root=root):
            t = inputs(50, torch.int64, 42)
            dist.reduce(t, dst=root, group=g, op=R.MAX)
            return t if rank == root else torch.zeros(0)
        check(f"reduce root {root}", red, gloo)

        def gat(g, root=root):
            outs = [torch.empty(6) for _ in range(size)] if rank == root else None
            dist.gather(inputs(6, torch.float32, 43), outs, dst=root, group=g)
            return outs if rank == root else []
        check(f"gather root {root}", gat, gloo)

        def sca(g, root=root):
            out = torch.empty(4, dtype=torch.int32)
            ins = [torch.full((4,), 10 * root + i, dtype=torch.int32) for i in range(size)]
            dist.scatter(out, ins if rank == root else None, src=root, group=g)
            return out
        check(f"scatter root {root}", sca, gloo)

    def ag(g):
        outs = [torch.empty(3, 5, dtype=torch.float64) for _ in range(size)]
        dist.all_gather(outs, inputs((3, 5), torch.float64, 50), group=g)
        return outs
    check("all_gather", ag, gloo)

    def agt(g):
        out = torch.empty(size * 8, dtype=torch.int32)
        dist.all_gather_into_tensor(out, inputs(8, torch.int32, 51), group=g)
        return out
    check("all_gather_into_tensor", agt, gloo)

    def agc(g):  # torch's layout: one output list per rank, one tensor per input
        ins = [inputs((2, 3), torch.float32, 52), inputs(5, torch.float32, 53),
               inputs(0, torch.float32, 54), inputs(4, torch.complex64, 55)]
        outs = [[torch.empty_like(t) for t in ins] for _ in range(size)]
        dist.all_gather_coalesced(outs, ins, group=g)
        return [t for lst in outs for t in lst]
    check("all_gather_coalesced", agc, gloo)  # (issue 33: it raised ValueError)

    def sparse(g):  # rank r: rows 0..r (overlapping ranks), a dense dimension of 2
        x = torch.sparse_coo_tensor(torch.arange(rank + 1).reshape(1, -1),
                                    inputs((rank + 1, 2), torch.float64, 56), (size + 1, 2))
        dist.all_reduce(x, group=g)
        return x.to_dense()
    check("sparse all_reduce", sparse, gloo)  # (issue 33: ucxcomm refused sparse tensors)
    for outs, words in (([[torch.empty(3)]] * (size + 1), f"{size} output lists"),
                        ([[torch.empty(3)]] * (size - 1) + [[]], "one tensor per input")):
        try:
            dist.all_gather_coalesced(outs, [torch.ones(3)])
        except ValueError as exc:
            assert words in str(exc), (words, str(exc))
        else:
            raise AssertionError(f"no error for {words}")
    # Uneven all_gather (gloo needs equal sizes): against what every rank sent.
    outs = [torch.empty(r + 1, dtype=torch.int64) for r in range(size)]
    dist.all_gather(outs, torch.arange(rank + 1, dtype=torch.int64) + 100 * rank)
    for r in range(size):
        assert torch.equal(outs[r], torch.arange(r + 1) + 100 * r), outs

    def rs(g):
        out = torch.empty(4, dtype=torch.int64)
        dist.reduce_scatter(out, [inputs(4, torch.int64, 60 + i) for i in range(size)],
                            group=g)
        return out
    check("reduce_scatter", rs, gloo)

    def rst(g):
        out = torch.empty(5)
        dist.reduce_scatter_tensor(out, inputs(5 * size, torch.float32, 61), group=g)
        return out
    check("reduce_scatter_tensor", rst, gloo)

    def a2a(g):
        outs = [torch.empty(3, dtype=torch.int64) for _ in range(size)]
        dist.all_to_all(outs, [inputs(3, torch.int64, 70 + i) for i in range(size)], group=g)
        return outs
    check("all_to_all", a2a, gloo)

    def a2as(g):
        out = torch.empty(2 * size, 3)
        dist.all_to_all_single(out, inputs((2 * size, 3), torch.float32, 71), group=g)
        return out
    check("all_to_all_single", a2as, gloo)

    def a2av(g):  # rank r sends r + i + 1 rows to rank i
        splits_in = [rank + i + 1 for i in range(size)]
        splits_out = [r + rank + 1 for r in range(size)]
        out = torch.empty(sum(splits_out), 2, dtype=torch.int64)
        dist.all_to_all_single(out, inputs((sum(splits_in), 2), torch.int64, 72),
                               splits_out, splits_in, group=g)
        return out
    check("all_to_all_single with splits", a2av, gloo)

    # Objects (all_gather of sizes, then of uint8 tensors; broadcast likewise).
    objs = [None] * size
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    assert objs == [{"rank": r, "s": "x" * r} for r in range(size)], objs
    lst = [{"a": 1}, "two"] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == [{"a": 1}, "two"], lst

    # Point-to-point: a ring, then recv from any source with the sender reported.
    right, left = (rank + 1) % size, (rank - 1) % size
    got = torch.empty(4, dtype=torch.int64)
    sreq = dist.isend(torch.full((4,), rank, dtype=torch.int64), right, tag=3)
    dist.recv(got, left, tag=3)
    sreq.wait()
    assert torch.equal(got, torch.full((4,), left)), got
    if rank == 0:
        seen = set()
        for _ in range(size - 1):
            t = torch.empty(2, dtype=torch.int64)
            src = dist.recv(t, tag=5)  # src=None: recv_anysource
            assert int(t[0]) == src, (t, src)
            seen.add(src)
        assert seen == set(range(1, size)), seen
        work = dist.irecv(t, tag=6)  # the Work reports the source
        work.wait()
        assert work._source_rank() == size - 1 == int(t[0]), (work._source_rank(), t)
    else:
        dist.send(torch.full((2,), rank, dtype=torch.int64), 0, tag=5)
        if rank == size - 1:
            dist.send(torch.full((2,), rank, dtype=torch.int64), 0, tag=6)
    ops = [dist.P2POp(dist.isend, torch.full((3,), rank * 1.0), right),
           dist.P2POp(dist.irecv, got3 := torch.empty(3), left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(got3, torch.full((3,), left * 1.0)), got3

    dist.barrier()
    # (dist.monitored_barrier admits gloo only; the group's method is reachable directly)
    dist.distributed_c10d._get_default_group().monitored_barrier(timedelta(seconds=60))

    # Errors at the call, before anything moves; the group stays usable.
    bad = [
        (lambda: dist.all_reduce(torch.ones(3), op=dist._make_nccl_premul_sum(2.0)),
         ValueError, "PREMUL_SUM is not supported"),
        (lambda: dist.all_reduce(torch.ones(3), op=R.BAND), ValueError, "integer or bool"),
        (lambda: dist.all_reduce(torch.ones(3, dtype=torch.int64), op=R.AVG), ValueError,
         "AVG needs floating-point"),
        (lambda: dist.all_reduce(torch.ones(4, 4).t()), ValueError, "not contiguous"),
        (lambda: dist.broadcast(torch.ones(2), src=size), ValueError, "not in the group"),
    ]
    for fn, exc_type, words in bad:
        try:
            fn()
        except exc_type as exc:
            assert words in str(exc), (words, str(exc))
        else:
            raise AssertionError(f"no error for {words}")
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(size))), t


def _ar(x, g):
    t = x.clone()
    dist.all_reduce(t, group=g)
    return t


def _coalesced(xs, g):
    ts = [x.clone() for x in xs]
    dist.all_reduce_coalesced(ts, group=g)
    return ts


def _bcast(x, root, g):
    t = x.clone()
    dist.broadcast(t, src=root, group=g)
    return t


def train(group, steps, seed=0):
    """A small MLP trained with DDP over ``group``; returns its parameters."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                    bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        y = torch.randn(32, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def scenario_ddp(gloo):
    mine = train(None, 30)
    ref = train(gloo, 30)
    for a, b in zip(mine, ref, strict=True):
        if dist.get_world_size() == 2:  # a + b: the same sum in any order
            assert torch.equal(a, b), (a - b).abs().max()
        else:
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()


def scenario_subgroup(gloo):
    rank, size = dist.get_rank(), dist.get_world_size()
    members = [0, size - 1]
    sub = dist.new_group(members, backend="ucxcomm")
    if rank in members:
        t = torch.full((3,), float(rank))
        dist.all_reduce(t, group=sub)
        assert torch.equal(t, torch.full((3,), float(sum(members)))), t
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(size))), t


def scenario_kill(gloo):
    """Rank ``KILL_RANK`` (default 1) dies (SIGKILL) without contributing to an
    all_reduce the others have posted (or are about to post): their waits raise
    PeerFailureError naming it, whichever comes first, and never complete.

    (A death that cuts a large transfer is not tested: a rank killed during a CMA
    rendezvous can make UCX abort the rank reading its memory, "process_vm_readv ... No
    such process"; endpoints carry no UCX error handling, to keep shared memory.)
    """
    rank = dist.get_rank()
    victim = int(os.environ.get("KILL_RANK", "1"))
    # The survivors meet over this group before exiting (one that exits first would be a
    # second death for the others, who may not have heard of the first yet). The
    # all_reduce after it: nobody dies before every survivor has formed it (through
    # torch's store, which rank 0 serves).
    survivors = dist.new_group([r for r in range(dist.get_world_size()) if r != victim],
                               backend="gloo")
    dist.all_reduce(torch.ones(1))
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    work = dist.all_reduce(torch.ones(8 << 10), async_op=True)
    try:
        work.wait()
    except PeerFailureError as exc:
        assert exc.peer == victim and f"rank {victim}" in str(exc), (exc.peer, str(exc))
        assert isinstance(exc, dist.DistBackendError) and isinstance(exc, ucxcomm.PeerFailure)
        print(f"RAISED rank {rank}: {exc}", flush=True)
    else:
        raise AssertionError(f"the all_reduce completed without rank {victim}")
    try:
        dist.all_reduce(torch.ones(2))
    except PeerFailureError as exc:
        assert "unusable" in str(exc) and exc.peer == victim, str(exc)
    else:
        raise AssertionError("the group still took a collective after a rank died")
    dist.barrier(group=survivors)
    return "no-destroy"


def scenario_timeout(gloo):
    """init_process_group(timeout=8 s): rank 0's all_reduce that rank 1 never joins
    fails after about that long, naming the timeout; then both meet over gloo."""
    rank = dist.get_rank()
    if rank == 0:
        t0 = time.monotonic()
        work = dist.all_reduce(torch.ones(3), async_op=True)
        try:
            work.wait()
        except WorkTimeoutError as exc:
            took = time.monotonic() - t0
            assert "8 s" in str(exc) and isinstance(exc, dist.DistBackendError), str(exc)
            assert 7.5 < took < 40, took
        else:
            raise AssertionError("the all_reduce did not time out")
    dist.barrier(group=gloo)  # rank 1 waits here (gloo's group is another world)
    return "no-destroy"


def scenario_cuda(gloo):
    """CUDA tensors through ucxcomm (UCX's CUDA transports, cupy reductions) against
    gloo on the same values on the host."""
    rank, size = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    torch.cuda.set_device(dev)

    def host_ref(x, fn):
        t = x.clone()
        fn(t, gloo)
        return t

    for dtype, n in ((torch.float32, 1000), (torch.float32, 1 << 20), (torch.int64, 77),
                     (torch.bfloat16, 500)):
        x = inputs(n, dtype, 200)
        t = x.to(dev)
        dist.all_reduce(t)
        same(t.cpu(), host_ref(x, lambda t, g: dist.all_reduce(t, group=g)), f"cuda ar {dtype}")
    x = inputs(64, torch.float32, 201)
    t = x.to(dev)
    dist.broadcast(t, src=size - 1)
    same(t.cpu(), host_ref(x, lambda t, g: dist.broadcast(t, src=size - 1, group=g)), "bcast")
    x = inputs(10, torch.float32, 202)
    out = torch.empty(10 * size, device=dev)
    dist.all_gather_into_tensor(out, x.to(dev))
    ref = torch.empty(10 * size)
    dist.all_gather_into_tensor(ref, x, group=gloo)
    same(out.cpu(), ref, "cuda all_gather_into_tensor")
    x = inputs(10 * size, torch.float32, 203)
    out = torch.empty(10, device=dev)
    dist.reduce_scatter_tensor(out, x.to(dev))
    ref = torch.empty(10)
    dist.reduce_scatter_tensor(ref, x, group=gloo)
    same(out.cpu(), ref, "cuda reduce_scatter_tensor")
    x = inputs((2 * size, 3), torch.float32, 204)
    out = torch.empty(2 * size, 3, device=dev)
    dist.all_to_all_single(out, x.to(dev))
    ref = torch.empty(2 * size, 3)
    dist.all_to_all_single(ref, x, group=gloo)
    same(out.cpu(), ref, "cuda all_to_all_single")
    # A kernel on the current stream produces the input: the stream order is respected.
    big = torch.zeros(1 << 22, device=dev)
    big.add_(rank + 1)
    dist.all_reduce(big)
    assert torch.all(big == sum(range(1, size + 1))).item(), big
    right, left = (rank + 1) % size, (rank - 1) % size
    got = torch.empty(5, device=dev)
    w = dist.isend(torch.full((5,), float(rank), device=dev), right)
    dist.recv(got, left)
    w.wait()
    assert torch.equal(got.cpu(), torch.full((5,), float(left))), got
    train_dev = train(None, 5)
    assert all(torch.isfinite(p).all() for p in train_dev)


def scenario_inline(gloo):
    """The caller's-thread path (ops run on the calling thread while the ucxcomm loop
    is idle; what has to wait continues on the loop): late peers, ops queued behind
    one in flight, two threads on two groups at once, and Works settled at the call."""
    rank, size = dist.get_rank(), dist.get_world_size()
    # Peers in step: most small all_reduces end within the call (settled Works).
    settled = 0
    for i in range(200):
        t = torch.full((2,), float(rank + i))
        w = dist.all_reduce(t, async_op=True)
        settled += w.is_completed()
        fut = w.get_future()
        w.wait()
        assert fut.done() and torch.equal(fut.value()[0], t), (fut, t)
        assert torch.equal(t, torch.full((2,), float(sum(range(size)) + size * i))), t
    assert settled > 0, "no all_reduce ended within the call"
    # A late rank (longer than any spin): the others' calls go on on the loop.
    for late in range(size):
        if rank == late:
            time.sleep(0.3)
        t = torch.full((5,), float(rank))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((5,), float(sum(range(size))))), t
    # Ops issued while a large one is in flight queue behind it, in order.
    big = torch.full((1 << 20,), float(rank))
    small = torch.full((3,), float(rank))
    root = size - 1
    b = torch.full((4,), float(rank))
    works = [dist.all_reduce(big, async_op=True), dist.all_reduce(small, async_op=True),
             dist.broadcast(b, src=root, async_op=True)]
    for w in works:
        w.wait()
    total = float(sum(range(size)))
    assert torch.equal(big, torch.full((1 << 20,), total)), big[:4]
    assert torch.equal(small, torch.full((3,), total)), small
    assert torch.equal(b, torch.full((4,), float(root))), b
    # A rendezvous-size message sent while the receiver is busy elsewhere (its loop
    # asleep, not watching the transport): it arrives once the receive is posted.
    if size >= 2 and rank in (0, 1):
        if rank == 1:
            dist.send(torch.arange(1 << 20, dtype=torch.float32), 0)
        else:
            time.sleep(0.3)
            got = torch.empty(1 << 20)
            dist.recv(got, 1)
            assert torch.equal(got, torch.arange(1 << 20, dtype=torch.float32)), got[:4]
    # Two threads, each driving its own group: one owns the loop at a time; each
    # group's order is its thread's.
    other = dist.new_group(backend="ucxcomm")
    errors = []

    def run(group, salt):
        try:
            for i in range(100):
                t = torch.full((3,), float(rank * salt + i))
                dist.all_reduce(t, group=group)
                want = float(salt * sum(range(size)) + size * i)
                assert torch.equal(t, torch.full((3,), want)), (salt, i, t)
        except BaseException as exc:  # (reported by the main thread)
            errors.append(exc)

    import threading

    threads = [threading.Thread(target=run, args=(None, 1)),
               threading.Thread(target=run, args=(other, 7))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert not errors, errors
    dist.destroy_process_group(other)


def scenario_mismatch(gloo):
    """Issue 31: all_reduce of float64 on rank 0 and int64 elsewhere (before: both
    'succeeded' with different results), then broadcast with different roots (before: a
    hang): every rank raises, naming the calls; then the group goes on."""
    rank = dist.get_rank()
    t = torch.ones(4, dtype=torch.float64 if rank == 0 else torch.int64)
    try:
        dist.all_reduce(t)
    except Exception as exc:
        text = str(exc)
        assert "does not match" in text and "called Allreduce(int64[4], SUM)" in text, text
        assert "rank 0 called Allreduce(float64[4], SUM)" in text, text
    else:
        raise AssertionError(f"mismatched all_reduce raised nothing on rank {rank}")
    t = torch.zeros(3)
    try:
        dist.broadcast(t, src=1 if rank == 0 else 0)
    except Exception as exc:
        # (the backend broadcasts a tensor's bytes)
        assert "rank 0 called Bcast(uint8[12], root=1)" in str(exc), str(exc)
    else:
        raise AssertionError(f"broadcasts with different roots raised nothing on rank {rank}")
    t = torch.ones(3)
    dist.all_reduce(t)
    assert (t == dist.get_world_size()).all(), t


SCENARIOS = {"mismatch": scenario_mismatch, "ops": scenario_ops, "inline": scenario_inline,
             "ddp": scenario_ddp,
             "subgroup": scenario_subgroup, "kill": scenario_kill, "timeout": scenario_timeout,
             "cuda": scenario_cuda}


def main() -> None:
    faulthandler.dump_traceback_later(75, exit=True)  # (a hang shows where, then ends)
    name = sys.argv[1]
    timeout = timedelta(seconds=8 if name == "timeout" else 60)
    dist.init_process_group("ucxcomm", timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    outcome = SCENARIOS[name](gloo)
    if outcome is None:
        dist.destroy_process_group()
    print(f"TORCH-OK {name} rank {rank}", flush=True)
    if outcome is not None:  # (a broken group: leave without waiting on it)
        os._exit(0)


if __name__ == "__main__":
    main()
