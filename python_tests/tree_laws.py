"""Exact laws of tree verifiers on small Markov tables, by enumeration (float64, no kernel): every tree a
drafter can draw for a shape, every outcome of recursive rejection sampling and of traversal verification on
it, the law of what they emit continued by the target, their expected accepted drafts, and the most any lossless
verifier can keep on the same trees (`optimal_accepted`). Used by test_traversal_verify.py and
bench/tree_bound.py."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import numpy as np

from chain_cases import markov_tables


def traversal_outcomes(tokens, parents, p, q, replacement: bool, residual: str = "traversal") -> dict:
    """{(node kept last, emitted token): probability} of `_traversal_verify_request` on one tree, exactly: every
    keep / reject decision is a fresh uniform (each node is decided at most once), so the walk branches on it.
    tokens, parents: lists (node 0 the root); p[n], q[n]: the target's and the drafter's distributions for node
    n's children (lists; q[n] None: one-hot on each child). residual="token" is a wrong variant: a rejected
    node's parent takes the per-token residual max(0, p - q) and keeps its weight (no w_b in either)."""
    count = len(tokens)
    kids = [[c for c in range(1, count) if parents[c] == b] for b in range(count)]
    outcomes = defaultdict(float)

    def weights(alive, r, mass, left, fraction):
        w = [1.0] * count
        for c in range(1, count):
            b = parents[c]
            if c in fraction:
                w[c] = fraction[c][0] / fraction[c][1]
            elif c in alive[b]:
                pw = w[b] * r[b][tokens[c]] / mass[b]
                q_x = 1.0 if q[b] is None else q[b][tokens[c]] / left[b]
                w[c] = 1.0 if pw >= q_x else pw / q_x
        return w

    def walk(alive, r, mass, left, fraction, prob):
        w = weights(alive, r, mass, left, fraction)
        a = 0
        while alive[a]:
            a = alive[a][0]
            if w[a] == 0.0:  # stands for its subtree: every node in it has weight 0
                break
        keep = 1.0 if a == 0 else w[a]
        if keep > 0.0:
            total = sum(r[a])
            for y, r_y in enumerate(r[a]):
                if r_y > 0.0:
                    outcomes[a, y] += prob * keep * r_y / total
        if keep >= 1.0:
            return
        b, x = parents[a], tokens[a]
        alive = [[c for c in k if c != a] for k in alive]
        r, mass, left, fraction = list(r), list(mass), list(left), dict(fraction)
        scale = w[b] if residual == "traversal" else 1.0
        if q[b] is None:
            s = scale * (mass[b] - r[b][x]) / mass[b]
            if s > 0.0:
                mass[b] -= r[b][x]
                r[b] = [0.0 if y == x else r_y for y, r_y in enumerate(r[b])]
        else:
            update = [max(0.0, scale * r_y / mass[b] - q_y / left[b]) for r_y, q_y in zip(r[b], q[b])]
            s = sum(update)
            if s > 0.0:
                r[b], mass[b] = update, s
            if not replacement:
                left[b] -= q[b][x]
        if b != 0 and residual == "traversal":
            den = s + 1.0 - w[b]
            fraction[b] = (s, den) if den > 0.0 else (0.0, 1.0)
        walk(alive, r, mass, left, fraction, prob * (1.0 - keep))

    walk(kids, [list(row) for row in p], [1.0] * count, [1.0] * count, {}, 1.0)
    return outcomes


def recursive_outcomes(tokens, parents, p, q, replacement: bool) -> dict:
    """The same for recursive rejection sampling (the default scheme): children in node order, accept x with
    min(1, p_i(x) / q_i(x)), else p_{i+1} = norm(max(0, p_i - q_i)) and, without replacement, q_{i+1} = q_i
    without x."""
    count, vocab = len(tokens), len(p[0])
    kids = [[c for c in range(1, count) if parents[c] == b] for b in range(count)]
    outcomes = defaultdict(float)

    def visit(node, prob):
        def try_child(i, r, left, prob):
            total = sum(r)
            if i == len(kids[node]):
                for y, r_y in enumerate(r):
                    if r_y > 0.0:
                        outcomes[node, y] += prob * r_y / total
                return
            c, x = kids[node][i], tokens[kids[node][i]]
            q_i = [float(y == x) for y in range(vocab)] if q[node] is None else [v / left for v in q[node]]
            accept = min(1.0, r[x] / total / q_i[x])
            if accept > 0.0:
                visit(c, prob * accept)
            if accept < 1.0:
                update = [max(0.0, r_y / total - q_y) for r_y, q_y in zip(r, q_i)]
                left_next = left - q[node][x] if q[node] is not None and not replacement else left
                try_child(i + 1, update if sum(update) > 0.0 else r, left_next, prob * (1.0 - accept))

        try_child(0, list(p[node]), 1.0, prob)

    visit(0, 1.0)
    return outcomes


