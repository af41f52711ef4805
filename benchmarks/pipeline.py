"""Pipeline benchmark: a producer process streaming batches to a consumer process, on
ucxcomm streams (``ep.stream_writer``/``stream_reader``), raw ucxx in each of its
progress modes and asyncio TCP streams, measured in the same run.

    python benchmarks/pipeline.py [--quick] [--sizes 64K,1M,16M,64M] [--tcp] [--out f.jsonl]

For each implementation the driver starts a consumer (it listens) and a producer (it
connects); per batch size the producer sends ``count`` batches, the consumer answers one
byte after the last, and the producer records GB/s from its first send to that answer
(``--reps`` samples of about ``--volume`` MiB each; median, min, max). Consumers receive
into reused memory (ucxcomm: its stream's buffer pool; ucxx: one preallocated array;
asyncio: ``readexactly``, which allocates). ucxcomm sends a small header per batch
(dtype, shape) and credits back; the raw baselines send the data only, one message in
flight at a time (``await ep.send`` per message, as a ucxx user writes it).

Transports: raw ucxx endpoints from a listener have UCX peer error handling, which keeps
UCX on TCP; ucxcomm connections between processes of one host carry their messages over
a second endpoint from the peer's worker address (shared memory, CMA) and keep the
socket-address endpoint for failure detection (docs/pipelines.md). ``--tcp`` sets
``UCX_TLS=tcp,self`` for everyone. Reported ratios: ucxcomm over the fastest ucxx
progress mode and over asyncio, per size.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _driver  # noqa: E402

PEERS = str(HERE / "baselines" / "pipeline_peers.py")
IMPLS = ("ucxcomm", "ucxx-polling", "ucxx-blocking", "ucxx-thread", "asyncio")
DEFAULT_SIZES = "64K,1M,16M,64M"
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def schedule_for(sizes: list[int], volume: int, reps: int) -> str:
    """``size:count:reps,...``: ``count`` batches of each size make about ``volume``
    bytes per sample (at least 2, at most 4096 batches)."""
    return ",".join(f"{s}:{max(2, min(4096, volume // s))}:{reps}" for s in sizes)


# ----------------------------------------------------------------- ucxcomm roles
def _parse(schedule: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in item.split(":")) for item in schedule.split(",")]  # type: ignore[misc]


async def ucxcomm_consumer(schedule: list[tuple[int, int, int]], window: int) -> None:
    import ucxcomm

    done = asyncio.get_running_loop().create_future()

    async def handler(ep: ucxcomm.transport.Endpoint) -> None:
        async with ep.stream_reader(window=window) as rx:
            for _size, count, reps in schedule:
                for _ in range(reps):
                    for _ in range(count):
                        (await anext(rx)).release()
                    await ep.send(b"k", tag=1)
        await ep.recv(bytearray(1), tag=2)  # the producer's goodbye
        await ep.close()
        done.set_result(None)

    async with await ucxcomm.transport.listen(handler) as lst:
        print("PORT", lst.port, flush=True)
        await done


async def ucxcomm_producer(schedule: list[tuple[int, int, int]], port: int) -> None:
    import numpy as np

    import ucxcomm

    ep = await ucxcomm.transport.connect("127.0.0.1", port, timeout=60)
    print(f"# ucxcomm lanes: {ep.transport_info()}", file=sys.stderr, flush=True)
    ack = bytearray(1)
    tx = ep.stream_writer()
    for size, count, reps in schedule:
        buf = np.ones(size, np.uint8)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(count):
                await tx.send(buf)
            await ep.recv(ack, tag=1)
            samples.append(size * count / (time.perf_counter() - t0) / 1e9)
        _driver.bench_line({"impl": "ucxcomm", "op": "stream_GBps", "size": size,
                            "nranks": 2, "median": sorted(samples)[len(samples) // 2],
                            "min": min(samples), "max": max(samples)})
    await tx.close()
    await ep.send(b"k", tag=2)
    await ep.close()


# ------------------------------------------------------------------------ driver
def run_pair(impl: str, schedule: str, env: dict, timeout: float,
             window: int) -> list[dict]:
    """Start ``impl``'s consumer, then its producer; the producer's records."""
    if impl == "ucxcomm":
        base = [sys.executable, __file__]
        cons_cmd = [*base, "--role", "consumer", "--schedule", schedule, "--window", str(window)]
        prod_cmd = [*base, "--role", "producer", "--schedule", schedule, "--port"]
    else:
        cons_cmd = [sys.executable, PEERS, "consumer", impl, schedule]
        prod_cmd = [sys.executable, PEERS, "producer", impl, schedule]
    print(f"$ {impl}", file=sys.stderr, flush=True)
    consumer = subprocess.Popen(cons_cmd, env=env, stdout=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)
    try:
        assert consumer.stdout is not None
        line = "-"
        while line and not line.startswith("PORT "):  # (UCX may log to stdout first)
            line = consumer.stdout.readline()
        if not line:
            print(f"  {impl}: the consumer did not start", file=sys.stderr)
            return []
        port = line.split()[1]
        recs = _driver.run_bench([*prod_cmd, port], env, timeout=timeout)
        consumer.wait(timeout=60)
        return recs
    except subprocess.TimeoutExpired:
        print(f"  {impl}: the consumer did not finish", file=sys.stderr)
        return []
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()


def report(results: list[dict], sizes: list[int]) -> None:
    print("\nstream throughput, GB/s (median):")
    impls = [i for i in IMPLS if any(r["impl"] == i for r in results)]
    print(f"  {'size':>10s} " + " ".join(f"{i:>14s}" for i in impls))
    for size in sizes:
        row = [_driver.median_of(results, i, "stream_GBps", size) for i in impls]
        print(f"  {size:>10d} " + " ".join(f"{v:14.3f}" if v is not None else
                                            f"{'-':>14s}" for v in row))
    figures: dict[str, float] = {}
    for size in sizes:
        ours = _driver.median_of(results, "ucxcomm", "stream_GBps", size)
        ucxx = [v for i in IMPLS if i.startswith("ucxx-")
                if (v := _driver.median_of(results, i, "stream_GBps", size)) is not None]
        plain = _driver.median_of(results, "asyncio", "stream_GBps", size)
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
    p.add_argument("--role", choices=("consumer", "producer"), help=argparse.SUPPRESS)
    p.add_argument("--schedule", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "consumer":
        asyncio.run(ucxcomm_consumer(_parse(args.schedule), args.window))
        return 0
    if args.role == "producer":
        asyncio.run(ucxcomm_producer(_parse(args.schedule), args.port))
        return 0
    sizes_text = args.sizes or ("64K,1M" if args.quick else DEFAULT_SIZES)
    sizes = [parse_size(s) for s in sizes_text.split(",")]
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
        results += run_pair(impl, schedule, env, 120 if args.quick else 900, args.window)
    _driver.record(results, "tcp" if args.tcp else "default", args.out)
    report(results, sizes)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
