"""ci/softroce/run's ``info`` phase on each VM: ``ucxcomm info --json`` must say verbs yes,
rdma yes, the rxe device ACTIVE, rc_verbs on it, the UCX chosen by ``UCXCOMM_UCX`` and no
CUDA support from a UCX without CUDA modules. Prints ``INFO-OK`` and a summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def main() -> None:
    rxe = os.environ.get("RXE_NAME", "rxe0")
    out = subprocess.run([sys.executable, "-m", "ucxcomm.cli", "info", "--json"],
                         check=True, capture_output=True, text=True).stdout
    r = json.loads(out)
    problems = []
    for key in ("verbs", "rdma"):  # (True in --json, "yes" in the text form)
        if r[key] is not True and r[key] != "yes":
            problems.append(f"{key}: {r[key]} ({r.get(key + '_why', '')})")
    ports = [p for p in r["rdma_devices"] if str(p).startswith(f"{rxe}:1")]
    if not ports or "ACTIVE" not in str(ports[0]):
        problems.append(f"{rxe}:1 not ACTIVE: {r['rdma_devices']}")
    if not any(x.startswith(f"rc_verbs/{rxe}:1") for x in r["ucx_resources"]):
        problems.append(f"no rc_verbs/{rxe}:1 in ucx_info -d: {r['ucx_resources']}")
    want = os.environ.get("UCXCOMM_UCX", "auto")
    if want not in ("auto", "") and r["ucx_source"] != want:
        problems.append(f"ucx_source {r['ucx_source']}, UCXCOMM_UCX={want}")
    if r["cuda_support"] and not r["cuda_device"]:
        problems.append("cuda_support true without a CUDA device or CUDA modules")
    print(f"INFO UCX {r['ucx_version']} ({r['ucx_source']}), verbs {r['verbs']}, "
          f"rdmacm {r['rdmacm']}, rdma {r['rdma']}, devices {r['rdma_devices']}, "
          f"tag offload {r['tag_offload']}, cuda_support {r['cuda_support']}, "
          f"self lanes {r['self_endpoint_lanes']}")
    if problems:
        sys.exit("INFO-FAILED " + "; ".join(problems))
    print("INFO-OK", flush=True)


if __name__ == "__main__":
    main()
