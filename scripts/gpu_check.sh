#!/usr/bin/env bash
# The checks that need a GPU, in one run (CI has none): the CUDA-only tests, the Hugging Face models on the GPU,
# the cost of norms there, the overhead benchmark on the GPU (small models, then GPU-sized ones), a profile, then
# the whole suite where CUDA is available.
#
#     bash scripts/gpu_check.sh [OUTDIR]      # logs under OUTDIR (default: $OUT, else /tmp/gpu_check)
#     STEPS="cuda-tests suite" bash scripts/gpu_check.sh   # only these steps (names below)
#
# Needs only what a GPU machine with torch, typer, rich, pytest and hypothesis has (transformers for the Hugging
# Face step, pytest-xdist for the last): nothing is fetched. Each step has its own time limit (seconds) and the
# script goes on after a failed one; the exit code is 1 if any step failed. Steps come in order of importance.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
failed=0

step() {  # step NAME LIMIT COMMAND...: run within LIMIT seconds, log to $out/NAME.log, say how it went
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $name "* ]] || return 0
    echo "== $name"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-12}" "$out/$name.log"
    echo "== $name: exit $rc in $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || failed=1
}

nvidia-smi -L
python3 -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '|', torch.cuda.get_device_name())"
# gradtrace from this checkout, nothing fetched; where pip cannot install it, from the source tree
if ! python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$out/install.log" 2>&1; then
    echo "pip install failed (see install.log): gradtrace from the source tree"
    export PYTHONPATH=$PWD
    mkdir -p /tmp/gradtrace-bin
    printf '#!/bin/sh\nexec python3 -m tracer_cli "$@"\n' > /tmp/gradtrace-bin/gradtrace
    chmod +x /tmp/gradtrace-bin/gradtrace
    export PATH=/tmp/gradtrace-bin:$PATH
fi

step cuda-tests 150 python3 -m pytest -q -p no:cacheprovider -rs -k cuda tests
step norm-cost 60 python3 benchmarks/norm_cost.py --device cuda
TAIL=20 step validate-hf 120 python3 scripts/validate_hf.py --device cuda
TAIL=16 step overhead 150 python3 benchmarks/overhead.py gpt2-style resnet-style wide-mlp tiny-ops deep-linear --device cuda --rounds 7 --memory
# steps of the size a GPU trains at, where kernels, not Python, take the time
TAIL=16 step overhead-large 200 python3 benchmarks/overhead.py gpt2-style-large tv-resnet50 hf-gpt2-base --device cuda --rounds 5
TAIL=16 step profile 60 python3 benchmarks/profile_step.py gpt2-style --device cuda --steps 10 --top 30
# the whole suite where CUDA is available, one test per line (what ran survives the time limit); in
# WORKERS processes where pytest-xdist is installed (WORKERS=0: serial)
if [ "${WORKERS:-12}" != 0 ] && python3 -c "import xdist" 2> /dev/null; then
    parallel=(-n "${WORKERS:-12}")
else
    parallel=(-p no:xdist)
fi
TAIL=8 step suite "${SUITE_LIMIT:-280}" python3 -m pytest -p no:cacheprovider "${parallel[@]}" -v --tb=short tests
grep -E "(FAILED|ERROR)( |$)" "$out/suite.log" | head -40
exit $failed
