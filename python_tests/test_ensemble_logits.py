"""Tests of `specops.ops.ensemble_logits`: the logits of a weighted or contrastive ensemble of next-token
distributions (semantics: `specops.reference.ensemble_logits`).

Implementations: "reference" (specops.reference.ensemble_logits, the spec: float64, then cast), "cpp"
(torch.ops.specops.ensemble_logits on CPU tensors: a scan for each (row, member)'s maximum and softmax
normalizer, then a combine pass in 16-lane vectors over vocabulary chunks of 16,384 with a scalar tail)
and "triton" (ensemble_logits_triton on the Triton device, with small tiles where a test says so, so
that the masked tail of the last tile runs), all called with the op's arguments (mode 0 or 1, float32
weights).

1. Exact: hand-computed cases (uniform and one-hot rows, mixtures, -inf tokens of one member, weight-0
   members, contrastive scores with and without the alpha cut, the fallback row where no token
   survives), empty batches, V = 1.
2. Agreement with the reference on random rows: V around the 16-lane vectors, the 16,384 chunks and
   the tiles, leading dims, M = 1..5, scales from 0.1 to 30, -inf blocks, 16-bit inputs, non-contiguous
   members. Tolerance, per finite output: 2e-6 + 4 * 2^-24 * (|want| + max_i |max_x l_i[x]|), and the
   same -inf pattern. The kernels subtract each member's row maximum before adding log w - log z, so
   rows far from zero keep the output's precision (test_weighted_is_shift_invariant_to_output_precision:
   rows offset by 1e4); members N(0, 1) without offsets are within 2e-6 absolute.
3. Properties: softmax of the weighted ensemble is the mixture sum_i w_i softmax(l_i) (1e-6); softmax of
   the contrastive one is p_e / p_a^mu renormalized on the plausible set; sampling through chain_verify
   at temperature 0 picks the mixture's argmax.
4. Batch and thread invariance of the C++ kernel: a row's bits do not depend on the rows beside it, its
   leading dims or the number of threads.
5. Bad input raises naming the problem (wrapper, and the C++ kernel called directly); the fake agrees
   with the kernel (opcheck, FakeTensorMode, meta, torch.compile).
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
import torch
from _triton import IMPLS, KERNELS, TRITON_DEVICE, needs_triton, triton_launcher
from torch._subclasses.fake_tensor import FakeTensorMode

import specops
from specops import reference

ensemble_logits_triton = triton_launcher("ensemble_logits")
# The interpreter evaluates log(0) for weight-0 members (a where() discards it): numpy warns.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")

NEG_INF = float("-inf")
MODES = {"weighted": 0, "contrastive": 1}
EPS32 = 2.0**-24
# Small Triton tiles for small vocabularies, so that a hand case spans several tiles and the last one is
# masked; the interpreter takes ~5 ms a tile, so big vocabularies use the default 1024.
SMALL_BLOCK_V = 16


# ---- helpers ----

def weights_tensor(weights, count: int) -> torch.Tensor:
    if weights is None:
        return torch.empty(0, dtype=torch.float32)
    return torch.as_tensor(weights, dtype=torch.float64).float().reshape(count)


def run_impl(impl: str, members, weights=None, mode: str = "weighted", mu: float = 0.0, alpha: float = 0.0,
             block_v: int = SMALL_BLOCK_V) -> torch.Tensor:
    """One implementation on the op's arguments; weights None for contrastive."""
    members = list(members)
    w = weights_tensor(weights, len(members)) if mode == "weighted" else weights_tensor(None, len(members))
    if impl == "reference":
        return reference.ensemble_logits(members, w, MODES[mode], mu, alpha)
    if impl == "cpp":
        return torch.ops.specops.ensemble_logits(members, w, MODES[mode], float(mu), float(alpha), True)
    out = ensemble_logits_triton([m.to(TRITON_DEVICE) for m in members], w.to(TRITON_DEVICE), MODES[mode],
                                 float(mu), float(alpha), block_v=block_v)
    return out.cpu()


def assert_same_logits(got: torch.Tensor, want: torch.Tensor, members=(), atol: float = 2e-6,
                       rel: float = 4 * EPS32):
    """Same shape, float32, the same -inf entries, no NaN / +inf, and every finite entry within
    atol + rel (|want| + the largest |row maximum| of the members) (module docstring)."""
    assert got.shape == want.shape and got.dtype == torch.float32
    assert not torch.isnan(got).any() and not torch.isposinf(got).any()
    got_inf, want_inf = torch.isneginf(got), torch.isneginf(want)
    assert torch.equal(got_inf, want_inf), f"-inf differs at {(got_inf != want_inf).nonzero()[:10].tolist()}"
    scale = want.double().abs()
    if members:
        row_max = torch.stack([m.double().amax(-1, keepdim=True).abs() for m in members]).amax(0)
        scale = scale + row_max
    finite = ~want_inf
    error = (got.double() - want.double()).abs()[finite]
    bound = (atol + rel * scale)[finite]
    if error.numel():
        worst = (error - bound).argmax()
        assert (error <= bound).all(), f"error {error[worst]:.3g} > bound {bound[worst]:.3g}"


def assert_matches_reference(got, members, weights=None, mode="weighted", mu=0.0, alpha=0.0):
    assert_same_logits(got, run_impl("reference", members, weights, mode, mu, alpha), members)


def logs(*probs) -> torch.Tensor:
    """float32 logits whose softmax is `probs` (0 -> -inf)."""
    return torch.tensor(probs, dtype=torch.float64).log().float()


def random_weights(count: int, gen: torch.Generator) -> list[float]:
    w = torch.rand(count, generator=gen, dtype=torch.float64) + 0.05
    return (w / w.sum()).tolist()


