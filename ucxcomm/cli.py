"""The ``ucxcomm`` command: ``run``, ``info``; the only module that parses argv or prints."""

from __future__ import annotations

import argparse
import asyncio
import json
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
    run.add_argument("prog", nargs=argparse.REMAINDER, help="program and its arguments")
    info = sub.add_parser("info", help="UCX version and library, RDMA/verbs, transports, tag "
                          "offload, CUDA support, and why")
    info.add_argument("--json", action="store_true")
    info.add_argument("--transport", choices=["auto", "rdma", "tcp"], default=None,
                      help="the policy to check (default: UCXCOMM_TRANSPORT or auto)")
    info.add_argument("--tag-offload", choices=["auto", "on", "off"], default=None,
                      help="the tag-matching policy to check (default: UCXCOMM_TAG_OFFLOAD)")
    args = parser.parse_args(argv)
    if args.cmd == "run":
        from .launch.launcher import run_job

        prog = args.prog[1:] if args.prog[:1] == ["--"] else args.prog
        if args.n < 1:
            parser.error("-n must be >= 1")
        if not prog:
            parser.error("no program given")
        return run_job(args.n, prog, tag_output=args.tag_output, timeout=args.timeout)
    if args.cmd == "info":
        return _info(args.json, args.transport, args.tag_offload)
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
