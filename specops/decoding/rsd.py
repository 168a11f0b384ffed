"""Draft trees from a drafter, verified whole by recursive rejection sampling (paper 003, RSD; SpecInfer) or
traversal verification, or by the target's positional tokens when a seed is given (option "scheme", below):

- "rsd-c": constant branching factors per level, num_draft_tokens = (b1, ..., bL): each node at level l
  gets b_{l+1} children drawn without replacement from the drafter's distribution there
  (`specops.ops.sample_without_replacement`), and `tree_verify` checks them with the residual target
  and the draft renormalized over what was not yet drawn (RSD-C, paper 003 Alg 3-4).
- "rsd-s": Stochastic Beam Search, num_draft_tokens = (W, L): every level keeps the W children with the
  largest truncated-Gumbel scores over all of the previous level's W beams (`specops.ops.
  stochastic_beam_step`), so the tree's W paths are L-token sequences drawn without replacement from the
  drafter (RSD-S, paper 003 Alg 5-9). A beam keeps a prefix of its draws, verified in draw order.
- "specinfer": the rsd-c shape with i.i.d. children (SpecInfer's multi-step speculative sampling), the
  baseline RSD improves on: a repeated sibling is wasted.

num_draft_tokens="auto" chooses the shape every step from measured costs and acceptance (`TreeShape`):
on a CPU, where a forward's cost grows with the tokens it carries, small trees or plain steps; on a GPU
wider and deeper ones.

Option "scheme" (`verify.SCHEMES`) says how sampled trees are verified. "token" is the above (recursive
rejection sampling). "joint" draws the same trees and verifies them from the leaves to the root (traversal
verification, `specops.ops.tree_verify(..., scheme="traversal")`): lossless too, and in expectation it kept at
least as many drafts wherever measured (docs/verification.md). "positional" gives each node's children the
same law but draws the first child of every node from q by the inverse CDF at the uniform number the target's
token at that position is drawn with (`verify.positional`; the first child of specinfer and rsd-c, rsd-c's
others then without replacement among the rest; rsd-s's beams as drawn). The tree goes to the verifier without
q, which keeps the child that is the target's positional token: the text is sampled "ar"'s with the same seed,
whatever shapes "auto" picks and however requests are batched (docs/same_seed.md). "auto" (the default) is
"positional" when the caller gave a seed and "joint" when not.

Any drafter: one with the target's vocabulary (or `self:N`) drafts from its own distribution; one with
another vocabulary drafts from its distribution restricted to the tokens both share (TLI's intersection,
`DraftVocab.project`), in target ids, and reads the tree back in its own ids.

One drafter forward per level: the root's children come from the logits after the drafter reads its
pending tokens; each further level is a tree forward of the drafter over the nodes drawn so far, which
is then dropped from its cache (the drafter re-reads the accepted path after verification). Greedy
(T = 0): the b largest drafter logits per node (rsd-c: a top-k tree; rsd-s: beam search), and the
target's argmax path through it, so the output equals greedy decoding.
"""

from __future__ import annotations

import dataclasses

import torch

from specops import ops
from specops import vocab as vocab_maps
from specops._seeds import beam_seeds
from specops.decoding.draft_vocab import DraftVocab, intersection
from specops.decoding.retokenize import Retokenizer
from specops.decoding.drafter import DrafterProposer
from specops.decoding.protocol import Drafter, Method, Proposal, Setup, StepResult, TreeDraft, draft_offset
from specops.decoding.tree import tree_from_parents
from specops.decoding.cost_model import TreeShape
from specops.decoding.verify import positional, resolve_scheme, scheme_option

INITIAL_BRANCHING = (2, 2)  # where "auto" starts for rsd-c / specinfer
INITIAL_BEAMS = (2, 3)  # where "auto" starts for rsd-s: W beams, L levels
_CHILD_BITS = 16  # draft offsets: (level << 16) | child, so levels never share random numbers

def check_branching(setting) -> None:
    if setting == "auto":
        return
    if (isinstance(setting, tuple) and setting and
            all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b < 1 << _CHILD_BITS for b in setting)):
        return
    raise ValueError("num_draft_tokens for methods 'rsd-c' and 'specinfer' must be 'auto' or a tuple (b1, ..., bL) "
                     f"of children per node at each level, each >= 1, got {setting!r}")


