"""What happens around a `kvbench bench` run (BenchOptions): its own module, so the command and its --endpoint form
both read it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvbench import options
from kvbench.options import option


@dataclass
class BenchOptions:
    """What happens around a `kvbench bench` sweep; the sweep's own options are BenchSettings' fields, and those
    given on the command line are `given` (the TOML file and the defaults decide the rest)."""

    config: Path | None = option(
        "--config", default=None, help="A TOML sweep (configs/bench/) or a shipped one by name (seed, quick)."
    )
    force: bool = option("--force", default=False, help="Replace the bench files of an earlier run in --out.")
    baseline: Path | None = option(
        "--baseline",
        default=None,
        help="A previous run folder: compare this run against it when the sweep ends (as kvbench compare).",
    )
    allow_env_change: bool = option(
        "--allow-env-change",
        default=False,
        help="With --baseline: compare even though the baseline ran on another device, dtype or library "
        "versions (the changes are printed).",
    )
    export: tuple[str, Path] | None = option(
        "--export",
        default=None,
        help="FORMAT FILE: when the sweep ends, also write its ok rows for a charting tool; FORMAT: "
        "github-action-benchmark (customSmallerIsBetter: TPOT and TTFT medians in ms per row).",
    )
    json_out: bool = options.json_option()
    hf: str | None = options.hf_option()
    trust_remote_code: bool = options.trust_option()
    layers: int | None = options.layers_option()
    given: dict = field(default_factory=dict)  # BenchSettings' options given on the command line, by field name
