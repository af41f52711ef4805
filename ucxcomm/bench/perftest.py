"""``ucx_perftest`` (shipped in the ``libucx`` wheel) as a reference: one client/server
pair on loopback per measurement."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from ..launch.ports import free_port
from .launchers import pin

__all__ = ["executable", "free_port", "perftest"]


def executable() -> Path | None:
    """The wheel's ``ucx_perftest``, or None."""
    try:
        import libucx
    except ImportError:
        return None
    exe = Path(libucx.__file__).parent / "bin" / "ucx_perftest"
    return exe if exe.exists() else None


def perftest(test: str, size: int, iters: int, env: dict, timeout: float = 300,
             mem: str | None = None, cores: Sequence[int] | None = None
             ) -> tuple[float, float, float] | None:
    """``(latency median us, latency average us, bandwidth GB/s)`` of one ``ucx_perftest
    -t test`` client/server pair on loopback, or None when it is missing or failed.
    ``mem`` is its memory type for both sides (``-m cuda``), host memory by default;
    ``cores`` (two CPUs) binds the server to the first and the client to the second."""
    exe = executable()
    if exe is None:
        return None
    env = dict(env, LD_LIBRARY_PATH=str(exe.parent.parent / "lib"))
    port = free_port()
    mflag = ["-m", mem] if mem else []
    if cores is not None and len(cores) < 2:
        raise ValueError(f"cores: one CPU for the server and one for the client, got {cores}")
    bind = [pin(cores, 0), pin(cores, 1)]
    server = subprocess.Popen([str(exe), "-p", str(port), *mflag], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=bind[0])
    try:
        for _attempt in range(100):  # until the server listens (it says so only buffered)
            proc = subprocess.run([str(exe), "127.0.0.1", "-p", str(port), "-t", test, "-s",
                                   str(size), "-n", str(iters), *mflag], capture_output=True,
                                  text=True, env=env, timeout=timeout, preexec_fn=bind[1])
            if proc.returncode == 0 or server.poll() is not None:
                break
            time.sleep(0.05)
    finally:
        server.kill()
        server.wait()
    final = [ln for ln in proc.stdout.splitlines() if ln.startswith("Final:")]
    if proc.returncode != 0 or not final:
        return None
    cols = final[0].split()
    return float(cols[2]), float(cols[3]), float(cols[5]) * (1 << 20) / 1e9
