#!/usr/bin/env bash
# The tests that read transformers (--hf, recurrent models, tensor parallelism, the memory planner's check), and
# kvbench verify with verify --hf on a tiny GQA Llama, at other transformers releases than the locked one:
#
#   bash scripts/compat.sh [lowest] [newest] [5.20.2 ...]
#
# lowest: the floor pyproject.toml declares; newest: the newest release on PyPI; or any version. Each runs in a venv
# of its own (.venv-compat-VERSION, made once and reused): torch as TORCH_SPEC pins it, requirements.lock, then that
# transformers (pip adjusts what it needs, tokenizers and huggingface-hub among them). A fact of transformers that a
# newer release changed is a skip naming it (tests/facts.py), not a failure. Exit 0 when every version passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TESTS=(tests/test_hf_verify.py tests/test_recurrent.py tests/test_tp.py tests/test_memory_transformers.py tests/test_zoo.py)
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1

floor() { sed -n 's/^ *"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml; }

one() {
    local want=$1 venv spec
    case $want in
        lowest) want=$(floor); spec="transformers==$want" ;;
        newest) spec="transformers" ;;
        *) spec="transformers==$want" ;;
    esac
    venv=.venv-compat-${1}
    test -x "$venv/bin/python" || "$PYTHON" -m venv "$venv" || return 1
    "$venv/bin/python" -c "import torch" 2>/dev/null || "$venv/bin/pip" install -q "$TORCH_SPEC" || return 1
    "$venv/bin/pip" install -q --no-deps -r requirements.lock || return 1
    "$venv/bin/pip" install -q --upgrade "$spec" || return 1
    "$venv/bin/pip" install -q --no-deps -e . || return 1
    local version
    version=$("$venv/bin/python" -c "import transformers; print(transformers.__version__)")
    echo "== transformers $version ($1) in $venv"
    local dir
    dir=$(mktemp -d)
    "$venv/bin/python" - "$dir" <<'EOF' || return 1
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, initializer_range=0.05)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])
EOF
    "$venv/bin/kvbench" verify -m gpt2-tiny -w random -d cpu -n 8 | tail -1 || return 1
    "$venv/bin/kvbench" verify --hf "$dir" -d cpu -n 8 | tail -1 || return 1
    rm -rf "$dir"
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" -n 2 --dist loadscope "${TESTS[@]}" | tail -15
}

failed=()
for v in "${@:-lowest newest}"; do
    for w in $v; do
        one "$w" || failed+=("$w")
    done
done
if ((${#failed[@]})); then
    echo "compat: failed at ${failed[*]}" >&2
    exit 1
fi
echo "compat: passed at ${*:-lowest newest}"
