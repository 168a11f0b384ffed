"""Learning-free n-gram drafting (method "ngram"; paper 001): drafts that cost almost nothing, taken
from the context and from the model's own weights, k rows of w tokens verified in one target forward.

Each step fills k draft rows (section 4.3, mixed strategy): first the context n-grams that continue the
last tokens (`specops.ops.ngram_match`: longest match first, then most frequent, then most recent), a
match cut short by the end of the context extended with the model bigram; the remaining rows from the
extended model bigram (the bigram's top-k after the last token, each continued with top-1 lookups), or
from the model unigram when no bigram table is given. The rows form one token tree per request (shared
prefixes once), which the target scores in a single forward over its KV cache, without copying the
cache per row. Each request then verifies one row: the one whose expected accepted prefix under the
target is longest (tree.choose_path); chain_verify checks it as deterministic drafts (q one-hot), so
greedy output equals greedy decoding and sampled output follows the target exactly. The cache keeps
that row's accepted prefix, compacted. k and w come from draft_shape.DraftShape.
"""

from __future__ import annotations

import time

import torch

from specops import ops
from specops.decoding.ar import prefill
from specops.decoding.draft_shape import DraftShape
from specops.decoding.engine import Batch, CausalLM, SamplingParams, Stats, sample_tokens
from specops.decoding.model_ngrams import extend
from specops.decoding.tree import build_tree, choose_path

__all__ = ["NgramDrafter", "decode_ngram"]


