#!/usr/bin/env bash
# One GPU check for a machine where the packages are installed but nothing can be installed (and there may be no
# network): `verify` on CUDA, the seed's benchmark (configs/bench/seed.toml, every cache beside transformers), the
# CUDA-graph tests, the compiled static-graph step and gpt2-xl, from the source tree.
#
#   scripts/gpu_check.sh            # or: make bench-gpu
#
# Writes under "$OUT" when set, else results/<timestamp>-gpu/:
#   env.txt            nvidia-smi, python and package versions
#   verify.json/.log   kvbench verify --device cuda (exactness of every cache, fp32, vs transformers)
#   bench/             summary.csv, steps.csv, meta.json, latency.png, speedup.png of the seed sweep (fp16)
#   graphs.log         tests/test_fast_caches.py -k cuda (graph capture/replay exactness on the GPU)
#   bench-compiled/    static-graph with KVBENCH_COMPILE=1: gpt2 fp16, prompt 128, 400 new tokens
#   bench-xl/          gpt2-xl fp16, prompt 128, 400 new tokens: static, static-graph (compiled) vs transformers
#   status.txt         exit code of each stage
# Each stage has its own timeout so the whole script ends in under 8 minutes on an H200. A bench that runs out of
# time is interrupted with SIGINT: it keeps every completed row and writes its plots (status.txt shows rc=124).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"  # no network on the GPU machine: cached weights, else random
PY="${PYTHON:-python3}"
DEST="${OUT:-results/$(date +%Y%m%d-%H%M%S)-gpu}"
mkdir -p "$DEST"
VERIFY_TIMEOUT="${VERIFY_TIMEOUT:-90}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-180}"
FAST_TIMEOUT="${FAST_TIMEOUT:-60}"
: >"$DEST/status.txt"

stage() {  # stage NAME TIMEOUT CMD...: run with a timeout (SIGINT first, SIGKILL 15 s later), record the exit code
  local name=$1 limit=$2
  shift 2
  echo "== $name (timeout ${limit}s): $*" >&2
  local t0=$SECONDS
  timeout -s INT -k 15 "$limit" "$@"
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$DEST/status.txt" >&2
  return 0
}

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  git rev-parse HEAD 2>/dev/null || echo "git: n/a"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: n/a"
  "$PY" -c 'import sys, torch, transformers; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); print("transformers", transformers.__version__); print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")'
} >"$DEST/env.txt" 2>&1
cat "$DEST/env.txt" >&2

stage verify "$VERIFY_TIMEOUT" bash -c \
  "'$PY' -m kvbench verify --device cuda --weights auto --json >'$DEST/verify.json' 2>'$DEST/verify.log'"

stage bench "$BENCH_TIMEOUT" "$PY" -m kvbench bench --config configs/bench/seed.toml --out "$DEST/bench"

stage graphs "$FAST_TIMEOUT" bash -c \
  "'$PY' -m pytest -q -p no:cacheprovider tests/test_fast_caches.py -k cuda >'$DEST/graphs.log' 2>&1"

stage bench-compiled "$FAST_TIMEOUT" env KVBENCH_COMPILE=1 "$PY" -m kvbench bench --model gpt2 --weights auto \
  --device cuda --dtype fp16 --prompt-len 128 --new-tokens 400 --caches static-graph --engine kvbench \
  --repeats 3 --out "$DEST/bench-compiled"

stage bench-xl "$((FAST_TIMEOUT + 30))" env KVBENCH_COMPILE=1 "$PY" -m kvbench bench --model gpt2-xl \
  --weights random --device cuda --dtype fp16 --prompt-len 128 --new-tokens 400 --caches static,static-graph \
  --engine kvbench,hf --repeats 2 --out "$DEST/bench-xl"

echo "files in $DEST:" >&2
ls -la "$DEST" "$DEST"/bench* >&2 2>/dev/null || true
cat "$DEST/status.txt" >&2
