"""The one decoding loop every method runs: propose -> score and verify (one target forward) -> commit the
accepted tokens to the KV cache -> emit. It owns timing, statistics, stopping, streaming and the removal
of finished requests; a method only proposes (protocol.Proposer).
"""

from __future__ import annotations

import time

import torch

from specops.decoding.batch import Batch
from specops.decoding.engine import CausalLM, KVState
from specops.decoding.stats import Stats
from specops.decoding.protocol import Proposer, SamplingParams, StepResult
from specops.decoding.verify import VERIFIERS, sample

__all__ = ["run"]

_SHORT_CALL = 4  # a drafter forward reading more tokens than this (a catch-up) is not a per-draft cost


def _per_draft_seconds(drafters: tuple[CausalLM, ...]) -> float | None:
    """Mean seconds of the step's drafter forwards, leaving out a first call that caught up on a long
    stretch of text (a prompt)."""
    samples = []
    for lm in drafters:
        calls = lm.log[1:] if lm.log and lm.log[0][0] > _SHORT_CALL else lm.log
        samples += [seconds for _, seconds in calls]
    return sum(samples) / len(samples) if samples else None


def run(target: CausalLM, batch: Batch, params: SamplingParams, seeds: torch.Tensor, stats: Stats,
        proposer: Proposer, method: str) -> None:
    """Decode every request of `batch` to the end with `proposer`'s drafts (method `method`), filling
    `stats`: the only clock and counters of a decode call."""
    start = time.perf_counter()
    drafters = tuple(proposer.drafters)
    stats.method, stats.requests = method, batch.rows
    if proposer.scheme is not None and not params.greedy:
        stats.scheme, stats.scheme_reason = proposer.scheme.name, proposer.scheme.reason
    try:
        if batch.max_new_tokens > 0:
            _decode(target, batch, params, seeds, stats, proposer, drafters)
    finally:
        proposer.finish()
    stats.seconds = time.perf_counter() - start
    stats.new_tokens = sum(len(t) for t in batch.generated)
    stats.target_calls = target.calls
    stats.drafter_calls = sum(lm.calls for lm in drafters)
    stats.forward_seconds = target.seconds + sum(lm.seconds for lm in drafters)
    members = getattr(target, "members", None)
    if members is not None:  # an ensemble of targets: each member's forwards
        stats.member_calls = [lm.calls for lm in members]


def _decode(target: CausalLM, batch: Batch, params: SamplingParams, seeds: torch.Tensor, stats: Stats,
            proposer: Proposer, drafters: tuple[CausalLM, ...]) -> None:
    device = target.device
    verify = proposer.verifier if callable(proposer.verifier) else VERIFIERS[proposer.verifier]
    start = time.perf_counter()
    if hasattr(target, "new_state"):  # an ensemble of targets: a state made for its own rows
        state = target.new_state(batch.rows)
        logits = state.prefill(batch.prompt_rows)
        stats.request_steps += batch.rows
    else:
        # Several samples of one prompt (num_samples): read each prompt once, then fork its cache.
        samples = batch.samples
        state = KVState(target, batch.rows // samples)
        logits = state.prefill(batch.prompt_rows[::samples])
        stats.request_steps += batch.rows // samples
        if samples > 1:
            fork = torch.arange(batch.rows // samples, device=device).repeat_interleave(samples)
            state.select(fork)
            logits = logits[fork]
    stats.prefill_seconds += time.perf_counter() - start
    last = sample(logits, params, seeds, 0)  # emitted, not yet read by the target
    first = last.tolist()
    proposer.start(first)
    finished, _ = batch.emit([[t] for t in first])
    step = 1
    while True:
        survivors = batch.drop(finished)
        if survivors is not None:
            if not batch.rows:
                break
            state.select(survivors)
            proposer.select(survivors)
            rows = survivors.to(device)
            seeds, last = seeds[rows], last[rows]
        step_start = time.perf_counter()
        forwards_before = target.seconds + sum(lm.seconds for lm in drafters)
        for lm in drafters:
            lm.log.clear()
        budget = (batch.remaining() - 1).clamp(min=0).to(device)  # drafts a request may still emit
        proposal = proposer.propose(step, budget, last)
        verify_start = time.perf_counter()
        stats.draft_seconds += verify_start - step_start
        target_before = target.seconds
        verified = verify(state, last, proposal, params, seeds, step)
        state.settle()  # rows that kept different numbers of drafts move now: this step's cost, not the next's
        stats.verify_seconds += time.perf_counter() - verify_start
        target_seconds = target.seconds - target_before
        accepted, out = verified.accepted.tolist(), verified.out.tolist()
        num_draft = verified.num_draft.tolist()
        emitted = [out[row][: n + 1] for row, n in enumerate(accepted)]
        last = verified.out[torch.arange(batch.rows, device=device), verified.accepted]
        requests = list(batch.index)
        finished, used = batch.emit(emitted)
        stats.drafted += sum(num_draft)
        drafts_emitted = accepted if verified.accepted_drafts is None else verified.accepted_drafts.tolist()
        stats.accepted += sum(min(n, u) for n, u in zip(drafts_emitted, used))  # drafts emitted, not cut at a stop
        stats.steps += 1
        stats.request_steps += len(requests)
        stats.draft_lengths.append(verified.size)
        step_seconds = time.perf_counter() - step_start
        forwards = target.seconds + sum(lm.seconds for lm in drafters) - forwards_before
        proposer.accept(StepResult(
            emitted=emitted, accepted=accepted, num_draft=num_draft, finished={requests[r] for r in finished},
            size=verified.size, target_seconds=target_seconds, drafter_seconds=_per_draft_seconds(drafters),
            step_seconds=step_seconds, outside_seconds=step_seconds - forwards, accepted_tensor=verified.accepted))
        step += 1
