"""Tests of `specops::tree_verify(..., scheme="traversal")`: traversal verification of a draft tree (Weng et al.,
NeurIPS 2025, arXiv 2505.12398; the rule and its random numbers: `specops.reference._traversal_verify_request`),
in the layers of test_tree_verify.py, plus bad inputs.

1. Exact: greedy and point-mass requests are the recursive scheme's; a chain is `chain_verify(...,
   scheme="block")` draw for draw; the law of what the rule emits, enumerated exactly (float64, no kernel) over
   every tree of small shapes drawn i.i.d., without replacement or deterministically from Markov tables, is
   the target's, and it keeps at least as many drafts as recursive rejection sampling in expectation (more on
   sampled trees); the same enumeration of a per-token residual variant is off, so the check can fail; the
   most any lossless verifier keeps (a linear program) is block verification's on chains and never below
   traversal's on trees; and the kernels' outcome frequencies on fixed trees are the enumerated law (this
   ties the kernels to the rule proven lossless).
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
import importlib.util
import itertools
import math

import pytest
import torch
from _triton import needs_triton, triton_launcher
from tree_laws import correlated_pair, optimal_accepted, recursive_outcomes, table_pair, traversal_outcomes, tree_law
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


def test_the_optimum_over_every_verifier_is_block_on_chains_and_bounds_traversal():
    """optimal_accepted (the most any lossless verifier keeps, a linear program over every verifier) equals
    block verification's on chains, which Sun et al. prove optimal there: the program is right. On trees it is
    never below traversal's, and above it on some (the gap docs/verification.md reports). It is not a bound
    that holds whatever the rule: the per-token residual walk, which is not lossless, keeps more than it on
    some trees."""
    wrong = functools.partial(traversal_outcomes, residual="token")
    gaps, beaten = [], []
    for vocab, seed, shape in itertools.product((2, 3), (0, 1), [(1,), (1, 1), (1, 1, 1), (2,), (2, 1), (2, 2)]):
        target, drafter = correlated_pair(vocab, len(shape), 50 + 10 * vocab + seed)
        for mode in ("rsd", "specinfer"):
            best = optimal_accepted(target, drafter, vocab, shape, mode)
            kept = tree_law(target, drafter, vocab, shape, mode, traversal_outcomes)[1]
            if set(shape) == {1}:
                assert abs(best - kept) < 1e-7, (vocab, seed, shape, mode, best, kept)
            else:
                assert kept <= best + 1e-7, (vocab, seed, shape, mode, best, kept)
                gaps.append(best - kept)
            beaten.append(tree_law(target, drafter, vocab, shape, mode, wrong)[1] - best)
    assert max(gaps) > 0.01, gaps
    assert max(beaten) > 1e-3, beaten


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
    with pytest.raises(ValueError, match="scheme must be 'recursive' or 'traversal', got 'bogus'"):
        specops.ops.tree_verify(logits, tokens, parents, probs, scheme="bogus")
    with pytest.raises(ValueError, match="tree_verify: scheme must be 'recursive' or 'traversal'"):
        torch.ops.specops.tree_verify(*small_case(), 0, True, "bogus")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="specops.kernels needs triton")
@pytest.mark.parametrize("with_probs", [False, True])
def test_the_cuda_kernel_runs_traversal_on_the_cpp_kernel_until_the_triton_one_is_verified(monkeypatch,
                                                                                           with_probs):
    # specops.kernels.tree_verify.TRAVERSAL_KERNEL_VERIFIED: the Triton traversal walk differed from the
    # reference on an H200. What the CUDA kernel runs, on CPU tensors here: the C++ kernel's result, the
    # Triton walk never launched; the recursive scheme still launches it.
    from specops.kernels import tree_verify as kernel

    launched = []
    monkeypatch.setattr(kernel, "tree_verify_triton", lambda *a, **k: launched.append(a[-1]) or "triton")
    args = random_case(torch.Generator().manual_seed(31), 5, 6, 20, torch.float32, with_probs)
    got = kernel.tree_verify_cuda(*args, 7, True, "traversal")
    assert_same(got, run_impl("cpp", args, 7, scheme="traversal"))
    assert launched == []
    assert kernel.tree_verify_cuda(*args, 7, True, "recursive") == "triton" and launched == ["recursive"]
    monkeypatch.setattr(kernel, "TRAVERSAL_KERNEL_VERIFIED", True)
    assert kernel.tree_verify_cuda(*args, 7, True, "traversal") == "triton" and launched[-1] == "traversal"
