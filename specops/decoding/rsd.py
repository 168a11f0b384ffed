"""Draft trees from a drafter, verified whole by recursive rejection sampling (paper 003, RSD; SpecInfer):

- "rsd-c": constant branching factors per level, num_draft_tokens = (b1, ..., bL): each node at level l
  gets b_{l+1} children drawn without replacement from the drafter's distribution there
  (`specops.ops.sample_without_replacement`), and `tree_verify` checks them with the residual target
  and the draft renormalized over what was not yet drawn (RSD-C, paper 003 Alg 3-4).
- "specinfer": the same tree shape with i.i.d. children (SpecInfer's multi-step speculative sampling),
  the baseline RSD improves on: a repeated sibling is wasted.

One drafter forward per level: the root's children come from the logits after the drafter reads its
pending tokens; each further level is a tree forward of the drafter over the nodes drawn so far, which
is then dropped from its cache (the drafter re-reads the accepted path after verification). Greedy
(T = 0): the b largest drafter logits per node (a top-k tree), and the target's argmax path through it,
so the output equals greedy decoding.
"""

from __future__ import annotations

import dataclasses

import torch

from specops import ops
from specops.decoding.drafter import DrafterProposer
from specops.decoding.step import Method, Proposal, Setup, StepResult, TreeDraft, draft_offset
from specops.decoding.tree import tree_from_parents

DEFAULT_BRANCHING = (2, 2)  # "auto": a fixed shape until tree shapes are chosen from measured costs
_CHILD_BITS = 16  # draft offsets: (level << 16) | child, so levels never share random numbers
_PARENT_STRIDE = 0x632BE59BD9B4E019  # odd: a level's parents get distinct seeds (int64 arithmetic wraps)


def check_branching(setting) -> None:
    if setting == "auto":
        return
    if (isinstance(setting, tuple) and setting and
            all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b < 1 << _CHILD_BITS for b in setting)):
        return
    raise ValueError("num_draft_tokens for methods 'rsd-c' and 'specinfer' must be 'auto' or a tuple (b1, ..., bL) "
                     f"of children per node at each level, each >= 1, got {setting!r}")


