"""torch.distributed benchmark: the ``ucxcomm`` backend against ``gloo`` in the same run.

all_reduce (float32, 8 B .. 64 MiB, in place) and one DDP training step of an MLP, each
timed over both backends with torchrun's variables (the ranks are started by
``ucxcomm run``, which exports them; ``init_process_group(backend)`` reads them).

    python benchmarks/torch_backend.py [-n 2] [--quick] [--out results.jsonl]

Prints one JSON line per (impl, op, size, nranks) with median/min/max in microseconds
(the slowest rank's time per call, per sample), then gloo / ucxcomm ratios (above 1:
ucxcomm is faster). ``--quick`` is a smoke run with small sizes and few iterations.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _driver import bench_line, print_ratios, ratios, record, run_bench

SIZES = [8, 64, 512, 4096, 32768, 262144, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [8, 4096, 1 << 20]
BACKENDS = ["ucxcomm", "gloo"]
LAUNCHER_VARS = ("UCXCOMM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 "MASTER_", "TORCHELASTIC")


def _iters(size: int, quick: bool) -> int:
    k = 400 if size <= 4096 else 100 if size <= 65536 else 20 if size <= (1 << 20) else 4
    return max(2, k // 10) if quick else k


def _slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (over gloo, so neither backend times
    itself with its own collective)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_TIMING)
    return float(t)


_TIMING = None


def _emit(impl: str, op: str, size: int, nranks: int, samples: list[float]) -> None:
    us = [s * 1e6 for s in samples]
    bench_line({"impl": impl, "op": op, "size": size, "nranks": nranks,
                "median": statistics.median(us), "min": min(us), "max": max(us)})


def rank_main(args: argparse.Namespace) -> None:
    """One rank: time all_reduce and a DDP step over ``args.backend``."""
    global _TIMING
    import torch
    import torch.distributed as dist
    from torch import nn

    import ucxcomm.torch  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    _TIMING = dist.new_group(backend="gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    impl = f"torch-{args.backend}"
    reps = 3 if args.quick else 5
    for size in (QUICK_SIZES if args.quick else SIZES):
        t = torch.ones(max(1, size // 4), dtype=torch.float32)
        k = _iters(size, args.quick)
        for _ in range(max(1, k // 10)):  # warm up (connections, scratch)
            dist.all_reduce(t)
        samples = []
        for _ in range(reps):
            dist.barrier(group=_TIMING)
            t0 = time.perf_counter()
            for _ in range(k):
                dist.all_reduce(t)
            samples.append(_slowest((time.perf_counter() - t0) / k))
        if rank == 0:
            _emit(impl, "all_reduce", size, p, samples)

    # A DDP step: forward, backward (gradients all-reduced in buckets, overlapped with
    # the backward pass), optimizer step.
    width = 256 if args.quick else 1024
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                          nn.ReLU(), nn.Linear(width, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(32, width), torch.randint(0, 10, (32,))
    nbytes = sum(q.numel() * q.element_size() for q in model.parameters())

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    steps = 3 if args.quick else 20
    for _ in range(2):
        step()
    samples = []
    for _ in range(reps):
        dist.barrier(group=_TIMING)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        samples.append(_slowest((time.perf_counter() - t0) / steps))
    if rank == 0:
        _emit(impl, "ddp_step", nbytes, p, samples)
    dist.destroy_process_group()


def measure(args: argparse.Namespace, env: dict) -> list[dict]:
    py = sys.executable
    results: list[dict] = []
    for backend in BACKENDS:
        cmd = [py, "-m", "ucxcomm.cli", "run", "-n", str(args.n), "--timeout",
               str(300 if args.quick else 1800), py, str(Path(__file__).resolve()),
               "--rank", "--backend", backend]
        if args.quick:
            cmd.append("--quick")
        results += run_bench(cmd, env)
    return results


def report(args: argparse.Namespace, results: list[dict]) -> None:
    sizes = sorted({r["size"] for r in results if r["op"] == "all_reduce"})
    pairs = [(f"all_reduce {s} B: gloo / ucxcomm", ("torch-gloo", "all_reduce", s),
              ("torch-ucxcomm", "all_reduce", s)) for s in sizes]
    pairs.append(("ddp_step: gloo / ucxcomm", ("torch-gloo", "ddp_step"),
                  ("torch-ucxcomm", "ddp_step")))
    print_ratios(ratios(results, pairs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="ucxcomm", help=argparse.SUPPRESS)
    parser.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--quick", action="store_true", help="smoke run: small sizes")
    parser.add_argument("--tcp", action="store_true", help="UCX_TLS=tcp,self for ucxcomm")
    parser.add_argument("--out", help="append JSON lines to this file")
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return 0
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    if args.tcp:
        env["UCX_TLS"] = "tcp,self"
    results = measure(args, env)
    record(results, "tcp" if args.tcp else "default", args.out)
    report(args, results)
    expected = 2 * (len(QUICK_SIZES if args.quick else SIZES) + 1)
    if len(results) != expected:
        print(f"incomplete: {len(results)} of {expected} records", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
