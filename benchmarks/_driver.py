"""Shared pieces of the benchmark drivers: running a job that prints ``BENCH {json}``
lines, and running ``ucx_perftest`` (from the libucx wheel) as a peer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["perftest", "run_bench"]


def run_bench(cmd: list[str], env: dict, timeout: float = 1800) -> list[dict]:
    """Run ``cmd``; return the records of its ``BENCH {json}`` lines (reporting failures
    and "unsupported" notes on stderr)."""
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        print("  timed out", file=sys.stderr)
        return []
    if proc.returncode != 0:
        print(f"  failed ({proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
    elif "unsupported" in proc.stderr:
        print("\n".join("  " + ln for ln in proc.stderr.splitlines() if "unsupported" in ln),
              file=sys.stderr)
    return [json.loads(line[6:]) for line in proc.stdout.splitlines()
            if line.startswith("BENCH ")]


def perftest(test: str, size: int, iters: int, env: dict) -> tuple[float, float, float] | None:
    """``(latency median us, latency average us, bandwidth GB/s)`` of one
    ``ucx_perftest -t test`` client/server pair on loopback, or None if unavailable."""
    import libucx

    exe = Path(libucx.__file__).parent / "bin" / "ucx_perftest"
    if not exe.exists():
        return None
    env = dict(env, LD_LIBRARY_PATH=str(exe.parent.parent / "lib"))
    port = 20000 + (os.getpid() + sum(map(ord, test)) + size) % 20000
    server = subprocess.Popen([str(exe), "-p", str(port)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _attempt in range(50):  # the server needs a moment to listen
            proc = subprocess.run([str(exe), "127.0.0.1", "-p", str(port), "-t", test, "-s",
                                   str(size), "-n", str(iters)], capture_output=True,
                                  text=True, env=env, timeout=300)
            if proc.returncode == 0:
                break
            time.sleep(0.1)
        else:
            return None
    finally:
        server.kill()
        server.wait()
    final = [ln for ln in proc.stdout.splitlines() if ln.startswith("Final:")]
    if not final:
        return None
    cols = final[0].split()
    return float(cols[2]), float(cols[3]), float(cols[5]) * (1 << 20) / 1e9


def record(results: list[dict], transport: str, out: str | None) -> None:
    """Tag every record with the transport, append them to ``out`` (JSON lines) if
    given, and print them."""
    for r in results:
        r["transport"] = transport
    if out:
        with open(out, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    for r in results:
        print(json.dumps(r))


def print_ratios(ratios: dict[str, float]) -> None:
    print("\nratios (median / median):")
    for k, v in ratios.items():
        print(f"  {k:45s} {v}")
