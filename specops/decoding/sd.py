"""Standard speculative decoding (method "sd"; Leviathan et al. 2023, Chen et al. 2023; paper 000
Alg 5): a drafter with the target's vocabulary proposes K tokens, the target scores them in one
forward, and `specops.ops.chain_verify` accepts a prefix and emits one more token. Lossless: greedy
output equals greedy decoding, sampled output follows the target's distribution."""

from __future__ import annotations

from specops.decoding.draft_vocab import DraftVocab
from specops.decoding.drafter import TokenDrafter
from specops.decoding.protocol import Drafter, Method, Proposer, Setup
from specops.decoding.verify import scheme_option


def _make(setup: Setup) -> Proposer:
    setup.drafter.check_prompts(setup.batch.prompt_rows, setup.batch.max_new_tokens, "drafter")
    vocab = DraftVocab.same(setup.target.vocab_size, setup.target.device)
    return TokenDrafter(setup, vocab, [list(p) for p in setup.batch.prompt_rows])


METHODS = [Method("sd", "speculative decoding with a drafter of the target's vocabulary", _make, drafter=Drafter.SAME_VOCABULARY,
                  ensemble="yes", auto=lambda given: given.drafter and given.same_vocabulary, **scheme_option())]
