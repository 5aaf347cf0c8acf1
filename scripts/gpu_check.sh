#!/usr/bin/env bash
# One command for a GPU: compile check, CUDA test tier, kernel, model and dispatch benchmarks, the
# test suite's CUDA tests; one JSON and one PNG under benchmarks/results/ on a GPU, bench-results/
# with --device cpu (or --out-dir). See
# `python -m moe_ep.bench gpu --help`.
#
#   bash scripts/gpu_check.sh                      # on a machine with a CUDA GPU, about 5-8 minutes
#   bash scripts/gpu_check.sh --out-dir /tmp/out   # results elsewhere
#   bash scripts/gpu_check.sh --device cpu         # the same plumbing at small shapes (CI)
#
# Installs nothing: it runs the first Python that has torch, triton and transformers (and, unless
# --device cpu, sees a GPU): $MOE_EP_PYTHON if set, then .venv/bin/python, python3, python.
set -euo pipefail
# A relative --out-dir is the caller's, not the repository's (the script runs from the latter).
args=()
previous=
for arg in "$@"; do
    # (a value starting with "-" is the next flag, which argparse then refuses: "expected one argument")
    if [[ $previous == --out-dir && $arg != /* && $arg != -* ]]; then arg=$PWD/$arg; fi
    if [[ $arg == --out-dir=* && ${arg#--out-dir=} != /* ]]; then arg=--out-dir=$PWD/${arg#--out-dir=}; fi
    args+=("$arg")
    previous=$arg
done
set -- ${args[@]+"${args[@]}"}
cd "$(dirname "$0")/.."

device=cuda
previous=
for arg in "$@"; do
    if [[ $previous == --device ]]; then device=$arg; fi
    if [[ $arg == --device=* ]]; then device=${arg#--device=}; fi
    previous=$arg
done
# --help needs no GPU: any Python with the packages prints it.
for arg in "$@"; do
    if [[ $arg == -h || $arg == --help ]]; then device=cpu; fi
done

python=
for candidate in "${MOE_EP_PYTHON:-}" .venv/bin/python python3 python; do
    [[ -n $candidate ]] || continue
    command -v "$candidate" > /dev/null 2>&1 || continue
    # The check also says which Python and versions run (one start-up of torch, not two).
    if versions=$("$candidate" - "$device" 2> /dev/null <<'EOF'
import sys
import torch, triton, transformers  # noqa: F401
if sys.argv[1] != "cpu" and not torch.cuda.is_available():
    sys.exit(1)
print(sys.executable, "torch", torch.__version__, "triton", triton.__version__)
EOF
    ); then
        python=$candidate
        break
    fi
done
if [[ -z $python ]]; then
    echo "gpu_check.sh: no Python with torch, triton and transformers$([[ $device == cpu ]] || echo ' that sees a CUDA GPU') found" \
         "(tried \$MOE_EP_PYTHON, .venv/bin/python, python3, python)$([[ $device == cpu ]] || echo '; without a GPU, --device cpu runs the same plumbing at small shapes')" >&2
    exit 2
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# The kernels run compiled on a GPU and under Triton's interpreter on the CPU; Triton reads this
# when the kernels are defined, so it is set before Python starts.
if [[ $device == cpu ]]; then export TRITON_INTERPRET=1; else export TRITON_INTERPRET=0; fi
echo "gpu_check.sh: $versions"
exec "$python" -m moe_ep.bench gpu "$@"
