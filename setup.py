"""Builds the compiled extension ``ucxcomm.transport._ucp`` (Cython module
ucxcomm/transport/_ucp.pyx over the C helpers in csrc/; see tools/build_ucp.py); metadata
lives in pyproject.toml."""

import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools"))
from build_ucp import c_library, extensions  # noqa: E402

setup(libraries=[c_library()], ext_modules=extensions())