def random_members(shape, count: int, seed: int, scale: float = 1.0, inf_blocks: bool = True,
                   offsets: bool = True) -> list[torch.Tensor]:
    """`count` members of `shape` (..., V): N(0, scale^2) with a random offset per member and, with
    inf_blocks, rows with -inf blocks and scattered -inf tokens (each member row keeps a finite logit;
    some tokens are -inf in every member)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = shape[-1]
    members = []
    shared = torch.rand(shape, generator=gen) < 0.05  # -inf in every member
    for i in range(count):
        m = torch.randn(shape, generator=gen) * scale
        if offsets:
            m += (torch.rand((), generator=gen) - 0.5) * 20
        if inf_blocks and vocab > 1:
            flat = m.view(-1, vocab)
            for r in range(flat.shape[0]):
                if (r + i) % 3 == 0:  # a -inf block
                    start = int(torch.randint(vocab, (), generator=gen))
                    length = int(torch.randint(1, max(2, vocab // 2), (), generator=gen))
                    flat[r, start:start + length] = NEG_INF
                elif (r + i) % 3 == 1:  # scattered -inf tokens
                    flat[r][torch.rand(vocab, generator=gen) < 0.3] = NEG_INF
            m[shared] = NEG_INF
            flat = m.view(-1, vocab)
            for r in range(flat.shape[0]):  # keep one finite logit per member row
                if not torch.isfinite(flat[r]).any():
                    flat[r, int(torch.randint(vocab, (), generator=gen))] = 0.0
        members.append(m)
    return members


# ---- 1. exact ----

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vocab", [1, 5, 16, 37])
def test_uniform_members_give_uniform_logits(impl, vocab):
    """Every member uniform (any constant row): every mixture is uniform, -log V; contrastive gives 0."""
    members = [torch.full((2, vocab), c) for c in (0.0, 3.5, -7.25)]
    for weights in ([1 / 3, 1 / 3, 1 / 3], [0.2, 0.0, 0.8], [0.0, 1.0, 0.0]):
        out = run_impl(impl, members, weights)
        assert_same_logits(out, torch.full((2, vocab), -math.log(vocab)), atol=1e-6)
    out = run_impl(impl, members[:2], mode="contrastive", mu=0.7, alpha=0.5)
    assert torch.equal(out, torch.zeros(2, vocab))


@pytest.mark.parametrize("impl", IMPLS)
def test_one_hot_members(impl):
    """Disjoint one-hot rows (every other token -inf): the mixture puts w_i on member i's token; tokens no
    member can produce stay -inf."""
    a = torch.tensor([0.0, NEG_INF, NEG_INF, NEG_INF, NEG_INF])
    b = torch.tensor([NEG_INF, 12.0, NEG_INF, NEG_INF, NEG_INF])
    c = torch.tensor([NEG_INF, NEG_INF, NEG_INF, -4.0, NEG_INF])
    out = run_impl(impl, [a, b, c], [0.25, 0.5, 0.25])
    assert_same_logits(out, logs(0.25, 0.5, 0, 0.25, 0), atol=1e-6)
    # Two members one-hot on the same token: probability 1, logit 0 (to the rounding of log 2 + log 0.5).
    out = run_impl(impl, [b, b + 3], [0.5, 0.5])
    assert_same_logits(out, logs(0, 1, 0, 0, 0), atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_weighted_mixture_by_hand(impl):
    """softmax(a) = [.5, .25, .25, 0, 0], softmax(b) = [.1, .2, .3, .4, 0] (shifted by 3, which softmax
    ignores), weights .4 / .6: [.26, .22, .28, .24, 0]."""
    a = logs(0.5, 0.25, 0.25, 0, 0)
    b = logs(0.1, 0.2, 0.3, 0.4, 0) + 3
    out = run_impl(impl, [a, b], [0.4, 0.6])
    assert_same_logits(out, logs(0.26, 0.22, 0.28, 0.24, 0), atol=1e-6)
    # Three members, leading dims [2, 1, 5]: the second row swaps a and b.
    c = torch.zeros(5)  # uniform
    members = [torch.stack([a, b]).view(2, 1, 5), torch.stack([b, a]).view(2, 1, 5), torch.stack([c, c]).view(2, 1, 5)]
    out = run_impl(impl, members, [0.5, 0.3, 0.2])
    want = torch.stack([logs(0.5 * 0.5 + 0.3 * 0.1 + 0.04, 0.5 * 0.25 + 0.3 * 0.2 + 0.04,
                             0.5 * 0.25 + 0.3 * 0.3 + 0.04, 0.3 * 0.4 + 0.04, 0.04),
                        logs(0.5 * 0.1 + 0.3 * 0.5 + 0.04, 0.5 * 0.2 + 0.3 * 0.25 + 0.04,
                             0.5 * 0.3 + 0.3 * 0.25 + 0.04, 0.5 * 0.4 + 0.04, 0.04)]).view(2, 1, 5)
    assert_same_logits(out, want, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_minus_inf_token_gets_only_the_others_mass(impl):
    """a cannot produce token 2 (-inf): a = [.5, .5, 0], b uniform over 3; w = .5 / .5 gives
    [5/12, 5/12, 1/6]: token 2 has only b's mass."""
    a = torch.tensor([[0.0, 0.0, NEG_INF], [NEG_INF, 1.0, 1.0]])
    b = torch.tensor([[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]])
    out = run_impl(impl, [a, b], [0.5, 0.5])
    want = torch.stack([logs(5 / 12, 5 / 12, 1 / 6), logs(1 / 6, 5 / 12, 5 / 12)])
    assert_same_logits(out, want, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_weight_zero_members_are_ignored(impl):
    """A weight-0 member gives no mass: w = (1, 0) is log_softmax(a) exactly where a is finite and -inf
    where a is, whatever b holds there; w = (0, 1) likewise for b. Weights may be ints."""
    a = torch.tensor([[1.0, NEG_INF, 2.0, 0.5, NEG_INF], [0.0, 0.0, 0.0, 0.0, 0.0]])
    b = torch.tensor([[NEG_INF, 3.0, 1.0, NEG_INF, NEG_INF], [5.0, NEG_INF, -1.0, 2.0, 0.0]])
    for weights, member in (([1, 0], a), ([0.0, 1.0], b)):
        out = run_impl(impl, [a, b], weights)
        assert_same_logits(out, torch.log_softmax(member.double(), -1).float(), atol=1e-6)
    # With three members, a zero weight in the middle.
    c = torch.zeros(2, 5)
    out = run_impl(impl, [a, b, c], [0.5, 0.0, 0.5])
    want = torch.logaddexp(math.log(0.5) + torch.log_softmax(a.double(), -1),
                           math.log(0.5) + torch.log_softmax(c.double(), -1)).float()
    assert_same_logits(out, want, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_single_member_is_its_log_softmax(impl):
    x = torch.tensor([[3.0, -1.0, NEG_INF, 0.25, 7.0, 2.0, -30.0]] * 2) + torch.tensor([[0.0], [100.0]])
    out = run_impl(impl, [x], [1.0])
    assert_same_logits(out, torch.log_softmax(x.double(), -1).float(), [x], atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_contrastive_by_hand(impl):
    """Expert e - max e = [0, -1, -2, -5, -0.5], amateur a - max a = [-3, 0, -1, -2, -4]: mu = 0.5 gives
    [1.5, -1, -1.5, -4, 1.5] (exact in float32); alpha = exp(-1.5) keeps e - max e >= -1.5: tokens 0, 1
    and 4. Row maxima are subtracted whatever the offsets (7 and -20)."""
    e = torch.tensor([0.0, -1.0, -2.0, -5.0, -0.5]) + 7
    a = torch.tensor([-3.0, 0.0, -1.0, -2.0, -4.0]) - 20
    out = run_impl(impl, [e, a], mode="contrastive", mu=0.5)
    assert torch.equal(out, torch.tensor([1.5, -1.0, -1.5, -4.0, 1.5]))
    out = run_impl(impl, [e, a], mode="contrastive", mu=0.5, alpha=math.exp(-1.5))
    assert torch.equal(out, torch.tensor([1.5, -1.0, NEG_INF, NEG_INF, 1.5]))
    # mu = 0: the expert's shifted logits; alpha = 0.999: only the expert's argmax.
    out = run_impl(impl, [e, a], mode="contrastive", mu=0.0)
    assert torch.equal(out, torch.tensor([0.0, -1.0, -2.0, -5.0, -0.5]))
    out = run_impl(impl, [e, a], mode="contrastive", mu=2.0, alpha=0.999)
    assert torch.equal(out, torch.tensor([6.0, NEG_INF, NEG_INF, NEG_INF, NEG_INF]))


@pytest.mark.parametrize("impl", IMPLS)
def test_contrastive_minus_inf_tokens_are_excluded(impl):
    """A token either member cannot produce is -inf, even where the other is finite; the row maxima are
    over the finite tokens."""
    e = torch.tensor([[0.0, 1.0, NEG_INF, 2.0, -1.0], [4.0, 4.0, 4.0, 4.0, 4.0]])
    a = torch.tensor([[1.0, NEG_INF, 0.0, 1.0, 0.0], [NEG_INF, 0.0, 2.0, NEG_INF, NEG_INF]])
    out = run_impl(impl, [e, a], mode="contrastive", mu=1.0)
    want = torch.tensor([[-2.0 - 0.0, NEG_INF, NEG_INF, 0.0 - 0.0, -3.0 + 1.0], [NEG_INF, 2.0, 0.0, NEG_INF, NEG_INF]])
    assert torch.equal(out, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_contrastive_fallback_row(impl):
    """Row 0: the expert's plausible tokens (alpha = 0.1: e - max e >= -2.303, tokens 0 and 1) are all -inf
    for the amateur, so nothing survives: the row is the expert's cut logits [0, -0.5, -inf, ...], not the
    scores of tokens 2, 3 (known to both, below the cut). Row 1 has a survivor and is scored normally."""
    e = torch.tensor([[5.0, 4.5, 2.0, 1.0, NEG_INF, 0.0], [5.0, 4.5, 2.0, 1.0, NEG_INF, 0.0]])
    a = torch.tensor([[NEG_INF, NEG_INF, 0.0, 0.0, 0.0, NEG_INF], [NEG_INF, 1.0, 0.0, 0.0, 0.0, NEG_INF]])
    out = run_impl(impl, [e, a], mode="contrastive", mu=0.5, alpha=0.1)
    want = torch.tensor([[0.0, -0.5, NEG_INF, NEG_INF, NEG_INF, NEG_INF],
                         [NEG_INF, -0.5, NEG_INF, NEG_INF, NEG_INF, NEG_INF]])
    assert torch.equal(out, want)
    # Without a cut the same row 0 still has survivors (tokens 2, 3): no fallback.
    out = run_impl(impl, [e[:1], a[:1]], mode="contrastive", mu=0.5)
    assert torch.equal(out, torch.tensor([[NEG_INF, NEG_INF, -3.0, -4.0, NEG_INF, NEG_INF]]))
    # Disjoint supports, no cut: the fallback is the expert's shifted logits.
    out = run_impl(impl, [e[:1], a[:1].roll(2, -1).masked_fill(e[:1] > NEG_INF, NEG_INF)], mode="contrastive",
                   mu=3.0)
    assert torch.equal(out, e[:1] - 5.0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vocab", [40, 16385, 40000])
def test_contrastive_fallback_spans_chunks_and_tiles(impl, vocab):
    """The fallback decision is over the whole row: survivors only in the last chunk / tile keep the row
    normal; none anywhere falls back in every chunk."""
    if impl == "triton" and vocab > 40:
        block = 4096
    else:
        block = SMALL_BLOCK_V
    gen = torch.Generator().manual_seed(vocab)
    e = torch.randn(3, vocab, generator=gen)
    a = torch.randn(3, vocab, generator=gen)
    a[0] = NEG_INF  # row 0: nothing survives (but the amateur keeps one finite logit, outside e's support)
    e[0, -1] = NEG_INF
    a[0, -1] = 0.0
    a[1, :-1] = NEG_INF  # row 1: a single survivor, the last token
    e[1, -1] = e[1].max() + 1
    out = run_impl(impl, [e, a], mode="contrastive", mu=0.5, alpha=0.0, block_v=block)
    assert_matches_reference(out, [e, a], mode="contrastive", mu=0.5)
    assert torch.equal(out[0], torch.where(e[0] > NEG_INF, e[0] - e[0].max(), NEG_INF))
    assert torch.isfinite(out[1]).sum() == 1 and out[1, -1] == 0.0


@pytest.mark.parametrize("impl", IMPLS)
def test_vocab_of_one(impl):
    members = [torch.tensor([[3.0], [-2.0]]), torch.tensor([[0.0], [50.0]])]
    assert_same_logits(run_impl(impl, members, [0.3, 0.7]), torch.zeros(2, 1), atol=1e-6)
    assert torch.equal(run_impl(impl, members, mode="contrastive", mu=1.0, alpha=0.5), torch.zeros(2, 1))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["weighted", "contrastive"])
def test_no_rows_is_empty(impl, mode):
    members = [torch.zeros(0, 7), torch.zeros(0, 7)]
    out = run_impl(impl, members, [0.5, 0.5], mode)
    assert out.shape == (0, 7) and out.dtype == torch.float32


def test_wrapper_empty_and_leading_shapes():
    members = [torch.zeros(2, 0, 7), torch.zeros(2, 0, 7, dtype=torch.bfloat16)]
    assert specops.ops.ensemble_logits(members, [0.5, 0.5]).shape == (2, 0, 7)
    x = torch.randn(7)
    out = specops.ops.ensemble_logits([x, x.flip(0)], torch.tensor([0.25, 0.75]))
    assert out.shape == (7,) and out.dtype == torch.float32
    assert torch.equal(out, specops.ops.ensemble_logits([x[None], x.flip(0)[None]], (0.25, 0.75))[0])


# ---- 2. agreement on random inputs ----

CPP_VOCABS = [1, 15, 16, 17, 1000, 16383, 16384, 16385, 40000]
SHAPES = [(3,), (2, 3), (2, 1, 2)]  # leading dims


@pytest.mark.parametrize("vocab", CPP_VOCABS)
def test_cpp_weighted_matches_reference(vocab):
    for i, lead in enumerate(SHAPES):
        for count in (1, 2, 3, 5):
            scale = (0.1, 1.0, 30.0)[(i + count) % 3]
            seed = 1000 * vocab + 100 * i + 10 * count
            members = random_members((*lead, vocab), count, seed, scale, inf_blocks=vocab > 1)
            weights = random_weights(count, torch.Generator().manual_seed(seed))
            got = run_impl("cpp", members, weights)
            assert got.shape == (*lead, vocab)
            assert_matches_reference(got, members, weights)


@pytest.mark.parametrize("vocab", CPP_VOCABS)
def test_cpp_contrastive_matches_reference(vocab):
    settings = [(0.0, 0.0), (0.1, 0.0), (0.5, 0.1), (1.0, 0.01), (2.5, 0.5)]
    for i, lead in enumerate(SHAPES):
        for j, (mu, alpha) in enumerate(settings if vocab <= 1000 else settings[i::2]):
            scale = (0.1, 1.0, 5.0, 30.0)[(i + j) % 4]
            members = random_members((*lead, vocab), 2, 7 * vocab + 10 * i + j, scale, inf_blocks=vocab > 1)
            got = run_impl("cpp", members, mode="contrastive", mu=mu, alpha=alpha)
            assert got.shape == (*lead, vocab)
            assert_matches_reference(got, members, mode="contrastive", mu=mu, alpha=alpha)


# Triton in the interpreter (~5 ms a tile and member): small tiles on small vocabularies, the default tile
# on the big ones; each member count / setting paired with one leading shape, few rows.
TRITON_CASES = [(1, 16), (15, 16), (16, 16), (17, 16), (100, 64), (1000, 64), (16383, 1024), (16385, 1024),
                (40000, 1024)]
TRITON_SHAPES = [(2,), (1, 2), (2, 1, 2)]


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("vocab,block_v", TRITON_CASES)
def test_triton_weighted_matches_reference(vocab, block_v):
    counts = (1, 2, 3, 5) if vocab <= 100 else (2, 3) if vocab < 40000 else (2,)
    for i, count in enumerate(counts):
        lead = TRITON_SHAPES[i % 3] if vocab <= 1000 else (2,)
        seed = 1000 * vocab + count
        members = random_members((*lead, vocab), count, seed, (0.1, 1.0, 30.0)[i % 3], inf_blocks=vocab > 1)
        weights = random_weights(count, torch.Generator().manual_seed(seed))
        assert_matches_reference(run_impl("triton", members, weights, block_v=block_v), members, weights)


@needs_triton
@pytest.mark.parametrize("vocab,block_v", TRITON_CASES)
def test_triton_contrastive_matches_reference(vocab, block_v):
    settings = [(0.0, 0.0), (0.1, 0.0), (0.5, 0.1), (2.5, 0.5)]
    settings = settings if vocab <= 100 else settings[1:3] if vocab < 40000 else settings[2:3]
    for j, (mu, alpha) in enumerate(settings):
        lead = TRITON_SHAPES[j % 3] if vocab <= 1000 else (2,)
        members = random_members((*lead, vocab), 2, 7 * vocab + j, (0.1, 1.0, 5.0, 30.0)[j], inf_blocks=vocab > 1)
        got = run_impl("triton", members, mode="contrastive", mu=mu, alpha=alpha, block_v=block_v)
        assert_matches_reference(got, members, mode="contrastive", mu=mu, alpha=alpha)


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("vocab", [17, 1000, 20000])
def test_unit_scale_members_within_2e_6_absolute(impl, vocab):
    """Members N(0, 1) without offsets (outputs down to about -log V - 5): 2e-6 absolute, no scale term."""
    if impl == "triton" and vocab > 1000:
        vocab = 4000
    for mode, count in (("weighted", 2), ("weighted", 5), ("contrastive", 2)):
        members = random_members((3, vocab), count, seed=vocab + count, offsets=False)
        weights = random_weights(count, torch.Generator().manual_seed(count)) if mode == "weighted" else None
        got = run_impl(impl, members, weights, mode, mu=0.5, alpha=0.01, block_v=64 if vocab <= 1000 else 1024)
        want = run_impl("reference", members, weights, mode, mu=0.5, alpha=0.01)
        assert_same_logits(got, want, atol=2e-6, rel=0.0)


@needs_triton
def test_triton_default_tile():
    members = random_members((3, 2500), 3, seed=5)
    out = ensemble_logits_triton([m.to(TRITON_DEVICE) for m in members],
                                 torch.tensor([0.2, 0.3, 0.5], device=TRITON_DEVICE), 0, 0.0, 0.0).cpu()
    assert_matches_reference(out, members, [0.2, 0.3, 0.5])


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["weighted", "contrastive"])
def test_16_bit_members(impl, dtype, mode):
    """bfloat16 / float16 members are read as float32: the reference on the same 16-bit values. Mixed
    dtypes too (one float32 member)."""
    vocab = 1000 if impl == "cpp" else 100
    members = [m.to(dtype) for m in random_members((4, vocab), 2, seed=3, scale=3.0)]
    mixed = [members[0], members[1].float()]
    for ms in (members, mixed):
        if mode == "weighted":
            got = run_impl(impl, ms, [0.3, 0.7], block_v=64)
            assert_matches_reference(got, ms, [0.3, 0.7])
        else:
            got = run_impl(impl, ms, mode="contrastive", mu=0.5, alpha=0.05, block_v=64)
            assert_matches_reference(got, ms, mode="contrastive", mu=0.5, alpha=0.05)


@pytest.mark.parametrize("impl", KERNELS)
def test_non_contiguous_members(impl):
    """A transposed member and a strided slice give the bits of their contiguous copies."""
    gen = torch.Generator().manual_seed(9)
    vocab = 41
    a = torch.randn(vocab, 6, generator=gen).T
    b = torch.randn(6, 2 * vocab, generator=gen)[:, ::2]
    assert not a.is_contiguous() and not b.is_contiguous()
    for mode in MODES:
        got = run_impl(impl, [a, b], [0.6, 0.4], mode, mu=0.5, alpha=0.1)
        assert torch.equal(got, run_impl(impl, [a.contiguous(), b.contiguous()], [0.6, 0.4], mode, mu=0.5,
                                         alpha=0.1))
        assert_matches_reference(got, [a, b], [0.6, 0.4], mode, mu=0.5, alpha=0.1)


def test_wrapper_matches_reference(device):
    members = [m.to(device) for m in random_members((2, 3, 300), 3, seed=4)]
    cpu = [m.cpu() for m in members]
    out = specops.ops.ensemble_logits(members, [0.5, 0.25, 0.25])
    assert out.shape == (2, 3, 300) and out.device == members[0].device
    assert_matches_reference(out.cpu(), cpu, [0.5, 0.25, 0.25])
    out = specops.ops.ensemble_logits(members[:2], mode="contrastive", mu=0.3, alpha=0.2)
    assert_matches_reference(out.cpu(), cpu[:2], mode="contrastive", mu=0.3, alpha=0.2)
    # Weights as a tensor (any dtype, any device) and as a tuple give the same bits.
    w = specops.ops.ensemble_logits(members, torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64))
    assert torch.equal(w, specops.ops.ensemble_logits(members, (0.5, 0.25, 0.25)))


@pytest.mark.parametrize("impl", KERNELS)
def test_weighted_is_shift_invariant_to_output_precision(impl):
    """softmax ignores a constant added to a member's row: members with 6 fraction bits offset by 1e4 are
    exact in float32, and the reference gives the unshifted bits; the kernels take each row's maximum off
    before adding log w - log z, so they stay within the output's own precision (2e-6 + 4 eps |out|)."""
    gen = torch.Generator().manual_seed(0)
    a, b = ((torch.randn(2, 1000, generator=gen) * 64).round() / 64 for _ in range(2))
    shifted = [a + 1e4, b + 1e4]
    assert torch.equal(shifted[0] - 1e4, a) and torch.equal(shifted[1] - 1e4, b)  # exact
    want = run_impl("reference", [a, b], [0.5, 0.5])
    assert torch.equal(run_impl("reference", shifted, [0.5, 0.5]), want)
    assert torch.equal(run_impl(impl, shifted, mode="contrastive", mu=0.5, block_v=64),
                       run_impl("reference", [a, b], mode="contrastive", mu=0.5))
    got = run_impl(impl, shifted, [0.5, 0.5], block_v=64)
    assert_same_logits(got, want)  # without the members: the bound at the output's own scale


# ---- 3. properties ----

@pytest.mark.parametrize("impl", IMPLS)
def test_softmax_of_weighted_is_the_mixture(impl):
    """Sampling from softmax(ensemble) is sampling the mixture: sum_i w_i softmax(l_i), to 1e-6."""
    vocab = 20000 if impl == "cpp" else 300
    for count, seed in ((2, 0), (3, 1), (5, 2)):
        members = random_members((3, vocab), count, seed, scale=4.0)
        weights = random_weights(count, torch.Generator().manual_seed(seed))
        out = run_impl(impl, members, weights, block_v=64)
        mixture = sum(w * torch.softmax(m.double(), -1) for w, m in zip(weights, members))
        assert (torch.softmax(out.double(), -1) - mixture).abs().max() <= 1e-6
        assert torch.equal(mixture == 0, torch.isneginf(out))


@pytest.mark.parametrize("impl", IMPLS)
def test_softmax_of_contrastive_is_the_ratio_on_the_plausible_set(impl):
    """softmax(contrastive) is proportional to p_e / p_a^mu on {p_e >= alpha max p_e, p_a > 0}."""
    vocab = 20000 if impl == "cpp" else 300
    e, a = random_members((3, vocab), 2, seed=11, scale=2.0)
    mu, alpha = 0.4, 0.02
    out = run_impl(impl, [e, a], mode="contrastive", mu=mu, alpha=alpha, block_v=64)
    pe, pa = torch.softmax(e.double(), -1), torch.softmax(a.double(), -1)
    plausible = (pe >= alpha * pe.amax(-1, keepdim=True)) & (pa > 0)
    score = torch.where(plausible, pe / pa.pow(mu), 0.0)
    want = score / score.sum(-1, keepdim=True)
    assert (torch.softmax(out.double(), -1) - want).abs().max() <= 1e-6
    assert torch.equal(~plausible, torch.isneginf(out))


def test_chain_verify_greedy_on_the_ensemble_takes_the_mixture_argmax():
    """At temperature 0 chain_verify on the ensemble emits argmax_x sum_i w_i p_i(x): here a token neither
    member ranks first (both give it 0.4, while each member's favourite gets 0.5 from one member only)."""
    a = logs(0.5, 0.4, 0.1, 0.0)
    b = logs(0.0, 0.4, 0.1, 0.5)
    assert a.argmax() != 1 and b.argmax() != 1
    ens = specops.ops.ensemble_logits([a.expand(1, 2, 4), b.expand(1, 2, 4)], [0.5, 0.5])
    # The draft is a's favourite, 0: rejected (not the ensemble's argmax), and 1 is emitted instead.
    tokens, accepted = specops.ops.chain_verify(ens, torch.tensor([[0]]), temperature=0.0, seed=0)
    assert accepted.tolist() == [0] and tokens[0, 0] == 1


# ---- 4. batch and thread invariance (the C++ kernel) ----

@pytest.mark.parametrize("mode", ["weighted", "contrastive"])
def test_row_bits_do_not_depend_on_the_batch(mode):
    vocab = 16390  # two chunks, the second a vector and a scalar tail
    count = 3 if mode == "weighted" else 2
    members = random_members((12, vocab), count, seed=21, scale=3.0)
    weights = [0.5, 0.2, 0.3][:count] if mode == "weighted" else None
    kwargs = {"mu": 0.5, "alpha": 0.05} if mode == "contrastive" else {}
    rng = random.Random(0)

    def call(rows):
        return specops.ops.ensemble_logits([m[rows] for m in members], weights, mode=mode, **kwargs)

    alone = torch.cat([call([r]) for r in range(12)])
    assert torch.equal(call(list(range(12))), alone)
    for _ in range(10):
        rows = rng.sample(range(12), rng.randint(1, 12))
        assert torch.equal(call(rows), alone[rows]), rows
    lead = specops.ops.ensemble_logits([m.view(3, 4, vocab) for m in members], weights, mode=mode, **kwargs)
    assert torch.equal(lead, alone.view(3, 4, vocab))


@pytest.mark.parametrize("mode", ["weighted", "contrastive"])
def test_thread_count_does_not_change_the_bits(mode):
    count = 3 if mode == "weighted" else 2
    members = random_members((5, 40000), count, seed=22, scale=2.0)
    weights = [0.25, 0.25, 0.5][:count] if mode == "weighted" else None
    kwargs = {"mu": 0.2, "alpha": 0.01} if mode == "contrastive" else {}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = specops.ops.ensemble_logits(members, weights, mode=mode, **kwargs)
        torch.set_num_threads(2)
        two = specops.ops.ensemble_logits(members, weights, mode=mode, **kwargs)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert_matches_reference(two, members, weights, mode, **kwargs)


# ---- 5. bad input, and the fake ----

def _good():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen)]


