"""What a decoding method and the loop hand each other every step.

A method is a `Proposer`: each step it proposes drafts for every running request (`Proposal`: a chain of
drafts with the distribution they were drawn from, or rows of a token tree), names the verifier that
checks them, and afterwards hears what was accepted (`StepResult`) so it can advance or roll back its own
state (a drafter's KV cache, a context of n-grams) and tune its draft sizes. The loop (loop.py) does
everything else: it runs the target, verifies, emits, times and counts.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["Drafter", "Given", "Method", "NoDrafts", "Proposal", "Proposer", "SamplingParams", "Setup", "StepResult", "TreeDraft",
           "draft_offset"]

_DRAFT_BITS = 32  # random-number offsets of drafts: step << 32 | draft index


def draft_offset(step: int, index: int) -> int:
    """The random-number offset of draft `index` of step `step`: distinct for every (step, index) with
    index < 2**32 (more drafts than that in one step could not fit in memory)."""
    if not 0 <= index < 2 ** _DRAFT_BITS or not 0 <= step < 2 ** (63 - _DRAFT_BITS):
        raise ValueError(f"draft offset out of range: step {step}, draft {index}")
    return (step << _DRAFT_BITS) | index


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Setup:
    """What a method's proposer is built from, before decoding starts (registry.Method.make)."""

    method: str
    target: object  # CausalLM
    tokenizer: object
    batch: object  # Batch
    params: SamplingParams
    seeds: torch.Tensor
    num_draft_tokens: object
    options: dict
    drafter: object = None  # CausalLM
    drafter_tokenizer: object = None
    drafter_key: object = None  # what the draft-length memory is kept under ("self:N" or the model)
    same_vocabulary: bool = True  # the drafter's tokenizer is the target's
    seeded: bool = False  # the caller gave a seed: it expects the same text back for it
    memory: object = None  # a specops.NgramMemory the method reads and writes (Method.memory), or None


@dataclass
class TreeDraft:
    """A draft tree per request, for the verifier "tree" (`specops.ops.tree_verify`): tokens, parents
    [B, N] int64 (node 0 the root, whose token the verifier sets to the last emitted one; parents
    precede children; siblings in the order they were drawn), num_nodes [B] (later nodes are padding),
    probs [B, N, W] float32 (row n: the distribution node n's children were drawn from; None for
    deterministic drafts, whose q is one-hot), whether siblings were drawn with replacement, and how the
    tree is verified (`scheme`): "positional" (sampled deterministic drafts: the walk through the target's
    positional tokens; otherwise tree_verify's default) or a tree_verify scheme ("recursive",
    "traversal")."""

    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    probs: torch.Tensor | None = None
    replacement: bool = False
    scheme: str = "positional"
    closure: object = None  # the tree.DraftTree of these nodes, where the proposer built one (its depths and
    # ancestor masks), rooted at the last emitted token: the verifier uses it instead of building it again


@dataclass
class Proposal:
    """One step's drafts for the running requests.

    Chains (verifier "chain"): drafts [B, K] int64 in the verification vocabulary, num_draft [B] (how
    many of them each request proposes), probs [B, K, W] float32 (the distribution each draft was drawn
    from; None for deterministic drafts, whose q is one-hot) and width W >= the target's vocabulary (ids
    from the target's vocabulary size up are tokens the target cannot emit: always rejected).
    Trees (verifier "tree"): a draft tree per request, verified whole (`TreeDraft.scheme`).
    size: draft tokens per request in flight, for the statistics (None: the verifier's count). scheme: how
    the chain is verified: "positional" (sampled deterministic drafts: matched against the target's
    positional tokens; otherwise chain_verify's default) or a chain_verify scheme ("token", "block"), which
    deterministic drafts take with a one-hot q."""

    drafts: torch.Tensor | None = None
    num_draft: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    width: int | None = None
    tree: TreeDraft | None = None
    size: int | None = None
    scheme: str = "positional"

    @classmethod
    def empty(cls, rows: int, device) -> Proposal:
        """No drafts: a plain decoding step."""
        return cls(torch.empty(rows, 0, dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device), size=0)


