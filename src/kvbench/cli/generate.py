"""`kvbench generate`: text through any cache, one prompt streamed or a batch decoded together."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbench import console, options
from kvbench.cli.app import command, load_for_cli
from kvbench.console import fitted, line, out, styled
from kvbench.errors import KVBenchError
from kvbench.jsonio import SCHEMA_VERSION
from kvbench.options import option

if TYPE_CHECKING:
    import torch

    from kvbench.decode.generate import Sampler
    from kvbench.model.tokenizer import Tokenizer
    from kvbench.model.weights import LoadedModel


def read_prompts(prompt: str | None, prompts: list[str] | None, prompts_file: Path | None) -> list[str]:
    texts = ([prompt] if prompt is not None else []) + list(prompts or [])
    if prompts_file is not None:
        texts += [line for line in prompt_lines(prompts_file) if line.strip()]
    if not texts:
        raise KVBenchError("no prompt given: pass PROMPT, --prompt (repeatable) or --prompts-file")
    for i, t in enumerate(texts):
        if not t.strip():
            raise KVBenchError(f"prompt {i + 1} is empty")
        # bytes that are not UTF-8 reach argv as lone surrogates (Python's surrogateescape): refused as a file's are
        bad = next((at for at, c in enumerate(t) if "\ud800" <= c <= "\udfff"), None)
        if bad is not None:
            raise KVBenchError(f"prompt {i + 1} is not UTF-8 text (character {bad + 1:,})")
    return texts


def prompt_lines(path: Path) -> list[str]:
    """The lines of a --prompts-file, split at line feeds only (a CR before one is dropped too): a form feed, U+0085
    or U+2028 inside a prompt stays in it. A leading byte-order mark is not part of the first prompt."""
    from kvbench import files

    text = files.read_text(path, f"--prompts-file {path}", files.PROMPTS_BYTES, "a prompts file")
    return [line.removesuffix("\r") for line in text.removeprefix("\ufeff").split("\n")]


@dataclass
class GenerateOptions:
    """One `kvbench generate` command line (decode/rules.py generate_rules)."""

    prompt: str | None = option(argument=True, default=None, help="The prompt (or use --prompt / --prompts-file).")
    prompts: list[str] | None = option(
        "--prompt", "-p", default=None, help="A prompt; repeat for a batch decoded together."
    )
    prompts_file: Path | None = option(
        "--prompts-file", default=None, help="One prompt per line, decoded together as a batch."
    )
    new_tokens: int = option(
        "--new-tokens",
        "--max-new-tokens",
        "-n",
        default=64,
        help="Tokens to generate (at most, with --stop).",
    )
    cache: str = option("--cache", "-c", default="dynamic", help="KV cache: none, dynamic, static, ...")
    temperature: float = option("--temperature", "-t", default=0.0, help="0 = greedy.")
    top_k: int | None = option("--top-k", default=None, help="Sample from the k most likely tokens.")
    stop_at_eot: bool = option("--stop/--no-stop", default=True, help="Stop a sequence at <|endoftext|>.")
    model: str | None = options.model_option()
    weights: str = options.weights_option()
    device: str = options.device_option()
    dtype: str = options.dtype_option("auto")
    seed: int = options.seed_option()
    tokenizer: str | None = options.tokenizer_option()
    compile: str = options.compile_option()
    draft: str = option(
        "--draft",
        default="none",
        help="none, or prompt-lookup: speculative decoding that drafts tokens by copying what followed the last "
        "n-gram earlier in the text and verifies them in one forward (one prompt, greedy; the same tokens).",
    )
    draft_tokens: int | None = option(
        "--draft-tokens",
        default=None,
        help="With --draft prompt-lookup: most draft tokens per forward (default: 4).",
    )
    ngram: int | None = option(
        "--ngram",
        default=None,
        help="With --draft prompt-lookup: longest suffix looked up, then shorter ones down to 1 (default: 3).",
    )
    json_out: bool = options.json_option()


@command(GenerateOptions)
def generate(o: GenerateOptions) -> None:
    """Generate text through any cache (and batches of prompts). Greedy by default; streams a single prompt."""
    doc, streamed = run_generation(o, prepare(o))
    if o.json_out:
        console.print_json({"schema_version": SCHEMA_VERSION, **doc})
    else:
        render_generation(doc, streamed=streamed)


@dataclass
class Prepared:
    """What a generation runs on: the prompts, their token ids, the sampler and the loaded model."""

    texts: list[str]
    tok: Tokenizer
    ids: list[list[int]]
    sampler: Sampler
    loaded: LoadedModel
    device: torch.device
    dtype: torch.dtype


def prepare(o: GenerateOptions) -> Prepared:
    """Every check that needs no weights (prompts, the options' rules, tokenizer, the model's context), then the
    model, then the prompts' token ids against its vocabulary."""
    texts = read_prompts(o.prompt, o.prompts, o.prompts_file)
    from kvbench import validate
    from kvbench.decode.generate import Sampler
    from kvbench.decode.rules import compile_mode, generate_rules, padding_rule
    from kvbench.model.tokenizer import load_tokenizer
    from kvbench.model.weights import peek_config

    generate_rules(o, len(texts))
    sampler = Sampler(temperature=o.temperature, top_k=o.top_k, seed=o.seed)
    tok = load_tokenizer(o.tokenizer)
    ids = [tok.encode(t) for t in texts]
    for i, p in enumerate(ids):
        if not p:
            raise KVBenchError(f"prompt {i + 1} encodes to zero tokens")
    padding_rule(o.cache, [len(p) for p in ids])
    cfg = peek_config(o.model, o.weights)
    longest = max(map(len, ids))
    validate.fits_context(
        "prompt length" if len(ids) == 1 else "longest prompt",
        longest,
        o.new_tokens,
        cfg.block_size,
        "use a shorter prompt or fewer --new-tokens",
    )
    from kvbench.check.verify import check_run_fits
    from kvbench.devices import resolve_device, resolve_dtype

    run_on = resolve_device(o.device)
    what = f"{len(ids):,} prompt(s) of up to {longest} tokens + {o.new_tokens} new"
    check_run_fits(cfg, len(ids), longest + o.new_tokens, resolve_dtype(o.dtype, run_on), run_on, what, 1)
    loaded, dev, dt = load_for_cli(o.model, o.weights, o.device, o.dtype, o.seed)
    compile_mode(o.compile, dev.type)
    vocab = loaded.config.vocab_size
    for i, p in enumerate(ids):
        if max(p) >= vocab:
            raise KVBenchError(f"prompt {i + 1} has token id {max(p)} >= the model's vocabulary of {vocab}")
    return Prepared(texts, tok, ids, sampler, loaded, dev, dt)


