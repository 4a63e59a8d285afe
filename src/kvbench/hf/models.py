"""Load a Hugging Face causal LM for `verify --hf` and `bench --hf`, or refuse it before any weight is read.

SOURCE is one of:
- a model directory (config.json + model.safetensors or pytorch_model.bin, sharded or not), as `save_pretrained`
  writes it;
- a config file (config.json, or any JSON file with a `model_type`): random weights from transformers' own
  initialisation, seeded, labelled as random;
- a hub id (`org/name`): from the local Hugging Face cache, or downloaded when the hub is reachable.
`--layers N` keeps the first N decoder layers (for speed: the cache code is the same in every layer).
`--trust-remote-code` lets a directory's own modelling code (`auto_map`) run; without it such a model is refused.

Anything that cannot become a decoder-only causal LM (missing files, an architecture transformers does not know,
an encoder-only or encoder-decoder model) is a `KVBenchError` with one line naming the source and the fix.
transformers' loading bars, log messages and Python warnings are kept off the terminal (`quiet_transformers`).
What a loaded model is, read from it (`describe`), is in hf/introspect.py.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers import __version__ as transformers_version
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from kvbench import devices, files
from kvbench.errors import KVBenchError, NotEnoughMemoryError, one_line
from kvbench.hf.introspect import HFModelInfo, describe
from kvbench.memory.config import check_fields, quiet_transformers
from kvbench.memory.units import fmt_bytes
from kvbench.model.weights import hub_reachable
from kvbench.resources import BUNDLED_MODELS
from kvbench.thirdparty import contained, did
from kvbench.validate import context_error, past_context

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel

    class CausalLM(PreTrainedModel, GenerationMixin):
        """What loading gives: a transformers model with `generate`, of the class its config names."""


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# "org/name" or "name": what the hub accepts as a model id (and what a path that does not exist may still be).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
REMOTE_MODULES = "transformers_modules"  # where transformers imports a directory's own modelling code from
# Families whose generate feeds the model something other than the sequence so far: a cached step cannot be compared
# with a forward over the prefix.
NOT_A_PREFIX_FORWARD = {
    "xlm": "appends a mask token to every input in generate (XLMWithLMHeadModel.prepare_inputs_for_generation), so "
    "a decode step is not a forward over the prefix",
}


@dataclass
class LoadedHF:
    model: CausalLM  # a transformers PreTrainedModel with GenerationMixin, eval mode, on its device
    source: str  # as given
    weights: str  # for every output: a path, "hub:org/name", or "random(transformers init, ...)"
    random: bool
    info: HFModelInfo
    pad_token_id: int  # what left padding fills with (masked out, so any id works)
    notes: list[str] = field(default_factory=list)

    layers_of: int | None = None  # the checkpoint's or config's layer count when --layers kept fewer

    @property
    def label(self) -> str:
        return _label(self.info, self.layers_of)

    def meta(self) -> dict:
        """The model facts recorded in JSON and meta.json outputs."""
        info = self.info
        return {
            "source": self.source,
            "architecture": info.architecture,
            "model_type": info.model_type,
            "layers": info.layer_types,
            "attn_implementation": info.attn_implementation,
            "context": info.context,
            "learned_positions": info.learned_positions,
            "transformers": info.transformers_version,
        }


def _label(info: HFModelInfo, layers_of: int | None) -> str:
    """'LlamaForCausalLM (2 layers)', or '(first 1 of 2 layers)' when --layers kept fewer."""
    kept = info.n_layers
    of = f"first {kept} of {layers_of} layers" if layers_of not in (None, kept) else f"{kept} layers"
    return f"{info.architecture} ({of})"


# --- reading a config before loading anything ----------------------------------------------------------------------
def _read_config(path: Path) -> dict:
    doc = files.load_json(path, str(path), files.CONFIG_BYTES, "a model config")
    if not isinstance(doc, dict):
        raise KVBenchError(f"{path} is not a model config (a JSON object with a model_type)")
    return doc


def _refuse_unloadable(doc: dict, where: str, trust_remote_code: bool) -> None:
    """Refuse, by name, what cannot become a decoder-only causal LM, before transformers tries (and fails in one
    of many exception types, or prompts on the terminal)."""
    model_type = doc.get("model_type")
    auto_map = doc.get("auto_map") or {}
    custom = isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map
    if custom and not trust_remote_code:
        raise KVBenchError(
            f"{where} has its own modelling code (auto_map: AutoModelForCausalLM -> "
            f"{auto_map['AutoModelForCausalLM']}); read it, then rerun with --trust-remote-code to let it run"
        )
    if custom:
        return  # the directory's own code decides; loading errors are reported as they come
    if not model_type:
        raise KVBenchError(f"{where} has no model_type; not a Hugging Face model config")
    if model_type not in CONFIG_MAPPING_NAMES:
        hint = " (it names custom code in auto_map, but not for AutoModelForCausalLM)" if auto_map else ""
        raise KVBenchError(
            f"{where}: model_type {model_type!r} is unknown to transformers {transformers_version}{hint}; upgrade "
            "transformers, or point at a directory whose auto_map provides the code (with --trust-remote-code)"
        )
    if doc.get("is_encoder_decoder"):
        raise KVBenchError(f"{where}: {model_type} is an encoder-decoder model; --hf checks decoder-only causal LMs")
    if model_type in NOT_A_PREFIX_FORWARD:
        raise KVBenchError(f"{where}: {model_type} {NOT_A_PREFIX_FORWARD[model_type]}; --hf cannot check it")
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not doc.get("is_decoder"):
        raise KVBenchError(
            f"{where}: {model_type} is an encoder-only model (a masked LM; its config has no is_decoder: true); "
            "--hf checks decoder-only causal LMs"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise KVBenchError(
            f"{where}: transformers has no causal-LM class for {model_type!r}; --hf checks decoder-only causal LMs"
        )


def _shrink(config, layers: int | None, where: str) -> tuple[int | None, int | None]:
    """Keep the first `layers` decoder layers (and their entries in per-layer lists). Returns (kept, of): the
    config's own count twice without `layers` (None where it has no num_hidden_layers)."""
    text = config.get_text_config(decoder=True)
    total = getattr(text, "num_hidden_layers", None)
    if layers is None:
        return total, total
    if not isinstance(total, int):
        raise KVBenchError(f"--layers: {where} has no num_hidden_layers to shrink")
    if not 1 <= layers <= total:
        raise KVBenchError(f"--layers must be between 1 and {total} (the layers {where} has), got {layers}")
    text.num_hidden_layers = layers
    for key in ("layer_types",):
        value = getattr(text, key, None)
        if isinstance(value, list) and len(value) == total:
            setattr(text, key, value[:layers])
    return layers, total


