#!/usr/bin/env bash
# The main job: a small expert-parallel training run of a Mixtral-style model on the CPU, two gloo
# processes launched by accelerate (examples/mixtral; its README explains GPUs and clusters).
# Extra arguments go to train.py, e.g. `bash scripts/run_main.sh --steps 50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
ACCELERATE_USE_CPU=true exec .venv/bin/accelerate launch --config_file examples/mixtral/configs/cpu.yaml \
    examples/mixtral/train.py --ep 2 --overwrite "$@"