def draft_settings(o: GenerateOptions) -> tuple[int, int]:
    from kvbench.decode import speculative

    return (
        speculative.DEFAULT_DRAFT_TOKENS if o.draft_tokens is None else o.draft_tokens,
        speculative.DEFAULT_NGRAM if o.ngram is None else o.ngram,
    )


def run_generation(o: GenerateOptions, p: Prepared) -> tuple[dict, bool]:
    """Generate, streaming a single prompt's completion unless --json; returns the JSON document and whether the
    completion was streamed."""
    from kvbench.decode.generate import generate as run_generate
    from kvbench.decode.speculative import speculative_generate

    stream = TextStream(p.tok, p.texts[0]) if (len(p.texts) == 1 and not o.json_out) else None
    stop_token = p.tok.eot_id if o.stop_at_eot else None
    on_token = stream.push if stream else None
    spec = None
    try:
        if o.draft == "prompt-lookup":
            k, n = draft_settings(o)
            spec = speculative_generate(
                p.loaded.model,
                p.ids,
                o.new_tokens,
                cache=o.cache,
                draft_tokens=k,
                ngram=n,
                stop_token=stop_token,
                on_token=on_token,
            )
            result = spec.generation
        else:
            result = run_generate(
                p.loaded.model,
                p.ids,
                o.new_tokens,
                cache=o.cache,
                sampler=p.sampler,
                stop_token=stop_token,
                on_token=on_token,
                compile=o.compile,
            )
    finally:  # the streamed line ends before anything else is printed, an interruption's line too
        if stream:
            stream.close()
    doc = generation_report(
        p.texts, result, p.tok, p.loaded, p.device, p.dtype, p.sampler, tokenizer_source=p.tok.source
    )
    doc["settings"]["compile"] = o.compile
    doc["settings"]["draft"] = o.draft
    doc["draft"] = None if spec is None else draft_report(spec)
    return doc, stream is not None


def draft_report(spec) -> dict:
    """What the drafts of a prompt-lookup run did (speculative.SpeculativeResult)."""
    import statistics

    return {
        "method": "prompt-lookup",
        "draft_tokens": spec.draft_tokens,
        "ngram": spec.ngram,
        "forwards": spec.forwards,
        "proposed": spec.proposed,
        "accepted": spec.accepted,
        "acceptance_rate": spec.acceptance_rate,
        "tokens_per_forward": spec.generation.new_tokens / spec.forwards,
        "forward_ms_median": statistics.median(spec.forward_s) * 1e3 if spec.forward_s else None,
    }


