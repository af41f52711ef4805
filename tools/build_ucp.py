"""How the compiled extensions are built (setup.py uses this): the transport's engine
``ucxcomm.transport._ucp`` and the communicator's fast paths ``ucxcomm.comm._fast``.

Two parts, so that each gets the warnings it deserves:

* ``ucxcomm_csrc``: the C helpers in ``csrc/`` (info, tag path, RMA engine, counters), a
  static library compiled with ``-Wall -Wextra`` (``-Werror`` when ``UCXCOMM_WERROR=1``, as
  ci/env.sh sets it); UCX's own headers are included as system headers (they are not
  ``-Wextra`` clean);
* the Cython module ``ucxcomm/transport/_ucp.pyx`` (generated C: Cython's own warnings are
  not ours to fix), linked with that library;
* the Cython module ``ucxcomm/comm/_fast.pyx``, which uses the engine at C level through
  its declarations (``ucxcomm/transport/_ucp.pxd``, cimported: calls through the engine
  type's method table, imported at run time), so it links nothing of UCX or csrc;
* the Cython module ``ucxcomm/comm/_shm.pyx``: the node's shared-memory collective
  engine, plain C over mapped memory (nothing of UCX).

Both compile against the UCX headers of the ``libucx`` wheel (or of the UCX under
``UCXCOMM_UCX_PREFIX``) and link ``libucp``/``libucs`` by soname only (no rpath): at run
time the extension binds to whichever libucp ucxx already loaded, so a system UCX with
verbs loaded via ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true`` replaces the wheel's without
rebuilding.
"""

from __future__ import annotations

import os
from typing import Any

CSRC = "csrc"
C_SOURCES = ["info.c", "tag.c", "rma.c", "stats.c"]
WARNINGS = ["-Wall", "-Wextra"]


def ucx_prefix() -> str:
    prefix = os.environ.get("UCXCOMM_UCX_PREFIX")
    if prefix:
        return prefix
    import libucx  # the wheel that ucxx-cu12 depends on (a build requirement too)

    return os.path.dirname(libucx.__file__)


def c_library() -> tuple[str, dict[str, Any]]:
    """The ``libraries`` entry (setuptools build_clib) for the C helpers."""
    flags = ["-O2", "-std=gnu11", "-fPIC", *WARNINGS,
             "-isystem", os.path.join(ucx_prefix(), "include")]
    if os.environ.get("UCXCOMM_WERROR", "") not in ("", "0"):
        flags.append("-Werror")
    return ("ucxcomm_csrc", {"sources": [f"{CSRC}/{name}" for name in C_SOURCES],
                             "include_dirs": [CSRC], "cflags": flags})


def extensions() -> list[Any]:
    """The Cython extensions, cythonized."""
    from Cython.Build import cythonize
    from setuptools import Extension

    prefix = ucx_prefix()
    ext = Extension(
        "ucxcomm.transport._ucp",
        ["ucxcomm/transport/_ucp.pyx"],  # relative: setuptools runs from the project root
        include_dirs=[CSRC],
        extra_compile_args=["-O2", "-isystem", os.path.join(prefix, "include")],
        library_dirs=[os.path.join(prefix, "lib")],
        # ucxcomm_csrc first: it needs libucp/libucs, which come after it.
        libraries=["ucxcomm_csrc", "ucp", "ucs", "dl", "pthread"],
    )
    fast = Extension("ucxcomm.comm._fast", ["ucxcomm/comm/_fast.pyx"],
                     extra_compile_args=["-O2"])
    # -O3: the reduction loops vectorize
    shm = Extension("ucxcomm.comm._shm", ["ucxcomm/comm/_shm.pyx"], extra_compile_args=["-O3"])
    # include_path: where `cimport ucxcomm.transport._ucp` finds the .pxd
    return cythonize([ext, fast, shm], language_level=3, quiet=True, include_path=["."])
