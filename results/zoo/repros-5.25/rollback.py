# usage, from the repository root: python results/zoo/repros-5.25/rollback.py results/zoo/configs/bamba MODE
# (MODE: none | default | keepN, e.g. keep6)
# Plain transformers, no kvbench. The config is the zoo sweep's own tiny config (scripts/zoo.py --out results/zoo
# writes results/zoo/configs/<type>/config.json). Classified in results/zoo/triage.toml.
# Plain transformers: speculative-decoding rollback on a hybrid (recurrent + attention) model's DynamicCache.
import sys, torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(sys.argv[1]); cfg.initializer_range = 0.05
mode = sys.argv[2]
model = AutoModelForCausalLM.from_config(cfg).eval()
ids = torch.randint(3, 1000, (1, 16)); x = torch.tensor([[7]])
def step(inp, cache, start):  # as generate calls it: explicit positions
    return model(input_ids=inp, position_ids=torch.arange(start, start + inp.size(1))[None], cache=cache, use_cache=True).logits[0, -1]
def full(inp):
    return model(input_ids=inp, use_cache=False).logits[0, -1]
with torch.no_grad():
    c = DynamicCache(config=cfg)
    try:
        if mode == "default": c.activate_past_recording()
        if mode.startswith("keep"): c.activate_past_recording(recurrent_states_to_keep=int(mode[4:]))
    except Exception as e:
        print(transformers.__version__, "activate_past_recording raised", type(e).__name__, e); sys.exit()
    print(transformers.__version__, mode, "| is_croppable, empty:", c.is_croppable, end=" ")
    try:
        step(ids[:, :10], c, 0)
    except Exception as e:
        print("| prefill raised", type(e).__name__, e); sys.exit()
    print("| after prefill:", c.is_croppable, "| get_seq_length():", repr(c.get_seq_length()), end=" ")
    step(ids[:, 10:16], c, 10)                      # 6 draft tokens in one forward
    try:
        c.crop(-3)                                   # reject the last 3
    except Exception as e:
        print("| crop(-3) raised", type(e).__name__, e); sys.exit()
    d = (step(x, c, 13) - full(torch.cat([ids[:, :13], x], 1))).abs().max().item()
    print(f"| crop(-3) then 1 step: max|diff| vs no-cache {d:.2e}", end=" ")
    try:
        c.crop(-int(c.get_seq_length()))            # crop to 0, start over
        d = (step(ids[:, :5], c, 0) - full(ids[:, :5])).abs().max().item()
        print(f"| crop to 0 then prefill: max|diff| {d:.2e}")
    except Exception as e:
        print("| crop to 0 raised", type(e).__name__, e)