def generation_report(texts, result, tok, loaded, dev, dt, sampler, tokenizer_source) -> dict:
    """The JSON document of a generate run: completions, settings, timings (all device-synchronised)."""
    import statistics

    from kvbench.devices import device_name, dtype_name

    n_tokens = sum(len(t) for t in result.tokens)
    return {
        "completions": [
            {"prompt": p, "prompt_tokens": n, "tokens": t, "text": tok.decode(t)}
            for p, n, t in zip(texts, result.prompt_lens, result.tokens, strict=True)
        ],
        "settings": {
            "model": loaded.config.name,
            "weights": loaded.weights,
            "random_weights": loaded.random,
            "tokenizer": tokenizer_source,
            "cache": result.cache,
            "device": str(dev),
            "device_name": device_name(dev),
            "dtype": dtype_name(dt),
            "batch": len(texts),
            "temperature": sampler.temperature,
            "top_k": sampler.top_k,
            "seed": sampler.seed,
        },
        "timings": {
            "ttft_ms": result.ttft_s * 1e3,
            "tpot_ms_median": statistics.median(result.step_s) * 1e3 if result.step_s else None,
            "total_s": result.total_s,
            "generated_tokens": n_tokens,
            "tokens_per_s": (len(texts) * result.new_tokens) / result.total_s if result.total_s > 0 else None,
        },
        "cache": {"name": result.cache, "bytes": result.cache_bytes, "bytes_copied": result.bytes_copied},
        "warning": loaded.warning,
    }


# --- rendering ---
class TextStream:
    """Prints a single completion as it is produced. Decodes the whole completion each time and prints the new
    suffix, so a character split across two byte-level tokens appears once it is complete."""

    def __init__(self, tokenizer, prompt: str) -> None:
        self.tok, self.shown = tokenizer, ""
        self.ids: list[int] = []
        out.print(styled(prompt, "bold"), end="")

    def push(self, ids: list[int]) -> None:
        if ids[0] == self.tok.eot_id:
            return
        self.ids.append(ids[0])
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        out.print(text[len(self.shown) :], end="", markup=False, highlight=False)
        self.shown = text

    def close(self) -> None:
        out.print()


def render_generation(doc: dict, streamed: bool) -> None:
    if not streamed:
        for i, c in enumerate(doc["completions"], 1):
            out.rule(styled(f"sequence {i} ({c['prompt_tokens']} prompt tokens)", "dim"))
            out.print(styled(c["prompt"], "bold"), end="")
            out.print(c["text"], markup=False, highlight=False)
    s, t, c, d = doc["settings"], doc["timings"], doc["cache"], doc.get("draft")
    tpot = t["tpot_ms_median"]
    tpot_note = "decode steps only" if d is None else "each forward's time over the tokens it produced"
    rows: list[list[Any]] = [
        [
            "model / weights",
            line(
                f"{s['model']} / {s['weights']}",
                styled("  (random: text is meaningless)", "yellow") if s["random_weights"] else "",
            ),
        ],
        ["device / dtype", f"{s['device_name']} / {s['dtype']}"],
        [
            "cache",
            f"{c['name']}: {console.fmt_bytes(c['bytes'])} held"
            + (f", {console.fmt_bytes(c['bytes_copied'])} of history copied" if c["bytes_copied"] else ""),
        ],
        ["prefill (TTFT)", f"{t['ttft_ms']:.1f} ms for batch {s['batch']}"],
        ["median time per output token", "-" if tpot is None else f"{tpot:.2f} ms ({tpot_note})"],
        [
            "throughput",
            f"{t['tokens_per_s']:.1f} tokens/s incl. prefill ({t['generated_tokens']} tokens kept)",
        ],
    ]
    if d is not None:
        rate = "-" if d["acceptance_rate"] is None else f"{d['acceptance_rate']:.0%}"
        rows.append(
            [
                "draft (prompt-lookup)",
                f"{d['accepted']} of {d['proposed']} draft tokens accepted ({rate}); {d['forwards']} forwards for "
                f"{t['generated_tokens']} tokens kept (K {d['draft_tokens']}, n-gram {d['ngram']})",
            ]
        )
    title = "generate (timings: device-synchronised wall clock)"
    for x in fitted(title, ["", ""], rows, out.width, header=False, wrap=(1,)):
        out.print(x)
