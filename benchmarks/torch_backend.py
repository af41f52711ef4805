"""torch.distributed benchmark: the ``ucxcomm`` backend against ``gloo`` in the same run.

all_reduce (float32, 8 B .. 64 MiB, in place) and one DDP training step of an MLP, over
both backends with torchrun's variables (the ranks are started by ``ucxcomm run``, which
exports them; ``init_process_group(backend)`` reads them). This is ``ucxcomm bench torch``
(programs in ``ucxcomm.bench.ranks_torch``; backends alternate at every size) plus the
ratios the torch issue tracks:

    python benchmarks/torch_backend.py [-n 2] [--quick] [--tcp] [--out results.jsonl]

Times are the slowest rank's per call (microseconds; median of 5 samples, 3 with
``--quick``); ratios are gloo / ucxcomm (above 1: ucxcomm is faster).
"""

from __future__ import annotations

import argparse
import sys

from ucxcomm.bench import driver


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--quick", action="store_true", help="smoke run: small sizes")
    parser.add_argument("--tcp", action="store_true",
                        help="UCX_TLS=tcp,self and UCX_NET_DEVICES=lo for ucxcomm")
    parser.add_argument("--out", help="write JSON lines to this file")
    args = parser.parse_args()
    opts = driver.Options(suites=["torch"], nranks=args.n, quick=args.quick,
                          compare=["gloo"], transport="tcp" if args.tcp else "shm",
                          json_out=args.out)
    records = driver.run(opts)
    print(driver.table(records))
    print("\nratios gloo / ucxcomm (> 1: ucxcomm faster):")
    mine = {(r["op"], r["size"]): r["median"] for r in records if r["impl"] == "ucxcomm"}
    for r in records:
        ours = mine.get((r["op"], r["size"]))
        if r["impl"] == "gloo" and ours:
            print(f"  {r['op']:10s} {r['size']:>10d} B  {r['median'] / ours:8.2f}")
    ops = {r["op"] for r in records if r["impl"] == "ucxcomm"}
    if ops != {"all_reduce", "ddp_step"}:
        print(f"incomplete: ucxcomm measured {sorted(ops)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
