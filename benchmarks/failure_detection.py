"""What failure detection costs: UCX peer error handling vs ucxcomm's store watch.

Run: ``ucxcomm run -n 2 python benchmarks/failure_detection.py``

1. Raw ucxx endpoints from worker addresses, without and with UCX peer error handling:
   the lanes UCX picks and the 64 MiB bandwidth it then gets (error handling pins the
   endpoint to TCP).
2. ucxcomm (no UCX error handling, shared memory kept): rank 1 exits without closing;
   how long until rank 0's pending ``Recv`` raises ``PeerFailure``.
"""

import asyncio
import json
import os
import tempfile
import time

import numpy as np

import ucxcomm


def raw_endpoint_bandwidth(comm, peer_address, worker, error_handling):
    import ucxx._lib.libucxx as ucx_lib
    from ucxx._lib.arr import Array

    from ucxcomm.transport import _ucx

    ep = worker.create_endpoint_from_worker_address(
        ucx_lib.UCXAddress.create_from_buffer(peer_address), error_handling)

    def wait(req):
        while not req.completed:
            worker.progress()
        req.check_error()

    small, tag, sync = Array(np.zeros(1, np.uint8)), ucx_lib.UCXXTag(1), ucx_lib.UCXXTag(2)

    def handshake():
        wait(ep.tag_send(small, sync))
        wait(worker.tag_recv(Array(np.zeros(1, np.uint8)), sync, ucx_lib.UCXXTagMaskFull))

    handshake()
    lanes = [f"{t}/{d}" for t, d in _ucx.endpoint_transports(ep.handle)]
    big = Array(np.ones(64 << 20, np.uint8))
    samples = []
    for rep in range(5):
        handshake()
        t0 = time.perf_counter()
        if comm.rank == 0:
            wait(ep.tag_send(big, tag))
        else:
            wait(worker.tag_recv(big, tag, ucx_lib.UCXXTagMaskFull))
        handshake()
        if rep:
            samples.append((64 << 20) / (time.perf_counter() - t0) / 1e9)
    return lanes, float(np.median(samples))


def _write_stamp(path: str, t: float) -> None:
    with open(path, "w") as f:
        f.write(repr(t))


def _read_stamp(path: str) -> float:
    with open(path) as f:
        t = float(f.read())
    os.unlink(path)
    return t


async def main() -> None:
    import ucxx._lib.libucxx as ucx_lib

    comm = await ucxcomm.init()
    assert comm.size == 2, "run with ucxcomm run -n 2"
    other = 1 - comm.rank
    for error_handling in (False, True):
        feats = ucx_lib.Feature
        ctx = ucx_lib.UCXContext({}, feature_flags=(feats.TAG, feats.WAKEUP))
        worker = ucx_lib.UCXWorker(ctx, enable_delayed_submission=False,
                                   enable_python_future=False)
        peer = await comm.sendrecv(bytes(worker.address), other)
        await comm.barrier()
        lanes, gbs = raw_endpoint_bandwidth(comm, peer, worker, error_handling)
        if comm.rank == 0:
            print("BENCH " + json.dumps({"impl": "ucxx-lowlevel", "op": "bandwidth_GBps",
                                         "size": 64 << 20, "ucx_error_handling": error_handling,
                                         "lanes": lanes, "median": gbs}), flush=True)
        await comm.barrier()
    # Detection: rank 1 dies (no close); rank 0 waits in Recv for it.
    stamp = os.path.join(tempfile.gettempdir(), f"ucxcomm-death-{os.getppid()}")
    await comm.barrier()
    if comm.rank == 1:
        _write_stamp(stamp, time.time())
        os._exit(0)
    try:
        await comm.Recv(np.empty(1), 1, tag=1, timeout=30)
    except ucxcomm.PeerFailure:
        detected = time.time()
        died = _read_stamp(stamp)
        print("BENCH " + json.dumps({"impl": "ucxcomm", "op": "peer_failure_detection_ms",
                                     "lanes": [f"{t}/{d}" for t, d in
                                               comm.transport_info()[1]],
                                     "median": 1000 * (detected - died)}), flush=True)
    comm.abort()


if __name__ == "__main__":
    asyncio.run(main())