def check_beams(setting) -> None:
    if setting == "auto":
        return
    if (isinstance(setting, tuple) and len(setting) == 2 and
            all(isinstance(v, int) and not isinstance(v, bool) for v in setting) and
            1 <= setting[0] < 1 << _CHILD_BITS and setting[1] >= 1):
        return
    raise ValueError("num_draft_tokens for method 'rsd-s' must be 'auto' or a tuple (W, L): W >= 1 beams kept at "
                     f"each of L >= 1 levels, got {setting!r}")


@dataclasses.dataclass
class Level:
    """One level of a draft tree: children [B, M] in verification ids (-1: none) under the frontier slots
    slot [B, M] (-1: none), and q [B, P, V] of every frontier node (None when greedy)."""

    tokens: torch.Tensor
    slot: torch.Tensor
    q: torch.Tensor | None


class TreeDrafter(DrafterProposer):
    """A draft tree per request, drawn level by level from the drafter; subclasses say how a level's
    children are drawn (`children`) and how many levels a shape has (`depth`). The shape is fixed or, with
    num_draft_tokens="auto", chosen every step from measured costs and acceptance (`TreeShape`)."""

    verifier = "tree"
    replacement = False
    beams = False  # shapes are (W, L), not branchings

    def __init__(self, setup: Setup, vocab: DraftVocab, prompts: list[list[int]], initial: tuple[int, ...]):
        super().__init__(dataclasses.replace(setup, num_draft_tokens="auto"), prompts)
        self.vocab = vocab
        # Sampled trees under "positional" go to the verifier without q: verify.tree accepts the child that is
        # the target's positional token (BranchingDrafter draws every node's first child with its number).
        # Otherwise they go with q, to tree_verify's scheme ("recursive" or "traversal").
        self.scheme = resolve_scheme(setup.options, seeded=setup.seeded, carries_q=True)
        self.matched = self.scheme.name == "positional" and not self.params.greedy
        auto = setup.num_draft_tokens == "auto"
        self.chooser = TreeShape.remembered(self.beams, initial, setup.target.model, setup.drafter_key,
                                            setup.method) if auto else None
        self.shape = initial if auto else tuple(setup.num_draft_tokens)
        self.sizer = self.chooser
        self.tree: tuple[list, list] | None = None  # the last tree's tokens and parents per request (lists)

    def start(self, first: list[int]) -> None:
        self.pending = [p + self.vocab.to_drafter([t]) for p, t in zip(self.pending, first)]

    def depth(self) -> int:
        if not self.shape:
            return 0
        return self.shape[1] if self.beams else len(self.shape)

    def children(self, logits: torch.Tensor, step: int, level: int) -> Level:
        """The children of the frontier, whose drafter logits in verification ids are logits [B, P, V]."""
        raise NotImplementedError

    def propose(self, step: int, budget: torch.Tensor, last: torch.Tensor) -> Proposal:
        batch, device = budget.shape[0], budget.device
        if self.chooser is not None:
            self.shape = self.chooser.choose(batch)
            if self.shape and not self.repays(self.shape, budget):
                self.shape = ()
        depth = min(self.depth(), int(budget.min()))  # every request's path fits its budget
        self.k = depth
        if depth == 0:  # plain decoding: the drafter reads nothing now and catches up later
            self.tree = None
            root = torch.zeros(batch, 1, dtype=torch.long, device=device)
            return Proposal(tree=TreeDraft(root, root, torch.ones(batch, dtype=torch.long, device=device)),
                            width=self.vocab.width, size=0)
        logits = self.read()[:, None]  # [B, 1, V_d] after each request's last emitted token: the root's children
        tokens = [torch.zeros(batch, dtype=torch.long, device=device)]
        parents = [torch.zeros(batch, dtype=torch.long, device=device)]
        probs = [] if not (self.params.greedy or self.matched) else None
        frontier = [0]  # node indices of the current level
        for level in range(depth):
            found = self.children(self.vocab.project(logits), step, level)
            if probs is not None:
                probs += [None] * (len(tokens) - len(probs))
                for i, node in enumerate(frontier):
                    probs[node] = found.q[:, i]
            first = frontier[0]  # a level's nodes are consecutive
            new = []
            for j in range(found.tokens.shape[1]):
                new.append(len(tokens))
                tokens.append(found.tokens[:, j])
                parents.append(first + found.slot[:, j].clamp(min=0))
            frontier = new
            if level + 1 < depth:
                logits = self._level_logits(torch.stack(tokens, 1), torch.stack(parents, 1), frontier)
        return self._proposal(torch.stack(tokens, 1), torch.stack(parents, 1), probs)

    def _level_logits(self, tokens: torch.Tensor, parents: torch.Tensor, frontier: list[int]) -> torch.Tensor:
        """The drafter's logits [B, len(frontier), V_d] at the frontier nodes: one tree forward over every
        node but the root (already in its cache), then dropped again. Nodes past q's support (-1) are
        padding."""
        valid = tokens[:, 1:] >= 0
        alive = valid.clone()
        for n in range(2, tokens.shape[1]):  # a node under a padding node is padding too
            parent = parents[:, n]
            alive[:, n - 1] &= torch.where(parent > 0, alive.gather(1, (parent - 1).clamp(min=0)[:, None])[:, 0],
                                           True)
        shape = tree_from_parents(tokens, parents, torch.full_like(tokens[:, 0], tokens.shape[1]))
        visible = shape.visible[:, 1:, 1:] & alive[:, None, :] & alive[:, :, None]
        visible |= torch.eye(visible.shape[1], dtype=torch.bool, device=visible.device)
        fed = torch.where(alive, self.vocab.drafter_ids(tokens[:, 1:]), 0)
        depth = torch.where(alive, shape.depth[:, 1:] - 1, 0)  # padding sees only itself, as the verifier's
        logits = self.state.append_tree(fed, alive, depth, visible)
        self.state.discard(fed.shape[1])
        return logits[:, [n - 1 for n in frontier]]

    def _proposal(self, tokens: torch.Tensor, parents: torch.Tensor, probs: list | None) -> Proposal:
        """Drop nodes past q's support (-1) and their subtrees, renumbering each request's nodes."""
        batch, size = tokens.shape
        token_rows, parent_rows = tokens.tolist(), parents.tolist()
        kept = []  # per request: (tokens, parents, old node -> new node)
        for b in range(batch):
            index, row_tokens, row_parents = {0: 0}, [0], [0]
            for n in range(1, size):
                parent, token = parent_rows[b][n], token_rows[b][n]
                if token < 0 or parent not in index:
                    continue
                index[n] = len(row_tokens)
                row_tokens.append(token)
                row_parents.append(index[parent])
            kept.append((row_tokens, row_parents, index))
        counts = [len(t) for t, _, _ in kept]
        out_tokens = torch.zeros(batch, size, dtype=torch.long)
        out_parents = torch.zeros(batch, size, dtype=torch.long)
        for b, (row_tokens, row_parents, _) in enumerate(kept):
            out_tokens[b, : counts[b]] = torch.tensor(row_tokens)
            out_parents[b, : counts[b]] = torch.tensor(row_parents)
        device = tokens.device
        q = None
        if probs is not None:
            q = torch.zeros(batch, size, self.vocab.width, device=device)
            for b, (_, _, index) in enumerate(kept):
                for old, new in index.items():
                    if old < len(probs) and probs[old] is not None:
                        q[b, new] = probs[old][b]
        draft = TreeDraft(out_tokens.to(device), out_parents.to(device), torch.tensor(counts, device=device), q,
                          self.replacement, self.scheme.op("tree"))
        self.tree = ([t for t, _, _ in kept], [p for _, p, _ in kept])
        return Proposal(tree=draft, width=self.vocab.width, size=size - 1)

    def accept(self, result: StepResult) -> None:
        # The tree's nodes left the drafter's cache: it reads the accepted path and the emitted token.
        self.pending = [p + self.vocab.to_drafter(e) for p, e in zip(self.pending, result.emitted)]
        self.moved(result)
        if self.chooser is not None:
            paths = [] if self.tree is None else [_path(t, p, e, n) for t, p, e, n in
                                                  zip(*self.tree, result.emitted, result.accepted)]
            # the shape drawn: fewer levels than chosen where a request's budget cut the tree
            drawn = () if not self.k else (self.shape[0], self.k) if self.beams else self.shape[:self.k]
            self.chooser.observe(drawn, len(result.emitted), result.target_seconds, result.drafter_seconds,
                                 result.outside_seconds, paths)

    def select(self, rows: torch.Tensor) -> None:
        super().select(rows)
        if self.tree is not None:
            keep = rows.tolist()
            self.tree = tuple([part[r] for r in keep] for part in self.tree)


