"""examples/mixtral/train.py with one rank that never finishes building its model (rank
``HUNG_RANK``): what a rank stopped or stuck during start-up looks like to the others. Launched by
test_launched_faults.py's start-up watchdog test in place of train.py, with train.py's flags."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "mixtral"))

import train  # noqa: E402

HUNG_RANK = "1"

if os.environ.get("RANK") == HUNG_RANK:
    def _never_built(*args, **kwargs):
        time.sleep(3600)

    train.prepare_model = _never_built

if __name__ == "__main__":
    sys.exit(train.main())
