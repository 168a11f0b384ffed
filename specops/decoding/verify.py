"""Verifiers: one target forward over a step's drafts, the tokens it accepts, and the target's KV cache
cut back to them.

- "chain": the last emitted token and K drafts in one forward; `chain_verify` accepts a prefix (with the
  drafts' q, or one-hot q for deterministic drafts; token by token or by block verification, the
  proposal's scheme) and emits one more token.
- Deterministic drafts (no q: n-grams, re-encoded text, no drafts at all, and a drafter's drafts drawn
  with the target's own random numbers, drafter.TokenDrafter) when sampling, under the proposal's scheme
  "positional" (the default): the target's token at every position is drawn as plain sampling draws it,
  with random numbers keyed by the row's seed and the token's position alone (`positional`), and a draft
  is accepted exactly when it is that token. Acceptance is p(x) for a draft that does not depend on those
  numbers, as with a one-hot q, and higher for one drawn with them; the text is token for token what "ar"
  gives with the same seed, whatever the draft shapes, the batch or the timing that chose them. A
  proposal of deterministic drafts may name an op's scheme instead (ngram's option "scheme"): the op then
  verifies them with a one-hot q.
- "tree": a draft tree per request (protocol.TreeDraft) in one forward, verified whole by `tree_verify`
  (recursive rejection sampling or traversal verification, the tree's scheme) when it comes with q or
  names that scheme; under "positional" without q (n-gram trees, and drafter trees under scheme
  "positional") by walking it from the root through the children that hold the target's positional
  tokens (`_match_tree`), sampling only the nodes the walk reaches. The cache keeps the accepted path. A
  tree proposer may hand over a step whose trees are all chains as a chain proposal (tree_verify's chain
  case is chain_verify).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specops import ops
from specops._seeds import position_seeds
from specops.decoding.engine import KVState
from specops.decoding.protocol import Proposal, SamplingParams
from specops.decoding.tree import tree_from_parents

__all__ = ["SCHEMES", "SCHEME_HELP", "VERIFIERS", "Scheme", "Verified", "resolve_scheme", "sample", "scheme_option"]

# The option "scheme" of every method that verifies sampled drafts: one vocabulary for chains and trees,
# drafts with q and without (docs/methods.md, "Verification schemes"). "positional" keeps a draft when it
# is the target's own token drawn with that position's random numbers (the text is sampled "ar"'s for the
# same seed); "token" verifies token by token (speculative sampling on a chain, recursive rejection
# sampling on a tree); "joint" verifies the draft as a whole (block verification on a chain, traversal
# verification on a tree: never fewer drafts kept in expectation). The ops keep their own names
# (`_OP_SCHEMES`), and a Proposal or TreeDraft carries the op's.
SCHEMES = ("auto", "positional", "token", "joint")
_OP_SCHEMES = {"token": {"chain": "token", "tree": "recursive"}, "joint": {"chain": "block", "tree": "traversal"}}
_PAPER_NAMES = {"block": "joint", "traversal": "joint", "recursive": "token"}  # the ops' names, for the message


@dataclass(frozen=True)
class Scheme:
    """A call's option "scheme" with "auto" resolved: `name` (one of SCHEMES but "auto") and `reason`, why
    it is the one (the stats line says both)."""

    name: str
    reason: str

    def op(self, kind: str) -> str:
        """What a proposal of `kind` ("chain" or "tree") carries: "positional", or the op's scheme."""
        return "positional" if self.name == "positional" else _OP_SCHEMES[self.name][kind]


SCHEME_HELP = ("how sampled drafts are verified: positional keeps a draft when it is the target's own token drawn "
               "with that position's random numbers (the text is sampled ar's for the same seed); token verifies "
               "token by token (speculative sampling, recursive rejection sampling on trees); joint verifies the "
               "draft as a whole (block verification, traversal verification on trees: never fewer drafts kept); "
               "auto is positional when a seed is given or the drafts carry no q, else joint. Greedy decoding is "
               "the same under all (docs/methods.md, Verification schemes)")


def scheme_option(choices: tuple[str, ...] = SCHEMES) -> dict:
    """The Method fields of the option "scheme" over `choices` (a subset of SCHEMES), default "auto"."""

    def check(options: dict) -> None:
        value = options["scheme"]
        if value not in choices:
            hint = (f" ({value!r} is the op's name: the option says {_PAPER_NAMES[value]!r})"
                    if value in _PAPER_NAMES else "")
            raise ValueError(f"decode: option 'scheme' must be one of {', '.join(choices)}, got {value!r}{hint}")

    return {"options": {"scheme": "auto"}, "check": check, "option_help": {"scheme": SCHEME_HELP},
            "option_choices": {"scheme": choices}}