def _with(member: int, row: int, col: int, value: float):
    members = _good()
    members[member][row, col] = value
    return members


def _no_finite_row():
    members = _good()
    members[1][2] = NEG_INF
    return members


# The op's messages (the C++ kernel's on CPU, its contract's elsewhere); the wrapper's own are the kinds of its
# arguments (a list of tensors, numbers) and the mode's name.
BAD = [
    ({"members": []}, ValueError, r"ensemble_logits: needs at least one member"),
    ({"members": torch.zeros(2, 3, 8)}, TypeError, r"members must be a list of logit tensors"),
    ({"members": [torch.zeros(3, 8), [0.0] * 8]}, TypeError, r"member 1 must be a tensor, got list"),
    ({"members": [torch.tensor(1.0), torch.tensor(1.0)]}, ValueError, r"members must be \[\.\.\., V\] with V >= 1"),
    ({"members": [torch.zeros(3, 0), torch.zeros(3, 0)]}, ValueError, r"members must be \[\.\.\., V\] with V >= 1"),
    ({"members": [torch.zeros(3, 8), torch.zeros(3, 9)]}, ValueError,
     r"member 1 has shape \[3, 9\], member 0 has \[3, 8\]"),
    ({"members": [torch.zeros(3, 8), torch.zeros(1, 8)]}, ValueError, r"member 1 has shape \[1, 8\]"),
    ({"members": [torch.zeros(3, 8), torch.zeros(3, 8, dtype=torch.int64)]}, TypeError,
     r"members must be float32, bfloat16 or float16"),
    ({"members": [torch.zeros(3, 8, dtype=torch.float64)] * 2}, TypeError,
     r"members must be float32, bfloat16 or float16"),
    ({"members": [torch.zeros(3, 8), torch.zeros(3, 8, device="meta")]}, ValueError,
     r"member 1 is on meta, member 0 on cpu"),
    ({"weights": None}, ValueError, r"weights must be \[2\] \(one per member\)"),
    ({"weights": [1.0]}, ValueError, r"weights must be \[2\] \(one per member\)"),
    ({"weights": [0.2, 0.3, 0.5]}, ValueError, r"weights must be \[2\]"),
    ({"weights": torch.tensor([0.2, 0.3, 0.5])}, ValueError, r"weights must be \[2\]"),
    ({"weights": "0.5,0.5"}, TypeError, r"weights must be a sequence of numbers or a tensor, got str"),
    ({"weights": 0.5}, TypeError, r"weights must be a sequence of numbers or a tensor, got float"),
    ({"weights": [True, False]}, TypeError, r"a weight must be a number, got bool"),
    ({"weights": [0.5, 0.4]}, ValueError, r"weights must sum to 1, got 0.9"),
    ({"weights": torch.tensor([0.6, 0.6])}, ValueError, r"weights must sum to 1, got 1.2"),
    ({"weights": [1.5, -0.5]}, ValueError, r"weights must be finite and >= 0, got -0.5 for member 1"),
    ({"weights": [float("nan"), 1.0]}, ValueError, r"weights must be finite and >= 0"),
    ({"weights": [float("inf"), 1.0]}, ValueError, r"weights must be finite and >= 0"),
    ({"mode": "mixture"}, ValueError, r"mode must be 'weighted' or 'contrastive', got 'mixture'"),
    ({"mode": 0}, ValueError, r"mode must be 'weighted' or 'contrastive', got 0"),
    ({"mode": "contrastive", "members": _good() + _good()[:1]}, ValueError,
     r"a contrastive ensemble has exactly 2 members \(expert, amateur\), got 3"),
    ({"mode": "contrastive", "members": _good()[:1]}, ValueError, r"exactly 2 members .*got 1"),
    ({"mode": "contrastive", "mu": -0.1}, ValueError, r"mu must be finite and >= 0, got -0.1"),
    ({"mode": "contrastive", "mu": float("nan")}, ValueError, r"mu must be finite and >= 0"),
    ({"mode": "contrastive", "mu": float("inf")}, ValueError, r"mu must be finite and >= 0"),
    ({"mode": "contrastive", "mu": True}, TypeError, r"mu must be a number, got bool"),
    ({"mode": "contrastive", "mu": "0.5"}, TypeError, r"mu must be a number, got str"),
    ({"mode": "contrastive", "alpha": 1.0}, ValueError, r"alpha must be in \[0, 1\), got 1"),
    ({"mode": "contrastive", "alpha": 1.5}, ValueError, r"alpha must be in \[0, 1\)"),
    ({"mode": "contrastive", "alpha": -0.01}, ValueError, r"alpha must be in \[0, 1\), got -0.01"),
    ({"mode": "contrastive", "alpha": float("nan")}, ValueError, r"alpha must be in \[0, 1\)"),
    # Values: on the CPU the kernel finds them (named by member and row).
    ({"members": _with(1, 2, 5, float("nan"))}, ValueError, r"member 1, row 2 contains NaN or \+inf"),
    ({"members": _with(0, 1, 0, float("inf"))}, ValueError, r"member 0, row 1 contains NaN or \+inf"),
    ({"members": _no_finite_row()}, ValueError, r"member 1, row 2 has no finite logit"),
    ({"members": _with(0, 0, 7, float("nan")), "mode": "contrastive"}, ValueError,
     r"member 0, row 0 contains NaN or \+inf"),
    ({"members": _no_finite_row(), "mode": "contrastive"}, ValueError, r"member 1, row 2 has no finite logit"),
]


