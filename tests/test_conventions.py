"""Conventions every command shares: dtype spellings, one meaning per short option, --new-tokens, exit 3 for memory."""

import json
from collections import defaultdict

import pytest
import typer
from typer.testing import CliRunner

from kvbench import dtypes
from kvbench.bench.settings import load_settings
from kvbench.cli import app
from kvbench.errors import KVBenchError

TINY = ["-m", "gpt2-tiny", "--weights", "random", "--device", "cpu"]


def _commands(group, path="kvbench"):
    """(command path, click command) for every command of the app, nested groups included."""
    for name, cmd in getattr(group, "commands", {}).items():
        yield f"{path} {name}", cmd
        yield from _commands(cmd, f"{path} {name}")


ROOT = typer.main.get_command(app)
COMMANDS = dict(_commands(ROOT))


# --- dtype spellings --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "typed, name",
    [
        ("fp16", "fp16"),
        ("float16", "fp16"),
        ("half", "fp16"),
        ("HALF", "fp16"),
        ("torch.float16", "fp16"),
        ("bf16", "bf16"),
        ("bfloat16", "bf16"),
        ("BFloat16", "bf16"),
        (" torch.bfloat16 ", "bf16"),
        ("fp32", "fp32"),
        ("float32", "fp32"),
        ("float", "fp32"),
        ("Float", "fp32"),
        ("fp8", "fp8"),
        ("float8_e4m3fn", "fp8"),
        ("fp8_e4m3", "fp8"),
        ("int8", "int8"),
        ("INT4", "int4"),
    ],
)
def test_every_spelling_has_one_canonical_name(typed, name):
    assert dtypes.canonical(typed, "--kv-dtype", tuple(dtypes.SPELLINGS)) == name


@pytest.mark.parametrize("typed", ["float64", "double", "fp8_e5m2", "int8", "auto", "", "torch.", "f16"])
def test_an_unknown_dtype_is_one_line_listing_the_spellings(typed):
    with pytest.raises(KVBenchError) as e:
        dtypes.canonical(typed, "--dtype")
    assert str(e.value) == (
        f"unknown --dtype {typed!r}; use fp32 (float32, float), fp16 (float16, half) or bf16 (bfloat16) "
        "(case-insensitive; a torch. prefix is allowed)"
    )


@pytest.mark.parametrize("typed", ["float", "Float32", "torch.float32"])
def test_generate_records_the_canonical_dtype(typed):
    r = CliRunner().invoke(app, ["generate", "hi", *TINY, "--dtype", typed, "-n", "2", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["settings"]["dtype"] == "fp32"


def test_generate_refuses_an_unknown_dtype_in_one_line():
    r = CliRunner().invoke(app, ["generate", "hi", *TINY, "--dtype", "double", "-n", "2"])
    assert r.exit_code == 2, r.output
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: unknown --dtype 'double'; use fp32 (float32, float), fp16 (float16, half)"), line


def test_bench_settings_from_toml_and_command_line_hold_the_canonical_dtype(tmp_path):
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('dtype = "BFloat16"\n')
    assert load_settings(sweep, {}).dtype == "bf16"
    assert load_settings(sweep, {"dtype": "torch.float32"}).dtype == "fp32"
    assert load_settings(None, {"dtype": "half"}).dtype == "fp16"
    assert load_settings(None, {}).dtype == "auto"


def test_memory_records_the_canonical_kv_and_weights_dtypes():
    args = ["memory", "-m", "llama-3-8b", "--ctx", "8k", "--json"]
    r = CliRunner().invoke(app, [*args, "--kv-dtype", "half", "--weights-dtype", "torch.bfloat16"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert (doc["kv_dtype"], doc["weights_dtype"]) == ("fp16", "bf16")
    same = CliRunner().invoke(app, [*args, "--kv-dtype", "fp16", "--weights-dtype", "bf16"])
    assert json.loads(same.stdout) == doc


def test_memory_refuses_an_unknown_kv_dtype_listing_the_spellings():
    r = CliRunner().invoke(app, ["memory", "-m", "llama-3-8b", "--kv-dtype", "fp8_e5m2"])
    assert r.exit_code == 2, r.output
    (line,) = r.stderr.strip().splitlines()
    assert "unknown --kv-dtype 'fp8_e5m2'; use fp32 (float32, float)" in line
    assert "fp8 (fp8_e4m3, float8_e4m3fn), int8 or int4" in line, line


# --- one word, one meaning ----------------------------------------------------------------------------------------------
def test_each_short_option_means_one_long_option_in_every_command():
    meanings = defaultdict(set)
    for path, cmd in COMMANDS.items():
        for p in cmd.params:
            names = [*p.opts, *p.secondary_opts]
            longs = [n for n in names if n.startswith("--")]
            for short in (n for n in names if n.startswith("-") and not n.startswith("--")):
                meanings[short].add((longs[0], path))
    assert {"-m", "-d", "-o", "-n", "-c"} <= set(meanings)  # the walk reaches the options
    clashes = {s: sorted(m) for s, m in meanings.items() if len({long for long, _ in m}) > 1}
    assert not clashes, clashes


def _option(command: str, flag: str):
    return next((p for p in COMMANDS[f"kvbench {command}"].params if flag in p.opts), None)


@pytest.mark.parametrize("command", ["generate", "verify", "break", "bench"])
def test_new_tokens_is_the_same_flag_everywhere(command):
    p = _option(command, "--new-tokens")
    assert p is not None, f"{command} has no --new-tokens"
    assert "-n" in p.opts, p.opts


def test_generate_keeps_max_new_tokens_as_an_alias():
    assert _option("generate", "--max-new-tokens") is _option("generate", "--new-tokens")
    runs = [
        CliRunner().invoke(app, ["generate", "hi", *TINY, flag, "3", "--no-stop", "--json"])
        for flag in ("--new-tokens", "--max-new-tokens", "-n")
    ]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    tokens = [[c["tokens"] for c in json.loads(r.stdout)["completions"]] for r in runs]
    assert [len(t[0]) for t in tokens] == [3, 3, 3] and tokens[0] == tokens[1] == tokens[2]


# --- out of memory: exit 3 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("memory_known", [True, False], ids=["refused up front", "allocation failed"])
def test_a_real_allocation_failure_exits_3_in_one_line(tmp_path, monkeypatch, memory_known):
    """A GPT-2 config within every field's bound whose embedding alone is 10M x 65,536 fp32 = 2.6 TB: refused
    before loading when the memory available is known; where it is not, the CPU allocator refuses it at once
    (nothing is touched). Either way the command ends with one line and exit 3, not 2."""
    if not memory_known:
        monkeypatch.setattr("kvbench.devices.available_memory_bytes", lambda device: None)
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps({"model_type": "gpt2", "vocab_size": 10_000_000, "n_layer": 1, "n_head": 1, "n_embd": 65_536})
    )
    r = CliRunner().invoke(app, ["generate", "hi", "-m", str(cfg), "--weights", "random", "--device", "cpu"])
    assert r.exit_code == 3, r.output
    (line,) = r.stderr.strip().splitlines()
    if memory_known:
        assert "needs about 2636.1 GiB (weights 2633.7 + " in line and "GiB available" in line, line
    else:
        assert line == "error: out of CPU memory (an allocation failed); lower --batch, the lengths or the model"
    assert r.stdout == ""


def test_bad_input_is_still_exit_2():
    r = CliRunner().invoke(app, ["generate", "hi", *TINY, "-n", "0"])
    assert r.exit_code == 2 and "--new-tokens must be >= 1" in r.stderr, r.output
