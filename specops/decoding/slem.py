"""String-level exact match (method "slem", paper 000 Alg 2): a drafter with any vocabulary drafts
text, the text is re-encoded in the target's tokens, and the target keeps the drafts it would have
produced itself.

Each step, per request:
1. The drafter (its own KV cache, its own encoding of the prompt) proposes k tokens.
2. Their bytes are re-encoded by the target's tokenizer behind a look-behind of the last target tokens
   (retokenize.Retokenizer.to_target).
3. One target forward scores them; the drafts are kept while they match the target's greedy token, or,
   when sampling, while they match the target's own sample at their position (verify.py's positional
   matching, option "scheme" below): each draft is kept with probability p(draft), and the output
   follows the target exactly.
4. Re-alignment: the drafter keeps the longest run of its drafts whose text the target emitted, and
   reads the rest of the emitted text in its own tokens. Both caches persist across steps.

Option "scheme" (`verify.SCHEMES`): "positional" is step 3, and the text is sampled "ar"'s for the same seed;
"token" and "joint" hand the same drafts to `chain_verify` with a one-hot q. The drafts do
not depend on the target's random numbers, so all three keep a draft with probability p(draft), the most
any verifier can keep of deterministic drafts; "auto" (the default) is "positional", which reads no q.
"""

from __future__ import annotations

import torch

from specops import vocab as vocab_maps
from specops.decoding.draft_vocab import DraftVocab
from specops.decoding.retokenize import Retokenizer
from specops.decoding.drafter import DrafterProposer
from specops.decoding.protocol import Drafter, Method, Proposal, Proposer, Setup, StepResult
from specops.decoding.verify import resolve_scheme, scheme_option

_HISTORY = 16  # target tokens kept per request for the look-behind


class StringDrafter(DrafterProposer):
    def __init__(self, setup: Setup):
        self.vmap = vocab_maps.vocab_map(setup.tokenizer, setup.drafter_tokenizer)
        self.text = Retokenizer(self.vmap, setup.tokenizer, setup.drafter_tokenizer)
        prompts = setup.batch.encode(setup.drafter_tokenizer)
        setup.drafter.check_prompts(prompts, setup.batch.max_new_tokens, "drafter")
        super().__init__(setup, prompts)
        self.own = DraftVocab.same(self.lm.vocab_size, self.lm.device)  # the drafter samples its own distribution
        self.history = [p[-_HISTORY:] for p in setup.batch.prompt_rows]
        self.drafted: list[list[int]] = []
        self.scheme = resolve_scheme(setup.options, seeded=setup.seeded, carries_q=False)

    def start(self, first: list[int]) -> None:
        self.history = [h + [t] for h, t in zip(self.history, first)]
        self.pending = [p + self.text.to_drafter(self.vmap.target.text_bytes([t])) for p, t in zip(self.pending, first)]

    def propose(self, step: int, budget: torch.Tensor, last: torch.Tensor) -> Proposal:
        rows, device = budget.shape[0], budget.device
        self.k = k = self.chain_length(budget)
        self.drafted = [[] for _ in range(rows)]
        if k:
            columns = []

            def draw(logits, i):
                _, token, _ = self.own.draft(logits, self.params, self.seeds, step, i)
                columns.append(token)
                return token

            self.run(k, draw)
            self.drafted = torch.stack(columns, dim=1).tolist()
        target_drafts = [self.text.to_target(h, self.vmap.draft.text_bytes(d))[:b]
                         for h, d, b in zip(self.history, self.drafted, budget.tolist())]
        width = max((len(d) for d in target_drafts), default=0)
        drafts = torch.tensor([d + [0] * (width - len(d)) for d in target_drafts], dtype=torch.long)
        num_draft = torch.tensor([len(d) for d in target_drafts], dtype=torch.long)
        return Proposal(drafts.view(rows, width).to(device), num_draft.to(device), size=k,
                        scheme=self.scheme.op("chain"))

    def advance(self, result: StepResult) -> None:
        """Re-align the drafter with what was emitted."""
        k, previous = self.k, self.pending
        keep, self.pending = [], []
        for row, tokens in enumerate(result.emitted):
            self.history[row] = (self.history[row] + tokens)[-_HISTORY:]
            kept, pending = self.text.realign(self.drafted[row][:k], self.vmap.target.text_bytes(tokens),
                                              previous[row])
            keep.append(kept)
            self.pending.append(pending)
        if k > 1:
            self.state.rollback(k - 1, torch.tensor(keep, device=self.lm.device))


def _make(setup: Setup) -> Proposer:
    return StringDrafter(setup)


METHODS = [Method("slem", "a drafter with another vocabulary drafts text, re-encoded for the target; exact match",
                  _make, drafter=Drafter.ANY_VOCABULARY, tokenizers=vocab_maps.vocab_map,
                  auto=lambda given: (given.drafter and not given.same_vocabulary and given.greedy
                                      and not given.ensemble),
                  **scheme_option())]
