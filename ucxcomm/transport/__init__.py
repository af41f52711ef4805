"""UCX as objects: workers and endpoints; the only package that touches UCX."""

from .endpoint import Endpoint
from .listener import Listener, connect, default_worker, listen
from .worker import Worker

__all__ = ["Endpoint", "Listener", "Worker", "connect", "default_worker", "listen"]
