"""``ucxcomm bench``: run the suites, interleaving implementations per size, and report.

For every suite and size, each implementation runs one job under its own launcher
(ucxcomm and raw ucxx under ``ucxcomm run``, mpi4py under the ``mpich`` wheel's
``mpiexec``, gloo with torchrun-style variables, ``ucx_perftest`` as a client/server pair,
asyncio streams as two forked processes). Jobs print ``BENCH {json}`` lines; the driver
adds the suite and the settings, then prints a table with ratios, and writes JSON lines
and a PNG on request. A peer that is not installed is skipped with a one-line note.

With ``hosts`` (``--hosts N``), the collectives suite runs across a network-namespace
cluster instead, links shaped to ``link`` bits/s (:mod:`ucxcomm.bench.hosts`); its
records and table add busbw as a share of the link rate.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from . import hosts as _hosts
from . import launchers as _launch
from . import perftest as _perftest
from .spec import DEFAULT_SIZES, OPS, QUICK_SIZES, ROOTED, SUITES, applies, size_label

__all__ = ["IMPLS", "Options", "gpu_missing", "run"]

#: Launcher variables the driver must not hand to the jobs it starts.
_DROP = ("UCXCOMM_RANK", "UCXCOMM_SIZE", "UCXCOMM_STORE", "UCXCOMM_TOKEN", "OMPI_", "PMI_",
         "SLURM_PROCID", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass
class Options:
    suites: list[str]
    nranks: int = 2
    sizes: list[int] | None = None
    quick: bool = False
    compare: list[str] | None = None  # None: every peer that is installed
    transport: str = "shm"
    json_out: str | None = None
    plot_out: str | None = None
    quiet: bool = False
    gpu: bool = False
    timeout: float = 900.0
    bind: bool = True  # every peer's ranks one per core, when there is a core per rank
    hosts: int | None = None  # collectives across a namespace cluster of this many hosts
    ranks_per_host: int = 1
    link: int | None = None  # the hosts' link rate, bits/s each way (None: unshaped)
    ops: list[str] | None = None  # only these operations (None: every op of the suite)

    @property
    def layout(self) -> _hosts.Layout | None:
        """The cluster of a ``--hosts`` run (None: one host)."""
        if self.hosts is None:
            return None
        return _hosts.Layout(self.hosts, self.ranks_per_host, self.link)


@dataclass
class Impl:
    """One implementation: what it measures and how to start one of its jobs."""

    name: str
    ops: dict[str, tuple[str, ...]]  # suite -> ops
    missing: Callable[[], str | None]  # why it cannot run here, or None
    start: Callable[..., list[dict]] = field(repr=False)
    peer: bool = True
    gpu: tuple[str, ...] = ()  # suites it measures on GPU memory too (--gpu)


def gpu_missing() -> str | None:
    """Why ``--gpu`` cannot run here (no cupy, no CUDA device), or None."""
    try:
        import cupy
    except ImportError:
        return "needs cupy (pip install 'ucxcomm[gpu]')"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device: cupy raises its runtime error
        return f"no CUDA device ({exc})"
    return None if count > 0 else "no CUDA device"


# --------------------------------------------------------------------------- environment
def _env(opts: Options) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP)}
    env["PYTHONUNBUFFERED"] = "1"
    if opts.transport == "tcp":  # every UCX-based implementation alike, loopback only
        env.update(UCX_TLS="tcp,self", UCX_NET_DEVICES="lo", UCXCOMM_TRANSPORT="auto",
                   MPIR_CVAR_NOLOCAL="1")  # MPICH: no shared memory, its UCX netmod
    return env


def settings(opts: Options) -> dict[str, str]:
    """The fair-play settings a reader needs to trust a comparison (also in every record)."""
    if opts.transport == "tcp":
        out = {"transport": "tcp", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo",
               "mpich": "no shared memory (MPIR_CVAR_NOLOCAL=1), its UCX over tcp,self on "
                        "every interface (its bundled UCX rejects lo alone: 'Destination "
                        "is unreachable')",
               "gloo": "TCP on loopback", "asyncio": "TCP on loopback"}
    else:
        out = {"transport": "shm", "UCX_TLS": os.environ.get("UCX_TLS", "(UCX default)"),
               "mpich": "default (shared memory within the node)",
               "gloo": "TCP on loopback (gloo has no shared-memory transport)",
               "asyncio": "TCP on loopback",
               "ucxx-pipeline": "ucxx's listener endpoints stay on TCP (UCX peer error "
                                "handling): --transport tcp is the like-for-like comparison"}
    if opts.gpu:
        out["gpu"] = ("device buffers (cupy arrays, CUDA tensors) on device LOCAL_RANK % "
                      "device count; ucx_perftest with -m cuda; gloo stages CUDA tensors "
                      "through the host")
    out["binding"] = ("one core per rank for ucxcomm, ucxx, mpi4py, gloo, torch and "
                      "ucx_perftest jobs when there is a core per rank (asyncio streams and "
                      "the pipeline pairs unbound)" if opts.bind else "none (--no-bind)")
    out["ucx_perftest"] = ("put_lat doubled (its ping-pong is halved; ours is Put+Flush); "
                           "its fadd/cswap/put_bw/get_bw are streaming per-operation "
                           "figures, not completed round trips")
    return out


# --------------------------------------------------------------------------- job runners
def _run(cmd: list[str], env: dict, timeout: float) -> tuple[list[dict], str | None]:
    """Records of ``cmd``'s ``BENCH`` lines and an error note (None when it succeeded)."""
    job = _launch.run(cmd, env, timeout)
    if job.returncode is None:
        return [], f"timed out after {timeout:.0f} s"
    if job.returncode != 0:
        tail = " | ".join(job.stderr.strip().splitlines()[-3:])
        return job.records, f"exit {job.returncode}: {tail[-400:]}"
    return job.records, None


