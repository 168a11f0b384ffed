"""Vocabulary maps between a target and a drafter with different tokenizers (paper 000).

Tokens are compared by the bytes they stand for, never by id or vocabulary size:

- byte-level BPE (GPT-2 style, `Ġ` for a space, `Ċ` for a newline): each character of a token is one
  byte under the byte-to-unicode table those tokenizers use;
- SentencePiece style (`▁` for a space) with byte fallback (`<0x0A>` is the single byte 0x0A);
- anything else: the token's UTF-8 text.

Special tokens (BOS, EOS, pad, chat markers, unused slots) stand for no text and are left out. When
several ids of one vocabulary stand for the same bytes (Gemma has both `A` and `<0x41>`), the one its
tokenizer produces wins: the regular token over the byte-fallback one, then the lowest id.

`vocab_map(target_tokenizer, drafter_tokenizer)` returns a `VocabMap`: the intersection as id maps in
both directions (what `specops.ops.vocab_project` and TLI need), the union's ids (Alg 1), the bytes of
every token (SLEM and SLRS work on strings) and the intersection's size. Maps are cached on disk under
$SPECOPS_CACHE/vocab, keyed by a hash of both vocabularies, and kept in memory per tokenizer pair.
"""

from __future__ import annotations

import hashlib
import json
import string
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specops._kept import per_object
from specops._files import cache_root, write_atomically

__all__ = ["Vocabulary", "VocabMap", "vocab_map", "vocabulary"]

_FORMAT = 1  # bump when what is cached, or how it is computed, changes
_PROBE = string.ascii_letters + string.digits + string.punctuation + " \n\t"


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE table, inverted: printable Latin-1 bytes stand for themselves, every other
    byte b for chr(256 + n), n counting those bytes in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


def _style(tokenizer) -> str:
    """'byte-level', 'sentencepiece' or 'plain', from the fast tokenizer's decoder, else its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.decoder is not None:
        decoder = backend.decoder.__getstate__() if hasattr(backend.decoder, "__getstate__") else None
        text = json.dumps(json.loads(decoder)) if isinstance(decoder, (str, bytes)) else str(backend.decoder)
        if "ByteLevel" in text:
            return "byte-level"
        if "Metaspace" in text or "\u2581" in text or "ByteFallback" in text:
            return "sentencepiece"
        return "plain"
    vocab = tokenizer.get_vocab()
    spaced = sum(t.startswith("\u0120") for t in vocab), sum(t.startswith("\u2581") for t in vocab)
    if max(spaced) < len(vocab) // 20:
        return "plain"
    return "byte-level" if spaced[0] > spaced[1] else "sentencepiece"


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(i))
    return ids


def _token_bytes(token: str, style: str) -> tuple[bytes | None, bool]:
    """(the bytes a token stands for, whether it is a byte-fallback token); None if it stands for none."""
    if style == "sentencepiece" and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)]), True
        except ValueError:
            pass
    if style == "byte-level":
        try:
            return bytes(_BYTE_LEVEL[c] for c in token), False
        except KeyError:  # an added token written in plain text
            return token.encode(), False
    if style == "sentencepiece":
        return token.replace("\u2581", " ").encode(), False
    return token.encode(), False


@dataclass
class Vocabulary:
    """One tokenizer's tokens as bytes. token_bytes[id] is None for special tokens and unused ids;
    canonical maps bytes to the id the tokenizer itself uses for them."""

    style: str
    size: int  # ids 0..size-1 (the tokenizer's, which a model's LM head may exceed)
    token_bytes: list
    canonical: dict = field(repr=False)
    adds_prefix_space: bool = False

    def text_bytes(self, ids) -> bytes:
        return b"".join(self.token_bytes[i] or b"" for i in ids)


def vocabulary(tokenizer) -> Vocabulary:
    """The bytes of every token of `tokenizer` (see the module docstring for the rules)."""
    style = _style(tokenizer)
    vocab = tokenizer.get_vocab()
    specials = _special_ids(tokenizer)
    size = max(vocab.values()) + 1 if vocab else 0
    token_bytes: list = [None] * size
    canonical: dict[bytes, tuple[bool, int]] = {}
    for token, i in vocab.items():
        if i in specials:
            continue
        data, fallback = _token_bytes(token, style)
        if not data:
            continue
        token_bytes[i] = data
        if data not in canonical or (fallback, i) < canonical[data]:
            canonical[data] = (fallback, i)
    probe = tokenizer("a", add_special_tokens=False)["input_ids"]
    adds_prefix = b"".join(token_bytes[i] or b"" for i in probe) == b" a"
    return Vocabulary(style, size, token_bytes, {b: i for b, (_, i) in canonical.items()}, adds_prefix)


@dataclass
class VocabMap:
    """The drafter∩target intersection of two vocabularies (by the bytes tokens stand for).

    draft_to_target: [drafter vocabulary] int64, each drafter id's target id, -1 outside the
    intersection. target_to_draft: [target vocabulary] int64, the inverse. Ids are each tokenizer's;
    `projection(n)` pads the first to a drafter LM head of n rows.
    """

    target: Vocabulary
    draft: Vocabulary
    draft_to_target: torch.Tensor
    target_to_draft: torch.Tensor

    @property
    def size(self) -> int:
        return int((self.draft_to_target >= 0).sum())

    @property
    def draft_ratio(self) -> float:
        """Share of the drafter's text tokens the target also has."""
        return self.size / max(1, sum(b is not None for b in self.draft.token_bytes))

    @property
    def target_ratio(self) -> float:
        return self.size / max(1, sum(b is not None for b in self.target.token_bytes))

    def projection(self, rows: int) -> torch.Tensor:
        """draft_to_target padded with -1 to a drafter LM head of `rows` outputs (target_ids of
        `specops.ops.vocab_project`)."""
        if rows < self.draft.size:
            raise ValueError(f"vocab: the drafter's LM head has {rows} outputs but its tokenizer has "
                             f"{self.draft.size} ids")
        pad = torch.full((rows - self.draft.size,), -1, dtype=torch.int64)
        return torch.cat([self.draft_to_target, pad])

    def union(self, rows: int, target_rows: int) -> tuple[torch.Tensor, int]:
        """Ids in the union of both vocabularies (paper 000, Alg 1): intersection tokens keep their
        target id, every other drafter id (LM-head padding included) gets target_rows + its rank.
        Returns (drafter id -> union id [rows], union size)."""
        ids = self.projection(rows)
        outside = ids < 0
        ids[outside] = target_rows + torch.arange(int(outside.sum()))
        return ids, target_rows + int(outside.sum())

    def summary(self) -> str:
        return (f"vocabulary intersection {self.size:,} tokens: {self.draft_ratio:.1%} of the drafter's, "
                f"{self.target_ratio:.1%} of the target's")


