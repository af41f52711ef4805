"""The host's summary of a ci/softroce/run directory: the lanes each rank used, the RMA
engine check (one engine, rc_verbs lanes) and, when the
ratio phases ran, rc_verbs against TCP. Exit status 1 when a check fails.

``python ci/softroce/summary.py OUT_DIR``
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

LANE = re.compile(r"\b([a-z0-9_]+)/(rxe\d+:\d+|eth\d+|lo|memory)\b|\('([a-z0-9_]+)', '([^']+)'\)")


def lanes_of(text: str) -> list[str]:
    seen: list[str] = []
    for m in LANE.finditer(text):
        lane = f"{m[1]}/{m[2]}" if m[1] else f"{m[3]}/{m[4]}"
        if lane not in seen:
            seen.append(lane)
    return seen


def main(out: str) -> int:
    ok = True
    phases = [line.split("#", 1)[0] for line in open(os.path.join(out, "phases"))
              if line.strip() and not line.startswith("#")]
    print("softroce: lanes seen per phase (node0 | node1):")
    for name in phases:
        cols = []
        for n in (0, 1):
            try:
                text = open(os.path.join(out, f"{name}.node{n}.log"), errors="replace").read()
            except OSError:
                text = ""
            keep = [ln for ln in text.splitlines()
                    if ln.startswith(("CLUSTER-OK", "RMA-LANES", "RATIO", "INFO "))]
            cols.append(", ".join(lanes_of("\n".join(keep))) or "-")
        if any(c != "-" for c in cols):
            print(f"softroce:   {name:<20} {cols[0]} | {cols[1]}")
    for path in sorted(glob.glob(os.path.join(out, "rma_engine.node*.log"))):
        for line in open(path, errors="replace"):
            if not line.startswith("RMA-LANES "):
                continue
            r = json.loads(line.split(" ", 1)[1])
            peer = str(1 - r["rank"])
            engines = len(r["rma_options"])
            rma = [f"{t}/{d}" for t, d in r["rma"][peer]]
            good = engines == 1 and rma and all(x.startswith("rc_verbs/") for x in rma)
            ok &= bool(good)
            print(f"softroce: RMA rank {r['rank']}: {engines} engine (want 1: hardware "
                  f"atomics), window lanes to rank {peer} {rma}: {'ok' if good else 'FAILED'}")
    ratios = {}
    for path in sorted(glob.glob(os.path.join(out, "ratio_*.node0.log"))):
        for line in open(path, errors="replace"):
            if line.startswith("RATIO "):
                r = json.loads(line.split(" ", 1)[1])
                ratios[r["label"]] = r
    if "rc_verbs" in ratios and "tcp" in ratios:
        v, t = ratios["rc_verbs"], ratios["tcp"]
        print("softroce: rc_verbs vs TCP in the same VMs (TCG + UDP tunnel: ratios only)")
        print(f"softroce:   lanes rc_verbs {v['lanes']} rma {v['rma_lanes']}; "
              f"tcp {t['lanes']} rma {t['rma_lanes']}")
        for key in ("p2p_8B_lat_us", "p2p_1MiB_MBps", "put_flush_8B_lat_us",
                    "fetch_and_op_lat_us"):
            better = t[key] / v[key] if key.endswith("_us") else v[key] / t[key]
            print(f"softroce:   {key:<22} rc_verbs {v[key]:10.1f}  tcp {t[key]:10.1f}  "
                  f"rc_verbs {better:.2f}x {'faster' if better >= 1 else 'slower'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