@dataclass(kw_only=True)
class StepResult:
    """What a step did, for the proposer: per running request the tokens emitted (the accepted drafts
    and one more token from the target, before any cut at EOS or a stop string) and the drafts
    accepted and offered; which requests finished; and what the step cost."""

    emitted: list[list[int]]
    accepted: list[int]
    num_draft: list[int]
    finished: set[int]
    size: int
    target_seconds: float
    drafter_seconds: float | None  # per drafter forward that read a few tokens (None: no such call)
    step_seconds: float
    outside_seconds: float  # of the step, outside model forwards
    accepted_tensor: torch.Tensor = field(repr=False, default=None)


class Proposer:
    """Base of every method. `drafters` lists the drafter models (CausalLM) the method runs, so the loop
    can time and count them; `verifier` names how drafts are checked (verify.py), or is the method's own
    verifier, called as verify.py's are (se: the members' drafts and scores meet there); `scheme` is the
    option "scheme" resolved, for the statistics."""

    verifier = "chain"
    drafters: tuple = ()
    scheme = None  # a verify.Scheme: how sampled drafts are verified, for methods that take option "scheme"

    def start(self, first: list[int]) -> None:
        """The first token of every request, sampled from the prompt's logits (already emitted)."""

    def propose(self, step: int, budget: torch.Tensor, last: torch.Tensor) -> Proposal:
        """Drafts for this step; budget [B]: how many drafts each request may still use; last [B]: each
        request's last emitted token (the target has not read it yet)."""
        raise NotImplementedError

    def accept(self, result: StepResult) -> None:
        """What the target accepted this step."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (finished requests leave the batch)."""

    def finish(self) -> None:
        """The decode call is over, whether it ended normally or not: release what would outlive it (a
        memory's running requests)."""


class Drafter(str, enum.Enum):
    """What drafter a method takes: none, one with the target's vocabulary (or `self:N`), or one with any
    vocabulary."""

    NONE = "none"
    SAME_VOCABULARY = "same"
    ANY_VOCABULARY = "any"


@dataclass(frozen=True)
class Given:
    """What method "auto" decides from: a drafter or none, whether it shares the target's vocabulary,
    greedy or sampled, an ensemble of targets or one, and whether the target scores draft trees exactly."""

    drafter: bool
    same_vocabulary: bool
    greedy: bool
    ensemble: bool
    trees: bool


class NoDrafts(Proposer):
    """Plain decoding: every step proposes nothing, so the target emits one token per request ("ar", and
    "ensemble" over an ensemble of targets)."""

    def propose(self, step: int, budget: torch.Tensor, last: torch.Tensor) -> Proposal:
        return Proposal.empty(budget.shape[0], budget.device)


@dataclass(frozen=True)
class Method:
    """name: what decode(method=...) says. drafter: the drafter it takes (`Drafter`: none, one with the
    target's vocabulary, or one with any vocabulary). trees: the roles ("target", "drafter") whose model
    scores draft trees. options: option name -> default; option_help: option name -> what it does (the
    command line's help); option_choices: option name -> its values, where they are few; check(options) raises ValueError for bad values. draft_setting:
    validates num_draft_tokens (default: "auto" or an int >= 1). tokenizers(target_tokenizer,
    drafter_tokenizer) checks what the tokenizers alone decide (a vocabulary map), before any prompt is
    encoded. ensemble: "no" (a single target), "yes" (a single target or an ensemble, verified against
    the ensemble) or "only" (an ensemble of targets). make(setup) builds the proposer, before decoding
    starts. auto(given): whether method "auto" picks this method for what it is `Given` (the first entry
    that says so wins). plain: the method without speculation that the others are compared with (one for
    a single target, one for an ensemble). memory: whether it drafts from a specops.NgramMemory (decode's
    memory=)."""

    name: str
    summary: str
    make: Callable[[Setup], Proposer]
    drafter: Drafter = Drafter.NONE
    trees: tuple[str, ...] = ()
    options: dict = field(default_factory=dict)
    check: Callable[[dict], None] | None = None
    option_help: dict = field(default_factory=dict)
    option_choices: dict = field(default_factory=dict)
    draft_setting: Callable[[object], None] | None = None
    tokenizers: Callable[[object, object], None] | None = None
    ensemble: str = "no"
    auto: Callable[[Given], bool] | None = None
    plain: bool = False
    memory: bool = False