def resolve_scheme(options: dict, *, seeded: bool, carries_q: bool, choices: tuple[str, ...] = SCHEMES) -> Scheme:
    """The scheme a call verifies sampled drafts with. "auto" is "positional" where drafts carry no q
    (n-grams, re-encoded text: every scheme keeps the same drafts in expectation, and "positional" gives
    sampled "ar"'s text) or a seed is given (the same seed asks for the same text back, whatever the draft
    shapes); otherwise "joint", which keeps the most drafts. Without "positional" among `choices`, "joint"."""
    asked = options.get("scheme", "auto")
    if asked != "auto":
        return Scheme(asked, "asked for")
    if "positional" in choices and not carries_q:
        return Scheme("positional", "auto: the drafts carry no q")
    if "positional" in choices and seeded:
        return Scheme("positional", "auto: a seed was given, so the text is sampled ar's; scheme 'joint' keeps "
                                    "more drafts and repeats itself for a fixed num_draft_tokens")
    return Scheme("joint", "auto: no seed given" if "positional" in choices else "auto")


@dataclass
class Verified:
    """out [B, K+1]: accepted drafts, then the recovered or bonus token, then -1; accepted [B] (the tokens
    emitted are out[:, :accepted + 1]); num_draft [B]: drafts each request offered; size: draft tokens per
    request in flight; accepted_drafts [B]: drafts among the emitted tokens when that is not `accepted`
    (se emits a whole accepted chain with no token after it)."""

    out: torch.Tensor
    accepted: torch.Tensor
    num_draft: torch.Tensor
    size: int
    accepted_drafts: torch.Tensor | None = None


def _chain_verify(logits, drafts, probs, num_draft, params: SamplingParams, seeds, offset, scheme="token"):
    return ops.chain_verify(logits, drafts, probs, num_draft=num_draft, temperature=params.temperature,
                            top_k=params.top_k, top_p=params.top_p, seed=seeds, offset=offset, validate=False,
                            scheme=scheme)


def sample(logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, offset: int) -> torch.Tensor:
    """One token per row from logits [B, V] (greedy at T = 0): chain_verify with no drafts, so sampling
    and verification share one implementation."""
    batch = logits.shape[0]
    none = torch.empty(batch, 0, dtype=torch.long, device=logits.device)
    out, _ = _chain_verify(logits.unsqueeze(1), none, None, None, params, seeds, offset)
    return out[:, 0]


