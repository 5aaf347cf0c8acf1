"""What a user sees when a launched example stops on a usage error (#21 item 8), through each
documented launcher: one line of ours, ``error: ...`` naming the flag, said once although every
rank found it, the last line of the program's own before the launcher's summary (torchrun's log
lines and ``ChildFailedError`` table, accelerate's ``CalledProcessError``), and no traceback frame
of moe_ep's or the example's code anywhere."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from example_runs import EXAMPLE, ROOT, accelerate_script_cmd, env, free_port

pytestmark = pytest.mark.slow

# torchrun's own log lines: "W1128 02:45:56.981000 29868 torch/distributed/run.py:874] ...".
LAUNCHER_LOG = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d")
# A frame in this checkout's package or example (its folder may itself be named moe_ep, and so
# may hold the venv: a frame under site-packages is the launcher's, not ours).
OUR_FRAME = re.compile(rf'File "{re.escape(str(ROOT))}/(moe_ep|kernels|examples)/')


def torchrun_script_cmd(script: str, *flags: str, processes: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
            "--master-port", str(free_port()), str(EXAMPLE / script), *flags]


CASES = {
    "train.py, torchrun": (torchrun_script_cmd, "train.py", ["--steps", "0"], "error: --steps must be >= 1, got 0"),
    "train.py, accelerate launch": (accelerate_script_cmd, "train.py", ["--lr", "nan"],
                                    "error: --lr must be a finite number > 0, got nan"),
    "trainer.py, accelerate launch": (accelerate_script_cmd, "trainer.py", ["--steps", "0"],
                                      "error: --steps must be >= 1, got 0"),
    "accelerate_loop.py, torchrun": (torchrun_script_cmd, "accelerate_loop.py", ["--warmup-steps", "60"],
                                     "error: --warmup-steps must be in [0, --steps), got 60"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_usage_error_is_one_line_of_ours_above_the_launchers_summary(case, tmp_path):
    make_cmd, script, flags, expected = CASES[case]
    proc = subprocess.run(make_cmd(script, *flags, "--output-dir", str(tmp_path / "out")), capture_output=True,
                          text=True, env=env(), timeout=240, cwd=tmp_path)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode != 0
    ours = [i for i, line in enumerate(lines) if line.startswith("error")]
    assert [lines[i] for i in ours] == [expected], "\n".join(lines)
    after = lines[ours[0] + 1:]
    traceback_at = next((j for j, line in enumerate(after) if line.startswith("Traceback")), len(after))
    assert [line for line in after[:traceback_at] if line.strip() and not LAUNCHER_LOG.match(line)] == [], after
    assert not [line for line in lines if OUR_FRAME.search(line)], lines
    assert not (tmp_path / "out").exists(), "a usage error must stop the run before anything is written"


RANK_0_LATE = """
import os, sys, time
from moe_ep.runs import UsageError, run_reported

def train(_):
    if os.environ["RANK"] == "0":
        time.sleep(3)  # rank 0 slower to find the same error (a loaded machine)
    raise UsageError("--steps must be >= 1, got 0", agreed=True)

sys.exit(run_reported(train, None))
"""


def test_an_error_found_before_the_process_group_is_said_although_rank_0_finds_it_last(tmp_path):
    """The launcher ends the job at the first rank to exit: a rank that leaves the line to rank 0
    waits for it in the launcher's store, which exists before any process group does."""
    script = tmp_path / "late.py"
    script.write_text(RANK_0_LATE)
    proc = subprocess.run(torchrun_script_cmd(str(script)), capture_output=True, text=True, env=env(), timeout=120,
                          cwd=tmp_path)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode != 0
    assert [line for line in lines if line.startswith("error")] == ["error: --steps must be >= 1, got 0"], lines
