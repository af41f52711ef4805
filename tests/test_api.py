"""The public surface: no import side effects, __all__, error hierarchy, layering."""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ucxcomm

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "ucxcomm"
PUBLIC_MODULES = [
    "ucxcomm", "ucxcomm.errors", "ucxcomm.comm", "ucxcomm.comm.communicator",
    "ucxcomm.comm.request", "ucxcomm.comm.ops", "ucxcomm.tags", "ucxcomm.transport",
    "ucxcomm.transport.worker", "ucxcomm.transport.endpoint", "ucxcomm.launch",
    "ucxcomm.launch.bootstrap", "ucxcomm.launch.store", "ucxcomm.launch.launcher",
    "ucxcomm.cli", "ucxcomm._buffers", "ucxcomm._serialize", "ucxcomm.comm.pool",
    "ucxcomm.pipes.listener", "ucxcomm.transport.info", "ucxcomm.comm.collectives",
    "ucxcomm.comm.algorithms", "ucxcomm.transport.config", "ucxcomm.transport.rma",
    "ucxcomm.comm.window", "ucxcomm.testing", "ucxcomm.transport.base",
    "ucxcomm.transport.progress", "ucxcomm.settings", "ucxcomm.comm.group",
    "ucxcomm.pipes.stream", "ucxcomm.pipes.pool", "ucxcomm.pipes",
    "ucxcomm.pipes.connection",
    "ucxcomm.torch", "ucxcomm.torch.process_group", "ucxcomm._deadline",
]


def test_import_has_no_side_effects():
    code = (
        "import os, sys, threading, json\n"
        "before = dict(os.environ); threads = threading.active_count()\n"
        "import ucxcomm\n"
        "print(json.dumps({'env_changed': dict(os.environ) != before,"
        " 'ucx_loaded': any(m.startswith('ucxx') or m.split('.')[-1] in"
        " ('_ucx', '_ucp', '_fast', 'worker', 'endpoint', 'listener', 'rma', 'progress')"
        " for m in sys.modules),"
        " 'threads': threading.active_count() - threads}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert json.loads(out) == {"env_changed": False, "ucx_loaded": False, "threads": 0}


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_names_exist(name):
    mod = importlib.import_module(name)
    assert mod.__doc__, f"{name} has no docstring"
    assert hasattr(mod, "__all__"), f"{name} has no __all__"
    for attr in mod.__all__:
        assert hasattr(mod, attr), f"{name}.__all__ names missing {attr}"


def test_contract_names():
    for name in ("init", "finalize", "ANY_SOURCE", "ANY_TAG", "SUM", "PROD", "MIN", "MAX",
                 "BAND", "BOR", "BXOR", "LAND", "LOR", "REPLACE", "NO_OP", "Request", "Status",
                 "TAG_UB", "Comm"):
        assert hasattr(ucxcomm, name), name
    assert ucxcomm.TAG_UB >= 2**20 - 1


def test_error_hierarchy():
    e = ucxcomm
    for cls in (e.ClosedError, e.PeerFailure, e.CommTimeoutError, e.TruncationError,
                e.BootstrapError, e.WindowError, e.UnsupportedError, e.CollectiveError):
        assert issubclass(cls, e.UcxCommError)
    assert issubclass(e.CommTimeoutError, TimeoutError)
    assert issubclass(e.UnsupportedError, NotImplementedError)
    assert e.PeerFailure("x", peer=3).peer == 3
    err = e.CollectiveError("x", rank=2, cause="TypeError: y")
    assert (err.rank, err.cause) == (2, "TypeError: y")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names.add(mod)
                names.update(f"{mod}.{a.name}" for a in node.names)
            else:
                names.add(node.module or "")
    return names


def test_layering():
    """Only transport/_ucx.py imports ucxx or the compiled extension; comm reaches the
    transport through its contract (transport/base.py) only; the transport imports
    nothing above it (pipes, comm, launch) and pipes nothing above it; endpoint.py does not import
    worker.py (the worker creates endpoints). ``ucxcomm.bench``'s raw-ucxx programs (p2p
    and pipeline) are the other importers: they are the ucxx baselines ``ucxcomm bench``
    measures us against, and nothing in the library imports the bench package."""
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        imports = _imports(path)
        ucx = {i for i in imports if i.startswith("ucxx") or i.endswith("._ucp")}
        if rel in ("ucxcomm/transport/_ucx.py", "ucxcomm/bench/ranks_ucxx.py",
                   "ucxcomm/bench/ranks_pipeline.py"):
            continue
        if not rel.startswith(("ucxcomm/bench/", "ucxcomm/cli.py")):
            bench = {i for i in imports if i.startswith("ucxcomm.bench")}
            assert not bench, f"{rel} imports {bench}"
        assert not ucx, f"{rel} imports {ucx}"
        if rel.startswith("ucxcomm/comm/"):
            bad = {i for i in imports
                   if i.startswith(("ucxcomm.transport", "ucxcomm.launch", "ucxcomm.pipes"))
                   and not i.startswith("ucxcomm.transport.base")}
            assert not bad, f"{rel} imports {bad}"
        if rel in ("ucxcomm/transport/endpoint.py", "ucxcomm/transport/rma.py",
                   "ucxcomm/transport/progress.py", "ucxcomm/transport/base.py"):
            bad = {i for i in imports if i.startswith("ucxcomm.transport.worker")}
            assert not bad, f"{rel} imports {bad}"
        if rel.startswith("ucxcomm/transport/"):  # UCX as objects: nothing above it
            bad = {i for i in imports
                   if i.startswith(("ucxcomm.comm", "ucxcomm.launch", "ucxcomm.pipes"))}
            assert not bad, f"{rel} imports {bad}"
        if rel.startswith("ucxcomm/pipes/"):  # rank-less endpoints, on the transport
            bad = {i for i in imports
                   if i.startswith(("ucxcomm.comm", "ucxcomm.launch", "ucxcomm.torch"))}
            assert not bad, f"{rel} imports {bad}"
        if rel in ("ucxcomm/errors.py", "ucxcomm/_buffers.py", "ucxcomm/_serialize.py",
                   "ucxcomm/settings.py", "ucxcomm/_deadline.py"):
            bad = {i for i in imports if i.startswith("ucxcomm.")
                   and i.split(".")[:2] != ["ucxcomm", "errors"]}
            assert not bad, f"{rel} imports {bad}"


def test_library_never_prints():
    """Only the programs print: the command line, the test helpers, and the benchmark's
    programs (``ucxcomm.bench``: the driver behind ``ucxcomm bench`` and the rank programs
    it starts)."""
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("ucxcomm/cli.py", "ucxcomm/testing.py") or rel.startswith("ucxcomm/bench/"):
            continue
        tree = ast.parse(path.read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Name) and n.func.id == "print"]
        assert not calls, f"{rel} calls print()"


