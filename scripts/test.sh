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
# Two workers (pytest-xdist), each module's tests on one (its module-scoped fixtures, often
# launched runs, made once; tests/conftest.py's made_once shares the session's), the slow modules
# handed out first (conftest's order; xdist's own would put the modules of most tests first): the
# Triton interpreter and the launches' start-ups are single-threaded, so one worker would leave a
# core idle much of the time. -n 0 (after the other arguments) runs the tests in this process.
exec .venv/bin/python -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder "$@"
