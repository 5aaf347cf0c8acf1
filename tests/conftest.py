import os

import torch

# Without a GPU the Triton kernels run under the interpreter. Triton reads this variable when a
# kernel is decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


# The session's example runs below, shared by several modules: under pytest-xdist (scripts/test.sh
# runs two workers) those modules stay on one worker, which makes each run once.
SHARED_RUNS = {"one_process_run", "two_rank_run", "two_rank_loops"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """One xdist group per module (its module-scoped fixtures, often launched runs, made once),
    the modules that use a shared run in one group together (``--dist loadgroup``)."""
    shared = {item.module.__name__ for item in items if SHARED_RUNS & set(getattr(item, "fixturenames", ()))}
    for item in items:
        name = item.module.__name__
        item.add_marker(pytest.mark.xdist_group("shared_runs" if name in shared else name))


@pytest.fixture(autouse=True)
def _no_tf32():
    # tf32 would break the 1e-5 float32 tolerance on Ampere and Hopper.
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    yield


# examples/mixtral's undisturbed runs with the shared flags (tests/example_runs.py's COMMON), each
# trained once per session for every module that compares with, resumes or damages it. A test that
# changes one works on a copy (example_runs.copy_run), never on the run itself.


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory):
    """train.py in this process: checkpoints at steps 2, 4 and 6, its losses the reference."""
    from example_runs import COMMON, train_in_process

    out = tmp_path_factory.mktemp("one_process_run") / "run"
    assert train_in_process([*COMMON, "--output-dir", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory):
    """train.py under ``accelerate launch`` on 2 gloo ranks (expert parallel over both), exported
    beside its folder. Returns (its folder, its output)."""
    from example_runs import accelerate_cmd, export_of, run

    out = tmp_path_factory.mktemp("two_rank_run") / "run"
    return out, run(accelerate_cmd(out, "--export-dir", str(export_of(out))))


@pytest.fixture(scope="session")
def two_rank_loops(tmp_path_factory):
    """tests/hf_loops.py's runs of trainer.py and accelerate_loop.py on 2 ranks (expert parallel over
    both): test_hf_loops.py's world, whose expert-parallel runs are also the undisturbed runs that
    tests/faults/test_preempted_runs.py resumes onto (the same flags, launched alone: bit for bit the
    same losses). Returns the folder of the runs."""
    from hf_loops import launch_world

    return launch_world(tmp_path_factory.mktemp("hf_loops_2"), 2, ("--ep", "2"), resume=True, bf16=True,
                        with_moe_ep_alone=True)