def _cores(opts: Options, n: int) -> list[int] | None:
    """The cores of a job of ``n`` ranks bound one per core, or None
    (:func:`ucxcomm.bench.launchers.bound_cores`)."""
    return _launch.bound_cores(n, opts.bind)


def _job_args(suite: str, ops: list[str], size: int, opts: Options) -> list[str]:
    out = [suite, "--ops", ",".join(ops), "--size", str(size)]
    return out + (["--quick"] if opts.quick else []) + (["--gpu"] if opts.gpu else [])


def _under_ucxcomm(module: str) -> Callable[..., list[dict]]:
    def start(suite, ops, size, n, opts, env, note):
        cmd = _launch.ucxcomm_run_cmd(
            n, [sys.executable, "-m", f"ucxcomm.bench.{module}",
                *_job_args(suite, ops, size, opts)], timeout=opts.timeout, bind=opts.bind)
        recs, err = _run(cmd, env, opts.timeout + 30)
        if err:
            note(err)
        return recs
    return start


def _start_mpi(suite, ops, size, n, opts, env, note):
    if opts.transport == "tcp":  # MPICH's own UCX finds no peer with lo alone
        env = {k: v for k, v in env.items() if k != "UCX_NET_DEVICES"}
    cmd = _launch.mpiexec_cmd(n, [sys.executable, "-m", "ucxcomm.bench.ranks_mpi",
                                  *_job_args(suite, ops, size, opts)], bind=opts.bind)
    recs, err = _run(cmd, env, opts.timeout)
    if err:
        note(err)
    return recs


def _start_gloo(suite, ops, size, n, opts, env, note):
    """N processes with torchrun's variables (what ``torchrun --nproc-per-node N`` sets)."""
    port = str(_perftest.free_port())
    cmd = [sys.executable, "-m", "ucxcomm.bench.ranks_gloo", *_job_args(suite, ops, size, opts)]
    procs = []
    cores = _cores(opts, n)
    for r in range(n):
        renv = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r),
                    WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n))
        procs.append(subprocess.Popen(cmd, env=renv, stdin=subprocess.DEVNULL, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      preexec_fn=_launch.pin(cores, r)))
    deadline = time.monotonic() + opts.timeout
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        note(f"timed out after {opts.timeout:.0f} s")
        return []
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for line in outs[0][1].splitlines():
        if "unsupported" in line:
            note(line.strip())
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
    if bad:
        tail = " | ".join(outs[bad[0][0]][1].strip().splitlines()[-3:])
        note(f"rank {bad[0][0]} exit {bad[0][1]}: {tail[-400:]}")
    return _launch.parse_records(outs[0][0])


