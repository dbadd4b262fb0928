"""Run a function on ``P`` local processes joined in a gloo group (tests, benchmarks, demos).

>>> from attnlab.distributed.launch import run_local
>>> run_local(_demo_rank, 2)          # doctest: +SKIP
[0, 1]

``run_local(fn, P, *args)`` starts ``P`` fresh processes, joins them through a
``FileStore`` in a private temporary folder (no ports to pick), calls
``fn(rank, P, *args)`` in each — ``fn`` must be importable (a module-level function) —
and returns the values they returned, in rank order (passed back through files with
``torch.save``/``torch.load(weights_only=True)``: tensors, numbers, strings, lists,
dicts).  Nothing hangs: the whole run has a deadline after which every process still
alive is killed and a ``TimeoutError`` names the ranks that did not finish; a rank
that raised makes ``run_local`` raise with its traceback (or, with
``return_errors=True``, return the traceback text in its slot).
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import time
import traceback

import torch

__all__ = ["run_local", "RankError"]


class RankError(RuntimeError):
    """A rank of :func:`run_local` raised; the message holds its traceback."""


def _demo_rank(rank, world):
    return rank


def _entry(rank, world, fn, args, folder, backend, threads, pg_timeout_s, env):
    os.environ.update(env)
    torch.set_num_threads(threads)
    result: dict[str, object] = {"ok": False}
    try:
        import torch.distributed as dist

        store = dist.FileStore(os.path.join(folder, "store"), world)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout_s)
        )
        result = {"ok": True, "value": fn(rank, world, *args)}
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": traceback.format_exc()}
    finally:
        path = os.path.join(folder, f"rank{rank}.pt")
        try:
            torch.save(result, path + ".tmp")
        except Exception:  # noqa: BLE001 - an unpicklable return value can raise anything from pickle
            torch.save({"ok": False, "error": traceback.format_exc()}, path + ".tmp")
        os.replace(path + ".tmp", path)
        # Skip interpreter teardown: a process group left mid-operation by a failed peer
        # can block destructors; the parent has what it needs.
        os._exit(0)


def _context(start_method, env):
    import multiprocessing

    import torch.multiprocessing as mp

    if start_method is None:
        fast = "forkserver" in multiprocessing.get_all_start_methods() and not env
        start_method = "forkserver" if fast else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # the server imports torch and attnlab once; every group after that forks from it
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


# What the forkserver imports before it forks any rank.  Besides torch and attnlab: torch._dynamo,
# which torch imports on the first call of a custom op (torch.library's wrappers are
# ``torch._disable_dynamo``-decorated, and that decorator imports torch._dynamo -- with sympy,
# triton and inductor's config -- the first time it runs), so on a rank's first native attention
# call; about a CPU second each, paid by every rank of every group.  torch.utils.cpp_extension too,
# which the native kernel's loader imports (attnlab.ops.native.build).  Imports only: no thread
# is started, the fork stays safe.
_PRELOAD = ["attnlab.distributed.launch", "torch._dynamo", "torch.utils.cpp_extension"]


def run_local(
    fn,
    world_size: int,
    *args,
    timeout: float = 120.0,
    backend: str = "gloo",
    threads: int = 1,
    env: dict | None = None,
    return_errors: bool = False,
    pg_timeout: float = 60.0,
    start_method: str | None = None,
) -> list:
    """``[fn(0, P, *args), ..., fn(P-1, P, *args)]`` computed by ``P`` fresh processes.

    ``threads``: torch threads per process (1: on a small machine, ``P`` processes of
    several threads each only fight for cores).  ``env``: environment variables the
    children start with (e.g. allocator settings for memory probes).  ``start_method``:
    ``"spawn"`` (a new interpreter per rank), or the default ``"forkserver"`` where
    available and no ``env`` is given: a server process that has imported torch once
    forks every rank (no thread pool is ever started in the server, so the fork is
    safe), which saves the seconds of importing torch per rank and group.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    env = dict(env or {})
    ctx = _context(start_method, env)
    folder = tempfile.mkdtemp(prefix="attnlab-dist-")
    saved = {k: os.environ.get(k) for k in env}
    procs = []
    try:
        os.environ.update(env)  # malloc settings etc. must be there when the child's runtime starts
        for r in range(world_size):
            p = ctx.Process(
                target=_entry, args=(r, world_size, fn, args, folder, backend, threads, pg_timeout, env), daemon=True
            )
            p.start()
            procs.append(p)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        saved = {}
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        late = [r for r, p in enumerate(procs) if p.is_alive()]
        if late:
            raise TimeoutError(
                f"run_local: rank(s) {late} of {world_size} did not finish within {timeout:g} s; they were killed"
            )
        out, errors = [], []
        for r in range(world_size):
            path = os.path.join(folder, f"rank{r}.pt")
            if not os.path.exists(path):
                err = f"rank {r} exited (code {procs[r].exitcode}) without a result"
            else:
                res = torch.load(path, weights_only=True)
                if res["ok"]:
                    out.append(res["value"])
                    continue
                err = f"rank {r} of {world_size} raised:\n{res['error']}"
            out.append(RankError(err))
            errors.append(err)
        if errors and not return_errors:
            # a rank's own failure first: the others usually only report losing it
            errors.sort(key=lambda e: "PeerFailureError" in e or "PeerTimeoutError" in e)
            raise RankError("run_local: " + "\n\n".join(errors))
        return out
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(folder, ignore_errors=True)
