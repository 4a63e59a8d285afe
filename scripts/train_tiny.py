"""Train gpt2-shakespeare: a small GPT-2 (GPT-2's architecture and tokenizer) on Shakespeare, with kvbench's own model.

    python scripts/shakespeare_corpus.py --out data/shakespeare
    python scripts/train_tiny.py --data data/shakespeare --out src/kvbench/data/gpt2-shakespeare --bf16 \
        --plot docs/shakespeare-loss.png

Seeded and CPU-only. The shipped checkpoint is that command's: 850 steps of 16 x 256 tokens (3.5 M tokens, 2.3
passes over the training text), bfloat16 autocast, 71 minutes on a 2-core AMD EPYC (AVX-512 BF16) that was running
other work beside it (2026-12-05). The model is kvbench's `GPT` (model/gpt2.py), so
what kvbench decodes is what was trained; it is written in Hugging Face's format (config.json +
model.safetensors, weights stored in float16 to stay small; config.json's dtype is float32, the dtype both
transformers and kvbench compute in), so `GPT2LMHeadModel.from_pretrained(dir)` loads it as is. Beside it:
train_log.csv (step, tokens, train loss, held-out loss) and the loss curve (--plot, docs/shakespeare-loss.png).
Held-out loss is measured on The Tempest, which the corpus script keeps out of training.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kvbench.model.gpt2 import GPT, GPTConfig
from kvbench.model.hf_config import hf_gpt2_config

CONFIG = GPTConfig(n_layer=6, n_head=4, n_embd=128, block_size=512, name="gpt2-shakespeare")


def batches(data: np.ndarray, batch: int, seq: int, g: torch.Generator):
    """Endless random windows of seq + 1 tokens: (inputs, targets), each (batch, seq)."""
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([torch.from_numpy(data[s : s + seq + 1].astype(np.int64)) for s in starts.tolist()])
        yield x[:, :-1], x[:, 1:]


@torch.no_grad()
def heldout_loss(model: GPT, data: np.ndarray, seq: int, windows: int) -> float:
    """Mean next-token loss over `windows` consecutive non-overlapping windows from the start of the held-out play."""
    model.eval()
    losses = []
    for w in range(min(windows, (len(data) - 1) // seq)):
        x = torch.from_numpy(data[w * seq : (w + 1) * seq + 1].astype(np.int64))[None]
        pos = torch.arange(seq)[None]
        logits = model(x[:, :-1], pos)
        losses.append(F.cross_entropy(logits[0], x[0, 1:]).item())
    model.train()
    return float(np.mean(losses))


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def save(model: GPT, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_gpt2_config(model.config).to_dict()
    cfg.update(dtype="float32", _name_or_path="gpt2-shakespeare", architectures=["GPT2LMHeadModel"])
    cfg.pop("transformers_version", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def plot(log: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    tokens = [r["tokens"] / 1e6 for r in log]
    ax.plot(tokens, [r["train_loss"] for r in log], label="training (mean of the last 25 steps)", color="#4c72b0")
    held = [(r["tokens"] / 1e6, r["heldout_loss"]) for r in log if r["heldout_loss"] == r["heldout_loss"]]
    ax.plot(*zip(*held, strict=True), "o-", label="held out (The Tempest)", color="#dd8452")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title("gpt2-shakespeare: 6 layers x 128 wide, GPT-2's tokenizer, 2-core CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--data", type=Path, required=True, help="train.bin and heldout.bin (scripts/shakespeare_corpus.py)"
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=850)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast for the matmuls (AVX-512 BF16 CPUs)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train = np.fromfile(args.data / "train.bin", dtype=np.uint16)
    held = np.fromfile(args.data / "heldout.bin", dtype=np.uint16)
    model = GPT(CONFIG).init_weights(seed=args.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95)
    )
    g = torch.Generator().manual_seed(args.seed)
    data = batches(train, args.batch, args.seq, g)
    pos = torch.arange(args.seq).expand(args.batch, -1)
    log, recent, t0 = [], [], time.perf_counter()
    # the last 4 positions learn too (inference at 512): every 4th step trains on windows of the full context
    long_data = batches(train, args.batch // 2, CONFIG.block_size, g)
    long_pos = torch.arange(CONFIG.block_size).expand(args.batch // 2, -1)
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=100)
        x, y = next(long_data) if step % 4 == 3 else next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(x, long_pos if step % 4 == 3 else pos)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent = (recent + [loss.item()])[-25:]
        last = step + 1 == args.steps
        if (step + 1) % 25 == 0 or last:
            evaluate = (step + 1) % args.eval_every == 0 or last
            row = {
                "step": step + 1,
                "tokens": (step + 1) * args.batch * args.seq,
                "train_loss": float(np.mean(recent)),
                "heldout_loss": heldout_loss(model, held, CONFIG.block_size, 16) if evaluate else float("nan"),
                "seconds": round(time.perf_counter() - t0, 1),
            }
            log.append(row)
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        if last or (step + 1) % 250 == 0:
            save(model, args.out)
    with (args.out / "train_log.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(log[0]))
        w.writeheader()
        w.writerows(log)
    if args.plot:
        plot(log, args.plot)


if __name__ == "__main__":
    main()
