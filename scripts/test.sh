#!/usr/bin/env bash
# Installs what the tests need into .venv and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh "[test]"
exec .venv/bin/python -m pytest -q "$@"