def sibling_draws(q_row: list[float], count: int, mode: str) -> list[tuple[tuple[int, ...], float]]:
    """Every ordered draw of `count` siblings from q_row with its probability. mode "rsd": without
    replacement (fewer where q has fewer tokens); "specinfer": i.i.d.; "rows": the most likely tokens of q."""
    if mode == "rows":
        return [(tuple(sorted(range(len(q_row)), key=lambda y: -q_row[y])[:count]), 1.0)]
    if mode == "rsd":
        count = min(count, sum(v > 0 for v in q_row))
    draws = [((), 1.0)]
    for _ in range(count):
        draws = [(drawn + (y,), prob * q_y / (1.0 - sum(q_row[t] for t in drawn) if mode == "rsd" else 1.0))
                 for drawn, prob in draws for y, q_y in enumerate(q_row)
                 if q_y > 0.0 and (mode == "specinfer" or y not in drawn)]
    return draws


def tree_draws(shape: tuple[int, ...], drafter: dict, mode: str) -> list[tuple]:
    """Every tree with shape[level] children per node at each level, drawn from the drafter's table (the row
    after each node's path): [(tokens, parents, paths, probability)], nodes numbered level by level, siblings in
    draw order."""
    trees = [([0], [0], [()], [0], 1.0)]  # tokens, parents, paths, the deepest level's nodes, probability
    for count in shape:
        grown = []
        for tokens, parents, paths, frontier, prob in trees:
            for combo in itertools.product(*(sibling_draws(drafter[paths[n]], count, mode) for n in frontier)):
                tokens_, parents_, paths_, frontier_, prob_ = list(tokens), list(parents), list(paths), [], prob
                for n, (drawn, drawn_prob) in zip(frontier, combo):
                    prob_ *= drawn_prob
                    for x in drawn:
                        frontier_.append(len(tokens_))
                        tokens_.append(x)
                        parents_.append(n)
                        paths_.append(paths[n] + (x,))
                grown.append((tokens_, parents_, paths_, frontier_, prob_))
        trees = grown
    return [(tokens, parents, paths, prob) for tokens, parents, paths, _, prob in trees]


def tree_law(target: dict, drafter: dict, vocab: int, shape: tuple[int, ...], mode: str, outcomes) -> tuple:
    """(largest error of the law of the first len(shape) + 1 tokens, expected accepted drafts) when trees are
    drawn from the drafter, verified by `outcomes` (traversal_outcomes or recursive_outcomes) and the output is
    continued by the target, as the next steps would."""
    law, accepted = defaultdict(float), 0.0
    for tokens, parents, paths, prob in tree_draws(shape, drafter, mode):
        p = [target[path] for path in paths]
        q = [None if mode == "rows" else drafter[path] for path in paths]
        for (node, y), prob_out in outcomes(tokens, parents, p, q, mode == "specinfer").items():
            law[paths[node] + (y,)] += prob * prob_out
            accepted += prob * prob_out * len(paths[node])
    length = len(shape) + 1
    worst = 0.0
    for seq in itertools.product(range(vocab), repeat=length):
        # continued[n]: the target's probability of seq[n:] after seq[:n]
        continued = [math.prod(target[seq[:j]][seq[j]] for j in range(n, length)) for n in range(length + 1)]
        got = sum(law.get(seq[:n], 0.0) * continued[n] for n in range(1, length + 1))
        worst = max(worst, abs(got - continued[0]))
    return worst, accepted


def table_pair(vocab: int, depth: int, seed: int) -> tuple[dict, dict]:
    """Target and drafter Markov tables (lists) for every prefix up to `depth` tokens, some entries exactly 0."""
    return tuple({k: v.tolist() for k, v in markov_tables(vocab, depth, seed + s, zeros=True).items()} for s in (0, 7))


