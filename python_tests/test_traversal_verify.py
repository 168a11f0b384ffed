"""Tests of `specops::tree_verify(..., scheme="traversal")`: traversal verification of a draft tree (Weng et al.,
NeurIPS 2025, arXiv 2505.12398; the rule and its random numbers: `specops.reference._traversal_verify_request`),
in the layers of test_tree_verify.py, plus bad inputs.

1. Exact: greedy and point-mass requests are the recursive scheme's; a chain is `chain_verify(...,
   scheme="block")` draw for draw; the law of what the rule emits, enumerated exactly (float64, no kernel) over
   every tree of small shapes drawn i.i.d., without replacement or deterministically from Markov tables, is
   the target's, and it keeps at least as many drafts as recursive rejection sampling in expectation (more on
   sampled trees); the same enumeration of a per-token residual variant is off, so the check can fail; and the
   kernels' outcome frequencies on fixed trees are the enumerated law (this ties the kernels to the rule
   proven lossless).
2. Agreement: the C++ CPU kernel, the Triton kernel (interpreted on CPU without a GPU) and the public wrapper
   return exactly the reference's tokens for the same seeds, on ragged random trees, dtypes, sampling
   settings, with and without draft probabilities and replacement, across vocabulary chunks.
3. Statistics: the first token after a star and the first two tokens of a two-level tree follow the target
   (RSD without replacement, SpecInfer i.i.d. children, deterministic rows, a ragged tree), the mean number
   of accepted drafts is its exact expectation, above the recursive scheme's; and a verifier told the wrong
   sampling fails the same check.
4. `torch.library.opcheck`.
5. Bad inputs: an unknown scheme raises ValueError naming the allowed ones.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict

import pytest
import torch
from _triton import needs_triton, triton_launcher
from chain_cases import markov_tables
from tree_cases import (
    LOGIT_DTYPES,
    N_DRAWS,
    P_VALUE_MIN,
    STAR_CASES,
    TARGET_LOGITS,
    Z_MAX,
    assert_same,
    chisquare_pvalue,
    random_case,
    run_impl,
    small_case,
    star,
    target_probs,
    tree,
)

import specops

tree_verify_triton = triton_launcher("tree_verify")

# Triton's cases are slow here: its kernels run in the interpreter without a GPU.
TRITON_SLOW = pytest.param("triton", marks=(needs_triton, pytest.mark.slow))
IMPLS = ["reference", "cpp", TRITON_SLOW]
KERNELS = ["cpp", TRITON_SLOW]


def run(impl: str, args: tuple, offset: int = 0, scheme: str = "traversal", block_v: int | None = None):
    """(out_tokens, out_nodes, num_accepted) on CPU from one implementation; traversal unless told."""
    return run_impl(impl, args, offset, block_v, scheme)


def verify(device: str, logits, tokens, parents, probs=None, **kwargs):
    """specops.ops.tree_verify with scheme "traversal" on `device`, results on CPU."""
    moved = [None if t is None else t.to(device) for t in (logits, tokens, parents, probs)]
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return tuple(t.cpu() for t in specops.ops.tree_verify(*moved, scheme="traversal", **kwargs))


# ---- the exact law of one verification, enumerated (float64, pure Python) ----

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


SHAPES = [(1,), (2,), (3,), (2, 1), (1, 2), (2, 2), (1, 1, 1), (2, 1, 1)]
MODES = ["rsd", "specinfer", "rows"]  # without replacement, i.i.d., deterministic children with one-hot q


# ==== 1. Exact ====

@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_and_point_mass_requests_are_the_recursive_schemes(impl, dtype):
    # T = 0, and T = 1e-40 where logits / T overflow (p a point mass on the argmax, verified by the traversal
    # rule): the argmax path either way.
    gen = torch.Generator().manual_seed(1)
    for temperature in (0.0, 1e-40):
        for with_probs, replacement in ((False, False), (True, False), (True, True)):
            args = random_case(gen, 6, 9, 32, dtype, with_probs, replacement)
            args = args[:6] + (torch.full((6,), temperature),) + args[7:]
            assert_same(run(impl, args, 3), run(impl, args, 3, scheme="recursive"), f"T = {temperature}: ")


# A chain is block verification, draw for draw: test_tree_verify.py's test_chain_is_chain_verify.


@pytest.mark.parametrize("mode", MODES)
def test_traversal_is_lossless_and_keeps_more(mode):
    """Every tree of each shape, two table pairs per vocabulary: the law of the output continued by the target
    is the target's; the expected number of accepted drafts is never below recursive rejection sampling's, and
    above it somewhere on sampled trees."""
    gains = []
    for vocab, seed, shape in itertools.product((2, 3, 4), (0, 1), SHAPES):
        target, drafter = table_pair(vocab, len(shape), 100 * vocab + 10 * seed + len(shape))
        error, kept = tree_law(target, drafter, vocab, shape, mode, traversal_outcomes)
        assert error < 1e-12, (vocab, seed, shape, error)
        recursive_error, recursive_kept = tree_law(target, drafter, vocab, shape, mode, recursive_outcomes)
        assert recursive_error < 1e-12, (vocab, seed, shape, recursive_error)
        assert kept >= recursive_kept - 1e-12, (vocab, seed, shape, kept, recursive_kept)
        gains.append(kept - recursive_kept)
    if mode != "rows":
        assert max(gains) > 0.01, gains


@pytest.mark.parametrize("mode", MODES)
def test_the_per_token_residual_is_not_lossless(mode):
    """The check above can fail: the same leaf-to-root walk where a rejected node's parent takes the residual
    max(0, p - q) and keeps its weight."""
    wrong = functools.partial(traversal_outcomes, residual="token")
    worst = 0.0
    for vocab, shape in itertools.product((3, 4), [(2, 1), (1, 2), (2, 2)]):
        target, drafter = table_pair(vocab, len(shape), 100 * vocab + len(shape))
        worst = max(worst, tree_law(target, drafter, vocab, shape, mode, wrong)[0])
    assert worst > 1e-3


# Fixed trees over V = 4 for the kernels' outcome law: (parents, tokens, replacement, p rows, q rows or None for
# one-hot q). Chosen so that most nodes can be the last one kept, every outcome has probability >= 0.003, and some
# p are 0; q of a leaf is not read (uniform).
UNIFORM = [0.25] * 4
FIXED_TREES = {
    "rsd_2x2": ([0, 0, 0, 1, 1, 2, 2], [0, 1, 3, 0, 2, 2, 1], False,
                [[0.3, 0.2, 0.05, 0.45], [0.2, 0.35, 0.35, 0.1], [0.4, 0.25, 0.2, 0.15], [0.35, 0.15, 0.45, 0.05],
                 [0.15, 0.2, 0.3, 0.35], [0.3, 0.2, 0.45, 0.05], [0.0, 0.55, 0.35, 0.1]],
                [[0.1, 0.3, 0.25, 0.35], [0.45, 0.2, 0.15, 0.2], [0.1, 0.1, 0.4, 0.4]] + [UNIFORM] * 4),
    "specinfer_3_1_repeated_sibling": ([0, 0, 0, 0, 1, 2], [0, 2, 0, 2, 1, 3], True,
                                       [[0.2, 0.15, 0.3, 0.35], [0.25, 0.05, 0.4, 0.3], [0.4, 0.35, 0.2, 0.05],
                                        [0.3, 0.4, 0.3, 0.0], [0.05, 0.45, 0.1, 0.4], [0.25, 0.35, 0.25, 0.15]],
                                       [[0.15, 0.45, 0.35, 0.05], [0.2, 0.3, 0.25, 0.25], [0.1, 0.25, 0.35, 0.3]]
                                       + [UNIFORM] * 3),
    "rows_2x1": ([0, 0, 0, 1, 2], [0, 3, 0, 1, 2], False,
                 [[0.15, 0.2, 0.3, 0.35], [0.1, 0.35, 0.2, 0.35], [0.2, 0.4, 0.35, 0.05], [0.25, 0.2, 0.2, 0.35],
                  [0.3, 0.0, 0.25, 0.45]], None),
    "chain_3": ([0, 0, 1, 2], [0, 1, 0, 3], False,
                [[0.3, 0.3, 0.1, 0.3], [0.25, 0.2, 0.2, 0.35], [0.45, 0.35, 0.15, 0.05], [0.35, 0.0, 0.3, 0.35]],
                [[0.45, 0.4, 0.05, 0.1], [0.25, 0.4, 0.1, 0.25], [0.1, 0.2, 0.25, 0.45], UNIFORM]),
}


@pytest.mark.parametrize("case", list(FIXED_TREES))
def test_kernel_follows_the_enumerated_law(device, case):
    """The (last accepted node, emitted token) frequencies of the kernel over N_DRAWS seeds are the exact law of
    traversal_outcomes on the kernel's own p (float32 softmax) and q: the kernel runs the rule proven
    lossless above. Chi-square over at most 28 cells, as in test_tree_verify.py."""
    parents, tokens, replacement, p_rows, q_rows = FIXED_TREES[case]
    logits = torch.tensor(p_rows).log()
    q = None if q_rows is None else torch.tensor(q_rows)
    nodes, vocab = logits.shape
    exact = traversal_outcomes(tokens, parents, torch.softmax(logits, -1).double().tolist(),
                               [None] * nodes if q is None else q.double().tolist(), replacement)
    law = torch.zeros(nodes * vocab, dtype=torch.float64)
    for (node, y), prob in exact.items():
        law[node * vocab + y] = prob
    out, out_nodes, accepted = verify(
        device, logits.expand(N_DRAWS, nodes, vocab), torch.tensor(tokens).expand(N_DRAWS, nodes),
        tree(parents).expand(N_DRAWS, nodes),
        None if q is None else q.expand(N_DRAWS, nodes, vocab), replacement=replacement,
        seed=torch.arange(N_DRAWS, dtype=torch.int64), offset=11)
    rows = torch.arange(N_DRAWS)
    last = torch.where(accepted > 0, out_nodes[rows, (accepted - 1).clamp(min=0)], 0)
    cell = last * vocab + out[rows, accepted]
    assert (law[cell] > 0).all(), "an outcome of probability 0 occurred"
    assert chisquare_pvalue(cell, law) > P_VALUE_MIN


# ==== 2. Agreement ====

# C++, Triton and the wrapper against the reference on random ragged trees: test_tree_verify.py's agreement
# tests, which run both schemes.


# ==== 3. Statistics ====
#
# As test_tree_verify.py: N_DRAWS = 200,000 requests per test, chi-square at level 1e-3 over at most 36 cells,
# z tests at |z| < 3.29 (two-sided level 1e-3). Seeds are fixed, so every run computes the same p-values.

@pytest.fixture
def traversal_star(monkeypatch):
    """test_tree_verify's `star`, verified by the traversal scheme."""
    monkeypatch.setattr(specops.ops, "tree_verify", functools.partial(specops.ops.tree_verify, scheme="traversal"))
    return star


