"""Launched by ``accelerate launch`` for test_hf_loops*.py: runs examples/mixtral/trainer.py and
accelerate_loop.py several times in one launched world, each run as its script would run alone,
so that the tests pay the start-up of a world once. accelerate's shared state (and the
environment a run asks for, e.g. ``ACCELERATE_MIXED_PRECISION``) is reset between runs; the
process group stays; no rank starts a run before every rank has ended the one before.

argv[1]: a JSON list of ``[script, flags, env, flip]``: ``flip``, a file or null, is damaged (one
byte flipped, by rank 0, before any rank starts the run). Rank 0 prints ``RUN <index> rc=<exit
status>`` after each run; the runs' figures are in their output folders (``metrics.jsonl``,
``final/``)."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mixtral"
sys.path.insert(0, str(EXAMPLE))

import accelerate_loop  # noqa: E402
import trainer  # noqa: E402

SCRIPTS = {"trainer": trainer, "accelerate_loop": accelerate_loop}


def reset_accelerate() -> None:
    # accelerate's own tests reset it this way between runs in one process.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def every_rank_reached(point: str) -> None:
    """Wait until every rank has reached ``point`` (the end of a run: as separate launches would, a
    rank that went on early would check the next run's folder while rank 0 still wrote this run's
    end into it). Through the launcher's store, which outlives a process group a failed run
    destroyed."""
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1:
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=300))
    store.set(f"hf_loops_driver/{point}/{os.environ['RANK']}", "reached")
    store.wait([f"hf_loops_driver/{point}/{rank}" for rank in range(world_size)])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def main() -> None:
    base_env = dict(os.environ)
    rank = int(os.environ.get("RANK", 0))
    for index, (script, flags, env, flip) in enumerate(json.loads(sys.argv[1])):
        if flip is not None:
            if rank == 0:
                flip_byte(Path(flip))
            every_rank_reached(f"{index}/damaged")
        os.environ.clear()
        os.environ.update(base_env, **env)
        reset_accelerate()
        code = SCRIPTS[script].main(flags)
        if rank == 0:
            print(f"RUN {index} rc={code}", flush=True)
        every_rank_reached(f"{index}/ended")


if __name__ == "__main__":
    main()