class TreeDrafter(DrafterProposer):
    verifier = "tree"

    def __init__(self, setup: Setup, replacement: bool):
        super().__init__(dataclasses.replace(setup, num_draft_tokens="auto"),
                         [list(p) for p in setup.batch.prompt_rows])
        setting = setup.num_draft_tokens
        self.branching = DEFAULT_BRANCHING if setting == "auto" else tuple(setting)
        self.replacement = replacement
        self.vocab = setup.target.vocab_size
        self.accepted_paths: list[list[int]] = []

    def start(self, first: list[int]) -> None:
        self.pending = [p + [t] for p, t in zip(self.pending, first)]

    def _children(self, logits: torch.Tensor, count: int, step: int, level: int) -> tuple[torch.Tensor, torch.Tensor]:
        """count children for each of the level's parents, logits [B, P, V]: tokens [B, P, count] (-1 past
        q's support) and q [B, P, V]. Every parent draws from its own stream: the request's seed moved by
        the parent's place in the level, at offset (step, level, child)."""
        batch, parents, vocab = logits.shape
        seeds = (self.seeds[:, None] + _PARENT_STRIDE * torch.arange(parents, device=self.seeds.device)).reshape(-1)
        p = self.params
        flat = logits.reshape(-1, vocab)
        if not self.replacement:
            tokens, q = ops.sample_without_replacement(flat, count, temperature=p.temperature, top_k=p.top_k,
                                                       top_p=p.top_p, seed=seeds,
                                                       offset=draft_offset(step, level << _CHILD_BITS), validate=False)
        else:
            draws = []
            for i in range(count):  # i.i.d.: independent single draws
                token, q = ops.sample_without_replacement(flat, 1, temperature=p.temperature, top_k=p.top_k,
                                                          top_p=p.top_p, seed=seeds,
                                                          offset=draft_offset(step, level << _CHILD_BITS | i),
                                                          validate=False)
                draws.append(token)
            tokens = torch.cat(draws, dim=1)
        return tokens.view(batch, parents, count), q.view(batch, parents, vocab)

    def propose(self, step: int, budget: torch.Tensor, last: torch.Tensor) -> Proposal:
        batch, device = budget.shape[0], budget.device
        depth = min(len(self.branching), int(budget.min()))  # every request's path fits its budget
        self.k = depth
        logits = self.read()  # [B, V] after each request's last emitted token: the root's children
        tokens = [torch.zeros(batch, dtype=torch.long, device=device)]
        parents = [torch.zeros(batch, dtype=torch.long, device=device)]
        probs = [] if not self.params.greedy else None
        frontier = [0]  # node indices of the current level
        for level in range(depth):
            width = self.branching[level]
            kids, q = self._children(logits.view(batch, len(frontier), -1), width, step, level)
            if probs is not None:
                probs += [None] * (len(tokens) - len(probs))
                for i, node in enumerate(frontier):
                    probs[node] = q[:, i]
            new = []
            for i, node in enumerate(frontier):
                for j in range(width):
                    new.append(len(tokens))
                    tokens.append(kids[:, i, j])
                    parents.append(torch.full((batch,), node, dtype=torch.long, device=device))
            frontier = new
            if level + 1 < depth:
                logits = self._level_logits(torch.stack(tokens, 1), torch.stack(parents, 1), frontier)
        return self._proposal(torch.stack(tokens, 1), torch.stack(parents, 1), probs)

    def _level_logits(self, tokens: torch.Tensor, parents: torch.Tensor, frontier: list[int]) -> torch.Tensor:
        """The drafter's logits [B, len(frontier), V] at the frontier nodes: one tree forward over every node
        but the root (already in its cache), then dropped again. Nodes past q's support (-1) are padding."""
        valid = tokens[:, 1:] >= 0
        alive = valid.clone()
        for n in range(2, tokens.shape[1]):  # a node under a padding node is padding too
            parent = parents[:, n]
            alive[:, n - 1] &= torch.where(parent > 0, alive.gather(1, (parent - 1).clamp(min=0)[:, None])[:, 0],
                                           True)
        shape = tree_from_parents(tokens, parents, torch.full_like(tokens[:, 0], tokens.shape[1]))
        visible = shape.visible[:, 1:, 1:] & alive[:, None, :] & alive[:, :, None]
        visible |= torch.eye(visible.shape[1], dtype=torch.bool, device=visible.device)
        fed = torch.where(alive, tokens[:, 1:], 0)
        logits = self.state.append_tree(fed, alive, shape.depth[:, 1:] - 1, visible)
        self.state.discard(fed.shape[1])
        return logits[:, [n - 1 for n in frontier]]

    def _proposal(self, tokens: torch.Tensor, parents: torch.Tensor, probs: list | None) -> Proposal:
        """Drop nodes past q's support (-1) and their subtrees, renumbering each request's nodes."""
        batch, size = tokens.shape
        keep_tokens, keep_parents = [], []
        for b in range(batch):
            index, row_tokens, row_parents = {0: 0}, [0], [0]
            for n in range(1, size):
                parent, token = int(parents[b, n]), int(tokens[b, n])
                if token < 0 or parent not in index:
                    continue
                index[n] = len(row_tokens)
                row_tokens.append(token)
                row_parents.append(index[parent])
            keep_tokens.append((row_tokens, index))
            keep_parents.append(row_parents)
        counts = [len(t) for t, _ in keep_tokens]
        out_tokens = torch.zeros(batch, size, dtype=torch.long)
        out_parents = torch.zeros(batch, size, dtype=torch.long)
        for b in range(batch):
            out_tokens[b, : counts[b]] = torch.tensor(keep_tokens[b][0])
            out_parents[b, : counts[b]] = torch.tensor(keep_parents[b])
        device = tokens.device
        q = None
        if probs is not None:
            q = torch.zeros(batch, size, self.vocab, device=device)
            for b in range(batch):
                for old, new in keep_tokens[b][1].items():
                    if old < len(probs) and probs[old] is not None:
                        q[b, new] = probs[old][b]
        draft = TreeDraft(out_tokens.to(device), out_parents.to(device), torch.tensor(counts, device=device), q,
                          self.replacement)
        return Proposal(tree=draft, width=self.vocab, size=size - 1)

    def accept(self, result: StepResult) -> None:
        # The tree's nodes left the drafter's cache: it reads the accepted path and the emitted token.
        self.pending = [p + e for p, e in zip(self.pending, result.emitted)]


def _make(replacement: bool):
    def make(setup: Setup) -> TreeDrafter:
        setup.drafter.check_prompts(setup.batch.prompt_rows, setup.batch.max_new_tokens, "drafter")
        return TreeDrafter(setup, replacement)

    return make


METHODS = [
    Method("rsd-c", "draft trees of constant branching, siblings drawn without replacement, verified by "
           "recursive rejection sampling (RSD-C)", _make(False), drafter="same", trees=("target", "drafter"),
           draft_setting=check_branching),
    Method("specinfer", "draft trees of constant branching with i.i.d. siblings (SpecInfer), verified by "
           "recursive rejection sampling", _make(True), drafter="same", trees=("target", "drafter"),
           draft_setting=check_branching),
]
