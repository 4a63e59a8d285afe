"""The look every kvbench figure shares: matplotlib on the Agg backend, a colour per cache (registry order, so a cache
keeps its colour across figures and runs), a line style per engine (solid: kvbench, dashed: transformers, dash-dot:
transformers compiled), plain-number log ticks, one legend under the panels, and the run's title."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator  # noqa: E402

from kvbench.caches import CACHES  # noqa: E402

ENGINE_STYLE = {"kvbench": "-", "hf": "--", "hf-compiled": "-."}
ENGINE_LABEL = {"kvbench": "kvbench", "hf": "transformers", "hf-compiled": "transformers compiled"}
ENGINE_ORDER = list(ENGINE_STYLE)


def _colour(cache: str) -> str:
    names = list(CACHES)
    i = names.index(cache) if cache in names else len(names)
    return plt.get_cmap("tab10")(i % 10)


def _label(engine: str, cache: str) -> str:
    return f"{ENGINE_LABEL.get(engine, engine)}: {cache}"


def _series(df: pd.DataFrame):
    """(engine, cache) groups in a stable, readable order: engines as given, caches in registry order."""
    names = list(CACHES)
    keys = df[["engine", "cache"]].drop_duplicates().itertuples(index=False)
    order = sorted(
        keys,
        key=lambda k: (
            ENGINE_ORDER.index(k.engine) if k.engine in ENGINE_ORDER else 99,
            names.index(k.cache) if k.cache in names else 99,
        ),
    )
    return [(k.engine, k.cache) for k in order]


_PLAIN = FuncFormatter(lambda x, _: f"{x:g}")


def _maybe_log(ax, values, ratio: float = 20.0) -> None:
    """Log y when the values span more than `ratio`, with plain numbers (not 10^k) on the ticks."""
    v = [x for x in values if x > 0]
    if v and max(v) / min(v) > ratio:
        ax.set_yscale("log")
        if max(v) / min(v) < 300:  # under 2.5 decades: label 1-2-5 steps, not only the powers of ten
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(_PLAIN)
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda x, _: ""))


def _shared_legend(fig, axes) -> None:
    """One legend under the panels (every panel draws the same engine x cache lines), so none hides data."""
    handles: dict = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=False):
            handles.setdefault(lab, h)
    if handles:
        fig.legend(
            list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 5), fontsize=9
        )


def _title(meta: dict) -> str:
    return f"{meta.get('model', '?')} ({meta.get('weights', '?')}) · {meta.get('device_name', '?')} · {meta.get('dtype', '?')}"
