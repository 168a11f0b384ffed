"""Token-level intersection (method "tli", paper 000 Alg 4) and its baseline, the union (method
"union", Alg 1): speculative decoding with a drafter whose vocabulary differs from the target's.

TLI restricts the drafter to the tokens both vocabularies share (by the text they stand for,
`specops.vocab`) and renormalizes it there: `specops.ops.vocab_project` gives that distribution in
target ids and samples the draft, and `chain_verify` verifies it unchanged. Lossless: q is exactly the
distribution the draft was drawn from. The union keeps the drafter's whole distribution over the union
of both vocabularies; its drafter-only tokens have target probability 0 and are always rejected, which
is why TLI's acceptance rate is at least the union's (Theorem 4.1).

Both are the token drafter of sd with another vocabulary crossing. Tokens the target emits go back to the
drafter through the intersection, or, outside it, as the drafter's encoding of their bytes.
"""

from __future__ import annotations

from specops import vocab as vocab_maps
from specops.decoding.draft_vocab import DraftVocab, intersection
from specops.decoding.retokenize import Retokenizer
from specops.decoding.drafter import TokenDrafter
from specops.decoding.protocol import Drafter, Method, Proposer, Setup
from specops.decoding.verify import scheme_option
from specops.vocab import VocabMap


def union(vmap: VocabMap, text: Retokenizer, drafter_rows: int, target_rows: int, device) -> DraftVocab:
    """Alg 1: drafts from the drafter's whole vocabulary, verified over the union of both."""
    ids, width = vmap.union(drafter_rows, target_rows)
    return DraftVocab(ids.to(device), width, target_rows, text.tokens_to_drafter)


def _maker(crossing):
    def make(setup: Setup) -> Proposer:
        vmap = vocab_maps.vocab_map(setup.tokenizer, setup.drafter_tokenizer)
        text = Retokenizer(vmap, setup.tokenizer, setup.drafter_tokenizer)
        prompts = setup.batch.encode(setup.drafter_tokenizer)
        setup.drafter.check_prompts(prompts, setup.batch.max_new_tokens, "drafter")
        vocab = crossing(vmap, text, setup.drafter.vocab_size, setup.target.vocab_size, setup.target.device)
        return TokenDrafter(setup, vocab, prompts)

    return make


METHODS = [
    Method("tli", "a drafter with another vocabulary, drafting from the tokens both vocabularies share",
           _maker(lambda *args: intersection(*args)), drafter=Drafter.ANY_VOCABULARY, tokenizers=vocab_maps.vocab_map,
           ensemble="yes", auto=lambda given: (given.drafter and not given.same_vocabulary
                                               and (given.ensemble or not given.greedy)), **scheme_option()),
    Method("union", "TLI's baseline: the drafter's whole vocabulary, its own tokens always rejected",
           _maker(lambda *args: union(*args)), drafter=Drafter.ANY_VOCABULARY, tokenizers=vocab_maps.vocab_map,
           ensemble="yes", **scheme_option()),
]
