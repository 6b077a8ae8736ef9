#!/usr/bin/env bash
# Set up fp8plug on a fresh machine: keep the torch already installed, or install torch 2.13.0
# (a CPU build where one is provided locally), then fp8plug with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# say where this installs: the active interpreter's environment, a virtual one or not
where=$("$PY" -c 'import sys; print(sys.prefix)')
if "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  echo "bootstrap: installing into the virtual environment $where ($PY)"
else
  echo "bootstrap: installing into $where ($PY), not a virtual environment; to keep fp8plug apart" \
       "instead: python3 -m venv .venv && . .venv/bin/activate && bash scripts/bootstrap.sh" \
       "(or PYTHON=/path/to/python bash scripts/bootstrap.sh)"
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "bootstrap: no torch found; installing torch==2.13.0"
  "$PY" -m pip install -q "torch==2.13.0"
fi
# (re)install when anything is missing or `fp8plug` resolves to another checkout
here=$(pwd)
if ! (cd / && "$PY" -c "import os, sys, fp8plug, pytest, xdist, ruff, torchao, transformers, deepspeed, peft, trl; sys.exit(os.path.dirname(os.path.dirname(os.path.realpath(fp8plug.__file__))) != os.path.realpath(sys.argv[1]))" "$here") >/dev/null 2>&1; then
  # torch is already present, so nothing below can pull another torch build.
  "$PY" -m pip install -q -e ".[test]"
fi
"$PY" -c "import torch, accelerate, fp8plug; print(f'bootstrap: torch {torch.__version__}, accelerate {accelerate.__version__}, fp8plug {fp8plug.__version__}')"
