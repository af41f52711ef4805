"""UCX as objects: workers and endpoints; the only package that touches UCX."""

from .endpoint import Endpoint
from .worker import Worker

__all__ = ["Endpoint", "Worker"]
