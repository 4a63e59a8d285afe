"""Options are declared once (a settings dataclass's field) and each rule lives in one place (validate.py, or beside
the registry or settings it reads: decode/rules.py, bench/rules.py, memory/request.py): every command's parameters
are its settings' option fields, and one bound serves every command that shares its meaning."""

import dataclasses

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from kvbench import validate
from kvbench.cli import app
from kvbench.options import flag_of

TINY = ["-m", "gpt2-tiny", "--weights", "random", "--device", "cpu"]


def _commands():
    group = get_command(app)
    return {name: group.commands[name] for name in group.commands}


def test_every_command_takes_exactly_its_settings_option_fields():
    from kvbench.bench.endpoint_settings import EndpointOptions
    from kvbench.bench.settings import BenchSettings
    from kvbench.cli.bench import BenchOptions
    from kvbench.cli.break_ import BreakOptions
    from kvbench.cli.compare import CompareOptions
    from kvbench.cli.generate import GenerateOptions
    from kvbench.cli.schema import SchemaOptions
    from kvbench.cli.serve import ServeOptions
    from kvbench.cli.verify import VerifyOptions
    from kvbench.memory.request import Options as MemoryOptions

    sources = {
        "generate": [GenerateOptions],
        "verify": [VerifyOptions],
        "break": [BreakOptions],
        "bench": [BenchSettings, BenchOptions, EndpointOptions],
        "memory": [MemoryOptions],
        "compare": [CompareOptions],
        "schema": [SchemaOptions],
        "serve": [ServeOptions],
    }
    commands = _commands()
    assert set(commands) == set(sources)
    for name, classes in sources.items():
        declared = {f.name for cls in classes for f in dataclasses.fields(cls) if flag_of(f) is not None}
        params = {p.name for p in commands[name].params}
        assert params == declared, (name, params ^ declared)


def test_bench_settings_are_typed_from_their_fields_for_toml_and_the_command_line(tmp_path):
    from kvbench.bench.settings import load_settings

    toml = tmp_path / "s.toml"
    toml.write_text('prompt_len = [8, 16]\nbatch = 2\ncaches = "none,static"\nrepeats = 2\nprofile = true\n')
    s = load_settings(toml, {"prompt_len": "1k", "engine": "kvbench"})
    assert (s.prompt_len, s.batch, s.caches, s.engine, s.repeats, s.profile) == (
        [1024],
        [2],
        ["none", "static"],
        ["kvbench"],
        2,
        True,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "hi", "-n", "2"],
        ["verify", "--caches", "dynamic", "--prompt-len", "3", "-n", "2", "--reference", "none"],
    ],
    ids=["generate", "verify"],
)
def test_the_largest_seed_torch_takes_is_accepted_by_every_command(args):
    r = CliRunner().invoke(app, [*args, *TINY, "--seed", str(validate.SEED_MAX)])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("command", ["generate", "verify", "bench"])
def test_one_seed_bound_for_every_command(command, tmp_path):
    args = {
        "generate": ["generate", "hi"],
        "verify": ["verify"],
        "bench": ["bench", "--out", str(tmp_path / "b")],
    }
    r = CliRunner().invoke(app, [*args[command], *TINY, "--seed", str(validate.SEED_MAX + 1)])
    assert r.exit_code == 2 and f"--seed must be <= {validate.SEED_MAX:,}" in r.stderr, r.output


@pytest.mark.parametrize(
    "args, bound",
    [
        (["verify", "--batch", str(validate.MAX_RUN_BATCH + 1)], validate.MAX_RUN_BATCH),
        (["break", "all", "--batch", str(validate.MAX_RUN_BATCH + 1)], validate.MAX_RUN_BATCH),
        (["bench", "--batch", str(validate.MAX_RUN_BATCH + 1)], validate.MAX_RUN_BATCH),
        (
            ["memory", "-m", "llama-3-8b", "--batch", str(validate.MAX_PLAN_BATCH + 1)],
            validate.MAX_PLAN_BATCH,
        ),
    ],
    ids=["verify", "break", "bench", "memory"],
)
def test_one_batch_bound_per_meaning(args, bound):
    extra = [] if args[0] == "memory" else TINY
    r = CliRunner().invoke(app, [*args, *extra])
    assert r.exit_code == 2 and f"{bound:,}" in r.stderr, r.output
