"""One-sided traffic follows the transport plan and the user's UCX options (the RMA
engines are built from the same configuration as the tag context). Run:
``ucxcomm run -n 2 python tests/spmd/rma_config_prog.py MODE``; MODE is ``ucx_config``
(``init(ucx_config={"TLS": "tcp,self"})``), ``tcp`` (``init(transport="tcp")``) or
``default`` (``init()``). Each rank prints ``RMA-LANES {json}``: its window's lanes per
peer, the tag lanes, the options its RMA engines were built with, and per peer whether
atomics reach the allocated window (and a window over a numpy array) directly."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

import ucxcomm


async def main(mode: str) -> None:
    # ucx_config over TCP under transport "auto" whatever the suite exports: an inherited
    # UCXCOMM_TRANSPORT=rdma refuses a TCP-only peer (as ucxcomm.testing.OVER_TCP says).
    kwargs = {"ucx_config": {"ucx_config": {"TLS": "tcp,self"}, "transport": "auto"},
              "tcp": {"transport": "tcp"}, "default": {}}[mode]
    comm = await ucxcomm.init(**kwargs)
    win = await ucxcomm.Win.Allocate(comm, 64, disp_unit=8)
    peer = (comm.rank + 1) % comm.size
    await win.Put(np.full(1, 7, np.int64), peer, 1 + comm.rank)  # traffic really flows
    assert await win.Fetch_and_op(1, peer, 0) >= 0
    await win.Fence()
    assert win.memory.view(np.int64)[1 + (comm.rank - 1) % comm.size] == 7
    created = await ucxcomm.Win.Create(comm, np.zeros(8, np.int64), disp_unit=8)
    assert await created.Fetch_and_op(1, peer, 0) >= 0
    engines = comm.group.transport._rma.local()  # white box: what UCX was configured with
    report = {"rank": comm.rank,
              "rma": {str(r): lanes for r, lanes in win.transport_info().items()},
              "tag": {str(r): lanes for r, lanes in comm.transport_info().items()},
              "rma_options": [e.options for e in engines],
              # white box: atomics done on the memory directly (no target thread)
              "direct": {str(r): m.direct for r, m in enumerate(win._mem)},
              "direct_created": {str(r): m.direct for r, m in enumerate(created._mem)}}
    print("RMA-LANES " + json.dumps(report), flush=True)
    await created.Free()
    await win.Free()
    await ucxcomm.finalize()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
