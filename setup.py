"""Builds the cffi extension ``ucxcomm.transport._ucp`` (tools/build_ucp.py, C sources in
csrc/); metadata lives in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["tools/build_ucp.py:ffibuilder"])
