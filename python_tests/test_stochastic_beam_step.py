"""Tests of `specops::stochastic_beam_step` (one level of Stochastic Beam Search, RSD-S's proposal), in the
four layers of DEVELOPERS.md ("Tests"), plus bad inputs.

1. Exact: greedy levels are beam search (each beam's largest logits, scored phi + log_softmax), small
   supports pad with -1 / -inf, dead beams are not read and get no children, and on random levels the
   children kept from a beam are a prefix of its `sample_without_replacement` draws (the first scored
   exactly G), with log_probs = phi + log q and scores descending.
2. Agreement: the C++ kernel, the Triton kernel (interpreted on CPU without a GPU) and the wrapper give
   the reference's parents and tokens for the same seeds, and its scores, log_probs and q to float32
   rounding; opcheck, the fake's shapes and torch.compile.
3. Statistics: two levels of beam width 2 on a table model return two 2-token sequences drawn without
   replacement, in draw order (chi-square over ordered pairs); and the check rejects the classic
   mistakes (children scored from phi instead of G, phi dropped, untruncated Gumbels, the levels sharing
   random numbers, the pair reported in the wrong order).
4. Bad inputs raise ValueError / TypeError naming the problem.
"""

from __future__ import annotations

import pytest
import torch
from _triton import IMPLS, KERNELS, TRITON_DEVICE, needs_triton, triton_launcher
from stats_helpers import N_DRAWS, P_VALUE_MIN, chisquare_pvalue

import specops
from specops import reference
from specops._rows import per_row
from specops._seeds import beam_seeds, row_seeds

stochastic_beam_step_triton = triton_launcher("stochastic_beam_step")

NEG_INF = float("-inf")
NAN = float("nan")
LOGIT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---- helpers ----

def normalized_args(logits, beam_log_probs, beam_scores, beam_width, *, temperature=1.0, top_k=0, top_p=1.0,
                    seed=0) -> tuple:
    """The op's arguments except `offset` (CPU tensors); an int seed gives the requests row_seeds(seed)."""
    batch = logits.shape[0]
    return (logits, beam_log_probs, beam_scores, beam_width,
            per_row("temperature", temperature, batch, torch.float32, "cpu"),
            per_row("top_k", top_k, batch, torch.int64, "cpu"),
            per_row("top_p", top_p, batch, torch.float32, "cpu"), row_seeds(seed, batch))


