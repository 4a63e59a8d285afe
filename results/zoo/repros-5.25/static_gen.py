# usage, from the repository root: python results/zoo/repros-5.25/static_gen.py results/zoo/configs/inkling2_text   (or inkling_text)
# Plain transformers, no kvbench. The config is the zoo sweep's own tiny config (scripts/zoo.py --out results/zoo
# writes results/zoo/configs/<type>/config.json). Classified in results/zoo/triage.toml.
# Plain transformers: greedy generate with cache_implementation="static" vs use_cache=False.
import sys, torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(sys.argv[1]); cfg.initializer_range = 0.05
model = AutoModelForCausalLM.from_config(cfg).eval()
ids = torch.randint(3, 1000, (1, 16))
kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, do_sample=False,
          pad_token_id=0, return_dict_in_generate=True, output_logits=True)
ref = model.generate(**kw, use_cache=False)
for impl in ("dynamic", "static"):
    try:
        out = model.generate(**kw, cache_implementation=impl)
        d = max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits))
        print(transformers.__version__, impl, "tokens equal:", torch.equal(out.sequences, ref.sequences), f"max|logit diff| {d:.2e}")
    except Exception as e:
        print(transformers.__version__, impl, "raised", type(e).__name__, str(e)[:200])
