"""Draft trees: k draft rows laid out as one token tree per request, verified in one target forward.

Rows that share a prefix share its nodes, so a forward carries each distinct prefix once (a trie), and
the attention mask lets a node see only its ancestors (engine `KVState.append_tree`). Verification picks
one root-to-leaf path per request and checks it with `chain_verify`, as a chain of deterministic drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DraftTree", "build_tree", "choose_path"]


@dataclass
class DraftTree:
    """Node 0 of every request is the root: the last emitted token, which the target has not seen yet.

    tokens, depth, parent [B, N] int64 (padding nodes: token 0, parent 0, invalid); valid [B, N];
    visible [B, N, N] (node i sees node j: j is i or an ancestor); paths [B, k, w] the node of row r's
    j-th draft token (-1 past the row's end)."""

    tokens: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    valid: torch.Tensor
    visible: torch.Tensor
    paths: torch.Tensor

    @property
    def nodes(self) -> int:
        return self.tokens.shape[1]


def build_tree(root: torch.Tensor, rows: torch.Tensor) -> DraftTree:
    """The trie of draft rows [B, k, w] (a row ends at its first -1) under roots [B]."""
    batch, k, width = rows.shape
    root_list, row_list = root.tolist(), rows.tolist()
    node_tokens, node_parents, paths = [], [], [[[-1] * width for _ in range(k)] for _ in range(batch)]
    for b in range(batch):
        tokens, parents, children = [root_list[b]], [0], {}
        for r in range(k):
            node = 0
            for j, token in enumerate(row_list[b][r]):
                if token < 0:
                    break
                child = children.get((node, token))
                if child is None:
                    child = children[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = paths[b][r][j] = child
        node_tokens.append(tokens)
        node_parents.append(parents)
    size = max(len(t) for t in node_tokens)
    tokens = torch.zeros(batch, size, dtype=torch.int64)
    parent = torch.zeros(batch, size, dtype=torch.int64)
    valid = torch.zeros(batch, size, dtype=torch.bool)
    for b in range(batch):
        n = len(node_tokens[b])
        tokens[b, :n] = torch.tensor(node_tokens[b])
        parent[b, :n] = torch.tensor(node_parents[b])
        valid[b, :n] = True
    # Ancestor closure: parents precede children, so one pass in node order suffices.
    visible = torch.eye(size, dtype=torch.bool).repeat(batch, 1, 1)
    depth = torch.zeros(batch, size, dtype=torch.int64)
    for i in range(1, size):
        p = parent[:, i]
        visible[:, i] |= visible[torch.arange(batch), p] & valid[:, i:i + 1]
        depth[:, i] = torch.where(valid[:, i], depth[torch.arange(batch), p] + 1, 0)
    device = rows.device
    return DraftTree(tokens.to(device), depth.to(device), parent.to(device), valid.to(device),
                     visible.to(device), torch.tensor(paths, dtype=torch.int64, device=device))


def choose_path(tree: DraftTree, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The row [B] each request verifies: the one with the longest expected accepted prefix under the
    target. Greedy (T = 0): the longest prefix that matches the target's argmax. Sampling: the largest
    sum over j of prod_{i <= j} p(d_i), with p = softmax(logits / T) (top-k / top-p ignored here).

    The choice depends only on the target's logits, never on the random numbers that verification then
    draws, and every row starts from the same distribution at the root, so verifying the chosen row with
    chain_verify (deterministic drafts, q one-hot) keeps the output distribution exactly the target's."""
    paths = tree.paths
    present = paths >= 0
    node = paths.clamp(min=0)
    batch = torch.arange(paths.shape[0], device=paths.device)[:, None, None]
    parent = tree.parent[batch, node]
    token = tree.tokens[batch, node]
    if temperature == 0.0:
        choice = logits.argmax(-1)  # [B, N]
        hit = (choice[batch, parent] == token) & present
        score = hit.long().cumprod(-1).sum(-1).double()
    else:
        norm = torch.logsumexp(logits / temperature, dim=-1)  # [B, N]
        step = (logits[batch, parent, token] / temperature - norm[batch, parent]).double()
        score = step.masked_fill(~present, float("-inf")).cumsum(-1).exp().sum(-1)
    return score.argmax(-1)  # first row among equals
