"""PyTorch integration: importing ``ucxcomm.torch`` registers the c10d backend ``"ucxcomm"``.

::

    import torch.distributed as dist
    import ucxcomm.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("ucxcomm")   # under torchrun or ``ucxcomm run``

The process group runs ucxcomm on an event-loop thread of its own; every call returns a
``Work`` at once (``async_op=True`` overlaps with computation), DDP works, CPU and CUDA
tensors; ``torch.distributed.shrink_group`` lets the survivors of a death go on. See
docs/torch.md. Importing ``ucxcomm`` itself never imports torch.
"""

from __future__ import annotations

try:
    import torch.distributed as _dist
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ucxcomm.torch needs PyTorch: pip install 'ucxcomm[torch]'") from exc

from ._work import PeerFailureError, ShrinkMismatchError, Work, WorkError, WorkTimeoutError
from .process_group import (
    BACKEND_NAME,
    ProcessGroupUCXComm,
    create_process_group,
    install_shrink_support,
)

__all__ = ["BACKEND_NAME", "PeerFailureError", "ProcessGroupUCXComm", "ShrinkMismatchError",
           "Work", "WorkError", "WorkTimeoutError", "create_process_group"]

if BACKEND_NAME.upper() not in _dist.Backend._plugins:
    _dist.Backend.register_backend(BACKEND_NAME, create_process_group,
                                   devices=["cpu", "cuda"])
install_shrink_support()  # (torch.distributed.shrink_group: docs/torch.md)
