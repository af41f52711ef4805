"""Which UCX library this process loads (``UCXCOMM_UCX``), decided before ucxx is imported.

ucxx loads UCX through the ``libucx`` wheel's ``load_library()``: the wheel's own copy,
built without verbs, or with ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true`` whatever
``dlopen("libucs.so")`` finds first on the loader's path. Neither can be steered from
inside a running program. Measured here (glibc 2.36, ucxx 0.52, 2026-12-03):

- ``LD_LIBRARY_PATH`` set by Python before ``import ucxx`` is ignored: the dynamic loader
  reads it when the process starts, so the wheel's UCX 1.21 was loaded.
- Loading another UCX by full path and then letting ``libucx.load_library()`` run put two
  UCX copies in the process: the wheel's ``libuct.so`` bound to the other ``libucs.so.0``
  by soname and failed ("undefined symbol: ucs_ifname_to_ndev_index"), or crashed when
  the first copy was loaded ``RTLD_GLOBAL``.

So a chosen ``libucp`` is loaded here by full path (its ``libuct``, ``libucs`` and
``libucm`` come by its RUNPATH, else the loader's path; loading those first one by one
fails: ``libucm`` alone has undefined ``libucs`` symbols) and :func:`ucxcomm.transport._ucx.load`
then imports ucxx without letting the wheel's loader add its copy; ucxx's ``libucxx.so``
and our extension bind to the loaded ``libucp.so.0`` by soname. :func:`choose` decides
(with a reason that ``ucxcomm info`` prints); :func:`load_chosen` loads.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .. import settings
from ..errors import UnsupportedError

__all__ = ["MIN_VERSION", "UcxLibrary", "choose", "library_dir", "load_chosen",
           "loaded_libucp", "pip_installed", "probe", "requested", "source_of",
           "wheel_libucp"]

log = logging.getLogger(__name__)

#: The oldest UCX ucxx 0.52 accepts ("Support for UCX 1.13.1 has ended" at import).
MIN_VERSION = (1, 19)

#: UCX copies that pip installs inside other packages: distribution -> the tail of its
#: libucp's path in the distribution's RECORD. The ``rdma`` extra installs ``mpich``,
#: whose wheel bundles a UCX built with verbs and rdmacm (and without CUDA).
PIP_COPIES = {"mpich": "mpich/libucp.so.0"}

_WORDS = ("auto", "wheel", "system", *PIP_COPIES)


@dataclass(frozen=True)
class UcxLibrary:
    """The UCX this process uses and why.

    ``libucp`` is the file :func:`load_chosen` loads by full path, or ``None`` when
    ucxx's own loader decides (then ``ucxcomm info`` names what it loaded).
    """

    requested: str  # the UCXCOMM_UCX value: auto, wheel, system, mpich or a path
    source: str  # wheel, system, mpich, path, ucxx (its own loader) or preloaded
    libucp: str | None
    reason: str


# ------------------------------------------------------------------ where UCX copies are
def library_dir(path: str) -> str:
    """The ``libucp`` file of a UCX given as that file, its directory, or its prefix
    (``PREFIX/lib`` or ``PREFIX/lib64``).

    Raises
    ------
    ValueError
        No ``libucp.so.0`` (or ``libucp.so``) there.
    """
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(path):
        if os.path.basename(path).startswith("libucp.so"):
            return path
        raise ValueError(f"{path} is not a libucp shared object")
    for sub in ("", "lib", "lib64"):
        for name in ("libucp.so.0", "libucp.so"):
            candidate = os.path.join(path, sub, name)
            if os.path.isfile(candidate):
                return candidate
    raise ValueError(f"no libucp.so.0 in {path}, {path}/lib or {path}/lib64")


def wheel_libucp() -> str | None:
    """The ``libucp`` of the ``libucx`` wheel (the UCX ucxx loads by default), if any."""
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = os.path.join(next(iter(spec.submodule_search_locations)), "lib")
    for name in ("libucp.so.0", "libucp.so"):
        if os.path.isfile(os.path.join(lib, name)):
            return os.path.join(lib, name)
    return None


def pip_installed() -> dict[str, str]:
    """``{distribution: libucp path}`` of the UCX copies in installed packages
    (:data:`PIP_COPIES`)."""
    found = {}
    for dist_name, tail in PIP_COPIES.items():
        try:
            files = importlib.metadata.distribution(dist_name).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in files:
            if str(f).replace(os.sep, "/").endswith(tail):
                path = os.path.realpath(str(f.locate()))
                if os.path.isfile(path):
                    found[dist_name] = path
                break
    return found


def _mapped(prefixes: tuple[str, ...]) -> list[str]:
    """Files mapped into this process whose names start with one of ``prefixes``."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith(prefixes) and path not in found:
                    found.append(path)
    except OSError:  # pragma: no cover - no procfs
        pass
    return found


def loaded_libucp() -> str | None:
    """The ``libucp`` already mapped into this process (by anyone), else ``None``."""
    found = _mapped(("libucp.so",))
    return found[0] if found else None


