#!/usr/bin/env bash
# Creates .venv with the CPU build of PyTorch and moe_ep installed in editable mode.
# torch is installed first, pinned, from PyTorch's CPU index: on Linux, PyPI's torch is the
# multi-GB CUDA build. Where a local wheel of the same version is already configured for pip
# (find-links), that wheel is used and the CPU index may be unreachable without harm.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 \
    --extra-index-url https://download.pytorch.org/whl/cpu
.venv/bin/pip install -q --disable-pip-version-check -e ".${EXTRAS}"
