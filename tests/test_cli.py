"""The CLI through Typer's CliRunner: help, version, generate --json, and every bad input of the foundation."""

import json

import pytest
import torch
from typer.testing import CliRunner

from kvbench import __version__
from kvbench.cli import app

runner = CliRunner()
TINY = ["--model", "gpt2-tiny", "--weights", "random"]


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_help_lists_the_five_subcommands():
    r = run("--help")
    assert r.exit_code == 0, r.output
    for cmd in ("generate", "verify", "break", "bench", "memory"):
        assert cmd in r.output


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and __version__ in r.output


def test_generate_json(ranks_file):
    r = run(
        "generate",
        "The key to fast inference is",
        "-n",
        12,
        *TINY,
        "--tokenizer",
        ranks_file,
        "--json",
        "--no-stop",
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    c = doc["completions"][0]
    assert c["prompt_tokens"] == 6 and len(c["tokens"]) == 12
    assert doc["settings"]["weights"].startswith("random(") and doc["settings"]["random_weights"] is True
    assert doc["settings"]["cache"] == "dynamic" and doc["cache"]["bytes"] > 0
    assert doc["timings"]["ttft_ms"] > 0 and doc["timings"]["tpot_ms_median"] > 0


def test_generate_batch_equals_solo_runs(ranks_file):
    """A batch of prompts of different lengths, decoded together, gives each prompt's solo tokens."""
    prompts = ["Hello", "The key to fast inference is to cache", "KV caches"]
    args = [
        "-n",
        10,
        "--model",
        "gpt2-tiny",
        "--weights",
        "random",
        "--tokenizer",
        ranks_file,
        "--json",
        "--no-stop",
    ]
    flags = [x for p in prompts for x in ("--prompt", p)]
    for cache in ("dynamic", "static"):
        r = run("generate", *flags, *args, "--cache", cache)
        assert r.exit_code == 0, r.output
        batch = [c["tokens"] for c in json.loads(r.stdout)["completions"]]
        solo = [
            json.loads(run("generate", p, *args, "--cache", cache).stdout)["completions"][0]["tokens"] for p in prompts
        ]
        assert batch == solo, cache


def test_generate_prompts_file_and_sampling(ranks_file, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("one prompt\n\nanother prompt here\n")
    r = run(
        "generate",
        "--prompts-file",
        f,
        "-n",
        5,
        *TINY,
        "--tokenizer",
        ranks_file,
        "--json",
        "--temperature",
        0.8,
        "--top-k",
        20,
        "--seed",
        3,
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert len(doc["completions"]) == 2 and doc["settings"]["top_k"] == 20


def test_generate_streams_text_and_summary(ranks_file):
    r = run("generate", "Hello", "-n", 5, *TINY, "--tokenizer", ranks_file, "--no-stop")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Hello") and "median time per output token" in r.output


BAD = {
    "context": (["generate", "hi", "-n", 1500], "exceeds the model's context of 1,024"),
    "unknown model": (["generate", "hi", "--model", "gpt3"], "unknown model 'gpt3'"),
    "unknown cache": (["generate", "hi", "--cache", "magic"], "unknown cache 'magic'; known caches: none"),
    "weights path": (["generate", "hi", "--weights", "/no/such/dir"], "weights path /no/such/dir not found"),
    "empty prompt": (["generate", "   "], "prompt 1 is empty"),
    "no prompt": (["generate"], "no prompt given"),
    # b"hi\xff\xfe" on the command line: Python's argv holds the bytes as lone surrogates
    "not utf-8": (["generate", "hi\udcff\udcfe"], "prompt 1 is not UTF-8 text (character 3)"),
    "fp16 cpu": (["generate", "hi", "--device", "cpu", "--dtype", "fp16"], "fp16 on the CPU"),
    "bad dtype": (["generate", "hi", "--dtype", "fp8"], "unknown --dtype 'fp8'"),
    "bad top-k": (["generate", "hi", "--top-k", "0"], "--top-k must be >= 1"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_nonzero(case, ranks_file):
    args, message = BAD[case]
    extra = [] if "--model" in args or "--weights" in args else ["--model", "gpt2-tiny"]
    r = run(*args, *extra, "--tokenizer", ranks_file)
    assert r.exit_code == 2, r.output
    assert message in r.output, r.output
    assert "Traceback" not in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda(ranks_file):
    r = run("generate", "hi", "--device", "cuda", *TINY, "--tokenizer", ranks_file)
    assert r.exit_code == 2 and "CUDA is not available" in r.output, r.output


def test_weights_not_gpt2(tmp_path, ranks_file):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    r = run("generate", "hi", "--weights", tmp_path, "--tokenizer", ranks_file)
    assert r.exit_code == 2 and "is not a GPT-2 config" in r.output and str(tmp_path) in r.output, r.output


def test_tokenizer_missing_and_malformed(tmp_path):
    r = run("generate", "hi", *TINY, "--tokenizer", tmp_path / "none.tiktoken")
    assert r.exit_code == 2 and "--tokenizer " in r.output and "none.tiktoken: file not found" in r.output, r.output
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("garbage\n")
    r = run("generate", "hi", *TINY, "--tokenizer", bad)
    assert r.exit_code == 2 and "malformed tokenizer file" in r.output, r.output


def test_every_help_text_reads_as_written():
    """Typer renders help as Rich markup, so a bracket is a style tag unless escaped: `kvbench[ct2]` in --engine's
    help printed as `kvbench`, the extra's name eaten. Every command's and option's help, rendered, must say what its
    source says (an escaped `\\[` is a literal bracket)."""
    import typer
    from rich.text import Text

    eaten = []

    def walk(command, path: str) -> None:
        texts = [("help", command.help or "")] + [(p.name, getattr(p, "help", None) or "") for p in command.params]
        for name, text in texts:
            if Text.from_markup(text).plain != text.replace("\\[", "["):
                eaten.append(f"{path} {name}: {text[:60]!r}")
        for sub_name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{path} {sub_name}")

    walk(typer.main.get_command(app), "kvbench")
    assert not eaten, eaten


def test_an_interrupted_stream_ends_its_line_before_the_error(monkeypatch):
    """Ctrl-C while a completion streams: the streamed line is ended, so `error: interrupted` starts its own line
    in the terminal instead of being glued to the text."""
    from kvbench.cli.generate import TextStream

    real_push = TextStream.push

    def push(self, ids):
        real_push(self, ids)
        if len(self.ids) == 2:  # Ctrl-C as the second token arrives
            raise KeyboardInterrupt

    monkeypatch.setattr(TextStream, "push", push)
    r = run("generate", "Once upon a time", "-n", 8, "--no-stop", *TINY)
    assert r.exit_code == 130 and "interrupted" in r.stderr, r.output
    assert r.stdout.startswith("Once upon a time") and r.stdout.endswith("\n") and r.stdout.count("\n") == 1


def test_each_commands_help_is_paragraphs_for_rich_to_wrap():
    """Typer keeps a docstring's line breaks after its first paragraph; at 100 columns Rich then left fragments
    ('Face causal', 'LM, in the same rows') on lines of their own."""
    from kvbench.cli.app import app as the_app

    helps = {c.name or c.callback.__name__: c.help for c in the_app.registered_commands}
    assert len(helps) >= 8 and all(helps.values())
    for name, text in helps.items():
        assert all("\n" not in p and p == p.strip() for p in text.split("\n\n")), (name, text)
    assert "on any Hugging Face causal LM, in the same rows" in helps["bench"]


def test_piped_help_is_laid_out_wide_not_cut(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TERMINAL_WIDTH", "COLUMNS")}
    out = subprocess.run(
        [sys.executable, "-m", "kvbench", "generate", "--help"], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert "--new-tokens,--max-new-tokens" in out and "…" not in out
    env["TERMINAL_WIDTH"] = "80"  # Typer's own setting still wins
    out = subprocess.run(
        [sys.executable, "-m", "kvbench", "generate", "--help"], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert max(len(line) for line in out.splitlines()) <= 80


def test_generate_on_kvbench_weights_never_imports_transformers():
    """transformers takes about a second to import and another to exit here: `generate`, which runs kvbench's own
    model, reads check.verify's memory rule only, and that module keeps transformers' import for the reference."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.argv = ['kvbench', 'generate', '-m', 'gpt2-tiny', '-w', 'random', '-n', '2', '--device', 'cpu', "
        "'--json', 'hi']\n"
        "from kvbench.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "print('transformers' in sys.modules, file=sys.stderr)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(r.stdout)["completions"] and r.stderr.strip().splitlines()[-1] == "False", r.stderr


def test_compare_reads_host_facts_without_torch():
    """compare reads two runs' CSVs and meta.json: the cores rule it shares with bench lives where torch is not."""
    import subprocess
    import sys

    code = "import sys, kvbench.cli.compare, kvbench.results.compare; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
