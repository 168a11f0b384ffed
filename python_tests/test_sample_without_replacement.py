"""Tests of `specops::sample_without_replacement` (a draft tree's siblings for RSD-C, and their q), in
the four layers of DEVELOPERS.md ("Tests"), plus bad inputs.

1. Exact: greedy rows (the largest logits, ties to the lower index, -inf never taken), point-mass and
   small-support rows (draws past the support are -1), distinct tokens always.
2. Agreement: the C++ kernel, the Triton kernel (interpreted on CPU without a GPU) and the wrapper give
   the reference's tokens for the same seeds, and its q to float32 rounding.
3. Statistics: ordered pairs and triples of draws follow sequential sampling without replacement,
   P(a, b) = q(a) q(b) / (1 - q(a)), at several temperatures and filters (chi-square); and the check
   rejects samplers with replacement and samplers that reorder their draws.
4. `torch.library.opcheck` and `torch.compile`.
5. Bad inputs raise ValueError / TypeError naming the problem.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _triton import IMPLS, KERNELS, TRITON_DEVICE, needs_triton, triton_launcher
from scipy import stats

import specops
from specops import reference

sample_without_replacement_triton = triton_launcher("sample_without_replacement")

NEG_INF = float("-inf")
LOGIT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def per_row(value, rows: int, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    return torch.full((rows,), value, dtype=dtype)


def normalized_args(logits, num_samples, *, temperature=1.0, top_k=0, top_p=1.0, seed=0) -> tuple:
    rows = logits.shape[0]
    if isinstance(seed, int):
        seed = seed + torch.arange(rows, dtype=torch.int64)
    return (logits, num_samples, per_row(temperature, rows, torch.float32), per_row(top_k, rows, torch.int64),
            per_row(top_p, rows, torch.float32), per_row(seed, rows, torch.int64))


def run_impl(impl: str, args: tuple, offset: int = 0, block_v: int | None = None):
    if impl == "reference":
        return reference.sample_without_replacement(*args, offset)
    if impl == "cpp":
        return torch.ops.specops.sample_without_replacement(*args, offset)
    if impl == "triton":
        moved = [a.to(TRITON_DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
        return tuple(t.cpu() for t in sample_without_replacement_triton(*moved, offset, block_v=block_v))
    raise AssertionError(impl)


def assert_agree(result, expected, what: str = "") -> None:
    tokens, probs = result
    assert torch.equal(tokens, expected[0]), f"{what}tokens\n{tokens}\n!= reference\n{expected[0]}"
    assert torch.allclose(probs, expected[1], atol=1e-6, rtol=1e-5), f"{what}probs differ"


# ==== 1. Exact ====

@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_takes_the_largest_logits(impl, dtype):
    logits = torch.tensor([[0.5, 3.0, -1.0, 3.0, 2.0, NEG_INF],
                           [NEG_INF, NEG_INF, 1.0, NEG_INF, 0.0, NEG_INF]]).to(dtype)
    tokens, probs = run_impl(impl, normalized_args(logits, 4, temperature=0.0))
    assert tokens.tolist() == [[1, 3, 4, 0], [2, 4, -1, -1]]
    assert probs.tolist() == [[0, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0]]


@pytest.mark.parametrize("impl", IMPLS)
def test_small_support_pads_with_minus_one(impl):
    # Row 0: one finite logit (a point mass); row 1: top_k = 2 leaves two tokens; row 2: top_p keeps
    # the two most likely. Every row asks for 4 draws.
    logits = torch.tensor([[NEG_INF, 0.3, NEG_INF, NEG_INF, NEG_INF],
                           [0.0, 2.0, 1.0, -1.0, 1.5],
                           [4.0, 0.0, 0.0, 4.1, 0.0]])
    for seed in range(5):
        tokens, probs = run_impl(impl, normalized_args(logits, 4, top_k=torch.tensor([0, 2, 0]),
                                                       top_p=torch.tensor([1.0, 1.0, 0.9]), seed=seed))
        assert tokens[0].tolist() == [1, -1, -1, -1]
        assert sorted(tokens[1, :2].tolist()) == [1, 4] and tokens[1, 2:].tolist() == [-1, -1]
        assert sorted(tokens[2, :2].tolist()) == [0, 3] and tokens[2, 2:].tolist() == [-1, -1]
        assert torch.allclose(probs.sum(-1), torch.ones(3))
        assert probs[0].tolist() == [0, 1, 0, 0, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_draws_are_distinct_and_cover_the_support(impl):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 7, generator=gen)
    tokens, _ = run_impl(impl, normalized_args(logits, 7, seed=3))
    assert (tokens.sort(dim=1).values == torch.arange(7)).all()


# ==== 2. Agreement ====

def random_case(gen: torch.Generator, rows: int, vocab: int, num_samples: int, dtype: torch.dtype) -> tuple:
    logits = 2.0 * torch.randn(rows, vocab, generator=gen)
    logits[1 % rows, : vocab // 2] = NEG_INF
    settings = [(1.0, 0, 1.0), (0.7, 5, 1.0), (0.0, 0, 1.0), (1.3, 0, 0.8), (0.9, 3, 0.9), (1.0, 0, 1.0)]
    return normalized_args(logits.to(dtype), num_samples,
                           temperature=torch.tensor([settings[r % 6][0] for r in range(rows)]),
                           top_k=torch.tensor([settings[r % 6][1] for r in range(rows)]),
                           top_p=torch.tensor([settings[r % 6][2] for r in range(rows)]),
                           seed=int(torch.randint(0, 2**40, (1,), generator=gen)))


@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_cpp_matches_reference(dtype):
    gen = torch.Generator().manual_seed(10 + LOGIT_DTYPES.index(dtype))
    for trial, (vocab, num_samples) in enumerate([(7, 7), (50, 4), (3000, 8), (5000, 1), (2049, 5)]):
        args = random_case(gen, 6, vocab, num_samples, dtype)
        assert_agree(run_impl("cpp", args, trial), run_impl("reference", args, trial), f"V {vocab}: ")


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_triton_matches_reference(dtype):
    gen = torch.Generator().manual_seed(20)
    for trial, (vocab, num_samples, block_v) in enumerate([(7, 7, 4), (50, 4, 16), (300, 6, 64), (200, 2, None)]):
        args = random_case(gen, 6, vocab, num_samples, dtype)
        assert_agree(run_impl("triton", args, trial, block_v), run_impl("reference", args, trial),
                     f"V {vocab}, block_v {block_v}: ")


def test_wrapper_matches_reference(device):
    gen = torch.Generator().manual_seed(30)
    logits, k, temperature, top_k, top_p, seed = random_case(gen, 6, 40, 5, torch.float32)
    got = specops.ops.sample_without_replacement(logits.to(device), k, temperature=temperature.to(device),
                                                 top_k=top_k.to(device), top_p=top_p.to(device),
                                                 seed=seed.to(device), offset=2)
    assert_agree(tuple(t.cpu() for t in got),
                 reference.sample_without_replacement(logits, k, temperature, top_k, top_p, seed, 2))


@pytest.mark.slow
@pytest.mark.parametrize("impl", KERNELS)
def test_offsets_give_other_draws(impl):
    gen = torch.Generator().manual_seed(40)
    args = normalized_args(torch.randn(64, 50, generator=gen), 3, seed=5)
    a, _ = run_impl(impl, args, 0)
    b, _ = run_impl(impl, args, 1)
    assert (a != b).any(1).float().mean() > 0.8


# ==== 3. Statistics ====
#
# N = 200,000 rows per test and at most 120 cells; as in test_chain_verify, a 1% error between two cells
# gives a noncentrality >= 80, detected at level 1e-3 with probability > 0.999 for up to 120 degrees of
# freedom (scipy.stats.ncx2). Seeds are fixed.
N_DRAWS = 200_000
P_VALUE_MIN = 1e-3
VOCAB = 6
LOGITS = torch.tensor([1.5, 0.2, -0.3, 0.9, NEG_INF, 0.0])


def ordered_probs(q: torch.Tensor, k: int) -> dict[tuple[int, ...], float]:
    """P(draws = (x_1..x_k)) under sequential sampling without replacement, float64."""
    q = q.double()
    table = {}
    for draw in itertools.permutations(range(q.numel()), k):
        prob, left = 1.0, 1.0
        for x in draw:
            prob *= float(q[x]) / left if left > 0 else 0.0
            left -= float(q[x])
        if prob > 0:
            table[draw] = prob
    return table


def chisquare_ordered(tokens: torch.Tensor, table: dict) -> float:
    keys = list(table)
    index = {key: i for i, key in enumerate(keys)}
    counts = torch.zeros(len(keys), dtype=torch.float64)
    rows = [tuple(r) for r in tokens.tolist()]
    outside = 0
    for r in rows:
        if r in index:
            counts[index[r]] += 1
        else:
            outside += 1
    assert outside == 0, f"{outside} draws outside the support of sampling without replacement"
    expected = torch.tensor([table[key] for key in keys], dtype=torch.float64)
    expected = expected / expected.sum() * counts.sum()
    return float(stats.chisquare(counts.numpy(), expected.numpy()).pvalue)


def q_of(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    filtered = reference.filter_logits(LOGITS[None], torch.tensor([temperature]), torch.tensor([top_k]),
                                       torch.tensor([top_p]))
    return torch.softmax(filtered.double(), -1)[0]


STAT_CASES = {  # name: (k, temperature, top_k, top_p)
    "pairs": (2, 1.0, 0, 1.0),
    "triples": (3, 1.0, 0, 1.0),
    "pairs_t0.7_top_k_4": (2, 0.7, 4, 1.0),
    "pairs_t1.4_top_p_0.9": (2, 1.4, 0, 0.9),
}


def draw(device: str, k: int, temperature: float, top_k: int, top_p: float, seed_base: int = 0):
    tokens, probs = specops.ops.sample_without_replacement(
        LOGITS.expand(N_DRAWS, VOCAB).to(device), k, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=(torch.arange(N_DRAWS, dtype=torch.int64) + seed_base).to(device), offset=seed_base)
    return tokens.cpu(), probs.cpu()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STAT_CASES))
def test_draws_follow_sampling_without_replacement(device, case):
    k, temperature, top_k, top_p = STAT_CASES[case]
    tokens, probs = draw(device, k, temperature, top_k, top_p, seed_base=list(STAT_CASES).index(case))
    q = q_of(temperature, top_k, top_p)
    assert torch.allclose(probs[0].double(), q, atol=1e-6)
    assert chisquare_ordered(tokens, ordered_probs(q, k)) > P_VALUE_MIN


class TestStatisticsCanFail:
    def test_rejects_sampling_with_replacement(self):
        # i.i.d. draws conditioned on being distinct are not sampling without replacement.
        q = q_of(1.0, 0, 1.0)
        gen = torch.Generator().manual_seed(5)
        tokens = torch.multinomial(q.float().expand(3 * N_DRAWS, VOCAB), 2, replacement=True, generator=gen)
        tokens = tokens[tokens[:, 0] != tokens[:, 1]][:N_DRAWS]
        assert chisquare_ordered(tokens, ordered_probs(q, 2)) < P_VALUE_MIN

    def test_rejects_draws_reported_in_the_wrong_order(self, device):
        # The ordering trap: the right set, sorted by token id instead of draw order.
        tokens, _ = draw(device, 2, 1.0, 0, 1.0, seed_base=6)
        q = q_of(1.0, 0, 1.0)
        assert chisquare_ordered(tokens.sort(dim=1).values, ordered_probs(q, 2)) < P_VALUE_MIN


# ==== 4. opcheck and torch.compile ====

def small_case(device: str = "cpu") -> tuple:
    args = random_case(torch.Generator().manual_seed(50), 6, 12, 3, torch.float32)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def test_opcheck(device):
    torch.library.opcheck(torch.ops.specops.sample_without_replacement.default, small_case(device) + (5,))


def _step(logits, k, temperature, top_k, top_p, seed, offset):
    return specops.ops.sample_without_replacement(logits, k, temperature=temperature, top_k=top_k, top_p=top_p,
                                                  seed=seed, offset=offset)


def test_torch_compile_matches_eager(device):
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True)
    args = small_case(device)
    want = _step(*args, 3)
    got = compiled(*args, 3)
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])


# ==== 5. Bad inputs ====

BAD = [
    (dict(logits=torch.randn(4)), ValueError, r"\[N, V\]"),
    (dict(logits=torch.randn(2, 5).long()), TypeError, "float32"),
    (dict(num_samples=0), ValueError, "num_samples"),
    (dict(num_samples=6), ValueError, "num_samples"),
    (dict(num_samples=2.0), TypeError, "num_samples must be an int, got float"),
    (dict(logits=torch.tensor([[0.0, float("nan"), 1.0, 0.0, 0.0]] * 2)), ValueError, "NaN"),
    (dict(logits=torch.full((2, 5), NEG_INF)), ValueError, "finite"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(offset=-3), ValueError, "offset"),
    (dict(seed=torch.tensor([1, 2, 3])), ValueError, "seed"),
]


@pytest.mark.parametrize("change,error,pattern", BAD)
def test_bad_arguments(change, error, pattern):
    kwargs = dict(logits=torch.randn(2, 5), num_samples=2)
    kwargs.update(change)
    logits, num_samples = kwargs.pop("logits"), kwargs.pop("num_samples")
    with pytest.raises(error, match=pattern):
        specops.ops.sample_without_replacement(logits, num_samples, **kwargs)
