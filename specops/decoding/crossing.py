"""How drafts cross from a drafter's vocabulary into the target's, and emitted text back.

- `DraftVocab`: token-level crossing (sd: the identity; tli: the vocabulary intersection; union: both
  vocabularies). It samples a draft from drafter logits through `specops.ops.vocab_project`, which also
  gives the exact q that verification needs.
- `TextCrossing`: string-level crossing (slem, slrs, and the way back for tli / union): drafted bytes
  re-encoded by the target's tokenizer behind a look-behind, emitted bytes re-encoded by the drafter's.
"""

from __future__ import annotations

import torch

from specops import ops
from specops.decoding.step import SamplingParams, draft_offset
from specops.vocab import VocabMap

__all__ = ["DraftVocab", "TextCrossing", "matched"]

LOOK_BEHIND = 4  # target tokens re-encoded with each draft


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


def _valid_prefix(data: bytes) -> str:
    """The longest prefix of `data` that is whole UTF-8 characters, as text."""
    for cut in range(min(4, len(data)) + 1):
        try:
            return data[:len(data) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="replace")


def matched(tokens: list[int], emitted: bytes, token_bytes: list) -> tuple[int, int]:
    """(how many of `tokens` spell a prefix of `emitted`, the bytes they cover): the drafter keeps
    those and reads the rest of the emitted text in its own tokens."""
    count, covered = 0, 0
    for token in tokens:
        piece = token_bytes[token] or b""
        if not piece or emitted[covered:covered + len(piece)] != piece:
            break
        count, covered = count + 1, covered + len(piece)
    return count, covered


class TextCrossing:
    """Moves text between the two tokenizers."""

    def __init__(self, vmap: VocabMap, target_tokenizer, drafter_tokenizer):
        self.vmap = vmap
        self.target_tokenizer = target_tokenizer
        self.drafter_tokenizer = drafter_tokenizer
        self.single = [vmap.draft.canonical.get(bytes([b])) for b in range(256)]
        # What the drafter reads for emitted text that is no text at all (a special token).
        self.stand_in = next((i for i in (getattr(drafter_tokenizer, "unk_token_id", None),
                                          getattr(drafter_tokenizer, "eos_token_id", None)) if i is not None), 0)
        self._mapped = vmap.target_to_draft.tolist()

    def to_target(self, history: list[int], draft: bytes) -> list[int]:
        """Target tokens for drafted bytes that follow `history` (target ids), via the look-behind:
        tokenizers merge across boundaries (" fo" + "o" is " foo"), so the widest window of the last
        target tokens that comes back unchanged decides where the drafts start."""
        text = _valid_prefix(draft)
        if not text:
            return []
        encode = self.target_tokenizer
        for behind in range(min(LOOK_BEHIND, len(history)), 0, -1):
            window = history[-behind:]
            try:
                context = self.vmap.target.text_bytes(window).decode("utf-8")
            except UnicodeDecodeError:  # the window starts inside a character
                continue
            ids = encode(context + text, add_special_tokens=False)["input_ids"]
            if ids[:behind] == window:
                return ids[behind:]
        return encode(text, add_special_tokens=False)["input_ids"]

    def to_drafter(self, data: bytes) -> list[int]:
        """Drafter tokens for emitted bytes: its own encoding of whole characters, single-byte tokens for a
        trailing partial character."""
        text = _valid_prefix(data)
        ids = self.drafter_tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        for b in data[len(text.encode("utf-8")):]:
            if self.single[b] is not None:
                ids.append(self.single[b])
        return ids

    def realign(self, drafted: list[int], emitted: bytes, waiting: list[int]) -> tuple[int, list[int]]:
        """After a step in which the drafter drafted `drafted` (its ids; it has read all but the last) and the
        target emitted `emitted` (bytes): (how many of the drafts its cache keeps, the drafter ids it reads
        next). It keeps the longest run of drafts whose text the target emitted and reads the rest of the
        emitted text in its own tokens; its next input must be a real token, so when the drafts cover all
        of the text the last kept one is read again. Without drafts, `waiting` (what it had not read yet)
        stays queued before the emitted text."""
        k = len(drafted)
        j, covered = matched(drafted, emitted, self.vmap.draft.token_bytes)
        rest = emitted[covered:]
        if k and not rest and j:
            return j - 1, [drafted[j - 1]]
        carried = [drafted[k - 1]] if k and j == k else []
        pending = (carried if k else waiting) + self.to_drafter(rest)
        return (min(j, k - 1) if k else 0), pending or [self.stand_in]  # a special token stands for no text

    def tokens_to_drafter(self, ids) -> list[int]:
        """Target ids -> drafter ids saying the same bytes: through the vocabulary intersection where a token
        is in it, else the drafter's encoding of its bytes; a token that stands for no text becomes the
        stand-in."""
        out = []
        for t in ids:
            d = self._mapped[t] if 0 <= t < len(self._mapped) else -1
            if d >= 0:
                out.append(d)
                continue
            data = self.vmap.target.token_bytes[t] if 0 <= t < self.vmap.target.size else None
            out.extend((self.to_drafter(data) if data else []) or [self.stand_in])
        return out


def intersection(vmap: VocabMap, text: TextCrossing, drafter_rows: int, target_rows: int, device) -> DraftVocab:
    """The drafter restricted to the tokens both vocabularies share, verified in the target's vocabulary
    (TLI's crossing; also how an ensemble member of another vocabulary reads the ensemble's tokens)."""
    return DraftVocab(vmap.projection(drafter_rows).to(device), target_rows, target_rows, text.tokens_to_drafter)
