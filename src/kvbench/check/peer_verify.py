"""`kvbench verify --engine PEER`: a peer engine's cache (CTranslate2) held to transformers' GPT2LMHeadModel on the
same weights, with no cache, over the same tokens.

Four checks per peer, each teacher-forced on the tokens the peer itself chose (so a step compares two distributions
over one prefix, never two texts that drifted apart):

    logits        prompts[0] alone: every generated step's logits from the peer's cached path against the reference
                  forward over prompt + the tokens before that step
    greedy        the peer's greedy tokens against the reference's own greedy tokens (no cache)
    batched       every prompt (distinct lengths) in one call: each sequence's steps against the reference, and its
                  tokens against the same prompt generated alone
    prefix-cache  prompts[0] as a cached prefix (its first half, `static_prompt`) + the rest, run twice: the warm
                  run (the prefix's K/V read from the peer's prefix cache) against the cold one (the same call that
                  computed and kept them), and against the reference

An exact peer (PeerSpec.exact) is held to the reference tolerance (check/judge.py: fp32 1e-5 of the row's scale);
a lossy one (int8 weights) to its stated bound, mean KL <= `max_kl` nats (llama.cpp's measure), with its distortion
(KL mean and p99, top-1 agreement, RMS Δp, and the worst depth bin) in every row and in the report. `hold_exact` holds a lossy
peer to the exact tolerance (a deployment that claims exactness): it then fails with those figures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbench.check.distortion import Distortion, Steps, step_figures, summarise, weights_note
from kvbench.check.judge import (
    CheckRow,
    VerifyReport,
    allclose_err,
    compare_tokens,
    first_diff,
    not_finite,
    tolerance,
    verdict,
)
from kvbench.model.gpt2 import GPT
from kvbench.peers import PeerRunner, PeerSpec, load

REFERENCE = "transformers GPT2LMHeadModel (eager attention, no cache, float32)"
# what each family's prefix cache is (the prefix-cache row): warm (the second call with the prefix, which reads it
# from the cache) vs cold (the first, which computed it)
PREFIX_CACHES = {
    "ct2": "CTranslate2: static_prompt with cache_static_prompt=True",
    "llamacpp": "llama.cpp: the context's cache reused up to the shared prefix, the rest dropped and evaluated",
}


def prefix_cache_note(peers: list[PeerSpec]) -> str:
    kinds = "; ".join(PREFIX_CACHES[f] for f in dict.fromkeys(p.family for p in peers))
    return (
        f"prefix-cache: the peer's own prefix cache ({kinds}), warm (the second call with the prefix, which reads it "
        "from the cache) vs cold (the first, which computed it)"
    )


@dataclass
class Judged:
    """One peer's steps against the reference: within the tolerance, the worst |difference|, the distortion."""

    ok: bool
    err: float
    figures: Distortion
    words: str


