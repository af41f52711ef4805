"""The elastic fault fuzzer: random kill -9 schedules over a mixed workload.

    python tools/elastic_fuzz.py [--schedules N] [--seed S] [--timeout T]

Each schedule (drawn from the seed: the same seed, the same schedules) runs
tests/spmd/elastic_fuzz_prog.py on 3 or 4 ranks, under ``ucxcomm run --elastic`` (two in
three) or a torchrun-style launch (rank 0 hosts the store, rank 1 a standby of it), with
1 or 2 victims (any rank, rank 0 included; never all, and never ranks 0 and 1 together
in a torchrun-style launch) that each kill themselves (SIGKILL) before a random step of
a random round. The survivors must all print
``FUZZ-OK`` with the expected final size, the job must exit 0 before its deadline, and
no rank may see a wrong byte. Prints the seed first and one line per failing schedule
(its JSON and the job's output), then ``schedules N, passed P, hangs H, wrong results
W, other failures F``; exits 1 if any failed. tests/test_elastic.py runs a few.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROG = ROOT / "tests" / "spmd" / "elastic_fuzz_prog.py"
STEPS = ("ring", "ring_big", "allreduce", "allreduce_big", "bcast", "allgather", "window")
ROUNDS = 4


def draw(rng: random.Random) -> dict:
    """One schedule: ``ucxcomm run --elastic`` (the launcher hosts the store), or a
    torchrun-style launch (rank 0 hosts it, rank 1 a standby; both dying is not
    survivable, so they are never both victims there)."""
    n = rng.choice((3, 4))
    launcher = rng.choice(("run", "run", "torchrun"))
    while True:
        victims = rng.sample(range(n), rng.choice((1, 1, 2)))
        if launcher == "run" or not {0, 1} <= set(victims):
            break
    return {"ranks": n, "rounds": ROUNDS, "deadline": 40.0, "launcher": launcher,
            "victims": {str(v): [rng.randrange(ROUNDS), rng.choice(STEPS)]
                        for v in victims}}


def run_one(sched: dict, timeout: float) -> tuple[str, str]:
    """``(outcome, output)``: outcome ``ok``, ``hang``, ``wrong`` or ``failed``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("UCXCOMM_RANK", "UCXCOMM_SIZE", "UCXCOMM_STORE", "RANK",
                                "WORLD_SIZE", "UCXCOMM_RESTART"))}
    env.update(ELASTIC_FUZZ=json.dumps(sched), PYTHONUNBUFFERED="1")
    if sched.get("launcher") == "torchrun":
        return _torchrun_style(sched, env, timeout)
    cmd = [sys.executable, "-m", "ucxcomm.cli", "run", "--elastic", "-n",
           str(sched["ranks"]), "--tag-output", "--timeout", str(timeout), sys.executable,
           str(PROG)]
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout + 60, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        return "hang", f"{exc.stdout or ''}{exc.stderr or ''}"
    return _verdict(sched, proc.returncode, proc.stdout, proc.stdout + proc.stderr)


def _torchrun_style(sched: dict, env: dict, timeout: float) -> tuple[str, str]:
    """The schedule with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT only (no launcher to
    end a hang: each rank's own deadline, then this one's)."""
    sys.path.insert(0, str(ROOT))
    from ucxcomm.launch import free_port

    port = free_port(span=2)
    n = sched["ranks"]
    procs = [subprocess.Popen(
        [sys.executable, str(PROG)], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
        env=dict(env, RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port))) for r in range(n)]
    outs, hung = [], False
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout + 60)[0])
        except subprocess.TimeoutExpired:
            hung = True
            p.kill()
            outs.append(p.communicate()[0])
    victims = {int(v) for v in sched["victims"]}
    text = "".join(f"[{r}] {line}\n" for r, o in enumerate(outs) for line in o.splitlines())
    if hung:
        return "hang", text
    bad = [r for r, p in enumerate(procs) if r not in victims and p.returncode != 0]
    return _verdict(sched, 1 if bad else 0, text, text)


def _verdict(sched: dict, returncode: int, stdout: str, out: str) -> tuple[str, str]:
    """``(outcome, out)`` of a finished schedule from its exit status and output."""
    if "AssertionError" in out:
        return "wrong", out
    if returncode == 124 or "timed out after" in out or "TimeoutError" in out:
        return "hang", out
    survivors = sorted(set(range(sched["ranks"])) - {int(v) for v in sched["victims"]})
    size = len(survivors)
    for r in survivors:
        if f"FUZZ-OK rank {r} rounds {ROUNDS} size {size} " not in stdout:
            return "failed", out
    if returncode != 0 or "Traceback" in out:
        return "failed", out
    return "ok", out


def fuzz(schedules: int, seed: int, timeout: float = 60.0,
         log=print) -> dict[str, int]:
    rng = random.Random(seed)
    counts = {"ok": 0, "hang": 0, "wrong": 0, "failed": 0}
    for i in range(schedules):
        sched = draw(rng)
        outcome, out = run_one(sched, timeout)
        counts[outcome] += 1
        if outcome != "ok":
            log(f"schedule {i} (seed {seed}): {outcome}: {json.dumps(sched)}\n{out[-4000:]}")
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="the launcher's deadline per schedule (s)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    print(f"elastic fuzz: seed {seed}, {args.schedules} schedules", flush=True)
    counts = fuzz(args.schedules, seed, args.timeout,
                  log=lambda m: print(m, flush=True))
    print(f"schedules {args.schedules}, passed {counts['ok']}, hangs {counts['hang']}, "
          f"wrong results {counts['wrong']}, other failures {counts['failed']}", flush=True)
    return 0 if counts["ok"] == args.schedules else 1


if __name__ == "__main__":
    sys.exit(main())
