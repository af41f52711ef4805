"""Worker addresses that pass ``wire.check_address`` must not crash UCX
(tests/test_fuzz.py runs this in its own process, so that a crash is a failed test).

    python tests/ucx_address_prog.py SEED COUNT

Takes the address of a real worker in another process (this script with ``--peer``),
mutates 1 to 3 bytes of it COUNT times, and for every mutation the check accepts,
creates a UCX endpoint to it (with and without UCX error handling), sends a message on
it and closes it. Prints ``TRIED <n>`` at the end; any crash shows as the exit status.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys

from ucxcomm.transport import _ucx
from ucxcomm.transport.wire import check_address
from ucxcomm.transport.worker import Worker


async def peer() -> None:
    worker = Worker()
    print(worker.address.hex(), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await worker.close()


def main(seed: int, count: int) -> None:
    proc = subprocess.Popen([sys.executable, __file__, "--peer"], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        real = bytes.fromhex(proc.stdout.readline().strip())
        asyncio.run(mutate(real, seed, count))
    finally:
        proc.kill()
        proc.wait()


async def mutate(real: bytes, seed: int, count: int) -> None:
    rnd = random.Random(seed)
    worker = Worker()
    try:
        tried = 0
        for _ in range(count):
            address = bytearray(real)
            for _ in range(rnd.randint(1, 3)):
                address[rnd.randrange(len(address))] = rnd.randrange(256)
            try:
                if check_address(bytes(address), worker.address, (worker.address,),
                                 os.getpid()):
                    continue
            except ValueError:
                continue
            tried += 1
            try:
                ep = worker.raw_endpoint(bytes(address), error_handling=bool(tried % 2))
            except ucxcomm_errors() as exc:
                print(f"refused by UCX: {type(exc).__name__}", flush=True)
                continue
            try:
                fut = worker.send(ep.handle, b"x", 1 << 40, None)
                if fut is not None:
                    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
                for _ in range(20):
                    worker.poll()
            except ucxcomm_errors():
                pass
            finally:
                _ucx.close_endpoint(ep)
        print(f"TRIED {tried}", flush=True)
    finally:
        worker.abort()


def ucxcomm_errors() -> tuple[type[BaseException], ...]:
    from ucxcomm import UcxCommError

    return (UcxCommError,)


if __name__ == "__main__":
    if sys.argv[1:] == ["--peer"]:
        asyncio.run(peer())
    else:
        main(int(sys.argv[1]), int(sys.argv[2]))