@pytest.mark.parametrize("module", ["transport/_ucp", "comm/_fast", "comm/_shm"])
def test_extension_stub_matches_the_extension(module):
    """Each compiled module's ``.pyi`` (what mypy checks the callers against) names exactly
    what the module offers: every function and class, and every public method of each
    class (a name added to or dropped from the .pyx without the stub fails here)."""
    code = ("import json, inspect, importlib\n"
            "from ucxcomm.transport import _ucx\n"
            "_ucx.load()\n"
            f"m = importlib.import_module('ucxcomm.{module.replace('/', '.')}')\n"
            "out = {}\n"
            "for n, v in vars(m).items():\n"
            "    if n.startswith('__') or inspect.ismodule(v):\n"
            "        continue\n"
            "    if isinstance(v, type):\n"
            "        if v.__module__ != m.__name__:\n"
            "            continue\n"
            "        out[n] = sorted(k for k in vars(v) if not k.startswith('__')\n"
            "                        and not k.startswith('_') or k in ('_engine_setup',\n"
            "                        '_abort_ops', '_dead', '_closed'))\n"
            "    elif callable(v) or isinstance(v, int) or type(v).__module__ == m.__name__:\n"
            "        out[n] = None\n"
            "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    compiled = json.loads(proc.stdout)
    compiled = {n: v for n, v in compiled.items() if not n.startswith("_")}
    stub: dict[str, list[str] | None] = {}
    tree = ast.parse((PKG / f"{module}.pyi").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            stub[node.name] = sorted(
                n.name if isinstance(n, ast.FunctionDef) else n.target.id  # type: ignore
                for n in node.body
                if (isinstance(n, ast.FunctionDef) and not n.name.startswith("__"))
                or isinstance(n, ast.AnnAssign))
        elif isinstance(node, ast.FunctionDef):
            stub[node.name] = None
        elif isinstance(node, ast.AnnAssign) and not node.target.id.startswith("_"):
            stub[node.target.id] = None
    assert stub == compiled


_CIMPORT = re.compile(r"^\s*(?:from\s+(\S+)\s+cimport|cimport\s+(\S+))", re.M)
_PYIMPORT = re.compile(r"^\s*(?:from\s+(\S+)\s+import\s|import\s+(\S+))", re.M)


def test_compiled_modules_keep_the_layers():
    """The communicator's compiled module uses the engine only through its declarations
    (``cimport`` of ``ucxcomm.transport._ucp``: the .pxd), never a Python import of the
    transport; the shared-memory engine uses nothing of it; and the engine imports
    nothing above the transport."""
    fast = (PKG / "comm" / "_fast.pyx").read_text()
    cimports = {a or b for a, b in _CIMPORT.findall(fast)}
    pyimports = {a or b for a, b in _PYIMPORT.findall(fast)} - cimports
    assert {c for c in cimports if c.startswith("ucxcomm")} == {"ucxcomm.transport._ucp",
                                                                "ucxcomm.comm._kernels"}
    assert not {i for i in pyimports if "transport" in i or i.startswith("ucxx")}, pyimports
    # The shared-memory engine: plain C over mapped memory, nothing of the transport.
    shm = (PKG / "comm" / "_shm.pyx").read_text()
    used = {a or b for a, b in _CIMPORT.findall(shm) + _PYIMPORT.findall(shm)}
    assert {c for c in used if c.startswith("ucxcomm")} == {"ucxcomm.comm._kernels"}, used
    assert not {i for i in used if "transport" in i or i.startswith("ucxx")}, used
    engine = (PKG / "transport" / "_ucp.pyx").read_text()
    above = {a or b for a, b in _PYIMPORT.findall(engine) + _CIMPORT.findall(engine)}
    assert not {i for i in above if i.lstrip(".").startswith(("comm", "pipes", "launch"))
                or i.startswith(("ucxcomm.comm", "ucxcomm.pipes", "ucxcomm.launch"))}, above
