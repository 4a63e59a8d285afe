"""Hostile and careless input to `kvbench bench`: each case is refused before any work with exit 2, one line on
stderr naming the problem, no traceback, and no run folder (or change to an existing one) left behind."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json

import pytest
from typer.testing import CliRunner

from kvbench.cli import app

TINY = ["--model", "gpt2-tiny", "--weights", "random", "--device", "cpu", "--repeats", "1", "--warmup", "0"]
HUGE = "99999999999999999999"


def _toml(text: str):
    return lambda tmp: _write(tmp / "sweep.toml", text)


def _write(path, text: str):
    path.write_text(text) if isinstance(text, str) else path.write_bytes(text)
    return path


def _earlier_run(tmp):
    run = tmp / "earlier"
    run.mkdir()
    (run / "summary.csv").write_text("engine,cache\nkvbench,none\n")
    (run / "meta.json").write_text(json.dumps({"status": "complete"}))
    return run


def _a_file(tmp):
    return _write(tmp / "a-file", "not a folder")


def _checkpoint_of_another_shape(tmp):
    d = tmp / "ckpt"
    d.mkdir()
    doc = {
        "model_type": "gpt2",
        "n_layer": 3,
        "n_head": 4,
        "n_embd": 64,
        "n_positions": 128,
        "vocab_size": 500,
    }
    _write(d / "config.json", json.dumps(doc))
    return d


# (id, arguments, what the message must name); an argument may be a function of tmp_path (files to point at).
CASES = [
    ("out-empty", ["--out", ""], "--out is empty"),
    ("out-earlier-run", ["--out", _earlier_run], "--force"),
    ("out-is-a-file", ["--out", _a_file], "not a folder"),
    ("out-under-a-file", ["--out", lambda t: _a_file(t) / "run"], "writable"),
    ("engine-empty", ["--engine", ""], "--engine is empty"),
    ("engine-unknown", ["--engine", "vllm"], "unknown engine 'vllm'"),
    (
        "engine-hf-lacks-caches",
        ["--engine", "hf", "--caches", "paged,int8"],
        "engine hf runs none of the caches",
    ),
    ("engine-compiled-lacks-caches", ["--engine", "hf-compiled", "--caches", "none,dynamic"], "runs static"),
    ("caches-empty", ["--caches", ""], "--caches is empty"),
    ("caches-blank", ["--caches", " , "], "--caches is empty"),
    ("cache-unknown", ["--caches", "none,turbo"], "unknown cache 'turbo'"),
    ("prompt-len-zero", ["--prompt-len", "0"], "--prompt-len values must be >= 1"),
    ("prompt-len-negative", ["--prompt-len", "16,-3"], "--prompt-len values must be >= 1"),
    ("prompt-len-float", ["--prompt-len", "3.7"], "whole numbers"),
    ("prompt-len-text", ["--prompt-len", "16,abc"], "whole numbers"),
    ("prompt-len-empty", ["--prompt-len", ","], "--prompt-len is empty"),
    ("prompt-len-huge", ["--prompt-len", HUGE], "context of 1024"),
    ("prompt-len-beyond-context", ["--prompt-len", "16,700", "--new-tokens", "400"], "700 + 400 = 1100"),
    ("new-tokens-one", ["--new-tokens", "1"], "--new-tokens must be >= 2"),
    ("new-tokens-huge", ["--new-tokens", HUGE], "context of 1024"),
    ("batch-zero", ["--batch", "0"], "--batch values must be >= 1"),
    ("batch-negative", ["--batch", "-4"], "--batch values must be >= 1"),
    ("batch-one-of-them-zero", ["--batch", "1,0,4"], "--batch values must be >= 1"),
    ("batch-empty-list", ["--batch", ","], "--batch is empty"),
    ("batch-huge", ["--batch", HUGE], "--batch values must be at most 1,048,576"),
    ("batch-beyond-memory", ["--batch", "1000000", "--prompt-len", "512"], "GiB available; lower --batch (at most"),
    # a list the user gave is named by its first few items and a count, however long it is
    (
        "prompt-len-100k-past-context",
        ["--prompt-len", ",".join(map(str, range(1021, 101_021)))],
        ": 1021 + 4 = 1025, 1022 + 4 = 1026, 1023 + 4 = 1027, 1024 + 4 = 1028, 1025 + 4 = 1029 and 99,995 more; "
        "use --prompt-len <= 1020",
    ),
    (
        "prompt-len-100k-below-one",
        ["--prompt-len", ",".join(map(str, range(0, -100_000, -1)))],
        "--prompt-len values must be >= 1, got 0, -1, -2, -3, -4 and 99,995 more",
    ),
    (
        "batch-100k-below-one",
        ["--batch", ",".join(map(str, range(0, -100_000, -1)))],
        "--batch values must be >= 1, got 0, -1, -2, -3, -4 and 99,995 more",
    ),
    (
        "fill-random-100k-batches",
        ["--fill", "random", "--batch", ",".join(map(str, range(1, 100_001)))],
        "got --batch 1,2,3,4,5 and 99,995 more; run one sweep per batch size",
    ),
    (
        "config-seed-100k-list",
        ["--config", _toml(f"seed = {list(range(100_000))}\n")],
        "seed must be an integer, got [0, 1, 2, 3, 4 and 99,995 more]",
    ),
    (
        "config-unknown-long-key",
        ["--config", _toml("x" * 2_000 + " = 1\n")],
        "x... (2,002 characters); known keys: model,",
    ),
    ("batch-100k-text", ["--batch", "a" * 100_000], "... (100,002 characters) (a k suffix"),
    ("repeats-zero", ["--repeats", "0"], "--repeats must be between 1 and"),
    ("repeats-huge", ["--repeats", HUGE], "--repeats must be between 1 and"),
    ("warmup-negative", ["--warmup", "-1"], "--warmup must be between 0 and"),
    ("threads-zero", ["--threads", "0"], "--threads must be between 1 and"),
    ("seed-negative", ["--seed", "-1"], "--seed must be"),
    ("seed-beyond-64-bits", ["--seed", str(2**64)], "--seed must be"),
    ("batch-not-a-number", ["--batch", "abc"], "batch must be whole numbers, got 'abc'"),
    ("dtype-fp16-on-cpu", ["--dtype", "fp16"], "fp16 on the CPU"),
    ("dtype-unknown", ["--dtype", "fp8"], "unknown --dtype 'fp8'; use fp32 (float32, float), fp16"),
    ("dtype-half-on-cpu", ["--dtype", "half"], "--dtype fp16 on the CPU"),
    ("config-dtype-unknown", ["--config", _toml('dtype = "float64"\n')], "unknown --dtype 'float64'"),
    ("device-empty", ["--device", ""], "--device is empty"),
    ("model-unknown", ["--model", "gpt5"], "unknown model 'gpt5'"),
    (
        "model-disagrees-with-weights",
        ["--weights", _checkpoint_of_another_shape],
        "does not match the checkpoint",
    ),
    ("weights-missing", ["--weights", lambda t: t / "nowhere"], "nowhere not found"),
    ("weights-is-a-file", ["--weights", _a_file], "is not a directory"),
    ("weights-without-config", ["--weights", lambda t: t], "config.json"),
    ("config-missing", ["--config", "nosuch"], "no shipped sweep of that name"),
    ("config-directory", ["--config", lambda t: t], "is a directory"),
    ("config-unknown-key", ["--config", _toml("prompt_lens = [16]\n")], "unknown key 'prompt_lens'"),
    ("config-prompt-len-float", ["--config", _toml("prompt_len = 3.7\n")], "whole numbers, got 3.7"),
    ("config-prompt-len-bool", ["--config", _toml("prompt_len = true\n")], "whole numbers, got True"),
    (
        "config-prompt-len-list-float",
        ["--config", _toml("prompt_len = [16, 2.5]\n")],
        "whole numbers, got 2.5",
    ),
    ("config-new-tokens-float", ["--config", _toml("new_tokens = 2.5\n")], "new_tokens must be an integer"),
    ("config-repeats-bool", ["--config", _toml("repeats = true\n")], "repeats must be an integer"),
    ("config-engine-empty", ["--config", _toml("engine = []\n")], "--engine is empty"),
    ("config-caches-numbers", ["--config", _toml("caches = [1, 2]\n")], "caches must be names"),
    ("config-engine-number", ["--config", _toml("engine = 3\n")], "engine must be names, got 3"),
    ("config-not-toml", ["--config", _toml("prompt_len = [16\n")], "not valid TOML"),
    ("config-not-utf8", ["--config", _toml(b"model = '\xff\xfe'\n")], "not UTF-8"),
    ("prompt-len-bad-suffix", ["--prompt-len", "4m"], "whole numbers"),
    ("prompt-len-fractional-k", ["--prompt-len", "1.5k"], "whole numbers"),
    ("fill-unknown", ["--fill", "zeros"], "--fill 'zeros'"),
    ("order-unknown", ["--order", "zigzag"], "--order 'zigzag'"),
    ("order-interleaved-with-fill-random", ["--fill", "random", "--order", "interleaved"], "prefill sweeps"),
    ("config-order-number", ["--config", _toml("order = 1\n")], "order must be a string"),
    ("fill-random-with-none", ["--fill", "random", "--caches", "none,static"], "drop none from --caches"),
    (
        "allow-env-change-without-baseline",
        ["--allow-env-change"],
        "--allow-env-change applies to --baseline only",
    ),
    ("fill-random-with-hf", ["--fill", "random", "--engine", "kvbench,hf"], "runs only --engine kvbench"),
    ("fill-random-beyond-positions", ["--fill", "random", "--prompt-len", "256,1k"], "use --model gpt2-long"),
    (
        "fill-random-beyond-memory",
        ["--fill", "random", "--model", "gpt2-long", "--prompt-len", "60k", "--batch", "4096"],
        "GiB available",
    ),
    (
        "config-fill-random-with-none",
        ["--config", _toml('fill = "random"\ncaches = ["none"]\n')],
        "drop none",
    ),
]


def _materialise(args: list, tmp_path) -> list[str]:
    return [str(a(tmp_path)) if callable(a) else a for a in args]


# Sweeps too large for the machine: refused up front like bad input, with the out-of-memory exit code
TOO_LARGE = {"batch-beyond-memory", "fill-random-beyond-memory"}


@pytest.mark.parametrize("case, args, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, monkeypatch, case, args, needle):
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)  # the default run folder would be results/<timestamp>-bench/ here
    argv = [*TINY, "--prompt-len", "8", "--new-tokens", "4", *_materialise(args, tmp_path)]
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    result = CliRunner().invoke(app, ["bench", *argv])
    shown = f"exit {result.exit_code}\nstdout: {result.stdout!r}\nstderr: {result.stderr!r}"
    assert result.exit_code == (3 if case in TOO_LARGE else 2), shown
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    assert needle in lines[0], shown
    assert len(lines[0]) < 500, f"a refusal line of {len(lines[0]):,} characters: {lines[0][:1000]}"
    assert "Traceback" not in result.output and not isinstance(result.exception, KeyError | AttributeError), shown
    assert result.stdout == "", shown
    assert not (work / "results").exists(), "a rejected command created a run folder"
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before, "a rejected command changed files"


# --- the run folder is this run's alone ---------------------------------------------------------------------------------
def _held(out):
    """Another bench is writing into `out` right now: it holds the folder and has written its first row."""
    from contextlib import ExitStack

    from kvbench.results import rundir

    stack = ExitStack()
    stack.enter_context(rundir.claimed_run_dir(out, False))
    (out / "summary.csv").write_text("engine,cache\nkvbench,none\n")
    return stack


def _finished(out):
    """Another bench started after this one was validated, wrote its run into `out` and ended."""
    with _held(out):
        pass
    return None


@pytest.mark.parametrize(
    "other, force, needle",
    [
        (_held, False, "is in use by another kvbench bench that is still running"),
        (_held, True, "is in use by another kvbench bench that is still running"),
        (_finished, False, "was written to while this run got ready (it now holds summary.csv)"),
    ],
    ids=["held", "held-with-force", "finished"],
)
def test_a_second_bench_with_the_same_out_is_refused_and_loses_nothing(tmp_path, monkeypatch, other, force, needle):
    """Both commands were validated while --out did not exist; the other one created it first."""
    from kvbench.cli import bench as cli_bench

    out = tmp_path / "run"
    stacks = []
    # the other run claims --out after this one was validated, before it creates the folder
    monkeypatch.setattr(cli_bench, "measure_bandwidth", lambda dev: stacks.append(other(out)))
    argv = [
        *TINY,
        "--prompt-len",
        "8",
        "--new-tokens",
        "4",
        "--out",
        str(out),
        *(["--force"] if force else []),
    ]
    result = CliRunner().invoke(app, ["bench", *argv])
    for stack in stacks:
        if stack is not None:
            stack.close()
    shown = f"exit {result.exit_code}\nstdout: {result.stdout!r}\nstderr: {result.stderr!r}"
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and needle in lines[0], shown
    assert result.stdout == "" and "Traceback" not in result.output, shown
    # the other run's row is intact
    assert (out / "summary.csv").read_text() == "engine,cache\nkvbench,none\n"
    assert sorted(p.name for p in out.iterdir()) == ["summary.csv"]  # its lock is gone with it, nothing added


def test_a_run_folder_is_claimed_once_at_a_time(tmp_path):
    from kvbench.errors import KVBenchError
    from kvbench.results import rundir

    out = tmp_path / "run"
    with rundir.claimed_run_dir(out, False) as p:
        assert p == out and (out / rundir.RUN_LOCK).is_file()
        for force in (False, True):
            with pytest.raises(KVBenchError, match="in use by another kvbench bench"):
                rundir.check_run_dir(str(out), force)
            with pytest.raises(KVBenchError, match="in use by another kvbench bench"):
                with rundir.claimed_run_dir(out, force):
                    pass
    assert list(out.iterdir()) == []  # released: the lock file is gone
    rundir.check_run_dir(str(out), False)  # and the empty folder can be used again
    with rundir.claimed_run_dir(out, False):
        pass


def test_a_run_folder_deleted_mid_run_is_one_line(tmp_path, monkeypatch):
    import shutil

    from kvbench.cli import bench as cli_bench

    out = tmp_path / "run"
    real_update = cli_bench._BenchProgress.update

    def update(self, done, total, label):  # the first run has finished; its row is written next
        if done == 1:
            shutil.rmtree(out)
        real_update(self, done, total, label)

    monkeypatch.setattr(cli_bench._BenchProgress, "update", update)
    argv = [*TINY, *"--engine kvbench --caches none,static --prompt-len 8 --new-tokens 4 --out".split(), str(out)]
    result = CliRunner().invoke(app, ["bench", *argv])
    shown = f"exit {result.exit_code}\nstdout: {result.stdout!r}\nstderr: {result.stderr!r}"
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and lines[-1] == f"error: the run folder disappeared: {out}", shown
    assert len([ln for ln in lines if ln.startswith("error:")]) == 1 and "Traceback" not in result.output, shown
    assert "kvbench bug" not in result.stderr, shown
