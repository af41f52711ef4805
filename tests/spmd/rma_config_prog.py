"""One-sided traffic follows the transport plan and the user's UCX options (the RMA
engines are built from the same configuration as the tag context). Run:
``ucxcomm run -n 2 python tests/spmd/rma_config_prog.py MODE``; MODE is ``ucx_config``
(``init(ucx_config={"TLS": "tcp,self"})``) or ``tcp`` (``init(transport="tcp")``). Each
rank prints ``RMA-LANES {json}``: its window's lanes per peer, the tag lanes, and the
options its RMA engines were built with."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

import ucxcomm


async def main(mode: str) -> None:
    kwargs = {"ucx_config": {"TLS": "tcp,self"}} if mode == "ucx_config" else \
        {"transport": "tcp"}
    comm = await ucxcomm.init(**kwargs)
    win = await ucxcomm.Win.Allocate(comm, 64, disp_unit=8)
    peer = (comm.rank + 1) % comm.size
    await win.Put(np.full(1, 7, np.int64), peer, 1 + comm.rank)  # traffic really flows
    assert await win.Fetch_and_op(1, peer, 0) >= 0
    await win.Fence()
    assert win.memory.view(np.int64)[1 + (comm.rank - 1) % comm.size] == 7
    engines = comm.group.transport._rma.local()  # white box: what UCX was configured with
    report = {"rank": comm.rank,
              "rma": {str(r): lanes for r, lanes in win.transport_info().items()},
              "tag": {str(r): lanes for r, lanes in comm.transport_info().items()},
              "rma_options": [e.options for e in engines]}
    print("RMA-LANES " + json.dumps(report), flush=True)
    await win.Free()
    await ucxcomm.finalize()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