# --- loading -------------------------------------------------------------------------------------------------------
@dataclass
class _Resolved:
    """SOURCE resolved to a config, before any weights are read."""

    config: Any  # transformers' config (a PretrainedConfig subclass), --layers applied
    where: str  # what transformers reads: a directory or a hub id
    kwargs: dict  # trust_remote_code (and local_files_only for a hub id)
    weights: str | None  # the checkpoint: "hub:org/name" or a path; None: random weights from a config file
    layers_of: int | None  # the layers the config has (before --layers)


def bundled_source(source: str) -> bool:
    """--hf SOURCE names a model shipped with kvbench, in Hugging Face's format (no path of that name exists)."""
    return source in BUNDLED_MODELS and not Path(source).expanduser().exists()


def _resolve(source: str, layers: int | None, trust_remote_code: bool) -> _Resolved:
    """Everything load_hf checks before it reads a weight: the source exists, its config reads, it is a decoder-only
    causal LM transformers can build, --layers fits; one line naming the source otherwise. A model shipped with
    kvbench (gpt2-shakespeare) is named by its preset name, where no file or folder of that name is."""
    bundled = bundled_source(source)
    path = BUNDLED_MODELS[source] if bundled else Path(source).expanduser()
    kwargs = {"trust_remote_code": trust_remote_code}  # never None: that would prompt on the terminal
    if path.is_file():
        doc = _read_config(path)
        _refuse_unloadable(doc, str(path), trust_remote_code)
        check_fields(doc, path)  # the bounds memory --config holds a config to, before transformers builds it
        where, weights = str(path), None
        if doc.get("auto_map"):  # its code is found beside it, through the directory
            if path.name != "config.json":
                raise KVBenchError(
                    f"{path} names modelling code (auto_map): transformers finds that code through a directory, "
                    "so name the file config.json and keep it beside the code"
                )
            where = str(path.parent)
    elif path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.exists():
            raise KVBenchError(f"no config.json in {path}; not a Hugging Face model directory")
        doc = _read_config(cfg_path)
        _refuse_unloadable(doc, str(path), trust_remote_code)
        check_fields(doc, cfg_path)
        for f in (path / name for name in WEIGHT_FILES if (path / name).exists()):
            files.check_file(f, str(f), "a checkpoint's weights are regular files")
        if not any((path / f).is_file() for f in WEIGHT_FILES):
            raise KVBenchError(
                f"no weights in {path} (model.safetensors or pytorch_model.bin); for random weights pass {cfg_path}"
            )
        where, weights = str(path), f"bundled:{source}" if bundled else str(path)
    elif path.exists():  # a device, a pipe, a socket
        raise KVBenchError(f"--hf {source} is {files.what_is(path)}, neither a config.json file nor a model directory")
    elif HUB_ID.match(source) and not source.startswith("."):
        where, weights = source, f"hub:{source}"
        kwargs["local_files_only"] = not hub_reachable()
    else:
        raise KVBenchError(f"--hf {source}: no such file or directory, and not a hub id (org/name)")
    config = _call(lambda: AutoConfig.from_pretrained(where, **kwargs), source)
    if "local_files_only" in kwargs:  # a hub id: now we know its config
        _refuse_unloadable(config.to_dict(), where, trust_remote_code)
        check_fields(config.to_dict(), Path(f"{where} config.json"))
    _, total = _shrink(config, layers, str(path) if weights is None else where)
    return _Resolved(config, where, kwargs, weights, total)


