#!/usr/bin/env bash
# Installs what the tests need into .venv and runs the whole suite; other arguments go to pytest.
# --quick (first) leaves out the tests marked slow: processes launched, end-to-end runs, anything
# over a couple of seconds on 2 busy cores (the README gives both times).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh "[test]"
if [ "${1:-}" = "--quick" ]; then
    shift
    set -- -m "not slow" "$@"
fi
exec .venv/bin/python -m pytest -q "$@"
