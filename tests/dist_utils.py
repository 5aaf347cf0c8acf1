"""Run a function on N gloo ranks in child processes and bring back what each rank returns.

Children come from a ``forkserver`` that imports torch, transformers and moe_ep's layers once per
test session, so a process group starts in well under a second instead of paying the imports per
rank (moe_ep's own: compiling its sources where no bytecode is cached, about a second per rank on
busy cores).
Ranks meet through a ``FileStore`` in a fresh temporary file (no ports to collide). A rank that
raises is reported with its own traceback; ranks still running after ``timeout`` seconds are
killed and reported, so a deadlocked collective fails the test instead of hanging it."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import tempfile
import time
import traceback
from datetime import timedelta

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "moe_ep.dispatch",
    "moe_ep.hf",
    "moe_ep.parallel",
    "moe_ep.training",
]

_context = None


def _mp_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


class RankError(RuntimeError):
    """A rank raised; the message carries its rank and traceback."""


def _child(fn, rank, world_size, backend, store_path, pg_timeout_s, args, kwargs, queue):
    import torch
    import torch.distributed as dist

    # Two cores are shared by every rank and every engineer: one intra-op thread per rank.
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            store=dist.FileStore(store_path, world_size),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args, **kwargs)
        queue.put((rank, True, result))
    except BaseException as exc:  # every failure goes back to the parent with its traceback
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 60.0, backend: str = "gloo",
              **kwargs) -> list:
    """``fn(rank, world_size, *args, **kwargs)`` on every rank of a fresh process group (gloo, or
    nccl with rank r on GPU r); returns the ranks' results in rank order. ``fn`` must be a
    module-level function (it is pickled by name).

    Raises RankError naming the lowest failing rank (with its traceback, and the other failures'
    first lines), or TimeoutError naming the ranks that had not finished after ``timeout`` s."""
    ctx = _mp_context()
    queue = ctx.Queue()
    fd, store_path = tempfile.mkstemp(prefix="moe_ep_store_")
    os.close(fd)
    os.unlink(store_path)  # FileStore creates it; a stale file would hold an old group's keys
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, backend, store_path, pg_timeout, args, kwargs, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s")
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:  # poll again, and notice children that died without reporting
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcomes]
                if dead:
                    raise RankError(f"ranks {dead} died without reporting (exit codes "
                                    f"{[procs[r].exitcode for r in dead]})") from None
                continue
            outcomes[rank] = (ok, payload)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(store_path):
            os.unlink(store_path)
    failed = sorted(r for r, (ok, _) in outcomes.items() if not ok)
    if failed:
        others = "".join(f"\n  rank {r}: {outcomes[r][1].splitlines()[0]}" for r in failed[1:])
        raise RankError(f"rank {failed[0]} of {world_size} raised {outcomes[failed[0]][1]}{others}")
    return [outcomes[r][1] for r in range(world_size)]