def _path(tokens: list[int], parents: list[int], emitted: list[int], accepted: int) -> list[tuple[int, int]]:
    """The nodes the verification walked, as (children, rank of the accepted child or 0): the root, then
    each accepted draft (for i.i.d. siblings, the first child with the emitted token)."""
    children: dict[int, list[int]] = {}
    for n in range(1, len(tokens)):
        children.setdefault(parents[n], []).append(n)
    path, node = [], 0
    for i in range(accepted + 1):
        kids = children.get(node, [])
        rank = 0
        if i < accepted:
            rank = next(j for j, c in enumerate(kids, 1) if tokens[c] == emitted[i])
        path.append((len(kids), rank))
        if not rank:
            break
        node = kids[rank - 1]
    return path


class BranchingDrafter(TreeDrafter):
    """rsd-c (siblings without replacement) and specinfer (i.i.d. siblings): b_l children per node."""

    def __init__(self, setup: Setup, vocab: DraftVocab, prompts: list[list[int]], replacement: bool):
        super().__init__(setup, vocab, prompts, INITIAL_BRANCHING)
        self.replacement = replacement

    def children(self, logits: torch.Tensor, step: int, level: int) -> Level:
        """branching[level] children for each parent, each parent drawing from its own stream (`beam_seeds`:
        the request's seed moved by the parent's place in the level) at offset (step, level, child).
        Coupled (scheme "positional"): the first child is drawn from q with the random number of the target's
        token at the level's position (`verify.positional`), and the others as before but never that
        token again (rsd-c: the first branching - 1 of the draws without replacement that are not it)."""
        batch, parents, width = logits.shape
        count = min(self.shape[level], width)  # no more distinct children than tokens
        seeds = beam_seeds(self.seeds, parents).reshape(-1)
        p = self.params
        flat = logits.reshape(-1, width)
        draws = []
        calls = count - self.matched if self.replacement else int(count > self.matched)  # without replacement: one
        for i in range(calls):
            token, q = ops.sample_without_replacement(
                flat, count if not self.replacement else 1, temperature=p.temperature, top_k=p.top_k,
                top_p=p.top_p, seed=seeds, offset=draft_offset(step, level << _CHILD_BITS | i), validate=False)
            draws.append(token)
        if self.matched:
            where = (self.position + level).to(self.seeds.device)[:, None].expand(batch, parents)
            first = positional(logits, p, self.seeds, where).reshape(-1, 1)
            rest = torch.cat(draws, dim=1) if draws else first[:, :0]
            if not self.replacement:  # the draws in their order, the first child's token moved last, cut
                order = torch.sort((rest == first).to(torch.int8), dim=1, stable=True).indices
                rest = rest.gather(1, order)[:, :count - 1]
            draws = [first, rest]
        tokens = torch.cat(draws, dim=1).view(batch, parents * count)
        slot = torch.arange(parents, device=logits.device).repeat_interleave(count).expand(batch, -1)
        return Level(tokens, slot, None if p.greedy or self.matched else q.view(batch, parents, width))


