"""The one module that imports ucxx and the compiled extension ``_ucp``.

Everything UCX-specific that the rest of the transport needs goes through here: lazy
loading (ucxx first: it loads libucp, which the extension links by soname), the
extension itself (:data:`ucp`, for the worker and the RMA engines), context/worker/
listener/endpoint creation with ucxx, UCX's constants, and the translation of UCX errors
(``ucs_status_t`` values and ucxx exceptions alike) into ``ucxcomm.errors`` through one
table, :data:`STATUS_ERRORS`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..errors import ClosedError, PeerFailure, TruncationError, UcxCommError
from .library import UcxLibrary, load_chosen
from .library import choose as choose_library

__all__ = [
    "STATUS_ERRORS",
    "close_endpoint",
    "const",
    "create_context",
    "create_worker",
    "creating_context",
    "endpoint_from_address",
    "endpoint_transports",
    "library",
    "libucp_path",
    "load",
    "status_error",
    "translate_error",
    "ucp",
    "ucx_errors",
    "ucx_version",
]

log = logging.getLogger(__name__)

#: What a UCX status means for ucxcomm (by its UCX name). Peer errors: the remote side
#: is gone or unreachable (a shared-memory segment error means its owner died).
STATUS_ERRORS: dict[str, type[UcxCommError]] = {
    "UCS_ERR_MESSAGE_TRUNCATED": TruncationError,
    "UCS_ERR_CANCELED": ClosedError,
    "UCS_ERR_CONNECTION_RESET": PeerFailure,
    "UCS_ERR_ENDPOINT_TIMEOUT": PeerFailure,
    "UCS_ERR_UNREACHABLE": PeerFailure,
    "UCS_ERR_NOT_CONNECTED": PeerFailure,
    "UCS_ERR_REJECTED": PeerFailure,
    "UCS_ERR_IO_ERROR": PeerFailure,
    "UCS_ERR_TIMED_OUT": PeerFailure,
    "UCS_ERR_SHMEM_SEGMENT": PeerFailure,
}

_lib: Any = None  # ucxx._lib.libucxx once loaded
_by_status: dict[int, tuple[str, type[UcxCommError]]] = {}
#: The compiled extension (``ucxcomm/transport/_ucp.pyx``, typed by ``_ucp.pyi``), set by
#: :func:`load`.
if TYPE_CHECKING:
    from . import _ucp as ucp
else:
    ucp = None
#: UCX constants by name (``const["UCP_ATOMIC_OP_ADD"]``), set by :func:`load`.
const: dict[str, int] = {}
#: Which UCX was loaded and why (``UCXCOMM_UCX``), set by :func:`load`.
library: UcxLibrary | None = None
_handles: list[Any] = []  # the chosen UCX's libraries, kept loaded


def load() -> Any:
    """Load the UCX that ``UCXCOMM_UCX`` chooses (:mod:`.library`), import ucxx bound to
    it, and then the compiled extension.

    This happens when the first worker is created, never at ``import ucxcomm``.
    Importing ucxx exports a few ``UCX_*`` defaults of its own; :func:`_restore_ucx_env`
    undoes them. Returns the ucxx low-level module.

    Raises
    ------
    ValueError
        A malformed ``UCXCOMM_UCX``.
    UnsupportedError
        The UCX it names is missing, does not load, or is older than ucxx accepts.
    """
    global _lib, ucp, library
    if _lib is not None:
        return _lib
    choice = choose_library()
    _handles.extend(load_chosen(choice))
    before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    libucxx = _import_ucxx(wheel_loader=choice.libucp is None)
    library = choice

    _restore_ucx_env(before)
    # Only after ucxx loaded libucp: the extension resolves libucp.so.0 by soname.
    from . import _ucp as ext  # built by tools/build_ucp.py

    ucp = ext
    ext.set_status_error(status_error)
    # ucxx logs every endpoint error at ERROR level on stderr ("UCXX ERROR
    # ucxx::Endpoint::endpointErrorCallback ... Endpoint is not connected" for each
    # refused connect) from inside worker progress; ucxcomm reports each such error
    # itself (PeerFailure, and an info line in pipes.listener), so that line goes.
    ext.log_drop_ucxx_ep_errors()
    const.update(ext.constants())
    for name, exc in STATUS_ERRORS.items():
        _by_status[const[name]] = (name, exc)
    _lib = libucxx
    return _lib


def _import_ucxx(wheel_loader: bool) -> Any:
    """``import ucxx._lib.libucxx``; unless ``wheel_loader``, with the ``libucx`` wheel's
    ``load_library()`` kept from loading its own UCX next to the one already loaded (two
    copies in one process break: see :mod:`.library`). It stays kept for the life of
    the process: any later caller (ucx-py, distributed-ucxx, ...) would otherwise load
    the wheel's copy next to ours."""
    if wheel_loader:
        import ucxx._lib.libucxx as libucxx

        return libucxx
    try:
        import libucx
    except ModuleNotFoundError:  # no wheel: ucxx finds libucp by soname, ours
        libucx = None
    if libucx is not None:
        libucx.load_library = lambda: []  # (UCX is loaded already: ours)
    import ucxx._lib.libucxx as libucxx

    return libucxx


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
    return str(ucp.version_string())