def _start_asyncio(suite, ops, size, n, opts, env, note):
    cmd = [sys.executable, "-m", "ucxcomm.bench.ranks_asyncio",
           *_job_args(suite, ops, size, opts)]
    recs, err = _run(cmd, env, opts.timeout)
    if err:
        note(err)
    return recs


def _pipeline(impls: tuple[str, ...]) -> Callable[..., list[dict]]:
    """The pipeline suite's job: a consumer and a producer process per implementation
    (raw ucxx: each of its progress modes), about 256 MiB per sample (16 with --quick)."""
    def start(suite, ops, size, n, opts, env, note):
        from .ranks_pipeline import run_pair, schedule_for
        from .spec import Plan

        volume = (16 if opts.quick else 256) << 20
        schedule = schedule_for([size], volume, Plan(opts.quick).samples)
        out = []
        for impl in impls:
            recs, err = run_pair(impl, schedule, env, opts.timeout)
            if err:
                note(f"{impl}: {err}")
            out += recs
        return out
    return start


def _torch(backend: str) -> Callable[..., list[dict]]:
    """The torch suite's job: ``ucxcomm run`` (which exports torchrun's variables) of
    :mod:`ucxcomm.bench.ranks_torch` over ``backend``."""
    def start(suite, ops, size, n, opts, env, note):
        cmd = _launch.ucxcomm_run_cmd(
            n, [sys.executable, "-m", "ucxcomm.bench.ranks_torch",
                *_job_args(suite, ops, size, opts), "--backend", backend],
            timeout=opts.timeout, bind=opts.bind)
        recs, err = _run(cmd, env, opts.timeout + 30)
        if err:
            note(err)
        return recs
    return start


def _by_suite(**starts: Callable[..., list[dict]]) -> Callable[..., list[dict]]:
    def start(suite, *args):
        return starts[suite](suite, *args)
    return start


#: our op -> (ucx_perftest test, which figure); perftest's latencies are its own
#: (ping-pong halves for tag_lat and put_lat), see the settings note.
_PERFTEST = {"latency": ("tag_lat", 0), "bw": ("tag_bw", 2), "put_lat": ("ucp_put_lat", 0),
             "put_bw": ("ucp_put_bw", 2), "get_bw": ("ucp_get", 2),
             "fadd_lat": ("ucp_fadd", 0), "cas_lat": ("ucp_cswap", 0)}
#: ucx_perftest halves its put ping-pong; ours (Put + Flush) is a whole round trip.
_PERFTEST_SCALE = {"put_lat": 2.0}


def _start_perftest(suite, ops, size, n, opts, env, note):
    out = []
    for op in ops:
        test, col = _PERFTEST[op]
        penv = dict(env)
        if op in ("fadd_lat", "cas_lat") and not os.path.isdir("/sys/class/infiniband"):
            penv.setdefault("UCX_PROTO_ENABLE", "n")  # as ucxcomm's atomics without RDMA
        lat = OPS[op][0] == "us"
        iters = (2000 if opts.quick else 20000) if lat and size <= 65536 else \
            (20 if opts.quick else 200)
        got = _perftest.perftest(test, size, iters, penv, mem="cuda" if opts.gpu else None,
                                 cores=_launch.perftest_cores(opts.bind))
        if got is None:
            note(f"ucx_perftest -t {test} -s {size} failed")
            continue
        value = got[col] * _PERFTEST_SCALE.get(op, 1.0)
        if value <= 0:  # below what it prints (e.g. MB/s with two decimals)
            note(f"ucx_perftest -t {test} -s {size} printed 0: below its resolution")
            continue
        out.append({"impl": "ucx_perftest" + ("-gpu" if opts.gpu else ""), "op": op,
                    "size": 8 if op in ("fadd_lat", "cas_lat") else size, "nranks": 2,
                    "unit": OPS[op][0], "median": value,
                    "min": value, "max": value, "samples": 1, "test": test})
    return out


def _needs_module(name: str, hint: str) -> Callable[[], str | None]:
    return lambda: None if importlib.util.find_spec(name) else f"{name} not installed ({hint})"


