"""``Counters``: a worker's traffic counters per peer, as plain dicts.

The engine counts every tag message where it already posts or matches it (``csrc/stats.c``
via ``_ucp.TagEngine``): per peer, messages and bytes sent and received, and the
receives that found their message already here (*unexpected*). A message is tallied
under the row of the endpoint's UCX protocol table that its size falls in
(``ucp_ep_print_info``, UCX protocols v2: "0..92 eager short sysv/memory",
"5029..inf rendezvous zero-copy read from remote cma/memory", ...), in the variant the
send asked for (plain or fast completion, ``csrc/ucxcomm_ucp.h``). That row names the
protocol (eager or rendezvous) and the lane UCX selects for that size: what the counters
report as *by lane* and *eager vs rendezvous*. It is UCX's selection table, not a
per-message report (UCX reports none): a protocol UCX marks ``(?)`` (an estimate)
or a switch made inside UCX is not seen. Messages in device memory, and those of an
endpoint without a table (protocols v1, ``UCX_PROTO_ENABLE=n``), are counted but
*unclassified*.

A send counts for the peer of its endpoint; a received message for the peer its sender
tag names (``route``: the communicator layer says which tags are whose).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, NamedTuple

from . import _ucx

__all__ = ["Counters", "Row", "protocol_table"]

#: The protocol-table variants that a tag send of host memory may take, by the title
#: of UCX's table (``ucp_ep_print_info``).
_VARIANTS = {"plain": "tagged message by ucp_tag_send* from host memory",
             "fast": "tagged message by ucp_tag_send*(fast-completion) from host memory"}
# A row: "|  93..5028 | eager copy-in copy-out | sysv/memory |"; one size ("|  0 |"); the
# lane may be a split ("52% on tcp/lo and 48% on tcp/eth0", kept as the lane's name).
_ROW = re.compile(r"^[#\s]*\|\s*(\d+[KMGT]?)(?:\.\.(\S+))?\s*\|\s*(.*?)\s*\|\s*(.*?)\s*\|\s*$")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class Row(NamedTuple):
    """One row of UCX's protocol table: message sizes ``first`` to ``last`` (text, as
    UCX prints it: ``"inf"`` or ``"256K"``) go by ``protocol`` over ``lane``."""

    first: int
    sizes: str
    protocol: str
    lane: str


def _size(text: str) -> int:
    return int(text.rstrip("KMGT")) * _UNITS[text[-1] if text[-1] in "KMGT" else ""]


def protocol_table(info: str) -> dict[str, list[Row]]:
    """The tag-send protocol rows of an endpoint description (``ucp_ep_print_info``),
    per variant (``"plain"``, ``"fast"``); empty when UCX printed no table
    (protocols v1)."""
    out: dict[str, list[Row]] = {}
    variant: str | None = None
    for line in info.splitlines():
        if "|" not in line:
            continue
        titled = [v for v, title in _VARIANTS.items() if title in line]
        if titled:
            variant = titled[0]
            out[variant] = []
            continue
        m = _ROW.match(line)
        if m is None:
            if " cfg#" in line:  # another table's title
                variant = None
            continue
        if variant is not None:
            first, last, protocol, lane = m.groups()
            sizes = first if last is None else f"{first}..{last}"
            out[variant].append(Row(_size(first), sizes, protocol, lane))
    return {v: rows for v, rows in out.items() if rows}


def _tally(pair: tuple[int, int]) -> dict[str, int]:
    return {"messages": int(pair[0]), "bytes": int(pair[1])}


class Counters:
    """The traffic counters of one worker's engine (``_ucp.TagEngine``)."""

    def __init__(self, engine: Any) -> None:
        self._eng = engine
        self._tables: dict[Any, dict[str, list[Row]]] = {}

    def link(self, ep_handle: int, peer: Any, fast: bool) -> None:
        """Count the sends of endpoint ``ep_handle`` for ``peer`` (``fast``: its lanes
        are fast lanes), classified by the endpoint's protocol table."""
        self._eng.stat_link(ep_handle, peer, fast)
        self._classify(ep_handle, peer)

    def _classify(self, ep_handle: int, peer: Any) -> None:
        """Read the endpoint's protocol table, once it has one (a table UCX changes
        later is not followed: rows counted must keep their meaning)."""
        if self._tables.get(peer):
            return
        table = protocol_table(_ucx.ucp.ep_info(ep_handle))
        for variant, rows in table.items():
            rows = rows[:_ucx.ucp.STAT_ROWS]
            table[variant] = rows
            self._eng.stat_rows(peer, 1 if variant == "fast" else 0, [r.first for r in rows])
        self._tables[peer] = table

    def route(self, shift: int, prefixes: Iterable[int], peer: Any) -> None:
        """Count received messages whose sender tag ``>> shift`` is one of ``prefixes``
        as from ``peer``."""
        self._eng.stat_route(shift, prefixes, peer)

    def peer(self, peer: Any, ep_handle: int | None = None) -> dict[str, Any]:
        """The counters of ``peer`` (zero when nothing was counted for it;
        ``ep_handle``: its endpoint if open, to read a table UCX had not made yet)::

            {"sent": {"messages", "bytes", "eager": {...}, "rendezvous": {...},
                      "unclassified": {...}, "lanes": {lane: {...}},
                      "protocols": [{"variant", "sizes", "protocol", "lane",
                                     "messages", "bytes"}, ...]},
             "received": {... the same, and "unexpected": {"messages", "bytes"}}}

        (every ``{...}`` is ``{"messages": int, "bytes": int}``; ``protocols`` lists the
        rows that counted something).
        """
        if ep_handle is not None and peer is not None:
            self._classify(ep_handle, peer)
        got = self._eng.stat_tallies(peer)
        if got is None:
            zero = [(0, 0)] * (2 * _ucx.ucp.STAT_ROWS + 1)
            got = zero, zero, (0, 0)
        sent, recv, unexpected = got
        table = self._tables.get(peer, {})
        out = {"sent": self._side(sent, table), "received": self._side(recv, table)}
        out["received"]["unexpected"] = _tally(unexpected)
        return out

    @staticmethod
    def _side(tallies: list[tuple[int, int]], table: dict[str, list[Row]]
              ) -> dict[str, Any]:
        nrows = _ucx.ucp.STAT_ROWS
        kinds = {"eager": [0, 0], "rendezvous": [0, 0], "unclassified": list(tallies[-1])}
        lanes: dict[str, list[int]] = {}
        rows = []
        for v, variant in enumerate(("plain", "fast")):
            for r, row in enumerate(table.get(variant, [])):
                m, b = tallies[v * nrows + r]
                if not m:
                    continue
                kind = kinds["rendezvous" if "rendezvous" in row.protocol else "eager"]
                lane = lanes.setdefault(row.lane, [0, 0])
                for acc in (kind, lane):
                    acc[0] += m
                    acc[1] += b
                rows.append({"variant": variant, "sizes": row.sizes,
                             "protocol": row.protocol, "lane": row.lane,
                             "messages": int(m), "bytes": int(b)})
        total = [sum(t[0] for t in tallies), sum(t[1] for t in tallies)]
        return {**_tally((total[0], total[1])),
                **{k: _tally((v[0], v[1])) for k, v in kinds.items()},
                "lanes": {k: _tally((v[0], v[1])) for k, v in lanes.items()},
                "protocols": rows}
