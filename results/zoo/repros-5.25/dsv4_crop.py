# usage, from the repository root: python results/zoo/repros-5.25/dsv4_crop.py results/zoo/configs/deepseek_v4
# Plain transformers, no kvbench. The config is the zoo sweep's own tiny config (scripts/zoo.py --out results/zoo
# writes results/zoo/configs/<type>/config.json). Classified in results/zoo/triage.toml.
# Plain transformers: DeepSeek-V4's DynamicCache: is it declared croppable, and is a crop exact?
import sys, torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(sys.argv[1]); cfg.initializer_range = 0.05
model = AutoModelForCausalLM.from_config(cfg).eval()
ids = torch.randint(3, 1000, (1, 38)); x = torch.tensor([[7]])
def step(inp, c, s): return model(input_ids=inp, position_ids=torch.arange(s, s + inp.size(1))[None], cache=c, use_cache=True).logits[0, -1]
with torch.no_grad():
    c = DynamicCache(config=cfg); c.activate_past_recording()
    step(ids[:, :32], c, 0); step(ids[:, 32:38], c, 32)
    print(transformers.__version__, "is_croppable:", c.is_croppable, sorted({type(l).__name__ for l in c.layers if not l.is_croppable}))
    c.crop(-3)
    want = model(input_ids=torch.cat([ids[:, :35], x], 1), use_cache=False).logits[0, -1]
    try: print("  crop(-3) anyway, then 1 step: max|diff| vs no-cache", f"{(step(x, c, 35) - want).abs().max().item():.2e}")
    except Exception as e: print("  crop(-3) anyway, then 1 step raised", type(e).__name__, str(e)[:120])
