"""The ``ucxcomm`` command: ``run``, ``status``, ``info``, ``bench``; the only module that
parses argv or prints (``bench``'s report is formatted by :mod:`ucxcomm.bench.driver`,
``status``'s by :mod:`ucxcomm.comm.trace`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Sequence

__all__ = ["main"]


#: The report's yes/no answers that carry an explanation in their text.
_ANSWERS = ("verbs", "rdmacm", "rdma", "tag_offload")


def _typed(report: dict) -> dict:
    """The report for machines: yes/no answers as booleans, explanations apart
    (``verbs: false`` and ``verbs_why: "..."``)."""
    out: dict = {}
    for key, value in report.items():
        if key in _ANSWERS and isinstance(value, str):
            yes = value in ("yes", "on")
            why = value.split(":", 1)[1] if ":" in value else value.partition("(")[2]
            out[key] = yes
            if key == "tag_offload":
                continue  # tag_offload_why follows in the report
            why = why.strip().removesuffix(")").strip() if not yes else ""
            if why:
                out[f"{key}_why"] = why
        else:
            out[key] = value
    return out


def _info(as_json: bool, transport: str | None, tag_offload: str | None) -> int:
    from .errors import UnsupportedError
    from .transport import config as tconfig
    from .transport import info as tinfo

    try:
        policy = tconfig.policy_from(transport, tag_offload)
        report = asyncio.run(tinfo.collect(policy))
    except (UnsupportedError, ValueError) as exc:
        print(f"ucxcomm info: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(_typed(report), indent=2))
        return 0
    width = max(len(k) for k in report)
    for key, value in report.items():
        if isinstance(value, list):
            value = ", ".join(map(str, value)) or "-"
        print(f"{key:<{width}}  {value}")
    return 0


def _status(as_json: bool, job: str | None, all_jobs: bool, last: int,
            store: str | None = None, token: str | None = None) -> int:
    """``ucxcomm status``: what every rank of this host's jobs is doing, from their
    flight recorders (read from shared memory: no rank has to answer); with ``store``,
    a job anywhere, its ranks asked through its bootstrap store."""
    import os

    from .comm import trace

    if store is not None:
        return _status_remote(as_json, last, store, token)
    if job is not None:
        path = job if os.sep in job else os.path.join(trace.root_dir(), job)
        found = trace.load_job(path)
        jobs = [found] if found.ranks else []
    else:
        jobs = trace.find_jobs(include_ended=all_jobs)
    if as_json:
        print(json.dumps(trace.as_json(jobs), indent=2))
        return 0 if jobs else 1
    if not jobs:
        print("ucxcomm status: no running job of this user on this host keeps a flight "
              "recorder (jobs started by ucxcomm run, torchrun or another launcher are "
              "found here once their ranks called ucxcomm.init)", file=sys.stderr)
        return 1
    print("\n\n".join(trace.report(j, last=last) for j in jobs))
    return 0


def _status_remote(as_json: bool, last: int, store: str, token: str | None) -> int:
    import asyncio

    from . import settings
    from .comm import trace
    from .errors import UcxCommError
    from .launch.status import ask

    host, sep, port_text = store.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        print(f"ucxcomm status: --store takes HOST:PORT, got {store!r}", file=sys.stderr)
        return 2
    token = token if token is not None else settings.get("UCXCOMM_TOKEN")
    try:
        job = asyncio.run(ask(host.strip("[]"), int(port_text), token or "", timeout=1.0))
    except (UcxCommError, OSError, ValueError) as exc:
        print(f"ucxcomm status: could not ask the job at {store}: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(trace.as_json([job]), indent=2))
    else:
        print(trace.report(job, last=last))
        size, answered = job.meta["size"], job.meta["answered"]
        if answered < size:
            print(f"({size - answered} of {size} rank(s) did not answer within 1 s: "
                  "not started yet, or gone)")
    return 0 if job.ranks else 1


_BENCH_SUITES = ("p2p", "rma", "collectives", "pipeline", "torch")
_PEERS = ("ucxx", "mpi4py", "gloo", "perftest", "asyncio")


def _bench_parser(sub) -> None:
    bench = sub.add_parser(
        "bench", help="measure ucxcomm next to ucxx, mpi4py+MPICH, gloo, ucx_perftest and "
        "asyncio streams, OSU-style, in the same run",
        description="OSU-style sweeps of ucxcomm and the peers that are installed, "
        "alternating implementations at every size. Prints a table with ucxcomm's speedup "
        "over each peer; --json and --plot keep the figures.")
    bench.add_argument("suite", nargs="?", default="all",
                       choices=[*_BENCH_SUITES, "all", "elastic"],
                       help="what to measure (default all); elastic: what surviving a "
                       "death costs (ucxcomm alone; not in all)")
    bench.add_argument("-n", type=int, default=None, dest="n",
                       help="ranks for collectives and torch (the others use 2); default 2")
    bench.add_argument("--sizes", help="message sizes, e.g. 8,4K,1M,64M (default: the "
                       "suite's OSU-like sweep)")
    bench.add_argument("--ops", help="comma separated operations of the suite, e.g. "
                       "Allreduce,Bcast (case does not matter; default: all of them); "
                       "collectives also Gather, Scatter, Reduce (rooted at rank 0; "
                       "ucxcomm and mpi4py, only when named)")
    bench.add_argument("--quick", action="store_true",
                       help="few sizes and repetitions: a smoke test, not a measurement")
    bench.add_argument("--compare", help=f"comma separated peers among {','.join(_PEERS)} "
                       "(default: all that are installed); 'none' for ucxcomm alone")
    bench.add_argument("--transport", choices=["shm", "tcp"], default=None,
                       help="shm: each library's default on one host; tcp: UCX_TLS=tcp,self "
                       "and UCX_NET_DEVICES=lo for every UCX-based library, MPICH without "
                       "shared memory (default shm)")
    bench.add_argument("--json", metavar="OUT.jsonl", help="write the records as JSON lines")
    bench.add_argument("--plot", metavar="OUT.png", help="plot (needs matplotlib)")
    bench.add_argument("--quiet", action="store_true", help="no progress display")
    bench.add_argument("--gpu", action="store_true",
                       help="GPU memory: p2p (ucxcomm, ucxx, ucx_perftest -m cuda), "
                            "collectives (ucxcomm) and torch (ucxcomm, gloo) on device "
                            "buffers; needs cupy and a CUDA device")
    bench.add_argument("--no-bind", action="store_true",
                       help="leave every job's ranks unbound (default: one core per rank, "
                       "every peer alike, when there is a core per rank)")
    bench.add_argument("--timeout", type=float, default=900.0,
                       help="seconds one job may take (default 900)")
    hosts = bench.add_argument_group(
        "many hosts (collectives only; root: network namespaces)",
        "--hosts N builds a cluster of N network-namespace hosts on a bridge for the run "
        "(torn down after it, also on an error or Ctrl-C), each host's link shaped to "
        "--link in both directions (tc tbf), and runs ucxcomm, mpi4py+MPICH and gloo there, "
        "TCP only. The table adds algbw, busbw (nccl-tests' formulas) and busbw as a "
        "percentage of the link rate; --json records add link_bps, busbw_pct_link and "
        "ucxcomm's speedup over each peer.")
    hosts.add_argument("--hosts", type=int, metavar="N",
                       help="hosts of the cluster (2 or more); ranks = N x --ranks-per-host")
    hosts.add_argument("--ranks-per-host", type=int, default=1, metavar="K",
                       help="ranks sharing each host's namespace (default 1)")
    hosts.add_argument("--link", metavar="RATE",
                       help="each host's link rate, tc units: e.g. 200mbit, 1gbit, 2.5gbit "
                       "(default: unshaped)")


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import importlib.util

    if args.suite == "elastic":
        from .bench import elastic

        return elastic.main(["--quick"] * args.quick
                            + (["--json", args.json] if args.json else []))

    from .bench import driver
    from .bench.spec import parse_sizes

    try:
        sizes = parse_sizes(args.sizes) if args.sizes else None
    except ValueError as exc:
        parser.error(f"--sizes: {exc}")
    compare = None
    if args.compare is not None:
        compare = [c.strip() for c in args.compare.split(",") if c.strip() not in ("", "none")]
        bad = [c for c in compare if c not in _PEERS]
        if bad:
            parser.error(f"--compare: unknown {', '.join(bad)}; choose among {','.join(_PEERS)}")
    cannot = _bench_hosts(args, parser)
    if cannot not in (None, "ok"):
        print(f"ucxcomm bench: --hosts cannot build its cluster here: {cannot}",
              file=sys.stderr)
        return 1
    nranks = 2 if args.n is None else args.n
    if nranks < 2:
        parser.error("-n must be >= 2")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'ucxcomm[bench]'")
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    if args.gpu:
        why = driver.gpu_missing()
        if why:
            parser.error(f"--gpu: {why}")
    suites = list(_BENCH_SUITES) if args.suite == "all" else [args.suite]
    ops = _bench_ops(args.ops, suites, parser) if args.ops else None
    opts = driver.Options(suites=suites, nranks=nranks, sizes=sizes, quick=args.quick,
                          compare=compare, transport=args.transport or "shm",
                          json_out=args.json, plot_out=args.plot, quiet=args.quiet,
                          gpu=args.gpu, timeout=args.timeout, bind=not args.no_bind,
                          hosts=args.hosts, ranks_per_host=args.ranks_per_host,
                          link=args.link_bps, ops=ops)
    try:
        records = driver.run(opts)
    except KeyboardInterrupt as exc:  # (Ctrl-C; SIGTERM too in a --hosts run)
        sig = getattr(exc, "signum", signal.SIGINT)
        torn = " (the namespace cluster was torn down)" if args.hosts else ""
        print(f"\nucxcomm bench: stopped by signal {int(sig)}{torn}", file=sys.stderr)
        return 128 + int(sig)
    print(driver.table(records))
    if args.plot and records:
        driver.plot(records, args.plot)
    if not any(r["impl"].startswith("ucxcomm") for r in records):
        print("ucxcomm bench: no ucxcomm measurement completed", file=sys.stderr)
        return 1
    return 0


def _bench_ops(text: str, suites: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``--ops``: the suites' operation names, any case (``Reduce_scatter`` is
    reduce_scatter_block)."""
    from .bench.spec import ROOTED, SUITES

    known = [op for suite in suites for op in SUITES[suite]]
    if "collectives" in suites:
        known += ROOTED  # (measured only when named here)
    out = []
    for name in (t.strip().lower() for t in text.split(",")):
        name = {"reduce_scatter": "reduce_scatter_block"}.get(name, name)
        if name not in known:
            parser.error(f"--ops: unknown {name!r} for {', '.join(suites)}; choose among "
                         f"{','.join(known)}")
        out.append(name)
    return out