def libucp_path() -> str:
    """Path of the libucp shared object in use (wheel or system)."""
    load()
    return str(ucp.libucp_path())


# ------------------------------------------------------------------ errors
def _make(exc: type[UcxCommError], status_name: str, text: str, peer: Any,
          what: str) -> UcxCommError:
    if exc is PeerFailure:
        return PeerFailure(f"{what}: peer {peer} failed ({text})", peer=peer)
    if exc is TruncationError:
        return TruncationError(f"{what}: message truncated ({text})")
    if exc is ClosedError:
        return ClosedError(f"{what} canceled ({text})")
    return exc(f"{what} failed: {text} ({status_name})")


def status_error(status: int, peer: Any = None, what: str = "operation") -> UcxCommError:
    """The ucxcomm exception for a negative ``ucs_status_t``."""
    text = ucp.status_string(status)
    name, exc = _by_status.get(status, (f"ucs_status_t {status}", UcxCommError))
    return _make(exc, name, text, peer, what)


def _status_name(exc: BaseException) -> str:
    """``UCXConnectionResetError`` -> ``UCS_ERR_CONNECTION_RESET`` (ucxx names its
    exceptions after UCX's statuses)."""
    name = type(exc).__name__
    name = re.sub(r"^UCXX?", "", name)
    name = re.sub(r"Error$", "", name)
    name = {"Canceled": "CANCELED", "MsgTruncated": "MESSAGE_TRUNCATED",
            "IO": "IO_ERROR"}.get(name) or re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()
    return "UCS_ERR_" + name


def translate_error(exc: BaseException, peer: Any = None,
                    what: str = "operation") -> UcxCommError:
    """The ucxcomm exception for a ucxx exception (callers ``raise ... from exc``)."""
    if _lib is not None and isinstance(exc, _lib.UCXCloseError):
        return ClosedError(f"{what}: closed ({exc})")
    name = _status_name(exc)
    found = STATUS_ERRORS.get(name)
    if found is None:
        return UcxCommError(f"{what} failed: {exc}")
    return _make(found, name, str(exc), peer, what)


def ucx_errors() -> tuple[type[BaseException], ...]:
    """The exception classes ucxx raises (for ``except``; empty before :func:`load`)."""
    return (_lib.UCXError,) if _lib is not None else ()


def _call(fn: Callable[..., Any], *args: Any, peer: Any = None, what: str) -> Any:
    """Call into ucxx, translating its exceptions."""
    try:
        return fn(*args)
    except ucx_errors() as exc:
        raise translate_error(exc, peer, what) from exc


# ------------------------------------------------------------------ objects
#: What UCX 1.19/1.20 say at every ``ucp_init`` from code built against 1.21's headers
#: (ucxx and our extension are): "UCP API version is incompatible: required >= 1.21,
#: actual 1.20.1". The context is created all the same, on the older API.
_API_WARNING = "UCP API version is incompatible"
_api_noted = False


@contextmanager
def creating_context(what: str) -> Iterator[None]:
    """Around a ``ucp_init`` (ucxx's context, an RMA engine's): UCX's warnings go to this
    module's log instead of stdout, its API-version warning once, at info level, since
    ``UCXCOMM_UCX`` may choose a UCX older than the headers we were built with
    (docs/transports.md)."""
    global _api_noted
    load()
    ucp.log_quiet_push()
    try:
        yield
    finally:
        for line in ucp.log_quiet_pop():
            if _API_WARNING not in line:
                log.warning("%s: UCX: %s", what, line)
            elif not _api_noted:
                _api_noted = True
                log.info("UCX %s is older than the API ucxx and ucxcomm were built "
                         "against; UCX says: %s", ucp.version_string(), line)


