"""Standard speculative decoding (method "sd"; Leviathan et al. 2023, Chen et al. 2023; paper 000
Alg 5): a drafter with the target's vocabulary proposes K tokens, the target scores them in one
forward, and `specops.ops.chain_verify` accepts a prefix and emits one more token. Lossless: greedy
output equals greedy decoding, sampled output follows the target's distribution."""

from __future__ import annotations

import time

import torch

from specops import ops
from specops.decoding.ar import prefill
from specops.decoding.draft_length import DraftLength
from specops.decoding.engine import Batch, CausalLM, KVState, SamplingParams, Stats, sample_tokens

# Offsets of the draft random numbers: step << _DRAFT_SHIFT | draft index (drafts per step < 256).
_DRAFT_SHIFT = 8


class DraftVocab:
    """How drafts cross from the drafter's vocabulary into the target's.

    target_ids [drafter LM-head rows]: each drafter id's id in the verification vocabulary (-1: never
    drafted), which has `width` >= the target's vocabulary; the columns past it (the union's
    drafter-only tokens, paper 000 Alg 1) get target logits of -inf. to_drafter: target ids -> the
    drafter ids that say the same (what the drafter reads after the target emitted them).
    """

    def __init__(self, target_ids: torch.Tensor, width: int, target_vocab: int, to_drafter):
        self.target_ids = target_ids
        self.width = width
        self.target_vocab = target_vocab
        self.to_drafter = to_drafter

    @classmethod
    def same(cls, vocab_size: int, device) -> DraftVocab:
        """The target's own vocabulary (standard speculative decoding)."""
        return cls(torch.arange(vocab_size, device=device), vocab_size, vocab_size, lambda ids: list(ids))

    def draft(self, logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, step: int, index: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One draft per row from drafter logits [B, V_d]: (target ids, drafter ids, q [B, width] or None
        when greedy), q being exactly the distribution the draft was drawn from."""
        q, tokens, drafter_tokens = ops.vocab_project(
            logits, self.target_ids, self.width, temperature=params.temperature, top_k=params.top_k,
            top_p=params.top_p, seed=seeds, offset=(step << _DRAFT_SHIFT) | index, validate=False)
        return tokens, drafter_tokens, None if params.greedy else q

    def widen(self, target_logits: torch.Tensor) -> torch.Tensor:
        """Target logits [..., V] over the verification vocabulary (-inf for drafter-only tokens)."""
        extra = self.width - self.target_vocab
        if not extra:
            return target_logits
        pad = target_logits.new_full((*target_logits.shape[:-1], extra), float("-inf"))
        return torch.cat([target_logits, pad], dim=-1)


def _left_aligned(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists as [B, n] tokens and validity, holes first so every row ends on a real token."""
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        tokens[b, width - len(r):] = torch.tensor(r, dtype=torch.long)
        valid[b, width - len(r):] = True
    return tokens.to(device), valid.to(device)


_SHORT_CATCH_UP = 4  # a catch-up longer than this (a prompt) is not a per-call cost sample


def prompt_rows(batch: Batch, tokenizer=None) -> list[list[int]]:
    """Each running request's prompt ids (in `tokenizer`'s vocabulary when given), without padding: a
    drafter reads them with its first draft, so a request that never drafts never runs the drafter."""
    ids, mask = (batch.prompt_ids, batch.prompt_mask) if tokenizer is None else batch.encode(tokenizer)
    return [[t for t, m in zip(row, row_mask) if m] for row, row_mask in zip(ids.tolist(), mask.tolist())]


def run_drafter(drafter: CausalLM, state: KVState, pending: list[list[int]], k: int, draw, stats: Stats
                ) -> float | None:
    """The drafter reads each row's pending tokens (ragged), then drafts k tokens: draw(logits [B, V_d],
    i) picks draft i and returns the drafter ids [B] it reads next. Returns the seconds of one short
    drafter call (for the draft-length controller; None if every call read a long catch-up)."""
    start = time.perf_counter()
    calls_before = drafter.calls
    tokens, valid = _left_aligned(pending, drafter.device)
    seconds_before = drafter.seconds
    logits = state.append(tokens, valid)[:, -1]
    samples = [drafter.seconds - seconds_before] if tokens.shape[1] <= _SHORT_CATCH_UP else []
    for i in range(k):
        fed = draw(logits, i)
        if i + 1 < k:
            seconds_before = drafter.seconds
            logits = state.append(fed.unsqueeze(1))[:, -1]
            samples.append(drafter.seconds - seconds_before)
    stats.drafter_calls += drafter.calls - calls_before
    stats.draft_seconds += time.perf_counter() - start
    return sum(samples) / len(samples) if samples else None


def drop_finished(batch: Batch, finished: list[int], states: tuple[KVState, ...], seeds: torch.Tensor,
                  last: torch.Tensor, *per_row: list) -> tuple[torch.Tensor, torch.Tensor, tuple[list, ...]]:
    """Remove finished requests from the batch, the KV states, the per-row tensors and lists. When none is
    left the batch is empty and nothing else is touched."""
    survivors = batch.drop(finished)
    if survivors is None or not batch.rows:
        return seeds, last, per_row
    for state in states:
        state.select(survivors)
    rows = survivors.tolist()
    return seeds[survivors], last[survivors], tuple([values[r] for r in rows] for values in per_row)


def close_step(batch: Batch, stats: Stats, draft_length: DraftLength, k: int, new_tokens: list[list[int]],
               accepted: list[int], num_draft: list[int], target_seconds: float, drafter_seconds: float | None,
               outside_seconds: float) -> list[int]:
    """Emit a verified step's tokens, count its drafts and accepted drafts (those emitted, not cut at
    EOS or a stop), and tell the draft-length controller what it cost. Returns the finished rows."""
    finished, used = batch.emit(new_tokens)
    stats.drafted += sum(num_draft)
    stats.accepted += sum(min(n, u) for n, u in zip(accepted, used))
    stats.steps += 1
    stats.draft_lengths.append(k)
    draft_length.observe(k, target_seconds, drafter_seconds, outside_seconds, accepted, num_draft)
    return finished


def decode_sd(target: CausalLM, drafter: CausalLM, batch: Batch, params: SamplingParams, seeds: torch.Tensor,
              stats: Stats, draft_length: DraftLength, vocab: DraftVocab | None = None,
              drafter_tokenizer=None) -> None:
    """Speculative decoding with a drafter; `vocab` says how its drafts map into the target's vocabulary
    (TLI and union, tli.py), `drafter_tokenizer` encodes the prompts for it when that differs."""
    device = target.device
    vocab = vocab or DraftVocab.same(target.vocab_size, device)
    target_state, logits = prefill(target, batch, stats)
    stats.target_calls += 1
    drafter_state = KVState(drafter, batch.rows)
    last = sample_tokens(logits, params, seeds, 0)  # emitted, not yet seen by the target
    pending = [prompt + vocab.to_drafter([t])  # not yet seen by the drafter
               for prompt, t in zip(prompt_rows(batch, drafter_tokenizer), last.tolist())]
    finished, _ = batch.emit([[t] for t in last.tolist()])
    step = 1
    while True:
        seeds, last, (pending,) = drop_finished(batch, finished, (target_state, drafter_state), seeds, last, pending)
        if not batch.rows:
            return
        step_start = time.perf_counter()
        forwards_before = target.seconds + drafter.seconds
        k = draft_length.choose()
        num_draft = torch.clamp(batch.remaining() - 1, min=0, max=k)
        k = int(num_draft.max())
        drafts = torch.empty(batch.rows, k, dtype=torch.long, device=device)
        drafter_drafts = torch.empty(batch.rows, k, dtype=torch.long, device=device)
        draft_probs = None if params.greedy or k == 0 else torch.empty(batch.rows, k, vocab.width, device=device)
        drafter_seconds = None
        if k:
            def draw(draft_logits, i):
                drafts[:, i], drafter_drafts[:, i], q = vocab.draft(draft_logits, params, seeds, step, i)
                if q is not None:
                    draft_probs[:, i] = q
                return drafter_drafts[:, i]

            drafter_seconds = run_drafter(drafter, drafter_state, pending, k, draw, stats)
        # Verify: one target forward over the last emitted token and the drafts.
        start = time.perf_counter()
        target_before = target.seconds
        # A drafter-only token (union) is always rejected, so the target may read any id in its place.
        scored = torch.where(drafts < vocab.target_vocab, drafts, 0)
        verify_logits = vocab.widen(target_state.append(torch.cat([last.unsqueeze(1), scored], dim=1), keep=k + 1))
        target_seconds = target.seconds - target_before
        out, accepted = ops.chain_verify(verify_logits, drafts, draft_probs, num_draft=num_draft.to(device),
                                         temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                         seed=seeds, offset=step, validate=False)
        stats.verify_seconds += time.perf_counter() - start
        stats.target_calls += 1
        # Roll both caches back to the accepted prefix.
        target_state.rollback(k + 1, accepted + 1)
        if k:
            drafter_state.rollback(k - 1, torch.clamp(accepted, max=k - 1))
        accepted_list, out_list, drafts_list = accepted.tolist(), out.tolist(), drafter_drafts.tolist()
        new_tokens = [out_list[row][: n + 1] for row, n in enumerate(accepted_list)]
        if k:
            # The drafter has seen the accepted drafts up to k-1; all k accepted leaves draft k unseen.
            pending = [([drafts_list[row][k - 1]] if n == k else []) + vocab.to_drafter([out_list[row][n]])
                       for row, n in enumerate(accepted_list)]
        else:  # a plain decoding step: the drafter saw nothing and catches up later
            pending = [pending[row] + vocab.to_drafter([out_list[row][0]]) for row in range(batch.rows)]
        last = out[torch.arange(batch.rows, device=device), accepted]
        finished = close_step(batch, stats, draft_length, k, new_tokens, accepted_list, num_draft.tolist(),
                              target_seconds, drafter_seconds,
                              time.perf_counter() - step_start - (target.seconds + drafter.seconds - forwards_before))
        step += 1
