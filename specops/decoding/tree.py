"""Draft trees, one per request, scored in one target forward and verified whole by `tree_verify`.

Draft rows that share a prefix share its nodes (a trie, `build_tree`); trees drawn level by level come
as parent pointers (`tree_from_parents`). The attention mask lets a node see only its ancestors (engine
`KVState.append_tree`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DraftTree", "build_tree", "tree_from_parents"]


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


def _closure(parent: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """visible [B, N, N] (a node sees itself and its ancestors) and depth [B, N] of trees whose parents
    precede their children; invalid nodes see only themselves, at depth 0."""
    batch, size = parent.shape
    rows = torch.arange(batch, device=parent.device)
    visible = torch.eye(size, dtype=torch.bool, device=parent.device).repeat(batch, 1, 1)
    depth = torch.zeros(batch, size, dtype=torch.int64, device=parent.device)
    for i in range(1, size):  # parents precede children: one pass in node order suffices
        p = parent[:, i]
        visible[:, i] |= visible[rows, p] & valid[:, i:i + 1]
        depth[:, i] = torch.where(valid[:, i], depth[rows, p] + 1, 0)
    return visible, depth


def tree_from_parents(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor) -> DraftTree:
    """The DraftTree of trees given by parent pointers: tokens, parents [B, N] (node 0 the root; nodes at
    or past num_nodes[b] are padding), as `specops.ops.tree_verify` takes them. No row paths."""
    batch, size = tokens.shape
    valid = torch.arange(size, device=tokens.device) < num_nodes[:, None]
    parent = torch.where(valid, parents, 0).clamp(min=0)
    parent[:, 0] = 0
    visible, depth = _closure(parent, valid)
    return DraftTree(torch.where(valid, tokens, 0), depth, parent, valid, visible,
                     torch.empty(batch, 0, 0, dtype=torch.int64, device=tokens.device))


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
    visible, depth = _closure(parent, valid)
    device = rows.device
    return DraftTree(tokens.to(device), depth.to(device), parent.to(device), valid.to(device),
                     visible.to(device), torch.tensor(paths, dtype=torch.int64, device=device))
