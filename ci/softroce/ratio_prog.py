"""A small measurement for ci/softroce/run, two ranks on two soft-RoCE VMs: 8 B ping-pong
latency, 1 MiB bandwidth, Put+Flush and Fetch_and_op latency. Rank 0 prints
``RATIO {json}`` (medians, and the lanes used). Run once over rc_verbs and once over TCP
(``UCX_TLS=tcp,self``) in the same VMs: under TCG and a lossy UDP tunnel only the ratios
between the two mean anything.

``python ratio_prog.py LABEL [REPS]``: REPS round trips per latency sample (default 200).
(Rank 1 prints ``RATIO-PEER done``.) Over TCP the ranks need ``UCX_NET_DEVICES`` naming
the interface (the harness's ``UCXCOMM_DEVICES`` names the rxe port).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys

import numpy as np

import ucxcomm
from ucxcomm.bench.ranks_ucxcomm import timed_calls as bench_timed
from ucxcomm.bench.spec import Plan

PLAN = Plan(quick=True)  # 3 timed samples after one warm-up, as `ucxcomm bench --quick`
BW_MSGS = 4  # 1 MiB messages per bandwidth sample


async def main(label: str, reps: int) -> None:
    async with ucxcomm.init(timeout=120) as comm:
        assert comm.size == 2, "two ranks"
        me, other = comm.rank, 1 - comm.rank
        small = np.zeros(8, np.uint8)
        big = np.ones(1 << 20, np.uint8)
        ack = np.zeros(1, np.uint8)

        async def timed(body, n: int) -> list[float]:
            return await bench_timed(comm, PLAN, body, n)

        async def pingpong() -> None:
            if me == 0:
                await comm.Send(small, other)
                await comm.Recv(small, other)
            else:
                await comm.Recv(small, other)
                await comm.Send(small, other)

        async def stream() -> None:
            if me == 0:
                for _ in range(BW_MSGS):
                    await comm.Send(big, other, 1)
                await comm.Recv(ack, other, 2)
            else:
                for _ in range(BW_MSGS):
                    await comm.Recv(big, other, 1)
                await comm.Send(ack, other, 2)

        res: dict[str, float] = {}
        res["p2p_8B_lat_us"] = statistics.median(await timed(pingpong, reps)) / 2 * 1e6
        t = statistics.median(await timed(stream, 1))
        res["p2p_1MiB_MBps"] = BW_MSGS * big.nbytes / t / 1e6
        win = await ucxcomm.Win.Allocate(comm, 64, disp_unit=1)
        one = np.ones(1, np.int64)

        async def put_flush() -> None:
            await win.Put(one, 1, 0)
            await win.Flush(1)

        async def fetch_add() -> None:
            await win.Fetch_and_op(np.int64(1), 1, 8)

        for key, body in (("put_flush_8B_lat_us", put_flush), ("fetch_and_op_lat_us", fetch_add)):
            await comm.barrier()
            if me == 0:  # passive target: rank 1 waits in the barriers
                out = await bench_timed(comm, PLAN, body, reps, sync=False)
                res[key] = statistics.median(out) * 1e6
            await comm.barrier()
        rma_lanes = win.transport_info()[other]
        await win.Free()
        if me == 1:
            print("RATIO-PEER done", flush=True)
        else:
            print("RATIO " + json.dumps({"label": label, **res,
                                         "lanes": [f"{t}/{d}" for t, d in
                                                   comm.transport_info()[other]],
                                         "rma_lanes": [f"{t}/{d}" for t, d in rma_lanes]}),
                  flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200))