class NgramDrafter:
    """Draft rows from the running contexts: context n-grams first, then the model bigram (or unigram).

    contexts [B, C] int64 hold each request's prompt and generated tokens, right-padded; lengths [B]."""

    def __init__(self, batch: Batch, bigram: torch.Tensor | None, unigram: torch.Tensor | None,
                 min_ngram: int = 1, max_ngram: int = 4):
        device = batch.prompt_ids.device
        prompts = [batch.prompt_ids[b][batch.prompt_mask[b].bool()] for b in range(batch.rows)]
        self.prompt_lengths = [len(p) for p in prompts]
        self.contexts = torch.zeros(batch.rows, max(self.prompt_lengths) + batch.max_new_tokens + 1,
                                    dtype=torch.int64, device=device)
        for b, p in enumerate(prompts):
            self.contexts[b, :len(p)] = p
        self.lengths = torch.tensor(self.prompt_lengths, dtype=torch.int64, device=device)
        self.bigram = None if bigram is None else bigram.to(device=device, dtype=torch.int64)
        self.unigram = None if unigram is None else unigram.to(device=device, dtype=torch.int64)
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def extend_contexts(self, new_tokens: list[list[int]]) -> None:
        width = max(len(t) for t in new_tokens)
        tokens = torch.tensor([t + [0] * (width - len(t)) for t in new_tokens], dtype=torch.int64)
        count = torch.tensor([len(t) for t in new_tokens], dtype=torch.int64, device=self.lengths.device)
        index = self.lengths[:, None] + torch.arange(width, device=self.lengths.device)
        keep = torch.arange(width, device=self.lengths.device)[None] < count[:, None]
        rows = torch.arange(len(new_tokens), device=self.lengths.device)[:, None].expand_as(index)
        self.contexts[rows[keep], index[keep]] = tokens.to(self.contexts.device)[keep]
        self.lengths = self.lengths + count

    def select(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.contexts.device)
        self.contexts, self.lengths = self.contexts[rows], self.lengths[rows]

    def propose(self, k: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft rows [B, k, w] (-1 past a row's end) and the source of each request's first row [B]:
        the length of its context match, 0 if it came from the model n-grams."""
        candidates, counts, level = ops.ngram_match(self.contexts, self.lengths, min_ngram=self.min_ngram,
                                                    max_ngram=self.max_ngram, num_candidates=k, width=w,
                                                    validate=False)
        batch = candidates.shape[0]
        last = self.contexts[torch.arange(batch, device=self.contexts.device), self.lengths - 1]
        if self.bigram is not None:
            top1 = self.bigram[:, 0]
            for j in range(1, w):  # a match near the end of the context: continue it with the bigram
                prev, here = candidates[:, :, j - 1], candidates[:, :, j]
                candidates[:, :, j] = torch.where((here < 0) & (prev >= 0), top1[prev.clamp(min=0)], here)
            fill = extend(self.bigram[last, :k], self.bigram, w)  # [B, min(k, top), w]
        elif self.unigram is not None:
            fill = torch.full((batch, min(k, self.unigram.numel()), w), -1, dtype=torch.int64,
                              device=last.device)
            fill[:, :, 0] = self.unigram[:fill.shape[1]]
        else:
            fill = torch.full((batch, 0, w), -1, dtype=torch.int64, device=last.device)
        # Row r: the r-th context candidate while there are any, then the fill from its start.
        found = (counts > 0).sum(1, keepdim=True)
        order = torch.arange(k, device=last.device)[None]
        from_fill = (order - found).clamp(min=0)
        filled = torch.full((batch, k, w), -1, dtype=torch.int64, device=last.device)
        if fill.shape[1]:
            usable = from_fill < fill.shape[1]
            taken = fill.gather(1, from_fill.clamp(max=fill.shape[1] - 1)[:, :, None].expand(-1, -1, w))
            filled = torch.where(usable[:, :, None], taken, filled)
        rows = torch.where((order < found)[:, :, None], candidates, filled)
        return rows, torch.where(found[:, 0] > 0, level[:, 0], 0)


def decode_ngram(target: CausalLM, batch: Batch, params: SamplingParams, seeds: torch.Tensor, stats: Stats,
                 drafter: NgramDrafter, shape: DraftShape) -> None:
    device = target.device
    state, logits = prefill(target, batch, stats)
    stats.target_calls += 1
    last = sample_tokens(logits, params, seeds, 0)  # emitted, not yet seen by the target
    first = [[t] for t in last.tolist()]
    drafter.extend_contexts(first)
    finished, _ = batch.emit(first)
    step = 1
    while True:
        shape.resolve(batch.generated, {batch.index[r] for r in finished})
        survivors = batch.drop(finished)
        if survivors is not None:
            if not batch.rows:
                return
            state.select(survivors)
            drafter.select(survivors)
            seeds, last = seeds[survivors.to(device)], last[survivors.to(device)]
        step_start = time.perf_counter()
        # Draft: the full list (for the acceptance record), then the rows this step can afford.
        rows, source = drafter.propose(shape.k_max, shape.w_max)
        shape.record(list(batch.index), [len(batch.generated[i]) for i in batch.index], source, rows)
        k, w = shape.choose(rows, source)
        budget = (batch.remaining() - 1).clamp(min=0).to(device)  # drafts a request may still emit
        rows = rows[:, :max(k, 1), :max(w, 1)].clone()
        beyond = torch.arange(rows.shape[2], device=device)[None, None, :] >= budget[:, None, None]
        rows = rows.masked_fill(beyond | (k == 0), -1)
        tree = build_tree(last, rows)
        stats.draft_seconds += time.perf_counter() - step_start
        # Verify: one forward over every request's tree, then one path per request through chain_verify.
        start = time.perf_counter()
        tree_logits = state.append_tree(tree.tokens, tree.valid, tree.depth, tree.visible)
        chosen = choose_path(tree, tree_logits, params.temperature)
        arange = torch.arange(batch.rows, device=device)
        path = tree.paths[arange, chosen]  # [B, w] nodes, -1 past the row's end
        num_draft = (path >= 0).sum(1)
        slots = torch.cat([torch.zeros_like(path[:, :1]), path.clamp(min=0)], dim=1)
        drafts = tree.tokens.gather(1, path.clamp(min=0)).masked_fill(path < 0, -1)
        out, accepted = ops.chain_verify(tree_logits[arange[:, None], slots], drafts, None, num_draft=num_draft,
                                         temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                         seed=seeds, offset=step, validate=False)
        state.commit(tree.nodes, slots, accepted + 1)
        stats.verify_seconds += time.perf_counter() - start
        stats.target_calls += 1
        accepted_list, out_list = accepted.tolist(), out.tolist()
        new_tokens = [out_list[row][: n + 1] for row, n in enumerate(accepted_list)]
        last = out[arange, accepted]
        drafter.extend_contexts(new_tokens)
        finished, used = batch.emit(new_tokens)
        stats.drafted += int(num_draft.sum())
        stats.accepted += sum(min(n, u) for n, u in zip(accepted_list, used))
        stats.steps += 1
        stats.draft_lengths.append(tree.nodes - 1)
        shape.observe_cost(batch.rows * tree.nodes, time.perf_counter() - step_start)
        step += 1