def create_context(config: dict[str, str] | None = None) -> Any:
    """A UCP context with TAG, RMA, AMO32, AMO64, AM and WAKEUP features."""
    ucxx = load()
    f = ucxx.Feature
    features = (f.TAG, f.RMA, f.AMO32, f.AMO64, f.AM, f.WAKEUP)
    with creating_context("creating the UCX context"):
        return _call(lambda: ucxx.UCXContext(dict(config or {}), feature_flags=features),
                     what="creating the UCX context")


def create_worker(context: Any) -> Any:
    """A worker whose requests we poll ourselves (no ucxx notifier thread)."""
    ucxx = load()

    def make() -> Any:
        worker = ucxx.UCXWorker(context, enable_delayed_submission=False,
                                enable_python_future=False)
        worker.init_blocking_progress_mode()
        return worker

    return _call(make, what="creating the UCX worker")


def endpoint_from_address(worker: Any, address: bytes, peer: Any = None, *,
                          error_handling: bool = False) -> Any:
    """A UCX endpoint to the worker at ``address``, without UCX peer error handling
    (which would keep it off shared memory) unless ``error_handling``; without it, the
    endpoint gets ucxcomm's error callback instead (with it, ucxx's own).

    A peer that died leaves shared-memory segments UCX cannot attach: that raises
    :class:`~ucxcomm.PeerFailure` naming ``peer``, and UCX's own error lines about it
    (up to 8 per attempt) are kept out of the user's stderr (logged at debug level)."""
    ucxx = load()
    what = "connecting" if peer is None else f"connecting to rank {peer}"
    ucp.log_quiet_push()
    try:
        ep = _call(lambda: worker.create_endpoint_from_worker_address(
            ucxx.UCXAddress.create_from_buffer(address), error_handling), peer=peer,
            what=what)
    except BaseException:
        for line in ucp.log_quiet_pop():  # the exception says it
            log.debug("%s: UCX: %s", what, line)
        raise
    for line in ucp.log_quiet_pop():  # it worked: UCX's warnings still deserve a look
        log.warning("%s: UCX: %s", what, line)
    # Without error handling UCX aborts the process when a lane reports the peer gone
    # (a CMA copy out of a peer that died mid-transfer); an error callback makes it fail
    # the endpoint's requests instead (docs/design.md, "Failure detection").
    status = 0 if error_handling else ucp.ep_catch_errors(ep.handle)
    if status != 0:  # pragma: no cover - UCX refuses only bad parameters
        raise status_error(status, peer=peer, what=f"{what}: error callback")
    return ep


def expect_lost_requests() -> None:
    """A peer failed: a rendezvous send to it that was in flight on an endpoint without
    UCX error handling can never complete nor be purged (UCX refuses a forced close
    there), and UCX warns about it and its buffer's registration when the worker is
    destroyed ("... was not returned to mpool", "ucp_rcache: destroying inuse region").
    From now on those two warnings are dropped (docs/design.md, "Failure
    detection")."""
    load()
    ucp.log_drop_lost_requests()


def close_endpoint(ucx_ep: Any, peer_dead: bool = False) -> None:
    """Close a ucxx endpoint unless UCX already failed it (ucxx crashes closing those).

    ``peer_dead``: the peer is known to have died (or UCX reported the endpoint failed,
    through the error callback of :func:`endpoint_from_address`); UCX's complaints
    while closing (the flush of each lane failing: "error during flush: Connection
    reset by remote peer") say nothing new, and go to this module's log at debug
    level."""
    handle = getattr(ucx_ep, "handle", 0) if ucx_ep.alive else 0
    if handle and ucp.ep_failed(handle, True):
        peer_dead = True
    if peer_dead:
        ucp.log_quiet_push()
    try:
        if ucx_ep.alive:
            ucx_ep.close()
    except ucx_errors():  # pragma: no cover - UCX tore it down meanwhile
        log.debug("closing an endpoint UCX already closed", exc_info=True)
    finally:
        if peer_dead:
            for line in ucp.log_quiet_pop():
                log.debug("closing an endpoint to a dead peer: UCX: %s", line)


def endpoint_transports(ep_handle: int) -> list[tuple[str, str]]:
    """The (transport, device) lanes UCX chose for an endpoint (``ucp_ep_query``)."""
    load()
    status, text = ucp.ep_transports(ep_handle)
    if status != 0:
        raise status_error(status, what="ucp_ep_query")
    lanes = []
    for item in filter(None, text.split(";")):
        tl, _, dev = item.partition("/")
        lanes.append((tl, dev))
    return lanes