class BeamDrafter(TreeDrafter):
    """rsd-s: W beams per level by Stochastic Beam Search; shapes are (W, L)."""

    beams = True

    def __init__(self, setup: Setup, vocab: DraftVocab, prompts: list[list[int]]):
        super().__init__(setup, vocab, prompts, INITIAL_BEAMS)
        self.log_probs = self.scores = self.lead = None

    def children(self, logits: torch.Tensor, step: int, level: int) -> Level:
        batch, parents, _ = logits.shape
        if level == 0:  # one beam per request, the root: phi = G = 0
            self.log_probs = logits.new_zeros(batch, 1, dtype=torch.float32)
            self.scores = logits.new_zeros(batch, 1, dtype=torch.float32)
            self.lead = torch.zeros(batch, dtype=torch.long, device=logits.device)
        p = self.params
        width = min(self.shape[0], logits.shape[-1])  # no more distinct children than tokens
        before = self.log_probs
        slot, tokens, self.log_probs, self.scores, q = ops.stochastic_beam_step(
            logits, self.log_probs, self.scores, width, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
            seed=self.seeds, offset=draft_offset(step, level << _CHILD_BITS), validate=False)
        if self.matched:
            self._keep_lead(logits, before, slot, tokens, q, level)
        return Level(tokens, slot, None if p.greedy or self.matched else q)

    def _keep_lead(self, logits, before, slot, tokens, q, level: int) -> None:
        """Scheme "positional": the lead beam, whose every token is the drafter's draw with the target's
        positional random number (as TokenDrafter's chain), gets that draw as a child at every level: it
        is kept if Stochastic Beam Search kept it, else it takes the place of the level's worst child (or an
        empty one). The tree then holds the coupled chain and W - 1 beams besides (in place)."""
        rows = torch.arange(slot.shape[0], device=slot.device)
        where = (self.position + level).to(self.seeds.device)[:, None]
        want = positional(logits[rows, self.lead][:, None], self.params, self.seeds, where)[:, 0].to(slot.device)
        hit = (slot == self.lead[:, None]) & (tokens == want[:, None])
        empty = tokens < 0
        place = torch.where(empty.any(1), empty.long().argmax(1), slot.shape[1] - 1)
        index = torch.where(hit.any(1), hit.long().argmax(1), place)
        lowest = torch.where(torch.isfinite(self.scores), self.scores, float("inf")).amin(1)
        phi = before[rows, self.lead] + q[rows, self.lead, want].clamp_min(1e-30).log()
        score = torch.where(torch.isfinite(self.scores[rows, index]), self.scores[rows, index], lowest)
        slot[rows, index], tokens[rows, index] = self.lead, want
        self.log_probs[rows, index], self.scores[rows, index] = phi, score
        self.lead = index


