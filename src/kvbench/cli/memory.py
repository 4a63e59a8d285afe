"""`kvbench memory`: KV-cache capacity planning for real models, checked against transformers' own cache, and
measured against our caches. The command parses options, calls the planner, and renders what it returns."""

from __future__ import annotations

from rich.text import Text

from kvbench import console
from kvbench.cli.app import command
from kvbench.cli.memory_render import (
    render_all,
    render_checks,
    render_copy_traffic,
    render_measure,
    render_paged,
    render_plan,
)
from kvbench.console import out
from kvbench.jsonio import SCHEMA_VERSION
from kvbench.memory.request import Options


@command(Options)
def memory(options: Options) -> None:
    """Plan KV-cache memory for real models (bytes/token, per sequence, fits on a GPU, decode floor)."""
    doc = run_jobs(checked_request(options), options.json_out)
    if options.json_out:
        console.print_json(doc)


def checked_request(options):
    """Every option and model checked and --measure's caches resolved (plugins loaded and probed): no work yet."""
    from kvbench.memory.request import parse_request

    req = parse_request(options, extra=_gpt2_spec)
    if req.measure:
        from kvbench.caches import parse_cache_names

        req.cache_names = parse_cache_names(options.caches)
    return req


def run_jobs(req, json_out: bool) -> dict:
    """The request's jobs in order (--measure, --copy-traffic, else the plans), each rendered as it completes unless
    `json_out`; returns the JSON document of them all."""
    doc: dict = {
        "schema_version": SCHEMA_VERSION,
        "kv_dtype": req.kv_dtype,
        "weights_dtype": req.weights_dtype,
        "batch": req.batch if len(req.batches) <= 1 else req.batches,
        "tp": req.tp,
        "tp_engine": req.tp_engine,
        "batches": req.batches,
    }
    if req.measure:
        _measure(req, doc, json_out)
    if req.copy_traffic:
        _copy_traffic(req, doc, json_out)
    if req.plans:
        _plans(req, doc, json_out)
    return doc


def _gpt2_spec(name: str):
    """Our own GPT-2 presets (gpt2-tiny too) for --measure and --copy-traffic; None for any other name."""
    from kvbench.caches.planned import spec_from_gpt_config
    from kvbench.model.gpt2 import PRESETS as GPT_PRESETS

    key = name.strip().lower()
    return spec_from_gpt_config(GPT_PRESETS[key]) if key in GPT_PRESETS else None


def _measure(req, doc: dict, json_out: bool) -> None:
    """Allocate every registered cache (and, with --lengths, a paged cache of mixed lengths) and compare."""
    from kvbench.bench.measure_memory import check_measure, measure_caches, paged_waste
    from kvbench.cli.memory_working import to_jsonable
    from kvbench.memory.request import DEFAULT_MEASURE_CTX

    name, contexts = req.specs[0].name, req.contexts or [DEFAULT_MEASURE_CTX]
    max_len = max(req.contexts) if req.contexts else None
    check_measure(name, req.batch, contexts, req.kv_dtype, req.device, req.lengths, max_len)
    reports = [measure_caches(name, req.batch, c, req.kv_dtype, req.device, req.cache_names) for c in contexts]
    paged = paged_waste(name, req.lengths, max_len, req.kv_dtype) if req.lengths else None
    doc["measure"] = to_jsonable(reports)
    if paged is not None:
        doc["paged"] = {
            **to_jsonable(paged),
            "static_waste": paged.static_waste,
            "paged_waste": paged.paged_waste,
            "saving": paged.saving,
        }
    for w in (w for r in reports for w in r.warnings):
        console.warn(w)
    if not json_out:
        for r in reports:
            render_measure(r)
        if paged is not None:
            render_paged(paged)


def _copy_traffic(req, doc: dict, json_out: bool) -> None:
    """The closed form of what torch.cat copies, and our dynamic cache's own counter where it can run."""
    from kvbench.bench.measure_memory import count_copy_traffic
    from kvbench.cli.memory_working import copy_traffic_json
    from kvbench.memory.formulas import copy_traffic

    (n0, n1), traffic = req.copy_range, []
    for spec in req.specs:
        t = copy_traffic(spec, n0, n1, req.batch, req.kv_dtype)
        t.measured_bytes, t.counter_note = count_copy_traffic(spec.name, n0, n1, req.batch, req.kv_dtype, req.device)
        traffic.append((spec.name, t))
    doc["copy_traffic"] = [dict(model=n, **copy_traffic_json(t)) for n, t in traffic]
    if not json_out:
        render_copy_traffic(traffic)


def _plans(req, doc: dict, json_out: bool) -> None:
    """The plan for every model, and with --check transformers' own cache beside it."""
    from kvbench.cli.memory_working import plan_json, plan_warnings, to_jsonable
    from kvbench.memory.request import plan_request

    plans, left_out = plan_request(req)
    checks = _checks(req, plans) if req.check else []
    for w in left_out:
        console.warn(w)
    if not req.all_:  # --all marks beyond-context cells with a dagger instead of a line each
        for w in (w for p in plans for w in plan_warnings(p)):
            console.warn(w)
    doc["plans"] = [plan_json(p) for p in plans]
    if req.bandwidth is not None:
        doc["bandwidth"] = to_jsonable(req.bandwidth)
    if req.check:
        doc["check"] = to_jsonable(checks)
    if req.plot is not None:
        from kvbench.memory.plot import write_capacity_plot

        doc["plot"] = to_jsonable(write_capacity_plot(plans, req.plot))
    if json_out:
        return
    if req.all_:
        render_all(plans, req.batch, req.kv_dtype, req.weights_dtype)
    for p in [] if req.all_ else plans:
        render_plan(p)
        mine = [c for c in checks if c.model == p.model.name]
        if mine:
            render_checks(mine)
    if req.plot is not None:
        out.print(Text(f"capacity chart: {req.plot}"))


def _checks(req, plans) -> list:
    """--check: each model against transformers' StaticCache on the meta device, at the plan's contexts."""
    from kvbench.memory.check import check_preset, check_resolved

    out_ = []
    for p in plans:
        for batch in req.batches or [req.batch]:
            contexts = [r.ctx for r in p.rows if r.batch == batch]
            resolved = req.resolved.get(p.model.name)
            if resolved is not None:
                out_ += check_resolved(resolved, contexts, batch, req.kv_dtype)
            else:
                out_ += check_preset(p.model, contexts, batch, req.kv_dtype)
    return out_
