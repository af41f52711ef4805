"""The elastic fault fuzzer: random kill -9 and link-cut schedules over a mixed workload.

    python tools/elastic_fuzz.py [--schedules N] [--seed S] [--timeout T] [--netns]

Each schedule (drawn from the seed: the same seed, the same schedules) runs
tests/spmd/elastic_fuzz_prog.py on 3 or 4 ranks, under ``ucxcomm run --elastic`` (two in
three) or a torchrun-style launch (rank 0 hosts the store, rank 1 a standby of it), with
1 or 2 victims (any rank, rank 0 included; never all; ranks 0 and 1 in a torchrun-style
launch only in different rounds) that each kill themselves (SIGKILL) before a random
step of a random round. The survivors must all print
``FUZZ-OK`` with the expected final size, the job must exit 0 before its deadline, and
no rank may see a wrong byte. Prints the seed first and one line per failing schedule
(its JSON and the job's output), then ``schedules N, passed P, hangs H, wrong results
W, other failures F``; exits 1 if any failed. tests/test_elastic.py runs a few.

``--netns`` (root only): each schedule runs in a fresh network-namespace cluster
(``ucxcomm/bench/netns.py``), one rank per host, UCX over TCP, and its victims either
kill themselves or cut their own host's link at the bridge (their peers hear nothing:
no reset, no end of stream), a cut healed after a random time in a third of the
schedules. The store is either the arbiter outside the ranks (a store process on the
bridge's namespace; ``UCXCOMM_STORE``), with 1 or 2 victims of any rank, or rank 0's
under a torchrun-style launch (rank 1 its standby), with one cut victim. Verdict: no
hang, no wrong byte, no traceback; the ranks that finish (``FUZZ-OK``) all name the
same members, themselves; every other rank was killed or exited 3 with ``FUZZ-OUT``
(it lost the store, or its side of the partition was fenced: launch/store.py,
"Partitions"). Without a heal the finishers are exactly the ranks not victims; with
one, they include those (arbiter store) or are a majority (torchrun-style).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROG = ROOT / "tests" / "spmd" / "elastic_fuzz_prog.py"
STEPS = ("ring", "ring_big", "allreduce", "allreduce_big", "bcast", "allgather", "window")
ROUNDS = 4


def draw(rng: random.Random) -> dict:
    """One schedule: ``ucxcomm run --elastic`` (the launcher hosts the store), or a
    torchrun-style launch (rank 0 hosts it, rank 1 a standby; both dying at once is not
    survivable, so there they die in different rounds)."""
    n = rng.choice((3, 4))
    launcher = rng.choice(("run", "run", "torchrun"))
    victims = rng.sample(range(n), rng.choice((1, 1, 2)))
    when = {v: rng.randrange(ROUNDS) for v in victims}
    if launcher == "torchrun" and {0, 1} <= set(victims):
        # (the primary's and the standby's hosts dying together is not survivable: a
        # round apart, the store has elected a new standby in between)
        when[0], when[1] = sorted(rng.sample(range(ROUNDS), 2))[::rng.choice((1, -1))]
    return {"ranks": n, "rounds": ROUNDS, "deadline": 40.0, "launcher": launcher,
            "victims": {str(v): [when[v], rng.choice(STEPS)] for v in victims}}


#: How fast a silent (cut) peer is declared dead in the netns schedules (UCXCOMM_LIVENESS_S).
NETNS_LIVENESS_S = 2
#: Serves the store from the bridge's namespace (argv: token, address, port).
_STORE = """
import asyncio, sys
from ucxcomm.launch.store import StoreServer
async def main():
    await StoreServer(sys.argv[1], sys.argv[2], int(sys.argv[3])).start()
    print("STORE-UP", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def _collect(procs: list[subprocess.Popen], timeout: float) -> tuple[list[str], bool]:
    """Every process's output, waiting for each up to ``timeout`` seconds (one still
    running then is killed): ``(outputs, whether one had to be killed)``."""
    outs, hung = [], False
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            hung = True
            p.kill()
            outs.append(p.communicate()[0])
    return outs, hung


def draw_netns(rng: random.Random) -> dict:
    """One link-cut schedule (module doc, ``--netns``)."""
    n = rng.choice((3, 4))
    launcher = rng.choice(("arbiter", "arbiter", "torchrun"))
    if launcher == "torchrun":  # (one cut: the survivors are a majority)
        victims = {rng.randrange(n): "cut"}
    else:
        chosen = rng.sample(range(n), rng.choice((1, 1, 2)))
        victims = {v: rng.choice(("cut", "cut", "kill")) for v in chosen}
        victims[chosen[0]] = "cut"
    heal = round(rng.uniform(0.2, 3 * NETNS_LIVENESS_S), 1) if rng.random() < 1 / 3 \
        else None
    return {"ranks": n, "rounds": ROUNDS, "deadline": 60.0, "launcher": launcher,
            "victims": {str(v): [rng.randrange(ROUNDS), rng.choice(STEPS), action,
                                 heal if action == "cut" else None]
                        for v, action in victims.items()}}


def run_netns(sched: dict, timeout: float, port: int) -> tuple[str, str]:
    """One ``draw_netns`` schedule in a cluster of its own: ``(outcome, output)``."""
    sys.path.insert(0, str(ROOT))
    from ucxcomm.bench.netns import HEAD, Cluster

    n = sched["ranks"]
    token = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("UCXCOMM_", "RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(ELASTIC_FUZZ=json.dumps(sched), PYTHONUNBUFFERED="1", UCX_TLS="tcp,self",
               UCXCOMM_TRANSPORT="auto", UCXCOMM_LIVENESS_S=str(NETNS_LIVENESS_S),
               UCXCOMM_TOKEN=token)
    if "UCXCOMM_UCX" in os.environ:
        env["UCXCOMM_UCX"] = os.environ["UCXCOMM_UCX"]
    with Cluster(n) as cluster:
        store = None
        if sched["launcher"] == "arbiter":
            store = subprocess.Popen(
                [*cluster.exec(-1), sys.executable, "-c", _STORE, token, HEAD, str(port)],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, stdin=subprocess.DEVNULL)
            where = {"UCXCOMM_SIZE": str(n), "UCXCOMM_STORE": f"{HEAD}:{port}"}
        else:
            where = {"WORLD_SIZE": str(n), "MASTER_ADDR": cluster.addr(0),
                     "MASTER_PORT": str(port)}
        procs = []
        for r in range(n):
            link = {"down": cluster.link_command(r, False), "up": cluster.link_command(r, True)}
            rank_env = dict(env, **where, ELASTIC_FUZZ_CUT=json.dumps(link))
            rank_env["UCXCOMM_RANK" if store is not None else "RANK"] = str(r)
            procs.append(subprocess.Popen(
                [*cluster.exec(r), sys.executable, str(PROG)], cwd=ROOT, env=rank_env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                stdin=subprocess.DEVNULL))
        outs, hung = _collect(procs, timeout)
        if store is not None:
            store.kill()
            outs.append(store.communicate()[0])
    text = "".join(f"[{r if r < n else 'store'}] {line}\n"
                   for r, o in enumerate(outs) for line in o.splitlines())
    if hung:
        return "hang", text
    return _netns_verdict(sched, [p.returncode for p in procs], outs[:n], text), text


def _netns_verdict(sched: dict, codes: list[int], outs: list[str], text: str) -> str:
    if "AssertionError" in text:
        return "wrong"
    if "FUZZ-FINALIZE-HUNG" in text or "TimeoutError" in text:
        return "hang"
    if "Traceback" in text:
        return "failed"
    n = sched["ranks"]
    victims = {int(v): a[2] for v, a in sched["victims"].items()}
    finished = {}
    for r, out in enumerate(outs):
        m = re.search(rf"^FUZZ-OK rank {r} rounds (\d+) size (\d+) recoveries \d+ "
                      r"members \[([\d, ]*)\]$", out, re.M)
        if m:
            finished[r] = (int(m[1]), int(m[2]), [int(x) for x in m[3].split(",") if x])
    alive = sorted(finished)
    for r, (rounds, size, members) in finished.items():
        if rounds != ROUNDS or size != len(alive) or members != alive or codes[r] != 0:
            return "failed"
    for r in set(range(n)) - finished.keys():
        if victims.get(r) == "kill":
            if codes[r] != -9:
                return "failed"
        elif codes[r] != 3 or f"FUZZ-OUT rank {r}: " not in outs[r]:
            return "failed"
    others = set(range(n)) - victims.keys()
    healed = any(a[3] is not None for a in sched["victims"].values())
    if not healed:
        return "ok" if set(alive) == others else "failed"
    if sched["launcher"] == "arbiter":
        return "ok" if others <= set(alive) else "failed"
    return "ok" if 2 * len(alive) > n else "failed"


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
    outs, hung = _collect(procs, timeout + 60)
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
         log=print, netns: bool = False, progress=None) -> dict[str, int]:
    """Run ``schedules`` schedules drawn from ``seed``: the count of each outcome
    (``log`` gets each failure; ``progress(i, counts)`` is called every 50 schedules)."""
    rng = random.Random(seed)
    counts = {"ok": 0, "hang": 0, "wrong": 0, "failed": 0}
    for i in range(schedules):
        if progress is not None and i and i % 50 == 0:
            progress(i, counts)
        if netns:
            sched = draw_netns(rng)
            outcome, out = run_netns(sched, timeout, 20000 + i % 20000)
            for v, what in sched["victims"].items():  # (what the cut ranks went through)
                if what[2] == "cut":
                    key = ("cut_back" if f"FUZZ-OK rank {v} " in out else
                           "cut_fenced" if re.search(rf"FUZZ-OUT rank {v}: .*minority", out)
                           else "cut_out")
                    counts[key] = counts.get(key, 0) + 1
        else:
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
    parser.add_argument("--netns", action="store_true",
                        help="link cuts in a network-namespace cluster (root only)")
    args = parser.parse_args()
    if args.netns:
        sys.path.insert(0, str(ROOT))
        from ucxcomm.bench.netns import unavailable

        why = unavailable()
        if why is not None:
            print(f"elastic fuzz --netns: cannot run here: {why}", file=sys.stderr)
            return 2
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    print(f"elastic fuzz{' --netns' if args.netns else ''}: seed {seed}, "
          f"{args.schedules} schedules", flush=True)
    counts = fuzz(args.schedules, seed, args.timeout,
                  log=lambda m: print(m, flush=True), netns=args.netns,
                  progress=lambda i, c: print(f"after {i} schedules: {c}", flush=True))
    print(f"schedules {args.schedules}, passed {counts['ok']}, hangs {counts['hang']}, "
          f"wrong results {counts['wrong']}, other failures {counts['failed']}", flush=True)
    if args.netns:
        print(f"cut ranks: finished (healed in time) {counts.get('cut_back', 0)}, out (lost "
              f"the store) {counts.get('cut_out', 0)}, fenced (a minority holding a store) "
              f"{counts.get('cut_fenced', 0)}", flush=True)
    return 0 if counts["ok"] == args.schedules else 1


if __name__ == "__main__":
    sys.exit(main())
