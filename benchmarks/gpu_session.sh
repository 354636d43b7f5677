#!/usr/bin/env bash
# Everything pelt checks on a GPU machine, in one command: the environment, the GPU tests, then
# bench_gpu.py in bf16 (with PEFT scripts as the peer) and in fp32. Logs, JUnit XML, JSON and Markdown
# tables go under $OUT (default out/gpu-session). Each step has its own time limit, so a slow step
# cannot eat the next one's time; bench_gpu.py rewrites its JSON after every setting, so a step cut
# short keeps what it measured.
#
# Prepare on a machine with the project's .venv and the GLUE rows (see benchmarks/README.md,
# "GPU benchmark"):  the service packages the GPU image lacks in .devbundle/site.tar.xz, and the
# benchmark's rows and backbone configs in out/gpu-input. Then, on the GPU machine, from the project root:
#     bash benchmarks/gpu_session.sh
# Time limits (seconds): TEST_SECONDS (120), BF16_SECONDS (240), FP32_SECONDS (150). PRECISIONS ("bf16 fp32")
# picks the benchmark steps and PACK_SIZES ("1,8,16,32") their pack sizes, e.g. to rerun one step in a later session.
set -u
OUT=${OUT:-out/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD
if [ -f .devbundle/site.tar.xz ]; then
  mkdir -p /tmp/site && tar -xJf .devbundle/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD
fi
# packages the bundle lacks, packed by hand (benchmarks/README.md: Ray Serve's grpcio-reflection)
for extra in .devbundle/extra*.tar.xz; do
  [ -f "$extra" ] && mkdir -p /tmp/site && tar -xJf "$extra" -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD
done
PYTHON=${PYTHON:-python3}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  lscpu | grep -E 'Model name|^CPU\(s\)'
  "$PYTHON" - <<'EOF'
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())
for name in ("transformers", "peft", "datasets", "sqlalchemy", "alembic", "ray", "mlflow", "fastapi"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:  # report every missing package, not only the first
        print(name, "MISSING:", type(exc).__name__, exc)
EOF
} 2>&1 | tee "$OUT/environment.txt"

echo "== GPU tests"
timeout "${TEST_SECONDS:-120}" "$PYTHON" -m pytest -m gpu tests/gpu \
  -q -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log"

BENCH=(benchmarks/bench_gpu.py --data out/gpu-input/glue --backbone-configs out/gpu-input/backbones
       --random-weights --jobs 32 --pack-sizes "${PACK_SIZES:-1,8,16,32}")
PRECISIONS=${PRECISIONS:-bf16 fp32}
if [[ " $PRECISIONS " == *" bf16 "* ]]; then
  echo "== bench_gpu.py, bf16, PEFT peer"
  timeout "${BF16_SECONDS:-240}" "$PYTHON" "${BENCH[@]}" --precision bf16 --peer peft --peer-jobs 8 \
    --json "$OUT/gpu-bf16.json" --markdown "$OUT/gpu-bf16.md" 2>&1 | tee "$OUT/gpu-bf16.log"
fi
if [[ " $PRECISIONS " == *" fp32 "* ]]; then
  echo "== bench_gpu.py, fp32"
  timeout "${FP32_SECONDS:-150}" "$PYTHON" "${BENCH[@]}" --precision fp32 --peer none \
    --json "$OUT/gpu-fp32.json" --markdown "$OUT/gpu-fp32.md" 2>&1 | tee "$OUT/gpu-fp32.log"
fi
echo "== done"
tail -n 4 "$OUT/gpu-tests.log"
cat "$OUT/gpu-bf16.md" "$OUT/gpu-fp32.md" 2>/dev/null
