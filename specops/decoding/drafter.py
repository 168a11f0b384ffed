"""The drafter model's side of the methods that have one (sd, tli, union, slem, slrs): its KV cache for
the batch, the tokens it has not read yet, and the draft length chosen from measured costs.

A drafter reads the prompt with its first draft, so a request that never drafts never runs the drafter;
after a step it keeps the drafts the target accepted and reads what the target emitted after them.
"""

from __future__ import annotations

import time

import torch

from specops.decoding.cost_model import DraftLength
from specops.decoding.engine import KVState
from specops.decoding.protocol import Proposal, Proposer, Setup, StepResult
from specops.decoding.verify import positional, resolve_scheme

__all__ = ["DrafterProposer", "TokenDrafter"]

class DrafterProposer(Proposer):
    """Base of the drafter methods. `pending[b]`: drafter ids request b's drafter has not read;
    `k`: the drafts of the last step (what `draft_length` is told about); `position[b]`: the sequence
    position of request b's next draft (the token after the last emitted one), whose random number a
    positional draft is drawn with."""

    def __init__(self, setup: Setup, pending_prompts: list[list[int]]):
        self.lm = setup.drafter
        self.drafters = (self.lm,)
        self.state = KVState(self.lm, setup.batch.rows)
        self.pending = pending_prompts
        self.params, self.seeds = setup.params, setup.seeds
        self.draft_length = DraftLength.remembered(setup.num_draft_tokens, setup.target.model, setup.drafter_key,
                                                   setup.method)
        self.sizer = self.draft_length  # the chooser that prices the drafter's catching up (trees: theirs)
        self.k = 0
        # A prompt, then the token the prompt's logits gave (the last emitted token, read with the drafts).
        self.position = torch.tensor([len(r) + 1 for r in setup.batch.prompt_rows], dtype=torch.long,
                                     device=setup.seeds.device)

    def moved(self, result: StepResult) -> None:
        """Advance each request's draft position past what the step emitted."""
        self.position = self.position + torch.tensor([len(e) for e in result.emitted], dtype=torch.long,
                                                     device=self.position.device)

    def read(self) -> torch.Tensor:
        """The drafter reads its pending tokens; its logits [B, V_d] after them. The read is timed for
        `repays`."""
        began, tokens = time.perf_counter(), sum(len(p) for p in self.pending)
        logits = self.state.extend(self.pending)
        if self.sizer is not None:
            self.sizer.catch_up.observe(tokens, time.perf_counter() - began)
        self.pending = [[] for _ in self.pending]
        return logits

    def repays(self, shape: tuple, budget: torch.Tensor) -> bool:
        """Whether drafting `shape` this step repays the drafter's reading what it has not read yet: the
        prompts at the first drafting step, what plain steps emitted since (cost_model.CatchUp; budget [B]:
        the drafts each request may still use). Always with a fixed num_draft_tokens."""
        if self.sizer is None or getattr(self.sizer, "fixed", None) is not None:
            return True
        backlog = sum(len(p) for p in self.pending)
        left = float(budget.double().mean()) + 1 if budget.numel() else 0.0
        return self.sizer.catch_up.pays(self.sizer, budget.shape[0], shape, backlog, left)

    def chain_length(self, budget: torch.Tensor) -> int:
        """This step's drafts per request of a chain: the chooser's, or none where that would not repay the
        drafter's catching up (`repays`)."""
        if not bool(budget.any()):
            return 0
        k = self.draft_length.choose(budget.shape[0])
        return k if k and self.repays((1,) * k, budget) else 0

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
        num_draft = torch.clamp(budget, max=self.chain_length(budget))
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
        self.position = self.position[rows.to(self.position.device)]


class TokenDrafter(DrafterProposer):
    """Drafts that cross into the target's vocabulary token by token (`DraftVocab`): a chain of K drafts,
    one per position. sd, tli and union are this proposer with different crossings.

    Sampled, draft i is drawn from the drafter's distribution q (its logits over the verification
    vocabulary, `DraftVocab.project`, after temperature, top-k and top-p) by `verify.positional`: the
    inverse CDF at the uniform number the target's token at the same position is drawn with (the same seed,
    row and position). The drafts go to the verifier as deterministic drafts (no q), which accepts a draft
    exactly when it equals the target's token drawn there. So the text is, token for token, what sampled
    "ar" gives with that seed, whatever draft lengths "auto" picks and however requests are batched. A
    draft is accepted with probability P(x = y) for x ~ q and y ~ p coupled through one uniform number,
    instead of sum(min(p, q)) for speculative sampling's accept/resample rule: on Gemma-3-270M's own
    truncations at T = 0.8, top-p 0.95 (HumanEval/0 and its solution) 0.535 against 0.551 per token with 15
    of 18 layers, 0.819 against 0.848 with 17 (0.518 and 0.751 if x and y were drawn independently).

    Option "scheme" (`verify.SCHEMES`): "positional" is the above; "token" and "joint" draw the drafts from q
    with the drafter's own random numbers and hand q to `chain_verify` (speculative sampling token by token,
    or block verification: they keep more drafts, but the text then depends on the draft lengths); "auto" (the
    default) is "positional" when the caller gave a seed and "joint" when not. On the real pair (Gemma-3-270M,
    SmolLM2-135M through tli) at T = 1, block drew 1.12-1.19x positional's tokens/s (docs/benchmarks.md)."""

    def __init__(self, setup: Setup, vocab, prompts: list[list[int]]):
        super().__init__(setup, prompts)
        self.vocab = vocab
        self.scheme = resolve_scheme(setup.options, seeded=setup.seeded, carries_q=True)
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
        with_q = not self.params.greedy and self.scheme.name != "positional"
        probs = [None] * k

        def draw(logits, i):
            if self.params.greedy or with_q:  # from q with the drafter's own random numbers
                drafts[:, i], drafted[:, i], probs[i] = self.vocab.draft(logits, self.params, self.seeds, step, i)
            else:  # from q with the key of the target's token at the same position (class docstring)
                where = (self.position + i).to(self.seeds.device)[:, None]
                projected = self.vocab.project(logits)[:, None, :]
                drafts[:, i] = positional(projected, self.params, self.seeds, where)[:, 0]
                drafted[:, i] = self.vocab.drafter_ids(drafts[:, i])
            return drafted[:, i]

        self.run(k, draw)
        self.drafted = drafted
        if with_q:
            return Proposal(drafts, num_draft, torch.stack(probs, 1), width=self.vocab.width, size=k,
                            scheme=self.scheme.op("chain"))
        return Proposal(drafts, num_draft, None, width=self.vocab.width, size=k)

    def advance(self, result: StepResult) -> None:
        self.moved(result)
        k = self.k
        if not k:  # a plain step: the drafter read nothing and catches up later
            self.pending = [p + self.vocab.to_drafter(e[-1:]) for p, e in zip(self.pending, result.emitted)]
            return
        # The drafter has read the drafts up to k-1; all k accepted leaves draft k unread.
        self.state.rollback(k - 1, torch.clamp(result.accepted_tensor, max=k - 1))
        drafted = self.drafted[:, k - 1].tolist()
        self.pending = [([drafted[row]] if n == k else []) + self.vocab.to_drafter(result.emitted[row][-1:])
                        for row, n in enumerate(result.accepted)]
