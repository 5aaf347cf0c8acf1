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
# Four workers (pytest-xdist) on 2 cores, each module's tests on one (its module-scoped fixtures,
# often launched runs, made once; tests/conftest.py's made_once shares the session's), the slow
# modules handed out first (conftest's order; xdist's own would put the modules of most tests
# first). Much of a launched test is waiting (a launcher's single-threaded start-up, a fixed
# timeout, a worker waiting for the run another one makes for both), so more workers than cores
# fill the waits: back to back on the Xeon on 2026-11-30, three workers took 18 min 39 s with the
# cores 73% busy and four 15 min 56 s at 77% (README). -n 0 (after the other arguments) runs the
# tests in this process.
exec .venv/bin/python -m pytest -q -n 4 --dist loadscope --no-loadscope-reorder "$@"
