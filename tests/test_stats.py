"""Traffic counters: ``comm.stats()`` and ``win.stats()`` against known traffic (real
ranks through the launcher: tests/spmd/stats_cases.py), and the reading of UCX's
protocol table. No timing is asserted: the cost figure is benchmarks/stats_cost.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from ucxcomm.testing import run_case
from ucxcomm.transport.counters import Row, protocol_table

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "tests" / "spmd" / "stats_cases.py"


def test_counts_known_traffic_per_peer_protocol_and_lane():
    run_case(CASES, "known_traffic", 3)


@pytest.mark.parametrize("nranks", [2, 3])
def test_counts_window_calls_per_target(nranks):
    run_case(CASES, "window_calls", nranks)


# What ucp_ep_print_info printed here (UCX 1.21) for a shared-memory endpoint and, with
# UCX_TLS=tcp, a TCP one (abridged).
SHM = """\
#                 lane[0]:  3:sysv/memory.0 md[2]           -> md[2]/sysv/sysdev[255] am
# +---+---+
# | ucp_context_0 cfg#0 | tagged message by ucp_tag_send* from host memory |
# +---+---+---+
# | 0..92 | eager short | sysv/memory |
# | 93..5028 | eager copy-in copy-out | sysv/memory |
# | 5029..inf | (?) rendezvous zero-copy read from remote | cma/memory |
# +---+---+---+
#
# +---+---+
# | ucp_context_0 cfg#0 | tagged message by ucp_tag_send*(fast-completion) from host memory |
# +---+---+---+
# | 0..92 | eager short | sysv/memory |
# | 93..8248 | eager copy-in copy-out | sysv/memory |
# | 8249..262143 | multi-frag eager copy-in copy-out | sysv/memory |
# | 256K..inf | (?) rendezvous zero-copy read from remote | cma/memory |
# +---+---+---+
#
# +---+---+
# | ucp_context_0 cfg#0 | active message by ucp_am_send* from host memory |
# +---+---+---+
# | 0..92 | short | sysv/memory |
# +---+---+---+
"""
TCP = """\
# | ucp_context_0 cfg#0 | tagged message by ucp_tag_send* from host memory |
# +---+---+---+
# | 0 | eager short | tcp/lo |
# | 1..8339 | eager zero-copy copy-out | tcp/lo |
# | 8340..inf | (?) rendezvous zero-copy fenced write | 52% on tcp/lo and 48% on tcp/eth0 |
# +---+---+---+
"""


def test_protocol_table_reads_each_variant_of_tag_sends():
    table = protocol_table(SHM)
    assert table["plain"] == [
        Row(0, "0..92", "eager short", "sysv/memory"),
        Row(93, "93..5028", "eager copy-in copy-out", "sysv/memory"),
        Row(5029, "5029..inf", "(?) rendezvous zero-copy read from remote", "cma/memory")]
    assert [(r.first, r.lane) for r in table["fast"]] == [
        (0, "sysv/memory"), (93, "sysv/memory"), (8249, "sysv/memory"),
        (256 << 10, "cma/memory")]


def test_protocol_table_reads_single_sizes_and_split_lanes():
    assert protocol_table(TCP) == {"plain": [
        Row(0, "0", "eager short", "tcp/lo"),
        Row(1, "1..8339", "eager zero-copy copy-out", "tcp/lo"),
        Row(8340, "8340..inf", "(?) rendezvous zero-copy fenced write",
            "52% on tcp/lo and 48% on tcp/eth0")]}


def test_protocol_table_without_tables_is_empty():
    """Protocols v1 (UCX_PROTO_ENABLE=n) print no table: messages count unclassified."""
    assert protocol_table("#\n# UCP endpoint\n#   lane[0]: 3:tcp/lo.0 md[1] am\n") == {}
