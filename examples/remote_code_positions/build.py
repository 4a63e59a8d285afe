"""Write a KVToy model directory with random weights: python build.py OUT_DIR [--fixed].

The directory holds config.json (with `auto_map` pointing at the two modelling files beside it), those files,
and model.safetensors; `kvbench verify --hf OUT_DIR --trust-remote-code` loads it.
"""

import argparse
import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(out_dir, positions_from_cache: bool = True, seed: int = 0, **config) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("configuration_kvtoy.py", "modeling_kvtoy.py"):
        shutil.copy(HERE / name, out / name)
    doc = {
        "model_type": "kvtoy",
        "architectures": ["KVToyForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_kvtoy.KVToyConfig",
            "AutoModelForCausalLM": "modeling_kvtoy.KVToyForCausalLM",
        },
        "positions_from_cache": positions_from_cache,
        **config,
    }
    (out / "config.json").write_text(json.dumps(doc, indent=2))
    cfg = AutoConfig.from_pretrained(out, trust_remote_code=True)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, trust_remote_code=True).save_pretrained(out)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--fixed", action="store_true", help="take the position_ids generate passes (no bug)")
    a = p.parse_args()
    print(build(a.out_dir, positions_from_cache=not a.fixed))
