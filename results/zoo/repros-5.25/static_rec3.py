# usage, from the repository root: python results/zoo/repros-5.25/static_rec3.py results/zoo/configs/bamba
# Plain transformers, no kvbench. The config is the zoo sweep's own tiny config (scripts/zoo.py --out results/zoo
# writes results/zoo/configs/<type>/config.json). Classified in results/zoo/triage.toml.
# Why: StaticCache.is_compileable turns False once a linear layer records its past, and create_causal_mask
# (masking_utils.py:976) then allows skipping the mask of a 1-token query: the step attends to the empty static slots.
import sys, torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM, StaticCache
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(sys.argv[1]); cfg.initializer_range = 0.05
model = AutoModelForCausalLM.from_config(cfg).eval()
ids = torch.randint(3, 1000, (1, 13))
with torch.no_grad():
    want = model(input_ids=ids, use_cache=False).logits[0, -1]
    for force in (False, True):
        c = StaticCache(config=cfg, max_cache_len=32)
        try: c.activate_past_recording(recurrent_states_to_keep=8)
        except TypeError: c.activate_past_recording()
        if force: type(c).is_compileable = property(lambda self: True)
        print("is_compileable:", c.is_compileable, end=" ")
        model(input_ids=ids[:, :12], cache=c, use_cache=True, position_ids=torch.arange(12)[None])
        got = model(input_ids=ids[:, 12:], cache=c, use_cache=True, position_ids=torch.tensor([[12]])).logits[0, -1]
        print(transformers.__version__, "force is_compileable" if force else "as is", f"max|diff| {(got - want).abs().max().item():.2e}")