def _same_library(a: str, b: str) -> bool:
    """Whether two libucp paths are one UCX (a wheel holds copies, not symlinks, of
    ``libucp.so``, ``.so.0`` and ``.so.0.0.0``: compare directories)."""
    return os.path.dirname(os.path.realpath(a)) == os.path.dirname(os.path.realpath(b))


def _modules(libucp: str) -> set[str]:
    from .config import ucx_modules  # (no UCX loaded by it)

    return ucx_modules(libucp)


# ------------------------------------------------------------------ probing a copy
_PROBE = r"""
import ctypes, json, sys
ucp = ctypes.CDLL(sys.argv[1], ctypes.RTLD_LOCAL)
v = [ctypes.c_uint() for _ in range(3)]
ucp.ucp_get_version(*[ctypes.byref(x) for x in v])
try:
    ctypes.CDLL("libibverbs.so.1")
    ibverbs = True
except OSError:
    ibverbs = False
print(json.dumps({"version": [x.value for x in v], "ibverbs": ibverbs}))
"""


def probe(libucp: str, timeout: float = 30.0) -> tuple[tuple[int, ...], bool]:
    """``(version, libibverbs loadable)`` of the UCX at ``libucp``, learnt in a child
    process so that this one loads no UCX it may not use.

    Raises
    ------
    UnsupportedError
        The library cannot be loaded (the message carries the loader's error).
    """
    try:
        proc = subprocess.run([sys.executable, "-I", "-c", _PROBE, libucp],
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise UnsupportedError(f"probing the UCX at {libucp} took over {timeout} s") \
            from None
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()[-1:] or ["(no message)"]
        raise UnsupportedError(f"cannot load the UCX at {libucp}: {err[0]}")
    out = json.loads(proc.stdout)
    return tuple(out["version"]), bool(out["ibverbs"])


def _version_text(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


# ------------------------------------------------------------------ the choice
def requested(env: Mapping[str, str] | None = None) -> str:
    """The ``UCXCOMM_UCX`` value: ``auto``, ``wheel``, ``system``, ``mpich`` or the
    absolute path of a ``libucp`` file.

    Raises
    ------
    ValueError
        A malformed value, or a path holding no UCX (the message names the variable).
    """
    value = settings.get("UCXCOMM_UCX", env)
    if value in _WORDS:
        return str(value)
    try:
        return library_dir(value)
    except ValueError as exc:
        raise ValueError(f"UCXCOMM_UCX={value!r}: {exc}") from None


def _truthy(text: str | None) -> bool:
    # As libucx's loader reads RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY: anything but "false".
    return text is not None and text.lower() != "false"


def choose(value: str | None = None, env: Mapping[str, str] | None = None, *,
           sysfs: str = "/sys/class/infiniband",
           probe_fn: Callable[[str], tuple[tuple[int, ...], bool]] = probe,
           installed: Mapping[str, str] | None = None,
           wheel: str | None = None, already: str | None = None) -> UcxLibrary:
    """Decide which UCX to load for ``value`` (default: ``UCXCOMM_UCX``).

    ``auto`` keeps ucxx's own loader unless an active RDMA port is present and the UCX
    that loader would use (the wheel's) has no verbs: then a verbs-capable UCX >= 1.19
    that pip installed (:func:`pip_installed`) is used, if its ``libibverbs`` loads and
    it does not cost CUDA support on a machine with a GPU. A UCX already loaded into the
    process (by ``import ucxx`` or an MPI library before ucxcomm) is kept.

    The keyword arguments replace what is read from this machine (for tests on recorded
    listings): the sysfs tree, the probe of a copy, the installed copies, the wheel's
    libucp and the libucp already loaded.

    Raises
    ------
    ValueError
        A malformed ``UCXCOMM_UCX``.
    UnsupportedError
        The requested UCX is not installed, or a different UCX is already loaded.
    """
    from .config import scan_sysfs

    env = os.environ if env is None else env
    want = requested(env) if value is None else value
    installed = pip_installed() if installed is None else installed
    wheel = wheel_libucp() if wheel is None else wheel
    already = loaded_libucp() if already is None else already
    label = f"UCXCOMM_UCX={want}"

    target: str | None = None
    if want == "wheel":
        if wheel is None:
            raise UnsupportedError(f"{label}: the libucx wheel is not installed")
        target = wheel
    elif want in PIP_COPIES:
        target = installed.get(want)
        if target is None:
            raise UnsupportedError(f"{label}: the {want} package is not installed (pip "
                                   f"install 'ucxcomm[rdma]' installs it)")
    elif want not in ("auto", "system"):
        target = want
    if already:
        if target is not None and not _same_library(target, already):
            raise UnsupportedError(f"{label}, but the UCX at {already} was loaded into this "
                                   "process before ucxcomm (by ucxx or an MPI library); "
                                   "start the program with no UCX loaded")
        return UcxLibrary(want, "preloaded", already, f"{label}: the UCX at {already} "
                          "was already loaded into this process before ucxcomm; kept")
    if want == "system":
        return UcxLibrary(want, "system", "libucp.so.0", f"{label}: libucp.so.0 from the "
                          "dynamic loader's path (LD_LIBRARY_PATH as set when the process "
                          "started, /etc/ld.so.cache)")
    if target is not None:
        source = "path" if want.startswith("/") else want
        what = {"wheel": "the libucx wheel's UCX",
                "path": "the UCX given"}.get(source, f"the UCX inside the {source} package")
        return UcxLibrary(want, source, target, f"{label}: {what}")

    # auto
    if _truthy(env.get("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY")):
        return UcxLibrary(want, "ucxx", None, f"{label}: RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY "
                          "is set, so ucxx's own loader picks (a system UCX found as "
                          "libucs.so, else the wheel's)")
    active = [p for p in scan_sysfs(sysfs) if p.active]
    if not active:
        return UcxLibrary(want, "ucxx", None, f"{label}: no active RDMA port, so the "
                          "libucx wheel's UCX (ucxx's default)")
    ports = ", ".join(f"{p.name} {p.kind}" for p in active)
    if wheel is None or "uct_ib" in _modules(wheel):
        return UcxLibrary(want, "ucxx", None, f"{label}: RDMA port {ports} and ucxx's "
                          "default UCX" + (" has verbs" if wheel else ""))
    gpu = os.path.exists("/dev/nvidiactl") and "uct_cuda" in _modules(wheel)
    notes = []
    for name, libucp in installed.items():
        modules = _modules(libucp)
        if "uct_ib" not in modules:
            notes.append(f"{name}'s UCX has no verbs")
            continue
        if gpu and "uct_cuda" not in modules:
            notes.append(f"{name}'s UCX has no CUDA support and this machine has a GPU "
                         f"(UCXCOMM_UCX={name} to prefer RDMA)")
            continue
        try:
            version, ibverbs = probe_fn(libucp)
        except UnsupportedError as exc:
            notes.append(str(exc))
            continue
        if version[:2] < MIN_VERSION:
            notes.append(f"{name}'s UCX {_version_text(version)} is older than "
                         f"{_version_text(MIN_VERSION)}")
            continue
        if not ibverbs:
            notes.append(f"{name}'s UCX needs libibverbs.so.1 (Debian: apt-get install "
                         "libibverbs1 ibverbs-providers)")
            continue
        return UcxLibrary(want, name, libucp, f"{label}: RDMA port {ports}, and the wheel's "
                          f"UCX has no verbs: the UCX {_version_text(version)} inside the "
                          f"{name} package (verbs" + (", rdmacm" if "uct_rdmacm" in modules
                                                       else "") + ")")
    hint = "; ".join(notes) or "none installed: pip install 'ucxcomm[rdma]'"
    return UcxLibrary(want, "ucxx", None, f"{label}: RDMA port {ports}, but the wheel's UCX "
                      f"has no verbs and no verbs-capable UCX was found ({hint}); the wheel's")


def source_of(choice: UcxLibrary, libucp: str) -> str:
    """``choice.source``, except that where ucxx's own loader chose, whether it took the
    wheel's UCX or a system one (``libucp`` is the one loaded)."""
    if choice.source != "ucxx":
        return choice.source
    wheel = wheel_libucp()
    return "wheel" if wheel and _same_library(wheel, libucp) else "system"


def load_chosen(choice: UcxLibrary) -> list[ctypes.CDLL]:
    """Load ``choice.libucp`` (with the libraries next to it) by full path; nothing for
    ucxx's own loader or a UCX already loaded. Returns the handles (keep them).

    Raises
    ------
    UnsupportedError
        The library does not load, or is older than :data:`MIN_VERSION`.
    """
    if choice.libucp is None or choice.source == "preloaded":
        return []
    label = f"UCXCOMM_UCX={choice.requested}"
    try:
        handle = ctypes.CDLL(choice.libucp, ctypes.RTLD_LOCAL)
    except OSError as exc:
        if choice.source == "system":
            raise UnsupportedError(f"{label}: no loadable libucp.so.0 on the dynamic "
                                   "loader's path (LD_LIBRARY_PATH as set when the process "
                                   f"started, /etc/ld.so.cache): {exc}") from None
        raise UnsupportedError(f"{label}: cannot load UCX ({exc}); if its libraries are "
                               "not found, start the process with LD_LIBRARY_PATH set to "
                               "their directory") from None
    libucp = loaded_libucp() or choice.libucp
    strays = [p for p in _mapped(("libucs.so", "libuct.so", "libucm.so"))
              if os.path.dirname(p) != os.path.dirname(libucp)]
    if strays:
        raise UnsupportedError(f"{label}: {libucp} loaded its companions from elsewhere "
                               f"({', '.join(strays)}); set LD_LIBRARY_PATH to its directory "
                               "when the process starts")
    v = [ctypes.c_uint() for _ in range(3)]
    handle.ucp_get_version(*[ctypes.byref(x) for x in v])
    version = tuple(x.value for x in v)
    if version[:2] < MIN_VERSION:
        raise UnsupportedError(f"{label}: UCX {_version_text(version)} at "
                               f"{libucp} is older than "
                               f"{_version_text(MIN_VERSION)}, the oldest ucxx accepts")
    log.info("UCX %s: %s", _version_text(version), choice.reason)
    return [handle]
