"""Verifiers: one target forward over a step's drafts, the tokens it accepts, and the target's KV cache
cut back to them.

- "chain": the last emitted token and K drafts in one forward; `chain_verify` accepts a prefix (with the
  drafts' q, or one-hot q for deterministic drafts) and emits one more token.
- "tree_path": rows of drafts as one token tree per request (tree.py) in one forward; each request
  verifies the row with the longest expected accepted prefix (tree.choose_path) as a chain of
  deterministic drafts, and the cache keeps that row's accepted prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specops import ops
from specops.decoding.engine import KVState
from specops.decoding.step import Proposal, SamplingParams
from specops.decoding.tree import build_tree, choose_path

__all__ = ["VERIFIERS", "Verified", "sample"]


@dataclass
class Verified:
    """out [B, K+1]: accepted drafts, then the recovered or bonus token, then -1; accepted [B];
    num_draft [B]: drafts each request offered; size: draft tokens per request in flight."""

    out: torch.Tensor
    accepted: torch.Tensor
    num_draft: torch.Tensor
    size: int


def _chain_verify(logits, drafts, probs, num_draft, params: SamplingParams, seeds, offset):
    return ops.chain_verify(logits, drafts, probs, num_draft=num_draft, temperature=params.temperature,
                            top_k=params.top_k, top_p=params.top_p, seed=seeds, offset=offset, validate=False)


def sample(logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, offset: int) -> torch.Tensor:
    """One token per row from logits [B, V] (greedy at T = 0): chain_verify with no drafts, so sampling
    and verification share one implementation."""
    batch = logits.shape[0]
    none = torch.empty(batch, 0, dtype=torch.long, device=logits.device)
    out, _ = _chain_verify(logits.unsqueeze(1), none, None, None, params, seeds, offset)
    return out[:, 0]


def _widen(logits: torch.Tensor, width: int | None) -> torch.Tensor:
    """Target logits [..., V] over a verification vocabulary of `width` >= V ids (-inf past V)."""
    extra = (width or logits.shape[-1]) - logits.shape[-1]
    if extra <= 0:
        return logits
    return torch.cat([logits, logits.new_full((*logits.shape[:-1], extra), float("-inf"))], dim=-1)


def chain(state: KVState, last: torch.Tensor, proposal: Proposal, params: SamplingParams, seeds: torch.Tensor,
          step: int) -> Verified:
    drafts = proposal.drafts
    k = drafts.shape[1]
    # A draft the target does not have (beyond its vocabulary, or padding) is rejected whatever the target
    # reads in its place, and nothing after it is used.
    scored = torch.where((drafts >= 0) & (drafts < state.lm.vocab_size), drafts, 0)
    logits = _widen(state.append(torch.cat([last.unsqueeze(1), scored], dim=1), keep=k + 1), proposal.width)
    out, accepted = _chain_verify(logits, drafts, proposal.probs, proposal.num_draft, params, seeds, step)
    state.rollback(k + 1, accepted + 1)
    return Verified(out, accepted, proposal.num_draft, k if proposal.size is None else proposal.size)


def tree_path(state: KVState, last: torch.Tensor, proposal: Proposal, params: SamplingParams, seeds: torch.Tensor,
              step: int) -> Verified:
    tree = build_tree(last, proposal.rows)
    logits = state.append_tree(tree.tokens, tree.valid, tree.depth, tree.visible)
    chosen = choose_path(tree, logits, params.temperature)
    arange = torch.arange(last.shape[0], device=last.device)
    path = tree.paths[arange, chosen]  # [B, w] nodes, -1 past the row's end
    num_draft = (path >= 0).sum(1)
    slots = torch.cat([torch.zeros_like(path[:, :1]), path.clamp(min=0)], dim=1)
    drafts = tree.tokens.gather(1, path.clamp(min=0)).masked_fill(path < 0, -1)
    out, accepted = _chain_verify(logits[arange[:, None], slots], drafts, None, num_draft, params, seeds, step)
    state.commit(tree.nodes, slots, accepted + 1)
    return Verified(out, accepted, num_draft, tree.nodes - 1)


VERIFIERS = {"chain": chain, "tree_path": tree_path}
