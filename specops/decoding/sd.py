"""Standard speculative decoding (method "sd"; Leviathan et al. 2023, Chen et al. 2023; paper 000
Alg 5): a drafter with the target's vocabulary proposes K tokens, the target scores them in one
forward, and `specops.ops.chain_verify` accepts a prefix and emits one more token. Lossless: greedy
output equals greedy decoding, sampled output follows the target's distribution."""

from __future__ import annotations

import time

import torch

from specops import ops, reference
from specops.decoding.ar import prefill
from specops.decoding.draft_length import DraftLength
from specops.decoding.engine import Batch, CausalLM, SamplingParams, Stats, sample_tokens


def draft_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """q [B, V]: the drafter's distribution under the request's temperature / top-k / top-p (the
    distribution the draft is sampled from, which verification must be given)."""
    batch = logits.shape[0]
    filtered = reference.filter_logits(
        logits, torch.full((batch,), params.temperature, device=logits.device),
        torch.full((batch,), params.top_k, device=logits.device),
        torch.full((batch,), params.top_p, device=logits.device))
    return torch.softmax(filtered, dim=-1)


def _left_aligned(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists as [B, n] tokens and validity, holes first so every row ends on a real token."""
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        tokens[b, width - len(r):] = torch.tensor(r, dtype=torch.long)
        valid[b, width - len(r):] = True
    return tokens.to(device), valid.to(device)


def decode_sd(target: CausalLM, drafter: CausalLM, batch: Batch, params: SamplingParams, seeds: torch.Tensor,
              stats: Stats, draft_length: DraftLength, generator: torch.Generator) -> None:
    device = target.device
    target_state, logits = prefill(target, batch, stats)
    stats.target_calls += 1
    drafter_state, _ = prefill(drafter, batch, stats)
    stats.drafter_calls += 1
    last = sample_tokens(logits, params, seeds, 0)  # emitted, not yet seen by the target
    pending = [[t] for t in last.tolist()]  # emitted, not yet seen by the drafter
    finished, _ = batch.emit([[t] for t in last.tolist()])
    step = 1
    while True:
        survivors = batch.drop(finished)
        if survivors is not None:
            if not batch.rows:
                return
            for state in (target_state, drafter_state):
                state.select(survivors)
            seeds, last = seeds[survivors], last[survivors]
            pending = [pending[r] for r in survivors.tolist()]
        step_start = time.perf_counter()
        forwards_before = target.seconds + drafter.seconds
        k = draft_length.choose()
        num_draft = torch.clamp(batch.remaining() - 1, min=0, max=k)
        k = int(num_draft.max())
        drafts = torch.empty(batch.rows, k, dtype=torch.long, device=device)
        draft_probs = None if params.greedy or k == 0 else torch.empty(batch.rows, k, target.vocab_size,
                                                                       device=device)
        drafter_seconds = None
        if k:
            # Draft: the drafter catches up on the tokens it has not seen, then proposes k tokens.
            start = time.perf_counter()
            calls_before, seconds_before = drafter.calls, drafter.seconds
            tokens, valid = _left_aligned(pending, device)
            draft_logits = drafter_state.append(tokens, valid)[:, -1]
            for i in range(k):
                if params.greedy:
                    drafts[:, i] = draft_logits.argmax(-1)
                else:
                    q = draft_distribution(draft_logits, params)
                    draft_probs[:, i] = q
                    drafts[:, i] = torch.multinomial(q, 1, generator=generator)[:, 0]
                if i + 1 < k:
                    draft_logits = drafter_state.append(drafts[:, i:i + 1])[:, -1]
            stats.drafter_calls += drafter.calls - calls_before
            drafter_seconds = (drafter.seconds - seconds_before) / (drafter.calls - calls_before)
            stats.draft_seconds += time.perf_counter() - start
        # Verify: one target forward over the last emitted token and the drafts.
        start = time.perf_counter()
        target_before = target.seconds
        verify_logits = target_state.append(torch.cat([last.unsqueeze(1), drafts], dim=1), keep=k + 1)
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
        accepted_list, out_list, drafts_list = accepted.tolist(), out.tolist(), drafts.tolist()
        new_tokens = [out_list[row][: n + 1] for row, n in enumerate(accepted_list)]
        if k:
            # The drafter has seen the accepted drafts up to k-1; all k accepted leaves draft k unseen.
            pending = [[drafts_list[row][k - 1], out_list[row][n]] if n == k else [out_list[row][n]]
                       for row, n in enumerate(accepted_list)]
        else:  # a plain decoding step: the drafter saw nothing and catches up later
            pending = [pending[row] + [out_list[row][0]] for row in range(batch.rows)]
        last = out[torch.arange(batch.rows, device=device), accepted]
        finished, used = batch.emit(new_tokens)
        stats.drafted += int(num_draft.sum())
        stats.accepted += sum(min(n, u) for n, u in zip(accepted_list, used))  # drafts emitted, not cut at EOS
        stats.steps += 1
        stats.draft_lengths.append(k)
        step_seconds = time.perf_counter() - step_start
        outside = step_seconds - (target.seconds + drafter.seconds - forwards_before)
        draft_length.observe(k, target_seconds, drafter_seconds, outside, accepted_list, num_draft.tolist())
        step += 1