def positional(logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """The tokens [B, n] plain sampling emits from logits [B, n, V] at sequence positions [B, n]: each drawn
    with the key of its row and position (_seeds.position_seeds), so the same seed gives the same token at
    the same place whichever step draws it."""
    rows, n, vocab = logits.shape
    keys = position_seeds(seeds, positions).reshape(-1)
    return sample(logits.reshape(rows * n, vocab), params, keys, 0).view(rows, n)


def _matched(params: SamplingParams, probs, scheme: str, state) -> bool:
    """Whether a step's drafts are verified by matching the positional tokens (module docstring): sampled
    deterministic drafts whose proposal asks for it (scheme "positional"), on a state that knows positions."""
    return (params.temperature > 0 and probs is None and scheme == "positional"
            and getattr(state, "next_pos", None) is not None)


def _op_scheme(scheme: str, default: str) -> str:
    """The op's scheme for a proposal's: "positional" drafts that are not matched (greedy, or a state without
    positions) take the op's default, which at temperature 0 is the same greedy matching."""
    return default if scheme == "positional" else scheme


def _widen(logits: torch.Tensor, width: int | None) -> torch.Tensor:
    """Target logits [..., V] over a verification vocabulary of `width` >= V ids (-inf past V)."""
    extra = (width or logits.shape[-1]) - logits.shape[-1]
    if extra <= 0:
        return logits
    return torch.cat([logits, logits.new_full((*logits.shape[:-1], extra), float("-inf"))], dim=-1)


def chain(state: KVState, last: torch.Tensor, proposal: Proposal, params: SamplingParams, seeds: torch.Tensor,
          step: int) -> Verified:
    drafts = proposal.drafts
    k = drafts.shape[1]
    # A draft the target does not have (beyond its vocabulary, or padding) is rejected whatever the target
    # reads in its place, and nothing after it is used.
    usable = (drafts >= 0) & (drafts < state.lm.vocab_size)
    scored = torch.where(usable, drafts, 0)
    follow = None
    if k and params.temperature == 0:  # row j is read only if the drafts before it are accepted
        offered = usable if proposal.num_draft is None else \
            usable & (torch.arange(k, device=drafts.device) < proposal.num_draft[:, None])
        parent = torch.arange(-1, k, device=drafts.device).expand(drafts.shape[0], k + 1)
        token = torch.cat([torch.full_like(drafts[:, :1], -1), torch.where(offered, drafts, -1)], 1)
        follow = (parent, token)
    logits = _widen(state.append(torch.cat([last.unsqueeze(1), scored], dim=1), keep=k + 1, follow=follow),
                    proposal.width)
    if _matched(params, proposal.probs, proposal.scheme, state):
        # The state has read `last` and the k drafts: the token after `last` lands k slots before its end.
        positions = state.next_pos[:, None] - k + torch.arange(k + 1, device=drafts.device)
        out = positional(logits, params, seeds, positions)
        offered = torch.arange(k, device=drafts.device) < proposal.num_draft[:, None]
        accepted = ((out[:, :k] == drafts) & offered).long().cumprod(1).sum(1)
        out = torch.where(torch.arange(k + 1, device=out.device) <= accepted[:, None], out, -1)
    else:
        out, accepted = _chain_verify(logits, drafts, proposal.probs, proposal.num_draft, params, seeds, step,
                                      _op_scheme(proposal.scheme, "token"))
    state.rollback(k + 1, accepted + 1)
    return Verified(out, accepted, proposal.num_draft, k if proposal.size is None else proposal.size)


def tree(state: KVState, last: torch.Tensor, proposal: Proposal, params: SamplingParams, seeds: torch.Tensor,
         step: int) -> Verified:
    draft = proposal.tree
    if draft is None:  # a step whose trees are all chains, handed over as one
        return chain(state, last, proposal, params, seeds, step)
    tokens = draft.tokens.clone()
    tokens[:, 0] = last
    shape = draft.closure if draft.closure is not None else tree_from_parents(tokens, draft.parents, draft.num_nodes)
    # Ids the target does not have (a wider verification vocabulary) are scored as 0 and always rejected.
    scored = torch.where(shape.tokens < state.lm.vocab_size, shape.tokens, 0)
    follow = None
    if params.temperature == 0:  # a node is read only if its parent's argmax is its token
        size = tokens.shape[1]
        parent = torch.where(torch.arange(size, device=tokens.device) > 0, shape.parent, -1)
        follow = (parent, torch.where(shape.valid & (shape.tokens < state.lm.vocab_size), shape.tokens, -1))
    logits = _widen(state.append_tree(scored, shape.valid, shape.depth, shape.visible, follow=follow),
                    proposal.width)
    if _matched(params, draft.probs, draft.scheme, state):
        out, nodes, accepted = _match_tree(logits, tokens, shape, params, seeds, state)
    else:
        out, nodes, accepted = ops.tree_verify(logits, tokens, shape.parent, draft.probs,
                                               num_nodes=draft.num_nodes, replacement=draft.replacement,
                                               temperature=params.temperature, top_k=params.top_k,
                                               top_p=params.top_p, seed=seeds,
                                               offset=step, validate=False,
                                               scheme=_op_scheme(draft.scheme, "recursive"))
    size = tokens.shape[1]
    slots = torch.cat([torch.zeros_like(nodes[:, :1]), nodes.clamp(min=0)], dim=1)[:, :size]
    state.commit(size, slots, accepted + 1)
    return Verified(out, accepted, draft.num_nodes - 1, size - 1 if proposal.size is None else proposal.size)


def _match_tree(logits, tokens, shape, params: SamplingParams, seeds, state):
    """tree_verify's (out, nodes, accepted) for a deterministic tree: from the root, the positional token
    after the current node; the child holding it is accepted and the walk goes on from there, else that
    token is emitted and the walk ends. Only the nodes the walk reaches are sampled: one `positional` call
    per depth, over the requests still walking."""
    rows, size = tokens.shape
    device = tokens.device
    parent, valid, ids, depth = shape.parent.tolist(), shape.valid.tolist(), tokens.tolist(), shape.depth.tolist()
    children = [{} for _ in range(rows)]  # per request: node -> {token: first child holding it}
    for b in range(rows):
        for c in range(size - 1, 0, -1):  # backwards, so the first child with a token wins
            if valid[b][c]:
                children[b].setdefault(parent[b][c], {})[ids[b][c]] = c
    node, paths, walking = [0] * rows, [[] for _ in range(rows)], list(range(rows))
    out = torch.full((rows, size), -1, dtype=torch.long)
    while walking:
        at = torch.tensor(walking, dtype=torch.long, device=device)
        here = torch.tensor([node[b] for b in walking], dtype=torch.long, device=device)
        # The state does not advance over a tree until commit: a node's prediction lands depth + 1 past `last`.
        where = state.next_pos[at] + 1 + torch.tensor([depth[b][node[b]] for b in walking], device=device)
        drawn = positional(logits[at, here][:, None], params, seeds[at], where[:, None])[:, 0].tolist()
        still = []
        for b, want in zip(walking, drawn):
            child = children[b].get(node[b], {}).get(want)
            if child is None:
                out[b, len(paths[b])] = want
                continue
            paths[b].append(child)
            node[b] = child
            still.append(b)
        walking = still
    nodes = torch.full((rows, size - 1), -1, dtype=torch.long)
    for b, path in enumerate(paths):
        out[b, :len(path)] = torch.tensor([ids[b][c] for c in path], dtype=torch.long)
        nodes[b, :len(path)] = torch.tensor(path, dtype=torch.long)
    accepted = torch.tensor([len(p) for p in paths], dtype=torch.long)
    return out.to(device), nodes.to(device), accepted.to(device)


VERIFIERS = {"chain": chain, "tree": tree}
