"""A listener under attack (tests/test_security.py): a separate process, so that its
memory and descriptors are its own to measure, and so that a crash is a dead process.

    python tests/security_prog.py MODE [--token T] [--host H] [--timeout S]

Prints ``PORT <n>``, then one ``EVENT <json>`` line per thing a handler saw (an object,
a batch, a signal, an error by class and message). Commands on stdin: ``stats`` prints
``STATS <json>`` (RSS, address space, open descriptors, handler calls, whether UCX holds
a message nobody received), ``exit`` ends.

Modes (what each connection's handler does):

* ``obj``: receive objects until an error (default codec: the connection's);
* ``stream``: read stream 0 (window 4), summing each batch;
* ``hold``: open a reader of stream 0 (window 4) and read nothing (a slow consumer),
  waiting for a message on tag 1 that never comes;
* ``region``: send the key of a 64 KiB region of its own, receive the peer's, then
  ``put_signal`` 4 KiB of 0xAB at offset 0 (and check its own region is untouched);
* ``signal``: register 4 KiB, send its key, then receive signals until an error;
* ``idle``: wait for a message on tag 1 that never comes (floods go elsewhere);
* ``noclose``: receive one object and return without closing the endpoint (the docs'
  shortest handler).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys

import numpy as np

import ucxcomm
from ucxcomm.transport import listen

calls = 0
listener = None


def event(**fields: object) -> None:
    print("EVENT " + json.dumps(fields, default=str), flush=True)


def stats() -> dict:
    gc.collect()  # (what is kept, not garbage the collector has not reached yet)
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmSize"):
                status[key] = int(value.split()[0]) * 1024
    worker = listener._worker
    return {"rss": status["VmRSS"], "vm": status["VmSize"],
            "fds": len(os.listdir("/proc/self/fd")), "calls": calls,
            # messages UCX holds that nobody received (any tag): 1 or 0
            "unreceived": int(worker.probe(0, 0) is not None),
            "endpoints": len(worker.endpoints), "address": worker.address.hex(),
            "tcp_listening": tcp_listening()}


def tcp_listening() -> list[str]:
    """The local addresses of this process's listening TCP sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for name in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{name}") as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    ip = fields[1].split(":")[0]
                    if name == "tcp":
                        ip = ".".join(str(b) for b in bytes.fromhex(ip)[::-1])
                    else:
                        ip = "::1" if ip == "0" * 31 + "1" or \
                            ip == "00000000000000000000000001000000" else ip
                    found.append(ip)
    return found


async def handle(mode: str, ep: ucxcomm.pipes.Connection) -> None:
    global calls
    calls += 1
    try:
        if mode == "obj":
            while True:
                obj = await ep.recv_obj()
                event(kind="obj", type=type(obj).__name__, repr=repr(obj)[:200])
        elif mode == "stream":
            async with ep.stream_reader(window=4) as rx:
                async for batch in rx:
                    with batch:
                        event(kind="batch", seq=batch.seq,
                              sums=[float(np.asarray(a, dtype=np.float64).sum())
                                    for a in batch], meta=repr(batch.meta)[:200])
                event(kind="end")
        elif mode == "region":
            canary = np.full(1 << 16, 7, np.uint8)
            region = ucxcomm.transport.default_worker().register(canary)
            await ep.send_region(region)
            remote = await ep.recv_remote_memory()
            event(kind="remote", direct=remote.direct, nbytes=remote.nbytes)
            try:
                await ep.put_signal(remote, np.full(4096, 0xAB, np.uint8), 0, value=1)
                event(kind="put", canary_intact=bool((canary == 7).all()))
            finally:
                region.close()
        elif mode == "signal":
            worker = ucxcomm.transport.default_worker()
            buf = np.zeros(4096, np.uint8)
            region = worker.register(buf)
            await ep.send_region(region)
            while True:
                sig = await ep.recv_signal()
                event(kind="signal", signal=list(sig))
        elif mode == "hold":
            async with ep.stream_reader(window=4):
                await ep.recv(bytearray(8), tag=1)
        elif mode == "idle":
            await ep.recv(bytearray(8), tag=1)
        elif mode == "noclose":
            obj = await ep.recv_obj()
            event(kind="obj", type=type(obj).__name__, repr=repr(obj)[:200])
            return
        else:  # pragma: no cover - a typo in a test
            raise SystemExit(f"unknown mode {mode}")
    except ucxcomm.UcxCommError as exc:
        event(kind="error", error=type(exc).__name__, msg=str(exc)[:300])
    await ep.close()


async def main(args: argparse.Namespace) -> None:
    global listener
    lst = listener = await listen(lambda ep: handle(args.mode, ep), 0, host=args.host,
                       token=args.token, timeout=args.timeout)
    print(f"PORT {lst.port}", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = (await reader.readline()).decode().strip()
        if line == "stats":
            print("STATS " + json.dumps(stats()), flush=True)
        elif line in ("exit", ""):
            break
    await lst.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode")
    p.add_argument("--token", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--timeout", type=float, default=10.0)
    asyncio.run(main(p.parse_args()))
