import json
import os
from pathlib import Path

import torch

# Without a GPU the Triton kernels run under the interpreter. Triton reads this variable when a
# kernel is decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# On pytest-xdist's workers (scripts/test.sh: two on 2 cores), one intra-op thread in each worker
# and in what it launches, as the launched ranks have (tests/dist_utils.py, example_runs.py): a
# second spinning thread per process slowed the tests' tiny ops 10 to 60 times (a benchmark's smoke
# run 56 s against 4 s). A value the caller set is kept.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def made_once(tmp_path_factory, name: str, make):
    """``make(folder)``'s result (JSON), made once per test session. scripts/test.sh runs the suite
    on pytest-xdist workers (``--dist loadscope``: each module's tests, so its module-scoped
    fixtures, on one worker); a session fixture several modules share would be made by every
    worker that runs one of them, so the first worker makes it in the session's folder, which
    the workers share, and the others wait for it and read it. A failure is recorded and raised
    on every worker, not retried."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # this session's, above each worker's own
    done = shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            folder = shared / name
            folder.mkdir()
            try:
                outcome = {"result": make(folder)}
            except BaseException as err:
                done.write_text(json.dumps({"error": f"{type(err).__name__}: {err}"}))
                raise
            done.write_text(json.dumps(outcome))
        outcome = json.loads(done.read_text())
    if "error" in outcome:
        raise RuntimeError(f"the shared {name} failed on another worker: {outcome['error'][:3000]}")
    return outcome["result"]


def pytest_collection_modifyitems(config, items):
    """On pytest-xdist's workers (scripts/test.sh: ``--no-loadscope-reorder``, which keeps this
    order), the modules marked slow as a whole (launched runs) first, then those holding slow
    tests, then the quick ones, each module's tests together and in order: the workers take
    modules in this order, so quick ones fill the end instead of one slow module running alone."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}

    def tier(item) -> int:
        marks = getattr(item.module, "pytestmark", [])
        wholly_slow = any(mark.name == "slow" for mark in (marks if isinstance(marks, list) else [marks]))
        return 0 if wholly_slow else 1 if item.module.__name__ in slow else 2

    items.sort(key=tier)


@pytest.fixture(scope="session", autouse=True)
def _launched_temp_dir(tmp_path_factory):
    """Processes the tests launch keep their temporary files under this session's folder, which
    pytest prunes, not in /tmp: torchrun and accelerate leave a torchelastic_* log folder there
    per launch (about 45 per full run)."""
    folder = tmp_path_factory.getbasetemp() / "launched_tmp"
    folder.mkdir(exist_ok=True)
    patch = pytest.MonkeyPatch()
    patch.setenv("TMPDIR", str(folder))
    yield
    patch.undo()


@pytest.fixture
def no_selector_measurement(monkeypatch):
    """Under the interpreter the experts' selector measures nothing (MOE_EP_AUTOTUNE=0), for tests
    about the numbers: a problem's first call would run the Triton path twice more only to time it
    by the host clock (or take what ~/.cache/moe_ep holds, and write there). Its measurement is
    tests/test_selector.py's and test_stage_candidates.py's. On a GPU the first call measures as
    in use."""
    from moe_ep.kernels import autotune
    from moe_ep.kernels.runtime import interpreting

    if interpreting():
        monkeypatch.setenv(autotune.ENV_VAR, "0")


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

    def make(folder):
        out = folder / "run"
        assert train_in_process([*COMMON, "--output-dir", str(out)]) == 0
        return str(out)

    return Path(made_once(tmp_path_factory, "one_process_run", make))


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory):
    """train.py under ``accelerate launch`` on 2 gloo ranks (expert parallel over both), exported
    beside its folder. Returns (its folder, its output)."""
    from example_runs import accelerate_cmd, export_of, run

    def make(folder):
        out = folder / "run"
        return str(out), run(accelerate_cmd(out, "--export-dir", str(export_of(out))))

    out, output = made_once(tmp_path_factory, "two_rank_run", make)
    return Path(out), output


@pytest.fixture(scope="session")
def two_rank_loops(tmp_path_factory):
    """tests/hf_loops.py's runs of trainer.py and accelerate_loop.py on 2 ranks (expert parallel over
    both): test_hf_loops.py's world, whose expert-parallel runs are also the undisturbed runs that
    tests/faults/test_preempted_runs.py resumes onto (the same flags, launched alone: bit for bit the
    same losses). Returns the folder of the runs."""
    from hf_loops import launch_world

    def make(folder):
        return str(launch_world(folder, 2, ("--ep", "2"), resume=True, bf16=True, with_moe_ep_alone=True))

    return Path(made_once(tmp_path_factory, "hf_loops_2", make))
