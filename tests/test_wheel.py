"""A plain (non-editable) install works from any folder: the wheel carries the presets, the GPU list, the bench
sweeps and GPT-2's ranks, and every command runs from a temporary folder with no source tree in sight."""

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from kvbench.jsonio import KINDS

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # builds a wheel and runs kvbench in fresh Pythons: a minute on two cores


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The project built as a wheel and installed alone into a fresh venv (dependencies borrowed from this one)."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist", ROOT],
        check=True,
        capture_output=True,
        cwd=tmp,
    )
    (wheel,) = (tmp / "dist").glob("kvbench-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", site, wheel],
        check=True,
        capture_output=True,
    )
    # torch, transformers, ... from this environment, after the wheel's own kvbench on the path.
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp / "elsewhere"
    work.mkdir()
    return wheel, py, work


def kvbench(installed, *args, timeout=240):
    _, py, work = installed
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBENCH_", "PYTHONPATH"))}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run(
        [py, "-m", "kvbench", *map(str, args)], cwd=work, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_wheel_ships_configs_and_ranks(installed):
    wheel, _, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in (
        "configs/models.toml",
        "configs/gpus.toml",
        "configs/bench/seed.toml",
        "configs/bench/quick.toml",
        "data/gpt2.tiktoken",
        "data/README.md",
        "data/gpt2-shakespeare/config.json",
        "data/gpt2-shakespeare/model.safetensors",
        "data/tempest-heldout.txt",
        *(f"schemas/{k}.json" for k in KINDS),
    ):
        assert f"kvbench/{f}" in names, f


def test_installed_kvbench_is_the_wheel_not_the_source_tree(installed):
    _, py, work = installed
    r = subprocess.run(
        [py, "-c", "import kvbench; print(kvbench.__file__)"],
        cwd=work,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
    )
    assert str(ROOT / "src") not in r.stdout and "site-packages" in r.stdout, r.stdout + r.stderr


def test_memory_from_any_folder(installed):
    r = kvbench(installed, "memory", "--model", "llama-3-8b", "--ctx", "8k", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["plans"][0]
    assert plan["bytes_per_token"] == 2 * 32 * 8 * 128 * 2  # 128 KiB/token in fp16


def test_generate_with_the_bundled_tokenizer(installed):
    r = kvbench(installed, "generate", "Hello world", *"-n 3 -m gpt2-tiny --weights random --device cpu --json".split())
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["settings"]["tokenizer"] == "bundled:gpt2.tiktoken"
    assert doc["completions"][0]["prompt_tokens"] == 2  # "Hello world" = [15496, 995]


def test_generate_with_the_bundled_checkpoint(installed):
    r = kvbench(installed, "generate", "ROMEO:", "-m", "gpt2-shakespeare", "-d", "cpu", "-n", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["settings"]["weights"] == "bundled:gpt2-shakespeare"


def test_bench_config_by_name(installed):
    _, _, work = installed
    r = kvbench(
        installed,
        *"bench --config quick -m gpt2-tiny --prompt-len 8 --new-tokens 3 --caches none,static".split(),
        *"--engine kvbench --repeats 1 --threads 1 --out".split(),
        work / "run",
    )
    assert r.returncode == 0, r.stderr
    assert (work / "run" / "summary.csv").read_text().count("\nkvbench,") == 2
    assert json.loads((work / "run" / "meta.json").read_text())["config_file"].endswith("quick.toml")
