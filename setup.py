"""Builds the cffi extension ``ucxcomm.transport._ucp``; metadata lives in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["ucxcomm/transport/_ucp_build.py:ffibuilder"])
