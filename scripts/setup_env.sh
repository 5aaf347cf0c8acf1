#!/usr/bin/env bash
# Creates .venv with the CPU build of PyTorch and moe_ep installed in editable mode.
# torch is pinned first: an unpinned torch would pull the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e ".${EXTRAS}"