@pytest.mark.parametrize("case", list(STAR_CASES))
def test_first_token_follows_target(device, case, traversal_star):
    mode, k, temperature, top_k, top_p = STAR_CASES[case]
    out, nodes, accepted, kids = traversal_star(device, k, mode=mode, temperature=temperature, top_k=top_k,
                                                top_p=top_p, draft_seed=list(STAR_CASES).index(case) + 1)
    p = target_probs(TARGET_LOGITS, temperature, top_k, top_p)
    tokens = out[:, 0]
    assert not torch.isin(tokens, (p == 0).nonzero().flatten()).any(), "a token with p = 0 was emitted"
    assert chisquare_pvalue(tokens, p) > P_VALUE_MIN
    took = accepted == 1
    assert torch.equal(tokens[took], kids[took, nodes[took, 0] - 1]) and (out[took, 1] >= 0).all()


def markov_pair(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An order-1 Markov target (logits, some -inf) and drafter (probabilities with some 0, at least two tokens
    per row): row v is the distribution after token v, row V the first token's."""
    gen = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(vocab + 1, vocab, generator=gen)
    target[torch.rand(vocab + 1, vocab, generator=gen) < 0.15] = float("-inf")
    target[torch.arange(vocab + 1), torch.randint(0, vocab, (vocab + 1,), generator=gen)] = 0.5
    drafter = torch.softmax(target.clamp(min=-2.0) + torch.randn(vocab + 1, vocab, generator=gen), -1)
    drafter[torch.rand(vocab + 1, vocab, generator=gen) < 0.2] = 0.0
    drafter[torch.arange(vocab + 1), torch.arange(vocab + 1) % vocab] += 0.1
    drafter[torch.arange(vocab + 1), (torch.arange(vocab + 1) + 1) % vocab] += 0.1
    return target, drafter / drafter.sum(-1, keepdim=True)


def two_level_trees(target, drafter, mode: str, seed: int):
    """N_DRAWS requests of branching (2, 2) over the Markov pair: (logits [N, 7, V], tokens, parents, q or None).
    Root children from the drafter's first row, each one's children from its own row; mode as MODES."""
    vocab = target.shape[1]
    gen = torch.Generator().manual_seed(seed)

    def children(rows: torch.Tensor) -> torch.Tensor:
        if mode == "rows":
            return rows.argsort(dim=-1, descending=True, stable=True)[:, :2]
        return torch.multinomial(rows, 2, replacement=mode == "specinfer", generator=gen)

    level1 = children(drafter[vocab].expand(N_DRAWS, vocab))
    level2 = torch.cat([children(drafter[level1[:, i]]) for i in range(2)], 1)
    tokens = torch.cat([torch.zeros(N_DRAWS, 1, dtype=torch.int64), level1, level2], 1)
    context = torch.cat([torch.full((N_DRAWS, 1), vocab), tokens[:, 1:]], 1)  # the row each node reads
    probs = None if mode == "rows" else drafter[context]
    return target[context], tokens, tree([0, 0, 0, 1, 1, 2, 2]).expand(N_DRAWS, 7), probs


TWO_LEVEL_CASES = {"rsd": ("rsd", 7), "specinfer": ("specinfer", 7), "rows": ("rows", 7), "rsd_ragged": ("rsd", 6)}


@pytest.mark.parametrize("case", list(TWO_LEVEL_CASES))
def test_two_level_tree_follows_joint_target(device, case):
    # The first two tokens follow p0(x0) p1(x1 | x0); where the walk keeps no draft, x1 comes from a second call,
    # as the next decoding step would. "rsd_ragged" cuts the tree's last node (num_nodes 6).
    mode, count = TWO_LEVEL_CASES[case]
    vocab = 6
    target, drafter = markov_pair(vocab, seed=50)
    logits, tokens, parents, probs = two_level_trees(target, drafter, mode, seed=51 + list(TWO_LEVEL_CASES).index(case))
    seeds = torch.arange(N_DRAWS, dtype=torch.int64)
    out, _, accepted = verify(device, logits, tokens, parents, probs, num_nodes=torch.full((N_DRAWS,), count),
                              replacement=mode == "specinfer", seed=seeds)
    x0, x1 = out[:, 0], out[:, 1].clone()
    stopped = accepted == 0
    lone = torch.zeros(int(stopped.sum()), 1, dtype=torch.int64)
    again, _, _ = verify(device, target[x0[stopped]][:, None], lone, lone, seed=seeds[stopped], offset=1)
    x1[stopped] = again[:, 0]
    joint = torch.softmax(target[vocab].double(), -1)[:, None] * torch.softmax(target[:vocab].double(), -1)
    assert chisquare_pvalue(x0 * vocab + x1, joint.flatten()) > P_VALUE_MIN
    assert int((accepted == 2).sum()) > 1000  # walks do reach the second level


MEAN_VOCAB, MEAN_SEED = 4, 60  # the Markov pair of the mean-accepted tests


@functools.cache
def exact_accepted(mode: str, scheme: str) -> float:
    """The exact expected accepted count of `scheme` over every (2, 2) tree drawn from the mean-accepted tests'
    Markov pair (traversal_outcomes' float64 tables, the drafter's rows renormalized: its float32 sum is 1 only
    to about 1e-7)."""
    target, drafter = markov_pair(MEAN_VOCAB, MEAN_SEED)
    p_rows = torch.softmax(target.double(), -1).tolist()
    q_rows = (drafter.double() / drafter.double().sum(-1, keepdim=True)).tolist()
    paths = [()] + [path for n in (1, 2) for path in itertools.product(range(MEAN_VOCAB), repeat=n)]
    row = {path: path[-1] if path else MEAN_VOCAB for path in paths}
    outcomes = traversal_outcomes if scheme == "traversal" else recursive_outcomes
    error, exact = tree_law({path: p_rows[row[path]] for path in paths}, {path: q_rows[row[path]] for path in paths},
                            MEAN_VOCAB, (2, 2), mode, outcomes)
    assert error < 1e-12
    return exact


def mean_accepted(device: str, mode: str, scheme: str, seed: int) -> tuple[float, float]:
    """(mean, its standard error) of num_accepted over N_DRAWS (2, 2) trees drawn from the Markov pair."""
    target, drafter = markov_pair(MEAN_VOCAB, MEAN_SEED)
    logits, tokens, parents, probs = two_level_trees(target, drafter, mode, seed)
    accepted = specops.ops.tree_verify(logits.to(device), tokens.to(device), parents.to(device), probs.to(device),
                                       replacement=mode == "specinfer", seed=torch.arange(N_DRAWS).to(device),
                                       scheme=scheme)[2].cpu().double()
    return float(accepted.mean()), float(accepted.std()) / math.sqrt(N_DRAWS)


@pytest.mark.parametrize("mode", ["rsd", "specinfer"])
def test_mean_accepted_is_exact_and_beats_recursive(device, mode):
    # (2, 2) trees over V = 4: the mean accepted count of each scheme is its exact expectation over every tree
    # (enumerated, weighted by its draft probability), on the same trees; traversal's is the larger.
    for scheme in ("traversal", "recursive"):
        mean, sd = mean_accepted(device, mode, scheme, seed=61)
        assert abs(mean - exact_accepted(mode, scheme)) < Z_MAX * sd, (scheme, mean, exact_accepted(mode, scheme))
    assert exact_accepted(mode, "traversal") > exact_accepted(mode, "recursive") + 10 * sd


class TestStatisticsCanFail:
    """The checks above reject a traversal verifier told the wrong sampling, and a wrong expectation."""

    def test_rejects_a_verifier_told_the_wrong_sampling(self, device, traversal_star):
        # Drawn without replacement but verified as i.i.d.: q is not renormalized after a rejection.
        out, _, _, _ = traversal_star(device, 3, mode="rsd", draft_seed=71, claim_replacement=True)
        assert chisquare_pvalue(out[:, 0], target_probs(TARGET_LOGITS)) < P_VALUE_MIN

    def test_rejects_the_recursive_schemes_expectation(self, device):
        # Traversal's counts are not recursive rejection sampling's expectation: the z test tells them apart.
        mean, sd = mean_accepted(device, "rsd", "traversal", seed=72)
        assert abs(mean - exact_accepted("rsd", "recursive")) > Z_MAX * sd


# ==== 4. opcheck ====

@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
def test_opcheck(device, with_probs):
    torch.library.opcheck(torch.ops.specops.tree_verify.default, small_case(device, with_probs) + (5, True, "traversal"))


# ==== 5. Bad inputs ====

def test_an_unknown_scheme_raises(device):
    args = small_case(device)
    logits, tokens, parents, probs = args[:4]
    with pytest.raises(ValueError, match="scheme must be one of 'recursive', 'traversal', got 'bogus'"):
        specops.ops.tree_verify(logits, tokens, parents, probs, scheme="bogus")
    with pytest.raises(ValueError, match="tree_verify: scheme must be 'recursive' or 'traversal'"):
        torch.ops.specops.tree_verify(*small_case(), 0, True, "bogus")
