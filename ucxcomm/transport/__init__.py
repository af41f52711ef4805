"""UCX as objects: workers, endpoints (and, later, memory regions); the only package that touches UCX."""

from .endpoint import Endpoint
from .worker import Worker

__all__ = ["Endpoint", "Worker"]