class Reference:
    """transformers' GPT2LMHeadModel on `model`'s weights: logits over whole sequences, and greedy tokens."""

    def __init__(self, model: GPT) -> None:
        from kvbench.model.weights import to_hf_model

        self.hf = to_hf_model(model, "eager", torch.float32).cpu()

    @torch.inference_mode()
    def logits(self, seq: list[int]) -> torch.Tensor:
        return self.hf(torch.tensor([seq])).logits[0].float()  # (T, V)

    def last(self, seq: list[int]) -> torch.Tensor:
        """(V,): the logits after `seq`, in storage of its own (a view of the row would keep the whole (T, V)
        forward alive: over a greedy run, memory quadratic in its length)."""
        return self.logits(seq)[-1].clone()

    def steps(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """(N, V): the logits each of N generated tokens was chosen from, teacher-forced on `tokens`."""
        return self.logits(prompt + tokens[:-1])[len(prompt) - 1 :]

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        seq, rows = list(prompt), []
        for _ in range(n):
            row = self.last(seq)  # (V,)
            rows.append(row)
            seq.append(int(row.argmax()))
        return seq[len(prompt) :], torch.stack(rows)


def judge(peer: PeerSpec, got: torch.Tensor, want: torch.Tensor, depth0: int, hold_exact: bool, note: str) -> Judged:
    """got/want (N, V) logits of N steps, the first at context `depth0`."""
    kl, top1, dp = step_figures(want, got)  # (N,) each

    figures = summarise(
        peer.name, Steps(kl[None], top1[None], dp[None], list(range(depth0, depth0 + len(kl)))), REFERENCE, note
    )
    if peer.exact or hold_exact:
        tol = tolerance(torch.float32, reference=True)
        ok, err = allclose_err(got, want, tol.rtol, tol.atol)
        words = f"logits within rtol {tol.rtol:g} x row scale + atol {tol.atol:g}" + (
            " (held exact)" if not peer.exact else ""
        )
        return Judged(ok, err, figures, words)
    err = float((got - want).abs().max())
    ok = figures.kl_mean <= peer.max_kl
    return Judged(ok, err, figures, f"lossy: mean KL <= {peer.max_kl:g} nats")


def distortion_words(d: Distortion) -> str:
    kl = torch.tensor(d.per_step["kl"])
    dp = torch.tensor(d.per_step["abs_dp"])
    worst = max(d.by_depth, key=lambda b: b.kl_mean)
    return (
        f"mean KL {d.kl_mean:.3g} nats, p99 {float(kl.quantile(0.99)):.3g}, top-1 {d.top1_agreement:.1%}, RMS Δp "
        f"{float(dp.square().mean().sqrt()):.3g}; worst depth {worst.depth_from}-{worst.depth_to}: KL "
        f"{worst.kl_mean:.3g}, top-1 {worst.top1_agreement:.1%}"
    )


def _row(name: str, peer: PeerSpec, j: Judged, what: str) -> CheckRow:
    return CheckRow(
        name=name,
        cache=peer.name,
        passed=j.ok,
        max_abs_diff=j.err,
        tolerance=j.words,
        detail=f"{what}; {distortion_words(j.figures)}",
    )


def check_logits(
    peer: PeerSpec, runner: PeerRunner, ref: Reference, prompt: list[int], n: int, hold: bool, note: str
) -> tuple[CheckRow, Distortion | None]:
    g = runner.generate([prompt], n, record_logits=True)
    got, want = g.rows[0], ref.steps(prompt, g.tokens[0])
    bad = not_finite([("the reference", want), (peer.name, got)])
    if bad:
        return CheckRow(name="logits", cache=peer.name, passed=False, tolerance="finite logits", detail=bad), None
    j = judge(peer, got, want, len(prompt), hold, note)
    return _row("logits", peer, j, f"{n} cached steps after a {len(prompt)}-token prompt"), j.figures


def check_greedy(peer: PeerSpec, runner: PeerRunner, ref: Reference, prompt: list[int], n: int, hold: bool) -> CheckRow:
    g = runner.generate([prompt], n, record_logits=True)
    want, want_rows = ref.greedy(prompt, n)
    if not (peer.exact or hold):  # a lossy peer's text drifts from its first flip: the logits row judges it
        first = first_diff(want, g.tokens[0])
        where = "all identical" if first is None else f"first differs at step {first}"
        return CheckRow(
            name="greedy",
            cache=peer.name,
            passed=True,
            first_divergence=first,
            tolerance="lossy: reported (judged teacher-forced by the logits row)",
            detail=f"{n} greedy tokens vs the reference's: {where}",
        )
    return compare_tokens(
        name="greedy",
        cache=peer.name,
        dtype=torch.float32,
        want=want,
        got=g.tokens[0],
        want_rows=want_rows,
        got_rows=g.rows[0],
        what=f"{n} greedy tokens vs the reference's",
        got_where=peer.name,
    )


def check_batched(
    peer: PeerSpec, runner: PeerRunner, ref: Reference, prompts: list[list[int]], n: int, hold: bool, note: str
) -> CheckRow:
    batch = runner.generate(prompts, n, record_logits=True)
    judged, alone_diff = [], []
    for i, p in enumerate(prompts):
        judged.append(judge(peer, batch.rows[i], ref.steps(p, batch.tokens[i]), len(p), hold, note))
        alone = runner.generate([p], n).tokens[0]
        if alone != batch.tokens[i]:
            alone_diff.append(i)
    worst = max(judged, key=lambda j: j.err)
    ok = all(j.ok for j in judged) and (not alone_diff or not (peer.exact or hold))
    lens = "/".join(str(len(p)) for p in prompts)
    what = f"{len(prompts)} prompts of {lens} tokens in one call, {n} steps each"
    if alone_diff:
        what += f"; sequence(s) {', '.join(map(str, alone_diff))} chose other tokens than alone"
    return _row("batched", peer, Judged(ok, worst.err, worst.figures, worst.words), what)


def check_prefix_cache(
    peer: PeerSpec, runner: PeerRunner, ref: Reference, prompt: list[int], n: int, hold: bool, note: str
) -> CheckRow:
    half = max(1, len(prompt) // 2)
    prefix, rest = prompt[:half], prompt[half:]
    cold = runner.generate([rest], n, record_logits=True, prefix=prefix)  # computes the prefix and keeps it
    warm = runner.generate([rest], n, record_logits=True, prefix=prefix)  # reads the kept prefix
    j = judge(peer, warm.rows[0], ref.steps(prompt, warm.tokens[0]), len(prompt), hold, note)
    first = first_diff(cold.tokens[0], warm.tokens[0])
    same = first is None
    if same:
        vs_cold = float((warm.rows[0] - cold.rows[0]).abs().max())
        versus = "bit-identical" if vs_cold == 0.0 else f"tokens identical, logits within {vs_cold:.3g}"
    else:
        versus = f"tokens differ from step {first}"
    what = f"a {half}-token cached prefix + {len(rest)} tokens, {n} steps; warm vs cold: {versus}"
    ok = j.ok and (same or not (peer.exact or hold))
    return _row("prefix-cache", peer, Judged(ok, j.err, j.figures, j.words), what)


def run_peer_verify(
    model: GPT,
    peers: list[PeerSpec],
    prompts: list[list[int]],
    new_tokens: int,
    hold_exact: bool = False,
    on_row: Callable[[CheckRow], None] | None = None,
    random_weights: bool = False,
    threads: int | None = None,
) -> VerifyReport:
    ref = Reference(model)
    note = weights_note(random_weights)
    rows: list[CheckRow] = []
    costs: dict[str, dict] = {}
    for peer in peers:
        runner = load(model, peer, threads or torch.get_num_threads())
        row, figures = check_logits(peer, runner, ref, prompts[0], new_tokens, hold_exact, note)
        found = [row]
        found.append(check_greedy(peer, runner, ref, prompts[0], new_tokens, hold_exact))
        found.append(check_batched(peer, runner, ref, prompts, new_tokens, hold_exact, note))
        found.append(check_prefix_cache(peer, runner, ref, prompts[0], new_tokens, hold_exact, note))
        for r in found:
            rows.append(r)
            if on_row is not None:
                on_row(r)
        if figures is not None and not peer.exact:
            costs[peer.name] = figures.as_dict()
    notes = [
        f"peers: {', '.join(f'{p.name} ({p.summary})' for p in peers)}; converted from these weights by the peer's "
        "own converter or format",
        prefix_cache_note(peers),
    ]
    if hold_exact:
        notes.append("--hold-exact: lossy peers held to the exact fp32 tolerance")
    judged = verdict(rows)
    return VerifyReport(
        passed=judged["passed"],
        nothing_checked=judged["nothing_checked"],
        checks=rows,
        dtype="fp32",
        new_tokens=new_tokens,
        prompt_len=len(prompts[0]),
        batch_lens=[len(p) for p in prompts],
        reference=REFERENCE,
        notes=notes,
        distortion=costs,
    )