P2P, RMA, COLL = SUITES["p2p"], SUITES["rma"], SUITES["collectives"]
COLL_ROOTED = COLL + ROOTED  # (the rooted ones when --ops names them)
PIPE = SUITES["pipeline"]
_UCXX_MODES = ("ucxx-polling", "ucxx-blocking", "ucxx-thread")
IMPLS: dict[str, Impl] = {i.name: i for i in [
    Impl("ucxcomm", {"p2p": P2P, "rma": RMA, "collectives": COLL_ROOTED, "pipeline": PIPE,
                     "torch": SUITES["torch"]},
         lambda: None, _by_suite(p2p=_under_ucxcomm("ranks_ucxcomm"),
                                 rma=_under_ucxcomm("ranks_ucxcomm"),
                                 collectives=_under_ucxcomm("ranks_ucxcomm"),
                                 pipeline=_pipeline(("ucxcomm",)),
                                 torch=_torch("ucxcomm")), peer=False,
         gpu=("p2p", "collectives", "torch")),
    Impl("ucxx", {"p2p": P2P, "pipeline": PIPE}, _needs_module("ucxx", "a ucxcomm dependency"),
         _by_suite(p2p=_under_ucxcomm("ranks_ucxx"), pipeline=_pipeline(_UCXX_MODES)),
         gpu=("p2p",)),
    Impl("mpi4py", {"p2p": P2P, "rma": RMA, "collectives": COLL_ROOTED}, _launch.mpi_missing,
         _start_mpi),
    Impl("gloo", {"p2p": P2P, "collectives": COLL, "torch": SUITES["torch"]},
         _needs_module("torch", "pip install torch"),
         _by_suite(p2p=_start_gloo, collectives=_start_gloo, torch=_torch("gloo")),
         gpu=("torch",)),
    Impl("perftest", {"p2p": ("latency", "bw"), "rma": tuple(op for op in RMA if op in _PERFTEST)},
         lambda: None if _perftest.executable() else "ucx_perftest not in the libucx wheel",
         _start_perftest, gpu=("p2p",)),
    Impl("asyncio", {"p2p": ("latency", "bw"), "pipeline": PIPE}, lambda: None,
         _by_suite(p2p=_start_asyncio, pipeline=_pipeline(("asyncio",)))),
]}
#: ``--compare`` names -> the record's ``impl`` (ucx_perftest keeps its own name).
RECORD_NAME = {"perftest": "ucx_perftest"}


