"""`kvbench generate`: text through any cache, one prompt streamed or a batch decoded together."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvbench import console
from kvbench.cli.app import app, handle_errors, load_for_cli
from kvbench.cli.options import (
    CompileOpt,
    DeviceOpt,
    DraftOpt,
    DraftTokensOpt,
    GenerateCacheOpt,
    GenerateNewTokensOpt,
    JsonOpt,
    ModelOpt,
    NgramOpt,
    PromptArg,
    PromptsFileOpt,
    PromptsOpt,
    SeedOpt,
    StopOpt,
    TemperatureOpt,
    TokenizerOpt,
    TopKOpt,
    WeightsOpt,
    dtype_opt,
)
from kvbench.console import fitted, line, out, styled
from kvbench.errors import KVBenchError
from kvbench.jsonio import SCHEMA_VERSION


def read_prompts(prompt: str | None, prompts: list[str] | None, prompts_file: Path | None) -> list[str]:
    texts = ([prompt] if prompt is not None else []) + list(prompts or [])
    if prompts_file is not None:
        texts += [line for line in prompt_lines(prompts_file) if line.strip()]
    if not texts:
        raise KVBenchError("no prompt given: pass PROMPT, --prompt (repeatable) or --prompts-file")
    for i, t in enumerate(texts):
        if not t.strip():
            raise KVBenchError(f"prompt {i + 1} is empty")
    return texts


def prompt_lines(path: Path) -> list[str]:
    """The lines of a --prompts-file, split at line feeds only (a CR before one is dropped too): a form feed, U+0085
    or U+2028 inside a prompt stays in it. A leading byte-order mark is not part of the first prompt."""
    from kvbench import files

    text = files.read_text(path, f"--prompts-file {path}", files.PROMPTS_BYTES, "a prompts file")
    return [line.removesuffix("\r") for line in text.removeprefix("\ufeff").split("\n")]


@dataclass
class GenerateOptions:
    """One `kvbench generate` command line, as given."""

    prompt: str | None
    prompts: list[str] | None
    prompts_file: Path | None
    new_tokens: int
    cache: str
    temperature: float
    top_k: int | None
    stop_at_eot: bool
    model: str | None
    weights: str
    device: str
    dtype: str
    seed: int
    tokenizer: str | None
    compile: str
    json_out: bool
    draft: str = "none"
    draft_tokens: int | None = None  # None: not given (speculative.DEFAULT_DRAFT_TOKENS)
    ngram: int | None = None  # None: not given (speculative.DEFAULT_NGRAM)


@app.command()
@handle_errors
def generate(
    prompt: PromptArg = None,
    prompts: PromptsOpt = None,
    prompts_file: PromptsFileOpt = None,
    new_tokens: GenerateNewTokensOpt = 64,
    cache: GenerateCacheOpt = "dynamic",
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = None,
    stop_at_eot: StopOpt = True,
    model: ModelOpt = None,
    weights: WeightsOpt = "auto",
    device: DeviceOpt = "auto",
    dtype: str = dtype_opt("auto"),
    seed: SeedOpt = 0,
    tokenizer: TokenizerOpt = None,
    compile: CompileOpt = "off",
    draft: DraftOpt = "none",
    draft_tokens: DraftTokensOpt = None,
    ngram: NgramOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Generate text through any cache (and batches of prompts). Greedy by default; streams a single prompt."""
    opts = GenerateOptions(
        prompt=prompt, prompts=prompts, prompts_file=prompts_file, new_tokens=new_tokens, cache=cache,
        temperature=temperature, top_k=top_k, stop_at_eot=stop_at_eot, model=model, weights=weights, device=device,
        dtype=dtype, seed=seed, tokenizer=tokenizer, compile=compile, json_out=json_out, draft=draft,
        draft_tokens=draft_tokens, ngram=ngram,
    )  # fmt: skip
    doc, streamed = run_generation(opts, prepare(opts))
    if json_out:
        console.print_json({"schema_version": SCHEMA_VERSION, **doc})
    else:
        render_generation(doc, streamed=streamed)


@dataclass
class Prepared:
    """What a generation runs on: the prompts, their token ids, the sampler and the loaded model."""

    texts: list[str]
    tok: object
    ids: list[list[int]]
    sampler: object
    loaded: object
    device: object
    dtype: object


def prepare(o: GenerateOptions) -> Prepared:
    """Every check that needs no weights (prompts, --new-tokens, cache, compile mode, sampler, --draft, tokenizer,
    the model's context), then the model, then the prompts' token ids against its vocabulary."""
    texts = read_prompts(o.prompt, o.prompts, o.prompts_file)
    from kvbench import validate
    from kvbench.caches import get_cache_spec
    from kvbench.decode.fixed_step import check_compile
    from kvbench.decode.generate import Sampler
    from kvbench.model.tokenizer import load_tokenizer
    from kvbench.model.weights import peek_config

    validate.integer("--new-tokens", o.new_tokens, 1)
    validate.integer("the number of prompts", len(texts), 1, validate.MAX_BATCH)
    get_cache_spec(o.cache)
    check_compile(o.compile, caches=[o.cache])
    sampler = Sampler(temperature=o.temperature, top_k=o.top_k, seed=o.seed)
    check_draft(o, len(texts))
    tok = load_tokenizer(o.tokenizer)
    ids = [tok.encode(t) for t in texts]
    for i, p in enumerate(ids):
        if not p:
            raise KVBenchError(f"prompt {i + 1} encodes to zero tokens")
    cfg = peek_config(o.model, o.weights)
    longest = max(map(len, ids))
    validate.fits_context("prompt length" if len(ids) == 1 else "longest prompt", longest, o.new_tokens,
                          cfg.block_size, "use a shorter prompt or fewer --new-tokens")  # fmt: skip
    loaded, dev, dt = load_for_cli(o.model, o.weights, o.device, o.dtype, o.seed)
    check_compile(o.compile, dev.type)
    vocab = loaded.config.vocab_size
    for i, p in enumerate(ids):
        if max(p) >= vocab:
            raise KVBenchError(f"prompt {i + 1} has token id {max(p)} >= the model's vocabulary of {vocab}")
    return Prepared(texts, tok, ids, sampler, loaded, dev, dt)


def check_draft(o: GenerateOptions, n_prompts: int) -> None:
    """--draft and its settings: a known method; --draft-tokens and --ngram only with prompt-lookup; prompt-lookup
    only where it runs (one prompt, greedy, eager, a cache that can crop)."""
    from kvbench.decode import speculative

    if o.draft not in speculative.DRAFTS:
        raise KVBenchError(f"--draft {o.draft!r}: use none or prompt-lookup")
    if o.draft == "none":
        for flag, value in (("--draft-tokens", o.draft_tokens), ("--ngram", o.ngram)):
            if value is not None:
                raise KVBenchError(
                    f"{flag} {value} has no effect without --draft prompt-lookup; add it or drop {flag}"
                )
        return
    speculative.check_settings(*draft_settings(o))
    speculative.check_draftable(o.cache, n_prompts, o.temperature, o.compile)


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
    if o.draft == "prompt-lookup":
        k, n = draft_settings(o)
        spec = speculative_generate(
            p.loaded.model, p.ids, o.new_tokens, cache=o.cache, draft_tokens=k, ngram=n,
            stop_token=stop_token, on_token=on_token,
        )  # fmt: skip
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
        self.tok, self.ids, self.shown = tokenizer, [], ""
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
    rows = [
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
