#!/usr/bin/env bash
# Run the test suite against another torch release, in a throwaway venv (CI runs one torch only).
#
#   bash scripts/test_torch_version.sh 2.1.2            # the floor pyproject.toml declares
#   bash scripts/test_torch_version.sh 2.14.1 -x -q     # extra arguments go to pytest
#
# Uses the python3 on PATH (PYTHON=... to choose another). The venv is made under a temporary folder
# and removed afterwards (KEEP_VENV=1 keeps it and prints where). Linux wheels of torch from PyPI are
# CUDA builds: several GB to download, and the suite still runs on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: bash scripts/test_torch_version.sh TORCH_VERSION [PYTEST_ARGS...]" >&2
    exit 2
fi
version="$1"
shift
python="${PYTHON:-python3}"
venv="$(mktemp -d)/venv"
if [[ "${KEEP_VENV:-0}" != 1 ]]; then
    trap 'rm -rf "$(dirname "$venv")"' EXIT
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
"$python" -m venv "$venv"
# torch before 2.3 was built against NumPy 1
numpy="numpy"
if [[ "$(printf '%s\n' "$version" 2.3 | sort -V | head -1)" != 2.3 ]]; then
    numpy="numpy<2"
fi
"$venv/bin/python" -m pip install --quiet "torch==$version" "$numpy"
"$venv/bin/python" -m pip install --quiet -e ".[test]"
"$venv/bin/python" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__)"
[[ "${KEEP_VENV:-0}" == 1 ]] && echo "venv kept: $venv"
if [[ $# -eq 0 ]]; then
    set -- -q
fi
"$venv/bin/python" -m pytest -p no:cacheprovider "$@"