def resolve_source(source: str, layers: int | None, trust_remote_code: bool) -> _Resolved:
    """SOURCE read and checked without reading a weight: load_hf's first step, on its own (hf/tp.py)."""
    with quiet_transformers():
        return _resolve(source, layers, trust_remote_code)


def load_hf(
    source: str,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    layers: int | None = None,
    trust_remote_code: bool = False,
    init_std: float | None = None,
    run: tuple[int, int] | None = None,
    check=None,
    tp: bool = False,
) -> LoadedHF:
    """Load SOURCE (see the module docstring) in `dtype` on `device`, eval mode, with a neutral generation config.
    `init_std`, for random weights only, replaces the config's initializer_range (None: keep the config's).

    Before any real allocation the model is built on the meta device: `check(shape)`, if given, runs on it (the
    caller's own checks: context, sizes), then its memory is estimated (`check_memory`, with `run` = (batch,
    tokens) of the largest generation the caller will run) against what the device has free.

    `tp`: this process is one rank of a tensor-parallel group already started (kvbench.distributed): the
    checkpoint is loaded split by transformers' own plan (hf/tp.py), this rank's shard on its device."""
    with quiet_transformers():
        return _load(source, device, dtype, seed, layers, trust_remote_code, init_std, run, check, tp)


def _load(source, device, dtype, seed, layers, trust_remote_code, init_std, run, check, tp=False) -> LoadedHF:
    r = _resolve(source, layers, trust_remote_code)
    shape = _meta_shape(r, source)
    if check is not None:
        check(shape)
    check_memory(source, shape, device, dtype, r.weights is None, *(run or (1, 0)))
    config, path = r.config, Path(source).expanduser()
    if r.weights is None:
        if init_std is not None and hasattr(config, "initializer_range"):
            config.initializer_range = init_std
        std = getattr(config, "initializer_range", None)
        torch.manual_seed(seed)  # transformers' init draws from the global generator: seeded, on the CPU
        model = _call(lambda: AutoModelForCausalLM.from_config(config, **r.kwargs), source)
        weights = f"random(transformers init, initializer_range={std}, seed={seed}) from {path}"
    else:
        split = {}
        if tp:
            from transformers.distributed import DistributedConfig

            split = {"distributed_config": DistributedConfig(tp_plan="auto")}
        model, info = _call(
            lambda: AutoModelForCausalLM.from_pretrained(
                r.where,
                config=config,
                dtype=dtype,
                output_loading_info=True,
                ignore_mismatched_sizes=True,
                **r.kwargs,
                **split,
            ),
            source,
        )
        refuse_incomplete(info, r.weights, kept=None if layers is None else layers)
        weights = r.weights
    model = (model if tp else model.to(device=device, dtype=dtype)).eval()
    _contain_remote_code(model, source)
    pad = _neutral_generation_config(model)
    return LoadedHF(model, source, weights, r.weights is None, describe(model), pad, layers_of=r.layers_of)


