"""Failure and timeout handling: no distributed attention call waits forever.

Every call that posts a send, a receive or a collective goes through
:func:`guarded_post`, and every wait on one through :func:`guarded_wait`,
with a timeout (seconds) taken from the call's ``timeout=`` or, when that is
``None``, from :func:`set_timeout` (default 300 s, or the environment variable
``ATTNLAB_DIST_TIMEOUT``).  What the backend raises is turned into one of:

* :class:`PeerTimeoutError` (also a ``TimeoutError``): a peer never arrived within the
  timeout — it hung, is still busy elsewhere, or never called the same function;
* :class:`PeerFailureError`: the connection to a peer closed — that process exited or
  crashed (gloo notices this at once, before the timeout);
* :class:`DistributedAttentionError` for anything else the backend reported.

Each message names the function, this rank, the peer (where one is known), the
message or collective that was waited on and the timeout, and how to change it.
After such an error the process group is in an unknown state: destroy it
(``torch.distributed.destroy_process_group()``) rather than reuse it.

>>> set_timeout(60.0); get_timeout()
60.0
>>> set_timeout(None); get_timeout() == _ENV_DEFAULT
True
"""

from __future__ import annotations

import datetime
import os

from attnlab.validate import real

__all__ = [
    "DistributedAttentionError",
    "PeerTimeoutError",
    "PeerFailureError",
    "set_timeout",
    "get_timeout",
    "resolve_timeout",
    "guarded_wait",
    "guarded_post",
]


class DistributedAttentionError(RuntimeError):
    """A communication step of a distributed attention call failed."""


class PeerTimeoutError(DistributedAttentionError, TimeoutError):
    """A peer did not send, receive or join a collective within the timeout."""


class PeerFailureError(DistributedAttentionError):
    """The connection to a peer closed: that process exited or crashed."""


def _env_default() -> float:
    raw = os.environ.get("ATTNLAB_DIST_TIMEOUT")
    if raw is None:
        return 300.0
    try:
        return _positive_seconds(float(raw), "ATTNLAB_DIST_TIMEOUT")
    except ValueError as e:
        raise ValueError(f"ATTNLAB_DIST_TIMEOUT: expected a positive number of seconds, got {raw!r}") from e


def _positive_seconds(x, name: str) -> float:
    if isinstance(x, datetime.timedelta):
        x = x.total_seconds()
    return real(x, name, gt=0.0, hint="seconds, or a datetime.timedelta")


_ENV_DEFAULT = _env_default()
_timeout_s = _ENV_DEFAULT


def set_timeout(seconds) -> None:
    """Set the default timeout (seconds or a ``timedelta``) of every distributed attention
    wait in this process; ``None`` restores the default (300 s or ``ATTNLAB_DIST_TIMEOUT``)."""
    global _timeout_s
    _timeout_s = _ENV_DEFAULT if seconds is None else _positive_seconds(seconds, "set_timeout(seconds)")


def get_timeout() -> float:
    """The default timeout in seconds."""
    return _timeout_s


def resolve_timeout(timeout) -> float:
    """``timeout=`` of a public call (seconds, ``timedelta`` or ``None``) in seconds."""
    return _timeout_s if timeout is None else _positive_seconds(timeout, "timeout")


_CLOSED = (
    "connection closed",
    "connection reset",
    "closed by peer",
    "broken pipe",
    "socket closed",
    "connection refused",
    "remote worker crashing",
    "ncclremoteerror",
)
_TIMED_OUT = ("timed out", "timeout", "deadline")


def translate(
    exc: BaseException, *, op: str, rank: int, peer: int | None, what: str, timeout_s: float, posting: bool = False
) -> DistributedAttentionError:
    """The error to raise for ``exc``, caught while ``rank`` waited on ``what`` (or, with
    ``posting``, while it posted the operation: started a send, a receive or a collective)."""
    while_ = f"posting {what}" if posting else f"waiting for {what}"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    low = text.lower()
    who = f"rank {peer}" if peer is not None else "a rank of the group"
    hint = (
        f"Change the timeout with {op}(..., timeout=seconds) or attnlab.distributed.set_timeout(seconds); "
        "destroy the process group before retrying."
    )
    if "pair closure" in low:  # gloo closes a connection after a timeout on it
        return PeerTimeoutError(
            f"{op}: rank {rank} cannot reach {who} while {while_}: an earlier timeout closed the "
            f"connection, so this process group is unusable; destroy the process group and start a new one. "
            f"(backend: {text})"
        )
    if any(s in low for s in _TIMED_OUT):
        if posting:
            return PeerTimeoutError(
                f"{op}: rank {rank} timed out while {while_}: {who} did not answer. {hint} (backend: {text})"
            )
        return PeerTimeoutError(
            f"{op}: rank {rank} waited {timeout_s:g} s for {what} and {who} never answered: it hung, is busy "
            f"elsewhere, or did not call {op} with the same arguments. {hint} (backend: {text})"
        )
    if any(s in low for s in _CLOSED):
        return PeerFailureError(
            f"{op}: rank {rank} lost the connection to {who} while {while_}: that process exited or "
            f"crashed. {hint} (backend: {text})"
        )
    return DistributedAttentionError(f"{op}: rank {rank} failed while {while_}: {text}. {hint}")


def guarded_post(post, *, timeout_s: float, op: str, rank: int, peer: int | None, what: str):
    """``post()`` — the call that starts a send, a receive or a collective (``isend``,
    ``irecv``, ``all_to_all_single(..., async_op=True)``, ...) — with the backend's
    errors turned into :class:`DistributedAttentionError`\\ s, as :func:`guarded_wait`
    does for the wait: gloo raises at once when the peer's connection is already gone."""
    try:
        return post()
    except DistributedAttentionError:
        raise
    except Exception as e:  # the backend's RuntimeError / DistBackendError
        raise translate(e, op=op, rank=rank, peer=peer, what=what, timeout_s=timeout_s, posting=True) from e


def guarded_wait(work, *, timeout_s: float, op: str, rank: int, peer: int | None, what: str) -> None:
    """``work.wait()`` with a timeout; backend errors become :class:`DistributedAttentionError`\\ s."""
    if work is None:
        return
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except DistributedAttentionError:
        raise
    except Exception as e:  # the backend's RuntimeError / DistBackendError
        raise translate(e, op=op, rank=rank, peer=peer, what=what, timeout_s=timeout_s) from e
    if ok is False:  # some backends report a timeout by returning False
        raise translate(TimeoutError("timed out"), op=op, rank=rank, peer=peer, what=what, timeout_s=timeout_s)
