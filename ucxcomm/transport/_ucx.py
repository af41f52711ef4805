"""The one module that imports ucxx and the cffi extension ``_ucp``.

Everything UCX-specific that the rest of the transport needs goes through here:
lazy loading, context/worker creation, buffer wrapping, tags, capability probes and
the translation of UCX errors into ``ucxcomm.errors`` (done once, here).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import ClosedError, PeerFailure, TruncationError, UcxCommError

__all__ = [
    "Array",
    "create_context",
    "create_worker",
    "endpoint_transports",
    "libucp_path",
    "load",
    "make_tag",
    "make_tag_mask",
    "status_error",
    "translate_error",
    "ucx_version",
]

log = logging.getLogger(__name__)

_lib: Any = None  # ucxx._lib.libucxx once loaded
_arr: Any = None  # ucxx._lib.arr
_ucp: Any = None  # the cffi extension
Array: Any = None
#: The extension's ``ffi`` and ``lib`` (the tag hot path), set by :func:`load`.
ffi: Any = None
lib: Any = None


def load() -> Any:
    """Import ucxx (which loads libucp) and then the cffi extension bound to it.

    This happens at ``init()`` time, never at ``import ucxcomm``. Importing ucxx
    exports a few ``UCX_*`` defaults of its own; :func:`_restore_ucx_env` undoes them.
    Returns the ucxx low-level module.
    """
    global _lib, _arr, _ucp, Array, ffi, lib
    if _lib is not None:
        return _lib
    before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    import ucxx._lib.arr as ucxx_arr
    import ucxx._lib.libucxx as libucxx

    _restore_ucx_env(before)
    # Only after ucxx loaded libucp: the extension resolves libucp.so.0 by soname.
    from . import _ucp as ucp_ext  # type: ignore[attr-defined]  # built by cffi

    _arr, _ucp, Array = ucxx_arr, ucp_ext, ucxx_arr.Array
    ffi, lib = ucp_ext.ffi, ucp_ext.lib
    _lib = libucxx
    return _lib


def _restore_ucx_env(before: dict[str, str]) -> None:
    """Undo the ``UCX_*`` defaults that importing ucxx exported behind the user's back.

    ucxx sets e.g. ``UCX_MAX_RNDV_RAILS=1``, which cut 64 MiB tag bandwidth over TCP from
    2.4 to 0.6 GB/s in ``ucx_perftest`` here, and ``UCX_MEMTYPE_CACHE=n``, which UCX 1.21
    warns about. We run on UCX's own defaults plus whatever the user set; the choice
    lives here, in one place (docs/design.md).
    """
    for key in [k for k in os.environ if k.startswith("UCX_")]:
        if key not in before:
            log.debug("dropping %s=%s exported by ucxx", key, os.environ[key])
            del os.environ[key]
        elif os.environ[key] != before[key]:
            os.environ[key] = before[key]


def ucx_version() -> str:
    """The version string of the libucp actually loaded."""
    load()
    return _ucp.ffi.string(_ucp.lib.ucp_get_version_string()).decode()


def libucp_path() -> str:
    """Path of the libucp shared object in use (wheel or system)."""
    load()
    return _ucp.ffi.string(_ucp.lib.ucxcomm_libucp_path()).decode()


def create_context(config: dict[str, str] | None = None) -> Any:
    """A UCP context with TAG, STREAM, RMA, AMO32, AMO64, AM and WAKEUP features."""
    ucxx = load()
    f = ucxx.Feature
    features = (f.TAG, f.STREAM, f.RMA, f.AMO32, f.AMO64, f.AM, f.WAKEUP)
    try:
        return ucxx.UCXContext(dict(config or {}), feature_flags=features)
    except ucxx.UCXError as exc:
        raise translate_error(exc) from exc


def create_worker(context: Any) -> Any:
    """A worker whose requests we poll ourselves (no ucxx notifier thread)."""
    ucxx = load()
    worker = ucxx.UCXWorker(context, enable_delayed_submission=False,
                            enable_python_future=False)
    worker.init_blocking_progress_mode()
    return worker


def status_error(status: int, peer: Any = None, what: str = "operation") -> UcxCommError:
    """Map a negative ``ucs_status_t`` to the ucxcomm hierarchy."""
    c = lib
    text = ffi.string(c.ucs_status_string(status)).decode()
    if status == c.UCS_ERR_MESSAGE_TRUNCATED:
        return TruncationError(f"{what}: message truncated ({text})")
    if status == c.UCS_ERR_CANCELED:
        return ClosedError(f"{what} canceled ({text})")
    if status in (c.UCS_ERR_CONNECTION_RESET, c.UCS_ERR_ENDPOINT_TIMEOUT,
                  c.UCS_ERR_UNREACHABLE, c.UCS_ERR_NOT_CONNECTED, c.UCS_ERR_REJECTED,
                  c.UCS_ERR_IO_ERROR, c.UCS_ERR_TIMED_OUT, c.UCS_ERR_SHMEM_SEGMENT):
        # (a shared-memory segment error: the peer that owned it is gone)
        return PeerFailure(f"{what}: peer {peer} failed ({text})", peer=peer)
    return UcxCommError(f"{what} failed: {text} (ucs_status_t {status})")


def make_tag(value: int) -> Any:
    return _lib.UCXXTag(value)


def make_tag_mask(value: int) -> Any:
    return _lib.UCXXTagMask(value)


def create_listener(worker: Any, port: int, callback: Any) -> Any:
    """A UCX listener on ``port`` (0: any); ``callback(conn_request)`` runs during
    worker progress."""
    ucxx = load()
    try:
        return ucxx.UCXListener.create(worker, port, callback)
    except ucxx.UCXError as exc:
        raise translate_error(exc) from exc


def address_from_bytes(data: bytes) -> Any:
    return _lib.UCXAddress.create_from_buffer(data)


def endpoint_transports(ep_handle: int) -> list[tuple[str, str]]:
    """The (transport, device) lanes UCX chose for an endpoint (``ucp_ep_query``)."""
    load()
    out = _ucp.ffi.new("char[]", 4096)
    status = _ucp.lib.ucxcomm_ep_transports(ep_handle, out, 4096)
    if status != 0:
        msg = _ucp.ffi.string(_ucp.lib.ucs_status_string(status)).decode()
        raise UcxCommError(f"ucp_ep_query failed: {msg}")
    text = _ucp.ffi.string(out).decode()
    lanes = []
    for item in filter(None, text.split(";")):
        tl, _, dev = item.partition("/")
        lanes.append((tl, dev))
    return lanes


def is_canceled(exc: BaseException) -> bool:
    return _lib is not None and isinstance(exc, (_lib.UCXCanceled, _lib.UCXCanceledError))


def is_ucx_error(exc: BaseException) -> bool:
    return _lib is not None and isinstance(exc, _lib.UCXError)


def translate_error(exc: BaseException, peer: Any = None) -> UcxCommError:
    """Map a ucxx exception to the ucxcomm hierarchy (callers ``raise ... from exc``)."""
    lib = _lib
    if lib is None or not isinstance(exc, lib.UCXError):
        return UcxCommError(str(exc))
    if isinstance(exc, (lib.UCXMsgTruncated, lib.UCXMessageTruncatedError)):
        return TruncationError(f"message truncated: {exc}")
    if isinstance(exc, (lib.UCXCanceled, lib.UCXCanceledError, lib.UCXCloseError)):
        return ClosedError(f"operation canceled by close: {exc}")
    peer_errors = (
        lib.UCXConnectionResetError, lib.UCXEndpointTimeoutError, lib.UCXUnreachableError,
        lib.UCXNotConnectedError, lib.UCXRejectedError, lib.UCXIOError, lib.UCXTimedOutError,
    )
    if isinstance(exc, peer_errors):
        return PeerFailure(f"peer {peer} failed: {exc}", peer=peer)
    return UcxCommError(f"UCX error: {exc}")