def _draft_vocab(setup: Setup) -> tuple[DraftVocab, list[list[int]]]:
    """The drafter's vocabulary crossing and its prompts: its own vocabulary when it is the target's, else
    the intersection (tli's)."""
    if setup.same_vocabulary:
        setup.drafter.check_prompts(setup.batch.prompt_rows, setup.batch.max_new_tokens, "drafter")
        prompts = [list(p) for p in setup.batch.prompt_rows]
        target_rows, drafter_rows, device = setup.target.vocab_size, setup.drafter.vocab_size, setup.target.device
        if drafter_rows == target_rows:
            return DraftVocab.same(target_rows, device), prompts
        # The same tokenizer over LM heads of other sizes (padding rows): ids past the target's never drafted.
        ids = torch.arange(drafter_rows, device=device)
        return DraftVocab(torch.where(ids < target_rows, ids, -1), target_rows, target_rows, list), prompts
    vmap = vocab_maps.vocab_map(setup.tokenizer, setup.drafter_tokenizer)
    text = Retokenizer(vmap, setup.tokenizer, setup.drafter_tokenizer)
    prompts = setup.batch.encode(setup.drafter_tokenizer)
    setup.drafter.check_prompts(prompts, setup.batch.max_new_tokens, "drafter")
    vocab = intersection(vmap, text, setup.drafter.vocab_size, setup.target.vocab_size, setup.target.device)
    return vocab, prompts


def _branching(replacement: bool):
    def make(setup: Setup) -> TreeDrafter:
        return BranchingDrafter(setup, *_draft_vocab(setup), replacement)

    return make


def _beams(setup: Setup) -> TreeDrafter:
    return BeamDrafter(setup, *_draft_vocab(setup))


METHODS = [
    Method("rsd-c", "draft trees of constant branching, siblings drawn without replacement, verified by "
           "recursive rejection sampling (RSD-C)", _branching(False), drafter=Drafter.ANY_VOCABULARY, trees=("target", "drafter"),
           draft_setting=check_branching, **scheme_option()),
    Method("rsd-s", "draft trees of W sequences drawn without replacement by Stochastic Beam Search, verified "
           "by recursive rejection sampling (RSD-S)", _beams, drafter=Drafter.ANY_VOCABULARY, trees=("target", "drafter"),
           draft_setting=check_beams, **scheme_option()),
    Method("specinfer", "draft trees of constant branching with i.i.d. siblings (SpecInfer), verified by "
           "recursive rejection sampling", _branching(True), drafter=Drafter.ANY_VOCABULARY, trees=("target", "drafter"),
           draft_setting=check_branching, **scheme_option()),
]
