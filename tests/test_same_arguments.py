"""moe_ep.runs.agree_on_arguments: the ranks of a job compare the run's arguments once the process
group exists, before any work; a difference stops every rank with one agreed line naming the
argument, the rank and both values (the example's scripts call it before they write anything)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dist_utils import run_ranks
from moe_ep.runs import UsageError, agree_on_arguments


def _agree(rank, world_size, per_rank):
    try:
        agree_on_arguments("train.py", per_rank[rank])
    except UsageError as err:
        return str(err), err.agreed
    return None


@pytest.mark.slow
def test_ranks_launched_with_different_arguments_stop_naming_the_first_difference():
    same = {"seed": 11, "steps": 6, "output folder": Path("/runs/a"), "resume": "auto"}
    assert run_ranks(_agree, 2, [same, dict(same)], timeout=120) == [None, None]
    other = dict(same, **{"output folder": Path("/home/b/runs/a")})
    expected = ("train.py: ranks disagree on output folder: rank 1 has PosixPath('/home/b/runs/a'), rank 0 has "
                "PosixPath('/runs/a'). Every rank must be launched with the same command and see the same files; "
                "stopped on every rank")
    assert run_ranks(_agree, 2, [same, other], timeout=120) == [(expected, True)] * 2


def test_one_process_has_nothing_to_agree_with():
    agree_on_arguments("train.py", {"seed": 1})