@pytest.mark.parametrize("change,error,match", BAD)
@pytest.mark.parametrize("validate", [True, False])
def test_bad_arguments(change, error, match, validate):
    """Every bad argument raises on the CPU, also with validate=False (the CPU kernel reads every value)."""
    args = {"members": _good(), "weights": [0.5, 0.5], "mode": "weighted", "mu": 0.5, "alpha": 0.1}
    args.update(change)
    with pytest.raises(error, match=match):
        specops.ops.ensemble_logits(args["members"], args["weights"], mode=args["mode"], mu=args["mu"],
                                    alpha=args["alpha"], validate=validate)


def test_bad_values_anywhere_in_a_long_row():
    """NaN / +inf in the vector part, the scalar tail and a later chunk are all found."""
    for col in (3, 16384 + 16, 16384 + 17, 40000 - 1):
        for value in (float("nan"), float("inf")):
            members = [torch.zeros(2, 40000), torch.zeros(2, 40000)]
            members[1][1, col] = value
            with pytest.raises(ValueError, match=r"member 1, row 1 contains NaN or \+inf"):
                specops.ops.ensemble_logits(members, [0.5, 0.5])


def test_weights_within_tolerance_are_accepted():
    members = _good()
    for weights in ([1 / 3, 1 / 3, 1 / 3], [0.33333, 0.33333, 0.33334], [0.5, 0.50005, 0.0]):
        out = specops.ops.ensemble_logits(members + [members[0]], weights)
        assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="weights must sum to 1"):
        specops.ops.ensemble_logits(members, [0.5, 0.5002])


