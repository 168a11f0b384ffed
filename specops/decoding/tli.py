"""Token-level intersection (method "tli", paper 000 Alg 4) and its baseline, the union (method
"union", Alg 1): speculative decoding with a drafter whose vocabulary differs from the target's.

TLI restricts the drafter to the tokens both vocabularies share (by the text they stand for,
`specops.vocab`) and renormalizes it there: `specops.ops.vocab_project` gives that distribution in
target ids and samples the draft, and `chain_verify` verifies it unchanged. Lossless: q is exactly the
distribution the draft was drawn from. The union keeps the drafter's whole distribution over the union
of both vocabularies; its drafter-only tokens have target probability 0 and are always rejected, which
is why TLI's acceptance rate is at least the union's (Theorem 4.1).

Both run on the speculative-decoding loop of sd.py; only the vocabulary crossing differs. Tokens the
target emits go back to the drafter through the intersection, or, outside it, as their bytes in the
drafter's own tokens.
"""

from __future__ import annotations

from specops.decoding.sd import DraftVocab
from specops.vocab import VocabMap


def _to_drafter(vmap: VocabMap, drafter_tokenizer):
    """target ids -> drafter ids saying the same bytes: through the intersection where a token is in it,
    else the bytes' drafter tokens (single-byte tokens, or the drafter's encoding of the text); a token
    that stands for no text (a special token) becomes the drafter's unk, eos or 0."""
    mapped = vmap.target_to_draft.tolist()
    single = [vmap.draft.canonical.get(bytes([b])) for b in range(256)]
    fallback = next((i for i in (getattr(drafter_tokenizer, "unk_token_id", None),
                                 getattr(drafter_tokenizer, "eos_token_id", None)) if i is not None), 0)

    def convert(ids) -> list[int]:
        out = []
        for t in ids:
            d = mapped[t] if 0 <= t < len(mapped) else -1
            if d >= 0:
                out.append(d)
                continue
            data = vmap.target.token_bytes[t] if 0 <= t < vmap.target.size else None
            if not data:
                out.append(fallback)
            elif all(single[b] is not None for b in data):
                out.extend(single[b] for b in data)
            else:
                out.extend(drafter_tokenizer(data.decode("utf-8", errors="replace"),
                                             add_special_tokens=False)["input_ids"] or [fallback])
        return out

    return convert


def intersection(vmap: VocabMap, drafter_tokenizer, drafter_rows: int, target_rows: int, device) -> DraftVocab:
    """TLI: drafts only from the intersection, verified in the target's vocabulary."""
    return DraftVocab(vmap.projection(drafter_rows).to(device), target_rows, target_rows,
                      _to_drafter(vmap, drafter_tokenizer))


def union(vmap: VocabMap, drafter_tokenizer, drafter_rows: int, target_rows: int, device) -> DraftVocab:
    """Alg 1: drafts from the drafter's whole vocabulary, verified over the union of both."""
    ids, width = vmap.union(drafter_rows, target_rows)
    return DraftVocab(ids.to(device), width, target_rows, _to_drafter(vmap, drafter_tokenizer))
