"""Builds the cffi extension ``ucxcomm.transport._ucp`` from the C sources in ``csrc/``.

Used by setup.py at install time (``cffi_modules``) and runnable on its own (``python
tools/build_ucp.py`` builds in place). The cdef is the block between the ``cffi:begin``
and ``cffi:end`` markers of ``csrc/ucxcomm_ucp.h``: every prototype is written once.

It compiles against the UCX headers of the ``libucx`` wheel (or of the UCX under
``UCXCOMM_UCX_PREFIX``) and links ``libucp``/``libucs`` by soname only (no rpath): at run
time the extension binds to whichever libucp ucxx already loaded, so a system UCX with
verbs loaded via ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true`` replaces the wheel's
without rebuilding. ``UCXCOMM_WERROR=1`` turns compiler warnings into errors (CI).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parent.parent
CSRC = "csrc"
HEADER = "ucxcomm_ucp.h"
SOURCES = ["info.c", "tag.c", "rma.c"]
WARNINGS = ["-Wall", "-Wextra"]


def cdef_from_header(text: str) -> str:
    """The declarations between the cffi markers of the header."""
    m = re.search(r"/\* cffi:begin \*/\n(.*?)/\* cffi:end \*/", text, re.S)
    if m is None:
        raise RuntimeError(f"{HEADER}: no cffi:begin/cffi:end block")
    return m.group(1)


def ucx_prefix() -> str:
    prefix = os.environ.get("UCXCOMM_UCX_PREFIX")
    if prefix:
        return prefix
    import libucx  # the wheel that ucxx-cu12 depends on (a build requirement too)

    return os.path.dirname(libucx.__file__)


def make_ffibuilder() -> FFI:
    prefix = ucx_prefix()
    header = (ROOT / CSRC / HEADER).read_text()
    flags = ["-O2", "-std=gnu11", *WARNINGS]
    if os.environ.get("UCXCOMM_WERROR", "") not in ("", "0"):
        flags.append("-Werror")
    ffibuilder = FFI()
    ffibuilder.cdef(cdef_from_header(header))
    ffibuilder.set_source(
        "ucxcomm.transport._ucp",
        f'#include "{HEADER}"',
        # Relative paths: setuptools runs this from the project root.
        sources=[f"{CSRC}/{name}" for name in SOURCES],
        include_dirs=[CSRC],
        # UCX's own headers are not warning-clean under -Wextra: include them as system
        # headers so the flags apply to our code only.
        extra_compile_args=["-isystem", os.path.join(prefix, "include"), *flags],
        library_dirs=[os.path.join(prefix, "lib")],
        libraries=["ucp", "ucs", "dl", "pthread"],
    )
    return ffibuilder


ffibuilder = make_ffibuilder()

if __name__ == "__main__":
    os.chdir(ROOT)
    ffibuilder.compile(verbose=True)