def refuse_incomplete(info: dict, where: str, kept: int | None = None) -> None:
    """A checkpoint must hold exactly the model's tensors, as the GPT-2 loader requires: transformers fills a missing
    tensor with random values and ignores an unexpected one, so a half checkpoint would pass every check on noise.
    `info` is from_pretrained's loading info; tied tensors (lm_head tied to the embedding) are not missing. With
    --layers N the layers past N are in the checkpoint but not in the model: those are expected."""

    def names(keys) -> str:
        keys = sorted(keys)
        return ", ".join(keys[:3]) + (f", ... ({len(keys) - 3} more)" if len(keys) > 3 else "")

    mismatched = sorted(info.get("mismatched_keys") or [], key=lambda m: m[0])
    if mismatched:
        key, ckpt, want = mismatched[0]
        more = f" (and {len(mismatched) - 1} more mismatched)" if len(mismatched) > 1 else ""
        raise KVBenchError(
            f"{where}: tensor {key} has shape {tuple(ckpt)} in the checkpoint, the config expects {tuple(want)}"
            f"{more}; the checkpoint does not match its config.json"
        )
    missing = set(info.get("missing_keys") or ())
    if missing:
        layers = [i for i in map(_layer_index, missing) if i is not None]
        # the checkpoint holds layers 0 .. first-1 in full
        first = min(layers) if len(layers) == len(missing) else 0
        hint = f", or --layers {first} to keep the layers it holds" if first else ""
        raise KVBenchError(
            f"{where}: the checkpoint lacks {len(missing)} of the model's tensors ({names(missing)}); transformers "
            f"would fill them with random values; use a complete checkpoint{hint}"
        )
    unexpected = {k for k in info.get("unexpected_keys") or () if kept is None or (_layer_index(k) or 0) < kept}
    if unexpected:
        raise KVBenchError(
            f"{where}: the checkpoint has {len(unexpected)} tensor(s) the model does not use ({names(unexpected)}); "
            "it is not a checkpoint of the architecture its config.json names"
        )


def _layer_index(key: str) -> int | None:
    """The decoder layer a tensor name belongs to ('model.layers.3.mlp...' -> 3), or None."""
    m = re.search(r"\.(\d+)\.", key)
    return int(m.group(1)) if m else None


@dataclass
class HFShape:
    """A model's facts and size, read without loading a weight (what bench checks before any work)."""

    info: HFModelInfo
    parameters: int  # each shared (tied) tensor once
    layers_of: int | None

    @property
    def label(self) -> str:
        return _label(self.info, self.layers_of)


def _meta_shape(r: _Resolved, source: str) -> HFShape:
    with torch.device("meta"):
        model = _call(lambda: AutoModelForCausalLM.from_config(r.config, **r.kwargs), source)
    _contain_remote_code(model, source)
    return HFShape(describe(model), sum(p.numel() for p in model.parameters()), r.layers_of)


def run_bytes(info: HFModelInfo, batch: int, tokens: int, element_size: int) -> int:
    """A rough allowance for running `batch` sequences of `tokens` tokens: K and V of every layer, twice (a cache and
    the copy a reset or a concatenation makes), the logits kept for comparison (fp32, on the device and on the CPU)
    and one eager attention's scores over the whole length."""
    kv = 2 * info.kv_elements * tokens * batch * element_size
    logits = 3 * batch * tokens * info.vocab_size * 4
    scores = batch * max(info.n_heads, 1) * tokens * tokens * 4
    return 2 * kv + logits + scores


def check_memory(
    source: str, shape: HFShape, device: torch.device, dtype: torch.dtype, random: bool, batch: int = 1, tokens: int = 0
) -> None:
    """The model's memory, estimated from its meta-device build, against what is free before anything is allocated:
    its parameters at `dtype` (random weights are initialised in fp32 on the CPU first), plus an allowance for
    activations and the cache (`run_bytes`, and a tenth of the weights). One line naming the estimate and what is
    available."""

    elem = torch.empty((), dtype=dtype).element_size()
    weights = shape.parameters * elem
    allowance = run_bytes(shape.info, batch, tokens, elem) + weights // 10
    host = shape.parameters * 4 if random else weights  # what is built on the CPU first
    built = f"{shape.parameters:,} parameters x {4 if random else elem} B" + (
        " (random weights are initialised in fp32 on the CPU)" if random else ""
    )
    run_on = f" + {fmt_bytes(allowance)} for activations and the cache"
    if device.type == "cpu":  # a random init in fp32 converted to another dtype is held twice for a moment
        twice = weights if random and elem != 4 else 0
        needs = [
            (
                device,
                host + twice + allowance,
                built + (f" + {fmt_bytes(twice)} converted" if twice else "") + run_on,
            )
        ]
    else:
        needs = [
            (torch.device("cpu"), host, built),
            (device, weights + allowance, f"{shape.parameters:,} parameters x {elem} B{run_on}"),
        ]
    for dev, need, how in needs:
        free = devices.available_memory_bytes(dev)
        if free is not None and need > free:
            what = "CPU memory" if dev.type == "cpu" else f"memory on {dev}"
            raise NotEnoughMemoryError(
                f"--hf {source}: {shape.label} needs about {fmt_bytes(need)} of {what}: {how}; {fmt_bytes(free)} is "
                "available; use --layers N, a smaller model or fewer tokens"
            )


