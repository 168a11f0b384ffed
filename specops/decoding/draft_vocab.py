"""How drafts cross from a drafter's vocabulary into the target's, token by token: `DraftVocab` (sd: the
identity; tli: the vocabulary intersection; union: both vocabularies). It samples a draft from drafter
logits through `specops.ops.vocab_project`, which also gives the exact q that verification needs. Text
that crosses between the two tokenizers is `retokenize.Retokenizer`'s.
"""

from __future__ import annotations

import torch

from specops import ops
from specops.decoding.retokenize import Retokenizer
from specops.decoding.protocol import SamplingParams, draft_offset
from specops.vocab import VocabMap

__all__ = ["DraftVocab", "intersection"]


class DraftVocab:
    """How drafts cross from the drafter's vocabulary into the target's.

    target_ids [drafter LM-head rows]: each drafter id's id in the verification vocabulary (-1: never
    drafted), which has `width` >= the target's vocabulary; the columns past it (the union's
    drafter-only tokens, paper 000 Alg 1) get target logits of -inf. to_drafter: target ids -> the
    drafter ids that say the same (what the drafter reads after the target emitted them).
    """

    def __init__(self, target_ids: torch.Tensor, width: int, target_vocab: int, to_drafter, identity: bool = False):
        self.target_ids = target_ids
        self.width = width
        self.target_vocab = target_vocab
        self.to_drafter = to_drafter
        self.identity = identity  # target_ids is arange(width): logits need no projection
        self._mapped = target_ids >= 0
        self._drafter_ids = None

    @classmethod
    def same(cls, vocab_size: int, device) -> DraftVocab:
        """The target's own vocabulary (standard speculative decoding)."""
        return cls(torch.arange(vocab_size, device=device), vocab_size, vocab_size, lambda ids: list(ids), True)

    def project(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter logits [..., V_d] as logits over the verification vocabulary [..., width]: -inf at ids no
        drafter id maps to. Softmax, temperature, top-k and top-p of these are vocab_project's q (the drafter
        restricted to the shared tokens, renormalized), so draft trees can draw several children from it."""
        if self.identity:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.width), float("-inf"))
        out[..., self.target_ids[self._mapped]] = logits[..., self._mapped]
        return out

    def drafter_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Verification ids drawn from `project`ed logits -> the drafter ids that map to them (-1 stays -1)."""
        if self.identity:
            return tokens
        if self._drafter_ids is None:
            inverse = torch.full((self.width + 1,), -1, dtype=torch.int64, device=self.target_ids.device)
            inverse[self.target_ids[self._mapped]] = torch.nonzero(self._mapped)[:, 0]
            self._drafter_ids = inverse
        return self._drafter_ids[torch.where(tokens < 0, self.width, tokens)]

    def draft(self, logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, step: int, index: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One draft per row from drafter logits [B, V_d]: (target ids, drafter ids, q [B, width] or None
        when greedy), q being exactly the distribution the draft was drawn from. The identity crossing
        samples with `sample_without_replacement` (one draw: the same filtered softmax and its q, without
        vocab_project's id map, which cost 4 ms a draft at V = 262,144)."""
        if self.identity:
            if params.greedy:  # the first maximal index, as chain_verify's greedy choice
                tokens = logits.argmax(-1)
                return tokens, tokens, None
            drawn, q = ops.sample_without_replacement(
                logits, 1, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seeds,
                offset=draft_offset(step, index), validate=False)
            return drawn[:, 0], drawn[:, 0], q
        q, tokens, drafter_tokens = ops.vocab_project(
            logits, self.target_ids, self.width, temperature=params.temperature, top_k=params.top_k,
            top_p=params.top_p, seed=seeds, offset=draft_offset(step, index), validate=False)
        return tokens, drafter_tokens, None if params.greedy else q


def intersection(vmap: VocabMap, text: Retokenizer, drafter_rows: int, target_rows: int, device) -> DraftVocab:
    """The drafter restricted to the tokens both vocabularies share, verified in the target's vocabulary
    (TLI's crossing; also how an ensemble member of another vocabulary reads the ensemble's tokens)."""
    return DraftVocab(vmap.projection(drafter_rows).to(device), target_rows, target_rows, text.tokens_to_drafter)
