"""The command-line options of generate, bench, memory and compare, each declared once as an `Annotated` alias.

A command's signature names an option by its alias and gives its default (`batch: BenchBatchOpt = None`); the flag,
its short form and its help live here. An option with the same flag and help in several commands is one alias
(ModelOpt, DeviceOpt, JsonOpt, ...). The `--hf` options are in cli/hf.py. Only typer is imported, so `kvbench --help`
stays fast.

A short option means one thing in every command: -m --model, -w --weights, -d --device, -o --out, -n --new-tokens,
-c --cache, -p --prompt, -b --batch (memory), -t --temperature (generate), -f --format (compare). A new option
takes no short form unless it is one of these long options.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

# --- shared by the commands that load our GPT-2 ---------------------------------------------------------------------
ModelOpt = Annotated[
    str,
    typer.Option(
        "--model", "-m", help="gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt2-tiny, or a GPT-2 config.json."
    ),
]
WeightsOpt = Annotated[
    str,
    typer.Option(
        "--weights", "-w", help="auto | hub | random | PATH (a local Hugging Face GPT-2 directory)."
    ),
]
DeviceOpt = Annotated[str, typer.Option("--device", "-d", help="auto | cpu | cuda | cuda:N.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for random weights, random prompts and sampling.")]
TokenizerOpt = Annotated[
    str | None,
    typer.Option(
        "--tokenizer",
        help="A .tiktoken ranks file or a directory with vocab.json + merges.txt (default: $KVBENCH_TOKENIZER, "
        "else GPT-2's ranks file shipped inside kvbench; nothing is downloaded).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document to stdout and nothing else.")]
COMPILE_HELP = (
    "How static-graph's fixed-shape decode step runs: off (eager), default (torch.compile), or max (CPU only: "
    "weights frozen into the step, GEMMs autotuned over Inductor's C++ templates). The first step compiles."
)
CompileOpt = Annotated[str, typer.Option("--compile", help=COMPILE_HELP)]
JUnitXmlOpt = Annotated[
    Path | None,
    typer.Option(
        "--junit-xml",
        help="Also write the verdict as JUnit XML to this file (one test case per row), for CI test reports; "
        "written when checks fail too, and as one error case when the run is refused.",
    ),
]
VerboseOpt = Annotated[
    bool, typer.Option("--verbose", "-v", help="Print every row's tolerance and detail in full.")
]


DTYPE_HELP = (
    "fp32 | fp16 | bf16 | auto (fp16 on CUDA, fp32 on CPU); torch's names work too: float32/float, float16/half, "
    "bfloat16 (case-insensitive)."
)


def dtype_opt(default: str) -> object:
    """`--dtype` with its default inside the option (`dtype: str = dtype_opt("fp32")`)."""
    return typer.Option(default, "--dtype", help=DTYPE_HELP)


# --- generate --------------------------------------------------------------------------------------------------------
PromptArg = Annotated[str | None, typer.Argument(help="The prompt (or use --prompt / --prompts-file).")]
PromptsOpt = Annotated[
    list[str] | None,
    typer.Option("--prompt", "-p", help="A prompt; repeat for a batch decoded together."),
]
PromptsFileOpt = Annotated[
    Path | None,
    typer.Option("--prompts-file", help="One prompt per line, decoded together as a batch."),
]
GenerateNewTokensOpt = Annotated[
    int,
    typer.Option("--new-tokens", "--max-new-tokens", "-n", help="Tokens to generate (at most, with --stop)."),
]
GenerateCacheOpt = Annotated[str, typer.Option("--cache", "-c", help="KV cache: none, dynamic, static, ...")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy.")]
TopKOpt = Annotated[int | None, typer.Option("--top-k", help="Sample from the k most likely tokens.")]
StopOpt = Annotated[bool, typer.Option("--stop/--no-stop", help="Stop a sequence at <|endoftext|>.")]
DraftOpt = Annotated[
    str,
    typer.Option(
        "--draft",
        help="none, or prompt-lookup: speculative decoding that drafts tokens by copying what followed the last "
        "n-gram earlier in the text and verifies them in one forward (one prompt, greedy; the same tokens).",
    ),
]
DraftTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--draft-tokens", help="With --draft prompt-lookup: most draft tokens per forward (default: 4)."
    ),
]
NgramOpt = Annotated[
    int | None,
    typer.Option(
        "--ngram",
        help="With --draft prompt-lookup: longest suffix looked up, then shorter ones down to 1 (default: 3).",
    ),
]

# --- bench: every option but --force and the --baseline pair is a BenchSettings field (None: not given) -----------
BenchPromptLenOpt = Annotated[
    str | None,
    typer.Option(
        "--prompt-len",
        help="Prompt lengths (with --fill random: contexts) to sweep, comma-separated; a k suffix is x1024, "
        "e.g. 256,1k,4k,16k (default: 16,128,512).",
    ),
]
BenchNewTokensOpt = Annotated[
    int | None, typer.Option("--new-tokens", "-n", help="Tokens generated per run (default: 400).")
]
BenchCachesOpt = Annotated[
    str | None,
    typer.Option(
        "--caches",
        help="Comma-separated cache names, or 'all' (default: all registered). With --hf: none, dynamic, "
        "static, static-compiled.",
    ),
]
EngineOpt = Annotated[
    str | None,
    typer.Option(
        "--engine",
        help="kvbench, hf (transformers' generate, eager), hf-compiled (its static cache with its default "
        "torch.compile), comma-separated (default: kvbench,hf).",
    ),
]
BenchBatchOpt = Annotated[
    str | None,
    typer.Option(
        "--batch",
        help="Sequences per run, comma-separated to sweep batch sizes (rows per size, batch.png), e.g. 1,4,16,64 "
        "(default: 1).",
    ),
]
RepeatsOpt = Annotated[
    int | None, typer.Option("--repeats", help="Timed runs per configuration (default: 3).")
]
WarmupOpt = Annotated[
    int | None,
    typer.Option("--warmup", help="Runs before the timed ones; the first is reported as cold (default: 1)."),
]
BenchConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", help="A TOML sweep (configs/bench/) or a shipped one by name (seed, quick)."),
]
BenchOutOpt = Annotated[
    str | None, typer.Option("--out", "-o", help="Run folder (default: results/<timestamp>-bench/).")
]
ForceOpt = Annotated[
    bool, typer.Option("--force", help="Replace the bench files of an earlier run in --out.")
]
BenchDtypeOpt = Annotated[str | None, typer.Option("--dtype", help=DTYPE_HELP)]
ThreadsOpt = Annotated[
    int | None,
    typer.Option("--threads", help="torch CPU threads (default: torch's default: one per core)."),
]
BaselineOpt = Annotated[
    Path | None,
    typer.Option(
        "--baseline",
        help="A previous run folder: compare this run against it when the sweep ends (as kvbench compare).",
    ),
]
BenchAllowEnvChangeOpt = Annotated[
    bool,
    typer.Option(
        "--allow-env-change",
        help="With --baseline: compare even though the baseline ran on another device, dtype or library "
        "versions (the changes are printed).",
    ),
]
FillOpt = Annotated[
    str | None,
    typer.Option(
        "--fill",
        help="prefill (default): a real prefill fills the cache, TTFT and decode timed. random: caches filled "
        "with random K/V to each --prompt-len without a prefill, only decode timed (long contexts: -m gpt2-long).",
    ),
]
OrderOpt = Annotated[
    str | None,
    typer.Option(
        "--order",
        help="sequential (default): each configuration's runs back to back. interleaved: cold and warm-up runs "
        "back to back, then the timed runs in rounds over every configuration of a prompt length, so drift on "
        "a shared machine hits every row alike (rows are written when the prompt length's rounds end).",
    ),
]
BenchCompileOpt = Annotated[str | None, typer.Option("--compile", help=COMPILE_HELP + " Default: off.")]
ExportOpt = Annotated[
    tuple[str, Path] | None,
    typer.Option(
        "--export",
        help="FORMAT FILE: when the sweep ends, also write its ok rows for a charting tool; FORMAT: "
        "github-action-benchmark (customSmallerIsBetter: TPOT and TTFT medians in ms per row).",
    ),
]
PercentilesOpt = Annotated[
    str | None,
    typer.Option(
        "--percentiles",
        help="TPOT percentiles written to summary.csv as tpot_ms_pNN, comma-separated, each strictly between 0 "
        "and 100 (default: 50,90,99; the median and p90 columns are always written).",
    ),
]

# --- memory: every option is a memory.Options field -----------------------------------------------------------------
MemoryModelOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--model",
        "-m",
        help="Preset from configs/models.toml (llama-3-8b), a local model directory or config.json, or a Hugging "
        "Face hub id (org/name; fetches its config.json) (repeatable).",
    ),
]
MemoryConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="Any Hugging Face config.json of a decoder LLM (resolved by transformers); as --model PATH.",
    ),
]
AllOpt = Annotated[bool, typer.Option("--all", help="One table for every preset.")]
CtxOpt = Annotated[
    str | None,
    typer.Option(
        "--ctx",
        help="Context lengths, e.g. 8k,32k,128k (k = 1024 tokens, m = 1024k). "
        "Default: the model's max context; 8k,128k with --all.",
    ),
]
MemoryBatchOpt = Annotated[
    str, typer.Option("--batch", "-b", help="Sequences held at once: one, or a list such as 1,16.")
]
KVDtypeOpt = Annotated[
    str,
    typer.Option(
        "--kv-dtype",
        help="fp32 | fp16 | bf16 | fp8 | int8 | int4 (int8/int4 add group scales); also float32/float, "
        "float16/half, bfloat16, fp8_e4m3/float8_e4m3fn (case-insensitive).",
    ),
]
WeightsDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--weights-dtype",
        help="fp32 | fp16 | bf16 (default) | fp8 | int8 | int4; torch's names work too (float16, bfloat16, ...).",
    ),
]
GPUOpt = Annotated[
    str | None,
    typer.Option("--gpu", help="GPU preset from configs/gpus.toml: t4, a100-80gb, h100, h200, ..."),
]
GPUMemOpt = Annotated[
    str | None, typer.Option("--gpu-mem", help="GPU memory instead of --gpu, e.g. 80GiB (GB = 10^9 B).")
]
OverheadOpt = Annotated[
    str | None,
    typer.Option(
        "--overhead", help="Allowance for activations, CUDA context, allocator: 10% (default) or 4GiB."
    ),
]
TPOpt = Annotated[int | None, typer.Option("--tp", help="Tensor-parallel GPUs (KV heads split across them).")]
CheckOpt = Annotated[
    bool,
    typer.Option(
        "--check",
        help="Also allocate transformers' own cache for the model on the meta device and compare per layer kind.",
    ),
]
CopyTrafficOpt = Annotated[
    bool,
    typer.Option("--copy-traffic", help="Bytes a torch.cat cache copies growing from --from to --to."),
]
FromOpt = Annotated[
    int | None, typer.Option("--from", help="Tokens cached at the start (--copy-traffic; default 128).")
]
ToOpt = Annotated[
    int | None, typer.Option("--to", help="Tokens cached at the end (--copy-traffic; default 528).")
]
MeasureOpt = Annotated[
    bool,
    typer.Option("--measure", help="gpt2 family: allocate every registered cache and compare bytes."),
]
LengthsOpt = Annotated[
    str | None,
    typer.Option(
        "--lengths",
        help="With --measure: a batch of mixed sequence lengths, e.g. 37,130,260,528: the blocks a paged "
        "cache holds vs a static cache's batch x max-length reservation (max length: --ctx, else the longest).",
    ),
]
MemoryCachesOpt = Annotated[
    str | None,
    typer.Option(
        "--caches",
        help="With --measure: the caches to allocate, comma-separated names or pkg.module:Class plugins "
        "(default: all).",
    ),
]
MemoryDeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--device", "-d", help="Where --measure and the copy counter run: auto | cpu | cuda | cuda:N."
    ),
]

# --- compare ---------------------------------------------------------------------------------------------------------
BaselineArg = Annotated[Path, typer.Argument(help="The reference run folder (written by kvbench bench).")]
CandidateArg = Annotated[Path, typer.Argument(help="The run folder to judge against it.")]
AlphaOpt = Annotated[
    float, typer.Option("--alpha", help="Significance level of the Mann-Whitney U test on decode steps.")
]
ThresholdOpt = Annotated[
    str,
    typer.Option(
        "--threshold", help="Minimum TPOT change that counts, e.g. 5% or 0.05 (smaller: no change)."
    ),
]
FailOnOpt = Annotated[
    str | None,
    typer.Option(
        "--fail-on",
        help="Exit 1 when any row regresses: slower (TPOT), slower-ttft, memory, comma-separated (the CI gate).",
    ),
]
FormatOpt = Annotated[
    str, typer.Option("--format", "-f", help="table (Rich), md (Markdown for a pull request) or json.")
]
CompareAllowEnvChangeOpt = Annotated[
    bool,
    typer.Option(
        "--allow-env-change",
        help="Compare runs from different devices, dtypes or library versions (the changes are printed).",
    ),
]
CompareOutOpt = Annotated[
    str | None,
    typer.Option(
        "--out", "-o", help="Where compare.png and compare.json go (default: the CANDIDATE folder)."
    ),
]
ProfileOpt = Annotated[
    bool | None,
    typer.Option(
        "--profile/--no-profile",
        help="One more warm run per configuration under torch.profiler, after the timed ones: a Chrome/Perfetto "
        "trace in the run folder's profile/, its top operators by self time in profile_ops.csv and printed.",
    ),
]
