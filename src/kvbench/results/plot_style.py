"""The one look every bench and compare figure shares: a colour per cache (registry order, so a cache keeps its
colour across figures and runs), a line style per engine (solid: kvbench, dashed: transformers, dash-dot:
transformers compiled), a look of its own per peer engine (a peer's cache is its own, not one of kvbench's, so it
does not take a cache's colour), plain-number log ticks, one legend under the panels, and the run's title."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator  # noqa: E402

from kvbench.caches import CACHES  # noqa: E402
from kvbench.peers import PEERS  # noqa: E402

ENGINE_STYLE = {"kvbench": "-", "hf": "--", "hf-compiled": "-."}
ENGINE_LABEL = {"kvbench": "kvbench", "hf": "transformers", "hf-compiled": "transformers compiled"}
ENGINE_ORDER = list(ENGINE_STYLE)
# Peer engines, in registry order: (colour, line style, bar hatch); dark greys, so they read apart from the caches.
PEER_LOOKS = [
    ("0.15", ":", ".."),
    ("0.5", (0, (5, 2, 1, 2)), "xx"),
    ("0.3", (0, (1, 1)), "oo"),
    ("0.65", ":", "--"),
    ("0.4", (0, (3, 1, 1, 1, 1, 1)), "++"),
    ("0.75", (0, (6, 2)), "||"),
]


def cache_colour(cache: str) -> tuple[float, float, float, float]:
    names = list(CACHES)
    i = names.index(cache) if cache in names else len(names)
    return plt.get_cmap("tab10")(i % 10)


def _peer_look(engine: str) -> tuple | None:
    names = list(PEERS)
    return PEER_LOOKS[names.index(engine) % len(PEER_LOOKS)] if engine in names else None


def series_colour(engine: str, cache: str):
    """A kvbench or transformers series takes its cache's colour; a peer its own grey."""
    look = _peer_look(engine)
    return look[0] if look else cache_colour(cache)


def series_style(engine: str):
    look = _peer_look(engine)
    return look[1] if look else ENGINE_STYLE.get(engine, ":")


def series_hatch(engine: str) -> str:
    look = _peer_look(engine)
    return look[2] if look else {"kvbench": "", "hf": "//", "hf-compiled": "\\\\"}.get(engine, "..")


def series_label(engine: str, cache: str) -> str:
    return f"{ENGINE_LABEL.get(engine, engine)}: {cache}"


def series_keys(df: pd.DataFrame):
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


PLAIN = FuncFormatter(lambda x, _: f"{x:g}")


def maybe_log(ax, values, ratio: float = 20.0) -> None:
    """Log y when the values span more than `ratio`, with plain numbers (not 10^k) on the ticks."""
    v = [x for x in values if x > 0]
    if v and max(v) / min(v) > ratio:
        ax.set_yscale("log")
        if max(v) / min(v) < 300:  # under 2.5 decades: label 1-2-5 steps, not only the powers of ten
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(PLAIN)
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda x, _: ""))


def shared_legend(fig, axes) -> None:
    """One legend under the panels (every panel draws the same engine x cache lines), so none hides data."""
    handles: dict = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=False):
            handles.setdefault(lab, h)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 5), fontsize=9)


def run_title(meta: dict) -> str:
    return f"{meta.get('model', '?')} ({meta.get('weights', '?')}) · {meta.get('device_name', '?')} · {meta.get('dtype', '?')}"


def context_label(n: float) -> str:
    n = int(n)
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


def line_kw(engine: str, cache: str, **more) -> dict:
    """One engine x cache line's look: the cache's colour, the engine's line style, round markers."""
    return dict(
        color=series_colour(engine, cache),
        linestyle=series_style(engine),
        marker="o",
        linewidth=1.4,
        markersize=5,
        **more,
    )


# At most this many labelled ticks on a prompt-length or context axis; more are left to matplotlib's locator.
MAX_TICKS = 16
