# usage, from the repository root: python results/zoo/repros-5.25/rg2.py results/zoo/configs/recurrent_gemma
# Plain transformers, no kvbench. The config is the zoo sweep's own tiny config (scripts/zoo.py --out results/zoo
# writes results/zoo/configs/<type>/config.json). Classified in results/zoo/triage.toml.
# Plain transformers: RecurrentGemma, greedy generate with the default DynamicCache vs use_cache=False, and a cached
# step without position_ids (the model derives them from cache.get_seq_length()).
import sys, torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(sys.argv[1]); cfg.initializer_range = 0.05
model = AutoModelForCausalLM.from_config(cfg).eval()
ids = torch.randint(3, 1000, (1, 12))
with torch.no_grad():
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    ref, out = model.generate(**kw, use_cache=False), model.generate(**kw)
    d = max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits))
    print(transformers.__version__, "generate cached vs use_cache=False: tokens equal", torch.equal(out.sequences, ref.sequences), f"max|logit diff| {d:.2e}")
    c = DynamicCache(config=cfg)
    model(input_ids=ids[:, :11], cache=c, use_cache=True)
    print("  after an 11-token forward: cache.get_seq_length() =", repr(c.get_seq_length()), "| layer 1:", c.get_seq_length(1) if len(c.layers) > 1 else None)
    got = model(input_ids=ids[:, 11:], cache=c, use_cache=True).logits[0, -1]
    want = model(input_ids=ids, use_cache=False).logits[0, -1]
    print(f"  cached step without position_ids: max|diff| vs no-cache {(got - want).abs().max().item():.2e}")
