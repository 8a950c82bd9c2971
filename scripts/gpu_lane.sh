#!/usr/bin/env bash
# The GPU lane on a bare GPU machine: no install of pagedbench, no network.
#
#   bash scripts/gpu_lane.sh --out DIR --git-sha SHA --dirty 0|1 [--carry DIR] [--rehearsal]
#                            [--impl NAME ...] [--points N]
#
# 1. makes `pagedbench.*` importable from this checkout (scripts/gpu_shim.py: a folder of
#    links under build/gpu-shim, from setup.py's ROOTS);
# 2. installs the carried wheels (CARRY/wheels/*.whl, default carry build/gpu-carry, made
#    by `make gpu-carry`) with pip --no-index --no-deps into build/gpu-site, puts the
#    carry's FlashInfer modules compiled ahead of time (CARRY/flashinfer-aot/<name>/) where
#    FlashInfer loads them (its package's data/aot/), and names CARRY/vllm-triton and
#    CARRY/sglang-triton (the peers' Triton kernel files) for their adapters;
# 3. runs python -m pagedbench.harness.lane.steps, which prints its time model, refuses a
#    plan over it, writes at most 8 files into DIR and prints its summary last; --impl and
#    --points go to it (the implementations, the sweep's first N points).
# No .git travels to the machine: the commit and dirtiness come from --git-sha/--dirty or
# PAGEDBENCH_GIT_SHA/PAGEDBENCH_GIT_DIRTY. --rehearsal: the CPU rehearsal of CI (tiny
# selection and budgets). PYTHON picks the interpreter (default python3). Exit status:
# the lane's (0 all steps passed, 1 a step failed), 2 on bad arguments, a plan over the
# time model's limit, or no import.
set -uo pipefail

started_at="$(date +%s)"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
out="${OUT:-}"
carry="$root/build/gpu-carry"
git_sha="${PAGEDBENCH_GIT_SHA:-}"
dirty="${PAGEDBENCH_GIT_DIRTY:-}"
device=cuda
forward=()

usage() { echo "usage: bash scripts/gpu_lane.sh --out DIR --git-sha SHA --dirty 0|1 [--carry DIR] [--rehearsal] [--impl NAME ...] [--points N]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="${2:-}"; shift 2 ;;
    --git-sha) git_sha="${2:-}"; shift 2 ;;
    --dirty) dirty="${2:-}"; shift 2 ;;
    --carry) carry="${2:-}"; shift 2 ;;
    --rehearsal) device=cpu; shift ;;
    --impl|--points) [ $# -ge 2 ] || usage; forward+=("$1" "$2"); shift 2 ;;
    *) echo "gpu_lane.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
[ -n "$out" ] || { echo "gpu_lane.sh: --out DIR (or OUT) is required" >&2; usage; }
[[ "$git_sha" =~ ^[0-9a-f]{40}$ ]] || { echo "gpu_lane.sh: --git-sha must be 40 hex digits, got '$git_sha'" >&2; usage; }
[[ "$dirty" =~ ^[01]$ ]] || { echo "gpu_lane.sh: --dirty must be 0 or 1, got '$dirty'" >&2; usage; }
mkdir -p "$out" && out="$(cd "$out" && pwd)"

cd "$root"
build="$root/build"
mkdir -p "$build/tmp"
export TMPDIR="${TMPDIR:-$build/tmp}" XDG_CACHE_HOME="${XDG_CACHE_HOME:-$build/xdg-cache}"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$build/pip-cache}" PYTHONUNBUFFERED=1 PYTHONNOUSERSITE=1
export PAGEDBENCH_GIT_SHA="$git_sha" PAGEDBENCH_GIT_DIRTY="$dirty"

"$python" scripts/gpu_shim.py "$build/gpu-shim" >/dev/null || exit 2
site="$build/gpu-site"
shopt -s nullglob
wheels=("$carry"/wheels/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  # The lane packs this log into its archive with the rest.
  "$python" -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "${wheels[@]}" >"$out/pip.log" 2>&1 \
    || echo "gpu_lane.sh: installing the carried wheels failed (see pip.log in the archive)" >&2
fi
# FlashInfer loads flashinfer/data/aot/<name>/<name>.so instead of compiling <name>.
if [ -d "$carry/flashinfer-aot" ] && [ -d "$site/flashinfer" ]; then
  mkdir -p "$site/flashinfer/data/aot"
  for module in "$carry"/flashinfer-aot/*/; do cp -r "$module" "$site/flashinfer/data/aot/"; done
fi
export PYTHONPATH="$build/gpu-shim:$site${PYTHONPATH:+:$PYTHONPATH}"
# The carried ninja (FlashInfer's JIT runs it) and FlashInfer's JIT cache under build/.
export PATH="$site/bin:$PATH" FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-$build}"
# Where vllm is not importable, the vllm-triton adapters load these (hashes checked).
[ -d "$carry/vllm-triton" ] && export PAGEDBENCH_VLLM_TRITON_CARRY="$(cd "$carry/vllm-triton" && pwd)"
# SGLang's Triton kernel files (sha256 checked by adapters/sglang_triton_load.py).
[ -d "$carry/sglang-triton" ] && export PAGEDBENCH_SGLANG_TRITON_DIR="$(cd "$carry/sglang-triton" && pwd)"
# LMDeploy's Triton kernel files (sha256 checked by adapters/lmdeploy_triton_load.py).
[ -d "$carry/lmdeploy-triton" ] && export PAGEDBENCH_LMDEPLOY_TRITON_DIR="$(cd "$carry/lmdeploy-triton" && pwd)"
"$python" -c "import pagedbench.harness.lane.steps" || {
  echo "gpu_lane.sh: pagedbench is not importable through $build/gpu-shim (a package the" \
       "image lacks? make gpu-carry builds its wheels into $carry/wheels)" >&2; exit 2; }

exec "$python" -m pagedbench.harness.lane.steps --out "$out" --device "$device" \
  --git-sha "$git_sha" --dirty "$dirty" --started-at "$started_at" ${forward[@]+"${forward[@]}"}