def _check_expressible(name: str, tokenizer, vocab: Vocabulary, chars: str) -> None:
    """Each character must round-trip through the tokenizer's bytes, or text cannot cross over."""
    bad = []
    for ch in chars:
        ids = tokenizer(ch, add_special_tokens=False)["input_ids"]
        data = vocab.text_bytes(ids)
        if vocab.adds_prefix_space and data.startswith(b" "):
            data = data[1:]
        if data != ch.encode():
            bad.append(ch)
    if bad:
        raise ValueError(f"vocab: the {name}'s tokenizer cannot express {''.join(bad)!r}, which the other "
                         "tokenizer can: text cannot be carried between the two vocabularies")


def _fingerprint(target: Vocabulary, draft: Vocabulary) -> str:
    h = hashlib.sha256(str(_FORMAT).encode())
    for vocab in (target, draft):
        h.update(f"{vocab.style}|{vocab.size}|".encode())
        for data in vocab.token_bytes:
            h.update(b"\x00" if data is None else b"\x01" + len(data).to_bytes(2, "little") + data)
    return h.hexdigest()[:24]


def _cache_dir() -> Path:
    return cache_root() / "vocab"


def _build(target: Vocabulary, draft: Vocabulary) -> tuple[torch.Tensor, torch.Tensor]:
    draft_to_target = torch.full((draft.size,), -1, dtype=torch.int64)
    target_to_draft = torch.full((target.size,), -1, dtype=torch.int64)
    for data, d in draft.canonical.items():
        t = target.canonical.get(data)
        if t is not None:
            draft_to_target[d] = t
            target_to_draft[t] = d
    return draft_to_target, target_to_draft


_MEMO: weakref.WeakKeyDictionary[object, weakref.WeakKeyDictionary] = per_object(
    "vocabulary maps", "vocabulary maps from this target tokenizer to drafter tokenizers")


def vocab_map(target_tokenizer, draft_tokenizer, *, cache: bool = True) -> VocabMap:
    """The `VocabMap` between two tokenizers (disk-cached unless cache=False, memoized per pair).

    Raises ValueError when the vocabularies share no token, or when a character that one tokenizer
    can write (printable ASCII, space, newline, tab) does not survive the other's encode and decode.
    """
    try:
        inner = _MEMO.setdefault(target_tokenizer, weakref.WeakKeyDictionary())
        if draft_tokenizer in inner:
            return inner[draft_tokenizer]
    except TypeError:  # not weak-referenceable
        inner = None
    target, draft = vocabulary(target_tokenizer), vocabulary(draft_tokenizer)
    writable = "".join(ch for ch in _PROBE if ch.encode() in target.canonical or ch.encode() in draft.canonical)
    _check_expressible("target", target_tokenizer, target, writable)
    _check_expressible("drafter", draft_tokenizer, draft, writable)
    path = _cache_dir() / f"map-{_fingerprint(target, draft)}.pt"
    maps = None
    if cache and path.exists():
        try:
            saved = torch.load(path, weights_only=True)
            maps = saved["draft_to_target"], saved["target_to_draft"]
        except Exception:  # a damaged cache file is rebuilt
            maps = None
    if maps is None:
        maps = _build(target, draft)
        if cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, lambda temporary: torch.save(
                {"draft_to_target": maps[0], "target_to_draft": maps[1]}, temporary))
    result = VocabMap(target, draft, *maps)
    if result.size == 0:
        raise ValueError("vocab: the target and drafter vocabularies share no token (compared by the text "
                         "they stand for): a drafter with another vocabulary cannot propose anything")
    if inner is not None:
        inner[draft_tokenizer] = result
    return result
