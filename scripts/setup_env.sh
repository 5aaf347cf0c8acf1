#!/usr/bin/env bash
# Creates .venv with the CPU build of PyTorch and moe_ep installed in editable mode.
# torch is installed first and pinned: on Linux, PyPI's torch is the multi-GB CUDA build. A CPU
# wheel that pip already finds on this machine (its configured find-links) is taken without the
# network; only where there is none does pip go to PyTorch's CPU index, which machines without
# internet access cannot reach (each lookup there would fail slowly, after retries).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
PIP=(.venv/bin/pip install -q --disable-pip-version-check)
if [ ! -x .venv/bin/python ]; then
    # The first install writes about 2.5 GB into .venv (torch, Triton) and unpacks its wheels in the
    # temporary folder: say so up front rather than let pip stop half-way with "No space left".
    for dir in . "${TMPDIR:-/tmp}"; do
        free_mb=$(df -Pm "$dir" | awk 'NR == 2 {print $4}')
        if [ "${free_mb:-0}" -lt 3000 ]; then
            echo "setup_env: the first install needs about 3 GB free; $(cd "$dir" && pwd) has ${free_mb} MB" >&2
            exit 1
        fi
    done
    echo "setup_env: creating .venv (the first install takes about two minutes)" >&2
    python3 -m venv .venv
fi
echo "setup_env: torch 2.13.0, CPU build" >&2
if "${PIP[@]}" --no-index --no-deps torch==2.13.0 2>/dev/null; then
    "${PIP[@]}" torch==2.13.0  # its dependencies, from the ordinary index
else
    echo "setup_env: pip finds no local torch==2.13.0 wheel; installing the CPU build from PyTorch's index" >&2
    "${PIP[@]}" torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu
fi
echo "setup_env: moe_ep${EXTRAS:+ with ${EXTRAS}} and its dependencies, editable" >&2
"${PIP[@]}" -e ".${EXTRAS}"
echo "setup_env: .venv ready" >&2
