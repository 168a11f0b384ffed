"""Ensembles of models as one target (paper 004): `WeightedEnsemble`, `ContrastiveEnsemble`, and
`EnsembleLM`, which the decoding loop and every method take where they take a target model. The method
"ensemble" (every member scores every token, ensemble.py) and "se" (se.py) decode from it.

The ensemble is a model of its own: at every position its logits are `specops.ops.ensemble_logits` of the
members' logits, and temperature, top-k and top-p apply to those exactly as to one model's, for every
method (the same sampling code verifies and samples):

- weighted: log sum_i w_i softmax(l_i), the mixture of the members' temperature-1 distributions; at
  temperature 0 the argmax of that mixture;
- contrastive (expert, amateur): (l_e - max l_e) - mu (l_a - max l_a), on the expert's tokens of
  probability at least alpha times its largest when alpha is given (contrastive decoding's adaptive
  plausibility); temperature, top-k and top-p then apply to that score.

Members with another vocabulary: the ensemble lives on the first member's vocabulary. Another member
reads the same text (each emitted token as the member's own tokens for its bytes, as TLI's drafter does)
and contributes its next-token distribution restricted to the tokens both vocabularies share,
renormalized there; a token it does not have gets its logit -inf (weighted: only the other members' mass;
contrastive: excluded, and if nothing is left the expert's plausible tokens alone).

`EnsembleLM` stands where a target model stands for the decoding loop; its `EnsembleState` holds one KV
cache per member (`Member`). Methods with a drafter (sd, tli, union) verify against it unchanged: the
paper's "ensemble-SD". "se" (se.py) lets the members propose to each other.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from specops import ops
from specops._kept import per_object
from specops.decoding.draft_vocab import DraftVocab, intersection
from specops.decoding.retokenize import Retokenizer
from specops.decoding.engine import CausalLM, KVState

__all__ = ["ContrastiveEnsemble", "EnsembleLM", "EnsembleState", "Member", "WeightedEnsemble"]

_WEIGHT_TOLERANCE = 1e-6
_HISTORY = 1024  # own-token counts kept per row: a step never forgets more ensemble tokens than it read


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class WeightedEnsemble:
    """A mixture of the members' next-token probabilities: sum_i weights[i] * p_i, weights > 0 summing
    to 1, one per member in the order of `target=[...]`."""

    weights: tuple[float, ...]

    def __init__(self, weights):
        values = tuple(weights) if isinstance(weights, (list, tuple)) else None
        if not values or not all(_number(w) for w in values):
            raise ValueError(f"WeightedEnsemble: weights must be a list of numbers, one per member, got {weights!r}")
        if any(w <= 0 for w in values):
            raise ValueError(f"WeightedEnsemble: every weight must be > 0 (leave a member out instead), got {values}")
        if abs(sum(values) - 1) > _WEIGHT_TOLERANCE:
            raise ValueError(f"WeightedEnsemble: weights must sum to 1, got {values} (sum {sum(values):.9g})")
        object.__setattr__(self, "weights", tuple(float(w) for w in values))

    def check(self, members: int) -> None:
        if len(self.weights) != members:
            raise ValueError(f"decode: WeightedEnsemble has {len(self.weights)} weights for {members} members")

    def combine(self, logits: list[torch.Tensor]) -> torch.Tensor:
        return ops.ensemble_logits(logits, list(self.weights), mode="weighted", validate=False)


@dataclass(frozen=True)
class ContrastiveEnsemble:
    """Contrastive decoding: the expert's (first member's) log-probabilities minus mu times the amateur's
    (second member's), with alpha (optional, in (0, 1)) keeping only the expert's tokens of probability at
    least alpha times its largest. Exactly two members."""

    mu: float
    alpha: float | None = None

    def __post_init__(self):
        if not _number(self.mu) or self.mu < 0:
            raise ValueError(f"ContrastiveEnsemble: mu must be a finite number >= 0, got {self.mu!r}")
        if self.alpha is not None and (not _number(self.alpha) or not 0 < self.alpha < 1):
            raise ValueError(f"ContrastiveEnsemble: alpha must be None or in (0, 1), got {self.alpha!r}")

    def check(self, members: int) -> None:
        if members != 2:
            raise ValueError(f"decode: ContrastiveEnsemble takes exactly 2 members (expert, amateur), got {members}")

    def combine(self, logits: list[torch.Tensor]) -> torch.Tensor:
        return ops.ensemble_logits(logits, mode="contrastive", mu=float(self.mu), alpha=float(self.alpha or 0.0),
                                   validate=False)


ENSEMBLES = (WeightedEnsemble, ContrastiveEnsemble)


class Member:
    """One member of an ensemble over a batch: its KV cache, how the ensemble's tokens (the first member's
    vocabulary) cross into its own, and the emitted tokens it has not read yet (`unread`, per row).

    Every read returns the member's logits projected onto the ensemble's vocabulary (-inf at tokens it
    does not share) after each ensemble token, however many of its own tokens that token takes."""

    def __init__(self, lm: CausalLM, vocab: DraftVocab, prompts: list[list[int]]):
        self.lm = lm
        self.vocab = vocab
        self.state = KVState(lm, len(prompts))
        self.prompts = prompts
        self.unread: list[list[int]] = [[] for _ in prompts]
        self._read: list[list[int]] = [[] for _ in prompts]  # own tokens per ensemble token of the last read

    def prefill(self) -> torch.Tensor:
        """Read the prompts; the projected logits [B, V] after them."""
        return self.vocab.project(self.state.prefill(self.prompts))

    def _own(self, tokens: list[int]) -> list[list[int]]:
        return [self.vocab.to_drafter([t]) for t in tokens]

    def read(self, rows: list[list[int]], keep: int) -> torch.Tensor:
        """Read each row's ensemble tokens (each row at least `keep`); the projected logits [B, keep, V] after
        each of the last `keep` of them."""
        own = [self._own(r) for r in rows]
        counts = [[len(ids) for ids in row] for row in own]
        self._read = [(old + new)[-_HISTORY:] for old, new in zip(self._read, counts)]
        flat = [[i for ids in row for i in ids] for row in own]
        if self.vocab.identity:
            return self.state.extend(flat, keep=keep)
        # Another vocabulary: the logits after the last own token of each of the last `keep` ensemble tokens.
        ends = [[len(f) - sum(c[len(c) - j:]) - 1 for j in range(keep - 1, -1, -1)] for f, c in zip(flat, counts)]
        span = max(len(f) - e[0] for f, e in zip(flat, ends))
        logits = self.state.extend(flat, keep=span)
        index = torch.tensor([[span - (len(f) - e) for e in row] for f, row in zip(flat, ends)],
                             device=logits.device)
        picked = logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1]))
        return self.vocab.project(picked)

    def forget(self, counts: list[int]) -> None:
        """Row b forgets the last counts[b] ensemble tokens of its last read."""
        own = [sum(read[len(read) - c:]) if c else 0 for read, c in zip(self._read, counts)]
        self.state.drop_last(torch.tensor(own, device=self.lm.device))
        self._read = [read[:len(read) - c] for read, c in zip(self._read, counts)]

    def select(self, rows: torch.Tensor) -> None:
        self.state.select(rows)
        kept = rows.tolist()
        self.unread = [self.unread[r] for r in kept]
        self._read = [self._read[r] for r in kept]


class EnsembleLM:
    """The ensemble where the decoding loop expects a target model: its vocabulary (the first member's),
    device, forward count and time (all members'), and `new_state`."""

    def __init__(self, members: list[CausalLM], vocabs: list[DraftVocab], prompts: list[list[list[int]]], rule):
        self.members, self.vocabs, self.member_prompts, self.rule = members, vocabs, prompts, rule
        first = members[0]
        self.name, self.arch = "ensemble", " + ".join(m.arch for m in members)
        self.vocab_size, self.device, self.dtype = first.vocab_size, first.device, first.dtype
        self.model = _key(members, rule)  # what draft-length memories are kept under
        self.log: list[tuple[int, float]] = []

    @property
    def calls(self) -> int:
        return sum(m.calls for m in self.members)

    @property
    def seconds(self) -> float:
        return sum(m.seconds for m in self.members)

    def check_prompts(self, rows: list[list[int]], new_tokens: int, role: str) -> None:
        for index, (lm, prompts) in enumerate(zip(self.members, self.member_prompts)):
            lm.check_prompts(prompts, new_tokens, f"target[{index}]")

    def new_state(self, rows: int) -> EnsembleState:
        if rows != len(self.member_prompts[0]):
            raise ValueError("EnsembleLM.new_state: an ensemble's state is made for its own batch")
        return EnsembleState(self)


class _Key:
    """A draft-length memory key for one ensemble (members and rule) for the life of its first member."""


_KEYS: weakref.WeakKeyDictionary = per_object(
    "ensemble keys", "the ensembles the model is the first member of (their learned draft lengths' keys)")


def _key(members: list[CausalLM], rule) -> _Key:
    try:
        per_first = _KEYS.setdefault(members[0].model, {})
    except TypeError:
        return _Key()
    return per_first.setdefault((tuple(id(m.model) for m in members[1:]), rule), _Key())


class EnsembleState:
    """The KV state of an ensemble: one `Member` per model, and the KVState interface the loop and the
    chain verifier use (prefill, append, rollback, select), returning the ensemble's logits."""

    def __init__(self, lm: EnsembleLM):
        self.lm = lm
        self.members = [Member(m, v, p) for m, v, p in zip(lm.members, lm.vocabs, lm.member_prompts)]

    @property
    def rows(self) -> int:
        return self.members[0].state.rows

    def combine(self, logits: list[torch.Tensor]) -> torch.Tensor:
        return self.lm.rule.combine(logits)

    def prefill(self, rows: list[list[int]]) -> torch.Tensor:
        return self.combine([m.prefill() for m in self.members])

    def append(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, keep: int = 1,
               follow=None) -> torch.Tensor:
        """Every member reads what it has not read yet and `tokens` [B, n]; the ensemble's logits [B, keep, V]
        after the last `keep` of them (every row: `follow` is not read)."""
        if valid is not None and not bool(valid.all()):
            raise ValueError("EnsembleState.append takes whole rows")
        rows = tokens.tolist()
        logits = []
        for member in self.members:
            logits.append(member.read([u + r for u, r in zip(member.unread, rows)], keep))
            member.unread = [[] for _ in rows]
        return self.combine(logits)

    def rollback(self, appended: int, keep: torch.Tensor) -> None:
        counts = (appended - keep).tolist()
        for member in self.members:
            member.forget(counts)

    def select(self, rows: torch.Tensor) -> None:
        for member in self.members:
            member.select(rows)

    def settle(self) -> None:
        for member in self.members:
            member.state.settle()


def member_vocab(lm: CausalLM, tokenizer, first_lm: CausalLM, first_tokenizer, same: bool) -> DraftVocab:
    """How the ensemble's tokens cross into a member's vocabulary: the identity for the first member's
    tokenizer, else the vocabulary intersection (as TLI's)."""
    if same:
        if lm.vocab_size != first_lm.vocab_size:
            raise ValueError(f"decode: ensemble members share a tokenizer but their LM heads have {lm.vocab_size} "
                             f"and {first_lm.vocab_size} outputs")
        return DraftVocab.same(first_lm.vocab_size, first_lm.device)
    from specops import vocab as vocab_maps

    vmap = vocab_maps.vocab_map(first_tokenizer, tokenizer)
    text = Retokenizer(vmap, first_tokenizer, tokenizer)
    return intersection(vmap, text, lm.vocab_size, first_lm.vocab_size, first_lm.device)