def _call(fn, source: str):
    """Run a transformers loading call (and, with --trust-remote-code, the model's own code it imports and runs);
    whatever it raises, or a sys.exit() inside it, becomes one line naming the source. Its prints go to stderr."""

    def fail(e: BaseException) -> KVBenchError:
        if not isinstance(e, Exception):  # sys.exit() or another BaseException: someone's code tried to leave
            return KVBenchError(f"cannot load {source}: {did('loading it', e)}")
        # transformers and huggingface_hub raise OSError, ValueError, KeyError, ImportError, ...
        text = str(e).strip()
        hint = ""
        if "local_files_only" in text or "offline" in text.lower() or type(e).__name__.endswith("OfflineError"):
            hint = " (the hub is not reachable or HF_HUB_OFFLINE is set, and it is not in the local cache)"
        return KVBenchError(f"cannot load {source}: {one_line(e)}{hint}")

    with contained(fail):
        return fn()


def _contain_remote_code(model, source: str) -> None:
    """Every method the model's own code defines (its classes from `auto_map`, loaded with --trust-remote-code)
    called through `contained`: a sys.exit(), any exception or a print from inside forward, generate or any other
    method it overrides becomes one KVBenchError naming the source and the method, and prints go to stderr.
    Submodules run inside the top-level forward, so they are covered by it. Under torch.compile the methods are
    called directly (the graph is traced through them)."""
    seen: set[str] = set()
    for cls in type(model).__mro__:
        if not cls.__module__.startswith(REMOTE_MODULES):
            continue
        for name, fn in vars(cls).items():
            if name.startswith("__") or name in seen or not inspect.isfunction(fn):
                continue
            seen.add(name)
            object.__setattr__(model, name, _contained_method(getattr(model, name), source, name))


def _contained_method(bound, source: str, name: str):
    def fail(e: BaseException) -> KVBenchError:
        return KVBenchError(f"{source}: the model's own code (--trust-remote-code): {did(name, e)}")

    @functools.wraps(bound)  # keeps the signature: generate reads forward's parameters
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return bound(*args, **kwargs)
        with contained(fail):
            return bound(*args, **kwargs)

    return call


def _neutral_generation_config(model) -> int:
    """Replace the model's generation defaults (sampling, repetition penalties, forced tokens: they change which
    token wins, identically on both paths, but hide the raw logits) with greedy defaults that keep only its special
    tokens. Returns the id left padding uses."""
    old = getattr(model, "generation_config", None)
    cfg = model.config.get_text_config(decoder=True)

    def first(*names):
        for obj in (old, cfg):
            for n in names:
                v = getattr(obj, n, None) if obj is not None else None
                if isinstance(v, list):
                    v = v[0] if v else None
                if isinstance(v, int):
                    return v
        return None

    vocab = int(cfg.vocab_size)
    eos, bos = first("eos_token_id"), first("bos_token_id")
    # masked out, so any id works, as long as the embedding has a row for it (tiny test configs keep GPT-2's 50256)
    pad = next((t for t in (first("pad_token_id"), eos) if t is not None and 0 <= t < vocab), 0)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    return pad


def check_length(info: HFModelInfo, total: int, what: str, fix: str) -> None:
    """Hold a run of `total` tokens (longest prompt + new tokens, spelled out in `what`) to the model's configured
    context (validate.past_context, validate.context_error)."""
    if info.context is None or not past_context(total, info.context):
        return
    why = (
        f"learned absolute positions: the model has no embedding past position {info.context - 1}"
        if info.learned_positions
        else f"its config's maximum length is {info.context}"
    )
    raise context_error(f"{what} = {total}", info.context, fix, why=why, grouped=False)
