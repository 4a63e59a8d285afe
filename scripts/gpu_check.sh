#!/usr/bin/env bash
# The GPU check behind `make bench-gpu`: everything in one call, inside one global deadline (6.5 minutes by
# default, leaving room for a rerun in a 15-minute slot), on a machine where the packages are installed and
# nothing can be installed. Runs from the source tree (PYTHONPATH=src); needs torch, transformers, tiktoken, typer,
# rich, pandas and matplotlib, nothing else.
#
#   scripts/gpu_check.sh                 # or: make bench-gpu          (CUDA, gpt2 and gpt2-xl, fp16)
#   scripts/gpu_check.sh --device cpu    # the same stages on gpt2-tiny with tiny sizes, nothing compiled: checks the
#                                        # script's structure end to end in well under a minute
#
# Stages, most important first (a later stage gets whatever time the earlier ones left, minus what is kept back for
# the stages after it; one that would get under 10 s, 5 s on the CPU, is skipped):
#   preflight  every import the stages need, versions, device, SDPA backends and cuDNN version   -> env.txt
#   seed       the seed's table: gpt2 fp16, prompts 512, 128, 16 (longest first: the seed's headline is at 512),
#              400 new tokens; kvbench none, dynamic, static, static-graph and transformers' dynamic and static
#                                                                                               -> seed/
#   verify     kvbench verify --device cuda --dtype fp16 over dynamic, static, static-graph, paged (fp16 flips at
#              near-ties are reported, not failed)                                             -> verify.json
#   compiled   --compile default, gpt2 fp16, prompt 128, 400 new tokens: kvbench none, static, static-graph (the
#              compiled step) against transformers' static cache with its default compile   -> compiled/
#   xl         --compile default, gpt2-xl fp16 (random weights drawn on the GPU), prompt 128, 400 new tokens:
#              kvbench none, static, static-graph                                             -> xl/
#   targets    the targets checked against those rows                                          -> targets.txt
#
# Everything lands under "$OUT" when set, else results/<timestamp>-gpu/: each stage's stdout and stderr in
# logs/<stage>.out and logs/<stage>.err, one line per stage in status.txt (exit code, seconds, limit). A bench
# stage that runs out of time gets SIGTERM, which bench handles like Ctrl-C (SIGINT may be ignored in a background
# job): it keeps every finished row, marks meta.json interrupted and draws its plots from the kept rows (status.txt
# shows rc=124, timeout's code for "ran out of time"); SIGKILL follows GRACE seconds later (15 s on CUDA).
# Environment: GPU_CHECK_BUDGET (seconds, default 390; 58 with --device cpu), PYTHON (default python3).
set -u
cd "$(dirname "$0")/.."
MODE=cuda
if [ "${1:-}" = "--device" ] && [ "${2:-}" = "cpu" ]; then MODE=cpu; shift 2; fi
if [ $# -gt 0 ]; then echo "usage: $0 [--device cpu]" >&2; exit 2; fi

export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" # no network on the GPU machine: cached weights, else random
PY="${PYTHON:-python3}"
DEST="${OUT:-results/$(date +%Y%m%d-%H%M%S)-gpu}"
mkdir -p "$DEST/logs"
: >"$DEST/status.txt"
if [ "$MODE" = cpu ]; then
  BUDGET="${GPU_CHECK_BUDGET:-58}" GRACE=3 MIN_STAGE=5
  export OMP_NUM_THREADS=1 # one thread per process: stable on a small, shared CPU
  export KVBENCH_PROBE_BYTES=$((16 << 20)) # bench's bandwidth probe, small: timings mean nothing in this mode
else
  # GRACE: SIGTERM to SIGKILL, time to write the kept rows, meta.json and plots; MIN_STAGE: skip a stage given less
  BUDGET="${GPU_CHECK_BUDGET:-390}" GRACE=15 MIN_STAGE=10
fi
END=$((SECONDS + BUDGET))

# Sizes per mode. cpu: a structure check (gpt2-tiny, fp32, a few tokens, one thread, no torch.compile).
if [ "$MODE" = cpu ]; then
  DEV=(--device cpu --dtype fp32 --threads 1)
  GPT2=(--model gpt2-tiny --weights random)
  XL=(--model gpt2-tiny --weights random)
  SEED_SIZES=(--prompt-len 32,8 --new-tokens 8 --repeats 1 --warmup 1)
  ONE_SIZE=(--prompt-len 16 --new-tokens 8 --repeats 1 --warmup 1)
  VERIFY=(verify --device cpu --dtype fp32 --model gpt2-tiny --weights random --prompt-len 8 --new-tokens 8)
  COMPILE=()
  KEEP_SEED=27 KEEP_VERIFY=16 KEEP_COMPILED=8 # seconds kept back for the stages after each one
else
  DEV=(--device cuda --dtype fp16)
  GPT2=(--model gpt2 --weights auto)
  XL=(--model gpt2-xl --weights random)
  SEED_SIZES=(--prompt-len 512,128,16 --new-tokens 400 --repeats 2 --warmup 1)
  ONE_SIZE=(--prompt-len 128 --new-tokens 400 --repeats 3 --warmup 1)
  VERIFY=(verify --device cuda --dtype fp16)
  COMPILE=(--compile default)
  KEEP_SEED=175 KEEP_VERIFY=140 KEEP_COMPILED=75
fi

stage() { # stage NAME KEEP CMD...: run CMD within the deadline, keeping KEEP seconds back for later stages
  local name=$1 keep=$2
  shift 2
  local limit=$((END - SECONDS - keep - GRACE - 3)) # 3 s for targets.txt at the end
  if [ "$limit" -lt "$MIN_STAGE" ]; then
    echo "$name skipped: out of time (${limit}s left for it)" | tee -a "$DEST/status.txt" >&2
    return 0
  fi
  echo "== $name (limit ${limit}s): $*" >&2
  local t0=$SECONDS
  timeout -s TERM -k "$GRACE" "$limit" "$@" >"$DEST/logs/$name.out" 2>"$DEST/logs/$name.err"
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0)) limit=${limit}" | tee -a "$DEST/status.txt" >&2
  return $rc
}

