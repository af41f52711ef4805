"""A failed ``init_process_group("ucxcomm")`` leaves nothing of ours behind (run by
tests/test_torch.py::test_failed_join_leaks_nothing in a process of its own).

Two failures, each at a different step of forming the group: rank 0 of 2 whose peer
never publishes its address (the c10d store's wait runs out), and rank 1 of 2 whose
rank 0's liveness store accepts the connection but never answers. After
each: no thread and no file descriptor more than before (the liveness store's
connection included), and then a group that can form does, works and is destroyed.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

import ucxcomm.torch  # noqa: F401  (registers the backend)
from ucxcomm.torch.process_group import create_process_group


def fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # (the listing's own descriptor, closed meanwhile)
            pass
    return out


def threads() -> set[str]:
    return {f"{t.name}:{t.ident}" for t in threading.enumerate()}


def check_clean(what: str, fds0: set[str], threads0: set[str]) -> None:
    # The transport's UCX handles sit in reference cycles (as any closed worker's), freed
    # by the collector: what must not stay is anything still reachable or running.
    gc.collect()
    extra_threads = threads() - threads0
    extra_fds = fds() - fds0
    assert not extra_threads, f"{what}: threads left behind: {sorted(extra_threads)}"
    assert not extra_fds, f"{what}: file descriptors left behind: {sorted(extra_fds)}"
    print(f"CLEAN {what}", flush=True)


def expect_failure(what: str, direct: bool = False, **kw: object) -> None:
    try:
        if direct:  # (the creator torch calls, on a store whose keys we control)
            create_process_group(kw["store"], kw["rank"], kw["world_size"],
                                 timedelta(seconds=2))
        else:
            dist.init_process_group("ucxcomm", timeout=timedelta(seconds=2), **kw)
    except Exception as exc:
        print(f"FAILED {what}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    else:
        raise AssertionError(f"{what}: init_process_group did not fail")
    assert not dist.is_initialized()


def main() -> None:
    # Warm up what torch and asyncio open once per process (not ours to account for).
    hs = dist.HashStore()
    asyncio.run(asyncio.sleep(0))
    tcp = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    fds0, threads0 = fds(), threads()

    # 1. Rank 0 of 2, its peer never comes: the address exchange runs out.
    expect_failure("alone", store=dist.PrefixStore("a/", tcp), rank=0, world_size=2)
    check_clean("alone", fds0, threads0)

    # 2. Rank 1 of 2: rank 0 publishes an address and a liveness store that accepts
    # the connection but never answers; the liveness handshake runs out (its
    # connection was left open before).
    mute = socket.create_server(("127.0.0.1", 0))  # (the kernel accepts; nobody answers)
    store = dist.PrefixStore("b/", tcp)
    store.set("ucxcomm/0/addr/0", b"not-an-address")  # (endpoints connect lazily)
    store.set("ucxcomm/0/live", json.dumps({"host": "127.0.0.1",
                                           "port": mute.getsockname()[1], "token": "t0k"}))
    store.add("ucxcomm/count", 1)  # (rank 0's count)
    expect_failure("liveness", direct=True, store=store, rank=1, world_size=2)
    mute.close()
    check_clean("liveness", fds0, threads0)

    # 3. A group that can form does (one rank), and works.
    dist.init_process_group("ucxcomm", store=hs, rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t.tolist() == [1.0] * 4
    dist.destroy_process_group()
    check_clean("after a group", fds0, threads0)
    print("JOIN-FAIL-OK", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
