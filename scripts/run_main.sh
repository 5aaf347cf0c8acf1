#!/usr/bin/env bash
# The main job. Until the training example lands, it runs the standalone kernel benchmark at small
# shapes on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh "[bench]"
exec .venv/bin/python -m moe_ep.bench kernels "$@"
