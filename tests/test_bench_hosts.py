"""``ucxcomm bench collectives --hosts N --link RATE`` (issue 29): ucxcomm's collectives
across a network-namespace cluster whose links are shaped with tc, end to end; the table
and the JSON records have the link columns; no namespace is left behind. Needs root and
iproute2 (skipped otherwise, like the other netns tests); timings are never asserted.
The option checks and the rate parsing run everywhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ucxcomm.bench import driver, hosts
from ucxcomm.bench.netns import Cluster, format_rate, parse_rate, tbf_burst, unavailable
from ucxcomm.testing import clean_env

ROOT = Path(__file__).resolve().parent.parent


def bench(*args: str, timeout: float = 100) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucxcomm.cli", "bench", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=clean_env(), stdin=subprocess.DEVNULL)


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


@pytest.mark.netns
@pytest.mark.timeout(150)
def test_two_hosts_shaped_allreduce(tmp_path):
    why = unavailable(shaped=True)
    if why is not None:
        pytest.skip(f"needs a network-namespace cluster: {why}")
    before = namespaces()
    out = tmp_path / "h.jsonl"
    proc = bench("collectives", "--hosts", "2", "--link", "1gbit", "--sizes", "64K",
                 "--ops", "Allreduce", "--compare", "none", "--quick", "--quiet",
                 "--json", str(out), "--timeout", "60")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert namespaces() == before, "the cluster's namespaces were left behind"
    [rec] = [json.loads(line) for line in out.read_text().splitlines()]
    assert (rec["impl"], rec["op"], rec["size"], rec["nranks"]) == \
        ("ucxcomm", "allreduce", 65536, 2)
    assert (rec["hosts"], rec["ranks_per_host"], rec["link"], rec["link_bps"]) == \
        (2, 1, "1gbit", 10**9)
    assert rec["settings"]["UCX_TLS"] == "tcp,self"
    assert rec["busbw_GBps"] == pytest.approx(rec["algbw_GBps"])  # 2 ranks: 2(n-1)/n = 1
    assert rec["busbw_pct_link"] == pytest.approx(rec["busbw_GBps"] * 8e9 / 1e9 * 100)
    assert 0 < rec["busbw_pct_link"]
    # the table: a header naming the cluster, the columns, one ucxcomm row at 64K
    text = proc.stdout
    assert "collectives allreduce, 2 hosts x 1 rank(s) (2 ranks), link 1gbit each way" in text
    assert "busbw %link" in text and "algbw MB/s" in text
    [row] = [ln.split() for ln in text.splitlines() if ln.strip().startswith("64K")]
    assert row[:2] == ["64K", "ucxcomm"] and row[5].endswith("%"), row


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_shaped_cluster_has_tbf_both_ways_and_leaves_nothing():
    why = unavailable(shaped=True)
    if why is not None:
        pytest.skip(f"needs a network-namespace cluster: {why}")
    before = namespaces()
    with Cluster(2, rate=200 * 10**6) as c:
        assert set(c.hosts) | {c.head} <= namespaces()
        for cmd in (["tc", "-n", c.hosts[1], "qdisc", "show", "dev", "eth0"],
                    ["tc", "-n", c.head, "qdisc", "show", "dev", "vb1"]):
            shown = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
            assert "tbf" in shown and "rate 200Mbit" in shown, shown
    assert namespaces() == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["p2p", "--hosts", "2"], "collectives suite only"),
    (["collectives", "--link", "1gbit"], "need --hosts"),
    (["collectives", "--hosts", "2", "-n", "4"], "-n does not go with --hosts"),
    (["collectives", "--hosts", "2", "--transport", "tcp"], "--transport does not go"),
    (["collectives", "--hosts", "1"], "--hosts must be 2"),
    (["collectives", "--hosts", "2", "--ranks-per-host", "0"], "--ranks-per-host must be"),
    (["collectives", "--hosts", "2", "--link", "fast"], "--link: bad rate"),
    (["collectives", "--ops", "allfoo"], "--ops: unknown"),
])
def test_bad_hosts_options_fail_before_anything_runs(args, message):
    proc = bench(*args, timeout=50)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_rates_and_buckets():
    assert parse_rate("200mbit") == 200_000_000
    assert parse_rate("1Gbit") == 10**9
    assert parse_rate("2.5gbit") == 2_500_000_000
    for bad in ("200", "200mbps", "fast", "0kbit", "1000gbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    assert format_rate(200_000_000) == "200mbit" and format_rate(1500) == "1500bit"
    assert tbf_burst(200_000_000) == 128 << 10  # at least two 64 KiB offloaded packets
    assert tbf_burst(10**10) == 10**10 // 8 // 500  # 2 ms at the rate


def test_busbw_share_and_speedups():
    layout = hosts.Layout(8, 1, 200_000_000)
    recs = [{"impl": "ucxcomm", "op": "bcast", "size": 1 << 24, "median": 100.0,
             "unit": "us", "busbw_GBps": 0.02, "suite": "collectives"},
            {"impl": "mpi4py", "op": "bcast", "size": 1 << 24, "median": 150.0,
             "unit": "us", "busbw_GBps": 0.01, "suite": "collectives"}]
    hosts.annotate(recs, layout)
    driver.add_speedups(recs)
    assert recs[0]["busbw_pct_link"] == pytest.approx(80.0)  # 0.02 GB/s = 160 Mbit/s
    assert recs[0]["speedup"] == {"mpi4py": pytest.approx(1.5)}
    assert "speedup" not in recs[1]
    assert recs[1]["link"] == "200mbit" and recs[1]["hosts"] == 8


def test_rooted_collectives_are_measured_when_named():
    """Gather, Scatter and Reduce are in no default run; --ops names them (ucxcomm and
    mpi4py), with nccl-tests' meaning of size and their bus factors."""
    from ucxcomm.bench import spec

    assert not set(spec.ROOTED) & set(spec.SUITES["collectives"])
    assert spec.counts("gather", 1 << 20, 4) == (1 << 16, 1 << 18)
    assert spec.counts("scatter", 1 << 20, 4) == (1 << 18, 1 << 16)
    assert spec.counts("reduce", 1 << 20, 4) == (1 << 18, 1 << 18)
    assert spec.busbw_factor("reduce", 4) == 1.0 and spec.busbw_factor("gather", 4) == 0.75
    proc = bench("collectives", "-n", "2", "--ops", "Gather,Scatter,Reduce", "--sizes",
                 "64K", "--quick", "--compare", "none", timeout=100)
    assert proc.returncode == 0, proc.stderr
    for name in ("gather", "scatter", "reduce"):
        assert f"collectives {name} [us]" in proc.stdout, proc.stdout