def _bench_hosts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """Checks the --hosts options (a usage error exits); sets ``args.link_bps``. Returns
    None without --hosts, "ok", or why the cluster cannot be built here."""
    from .bench.netns import MAX_HOSTS, parse_rate, unavailable

    args.link_bps = None
    if args.hosts is None:
        if args.link is not None or args.ranks_per_host != 1:
            parser.error("--link and --ranks-per-host need --hosts")
        return None
    if args.suite != "collectives":
        parser.error("--hosts runs the collectives suite only: ucxcomm bench collectives "
                     "--hosts N ...")
    for flag, given in (("-n", args.n is not None), ("--transport", args.transport),
                        ("--gpu", args.gpu)):
        if given:
            parser.error(f"{flag} does not go with --hosts (ranks = --hosts x "
                         "--ranks-per-host, TCP between namespace hosts, host memory)")
    if args.ranks_per_host < 1:
        parser.error("--ranks-per-host must be >= 1")
    if not 2 <= args.hosts <= MAX_HOSTS:
        parser.error(f"--hosts must be 2 to {MAX_HOSTS}")
    if args.link is not None:
        try:
            args.link_bps = parse_rate(args.link)
        except ValueError as exc:
            parser.error(f"--link: {exc}")
    return unavailable(shaped=args.link is not None) or "ok"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ucxcomm", description="Run ucxcomm programs on this machine and report what "
        "its UCX can do (transports, RDMA, tag matching, CUDA).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="start N ranks of a program on this machine")
    run.add_argument("-n", "--np", type=int, required=True, dest="n", help="number of ranks")
    run.add_argument("--timeout", type=float, default=None,
                     help="kill the job (stack dumps first) after this many seconds")
    run.add_argument("--tag-output", action="store_true", help="prefix output lines with [rank]")
    run.add_argument("--bind-to", choices=["none", "core"], default="none", dest="bind",
                     help="core: rank r runs only on the r-th CPU this launcher may use "
                     "(round robin when ranks outnumber them); default none")
    run.add_argument("--elastic", action="store_true",
                     help="a rank's failure does not end the job: the others go on "
                     "(Comm.shrink); the exit code is the survivors' (docs/elastic.md)")
    run.add_argument("--max-restarts", type=int, default=0, metavar="K",
                     help="with --elastic: start a failed rank again, at most K times per "
                     "rank (UCXCOMM_RESTART_COUNT; it joins through Comm.grow)")
    run.add_argument("prog", nargs=argparse.REMAINDER, help="program and its arguments")
    status = sub.add_parser(
        "status", help="what each rank of this host's running jobs waits in, for how long, "
        "and why (from the ranks' flight recorders; answers while they hang)")
    status.add_argument("--json", action="store_true")
    status.add_argument("--job", default=None,
                        help="a job's directory or name (default: every running job)")
    status.add_argument("--all", action="store_true", dest="all_jobs",
                        help="also jobs whose processes are gone")
    status.add_argument("--last", type=int, default=5,
                        help="completed operations shown per rank (default 5)")
    status.add_argument("--store", default=None, metavar="HOST:PORT",
                        help="a job on other hosts: ask its ranks through its bootstrap "
                        "store (the token: --token or UCXCOMM_TOKEN)")
    status.add_argument("--token", default=None,
                        help="the job's store token (default: UCXCOMM_TOKEN)")
    info = sub.add_parser("info", help="UCX version and library, RDMA/verbs, transports, tag "
                          "offload, CUDA support, and why")
    info.add_argument("--json", action="store_true")
    info.add_argument("--transport", choices=["auto", "rdma", "tcp"], default=None,
                      help="the policy to check (default: UCXCOMM_TRANSPORT or auto)")
    info.add_argument("--tag-offload", choices=["auto", "on", "off"], default=None,
                      help="the tag-matching policy to check (default: UCXCOMM_TAG_OFFLOAD)")
    _bench_parser(sub)
    args = parser.parse_args(argv)
    if args.cmd == "bench":
        return _bench(args, parser)
    if args.cmd == "run":
        from .launch.launcher import run_job

        prog = args.prog[1:] if args.prog[:1] == ["--"] else args.prog
        if args.n < 1:
            parser.error("-n must be >= 1")
        if not prog:
            parser.error("no program given")
        if args.max_restarts < 0 or (args.max_restarts and not args.elastic):
            parser.error("--max-restarts must be >= 0 and needs --elastic")
        return run_job(args.n, prog, tag_output=args.tag_output, timeout=args.timeout,
                       bind=args.bind, elastic=args.elastic,
                       max_restarts=args.max_restarts)
    if args.cmd == "status":
        return _status(args.json, args.job, args.all_jobs, args.last, args.store, args.token)
    if args.cmd == "info":
        return _info(args.json, args.transport, args.tag_offload)
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
