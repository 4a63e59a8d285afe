# usage, from the repository root: python results/zoo/repros-5.25/rollback_multi.py results/zoo/configs/zamba   (or zaya; bamba as a control)
# Plain transformers, no kvbench. The config is the zoo sweep's own tiny config (scripts/zoo.py --out results/zoo
# writes results/zoo/configs/<type>/config.json). Classified in results/zoo/triage.toml.
# Plain transformers 5.25: prefill, 3 one-token steps, a 6-token draft in one forward, crop(-3), one step, vs no cache.
# With recurrent_states_to_keep=6 a model that computes the intermediate states restores the right one; a model that
# does not (zamba, zaya: no get_recurrent_states_to_keep in their modeling) gets an older state back, silently.
import sys, torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(sys.argv[1]); cfg.initializer_range = 0.05
model = AutoModelForCausalLM.from_config(cfg).eval()
ids = torch.randint(3, 1000, (1, 19)); x = torch.tensor([[7]])
def step(inp, c, s): return model(input_ids=inp, position_ids=torch.arange(s, s + inp.size(1))[None], cache=c, use_cache=True).logits[0, -1]
with torch.no_grad():
    c = DynamicCache(config=cfg); c.activate_past_recording(recurrent_states_to_keep=6)
    step(ids[:, :10], c, 0)
    for t in (10, 11, 12): step(ids[:, t:t + 1], c, t)
    step(ids[:, 13:19], c, 13)
    try:
        c.crop(-3)
    except Exception as e:
        print(transformers.__version__, cfg.model_type, "crop(-3) raised", type(e).__name__, e); sys.exit()
    want = model(input_ids=torch.cat([ids[:, :16], x], 1), use_cache=False).logits[0, -1]
    print(transformers.__version__, cfg.model_type, "is_croppable", c.is_croppable, f"| crop(-3), one step: max|diff| vs no-cache {(step(x, c, 16) - want).abs().max().item():.2e} (scale {want.abs().max().item():.2f})")