# --- preflight: fail fast, before any stage spends time ---------------------------------------------------------------
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  echo "mode $MODE, budget ${BUDGET}s"
  git rev-parse HEAD 2>/dev/null || echo "git: n/a"
  if [ "$MODE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: n/a"
  fi
} >"$DEST/env.txt" 2>&1
stage preflight 0 "$PY" - "$MODE" <<'PYEOF'
import importlib
import json
import platform
import sys

mode = sys.argv[1]
missing = []
for name in ("torch", "transformers", "tiktoken", "typer", "rich", "pandas", "matplotlib", "kvbench.cli",
             "kvbench.bench.sweep", "kvbench.results.plots"):
    try:
        importlib.import_module(name)
    except Exception as e:  # report every missing piece at once
        missing.append(f"{name}: {type(e).__name__}: {e}")
import torch  # noqa: E402

print("python", platform.python_version(), platform.platform())
from importlib import metadata  # noqa: E402

for name in ("torch", "transformers", "tiktoken", "typer", "rich", "pandas", "matplotlib", "numpy", "triton"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "not installed")
print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available())
if mode == "cuda":
    if not torch.cuda.is_available():
        missing.append("CUDA is not available (run scripts/gpu_check.sh --device cpu for the structure check)")
    else:
        p = torch.cuda.get_device_properties(0)
        print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}")
from kvbench.bench.backends import sdpa_settings, watch_sdpa  # noqa: E402

print("sdpa", json.dumps(sdpa_settings()))
if not missing:  # the backend SDPA picks for GPT-2's shapes: prefill (causal) and one decode query over 528 keys
    dev, dt = ("cuda", torch.float16) if mode == "cuda" else ("cpu", torch.float32)
    q = torch.randn(1, 12, 128, 64, device=dev, dtype=dt)
    kv = torch.randn(1, 12, 528, 64, device=dev, dtype=dt)
    F = torch.nn.functional

    def calls():
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        F.scaled_dot_product_attention(q[:, :, :1], kv, kv)

    print("sdpa choice for gpt2 shapes", json.dumps(watch_sdpa(calls, prefill_calls=1)))
for m in missing:
    print("MISSING", m, file=sys.stderr)
sys.exit(1 if missing else 0)
PYEOF
PRE=$?
cat "$DEST/logs/preflight.out" >>"$DEST/env.txt"
cat "$DEST/env.txt" >&2
if [ $PRE -ne 0 ]; then
  echo "preflight failed (see $DEST/logs/preflight.err); nothing else was run" | tee -a "$DEST/status.txt" >&2
  cat "$DEST/logs/preflight.err" >&2
  exit 1
fi

# --- the stages, most important first ---------------------------------------------------------------------------------
stage seed "$KEEP_SEED" "$PY" -m kvbench bench "${GPT2[@]}" "${DEV[@]}" "${SEED_SIZES[@]}" \
  --caches none,dynamic,static,static-graph --engine kvbench,hf --out "$DEST/seed" --force

