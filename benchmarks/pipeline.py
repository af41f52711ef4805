"""Pipeline benchmark: a producer process streaming batches to a consumer process, on
ucxcomm streams (``ep.stream_writer``/``stream_reader``), raw ucxx in each of its
progress modes and asyncio TCP streams, measured in the same run.

    python benchmarks/pipeline.py [--quick] [--sizes 64K,1M,16M,64M] [--tcp] [--out f.jsonl]

For each implementation the driver starts a consumer (it listens) and a producer (it
connects), the programs of ``ucxcomm.bench.ranks_pipeline`` (also behind ``ucxcomm bench
pipeline``, which alternates implementations per size); per batch size the producer
sends ``count`` batches, the consumer answers one byte after the last, and the producer
records GB/s from its first send to that answer
(``--reps`` samples of about ``--volume`` MiB each; median, min, max). Consumers receive
into reused memory (ucxcomm: its stream's buffer pool; ucxx: one preallocated array;
asyncio: ``readexactly``, which allocates). ucxcomm sends a small header per batch
(dtype, shape) and credits back; the raw baselines send the data only, one message in
flight at a time (``await ep.send`` per message, as a ucxx user writes it).

Transports: raw ucxx endpoints from a listener have UCX peer error handling, which keeps
UCX on TCP; ucxcomm connections between processes of one host carry their messages over
an endpoint from the peer's worker address without it (shared memory, CMA) and watch the
handshake's TCP connection for failure detection (docs/pipelines.md). ``--tcp`` sets
``UCX_TLS=tcp,self`` for everyone. Reported ratios: ucxcomm over the fastest ucxx
progress mode and over asyncio, per size.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _driver  # noqa: E402

from ucxcomm.bench.ranks_pipeline import run_pair, schedule_for  # noqa: E402
from ucxcomm.bench.spec import parse_sizes  # noqa: E402

IMPLS = ("ucxcomm", "ucxx-polling", "ucxx-blocking", "ucxx-thread", "asyncio")
DEFAULT_SIZES = "64K,1M,16M,64M"


def report(results: list[dict], sizes: list[int]) -> None:
    print("\nstream throughput, GB/s (median):")
    impls = [i for i in IMPLS if any(r["impl"] == i for r in results)]
    print(f"  {'size':>10s} " + " ".join(f"{i:>14s}" for i in impls))
    for size in sizes:
        row = [_driver.median_of(results, i, "stream", size) for i in impls]
        print(f"  {size:>10d} " + " ".join(f"{v:14.3f}" if v is not None else
                                            f"{'-':>14s}" for v in row))
    figures: dict[str, float] = {}
    for size in sizes:
        ours = _driver.median_of(results, "ucxcomm", "stream", size)
        ucxx = [v for i in IMPLS if i.startswith("ucxx-")
                if (v := _driver.median_of(results, i, "stream", size)) is not None]
        plain = _driver.median_of(results, "asyncio", "stream", size)
        if ours is not None and ucxx:
            figures[f"ucxcomm / fastest ucxx @ {size}"] = round(ours / max(ucxx), 3)
        if ours is not None and plain:
            figures[f"ucxcomm / asyncio @ {size}"] = round(ours / plain, 3)
    _driver.print_ratios(figures)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 64K and 1M batches, 16 MiB per sample, 2 samples")
    p.add_argument("--sizes", default=None, help=f"batch sizes (default {DEFAULT_SIZES})")
    p.add_argument("--impls", default=",".join(IMPLS), help="which implementations")
    p.add_argument("--window", type=int, default=8, help="ucxcomm stream window")
    p.add_argument("--volume", type=int, default=None,
                   help="MiB per sample (default 256; 16 with --quick)")
    p.add_argument("--reps", type=int, default=None,
                   help="samples per size (default 3; 2 with --quick)")
    p.add_argument("--tcp", action="store_true", help="UCX_TLS=tcp,self")
    p.add_argument("--out", help="append JSON lines to this file")
    args = p.parse_args()
    sizes_text = args.sizes or ("64K,1M" if args.quick else DEFAULT_SIZES)
    sizes = parse_sizes(sizes_text)
    volume = (args.volume or (16 if args.quick else 256)) << 20
    schedule = schedule_for(sizes, volume, args.reps or (2 if args.quick else 3))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(tuple(_driver.LAUNCHER_VARS))}
    if args.tcp:
        env["UCX_TLS"] = "tcp,self"
    results: list[dict] = []
    for impl in args.impls.split(","):
        if impl not in IMPLS:
            p.error(f"unknown implementation {impl} (one of {', '.join(IMPLS)})")
        print(f"$ {impl}", file=sys.stderr, flush=True)
        recs, err = run_pair(impl, schedule, env, 120 if args.quick else 900, args.window)
        if err:
            print(f"  {impl}: {err}", file=sys.stderr)
        results += recs
    for r in results:  # the pairs are started unbound (ucxcomm.bench.ranks_pipeline.run_pair)
        r["bound"] = False
    _driver.record(results, "tcp" if args.tcp else "default", args.out)
    report(results, sizes)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