def correlated_pair(vocab: int, depth: int, seed: int, noise: float = 1.0) -> tuple[dict, dict]:
    """Target and drafter tables for every prefix up to `depth` tokens, the drafter's a noisy copy of the
    target's, as a real drafter is: target logits 1.5 N(0, 1), drafter logits those + noise N(0, 1)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    target, drafter = {}, {}
    for length in range(depth + 1):
        for prefix in itertools.product(range(vocab), repeat=length):
            logits = 1.5 * torch.randn(vocab, generator=gen, dtype=torch.float64)
            target[prefix] = torch.softmax(logits, 0).tolist()
            drafter[prefix] = torch.softmax(logits + noise * torch.randn(vocab, generator=gen, dtype=torch.float64),
                                            0).tolist()
    return target, drafter


def optimal_accepted(target: dict, drafter: dict, vocab: int, shape: tuple[int, ...], mode: str) -> float:
    """The most drafts any lossless verifier keeps in expectation on the trees `tree_draws` draws, the whole tree
    at once: the optimum that recursive rejection sampling and traversal verification are measured against.

    A verifier, given the tree T, emits z: a path of T (the drafts it keeps) and one more token; the target
    continues after z. Any such rule is a law pi(T, z) whose sum over z is T's probability, and it is lossless
    exactly when, for every sequence y of len(shape) + 1 tokens, sum over the prefixes z of y of
    L(z) p(rest of y | z) = p(y), where L(z) = sum over T of pi(T, z): the output, continued by the target,
    follows the target. Keeping E[|z| - 1] is linear in pi, so the optimum over every lossless verifier is a
    linear program, solved here exactly. At the root alone (one level) it is the multi-draft optimum of Hu et
    al., "Towards Optimal Multi-draft Speculative Decoding" (ICLR 2025, arXiv 2502.18779); on a chain it is
    block verification's (Sun et al., ICLR 2025: optimal for chains). Trees with the same set of paths are one
    tree here: a verifier could only tell them apart by the order of the draws, which says nothing about the
    target."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    depth = len(shape)
    laws: dict[frozenset, float] = defaultdict(float)
    for _, _, paths, prob in tree_draws(shape, drafter, mode):
        laws[frozenset(paths)] += prob
    trees = list(laws)
    full = {y: j for j, y in enumerate(itertools.product(range(vocab), repeat=depth + 1))}

    def law(seq: tuple, start: int) -> float:
        """The target's probability of seq[start:] after seq[:start]."""
        return math.prod(target[seq[:j]][seq[j]] for j in range(start, len(seq)))

    # Variables mu(T, z) = pi(T, z) / p(z) for the z the target can emit (a lossless verifier never emits one it
    # cannot), so that every coefficient is at least a probability of the tables (HiGHS drops coefficients
    # below 1e-9, and a tree's probability can be far smaller): the lossless row of each y with p(y) > 0 is
    # sum over its prefixes z and the trees of mu(T, z) = 1 (the condition above divided by p(y)), a tree's row
    # sum_z p(z) / P(T) mu(T, z) = 1.
    rows, columns, values, gain = [], [], [], []
    for i, paths in enumerate(trees):
        for path in paths:
            for x in range(vocab):
                z, column = path + (x,), len(gain)
                emitted = law(z, 0)
                if emitted <= 0.0:
                    continue
                rows.append(i)
                columns.append(column)
                values.append(emitted / laws[paths])
                for tail in itertools.product(range(vocab), repeat=depth + 1 - len(z)):
                    if law(z + tail, len(z)) > 0.0:
                        rows.append(len(trees) + full[z + tail])
                        columns.append(column)
                        values.append(1.0)
                gain.append(len(path) * emitted)
    possible = [j for y, j in full.items() if law(y, 0) > 0.0]
    constraints = coo_matrix((values, (rows, columns)), shape=(len(trees) + len(full), len(gain))).tocsr()
    constraints = constraints[list(range(len(trees))) + [len(trees) + j for j in possible]]
    # Always feasible (the plain target's token: mu(T, z) = P(T) on every z of one token); should one of HiGHS'
    # methods still call it infeasible, the next one answers.
    for method in ("highs-ipm", "highs-ds", "highs"):
        solved = linprog(-np.array(gain), A_eq=constraints, b_eq=np.ones(constraints.shape[0]), bounds=(0, None),
                         method=method)
        if solved.status == 0:
            break
    else:
        raise RuntimeError(f"optimal_accepted: the linear program failed: {solved.message}")
    return -solved.fun
