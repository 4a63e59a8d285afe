"""`kvbench verify --text FILE`: the text read and tokenized, its window checked, and its figure written.

The text rows themselves are check/text.py's; this module is the edge around them: which file (the bundled held-out
passage by default for a bundled checkpoint), which tokenizer (GPT-2's BPE for our GPT-2, the model's own with
--hf), every bad input one line before any model is loaded, and the KL-by-depth PNG once the report is back.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbench.errors import KVBenchError

if TYPE_CHECKING:
    from kvbench.model.gpt2 import GPTConfig

NO_TEXT = "none"
PLOT_NAME = "text-kld.png"


def text_path(o: Any) -> str | None:
    """The file --text names; for a bundled checkpoint without --text (`-m gpt2-shakespeare` with its weights, or
    `--hf gpt2-shakespeare`), its held-out passage, where text is scored at all (one process, no --endpoint); None
    for no text."""
    from kvbench.hf.models import bundled_source
    from kvbench.resources import BUNDLED_MODELS, TEMPEST_HELDOUT

    if o.text is not None:
        return None if o.text == NO_TEXT else o.text
    bundled = o.model in BUNDLED_MODELS and o.weights == "auto" if o.hf is None else bundled_source(o.hf)
    if bundled and o.endpoint is None and o.tp == 1:
        return str(TEMPEST_HELDOUT)
    return None


def text_rules(o: Any) -> None:
    """--text, --window and --plot together, before any work: the options that need --text given without one, a
    window too small, a plot path that is a folder, --text under --tp or --endpoint."""
    from kvbench.outputs import output_kind

    on = text_path(o) is not None
    for flag, given in (("--window", o.window is not None), ("--plot", o.plot is not None)):
        if given and not on:
            raise KVBenchError(f"{flag} goes with --text FILE (the text scored through every cache); add --text")
    if not on:
        return
    if o.tp != 1:
        raise KVBenchError("--text runs in one process: drop --tp, or --text (verify --tp checks each rank's slice)")
    if o.endpoint is not None:
        raise KVBenchError("--text scores a model kvbench runs itself; with --endpoint drop --text")
    if o.window is not None and o.window < 2:
        raise KVBenchError(f"--window {o.window}: a window needs at least 2 tokens (one read, one predicted)")
    if o.plot is not None:
        if not o.plot.strip():
            raise KVBenchError("--plot is empty; give a file path for the PNG, e.g. text-kld.png")
        output_kind(Path(o.plot).expanduser(), "--plot")


def _window(o: Any, context: int | None, n: int, model: str) -> int:
    """--window, or the model's context (the whole text where the model states none), checked against the context."""
    if o.window is None:
        return context if context is not None else n
    if context is not None and o.window > context:
        raise KVBenchError(f"--window {o.window} is longer than {model}'s context of {context} tokens; lower --window")
    return o.window


def gpt2_text(o: Any, cfg: GPTConfig) -> tuple[tuple[list[int], int] | None, dict]:
    """Our GPT-2's text: GPT-2's BPE over the file, the window; and what the JSON says of them."""
    from kvbench.check.text import read_text_tokens
    from kvbench.model.tokenizer import load_tokenizer

    path = text_path(o)
    if path is None:
        return None, {}
    tok = load_tokenizer()
    if cfg.vocab_size <= tok.eot_id:
        raise KVBenchError(
            f"--text tokenizes with GPT-2's BPE (ids up to {tok.eot_id}); {cfg.name} has a vocabulary of "
            f"{cfg.vocab_size:,}: use a GPT-2 model, or --hf with a model that has its own tokenizer"
        )
    ids = read_text_tokens(path, tok.encode)
    return (ids, _window(o, cfg.block_size, len(ids), cfg.name)), {
        "file": path,
        "tokenizer": f"GPT-2 BPE ({tok.source})",
    }


def hf_text_tokens(o: Any) -> tuple[list[int], str] | None:
    """--hf's text: the model's own tokenizer (AutoTokenizer from the same source) over the file, before the model
    is loaded; None without --text."""
    from kvbench import files
    from kvbench.check.text import read_text_tokens

    path = text_path(o)
    if path is None:
        return None
    files.read_text(path, f"--text {path}", files.PROMPTS_BYTES, "a text file")  # a bad file before the tokenizer
    from kvbench.hf.models import bundled_source

    if bundled_source(o.hf):  # trained with GPT-2's BPE, which kvbench ships (the folder holds weights only)
        from kvbench.model.tokenizer import load_tokenizer

        bpe = load_tokenizer()
        return read_text_tokens(path, bpe.encode), f"GPT-2 BPE ({bpe.source})"
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(o.hf, trust_remote_code=o.trust_remote_code)
    except Exception as e:  # transformers raises many types for "no tokenizer here"
        why = " ".join(str(e).split())[:160] or type(e).__name__
        raise KVBenchError(f"--text needs the model's tokenizer, and {o.hf} has none that loads ({why})") from None
    if tok.vocab_size == 0:  # transformers 5.x builds an empty tokenizer for a folder without vocabulary files
        raise KVBenchError(
            f"--text needs the model's tokenizer, and {o.hf} has none: {type(tok).__name__} loaded with an empty "
            "vocabulary (no tokenizer files beside the weights)"
        )
    ids = read_text_tokens(path, lambda t: list(tok(t, add_special_tokens=False)["input_ids"]))
    return ids, f"{type(tok).__name__} from {o.hf}"


def hf_text(o: Any, tokens: tuple[list[int], str] | None, loaded: Any) -> tuple[tuple[list[int], int] | None, dict]:
    """The window for --hf's text, from the loaded model's context; ids past its vocabulary refused."""
    if tokens is None:
        return None, {}
    ids, source = tokens
    vocab = loaded.info.vocab_size
    if max(ids) >= vocab:
        raise KVBenchError(
            f"--text: {source} gives token id {max(ids):,}, past the model's vocabulary of {vocab:,}; the tokenizer "
            "does not belong to this model"
        )
    window = _window(o, loaded.info.context, len(ids), loaded.label)
    return (ids, window), {"file": text_path(o), "tokenizer": source}


def text_plot(report: Any, meta: dict, plot: str | None) -> str | None:
    """The KL-by-depth PNG of the report's lossy caches, at --plot or in a new results/<timestamp>-verify/; None
    (nothing written) when no lossy cache was scored."""
    lossy = {c: d for c, d in report.text.get("caches", {}).items() if not d.get("exact") and d.get("by_depth")}
    if not lossy:
        return None
    from kvbench.results.distortion_plot import text_figure
    from kvbench.results.rundir import prepare_run_dir, unique_default_run_dir

    path = Path(plot).expanduser() if plot else prepare_run_dir(unique_default_run_dir("verify")) / PLOT_NAME
    title = f"{meta['model']} ({meta['weights']}), {meta['dtype']}: {Path(str(meta['text']['file'])).name}"
    text_figure(lossy, report.text, title, path)
    return str(path)