stage verify "$KEEP_VERIFY" "$PY" -m kvbench "${VERIFY[@]}" --caches dynamic,static,static-graph,paged --json
cp "$DEST/logs/verify.out" "$DEST/verify.json" 2>/dev/null

# Rows in order of importance (a stage cut short keeps the rows before the cut): kvbench's none first (the token
# reference, always), then the rows the targets compare.
stage compiled "$KEEP_COMPILED" "$PY" -m kvbench bench "${GPT2[@]}" "${DEV[@]}" ${COMPILE[@]+"${COMPILE[@]}"} \
  "${ONE_SIZE[@]}" --caches none,static-graph,static --engine hf-compiled,kvbench --out "$DEST/compiled" --force

stage xl 0 "$PY" -m kvbench bench "${XL[@]}" "${DEV[@]}" ${COMPILE[@]+"${COMPILE[@]}"} "${ONE_SIZE[@]}" \
  --repeats 2 --caches none,static-graph,static --engine kvbench --out "$DEST/xl" --force

# --- targets: read back from the rows (plain csv, no torch import) ---------------------------------------------------
"$PY" - "$DEST" "$MODE" >"$DEST/targets.txt" 2>>"$DEST/logs/targets.err" <<'PYEOF'
import csv
import json
import sys
from pathlib import Path

dest, mode = Path(sys.argv[1]), sys.argv[2]


def rows(stage):
    f = dest / stage / "summary.csv"
    return [r for r in csv.DictReader(f.open())] if f.is_file() else []


def num(r, key):
    try:
        return float(r[key])
    except (KeyError, ValueError, TypeError):
        return float("nan")


def check(label, value, ok, target):
    verdict = "not measured" if value != value else ("PASS" if ok else "MISS")
    if mode == "cpu":
        verdict = "n/a (cpu structure check; targets are for an H200)"
    print(f"{label}: {value:.3f} ({target}) -> {verdict}" if value == value else f"{label}: - ({target}) -> {verdict}")


print(f"targets ({mode}); TPOT = median decode step, ms; transformers rows: hf, hf-compiled of the same run")
for stage in ("seed", "compiled", "xl"):
    rs = [r for r in rows(stage) if r["status"] == "ok"]
    if not rs:
        print(f"{stage}: no rows")
        continue
    meta = json.loads((dest / stage / "meta.json").read_text())
    model = meta["model"]
    print(f"{stage}: {model} ({meta['weights']}) on {meta['device_name']}, {meta['dtype']}, status {meta['status']}")
    for p in sorted({int(r["prompt_len"]) for r in rs}, reverse=True):
        at = [r for r in rs if int(r["prompt_len"]) == p]
        sg = next((r for r in at if r["engine"] == "kvbench" and r["cache"] == "static-graph"), None)
        hf = [r for r in at if r["engine"] in ("hf", "hf-compiled") and num(r, "tpot_ms_median") == num(r, "tpot_ms_median")]
        best = min(hf, key=lambda r: num(r, "tpot_ms_median")) if hf else None
        if sg is not None:
            t = num(sg, "tpot_ms_median")
            limit = 1.5 if model == "gpt2-xl" else 0.40
            check(f"{stage} {model} prompt {p} static-graph TPOT", t, t <= limit, f"<= {limit} ms")
            if best is not None:
                ratio = num(best, "tpot_ms_median") / t
                check(f"{stage} prompt {p} fastest transformers row ({best['engine']} {best['cache']}, "
                      f"{num(best, 'tpot_ms_median'):.3f} ms) / static-graph", ratio, ratio >= 3, ">= 3x")
        for r in at:
            if r["cache"] != "none" and r["engine"] == "kvbench":
                print(f"  {stage} prompt {p} kvbench {r['cache']}: speedup vs none {num(r, 'speedup_vs_none'):.2f}x, "
                      f"TPOT {num(r, 'tpot_ms_median'):.3f} ms (cold {num(r, 'cold_tpot_ms_median'):.3f})")
    flips = [r for r in rs if num(r, "flips") > 0]
    for r in flips:
        print(f"  {stage} tokens {r['engine']} {r['cache']} prompt {r['prompt_len']}: "
              f"{num(r, 'token_agreement'):.0%} agree; {r['tokens_note']}")
    if not flips:
        print(f"  {stage}: every row's tokens equal kvbench none's")
PYEOF
echo "targets rc=$?" >>"$DEST/status.txt"

echo "files in $DEST:" >&2
ls -la "$DEST" >&2
cat "$DEST/status.txt" "$DEST/targets.txt" >&2
echo "total ${SECONDS}s of a ${BUDGET}s budget" | tee -a "$DEST/status.txt" >&2