# --------------------------------------------------------------------------- the run
class _Progress:
    def __init__(self, quiet: bool) -> None:
        self.quiet, self.tty = quiet, sys.stderr.isatty()

    def show(self, text: str) -> None:
        if self.quiet:
            return
        if self.tty:
            sys.stderr.write("\r\x1b[K" + text)
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def note(self, text: str) -> None:
        if self.tty and not self.quiet:
            sys.stderr.write("\r\x1b[K")
        sys.stderr.write(f"ucxcomm bench: {text}\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty and not self.quiet:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def chosen_impls(opts: Options, progress: _Progress) -> list[Impl]:
    """ucxcomm plus the requested (default: every) peer that can run here; the others
    are named once on stderr."""
    names = list(IMPLS) if opts.compare is None else ["ucxcomm", *opts.compare]
    out = []
    for name in dict.fromkeys(names):
        impl = IMPLS[name]
        why = impl.missing()
        if why:
            progress.note(f"skipping {name}: {why}")
            continue
        if opts.gpu and not set(impl.gpu) & set(opts.suites):
            progress.note(f"skipping {name}: it has no GPU variant of "
                          f"{', '.join(opts.suites)}")
            continue
        out.append(impl)
    return out


def run(opts: Options) -> list[dict]:
    """Run every suite of ``opts``; returns the records (also written/printed/plotted
    as ``opts`` says). With ``opts.hosts``, in a cluster built for the run and torn down
    after it (on an error or Ctrl-C too)."""
    progress = _Progress(opts.quiet)
    impls = chosen_impls(opts, progress)
    layout = opts.layout
    if layout is None:
        records = _sweep(opts, impls, progress, _env(opts), settings(opts),
                         lambda impl: impl.start)
    else:
        for impl in impls:
            if impl.name not in _hosts.IMPLS and "collectives" in impl.ops:
                progress.note(f"skipping {impl.name}: not runnable across --hosts")
        impls = [i for i in impls if i.name in _hosts.IMPLS]
        with _hosts.cluster(layout) as cluster:
            records = _sweep(
                opts, impls, progress, _hosts.env(_env(opts)),
                _hosts.settings(layout, opts.bind),
                lambda impl: partial(_hosts.IMPLS[impl.name], cluster, layout),
                nranks=layout.nranks)
        _hosts.annotate(records, layout)
    add_speedups(records)
    progress.done()
    if opts.json_out:
        os.makedirs(os.path.dirname(opts.json_out) or ".", exist_ok=True)
        with open(opts.json_out, "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    return records


def _sweep(opts: Options, impls: list[Impl], progress: _Progress, env: dict[str, str],
           sett: dict[str, str], starter: Callable[[Impl], Callable[..., list[dict]]],
           nranks: int | None = None) -> list[dict]:
    """Every suite's jobs, sizes outermost, implementations alternating."""
    records: list[dict] = []
    for suite in opts.suites:
        if suite == "torch" and importlib.util.find_spec("torch") is None:
            progress.note("skipping the torch suite: torch not installed "
                          "(pip install 'ucxcomm[torch]')")
            continue
        sizes = opts.sizes or (QUICK_SIZES if opts.quick else DEFAULT_SIZES)[suite]
        n = nranks or (opts.nranks if suite in ("collectives", "torch") else 2)
        if opts.gpu and "ucxcomm" not in [i.name for i in impls if suite in i.gpu]:
            progress.note(f"skipping the {suite} suite: no GPU variant (--gpu)")
            continue
        jobs = [(size, impl, [op for op in impl.ops.get(suite, ())
                              if applies(op, size, sizes) and (op in opts.ops if opts.ops
                                                               else op not in ROOTED)])
                for size in sizes for impl in impls if not opts.gpu or suite in impl.gpu]
        jobs = [j for j in jobs if j[2]]
        for k, (size, impl, ops) in enumerate(jobs, 1):
            progress.show(f"[{suite} {k}/{len(jobs)}] {size_label(size)}: {impl.name} "
                          f"({', '.join(ops)})")

            def note(text: str, impl: Impl = impl, size: int = size, suite: str = suite
                     ) -> None:
                progress.note(f"{suite} {impl.name} {size_label(size)}: {text}")

            for rec in starter(impl)(suite, ops, size, n, opts, env, note):
                rec.update(suite=suite, settings=sett)
                records.append(rec)
    return records


def add_speedups(records: list[dict]) -> None:
    """ucxcomm's speedup over each peer (> 1: ucxcomm faster), as the table's ``x``
    columns show it, in each of ucxcomm's records: ``speedup = {peer: x}``."""
    cell = {(r.get("suite"), r["op"], r["size"], r["impl"]): r for r in records}
    for r in records:
        if not r["impl"].startswith("ucxcomm") or r["median"] <= 0:
            continue
        out = {}
        for (suite, op, size, impl), peer in cell.items():
            if (suite, op, size) == (r.get("suite"), r["op"], r["size"]) \
                    and not impl.startswith("ucxcomm") and peer["median"] > 0:
                out[impl] = _speedup(r, peer)
        if out:
            r["speedup"] = out


# --------------------------------------------------------------------------- the report
def _speedup(ours: dict, theirs: dict) -> float:
    """How many times better ucxcomm is (> 1: ucxcomm faster)."""
    if ours["unit"] == "us":
        return theirs["median"] / ours["median"]
    return ours["median"] / theirs["median"]


def _suite_ops(suite: str) -> tuple[str, ...]:
    """Every op a suite's records may hold (the collectives' rooted ones too)."""
    return SUITES[suite] + (ROOTED if suite == "collectives" else ())


def table(records: list[dict]) -> str:
    """Per suite and op: medians per implementation and size, then ucxcomm's speedup
    over each peer (x > 1: ucxcomm is that many times faster)."""
    lines = []
    for suite in SUITES:
        for op in _suite_ops(suite):
            rows = [r for r in records if r.get("suite") == suite and r["op"] == op]
            if not rows:
                continue
            unit, what = OPS[op]
            impls = list(dict.fromkeys(r["impl"] for r in rows))
            ours = next((i for i in impls if i.startswith("ucxcomm")), None)
            peers = [i for i in impls if i != ours]
            nr = rows[0]["nranks"]
            if "hosts" in rows[0]:
                lines += _hosts_block(suite, op, rows, ours, peers)
                continue
            lines.append(f"\n{suite} {op} [{unit}], {nr} ranks: {what}")
            if unit == "us" and suite == "collectives":
                lines.append("  (busbw GB/s in the JSON; nccl-tests formulas)")
            head = f"{'size':>8}" + "".join(f"{i:>14}" for i in impls)
            head += "".join(f"{'x ' + p:>16}" for p in peers) if ours else ""
            lines.append(head)
            cell = {(r["impl"], r["size"]): r for r in rows}
            for size in sorted({r["size"] for r in rows}):
                line = f"{size_label(size):>8}"
                for i in impls:
                    r = cell.get((i, size))
                    line += f"{r['median']:>14.3f}" if r else f"{'-':>14}"
                for p in peers if ours else ():
                    a, b = cell.get((ours, size)), cell.get((p, size))
                    if a and b and a["median"] > 0 and b["median"] > 0:
                        line += f"{_speedup(a, b):>16.2f}"
                    else:
                        line += f"{'-':>16}"
                lines.append(line)
    if records:
        sett = records[0]["settings"]
        lines.append("\nsettings: " + "; ".join(f"{k}={v}" for k, v in sett.items()))
        lines.append("x = ucxcomm's speedup over that peer (> 1: ucxcomm faster); "
                     "ucx_perftest is a reference, not a ceiling (its window and "
                     "progress differ)")
    return "\n".join(lines)


def _hosts_block(suite: str, op: str, rows: list[dict], ours: str | None,
                 peers: list[str]) -> list[str]:
    """One collective across --hosts: per size, one line per implementation with its
    time, algbw, busbw (MB/s: 1e6 B/s) and busbw as a share of the link rate, then
    ucxcomm's speedup over that peer."""
    r0 = rows[0]
    lines = [f"\n{suite} {op}, {r0['hosts']} hosts x {r0['ranks_per_host']} rank(s) "
             f"({r0['nranks']} ranks), link {r0['link']} each way: {OPS[op][1]}"]
    lines.append(f"{'size':>8}  {'impl':<10}{'time us':>12}{'algbw MB/s':>12}"
                 f"{'busbw MB/s':>12}{'busbw %link':>13}{'ucxcomm x':>11}")
    cell = {(r["impl"], r["size"]): r for r in rows}
    order = ([ours] if ours else []) + peers
    for size in sorted({r["size"] for r in rows}):
        first = True
        for impl in order:
            r = cell.get((impl, size))
            if r is None:
                continue
            label = size_label(size) if first else ""
            first = False
            pct = r.get("busbw_pct_link")
            a = cell.get((ours, size)) if ours else None
            x = (f"{_speedup(a, r):>11.2f}" if a and impl != ours and a["median"] > 0
                 and r["median"] > 0 else f"{'-':>11}")
            lines.append(f"{label:>8}  {impl:<10}{r['median']:>12.1f}"
                         f"{r['algbw_GBps'] * 1e3:>12.2f}{r['busbw_GBps'] * 1e3:>12.2f}"
                         + (f"{pct:>12.1f}%" if pct is not None else f"{'-':>13}") + x)
    lines.append("  (busbw: nccl-tests' formulas; 'ucxcomm x' = ucxcomm's speedup over "
                 "that peer, > 1: ucxcomm faster)")
    return lines


def plot(records: list[dict], path: str) -> None:
    """Latency/time and bandwidth vs size, log axes, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(s, op) for s in SUITES for op in _suite_ops(s)
              if sum(1 for r in records if r.get("suite") == s and r["op"] == op)]
    if not panels:
        raise ValueError("nothing to plot: no records")
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (suite, op) in zip(axes.flat, panels, strict=False):
        data = [r for r in records if r.get("suite") == suite and r["op"] == op]
        for impl in dict.fromkeys(r["impl"] for r in data):
            pts = sorted((r["size"], r["median"]) for r in data if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl,
                    linewidth=2.2 if impl.startswith("ucxcomm") else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{suite}: {op}")
        ax.set_xlabel("bytes")
        ax.set_ylabel(OPS[op][0])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
