"""torch.distributed.shrink_group on the ucxcomm backend (no gloo anywhere), under
``ucxcomm run --elastic -n 3``: a rank's death does not end the job.

``python torch_elastic_prog.py SCENARIO`` on every rank; a rank prints ``SHRINK-OK
SCENARIO rank R`` (R: its rank when it started) when its checks pass, and the lines the
test reads on the way (``RAISED``, ``SHRUNK``, ``DDP``, ``ALONE``, ``MISMATCH``, ``LEFT``,
``NONE GONE``, ``TIMED-OUT``, ``RELEASED``).
"""

from __future__ import annotations

import copy
import faulthandler
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend

import ucxcomm
import ucxcomm.torch  # (registers the backend)
from ucxcomm.torch import PeerFailureError, ShrinkMismatchError, WorkError, WorkTimeoutError

#: Every wait of the ranks is bounded by this (the group's timeout).
TIMEOUT = timedelta(seconds=40)


def say(line: str) -> None:
    print(line, flush=True)


def model_() -> torch.nn.Module:
    torch.manual_seed(0)  # (the same initial parameters on every rank)
    return torch.nn.Linear(8, 3)


def batch(who: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of the rank that started as ``who``, for ``step``."""
    g = torch.Generator().manual_seed(1000 * who + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)


def ddp_step(ddp: torch.nn.Module, opt: torch.optim.Optimizer, who: int, step: int) -> None:
    x, y = batch(who, step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()


def reference(model: torch.nn.Module, whos: list[int], steps: range,
              lr: float) -> list[torch.Tensor]:
    """What DDP over the ranks ``whos`` computes from ``model``, in one process: the
    gradient averaged over their batches, then SGD."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in steps:
        grads = []
        for who in whos:
            x, y = batch(who, step)
            ref.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for p, *gs in zip(ref.parameters(), *grads, strict=True):
            p.grad = sum(gs) / len(gs)
        opt.step()
    return [p.detach().clone() for p in ref.parameters()]


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_everywhere(model: torch.nn.Module, what: str) -> None:
    """The parameters are bit for bit the same on every rank of the default group."""
    mine = flat(model)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    for r, theirs in enumerate(every):
        assert torch.equal(theirs, mine), f"{what}: rank {r}'s parameters differ"


def check_sum(whos: list[int]) -> None:
    """all_reduce on the default group: the ranks that started as ``whos``."""
    t = torch.full((5,), float(START + 1))
    dist.all_reduce(t)
    want = float(sum(w + 1 for w in whos))
    assert torch.equal(t, torch.full((5,), want)), (t, want)
    t = torch.tensor([float(START)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert t.item() == max(whos), t


def scenario_kill() -> None:
    """Rank 1 kills itself (SIGKILL) between two DDP steps; the survivors' next
    collective raises PeerFailureError, and so does a DDP step; they shrink_group([1])
    and go on: ranks 0 and 1 (which started as 2), all_reduce, a new DDP on the shrunk
    default group whose parameters match a single-process reference and stay equal on
    both. Then the rank that started as 2 dies too: rank 0 is told that its rank 1 died,
    and shrinks the shrunk group to itself."""
    victim, lr = 1, 0.1
    model = model_()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    for step in range(3):
        ddp_step(ddp, opt, START, step)
    same_everywhere(model, "3 ranks")
    check_sum([0, 1, 2])
    if START == victim:
        say(f"VICTIM {START} dies")
        os.kill(os.getpid(), signal.SIGKILL)
    old = dist.group.WORLD
    t = torch.ones(4)
    try:
        dist.all_reduce(t)
    except PeerFailureError as exc:
        assert exc.peer == victim and isinstance(exc, ucxcomm.PeerFailure), exc
        say(f"RAISED rank {START}: {exc}")
    else:
        raise AssertionError("the all_reduce completed without the dead rank")
    try:  # a DDP step on the broken group raises too (at its first collective)
        ddp_step(ddp, opt, START, 3)
    except PeerFailureError as exc:
        assert exc.peer == victim, exc
    else:
        raise AssertionError("a DDP step completed without the dead rank")
    before = flat(model)

    new = dist.shrink_group([victim])

    assert new is dist.group.WORLD and new is not old
    rank, size = dist.get_rank(), dist.get_world_size()
    assert (size, rank) == (2, {0: 0, 2: 1}[START]), (size, rank)
    assert dist.get_backend() == "ucxcomm" and new.size() == 2
    say(f"SHRUNK rank {START}: now rank {rank} of {size}")
    check_sum([0, 2])
    try:  # the old group is gone
        old.allreduce([torch.ones(1)])
    except WorkError as exc:
        assert "shrink_group" in str(exc) or "shut down" in str(exc), exc
    else:
        raise AssertionError("the old group took an all_reduce after the shrink")
    # DDP goes on: a new DDP over the same model on the shrunk default group.
    del ddp, opt
    assert torch.equal(flat(model), before)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    want = reference(model, [0, 2], range(3, 8), lr)
    for step in range(3, 8):
        ddp_step(ddp, opt, START, step)
    for p, w in zip(model.parameters(), want, strict=True):
        assert torch.allclose(p.detach(), w, rtol=1e-5, atol=1e-6), (p - w).abs().max()
    same_everywhere(model, "2 ranks")
    assert not torch.equal(flat(model), before)
    say(f"DDP rank {START}: 5 steps on 2 ranks match the reference")
    # A second death, in the shrunk group: the rank that started as 2 (rank 1 now).
    dist.barrier()
    if START == 2:
        say(f"VICTIM {START} dies")
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(torch.ones(3))
    except PeerFailureError as exc:
        assert exc.peer == 1 and "rank 1 " in str(exc), exc  # (its rank in this group)
        say(f"RAISED AGAIN rank {START}: {exc}")
    else:
        raise AssertionError("the all_reduce completed without the dead rank")
    dist.shrink_group([1])
    assert (dist.get_world_size(), dist.get_rank()) == (1, 0)
    check_sum([0])
    say(f"ALONE rank {START}")


def scenario_args() -> None:
    """No death. Arguments torch refuses, and ours (pg_options, rank 0), change
    nothing; nor does a shrink_group that every rank takes part in, each excluding
    another (ShrinkMismatchError, nothing gone). Then rank 2 leaves
    (destroy_process_group, exit 0) without a failure; ranks 0 and 1 exclude different
    ranks ([1] and [2]): both raise ShrinkMismatchError naming [2], no group is made;
    shrink_group(exc.gone) then works on both."""
    size = dist.get_world_size()
    other = (START + 1) % size
    refused = [([], ValueError), ([size], ValueError), ([other, other], ValueError),
               ([START], RuntimeError), ((other,), TypeError)]
    for bad, kind in refused:
        try:
            dist.shrink_group(bad)  # type: ignore[arg-type]
        except kind:
            pass
        else:
            raise AssertionError(f"shrink_group({bad!r}) raised nothing")
    for opts, kind in ((object(), TypeError), (None, ValueError)):
        try:
            dist.shrink_group([other], pg_options=opts,
                              shrink_flags=7 if opts is None else 0)
        except kind as exc:
            assert opts is None or "pg_options" in str(exc), exc
        else:
            raise AssertionError("bad pg_options / shrink_flags raised nothing")
    if START != 0:
        try:
            dist.shrink_group([0])
        except ucxcomm.UnsupportedError as exc:
            assert "rank 0" in str(exc) and isinstance(exc, RuntimeError), exc
        else:
            raise AssertionError("shrink_group([0]) raised nothing")
    check_sum([0, 1, 2])  # (the group is intact)
    # Each excludes another rank, and all take part: none is gone.
    try:
        dist.shrink_group([{0: 1, 1: 2, 2: 1}[START]])
    except ShrinkMismatchError as exc:
        assert exc.gone == [] and "none is gone" in str(exc), (exc.gone, exc)
        say(f"NONE GONE rank {START}")
    else:
        raise AssertionError("shrink_group excluded a rank that took part")
    check_sum([0, 1, 2])  # (still intact)
    if START == 2:
        dist.destroy_process_group()
        say("LEFT rank 2")
        return
    try:
        dist.shrink_group([1] if START == 0 else [2])
    except ShrinkMismatchError as exc:
        assert exc.gone == [2] and isinstance(exc, ValueError), (exc.gone, exc)
        say(f"MISMATCH rank {START}: {exc}")
        gone = exc.gone
    else:
        raise AssertionError("different ranks_to_exclude raised nothing")
    check = dist.group.WORLD
    dist.shrink_group(gone, shrink_flags=dist.distributed_c10d.SHRINK_ABORT)
    assert dist.group.WORLD is not check and dist.get_world_size() == 2
    assert dist.get_rank() == START
    say(f"SHRUNK rank {START}: now rank {dist.get_rank()} of 2")
    check_sum([0, 1])
    dist.barrier()


def scenario_timeout() -> None:
    """No death: ranks 0 and 1 exclude rank 2, which stays (in a recv from rank 0).
    Their shrink_group, bounded by pg_options' 3 s, raises WorkTimeoutError saying that
    rank 2 is still alive, on both; the group refuses another shrink and collectives.
    Then rank 0 releases rank 2 (point-to-point still works)."""
    if START == 2:
        t = torch.zeros(1)
        dist.recv(t, src=0)
        assert t.item() == 7.0, t
        say("RELEASED rank 2")
        return
    start = time.monotonic()
    try:
        dist.shrink_group([2], pg_options=Backend.Options("ucxcomm", timedelta(seconds=3)))
    except WorkTimeoutError as exc:
        took = time.monotonic() - start
        assert "rank 2 is still alive" in str(exc) and 2.9 < took < 30, (took, exc)
        say(f"TIMED-OUT rank {START} after {took:.1f} s: {exc}")
    else:
        raise AssertionError("shrink_group decided without rank 2 leaving")
    for call in (lambda: dist.shrink_group([2]), lambda: dist.all_reduce(torch.ones(1))):
        try:
            call()
        except WorkError as exc:
            assert "unusable" in str(exc), exc
        else:
            raise AssertionError("the group went on after a timed-out shrink_group")
    assert dist.get_world_size() == 3
    # Rank 0 releases rank 2 once rank 1 has timed out too (were rank 2 to leave
    # before, rank 1's shrink could still be decided, without it).
    if START == 1:
        dist.send(torch.ones(1), dst=0)
    else:
        dist.recv(torch.empty(1), src=1)
        dist.send(torch.full((1,), 7.0), dst=2)


SCENARIOS = {"kill": scenario_kill, "args": scenario_args, "timeout": scenario_timeout}


def main() -> None:
    global START
    faulthandler.dump_traceback_later(80, exit=True)  # (a hang shows where, then ends)
    name = sys.argv[1]
    dist.init_process_group("ucxcomm", timeout=TIMEOUT)
    START = dist.get_rank()
    SCENARIOS[name]()
    if dist.is_initialized():
        dist.destroy_process_group()
    say(f"SHRINK-OK {name} rank {START}")


START = -1  # this rank's rank when the job started

if __name__ == "__main__":
    main()
