"""Tests of `specops::tree_verify` (recursive rejection sampling over draft trees), in the four layers of
DEVELOPERS.md ("Tests"), plus bad inputs.

1. Exact: greedy trees, point-mass targets (the child holding the target's only token is accepted
   whatever q and the random numbers), ragged trees whose padding must not be read, a chain equal to
   chain_verify draw for draw.
2. Agreement: the C++ CPU kernel, the Triton kernel (interpreted on CPU without a GPU) and the public
   wrapper return exactly the reference's tokens for the same seeds, on random trees, dtypes, sampling
   settings, with and without draft probabilities and replacement.
3. Statistics: the first token after a tree follows p whatever q and the shape (RSD without
   replacement, SpecInfer i.i.d. children, deterministic rows), the first two tokens of a two-level
   tree follow the joint target, acceptance rates equal their exact values and RSD's is at least
   SpecInfer's; and verifiers with the classic mistakes fail the same checks.
4. `torch.library.opcheck` and `torch.compile`.
5. Bad inputs raise ValueError / TypeError naming the problem, on the C++ path and on the accelerator
   path's checks.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from _triton import IMPLS, KERNELS, needs_triton
from tree_cases import (
    DRAFT_PROBS,
    LOGIT_DTYPES,
    N_DRAWS,
    OFFSETS,
    P_VALUE_MIN,
    STAR_CASES,
    TARGET_LOGITS,
    VOCAB,
    Z_MAX,
    assert_same,
    chain_case,
    chisquare_pvalue,
    normalized_args,
    point_mass_logits,
    random_case,
    run_impl,
    small_case,
    star,
    target_probs,
    tree,
)

import specops
from specops import reference

# ---- helpers ----



















# ==== 1. Exact ====

# Root 0 with children 1, 2, 3; node 4 under 2; nodes 5, 6 under 4; node 7 under 1.
HAND_PARENTS = [0, 0, 0, 0, 2, 4, 4, 1]
HAND_TOKENS = [9, 3, 5, 3, 7, 1, 2, 6]


@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_follows_the_argmax_path(impl, dtype):
    gen = torch.Generator().manual_seed(1)
    vocab = 10
    # Argmax at each node: root 5 (-> node 2, not the first child 1), node 2: 7 (-> 4), node 4: 2 (-> 6,
    # the second child), node 6: 8 (a leaf: emitted). Request 1: root argmax 4, which no child holds.
    best = [[5, 0, 7, 0, 2, 0, 8, 0], [4, 0, 0, 0, 0, 0, 0, 0]]
    logits = torch.randn(2, 8, vocab, generator=gen).scatter(-1, torch.tensor(best).unsqueeze(-1), 10.0).to(dtype)
    tokens = torch.tensor([HAND_TOKENS] * 2)
    parents = torch.stack([tree(HAND_PARENTS)] * 2)
    out, nodes, accepted = run_impl(impl, normalized_args(logits, tokens, parents, temperature=0.0))
    assert out.tolist() == [[5, 7, 2, 8, -1, -1, -1, -1], [4, -1, -1, -1, -1, -1, -1, -1]]
    assert nodes.tolist() == [[2, 4, 6, -1, -1, -1, -1, -1], [-1] * 8]
    assert accepted.tolist() == [3, 0]


@pytest.mark.slow
@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
@pytest.mark.parametrize("replacement", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_point_mass_target_takes_its_child(impl, replacement, with_probs):
    # p is a point mass at every node: the child holding that token is accepted whatever q and u are,
    # after its earlier siblings (p = 0 for them) are rejected; where no child holds it, it is emitted.
    gen = torch.Generator().manual_seed(2)
    vocab, batch = 10, 16
    hot = torch.tensor([3, 0, 7, 3, 0, 0, 2, 4])  # root -> child 3 (third child) -> leaf: emits 3
    logits = point_mass_logits(hot.expand(batch, 8), vocab, gen)
    tokens = torch.tensor([[9, 5, 6, 3, 7, 1, 2, 6]] * batch)
    q = torch.softmax(torch.randn(batch, 8, vocab, generator=gen), -1) if with_probs else None
    args = normalized_args(logits, tokens, torch.stack([tree(HAND_PARENTS)] * batch), q, replacement=replacement,
                           temperature=torch.linspace(0.5, 1.5, batch), seed=20)
    out, nodes, accepted = run_impl(impl, args)
    assert (out[:, :2] == torch.tensor([3, 3])).all() and (out[:, 2:] == -1).all()
    assert (nodes[:, 0] == 3).all() and (accepted == 1).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_nodes_are_not_read(impl):
    gen = torch.Generator().manual_seed(3)
    vocab = 6
    hot = torch.tensor([[2, 4, 1, 5], [3, 0, 0, 0]])
    logits = point_mass_logits(hot, vocab, gen)
    logits[1, 1:] = float("nan")  # past request 1's single node
    tokens = torch.tensor([[0, 2, 4, 1], [0, -5, 99, 3]])
    parents = torch.tensor([[0, 0, 1, 2], [0, 7, -1, 9]])
    args = normalized_args(logits, tokens, parents, num_nodes=torch.tensor([4, 1]))
    out, nodes, accepted = run_impl(impl, args)
    assert out.tolist() == [[2, 4, 1, 5], [3, -1, -1, -1]]
    assert nodes.tolist() == [[1, 2, 3, -1], [-1, -1, -1, -1]]
    assert accepted.tolist() == [3, 0]




@pytest.mark.slow
@pytest.mark.parametrize("scheme, with_probs", [("recursive", False), ("recursive", True), ("traversal", True)],
                         ids=["q_one_hot", "q_given", "traversal"])
@pytest.mark.parametrize("impl", IMPLS)
def test_chain_is_chain_verify(impl, scheme, with_probs):
    # A chain is chain_verify draw for draw: token-level for the recursive walk, block verification for
    # traversal verification (with draft probabilities: one-hot block rounds its residual differently).
    gen = torch.Generator().manual_seed(4)
    batch, k, vocab = 12, 4, 40
    logits, q, drafts, tokens, parents = chain_case(gen, batch, k, vocab, with_probs)
    num = torch.randint(0, k + 1, (batch,), generator=gen)
    temperature = torch.tensor([1.0, 0.6, 0.0, 1.4] * 3)
    top_k, top_p = torch.tensor([0, 5, 0, 0] * 3), torch.tensor([1.0, 1.0, 1.0, 0.8] * 3)
    seeds = torch.arange(batch) * 7919
    for offset in (0, 5):
        want_out, want_accepted = torch.ops.specops.chain_verify(
            logits, drafts, None if q is None else q[:, :k].contiguous(), num, temperature, top_k, top_p, seeds,
            offset, True, "token" if scheme == "recursive" else "block")
        args = normalized_args(logits, tokens, parents, q, num_nodes=num + 1, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seeds)
        out, nodes, accepted = run_impl(impl, args, offset, scheme=scheme)
        assert torch.equal(out, want_out) and torch.equal(accepted, want_accepted)
        path = torch.arange(1, k + 2).expand(batch, k + 1)
        assert torch.equal(nodes, torch.where(path <= accepted[:, None], path, -1))


@pytest.mark.parametrize("impl", IMPLS)
def test_tiny_temperature_overflow_is_greedy(impl):
    logits = torch.tensor([[[1.0, 2.0, 3.0, -1.0], [0.0, 0.0, 0.0, 9.0]], [[2e38, 3e38, 1.0, -1.0]] * 2])
    tokens = torch.tensor([[0, 2], [0, 0]])
    parents = torch.zeros(2, 2, dtype=torch.int64)
    out, _, accepted = run_impl(impl, normalized_args(logits, tokens, parents, temperature=torch.tensor([1e-40, 0.5])))
    assert out.tolist() == [[2, 3], [1, -1]] and accepted.tolist() == [1, 0]


# ==== 2. Agreement ====



# Both schemes (the recursive walk and traversal verification, test_traversal_verify.py) agree with the reference.
SCHEMES = pytest.mark.parametrize("scheme", specops.ops.TREE_SCHEMES)


@SCHEMES
@pytest.mark.parametrize("replacement", [False, True])
@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_cpp_matches_reference(dtype, with_probs, replacement, scheme):
    gen = torch.Generator().manual_seed(10 + LOGIT_DTYPES.index(dtype))
    for trial in range(8):
        args = random_case(gen, 6, 9, 64, dtype, with_probs, replacement)
        offset = OFFSETS[trial % 3]
        assert_same(run_impl("cpp", args, offset, scheme=scheme), run_impl("reference", args, offset, scheme=scheme),
                    f"trial {trial}: ")


@pytest.mark.slow
@needs_triton
@SCHEMES
@pytest.mark.parametrize("replacement", [False, True])
@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
def test_triton_matches_reference(with_probs, replacement, scheme):
    gen = torch.Generator().manual_seed(20)
    for trial, (dtype, block_v) in enumerate([(torch.float32, 16), (torch.bfloat16, None), (torch.float16, 32)]):
        args = random_case(gen, 6, 7, 48, dtype, with_probs, replacement)
        assert_same(run_impl("triton", args, OFFSETS[trial], block_v, scheme),
                    run_impl("reference", args, OFFSETS[trial], scheme=scheme), f"{dtype}, block_v {block_v}: ")


@SCHEMES
@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
def test_wrapper_matches_reference(device, with_probs, scheme):
    gen = torch.Generator().manual_seed(30)
    logits, tokens, parents, q, num, replacement, temperature, top_k, top_p, seed = random_case(
        gen, 5, 8, 40, torch.float32, with_probs)
    got = specops.ops.tree_verify(logits.to(device), tokens.to(device), parents.to(device),
                                  None if q is None else q.to(device), num_nodes=num.to(device),
                                  temperature=temperature.to(device), top_k=top_k.to(device), top_p=top_p.to(device),
                                  seed=seed.to(device), offset=3, scheme=scheme)
    want = reference.tree_verify(logits, tokens, parents, q, num, replacement, temperature, top_k, top_p, seed, 3,
                                 scheme=scheme)
    assert_same(tuple(t.cpu() for t in got), want)


@SCHEMES
@pytest.mark.parametrize("impl", KERNELS)
def test_long_rows_across_chunks(impl, scheme):
    # V above the C++ kernel's 2,048-value chunks and several Triton tiles; B = 1 splits rows across threads.
    gen = torch.Generator().manual_seed(40)
    for with_probs in (False, True):
        args = random_case(gen, 1, 6, 5000, torch.float32, with_probs)
        assert_same(run_impl(impl, args, 1, 1024, scheme), run_impl("reference", args, 1, scheme=scheme))











def exact_acceptance(p: torch.Tensor, q: torch.Tensor, k: int, replacement: bool) -> float:
    """P(some child of a k-child star is accepted), by enumerating every ordered draw: float64."""
    p, q = p.double(), q.double()
    total = 0.0
    for draw in itertools.product(range(VOCAB), repeat=k):
        if not replacement and len(set(draw)) < k:
            continue
        prob, residual, left, none = 1.0, p.clone(), q.clone(), 1.0
        for x in draw:
            q_i = left / left.sum()
            prob *= float(q_i[x])
            if prob == 0.0:
                break
            accept = min(1.0, float(residual[x] / q_i[x]))
            none *= 1.0 - accept
            update = torch.clamp(residual - q_i, min=0.0)
            residual = update / update.sum() if update.sum() > 0 else residual
            if not replacement:
                left = left.clone()
                left[x] = 0.0
        total += prob * (1.0 - none)
    return total




@pytest.mark.parametrize("case", list(STAR_CASES))
def test_first_token_follows_target(device, case):
    mode, k, temperature, top_k, top_p = STAR_CASES[case]
    out, nodes, accepted, kids = star(device, k, mode=mode, temperature=temperature, top_k=top_k, top_p=top_p,
                                      draft_seed=list(STAR_CASES).index(case) + 1)
    p = target_probs(TARGET_LOGITS, temperature, top_k, top_p)
    tokens = out[:, 0]
    assert not torch.isin(tokens, (p == 0).nonzero().flatten()).any(), "a token with p = 0 was emitted"
    assert chisquare_pvalue(tokens, p) > P_VALUE_MIN
    # An accepted token is the chosen child's; one more token follows it.
    took = accepted == 1
    assert torch.equal(tokens[took], kids[took, nodes[took, 0] - 1]) and (out[took, 1] >= 0).all()


def test_two_level_tree_follows_joint_target(device):
    # An order-1 Markov target and drafter over V = 6; RSD-C with branching (2, 2): root children a, b
    # drawn without replacement from q0, each with two children drawn without replacement from
    # q(. | parent). The first two tokens must follow p0(x0) p1(x1 | x0); where the walk stops at the
    # root, x1 comes from a second call, as the next decoding step would.
    vocab = 6
    gen = torch.Generator().manual_seed(50)
    first_logits = torch.randn(vocab, generator=gen)
    next_logits = 1.5 * torch.randn(vocab, vocab, generator=gen)
    first_q = torch.softmax(first_logits + torch.randn(vocab, generator=gen), -1)
    next_q = torch.softmax(next_logits + torch.randn(vocab, vocab, generator=gen), -1)
    level1 = torch.multinomial(first_q.expand(N_DRAWS, vocab), 2, generator=gen)
    level2 = torch.stack([torch.multinomial(next_q[level1[:, i]], 2, generator=gen) for i in range(2)], 1)
    tokens = torch.cat([torch.zeros(N_DRAWS, 1, dtype=torch.int64), level1, level2.reshape(N_DRAWS, 4)], 1)
    parents = tree([0, 0, 0, 1, 1, 2, 2]).expand(N_DRAWS, 7)
    rows = torch.cat([first_logits.expand(N_DRAWS, 1, vocab), next_logits[tokens[:, 1:]]], 1)
    probs = torch.cat([first_q.expand(N_DRAWS, 1, vocab), next_q[tokens[:, 1:]]], 1)
    seeds = torch.arange(N_DRAWS, dtype=torch.int64).to(device)
    out, _, accepted = specops.ops.tree_verify(rows.to(device), tokens.to(device), parents.to(device),
                                               probs.to(device), seed=seeds)
    out, accepted = out.cpu(), accepted.cpu()
    x0, x1 = out[:, 0], out[:, 1].clone()
    stopped = accepted == 0
    lone = torch.zeros(int(stopped.sum()), 1, dtype=torch.int64)
    again, _, _ = specops.ops.tree_verify(next_logits[x0[stopped]][:, None].to(device), lone.to(device),
                                          lone.to(device), seed=seeds[stopped.to(device)], offset=1)
    x1[stopped] = again[:, 0].cpu()
    joint = torch.softmax(first_logits.double(), -1)[:, None] * torch.softmax(next_logits.double(), -1)
    assert chisquare_pvalue(x0 * vocab + x1, joint.flatten()) > P_VALUE_MIN
    assert int((accepted == 2).sum()) > 1000  # walks do reach the second level


def acceptance_z(accepted: torch.Tensor, rate: float) -> float:
    observed = float((accepted >= 1).double().mean())
    return (observed - rate) / math.sqrt(rate * (1 - rate) / accepted.numel())


def test_acceptance_rates_are_exact_and_rsd_beats_specinfer(device):
    p = target_probs(TARGET_LOGITS)
    k = 3
    rates = {}
    for mode in ("rsd", "specinfer"):
        rates[mode] = exact_acceptance(p, DRAFT_PROBS, k, replacement=mode == "specinfer")
        _, _, accepted, _ = star(device, k, mode=mode, draft_seed=60)
        assert abs(acceptance_z(accepted, rates[mode])) < Z_MAX, (mode, rates[mode])
    # Drawing without replacement never wastes a sibling on a token already rejected.
    assert rates["rsd"] > rates["specinfer"] + 0.01, rates


class TestStatisticsCanFail:
    """The checks above reject verifiers with the classic mistakes."""

    def test_rejects_siblings_verified_out_of_draw_order(self, device):
        # Drawn without replacement, then sorted by token id before verification (the ordering trap).
        out, _, _, _ = star(device, 3, mode="rsd", draft_seed=70, order=lambda kids: kids.sort(dim=1).values)
        assert chisquare_pvalue(out[:, 0], target_probs(TARGET_LOGITS)) < P_VALUE_MIN

    def test_rejects_a_verifier_told_the_wrong_sampling(self, device):
        # Drawn without replacement but verified as i.i.d.: q is not renormalized after a rejection.
        out, _, _, _ = star(device, 3, mode="rsd", draft_seed=71, claim_replacement=True)
        assert chisquare_pvalue(out[:, 0], target_probs(TARGET_LOGITS)) < P_VALUE_MIN

    def test_rejects_a_wrong_acceptance_rate(self, device):
        # The exact rate of one mode is not the other's: the z test tells them apart.
        p = target_probs(TARGET_LOGITS)
        _, _, accepted, _ = star(device, 3, mode="specinfer", draft_seed=72)
        assert abs(acceptance_z(accepted, exact_acceptance(p, DRAFT_PROBS, 3, replacement=False))) > Z_MAX


@SCHEMES
@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
def test_cpp_top_p_trees_match_reference_at_a_large_vocabulary(with_probs, scheme):
    """Trees at 262,144 ids under top-p: where the cut keeps few tokens the C++ walks keep a node's residual
    on those alone (the recursive walk's walk_kept, traversal's rows of kept values); the same tokens and
    nodes as the reference, children accepted, rejected (the walk moving on to a sibling) and drawn from the
    residual, with one-hot q and with q given, beside rows whose cut the histogram finds (dense passes)."""
    gen = torch.Generator().manual_seed(29)
    vocab, batch, parents = 262_144, 8, [-1, 0, 1, 2, 0, 4, 5]  # two rows of three drafts, as ngram's
    nodes = len(parents)
    # a few likely tokens over a spread of unlikely ones; the last two requests flat (the histogram's cut)
    logits = torch.randn(batch, nodes, vocab, generator=gen)
    likely = torch.randint(0, vocab, (batch, nodes, 6), generator=gen)
    logits.scatter_(-1, likely, 16.0 + 2 * torch.rand(batch, nodes, 6, generator=gen))
    logits.scatter_(-1, likely[..., :1], 19.0)  # the first likely token the likeliest
    logits[-2:] *= 0.1
    tokens = torch.zeros(batch, nodes, dtype=torch.int64)
    for c in range(1, nodes):  # a likely token of the parent's row, often its likeliest; now and then another
        other = torch.randint(1, 6, (batch, 1), generator=gen)
        which = torch.where(torch.rand(batch, 1, generator=gen) < 0.8, 0, other)
        pick = likely[:, parents[c]].gather(-1, which)[:, 0]
        tokens[:, c] = torch.where(torch.rand(batch, generator=gen) < 0.15, c, pick)
    q = torch.softmax(logits + torch.randn(batch, nodes, vocab, generator=gen), -1) if with_probs else None
    args = normalized_args(logits, tokens, tree(parents).expand(batch, nodes).contiguous(), q,
                           num_nodes=torch.tensor([7, 7, 4, 7, 1, 7, 7, 7]), replacement=with_probs,
                           temperature=torch.tensor([1.0, 0.8, 0.8, 1.3, 0.5, 1.0, 0.8, 1.0]),
                           top_k=torch.tensor([0, 0, 1000, 0, 0, 50_000, 0, 0]),
                           top_p=torch.tensor([0.95, 0.9, 0.95, 0.5, 0.999, 0.7, 0.95, 0.9]), seed=11)
    accepted = []
    for offset in range(6):
        got = run_impl("cpp", args, offset, scheme=scheme)
        assert_same(got, run_impl("reference", args, offset, scheme=scheme), f"offset {offset}: ")
        accepted.append(got[2])
    accepted = torch.stack(accepted)
    assert bool((accepted == 0).any()) and bool((accepted >= 2).any())  # walks stop at the root and go deep


# ==== 4. opcheck and torch.compile ====



@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
def test_opcheck(device, with_probs):
    torch.library.opcheck(torch.ops.specops.tree_verify.default, small_case(device, with_probs) + (5,))


def _step(logits, tokens, parents, probs, num_nodes, replacement, temperature, top_k, top_p, seed, offset):
    return specops.ops.tree_verify(logits, tokens, parents, probs, num_nodes=num_nodes, replacement=replacement,
                                   temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset)


def test_torch_compile_matches_eager(device):
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True)
    args = small_case(device)
    assert_same(tuple(t.cpu() for t in compiled(*args, 3)), tuple(t.cpu() for t in _step(*args, 3)))


# ==== 5. Bad inputs ====

def _valid(device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(90)
    batch, nodes, vocab = 2, 4, 7
    parents = torch.tensor([[0, 0, 0, 1], [0, 0, 1, 1]])
    q = torch.softmax(torch.randn(batch, nodes, vocab, generator=gen), -1)
    tokens = torch.tensor([[0, 1, 2, 3], [0, 4, 5, 6]])
    return dict(target_logits=torch.randn(batch, nodes, vocab, generator=gen).to(device), tokens=tokens.to(device),
                parents=parents.to(device), draft_probs=q.to(device))


def _set(d: dict, name: str, index: tuple, value) -> dict:
    d[name] = d[name].clone()
    d[name][index] = value
    return d


# name: (change to valid inputs, exception, a pattern both the C++ and the accelerator messages match)
BAD_VALUES = {
    "parent_after_child": (lambda d: _set(d, "parents", (0, 2), 2), "parents"),
    "negative_parent": (lambda d: _set(d, "parents", (1, 3), -1), "parents"),
    "token_out_of_range": (lambda d: _set(d, "tokens", (1, 2), 7), "outside"),
    "nan_logit": (lambda d: _set(d, "target_logits", (0, 1, 3), float("nan")), "NaN"),
    "probs_not_normalized": (lambda d: _set(d, "draft_probs", (0, 0, 1), 0.9), "sum"),
    "child_with_q_zero": (lambda d: _set(d, "draft_probs", (1, 1, 5), 0.0), "q = 0"),
    "repeated_sibling": (lambda d: _set(d, "tokens", (0, 2), 1), "siblings"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_raise(case):
    change, pattern = BAD_VALUES[case]
    if case == "child_with_q_zero":  # keep the row a distribution
        d = change(_valid())
        d["draft_probs"] = d["draft_probs"] / d["draft_probs"].sum(-1, keepdim=True)
    else:
        d = change(_valid())
    with pytest.raises(ValueError, match=pattern):
        specops.ops.tree_verify(d["target_logits"], d["tokens"], d["parents"], d["draft_probs"])
    # The op's contract, which runs before the Triton kernel, finds the same problem.
    num, rows = torch.full((2,), 4, dtype=torch.int64), torch.ones(2)
    with pytest.raises(ValueError, match=pattern):
        specops.ops.CONTRACTS["tree_verify"](d["target_logits"], d["tokens"], d["parents"], d["draft_probs"], num,
                                             False, rows, torch.zeros(2, dtype=torch.int64), rows,
                                             torch.zeros(2, dtype=torch.int64), 0)


def test_repeated_sibling_is_allowed_with_replacement_or_one_hot_q():
    d = _set(_valid(), "tokens", (0, 2), 1)
    specops.ops.tree_verify(d["target_logits"], d["tokens"], d["parents"], d["draft_probs"], replacement=True)
    specops.ops.tree_verify(d["target_logits"], d["tokens"], d["parents"])


BAD_ARGS = [
    (dict(target_logits=torch.randn(2, 4)), ValueError, r"\[B, N, V\]"),
    (dict(target_logits=torch.randn(2, 4, 7).long()), TypeError, "float32"),
    (dict(tokens=torch.zeros(2, 3, dtype=torch.int64)), ValueError, "tokens"),
    (dict(parents=torch.zeros(2, 4, dtype=torch.int32)), TypeError, "parents"),
    (dict(draft_probs=torch.rand(2, 4, 6)), ValueError, "draft_probs"),
    (dict(draft_probs=torch.rand(2, 4, 7).double()), TypeError, "draft_probs"),
    (dict(num_nodes=torch.tensor([4, 0])), ValueError, "num_nodes"),
    (dict(num_nodes=torch.tensor([4, 5])), ValueError, "num_nodes"),
    (dict(num_nodes=[4, 4]), TypeError, "num_nodes"),
    (dict(replacement=1), TypeError, "replacement"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(offset=-1), ValueError, "offset"),
]


@pytest.mark.parametrize("change,error,pattern", BAD_ARGS)
def test_bad_arguments(change, error, pattern):
    d = _valid()
    kwargs = {k: change.pop(k) for k in list(change) if k not in d}
    d.update(change)
    with pytest.raises(error, match=pattern):
        specops.ops.tree_verify(d["target_logits"], d["tokens"], d["parents"], d["draft_probs"], **kwargs)
