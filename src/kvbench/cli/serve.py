"""`kvbench serve`: our GPT-2 behind an OpenAI-compatible HTTP server with a paged, prefix-cached KV pool."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbench import console, options
from kvbench.cli.app import Terminated, command, load_for_cli
from kvbench.errors import KVBenchError
from kvbench.options import option

if TYPE_CHECKING:
    from kvbench.serve.engine import Engine
    from kvbench.serve.protocol import Served

INSTALL = "pip install 'kvbench[serve]'"


@dataclass
class ServeOptions:
    """One `kvbench serve` command line (serve/rules.py serve_rules)."""

    model: str | None = options.model_option()
    weights: str = options.weights_option()
    device: str = options.device_option()
    dtype: str = options.dtype_option("auto")
    seed: int = options.seed_option()
    tokenizer: str | None = options.tokenizer_option()
    kv_blocks: int = option("--kv-blocks", default=256, help="Device KV blocks in the pool every request shares.")
    block_size: int = option(
        "--block-size", default=16, help="Tokens per KV block: the unit of allocation and of prefix caching."
    )
    host_blocks: int = option(
        "--host-blocks",
        default=0,
        help="Host-tier blocks (CPU copies) that evicted cached blocks go to and come back from; 0: no host tier.",
    )
    max_batch: int = option("--max-batch", default=8, help="Most requests decoded together in one forward.")
    host: str = option("--host", default="127.0.0.1", help="The address to listen on.")
    port: int = option(
        "--port", default=8000, help="The port to listen on; 0 picks a free one (the ready line names it)."
    )
    fault: str | None = option(
        "--fault",
        default=None,
        help="Serve with an injected server fault: freed-block-reused, hit-without-copy, hash-without-parent or "
        "reset-keeps-host-tier (kvbench break shows each).",
    )


def _frameworks() -> None:
    """FastAPI and uvicorn, the optional extra: missing, one line naming the install."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise KVBenchError(f"kvbench serve needs FastAPI and uvicorn ({e.name} is not installed): {INSTALL}") from None


@command(ServeOptions)
def serve(o: ServeOptions) -> None:
    """Serve our GPT-2 over HTTP (OpenAI's /v1/completions) with a paged KV pool, prefix caching and continuous
    batching. Prints one line when ready, `kvbench serve: http://HOST:PORT/v1`, and runs until SIGINT, SIGTERM or
    SIGHUP (exit 130, 143, 129)."""
    from kvbench.serve.rules import serve_rules

    serve_rules(o)
    _frameworks()
    from kvbench.serve.app import listen, serve_forever

    sock = listen(o.host, o.port)  # a port in use is refused before the model loads
    try:
        engine, served = _prepare(o)
    except BaseException:
        sock.close()
        raise
    port = sock.getsockname()[1]
    host = f"[{o.host}]" if ":" in o.host else o.host

    def ready() -> None:
        print(f"kvbench serve: http://{host}:{port}/v1", flush=True)

    stopped_by = serve_forever(engine, served, sock, ready, log=console.note)
    if stopped_by == signal.SIGINT:
        raise KeyboardInterrupt
    if stopped_by is not None:  # SIGTERM, SIGHUP: 128 + the signal, as any command they end
        raise Terminated(stopped_by)


def _prepare(o: ServeOptions) -> tuple[Engine, Served]:
    """The tokenizer, the model, the pool (the fault's, with --fault) and the engine over them."""
    from kvbench.devices import resolve_device, resolve_dtype
    from kvbench.model.tokenizer import load_tokenizer
    from kvbench.model.weights import peek_config
    from kvbench.serve.engine import Engine
    from kvbench.serve.faults import get_server_fault, pool_class
    from kvbench.serve.protocol import Served
    from kvbench.serve.rules import pool_bytes, pool_fits

    tok = load_tokenizer(o.tokenizer)
    cfg = peek_config(o.model, o.weights)
    run_on = resolve_device(o.device)
    pool_fits(cfg, o, resolve_dtype(o.dtype, run_on), run_on)
    loaded, dev, dt = load_for_cli(o.model, o.weights, o.device, o.dtype, o.seed)
    c = loaded.model.cache_config
    pool = pool_class(o.fault)(c.n_layer, c.n_head, c.head_dim, o.kv_blocks, o.block_size, dt, dev, o.host_blocks)
    stop = tok.eot_id if tok.eot_id < loaded.config.vocab_size else None
    engine = Engine(loaded.model, pool, o.max_batch, stop, seed=o.seed)
    served = Served(
        loaded.config.name,
        loaded.config.vocab_size,
        loaded.config.block_size,
        o.block_size,
        o.kv_blocks,
        tok,
        str(dt).removeprefix("torch."),
    )
    mib = 2**20
    host = f", host tier {o.host_blocks} blocks" if o.host_blocks else ", no host tier"
    console.note(
        f"kvbench serve: {served.model} ({loaded.weights}) on {dev} {str(dt).removeprefix('torch.')}; "
        f"{o.kv_blocks} KV blocks of {o.block_size} tokens "
        f"({pool_bytes(loaded.config, o.kv_blocks, o.block_size, dt) / mib:.1f} MiB){host}; batch up to {o.max_batch}"
    )
    if o.fault is not None:
        f = get_server_fault(o.fault)
        dormant = " (dormant: it needs --host-blocks > 0)" if f.host_tier and not o.host_blocks else ""
        console.warn(f"injected server fault {f.name}: {f.summary}{dormant}")
    return engine, served
