"""The drafter model's side of the methods that have one (sd, tli, union, slem, slrs): its KV cache for
the batch, the tokens it has not read yet, and the draft length chosen from measured costs.

A drafter reads the prompt with its first draft, so a request that never drafts never runs the drafter;
after a step it keeps the drafts the target accepted and reads what the target emitted after them.
"""

from __future__ import annotations

import torch

from specops.decoding.draft_length import DraftLength
from specops.decoding.engine import KVState
from specops.decoding.step import Proposal, Proposer, Setup, StepResult

__all__ = ["DrafterProposer", "TokenDrafter"]


class DrafterProposer(Proposer):
    """Base of the drafter methods. `pending[b]`: drafter ids request b's drafter has not read;
    `k`: the drafts of the last step (what `draft_length` is told about)."""

    def __init__(self, setup: Setup, pending_prompts: list[list[int]]):
        self.lm = setup.drafter
        self.drafters = (self.lm,)
        self.state = KVState(self.lm, setup.batch.rows)
        self.pending = pending_prompts
        self.params, self.seeds = setup.params, setup.seeds
        self.draft_length = DraftLength.remembered(setup.num_draft_tokens, setup.target.model, setup.drafter_key,
                                                   setup.method)
        self.k = 0

    def read(self) -> torch.Tensor:
        """The drafter reads its pending tokens; its logits [B, V_d] after them."""
        logits = self.state.extend(self.pending)
        self.pending = [[] for _ in self.pending]
        return logits

    def run(self, k: int, draw) -> None:
        """Read the pending tokens, then draft k tokens: draw(logits [B, V_d], i) picks draft i and returns
        the drafter ids [B] it reads next (the last draft is not read until the next step)."""
        logits = self.read()
        for i in range(k):
            fed = draw(logits, i)
            if i + 1 < k:
                logits = self.state.append(fed.unsqueeze(1))[:, -1]

    def choose(self, budget: torch.Tensor) -> tuple[int, torch.Tensor]:
        """This step's draft length and the drafts each request may offer."""
        num_draft = torch.clamp(budget, max=self.draft_length.choose())
        self.k = int(num_draft.max()) if num_draft.numel() else 0
        return self.k, num_draft

    def accept(self, result: StepResult) -> None:
        self.draft_length.observe(self.k, result.target_seconds, result.drafter_seconds, result.outside_seconds,
                                  result.accepted, result.num_draft)
        self.advance(result)

    def advance(self, result: StepResult) -> None:
        """Keep the accepted drafts in the drafter's cache and queue what it must read next."""
        raise NotImplementedError

    def select(self, rows: torch.Tensor) -> None:
        self.state.select(rows)
        rows_list = rows.tolist()
        self.pending = [self.pending[r] for r in rows_list]
        self.seeds = self.seeds[rows.to(self.seeds.device)]


class TokenDrafter(DrafterProposer):
    """Drafts that cross into the target's vocabulary token by token (`DraftVocab`): a chain of K drafts
    with the exact distribution each was drawn from, verified by `chain_verify`. sd, tli and union are
    this proposer with different crossings."""

    def __init__(self, setup: Setup, vocab, prompts: list[list[int]]):
        super().__init__(setup, prompts)
        self.vocab = vocab
        self.drafted = None

    def start(self, first: list[int]) -> None:
        self.pending = [p + self.vocab.to_drafter([t]) for p, t in zip(self.pending, first)]

    def propose(self, step: int, budget: torch.Tensor, last: torch.Tensor) -> Proposal:
        k, num_draft = self.choose(budget)
        rows, device = budget.shape[0], budget.device
        if not k:
            return Proposal.empty(rows, device)
        drafts = torch.empty(rows, k, dtype=torch.long, device=device)
        drafted = torch.empty(rows, k, dtype=torch.long, device=device)
        probs = None if self.params.greedy else torch.empty(rows, k, self.vocab.width, device=device)

        def draw(logits, i):
            drafts[:, i], drafted[:, i], q = self.vocab.draft(logits, self.params, self.seeds, step, i)
            if q is not None:
                probs[:, i] = q
            return drafted[:, i]

        self.run(k, draw)
        self.drafted = drafted
        return Proposal(drafts, num_draft, probs, width=self.vocab.width, size=k)

    def advance(self, result: StepResult) -> None:
        k = self.k
        if not k:  # a plain step: the drafter read nothing and catches up later
            self.pending = [p + self.vocab.to_drafter(e[-1:]) for p, e in zip(self.pending, result.emitted)]
            return
        # The drafter has read the drafts up to k-1; all k accepted leaves draft k unread.
        self.state.rollback(k - 1, torch.clamp(result.accepted_tensor, max=k - 1))
        drafted = self.drafted[:, k - 1].tolist()
        self.pending = [([drafted[row]] if n == k else []) + self.vocab.to_drafter(result.emitted[row][-1:])
                        for row, n in enumerate(result.accepted)]
