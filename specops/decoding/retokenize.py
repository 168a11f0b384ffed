"""Text between two tokenizers (slem, slrs, and the way back for tli, union and the ensembles): drafted
bytes re-encoded by the target's tokenizer behind a look-behind, emitted bytes re-encoded by the
drafter's, and which drafts a drafter keeps after the target emitted its text.
"""

from __future__ import annotations

from specops.vocab import VocabMap

__all__ = ["Retokenizer", "matched"]

LOOK_BEHIND = 4  # target tokens re-encoded with each draft


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


class Retokenizer:
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