def test_cpp_kernel_checks_its_arguments():
    """The op called directly (no wrapper) refuses what its kernel cannot run."""
    a, b = _good()
    op = torch.ops.specops.ensemble_logits
    w = torch.tensor([0.5, 0.5])
    cases = [
        (([a, b], w, 2, 0.0, 0.0), ValueError, r"mode must be 0 \(weighted\) or 1 \(contrastive\)"),
        (([], w, 0, 0.0, 0.0), ValueError, r"needs at least one member"),
        (([a, b, a], w, 1, 0.0, 0.0), ValueError, r"a contrastive ensemble has exactly 2 members .*got 3"),
        (([a, b[:, :7]], w, 0, 0.0, 0.0), ValueError, r"member 1 has shape \[3, 7\], member 0 has \[3, 8\]"),
        (([a, b.long()], w, 0, 0.0, 0.0), TypeError, r"members must be float32, bfloat16 or float16"),
        (([a.double(), b.double()], w, 0, 0.0, 0.0), TypeError, r"members must be float32, bfloat16 or float16"),
        (([a[:, :0], b[:, :0]], w, 0, 0.0, 0.0), ValueError, r"members must be \[\.\.\., V\] with V >= 1"),
        (([a, b], torch.tensor([1.0]), 0, 0.0, 0.0), ValueError, r"weights must be \[2\] \(one per member\)"),
        (([a, b], w.view(1, 2), 0, 0.0, 0.0), ValueError, r"weights must be \[2\]"),
        (([a, b], w.double(), 0, 0.0, 0.0), TypeError, r"weights must be float32"),
        (([a, b], torch.tensor([0.5, 0.4]), 0, 0.0, 0.0), ValueError, r"weights must sum to 1, got 0.9"),
        (([a, b], torch.tensor([1.5, -0.5]), 0, 0.0, 0.0), ValueError, r"weights must be finite and >= 0, got -0.5"),
        (([a, b], torch.tensor([float("nan"), 1.0]), 0, 0.0, 0.0), ValueError, r"weights must be finite and >= 0"),
        (([a, b], w, 1, -1.0, 0.0), ValueError, r"mu must be finite and >= 0, got -1"),
        (([a, b], w, 1, float("inf"), 0.0), ValueError, r"mu must be finite and >= 0"),
        (([a, b], w, 1, 0.5, 1.0), ValueError, r"alpha must be in \[0, 1\), got 1"),
        (([a, b], w, 1, 0.5, -0.5), ValueError, r"alpha must be in \[0, 1\)"),
        (([a, b], w, 1, 0.5, float("nan")), ValueError, r"alpha must be in \[0, 1\)"),
        (([a, _with(1, 0, 3, float("inf"))[1]], w, 0, 0.0, 0.0), ValueError,
         r"member 1, row 0 contains NaN or \+inf"),
        (([_no_finite_row()[1], b], w, 0, 0.0, 0.0), ValueError, r"member 0, row 2 has no finite logit"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            op(*args)
        with pytest.raises(error, match=match):
            op(*args, False)  # validate=False: the CPU kernel checks every value anyway
    # Contrastive ignores the weights tensor, whatever it holds.
    assert torch.equal(op([a, b], torch.tensor([7.0]), 1, 0.5, 0.0), op([a, b], torch.empty(0), 1, 0.5, 0.0))


@pytest.mark.parametrize("mode", [0, 1])
def test_opcheck(mode):
    members = random_members((2, 3, 40), 2, seed=mode)
    w = torch.tensor([0.3, 0.7]) if mode == 0 else torch.empty(0)
    torch.library.opcheck(torch.ops.specops.ensemble_logits.default, (members, w, mode, 0.5, 0.1, True))
    three = random_members((5, 33), 3, seed=3)
    torch.library.opcheck(torch.ops.specops.ensemble_logits.default,
                          (three, torch.tensor([0.2, 0.2, 0.6]), 0, 0.0, 0.0, False))
    torch.library.opcheck(torch.ops.specops.ensemble_logits.default,
                          ([m.bfloat16() for m in members], w, mode, 0.5, 0.1))


def test_fake_and_meta_shapes():
    with FakeTensorMode():
        out = specops.ops.ensemble_logits([torch.empty(2, 3, 33), torch.empty(2, 3, 33, dtype=torch.bfloat16)],
                                          [0.5, 0.5])
        assert out.shape == (2, 3, 33) and out.dtype == torch.float32
    # Meta tensors have no values to check: validate=False (as on any non-CPU device that skips the sync).
    meta = [torch.empty(4, 33, device="meta", dtype=torch.float16)] * 2
    out = specops.ops.ensemble_logits(meta, mode="contrastive", mu=0.1, validate=False)
    assert out.shape == (4, 33) and out.device.type == "meta" and out.dtype == torch.float32


def test_torch_compile_matches_eager():
    # aot_eager traces the op through its fake with fullgraph and skips Inductor's C++ build.
    members = random_members((2, 3, 50), 2, seed=8)

    def ensemble(a, b):
        weighted = specops.ops.ensemble_logits([a, b], [0.25, 0.75])
        contrastive = specops.ops.ensemble_logits([a, b], mode="contrastive", mu=0.1, alpha=0.05)
        return torch.softmax(weighted, -1), contrastive

    compiled = torch.compile(ensemble, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(*members), ensemble(*members)):
        assert torch.equal(got, want)


_COMPILE = """
from specops.tools import compile_check
launches = [l for l in compile_check.kernels_launched() if l.name == "_ensemble_logits_kernel"]
assert {l.constexprs["CONTRASTIVE"] for l in launches} == {False, True}
rows = [compile_check.compile_launch(l, capability) for l in launches for capability in (90, 80)]
assert all(row["ok"] for row in rows), [row.get("error") for row in rows]
"""


@pytest.mark.slow
@pytest.mark.skipif(triton_launcher("ensemble_logits") is None, reason="needs triton")
def test_kernel_compiles_for_hopper_and_ampere():
    """Both modes, at every shape and dtype compile_check launches them with (through the launcher),
    compile ahead of time for sm_90 and sm_80, no GPU needed (outside the interpreter, which conftest turns
    on for this process). The interpreter ran the kernel with a plain float global that the compiler
    rejects ("Cannot access global variable _NEG_INF"), and the launcher then passed the constexpr that
    replaced it as a runtime argument: every CUDA call would have failed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], check=False, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