def run_impl(impl: str, args: tuple, offset: int = 0, block_v: int | None = None) -> tuple:
    """(parents, tokens, log_probs, scores, probs) on CPU from one implementation."""
    if impl == "reference":
        return reference.stochastic_beam_step(*args, offset)
    if impl == "cpp":
        return torch.ops.specops.stochastic_beam_step(*args, offset)
    if impl == "triton":
        moved = [a.to(TRITON_DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
        return tuple(t.cpu() for t in stochastic_beam_step_triton(*moved, offset, block_v=block_v))
    raise AssertionError(impl)


def assert_agree(result, expected, what: str = "") -> None:
    """Parents and tokens exactly (the backends share their random numbers); scores and log_probs to
    1e-5: float32 logs of the remaining mass and of q, at |score| up to about 20; q to 1e-6 as in
    test_sample_without_replacement."""
    for name, got, want in zip(("parents", "tokens"), result[:2], expected[:2]):
        assert torch.equal(got, want), f"{what}{name}\n{got}\n!= reference\n{want}"
    for name, got, want in zip(("log_probs", "scores"), result[2:4], expected[2:4]):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"{what}{name}\n{got}\n!= reference\n{want}"
    assert torch.allclose(result[4], expected[4], atol=1e-6, rtol=1e-5), f"{what}probs differ"


def live_beams(args: tuple) -> torch.Tensor:
    _, phi, g, *_ = args
    return (phi > NEG_INF) & (g > NEG_INF)


def beam_draws(args: tuple, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each beam's draws [B, W, K] and q [B, W, V] from sample_without_replacement with the beam's seed:
    what the children of a live beam must be a prefix of."""
    logits, _, _, k, temperature, top_k, top_p, seed = args
    batch, beams, vocab = logits.shape
    # Dead beams may hold NaN, which sample_without_replacement rejects; their draws are not compared.
    rows = torch.where(live_beams(args)[..., None], logits.float(), 0.0).reshape(batch * beams, vocab)
    draws, q = torch.ops.specops.sample_without_replacement(
        rows, k, temperature.repeat_interleave(beams), top_k.repeat_interleave(beams),
        top_p.repeat_interleave(beams), beam_seeds(seed, beams).reshape(-1), offset)
    return draws.reshape(batch, beams, k), q.reshape(batch, beams, vocab)


def check_level(args: tuple, result: tuple, offset: int) -> None:
    """What every level satisfies whatever the random numbers (stochastic rows; greedy rows have their
    own test): children best first then padding; from each live beam a prefix of its draws, the first
    scored exactly G, with log_prob = phi + log q; nothing from dead beams, whose q is 0."""
    logits, phi, g, k, temperature, *_ = args
    parents, tokens, log_probs, scores, probs = result
    draws, q = beam_draws(args, offset)
    live = live_beams(args)
    for b in range(logits.shape[0]):
        available = int(((draws[b] >= 0) & live[b, :, None]).sum())
        count = min(k, available)
        assert (tokens[b, :count] >= 0).all() and (parents[b, :count] >= 0).all(), f"request {b}: {tokens[b]}"
        assert (tokens[b, count:] == -1).all() and (parents[b, count:] == -1).all()
        assert (scores[b, count:] == NEG_INF).all() and (log_probs[b, count:] == NEG_INF).all()
        assert (scores[b, :count].diff() <= 0).all(), f"request {b}: scores {scores[b]}"
        for w in range(logits.shape[1]):
            mine = parents[b, :count] == w
            kept = tokens[b, :count][mine]
            if not live[b, w]:
                assert kept.numel() == 0 and not probs[b, w].any(), f"dead beam {w} of request {b}"
                continue
            assert torch.equal(kept, draws[b, w, : kept.numel()]), f"request {b} beam {w}: {kept}"
            assert torch.allclose(probs[b, w], q[b, w], atol=1e-6)
            if kept.numel() and float(temperature[b]) > 0:
                assert float(scores[b, :count][mine][0]) == float(g[b, w]), f"request {b} beam {w}"
                want = phi[b, w].double() + q[b, w, kept].double().log()
                assert torch.allclose(log_probs[b, :count][mine].double(), want, atol=1e-5)


# Per-request sampling settings (temperature, top_k, top_p), cycled over the requests.
SETTINGS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (0.0, 0, 1.0), (1.0, 0, 0.8), (0.7, 3, 0.9), (1.0, 0, 1.0)]


def random_case(gen: torch.Generator, batch: int, beams: int, vocab: int, beam_width: int, dtype: torch.dtype,
                shift: int = 0) -> tuple:
    """A ragged level: dead beams (phi = -inf in request 0, G = -inf in request 1) holding NaN logits, one
    beam with half its vocabulary at -inf, mixed sampling settings (starting at SETTINGS[shift])."""
    logits = 2.0 * torch.randn(batch, beams, vocab, generator=gen)
    phi = -3.0 * torch.rand(batch, beams, generator=gen)
    g = phi + torch.randn(batch, beams, generator=gen)
    if beams > 1:
        phi[0, beams - 1] = NEG_INF
        logits[0, beams - 1] = NAN
    g[1 % batch, 0] = NEG_INF
    logits[1 % batch, 0] = NAN
    logits[batch - 1, beams - 1, : vocab // 2] = NEG_INF
    settings = [SETTINGS[(b + shift) % len(SETTINGS)] for b in range(batch)]
    temperature, top_k, top_p = (torch.tensor(column) for column in zip(*settings))
    return normalized_args(logits.to(dtype), phi, g, beam_width, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=int(torch.randint(0, 2**40, (1,), generator=gen)))


# ==== 1. Exact ====

@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_is_beam_search(impl, dtype):
    # Request 0: beam 0's top 3 are tokens 1, 4, 3 and beam 1's 2, 5, 0; phi + log_softmax interleaves them.
    # Request 1: ties. Both beams equal, tokens 1 and 2 equal: draw order, then the lower beam.
    # Request 2: beam 0 has two finite logits (two children); beam 1 is dead and its NaN logits unread.
    # G does not score greedy children; it differs from phi to show that.
    logits = torch.tensor([[[0.5, 3.0, -1.0, 2.0, 2.5, NEG_INF], [1.0, NEG_INF, 4.0, 0.0, NEG_INF, 3.5]],
                           [[1.0, 2.0, 2.0, 0.0, -1.0, -1.0], [1.0, 2.0, 2.0, 0.0, -1.0, -1.0]],
                           [[NEG_INF, 1.0, NEG_INF, NEG_INF, 0.0, NEG_INF], [NAN] * 6]]).to(dtype)
    phi = torch.tensor([[-0.2, -0.6], [-1.0, -1.0], [0.0, NEG_INF]])
    g = torch.tensor([[5.0, -7.0], [0.0, 0.0], [-3.0, 1.0]])
    args = normalized_args(logits, phi, g, 4, temperature=0.0)
    parents, tokens, log_probs, scores, probs = run_impl(impl, args)
    assert parents.tolist() == [[0, 1, 0, 1], [0, 0, 1, 1], [0, 0, -1, -1]]
    assert tokens.tolist() == [[1, 2, 4, 5], [1, 2, 1, 2], [1, 4, -1, -1]]
    beam_search = phi.double()[..., None] + torch.log_softmax(logits.double().nan_to_num(), -1)
    want = torch.full((3, 4), NEG_INF, dtype=torch.float64)
    for b in range(3):
        for j in range(4):
            if tokens[b, j] >= 0:
                want[b, j] = beam_search[b, parents[b, j], tokens[b, j]]
    assert torch.allclose(scores.double(), want, atol=1e-6)
    assert torch.allclose(log_probs.double(), want, atol=1e-6)
    one_hot = torch.zeros(3, 2, 6)
    one_hot[0, 0, 1] = one_hot[0, 1, 2] = one_hot[1, 0, 1] = one_hot[1, 1, 1] = one_hot[2, 0, 1] = 1.0
    assert torch.equal(probs, one_hot)


@pytest.mark.parametrize("impl", IMPLS)
def test_small_support_pads(impl):
    # Four children asked for. Request 0: one live beam with two finite logits; request 1: top_k = 2 on
    # both beams, so four children from two beams; request 2: top_p keeps tokens 0 and 3 of the only beam.
    logits = torch.tensor([[[NEG_INF, 0.3, NEG_INF, NEG_INF, -0.2], [NAN] * 5],
                           [[0.0, 2.0, 1.0, -1.0, 1.5], [0.5, 0.0, 3.0, 2.5, 0.0]],
                           [[4.0, 0.0, 0.0, 4.1, 0.0], [NAN] * 5]])
    phi = torch.tensor([[-0.5, NEG_INF], [-1.0, -2.0], [0.0, 0.0]])
    g = torch.tensor([[0.2, 0.0], [-0.4, -1.0], [0.0, NEG_INF]])
    for seed in range(3):
        args = normalized_args(logits, phi, g, 4, top_k=torch.tensor([0, 2, 0]),
                               top_p=torch.tensor([1.0, 1.0, 0.9]), seed=seed)
        parents, tokens, log_probs, scores, probs = run_impl(impl, args)
        check_level(args, (parents, tokens, log_probs, scores, probs), 0)
        assert sorted(tokens[0, :2].tolist()) == [1, 4] and tokens[0, 2:].tolist() == [-1, -1]
        assert parents[0].tolist() == [0, 0, -1, -1] and scores[0, 0] == g[0, 0]
        assert (scores[0, 2:] == NEG_INF).all() and (log_probs[0, 2:] == NEG_INF).all()
        kids = sorted(zip(parents[1].tolist(), tokens[1].tolist()))
        assert kids == sorted([(0, 1), (0, 4), (1, 2), (1, 3)])
        assert sorted(tokens[2, :2].tolist()) == [0, 3] and parents[2].tolist() == [0, 0, -1, -1]
        assert not probs[0, 1].any() and not probs[2, 1].any()


@pytest.mark.parametrize("impl", IMPLS)
def test_dead_beams_give_no_children(impl):
    # phi = -inf or G = -inf: not read (NaN logits), no children, q = 0. Request 1 has no live beam at all.
    logits = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(2))
    logits[0, 0] = logits[0, 2] = NAN
    logits[1] = NAN
    phi = torch.tensor([[NEG_INF, -0.3, -0.1], [NEG_INF, -1.0, NEG_INF]])
    g = torch.tensor([[0.0, -0.5, NEG_INF], [0.0, NEG_INF, NEG_INF]])
    args = normalized_args(logits, phi, g, 3, seed=7)
    parents, tokens, log_probs, scores, probs = run_impl(impl, args)
    check_level(args, (parents, tokens, log_probs, scores, probs), 0)
    assert parents[0].tolist() == [1, 1, 1] and parents[1].tolist() == [-1, -1, -1]
    assert tokens[1].tolist() == [-1, -1, -1]
    assert (scores[1] == NEG_INF).all() and (log_probs[1] == NEG_INF).all()
    assert not probs[0, 0].any() and not probs[0, 2].any() and not probs[1].any()


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_children_are_prefixes_of_each_beams_draws(impl):
    # Kept children from beam w: the first of sample_without_replacement's draws with beam_seeds' key, in
    # draw order, the first scored G; top-k and top-p keep them in the filtered support (q > 0).
    gen = torch.Generator().manual_seed(3)
    for trial in range(3):  # request b of trial t has SETTINGS[b + t]: each setting at least once
        args = random_case(gen, 4, 3, 9, 4, torch.float32, shift=trial)
        result = run_impl(impl, args, offset=trial)
        check_level(args, result, trial)
        parents, tokens, *_, probs = result
        kept = (tokens >= 0) & (args[4] > 0)[:, None]  # greedy rows' q is one-hot
        requests = torch.arange(4)[:, None].expand_as(tokens)
        assert (probs[requests[kept], parents[kept], tokens[kept]] > 0).all()


# ==== 2. Agreement ====

# (B, W, V, K): single beams, full beams, a large vocabulary, K = V.
CPP_SHAPES = [(1, 1, 7, 7), (4, 4, 50, 4), (3, 2, 3000, 8), (4, 3, 2049, 5), (2, 4, 5, 5)]


@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_cpp_matches_reference(dtype):
    gen = torch.Generator().manual_seed(10 + LOGIT_DTYPES.index(dtype))
    for trial, (batch, beams, vocab, k) in enumerate(CPP_SHAPES):
        args = random_case(gen, batch, beams, vocab, k, dtype, shift=trial)
        assert_agree(run_impl("cpp", args, trial), run_impl("reference", args, trial),
                     f"shape {(batch, beams, vocab)}: ")


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_triton_matches_reference(dtype):
    # block_v below V: several vocabulary tiles per beam.
    gen = torch.Generator().manual_seed(20 + LOGIT_DTYPES.index(dtype))
    for trial, (batch, beams, vocab, k, block_v) in enumerate([(2, 2, 7, 3, 4), (3, 4, 50, 4, 16),
                                                                (2, 2, 300, 6, 64), (4, 3, 200, 2, None)]):
        args = random_case(gen, batch, beams, vocab, k, dtype, shift=trial)
        assert_agree(run_impl("triton", args, trial, block_v), run_impl("reference", args, trial),
                     f"shape {(batch, beams, vocab)}, block_v {block_v}: ")


@pytest.mark.parametrize("impl", KERNELS)
def test_one_token_holding_nearly_all_the_mass(impl):
    """Each beam's first draw is a token with q = 1 - 1e-13: the mass left after it must come from what is
    left (about 1e-13), not from 1 - q(first), which cancels to round-off and moves the later scores."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 2, 3000, generator=gen)
    logits[:, :, 7] = 40.0
    args = normalized_args(logits, torch.zeros(3, 2), torch.randn(3, 2, generator=gen), 3, seed=9)
    result, expected = run_impl(impl, args, 0, 512), run_impl("reference", args)
    assert_agree(result, expected)
    # Both beams' token 7 score their beam's G; a beam's second draw scores far below.
    assert (expected[1][:, :2] == 7).all() and (expected[3][:, 2] < expected[3][:, :2].min(1).values - 10).all()


def test_wrapper_matches_reference(device):
    args = random_case(torch.Generator().manual_seed(30), 4, 3, 40, 3, torch.float32)
    logits, phi, g, k, temperature, top_k, top_p, seed = args
    got = specops.ops.stochastic_beam_step(logits.to(device), phi.to(device), g.to(device), k,
                                           temperature=temperature.to(device), top_k=top_k.to(device),
                                           top_p=top_p.to(device), seed=seed.to(device), offset=2)
    assert_agree(tuple(t.cpu() for t in got), reference.stochastic_beam_step(*args, 2))


def test_wrapper_int_seed_is_row_seeds():
    logits = torch.randn(3, 2, 10, generator=torch.Generator().manual_seed(31))
    phi = torch.zeros(3, 2)
    got = specops.ops.stochastic_beam_step(logits, phi, phi, 3, temperature=0.8, top_k=6, seed=123, offset=4)
    args = normalized_args(logits, phi, phi, 3, temperature=0.8, top_k=6, seed=123)
    assert_agree(got, reference.stochastic_beam_step(*args, 4))


@pytest.mark.parametrize("impl", KERNELS)
def test_requests_do_not_depend_on_their_batch(impl):
    # Batch invariance: request 2 alone, with its own seed, gives what it gave in the batch.
    args = random_case(torch.Generator().manual_seed(32), 4, 3, 30, 3, torch.float32)
    whole = run_impl(impl, args, 5)
    alone = run_impl(impl, tuple(a[2:3] if isinstance(a, torch.Tensor) else a for a in args), 5)
    assert_agree(alone, tuple(t[2:3] for t in whole))


@pytest.mark.slow
@pytest.mark.parametrize("impl", KERNELS)
def test_offsets_give_other_children(impl):
    logits = torch.randn(16, 2, 20, generator=torch.Generator().manual_seed(40))
    phi = torch.zeros(16, 2)
    args = normalized_args(logits, phi, phi, 3, seed=5)
    a = run_impl(impl, args, 0)[1]
    b = run_impl(impl, args, 1)[1]
    assert (a != b).any(1).float().mean() > 0.8


def small_case(device: str = "cpu") -> tuple:
    args = random_case(torch.Generator().manual_seed(50), 3, 2, 12, 3, torch.float32)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def test_opcheck(device):
    torch.library.opcheck(torch.ops.specops.stochastic_beam_step.default, small_case(device) + (5,))


def test_fake_gives_the_real_shapes():
    args = small_case()
    real = torch.ops.specops.stochastic_beam_step(*args, 5)
    meta = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    fake = torch.ops.specops.stochastic_beam_step(*meta, 5)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
    assert [tuple(t.shape) for t in real] == [(3, 3)] * 4 + [(3, 2, 12)]
    assert all(t.device.type == "meta" for t in fake)


def _level(logits, beam_log_probs, beam_scores, beam_width, temperature, top_k, top_p, seed, offset):
    return specops.ops.stochastic_beam_step(logits, beam_log_probs, beam_scores, beam_width,
                                            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                            offset=offset)


def test_torch_compile_matches_eager(device):
    # Inductor with fullgraph: the op must trace through its fake.
    torch._dynamo.reset()
    compiled = torch.compile(_level, fullgraph=True)
    args = small_case(device)
    assert_agree(tuple(t.cpu() for t in compiled(*args, 3)), tuple(t.cpu() for t in _level(*args, 3)))


# ==== 3. Statistics ====
#
# Two levels of beam width 2 on a table model of vocabulary 3: the pair of 2-token sequences returned,
# best first, must be an ordered sample without replacement from p(x0, x1) = q_root(x0) q_next[x0](x1):
# P(s1, s2) = p(s1) p(s2) / (1 - p(s1)). 9 sequences, at most 72 ordered pairs. As in test_chain_verify,
# N_DRAWS = 200,000 trials and a chi-square at level P_VALUE_MIN = 1e-3; no pair here is more likely than
# 0.27, so a 1% error moved between two pairs gives a noncentrality N * 0.01**2 * (1/a + 1/b) >= 148,
# detected with probability > 0.9999 for up to 71 degrees of freedom (scipy.stats.ncx2). Seeds are fixed,
# so every run computes the same p-values. The trials are the requests of one batch (seed = int: one
# seed per request, by row_seeds).
VOCAB = 3
ROOT_LOGITS = torch.tensor([0.9, 0.2, -0.5])
NEXT_LOGITS = torch.tensor([[0.3, 1.2, -0.4], [-0.8, 0.0, 0.7], [1.5, -1.0, 0.1]])  # row x0: logits of x1


def table_q(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    rows = logits.shape[0]
    filtered = reference.filter_logits(logits, torch.full((rows,), temperature), torch.full((rows,), top_k),
                                       torch.full((rows,), top_p))
    return torch.softmax(filtered.double(), -1)


def ordered_pair_probs(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[81] float64: P(s1, s2) at s1 * 9 + s2, sequences s = x0 * 3 + x1."""
    p = (table_q(ROOT_LOGITS[None], temperature, top_k, top_p)[0, :, None]
         * table_q(NEXT_LOGITS, temperature, top_k, top_p)).flatten()
    pairs = p[:, None] * p[None, :] / (1 - p[:, None])
    return pairs.fill_diagonal_(0.0).flatten()


def two_levels(temperature: float, top_k: int, top_p: float, seed: int,
               mistake: str | None = None) -> torch.Tensor:
    """[N_DRAWS] ordered pairs s1 * 9 + s2 from two levels of the op, with `mistake` made between them."""
    zeros = torch.zeros(N_DRAWS, 1)
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
    root = ROOT_LOGITS.expand(N_DRAWS, 1, VOCAB)
    _, first, log_probs, scores, _ = specops.ops.stochastic_beam_step(root, zeros, zeros, 2, offset=0,
                                                                      **sampling)
    # The levels of one request take different offsets: the same offset would replay level 1's numbers.
    offset = 1
    if mistake == "children_scored_below_phi":  # the level's Gumbels restarted: G dropped
        scores = log_probs
    elif mistake == "phi_dropped":
        log_probs = torch.zeros_like(log_probs)
    elif mistake == "same_offset":
        offset = 0
    parents, second, _, _, _ = specops.ops.stochastic_beam_step(NEXT_LOGITS[first], log_probs, scores, 2,
                                                                offset=offset, **sampling)
    sequences = first.gather(1, parents) * VOCAB + second
    return sequences[:, 0] * VOCAB**2 + sequences[:, 1]


def untruncated_gumbel_pairs(seed: int) -> torch.Tensor:
    """The classic mistake, at T = 1: level 2 scores every child of the kept prefixes log p(x0, x1) plus a
    fresh Gumbel, not a Gumbel conditioned on its parent's score."""
    gen = torch.Generator().manual_seed(seed)

    def gumbel(*shape):
        return -torch.log(-torch.log(torch.rand(*shape, generator=gen, dtype=torch.float64)))

    log_root = table_q(ROOT_LOGITS[None], 1.0, 0, 1.0)[0].log()
    log_next = table_q(NEXT_LOGITS, 1.0, 0, 1.0).log()
    first = (log_root + gumbel(N_DRAWS, VOCAB)).topk(2, dim=1).indices
    children = (log_root[first][..., None] + log_next[first] + gumbel(N_DRAWS, 2, VOCAB)).reshape(N_DRAWS, -1)
    best = children.topk(2, dim=1).indices
    sequences = first.gather(1, best // VOCAB) * VOCAB + best % VOCAB
    return sequences[:, 0] * VOCAB**2 + sequences[:, 1]


STAT_CASES = {  # name: (temperature, top_k, top_p)
    "t1": (1.0, 0, 1.0),
    "t0.7_top_k_2": (0.7, 2, 1.0),
    "t1.3_top_p_0.9": (1.3, 0, 0.9),  # q_next[2] keeps 2 tokens, the others 3
}


@pytest.mark.parametrize("case", list(STAT_CASES))
def test_two_levels_sample_sequences_without_replacement(case):
    temperature, top_k, top_p = STAT_CASES[case]
    pairs = two_levels(temperature, top_k, top_p, seed=300 + list(STAT_CASES).index(case))
    expected = ordered_pair_probs(temperature, top_k, top_p)
    assert expected.max() < 0.27  # the power argument above
    # chisquare_pvalue counts only the possible pairs: impossible ones must not occur at all.
    assert (expected[pairs] > 0).all(), "a pair outside the support of sampling without replacement"
    assert chisquare_pvalue(pairs, expected) > P_VALUE_MIN


class TestStatisticsCanFail:
    @pytest.mark.parametrize("mistake", ["children_scored_below_phi", "phi_dropped", "same_offset"])
    def test_rejects_a_broken_level(self, mistake):
        assert chisquare_pvalue(two_levels(1.0, 0, 1.0, seed=110, mistake=mistake),
                                ordered_pair_probs(1.0, 0, 1.0)) < P_VALUE_MIN

    def test_rejects_untruncated_gumbels(self):
        assert chisquare_pvalue(untruncated_gumbel_pairs(111), ordered_pair_probs(1.0, 0, 1.0)) < P_VALUE_MIN

    def test_rejects_the_pair_in_the_wrong_order(self):
        # The right two sequences, reported lower id first instead of best first.
        pairs = two_levels(1.0, 0, 1.0, seed=112)
        s1, s2 = pairs // VOCAB**2, pairs % VOCAB**2
        swapped = torch.minimum(s1, s2) * VOCAB**2 + torch.maximum(s1, s2)
        assert chisquare_pvalue(swapped, ordered_pair_probs(1.0, 0, 1.0)) < P_VALUE_MIN


# ==== 4. Bad inputs ====

def _valid(device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(90)
    phi = -torch.rand(2, 3, generator=gen)
    return {"logits": torch.randn(2, 3, 5, generator=gen).to(device), "beam_log_probs": phi.to(device),
            "beam_scores": (phi + 0.5).to(device), "beam_width": 2}


def _set(name: str, index: tuple, value):
    def change(d: dict) -> dict:
        d[name] = d[name].clone()
        d[name][index] = value
        return d
    return change


def _with(**changes):
    def change(d: dict) -> dict:
        return {**d, **{name: value(d) if callable(value) else value for name, value in changes.items()}}
    return change


# name: (change to valid inputs, exception, a pattern the C++ and the accelerator messages both match)
BAD = {
    "logits_2d": (_with(logits=lambda d: d["logits"][0]), ValueError, r"logits must be \[B, W, V\]"),
    "logits_int": (_with(logits=lambda d: d["logits"].long()), TypeError, "float32, bfloat16 or float16"),
    "no_beams": (_with(logits=lambda d: d["logits"][:, :0], beam_scores=lambda d: d["beam_scores"][:, :0],
                       beam_log_probs=lambda d: d["beam_log_probs"][:, :0]), ValueError, "needs W >= 1"),
    "beam_width_0": (_with(beam_width=0), ValueError, r"beam_width must be in \[1, 5\], got 0"),
    "beam_width_above_vocab": (_with(beam_width=6), ValueError, r"beam_width must be in \[1, 5\], got 6"),
    "beam_width_bool": (_with(beam_width=True), TypeError, "beam_width must be an int, got bool"),
    "beam_width_float": (_with(beam_width=2.0), TypeError, "beam_width must be an int, got float"),
    "log_probs_shape": (_with(beam_log_probs=lambda d: d["beam_log_probs"][:, :2]), ValueError,
                        r"beam_log_probs and beam_scores must be \[B, W\] float32"),
    "scores_shape": (_with(beam_scores=lambda d: d["beam_scores"][0]), ValueError,
                     r"beam_scores must be \[B, W\]"),
    "log_probs_float64": (_with(beam_log_probs=lambda d: d["beam_log_probs"].double()), ValueError,
                          r"beam_log_probs and beam_scores must be \[B, W\] float32"),
    "scores_bfloat16": (_with(beam_scores=lambda d: d["beam_scores"].bfloat16()), ValueError,
                        r"beam_log_probs and beam_scores must be \[B, W\] float32"),
    "nan_logit_of_live_beam": (_set("logits", (1, 2, 3), NAN), ValueError, r"contains NaN or \+inf"),
    "posinf_logit_of_live_beam": (_set("logits", (0, 1, 0), float("inf")), ValueError,
                                  r"contains NaN or \+inf"),
    "live_beam_without_finite_logit": (_set("logits", (0, 1), NEG_INF), ValueError, "has no finite value"),
    "posinf_score": (_set("beam_scores", (1, 1), float("inf")), ValueError,
                     r"beam_log_probs and beam_scores must not hold NaN or \+inf"),
    "nan_log_prob": (_set("beam_log_probs", (0, 2), NAN), ValueError,
                     r"beam_log_probs and beam_scores must not hold NaN or \+inf"),
    "negative_offset": (_with(offset=-1), ValueError, "offset must be >= 0"),
    "float_offset": (_with(offset=1.0), TypeError, "offset must be an int"),
    "negative_temperature": (_with(temperature=-0.5), ValueError, "temperature.*must be finite and >= 0"),
    "nan_temperature": (_with(temperature=NAN), ValueError, "temperature.*must be finite and >= 0"),
    "top_p_0": (_with(top_p=0.0), ValueError, r"top_p.*must be in \(0, 1\]"),
    "top_p_above_1": (_with(top_p=1.5), ValueError, r"top_p.*must be in \(0, 1\]"),
    "negative_top_k": (_with(top_k=-1), ValueError, "top_k.*must be >= 0"),
    "seed_shape": (_with(seed=torch.tensor([1, 2, 3])), ValueError, r"top_k and seed must be \[B\] int64"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments(device, case):
    change, error, pattern = BAD[case]
    inputs = _valid(device)
    specops.ops.stochastic_beam_step(**inputs)  # the unchanged inputs are fine
    inputs = change(inputs)
    if isinstance(inputs.get("seed"), torch.Tensor):
        inputs["seed"] = inputs["seed"].to(device)
    with pytest.raises(error, match=pattern):
        specops.ops.stochastic_beam_step(**inputs)


def test_dead_beams_may_hold_anything():
    # A dead beam's logits are not read: NaN, +inf or no finite value raise nothing there.
    inputs = _valid()
    inputs["logits"][0, 0], inputs["logits"][0, 1], inputs["logits"][1, 2] = NAN, float("inf"), NEG_INF
    inputs["beam_log_probs"][0, 0] = inputs["beam_scores"][0, 1] = inputs["beam_log_probs"][1, 2] = NEG_INF
    parents, *_ = specops.ops.stochastic_beam_step(**inputs)
    assert parents[0].tolist() == [2, 2]


@pytest.mark.parametrize("name", ["beam_log_probs", "beam_scores", "temperature", "seed"])
def test_inputs_on_another_device_raise(device, name):
    # Without a second real device, "meta" tensors stand in for tensors on the wrong device.
    other = "meta" if device == "cpu" else "cpu"
    inputs = _valid(device)
    if name in ("temperature", "seed"):
        inputs[name] = torch.ones(2, dtype=torch.float32 if name == "temperature" else torch.int64)
    inputs[name] = inputs[name].to(other)
    with pytest.raises(ValueError, match=rf"{name} is on {other} but logits is on {device}"):
        specops.ops.stochastic_beam_step(**inputs)
