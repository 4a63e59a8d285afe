"""`kvbench memory` given bad input: every case is refused before any work with exit code 2, exactly one line on
stderr naming the bad value (and the file and field for a config.json), no traceback, and nothing on stdout."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # a test never reaches the network

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from tiny import LLAMA_JSON

runner = CliRunner()

LLAMA = LLAMA_JSON


def llama(**fields) -> dict:
    return {**LLAMA, **fields}


# Config files a case can name as CFG:<key>: a dict is written as JSON, bytes as they are, None makes a directory.
FILES = {
    "layers-1e9": llama(num_hidden_layers=10**9),
    "layers-1e30": llama(num_hidden_layers=1e30),
    "layers-float-1e9": llama(num_hidden_layers=1e9),
    "layers-2.7": llama(num_hidden_layers=2.7),
    "layers-zero": llama(num_hidden_layers=0),
    "layers-true": llama(num_hidden_layers=True),
    "heads-negative": llama(num_attention_heads=-4),
    "hidden-string": llama(hidden_size="64"),
    "window-string": llama(sliding_window="4096"),
    "kv-heads-0.5": llama(num_key_value_heads=0.5),
    "vocab-huge": llama(vocab_size=10**12),
    "tie-yes": llama(tie_word_embeddings="yes"),
    "model-type-number": llama(model_type=7),
    "layer-types-string": llama(layer_types="full_attention"),
    "layer-types-length": llama(layer_types=["full_attention"] * 3),
    "text-config-layers-2.7": {"model_type": "llava", "text_config": {"model_type": "llama", "num_hidden_layers": 2.7}},
    "text-config-list": {"model_type": "llava", "text_config": [1, 2]},
    "unknown-type-layers-1e9": {**llama(num_hidden_layers=10**9), "model_type": "mystery"},
    "heads-not-multiple": llama(num_attention_heads=4, num_key_value_heads=3),
    "bert": {"model_type": "bert", "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8},
    "array": [1, 2, 3],
    "not-json": b"{nope",
    "empty": b"",
    "non-utf8": b'\xff\xfe{"model_type": "llama"}',
    "latin1": '{"model_type": "llama", "_name_or_path": "caf\xe9"}'.encode("latin-1"),
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "a-directory": None,
    "int-of-5000-digits": b'{"model_type": "llama", "num_hidden_layers": ' + b"9" * 5000 + b"}",
    # hybrid layer stacks (a model type transformers lacks, so the fields are read as written)
    "pattern-letter": {**llama(model_type="mystery"), "hybrid_override_pattern": "M?"},
    "pattern-length": {**llama(model_type="mystery"), "hybrid_override_pattern": "M*M"},
    "period-zero": {**llama(model_type="mystery"), "attn_layer_period": 0},
    "indices-out-of-range": {**llama(model_type="mystery"), "attn_layer_indices": [0, 5]},
    "block-kind": {**llama(model_type="mystery"), "layers_block_type": ["mamba", "quantum"]},
    "layer-kind": {**llama(model_type="mystery"), "layer_types": ["linear_attention", "quantum"]},
}

# (case id, arguments, text the one error line must contain)
CASES = [
    # config.json: sizes bounded before any arithmetic, types checked, one line naming the file and the field
    ("layers 1e9", ["--config", "CFG:layers-1e9"], "num_hidden_layers = 1000000000 must be from 1 to 4,096"),
    ("layers 1e30", ["--config", "CFG:layers-1e30"], "num_hidden_layers = 1e+30 must be a whole number"),
    ("layers float 1e9", ["--config", "CFG:layers-float-1e9"], "num_hidden_layers = 1000000000.0 must be a whole"),
    ("layers 2.7", ["--config", "CFG:layers-2.7"], "num_hidden_layers = 2.7 must be a whole number (float given)"),
    ("layers 0", ["--config", "CFG:layers-zero"], "num_hidden_layers = 0 must be from 1"),
    ("layers true", ["--config", "CFG:layers-true"], "num_hidden_layers = true must be a whole number (true/false"),
    ("heads negative", ["--config", "CFG:heads-negative"], "num_attention_heads = -4 must be from 1"),
    ("hidden string", ["--config", "CFG:hidden-string"], 'hidden_size = "64" must be a whole number (str given)'),
    ("window string", ["--config", "CFG:window-string"], 'sliding_window = "4096" must be a whole number'),
    ("kv heads 0.5", ["--config", "CFG:kv-heads-0.5"], "num_key_value_heads = 0.5 must be a whole number"),
    ("vocab huge", ["--config", "CFG:vocab-huge"], "vocab_size = 1000000000000 must be from 1 to 16,777,216"),
    ("tie yes", ["--config", "CFG:tie-yes"], 'tie_word_embeddings = "yes" must be true or false'),
    ("model_type number", ["--config", "CFG:model-type-number"], "model_type = 7 must be a string"),
    ("layer_types string", ["--config", "CFG:layer-types-string"], "layer_types must be a list of layer type names"),
    ("layer_types length", ["--config", "CFG:layer-types-length"], "must be equal to the number of `layer_types` (3)"),
    ("nested text_config", ["--config", "CFG:text-config-layers-2.7"], "text_config.num_hidden_layers = 2.7"),
    ("text_config list", ["--config", "CFG:text-config-list"], "text_config must be a JSON object"),
    ("fallback reader bounded", ["--config", "CFG:unknown-type-layers-1e9"], "num_hidden_layers = 1000000000"),
    ("kv heads not a divisor", ["--config", "CFG:heads-not-multiple"], "not a multiple of 3 key/value heads"),
    (
        "hybrid pattern letter",
        ["--config", "CFG:pattern-letter"],
        "hybrid_override_pattern has '?', which this planner cannot size",
    ),
    (
        "hybrid pattern length",
        ["--config", "CFG:pattern-length"],
        "hybrid_override_pattern lists 3 layers, the model has 2",
    ),
    (
        "attention period 0",
        ["--config", "CFG:period-zero"],
        "attn_layer_period 0 / attn_layer_offset 0 are not a layer pattern",
    ),
    (
        "attention index 5 of 2",
        ["--config", "CFG:indices-out-of-range"],
        "attn_layer_indices must be a list of layer indices below 2",
    ),
    (
        "unknown block kind",
        ["--config", "CFG:block-kind"],
        "layers_block_type contains 'quantum', which this planner cannot size",
    ),
    (
        "unknown layer kind",
        ["--config", "CFG:layer-kind"],
        "layer_types contains 'quantum', which this planner cannot size",
    ),
    ("encoder", ["--config", "CFG:bert"], "model_type 'bert' is not a decoder-only LLM"),
    ("JSON array", ["--config", "CFG:array"], "expected a JSON object"),
    ("not JSON", ["--config", "CFG:not-json"], "is not valid JSON"),
    ("empty file", ["--config", "CFG:empty"], "is not valid JSON"),
    ("non-UTF-8", ["--config", "CFG:non-utf8"], "is not UTF-8 text"),
    ("latin-1", ["--config", "CFG:latin1"], "is not UTF-8 text"),
    ("nested too deep", ["--config", "CFG:deep"], "nested too deeply"),
    ("a directory", ["--config", "CFG:a-directory"], "is a directory, not a file; give the config.json file inside it"),
    ("a device", ["--config", "/dev/zero"], "--config /dev/zero is not a regular file"),
    ("5000-digit number", ["--config", "CFG:int-of-5000-digits"], "is not valid JSON (Exceeds the limit"),
    ("--ctx with 300 lengths", ["-m", "llama-3-8b", "--ctx", ",".join(map(str, range(1, 301)))], "at most 256"),
    ("missing file", ["--config", "CFG:nowhere"], "file not found"),
    ("path with markup", ["--config", "CFG:[/]x[bold]y.json"], "[/]x[bold]y.json: file not found"),
    # names and sizes on the command line
    ("empty --gpu", ["-m", "llama-3-8b", "--gpu", ""], "--gpu is empty"),
    ("unknown gpu", ["-m", "llama-3-8b", "--gpu", "[/]"], "unknown GPU '[/]'"),
    ("--gpu-mem without unit", ["-m", "llama-3-8b", "--gpu-mem", "80"], "--gpu-mem '80' has no unit: write 80GiB"),
    ("empty --gpu-mem", ["-m", "llama-3-8b", "--gpu-mem", ""], "cannot read --gpu-mem ''"),
    ("--gpu-mem nan", ["-m", "llama-3-8b", "--gpu-mem", "nanGiB"], "cannot read --gpu-mem 'nanGiB'"),
    ("--gpu-mem zero", ["-m", "llama-3-8b", "--gpu-mem", "0GiB"], "must be positive"),
    ("--gpu-mem huge", ["-m", "llama-3-8b", "--gpu-mem", "99999999999TiB"], "more than 2^60 bytes"),
    ("--overhead 150%", ["-m", "llama-3-8b", "--gpu", "h100", "--overhead", "150%"], "between 0% and 100%"),
    ("--overhead nan%", ["-m", "llama-3-8b", "--gpu", "h100", "--overhead", "nan%"], "between 0% and 100%"),
    ("--overhead bare", ["-m", "llama-3-8b", "--gpu", "h100", "--overhead", "4"], "--overhead '4' has no unit"),
    ("--overhead alone", ["-m", "llama-3-8b", "--overhead", "5%"], "--overhead goes with --gpu or --gpu-mem"),
    ("empty --model", ["-m", ""], "--model is empty"),
    ("model with markup", ["-m", "llama[/]3"], "unknown model 'llama[/]3'"),
    ("model with emoji code", ["-m", ":smile:"], "unknown model ':smile:'"),
    ("empty --ctx", ["-m", "llama-3-8b", "--ctx", ""], "--ctx is empty"),
    ("--ctx 1e9", ["-m", "llama-3-8b", "--ctx", "1e9"], "cannot read context length '1e9'"),
    ("--ctx huge", ["-m", "llama-3-8b", "--ctx", "99999999999999999999"], "is more than 1,099,511,627,776 tokens"),
    ("--ctx with a zero", ["-m", "llama-3-8b", "--ctx", "2m,0"], "context length '0' must be at least 1 token"),
    ("--batch 0", ["-m", "llama-3-8b", "--batch", "0"], "--batch 0 must be from 1"),
    ("--batch huge", ["-m", "llama-3-8b", "--batch", "99999999999"], "--batch 99999999999 must be from 1 to"),
    ("--batch not a number", ["-m", "llama-3-8b", "--batch", "abc"], "cannot read --batch 'abc'"),
    ("--tp 0", ["-m", "llama-3-8b", "--tp", "0"], "--tp 0 must be at least 1"),
    ("--tp 3", ["-m", "llama-3-8b", "--tp", "3"], "not divisible by 3"),
    ("--kv-dtype empty", ["-m", "llama-3-8b", "--kv-dtype", ""], "unknown --kv-dtype ''"),
    ("--weights-dtype int3", ["-m", "llama-3-8b", "--weights-dtype", "int3"], "unknown --weights-dtype 'int3'"),
    # options that would be ignored, refused instead
    ("--lengths without --measure", ["-m", "gpt2", "--lengths", "10,20"], "--lengths goes with --measure"),
    ("--from without --copy-traffic", ["-m", "gpt2", "--from", "5"], "--from and --to go with --copy-traffic"),
    ("--device on a plan", ["-m", "llama-3-8b", "--device", "cpu"], "--device goes with --measure or --copy-traffic"),
    ("--gpu with --measure", ["-m", "gpt2", "--measure", "--gpu", "h100"], "--gpu sizes a plan"),
    ("--check with --all", ["--all", "--check"], "name them with --model or --config"),
    ("--check with --measure", ["-m", "gpt2", "--measure", "--check"], "--check checks a plan"),
    ("--check int4", ["-m", "llama-3-8b", "--check", "--kv-dtype", "int4"], "--kv-dtype int4 has no counterpart"),
    ("--all with --model", ["--all", "-m", "gpt2"], "not both"),
    ("no model", [], "name a model"),
    # --copy-traffic ranges
    ("--from > --to", ["-m", "gpt2", "--copy-traffic", "--from", "10", "--to", "5"], "need 0 <= from < to"),
    ("--to huge", ["-m", "gpt2", "--copy-traffic", "--to", "99999999999999"], "--to 99999999999999 is more than"),
    # --measure and --lengths: every value checked before the first table
    ("--lengths 0", ["-m", "gpt2", "--measure", "--lengths", "0"], "--lengths value '0' must be at least 1 token"),
    ("--lengths text", ["-m", "gpt2", "--measure", "--lengths", "ten"], "cannot read --lengths value 'ten'"),
    ("--lengths empty", ["-m", "gpt2", "--measure", "--lengths", ""], "--lengths is empty"),
    ("--lengths > --ctx", ["-m", "gpt2", "--measure", "--ctx", "64", "--lengths", "10,100"], "longer than --ctx 64"),
    ("--lengths too many tokens", ["-m", "gpt2", "--measure", "--lengths", "40000,40000"], "adds up to 80,000"),
    ("--measure too big", ["-m", "gpt2", "--measure", "--ctx", "1m", "--batch", "100000"], "lower --batch or --ctx"),
    ("--measure non-gpt2", ["-m", "llama-3-8b", "--measure"], "gpt2-family model"),
    ("--measure int4", ["-m", "gpt2", "--measure", "--kv-dtype", "int4"], "--measure allocates real torch caches"),
]


def _write(tmp_path, key: str):
    path = tmp_path / key if key.endswith(".json") else tmp_path / f"{key}.json"
    content = FILES.get(key, "absent")
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content != "absent":
        path.write_text(json.dumps(content))
    return str(path)


TOO_LARGE = {"--measure too big"}  # refused up front like bad input, with the out-of-memory exit code 3


@pytest.mark.parametrize("case, args, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case, args, message):
    argv = [_write(tmp_path, a[4:]) if a.startswith("CFG:") else a for a in args]
    r = runner.invoke(app, ["memory", *argv])
    assert r.exit_code == (3 if case in TOO_LARGE else 2), (r.exit_code, r.output)
    assert r.stdout == "", r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]


def test_config_errors_name_the_file(tmp_path):
    path = _write(tmp_path, "layers-2.7")
    r = runner.invoke(app, ["memory", "--config", path])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: {path}: num_hidden_layers"), r.stderr


def test_huge_config_file_is_refused_unread(tmp_path):
    path = tmp_path / "config.json"
    with open(path, "wb") as f:
        f.truncate(17 * 2**20)  # sparse: no 17 MiB written
    r = runner.invoke(app, ["memory", "--config", str(path)])
    assert r.exit_code == 2 and "is 17 MiB, more than the 16 MiB a config.json may be" in r.stderr, r.stderr


def test_user_text_is_printed_literally(tmp_path):
    """Brackets and :emoji: codes in names, sources and paths come out as typed."""
    cfg = {**LLAMA, "model_type": "mystery", "_name_or_path": "org/[/]model[bold]:smile:"}
    path = tmp_path / "[red]config[bold].json"
    path.write_text(json.dumps(cfg))
    r = runner.invoke(app, ["memory", "--config", str(path), "--ctx", "128"])
    assert r.exit_code == 0, r.output
    assert "org/[/]model[bold]:smile:" in r.stdout and "[red]config[bold].json" in r.stdout


def test_gpu_memory_beyond_any_need_says_how_far_it_searched():
    r = runner.invoke(app, ["memory", "-m", "llama-3-8b", "--ctx", "8k", "--gpu-mem", "1000000TiB", "--json"])
    assert r.exit_code == 0, r.output
    row = json.loads(r.stdout)["plans"][0]["rows"][0]
    assert row["max_ctx_at_limit"] and not row["max_ctx_unbounded"] and row["max_ctx"] == 2**40
    r = runner.invoke(app, ["memory", "-m", "llama-3-8b", "--ctx", "8k", "--gpu-mem", "1000000TiB"])
    text = " ".join(r.stdout.split())
    assert ">= 1,099,511,627,776 (searched up to 1,099,511,627,776)" in text and "all layers windowed" not in text


# Values transformers' own config classes cannot digest: whatever they raise, the file is refused in one line.
THIRD_PARTY_CONFIGS = {
    "jamba attn_layer_period 0": (
        {
            "model_type": "jamba",
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "attn_layer_period": 0,
            "attn_layer_offset": 1,
        },
        "jamba config class rejects it: ZeroDivisionError",
    ),
    "qwen3_next full_attention_interval 0": (
        {
            "model_type": "qwen3_next",
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "full_attention_interval": 0,
        },
        "qwen3_next config class rejects it: ZeroDivisionError",
    ),
    "xlstm qk_dim_factor NaN": (
        {"model_type": "xlstm", "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4, "qk_dim_factor": "NaN"},
        "cannot derive qk_head_dim from this config: ValueError",
    ),
    "llama with a text_config dict": (
        {
            "model_type": "llama",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "text_config": {"hidden_size": 32},
        },
        "no num_hidden_layers",
    ),
}


@pytest.mark.parametrize("case", list(THIRD_PARTY_CONFIGS))
def test_what_transformers_config_classes_raise_is_one_line(tmp_path, case):
    doc, message = THIRD_PARTY_CONFIGS[case]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc).replace('"NaN"', "NaN"))
    r = runner.invoke(app, ["memory", "--config", str(path), "--ctx", "1k"])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.output, r.stderr


def test_a_vision_config_kept_as_a_dict_is_read_as_it_is(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "vision_config": {"hidden_size": 32},
            }
        )
    )
    r = runner.invoke(app, ["memory", "--config", str(path), "--ctx", "1k"])
    assert r.exit_code == 0, r.output
    assert "vision tower" in r.output
