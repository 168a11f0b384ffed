"""Tests of `specops::vocab_project` (a heterogeneous drafter's distribution over the vocabulary
intersection, in target ids, and a draft sampled from it), in layers, plus bad inputs.

1. Exact: hand tables whose answer does not depend on the random numbers (a single mapped id, greedy
   argmax inside the intersection, ties, top-k = 1, tiny top-p, temperature, identity and union maps,
   padded drafter rows), for every backend.
2. Agreement: the C++ CPU kernel, the Triton kernel (interpreted on CPU without a GPU) and the public
   wrapper return exactly the reference's tokens for the same seeds, and its probabilities to 1e-6.
3. Statistics: drafts follow the masked, filtered, renormalized drafter distribution (chi-square),
   zero-probability ids never appear; and the test rejects the distributions of plausible bugs.
4. Bad inputs raise ValueError / TypeError naming the problem; validate=False never crashes.
5. `torch.library.opcheck` and `torch.compile(fullgraph=True)`.

Implementations are named "reference" (specops.reference.vocab_project, the spec), "cpp"
(torch.ops.specops.vocab_project on CPU tensors) and "triton" (vocab_project_triton on the Triton
device), all called with the op's normalized per-row arguments. Batches mix greedy and sampled rows.
"""

from __future__ import annotations

import pytest
import torch
from _triton import IMPLS, KERNELS, TRITON_DEVICE, needs_triton, triton_launcher
from scipy import stats

import specops
from specops import reference

vocab_project_triton = triton_launcher("vocab_project")

NEG_INF = float("-inf")
LOGIT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Small vocabulary tiles for the Triton kernel, so that hand tables with V_d ~ 10 span several tiles
# (cross-tile maximum, first argmax, inverse CDF). The interpreter runs every program in Python (tens
# of ms each, top-k/top-p bisection far more), so Triton cases stay small.
SMALL_BLOCK_V = 4
# Probabilities are float32 softmax values <= 1; backends compute exp and the normalizer in their own
# order (the C++ exp is a polynomial within ~1 ulp), so they differ by a few float32 ulps of 1 (~1e-7).
PROBS_ATOL = 1e-6


# ---- helpers ----

def per_row(value, rows: int, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    return torch.full((rows,), value, dtype=dtype)


def normalized_args(draft_logits, target_ids, target_vocab: int, *, temperature=1.0, top_k=0, top_p=1.0,
                    seed=0) -> tuple:
    """The op's normalized arguments except `offset` ([N] tensors, CPU). An int seed gives row n the
    seed `seed + n`, a readable choice for tests (the public wrapper spreads int seeds differently)."""
    rows = draft_logits.shape[0]
    if isinstance(seed, int):
        seed = seed + torch.arange(rows, dtype=torch.int64)
    return (draft_logits, target_ids, target_vocab, per_row(temperature, rows, torch.float32),
            per_row(top_k, rows, torch.int64), per_row(top_p, rows, torch.float32),
            per_row(seed, rows, torch.int64))


def check_outputs(result, rows: int, target_vocab: int, device) -> None:
    probs, tokens, draft_tokens = result
    assert probs.dtype == torch.float32 and probs.shape == (rows, target_vocab)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    assert draft_tokens.dtype == torch.int64 and draft_tokens.shape == (rows,)
    assert all(t.device.type == torch.device(device).type for t in result)


def run_impl(impl: str, args: tuple, offset: int = 0, *, block_v: int | None = None, validate: bool = True):
    """(probs, tokens, draft_tokens) on CPU from one implementation, given normalized CPU arguments;
    the outputs' dtypes, shapes and device are checked for every call."""
    rows, target_vocab = args[0].shape[0], args[2]
    if impl == "reference":
        result, device = reference.vocab_project(*args, offset), "cpu"
    elif impl == "cpp":
        result, device = torch.ops.specops.vocab_project(*args, offset, validate), "cpu"
    elif impl == "triton":
        moved = [a.to(TRITON_DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
        result = vocab_project_triton(*moved, offset, validate, block_v=block_v)
        device = TRITON_DEVICE
    else:
        raise AssertionError(impl)
    check_outputs(result, rows, target_vocab, device)
    return tuple(t.cpu() for t in result)


def run_wrapper(device: str, args: tuple, offset: int = 0, validate: bool = True):
    """The public wrapper on `device` (CPU: the C++ kernel; CUDA: Triton), normalized CPU arguments."""
    logits, ids, target_vocab, temperature, top_k, top_p, seed = (
        a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    result = specops.ops.vocab_project(logits, ids, target_vocab, temperature=temperature, top_k=top_k,
                                       top_p=top_p, seed=seed, offset=offset, validate=validate)
    check_outputs(result, logits.shape[0], target_vocab, device)
    return tuple(t.cpu() for t in result)


def assert_same(result, expected, what: str = "") -> None:
    """Tokens exactly equal (backends share their random numbers); the same zero pattern of probs
    (test logits stay far from exp underflow, so a zero means unmapped or filtered out); probs to 1e-6."""
    probs, tokens, draft_tokens = result
    exp_probs, exp_tokens, exp_draft_tokens = expected
    assert torch.equal(draft_tokens, exp_draft_tokens), (
        f"{what}draft_tokens {draft_tokens.tolist()} != reference {exp_draft_tokens.tolist()}")
    assert torch.equal(tokens, exp_tokens), (
        f"{what}tokens {tokens.tolist()} != reference {exp_tokens.tolist()}")
    assert torch.equal(probs == 0, exp_probs == 0), f"{what}probs are zero at other target ids"
    torch.testing.assert_close(probs, exp_probs, rtol=0, atol=PROBS_ATOL, msg=lambda m: f"{what}probs: {m}")


def check_distribution(result, target_ids: torch.Tensor) -> None:
    """Every probs row sums to 1, is 0 at every target id outside the map, and the tokens are the
    target ids of the draft tokens, which have positive probability."""
    probs, tokens, draft_tokens = result
    torch.testing.assert_close(probs.double().sum(-1), torch.ones(probs.shape[0], dtype=torch.float64),
                               rtol=0, atol=1e-5)
    outside = torch.ones(probs.shape[1], dtype=torch.bool)
    outside[target_ids[target_ids >= 0]] = False
    assert not probs[:, outside].any()
    assert torch.equal(tokens, target_ids[draft_tokens])
    assert (probs.gather(1, tokens[:, None]) > 0).all()


def random_map(gen: torch.Generator, draft_vocab: int, target_vocab: int,
               mapped_fraction: float) -> torch.Tensor:
    """target_ids [V_d]: a random injective map of about mapped_fraction of the drafter ids (at least one)."""
    mapped = torch.rand(draft_vocab, generator=gen) < mapped_fraction
    mapped[torch.randint(0, draft_vocab, (), generator=gen)] = True
    count = min(int(mapped.sum()), target_vocab)
    positions = torch.nonzero(mapped).flatten()[:count]
    ids = torch.full((draft_vocab,), -1, dtype=torch.int64)
    ids[positions] = torch.randperm(target_vocab, generator=gen)[:count]
    return ids


# ==== 1. Exact: answers that do not depend on the random numbers ====

@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_single_mapped_id_is_always_drafted(impl):
    # Drafter id 5 is the only one in the intersection (as target id 8): whatever the temperature,
    # top-k, top-p or random number, it is the draft, with probability exactly 1 (exp(0) / 1).
    gen = torch.Generator().manual_seed(1)
    logits = 4 * torch.randn(6, 9, generator=gen)
    logits[:, 0] = 20.0  # a far larger logit outside the intersection
    ids = torch.full((9,), -1)
    ids[5] = 8
    args = normalized_args(logits, ids, 12, temperature=torch.tensor([0.0, 1.0, 0.3, 2.5, 1.0, 0.7]),
                           top_k=torch.tensor([0, 0, 1, 3, 0, 2]),
                           top_p=torch.tensor([1.0, 0.5, 1.0, 0.01, 1.0, 0.9]), seed=17)
    for offset in (0, 1, 2**40):
        probs, tokens, draft_tokens = run_impl(impl, args, offset, block_v=SMALL_BLOCK_V)
        assert draft_tokens.tolist() == [5] * 6 and tokens.tolist() == [8] * 6
        assert torch.equal(probs, torch.nn.functional.one_hot(tokens, 12).float())


# The interpreter evaluates overflowing logits / T with numpy, which warns about what these tests are about.
INTERPRETER_OVERFLOW_WARNINGS = ("ignore:overflow encountered:RuntimeWarning",
                                 "ignore:invalid value encountered:RuntimeWarning")
# Target ids in reverse drafter order, so "first in drafter order" and "first in target order" differ.
REVERSED_IDS = torch.tensor([-1, 9, 8, -1, 6, 5, 4, 3, 2, 1])


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_takes_the_first_argmax_inside_the_intersection(impl):
    # With 4-wide Triton tiles the ties sit in different tiles, and a whole tile can be unmapped or -inf.
    logits = torch.tensor([
        [9.0, 1.0, 3.0, 8.0, 0.0, 1.0, 3.0, 2.0, 3.0, 0.0],   # larger logits at unmapped 0, 3; tie 2, 6, 8: 2
        [5.0, NEG_INF, NEG_INF, 7.0, 1.0, 2.0, 0.0, 0.5, 2.0, 2.0],  # tie across tiles at 5, 8, 9: 5
        [0.0, -1.0, -0.0, 3.0, 0.0, -2.0, -3.0, -4.0, -5.0, 0.0],  # -0.0 == 0.0 at 2, 4, 9: 2
        [NEG_INF] * 9 + [-50.0],                                # a single finite logit, at the end: 9
        [1.0] * 10,                                             # all equal: the first mapped id, 1
    ])
    # top-k / top-p are ignored by greedy rows.
    args = normalized_args(logits, REVERSED_IDS, 11, temperature=0.0, top_k=torch.tensor([0, 1, 3, 0, 2]),
                           top_p=torch.tensor([1.0, 0.5, 1.0, 0.1, 1.0]))
    result = run_impl(impl, args, block_v=SMALL_BLOCK_V)
    drafts = [2, 5, 2, 9, 1]
    assert result[2].tolist() == drafts
    assert result[1].tolist() == REVERSED_IDS[drafts].tolist()
    assert torch.equal(result[0], torch.nn.functional.one_hot(result[1], 11).float())


@pytest.mark.slow
@pytest.mark.filterwarnings(*INTERPRETER_OVERFLOW_WARNINGS)
@pytest.mark.parametrize("impl", IMPLS)
def test_sampled_rows_with_one_survivor_draft_the_argmax(impl):
    # top_k = 1, or a top_p below the largest probability, keeps only the argmax of the intersection
    # (logits are distinct there), whose probability is then exactly 1; a logits / T that overflows
    # float32 is the T -> 0 limit, greedy. The largest logit (drafter id 0) is never mapped.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 10, generator=gen)
    logits[:, 0] = 6.0
    args = normalized_args(logits, REVERSED_IDS, 11,
                           temperature=torch.tensor([1.0, 0.5, 2.0, 1.0, 1e-40, 0.7]),
                           top_k=torch.tensor([1, 1, 0, 0, 0, 1]),
                           top_p=torch.tensor([1.0, 0.9, 1e-3, 1e-3, 1.0, 1e-3]), seed=30)
    inside = logits.masked_fill(REVERSED_IDS < 0, NEG_INF)
    for offset in (0, 5):
        probs, tokens, draft_tokens = run_impl(impl, args, offset, block_v=SMALL_BLOCK_V)
        assert draft_tokens.tolist() == inside.argmax(-1).tolist()
        assert torch.equal(probs, torch.nn.functional.one_hot(tokens, 11).float())


@pytest.mark.filterwarnings(*INTERPRETER_OVERFLOW_WARNINGS)
@pytest.mark.parametrize("impl", IMPLS)
def test_overflowing_temperature_takes_the_largest_logit(impl):
    # Several mapped logits overflow to +inf at T = 0.5; the first of them (drafter id 1) is not the
    # largest (drafter id 2). Drafter id 0 is larger still, but unmapped.
    logits = torch.tensor([[3.3e38, 2e38, 3e38, 1.0, -1.0], [0.0, 1.0, 2.5e38, 3e38, 0.0]])
    ids = torch.tensor([-1, 4, 0, 2, 1])
    args = normalized_args(logits, ids, 5, temperature=0.5, top_p=0.9)
    probs, tokens, draft_tokens = run_impl(impl, args, block_v=SMALL_BLOCK_V)
    assert draft_tokens.tolist() == [2, 3] and tokens.tolist() == [0, 2]
    assert torch.equal(probs, torch.nn.functional.one_hot(tokens, 5).float())


def softmax_in_target_ids(logits: torch.Tensor, target_ids: torch.Tensor, target_vocab: int,
                          temperature: float) -> torch.Tensor:
    """The expected probs, written independently of the reference: softmax over the mapped logits / T
    in float64, placed at their target ids."""
    mapped = target_ids >= 0
    w = torch.softmax(logits[:, mapped].double() / temperature, dim=-1)
    out = torch.zeros(logits.shape[0], target_vocab, dtype=torch.float64)
    out[:, target_ids[mapped]] = w
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_softmax_over_the_intersection(impl, temperature):
    gen = torch.Generator().manual_seed(4)
    logits = 2 * torch.randn(3, 10, generator=gen)
    args = normalized_args(logits, REVERSED_IDS, 12, temperature=temperature, seed=40)
    result = run_impl(impl, args, block_v=SMALL_BLOCK_V)
    check_distribution(result, REVERSED_IDS)
    expected = softmax_in_target_ids(logits, REVERSED_IDS, 12, temperature)
    torch.testing.assert_close(result[0].double(), expected, rtol=0, atol=PROBS_ATOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_identity_map_is_the_plain_softmax(impl):
    gen = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(4, 13, generator=gen)
    ids = torch.arange(13)
    args = normalized_args(logits, ids, 13, temperature=0.8, seed=50)
    probs, tokens, draft_tokens = run_impl(impl, args, 3)
    torch.testing.assert_close(probs, torch.softmax(logits / 0.8, -1), rtol=0, atol=PROBS_ATOL)
    assert torch.equal(tokens, draft_tokens)


@pytest.mark.parametrize("impl", IMPLS)
def test_union_map_keeps_the_whole_drafter_distribution(impl):
    # Every drafter id mapped (paper 000 Alg 1), into a wider target vocabulary: q is the drafter's
    # unrestricted distribution, at permuted ids, with the target-only ids at 0.
    gen = torch.Generator().manual_seed(6)
    logits = 3 * torch.randn(5, 11, generator=gen)
    ids = torch.randperm(16, generator=gen)[:11]
    args = normalized_args(logits, ids, 16, temperature=torch.tensor([1.0, 0.0, 1.5, 1.0, 0.7]), seed=60)
    result = run_impl(impl, args, 2, block_v=SMALL_BLOCK_V)
    check_distribution(result, ids)
    sampled = torch.tensor([0, 2, 3, 4])
    scaled = logits[sampled] / torch.tensor([1.0, 1.5, 1.0, 0.7])[:, None]
    expected = softmax_in_target_ids(scaled, ids, 16, 1.0)
    torch.testing.assert_close(result[0][sampled].double(), expected, rtol=0, atol=PROBS_ATOL)
    assert result[2][1] == logits[1].argmax()


@pytest.mark.parametrize("impl", IMPLS)
def test_padded_drafter_columns_change_nothing(impl):
    # A drafter's logits often have more columns than its tokenizer has tokens; they map to -1. Even with
    # huge logits there, the result (draws included: the inverse CDF runs in drafter-id order and the
    # padding comes last) equals that of the unpadded logits.
    gen = torch.Generator().manual_seed(7)
    logits = 2 * torch.randn(6, 12, generator=gen)
    ids = random_map(gen, 12, 20, 0.7)
    padded = torch.cat([logits, torch.full((6, 4), 30.0)], dim=1)
    padded_ids = torch.cat([ids, torch.full((4,), -1)])
    options = {"temperature": torch.tensor([1.0, 0.0, 0.6, 1.0, 1.3, 1.0]),
               "top_k": torch.tensor([0, 0, 3, 0, 0, 2]),
               "top_p": torch.tensor([1.0, 1.0, 1.0, 0.7, 1.0, 1.0]), "seed": 70}
    result = run_impl(impl, normalized_args(padded, padded_ids, 20, **options), 9, block_v=SMALL_BLOCK_V)
    assert_same(result, run_impl(impl, normalized_args(logits, ids, 20, **options), 9, block_v=SMALL_BLOCK_V))
    check_distribution(result, ids)


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_do_not_depend_on_the_batch(impl):
    # A row's result depends only on its own inputs and seed: the same rows in another batch (reordered,
    # fewer neighbours) give the same probs and tokens.
    gen = torch.Generator().manual_seed(8)
    args = random_case(gen, 6, 40, 50, torch.float32, filtered=False)
    full = run_impl(impl, args, 2)
    rows = torch.tensor([4, 1, 5])
    subset = (args[0][rows], args[1], args[2]) + tuple(a[rows] for a in args[3:])
    assert_same(run_impl(impl, subset, 2), tuple(t[rows] for t in full))


@pytest.mark.parametrize("impl", ["reference", "cpp"])
def test_offsets_give_different_draws(impl):
    # Uniform over 64 mapped ids: two independent draws of a row agree with probability 1/64, so of 32
    # rows about 0.5 agree; requiring at least 24 to differ leaves a wide margin. (Triton's Philox
    # counters, high offset word included, are covered by its exact agreement with the reference.)
    ids = torch.full((80,), -1)
    ids[8:72] = torch.arange(64) * 3
    args = normalized_args(torch.zeros(32, 80), ids, 200, seed=123)
    draws = {offset: run_impl(impl, args, offset)[2] for offset in (0, 1, 2**32, 2**63 - 1)}
    assert torch.equal(run_impl(impl, args, 1)[2], draws[1])  # same offset, same draw
    values = list(draws.values())
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            assert int((values[i] != values[j]).sum()) >= 24


# ==== 2. Agreement with the reference, same seeds ====

def random_case(gen: torch.Generator, rows: int, draft_vocab: int, target_vocab: int, dtype: torch.dtype,
                mapped_fraction: float = 0.6, filtered: bool = True) -> tuple:
    """A batch with everything mixed: greedy and sampled rows, top-k/top-p on and off per row (with
    `filtered`), -inf logits (at least one finite mapped logit per row), random 64-bit seeds."""
    ids = random_map(gen, draft_vocab, target_vocab, mapped_fraction)
    logits = 3 * torch.randn(rows, draft_vocab, generator=gen)
    logits = logits.masked_fill(torch.rand(rows, draft_vocab, generator=gen) < 0.15, NEG_INF)
    keep = torch.nonzero(ids >= 0).flatten()
    logits[:, keep[torch.randint(0, keep.numel(), (), generator=gen)]] = 1.0
    n_mapped = keep.numel()

    def pick(options):  # a random option per row
        return torch.tensor(options)[torch.randint(0, len(options), (rows,), generator=gen)]

    return normalized_args(
        logits.to(dtype), ids, target_vocab, temperature=pick([0.0, 1.0, 0.6, 1.7]),
        top_k=pick([0, 1, 3, n_mapped, draft_vocab + 5] if filtered else [0]),
        top_p=pick([1.0, 0.9, 0.5, 0.05] if filtered else [1.0]),
        seed=torch.randint(-2**63, 2**63 - 1, (rows,), generator=gen))


OFFSETS = [0, 7, 2**32 + 3, 2**63 - 1]  # high offset word included


@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_cpp_matches_reference(dtype):
    # (N, V_d, V_t): 5000 drafter ids map ~3000 ids, more than one 2048-id chunk of the inverse CDF;
    # V_t = 70000 spans many 4096-id output windows; V_d = 1 has a single id; N = 16 a bigger batch.
    gen = torch.Generator().manual_seed(100 + LOGIT_DTYPES.index(dtype))
    shapes = [(6, 7, 10), (5, 300, 1000), (4, 5000, 8000), (3, 1, 1), (16, 64, 100), (2, 900, 70000)]
    for i, (rows, draft_vocab, target_vocab) in enumerate(shapes):
        args = random_case(gen, rows, draft_vocab, target_vocab, dtype)
        offset = OFFSETS[i % len(OFFSETS)]
        result = run_impl("cpp", args, offset)
        assert_same(result, run_impl("reference", args, offset), f"case {i}: ")
        check_distribution(result, args[1])


@needs_triton
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_triton_matches_reference(dtype):
    # One vocabulary tile: the interpreter is slow. The multi-tile case follows.
    gen = torch.Generator().manual_seed(200 + LOGIT_DTYPES.index(dtype))
    for i, (rows, draft_vocab, target_vocab) in enumerate([(5, 40, 60), (2, 1, 1)]):
        args = random_case(gen, rows, draft_vocab, target_vocab, dtype)
        offset = OFFSETS[(i + LOGIT_DTYPES.index(dtype)) % len(OFFSETS)]
        assert_same(run_impl("triton", args, offset), run_impl("reference", args, offset), f"case {i}: ")


@needs_triton
def test_triton_matches_reference_across_tiles():
    # block_v = 32 splits V_d = 100 into 4 tiles (the last one partial): per-tile maxima and sums, top-k /
    # top-p bisection over tiles, and the two-level inverse CDF; one tile wholly unmapped.
    gen = torch.Generator().manual_seed(250)
    args = random_case(gen, 4, 100, 150, torch.float32, filtered=False)
    ids = args[1].clone()
    ids[32:64] = -1
    args = (args[0], ids) + args[2:]
    args[5][1] = 0.8  # one row with top-p across tiles
    assert_same(run_impl("triton", args, 2**32 + 9, block_v=32), run_impl("reference", args, 2**32 + 9))


def test_wrapper_matches_reference(device):
    gen = torch.Generator().manual_seed(400)
    for i, dtype in enumerate(LOGIT_DTYPES):
        args = random_case(gen, 6, 64, 90, dtype)
        assert_same(run_wrapper(device, args, OFFSETS[i]), run_impl("reference", args, OFFSETS[i]),
                    f"{dtype}: ")


def test_wrapper_scalars_and_int_seed(device):
    # Scalars broadcast to every row; an int seed s gives row n the seed s + n * 0x9E3779B97F4A7C15
    # (mod 2**64), as documented.
    gen = torch.Generator().manual_seed(450)
    logits = torch.randn(5, 20, generator=gen)
    ids = random_map(gen, 20, 30, 0.7)
    seed = 2**63 - 5  # wraps around 2**64 for later rows
    out = specops.ops.vocab_project(logits.to(device), ids.to(device), 30, temperature=0.8, top_k=7,
                                    top_p=0.9, seed=seed, offset=4)
    row_seeds = [(seed + n * 0x9E3779B97F4A7C15) % 2**64 for n in range(5)]
    row_seeds = torch.tensor([s - 2**64 if s >= 2**63 else s for s in row_seeds])
    expected = run_impl("reference", normalized_args(logits, ids, 30, temperature=0.8, top_k=7, top_p=0.9,
                                                     seed=row_seeds), 4)
    assert_same(tuple(t.cpu() for t in out), expected)


def test_validate_false_gives_the_same_result():
    gen = torch.Generator().manual_seed(460)
    args = random_case(gen, 8, 3000, 5000, torch.float32)
    assert_same(run_impl("cpp", args, 5, validate=False), run_impl("cpp", args, 5))


def every_other(x: torch.Tensor, gap) -> torch.Tensor:
    """The values of x in a non-contiguous view (last-dim stride 2) of a buffer twice as long whose
    gaps hold `gap`. A kernel that ignores the stride reads gaps, yet stays inside the buffer."""
    buffer = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    buffer[..., ::2] = x
    buffer[..., 1::2] = gap
    return buffer[..., ::2]


# Gap values that change the answer if read: huge logits, other ids, greedy, top_k = 1, other seeds.
STRIDED_GAPS = {"draft_logits": 50.0, "target_ids": 0, "temperature": 0.0, "top_k": 1, "top_p": 0.01,
                "seed": 99}
ARG_INDEX = {"draft_logits": 0, "target_ids": 1, "temperature": 3, "top_k": 4, "top_p": 5, "seed": 6}


@pytest.mark.parametrize("which", list(STRIDED_GAPS))
@pytest.mark.parametrize("impl", KERNELS)
def test_op_accepts_non_contiguous_inputs(impl, which):
    # The op itself, not only the wrapper (which makes inputs contiguous), must honour strides.
    gen = torch.Generator().manual_seed(470)
    args = random_case(gen, 3, 12, 16, torch.float32, filtered=False)
    strided = list(args)
    strided[ARG_INDEX[which]] = every_other(args[ARG_INDEX[which]], STRIDED_GAPS[which])
    assert not strided[ARG_INDEX[which]].is_contiguous()
    assert_same(run_impl(impl, tuple(strided), 1), run_impl("reference", args, 1))


# ==== 3. Statistics ====
#
# N = 200,000 draws (rows with distinct seeds). A 1% absolute error moving mass between two ids of
# probabilities a + b <= 1 gives the chi-square statistic a noncentrality of N * 0.01**2 * (1/a + 1/b)
# >= 4e-4 * N = 80, which the test at level 1e-3 detects with probability > 0.99998 for up to 9 degrees
# of freedom (scipy.stats.ncx2). For a correct sampler the p-value is uniform, so a fixed seed fails
# with probability 1e-3; the seeds below are fixed, so every run computes the same p-values.
N_DRAWS = 200_000
P_VALUE_MIN = 1e-3

# Drafter id 0 (the largest logit) and 5, 7 are outside the intersection; drafter id 10 is mapped
# (target id 2) but -inf; target ids 5, 6, 8, 10, 11, 13 are not in the map.
STAT_LOGITS = torch.tensor([3.0, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.2, -2.0, NEG_INF, 1.2])
STAT_IDS = torch.tensor([-1, 4, 7, 0, 12, -1, 3, -1, 9, 15, 2, 14])
STAT_TARGET_VOCAB = 16
# (temperature, top_k, top_p): plain, top-p, top-k with temperature.
STAT_SETTINGS = [(1.0, 0, 1.0), (0.8, 0, 0.8), (1.3, 4, 1.0)]


def spec_probs(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The exact q [target_vocab] (float64): mask to the intersection, then filter, then softmax."""
    ids = STAT_IDS
    masked = torch.where(ids >= 0, STAT_LOGITS, NEG_INF)
    filtered = reference.filter_logits(masked[None], torch.tensor([temperature]), torch.tensor([top_k]),
                                       torch.tensor([top_p]))[0]
    w = torch.softmax(filtered.double(), -1)
    out = torch.zeros(STAT_TARGET_VOCAB, dtype=torch.float64)
    out[ids[ids >= 0]] = w[ids >= 0]
    return out


def filter_then_mask_probs(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """A plausible bug's q: top-k/top-p over the whole drafter vocabulary, then restricted to the
    intersection and renormalized."""
    filtered = reference.filter_logits(STAT_LOGITS[None], torch.tensor([temperature]), torch.tensor([top_k]),
                                       torch.tensor([top_p]))[0]
    w = torch.softmax(filtered.double(), -1).masked_fill(STAT_IDS < 0, 0.0)
    out = torch.zeros(STAT_TARGET_VOCAB, dtype=torch.float64)
    out[STAT_IDS[STAT_IDS >= 0]] = w[STAT_IDS >= 0] / w.sum()
    return out


def chisquare_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of `tokens` to `probs` over the ids with positive probability."""
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    support = probs > 0
    expected = probs[support] / probs[support].sum() * counts[support].sum()
    return float(stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue)


def draw(impl_or_device: str, n: int, setting, offset: int = 3, wrapper: bool = False):
    """n drafts of the STAT row, one per row, row seeds 1000 + row."""
    temperature, top_k, top_p = setting
    args = normalized_args(STAT_LOGITS.expand(n, -1).contiguous(), STAT_IDS, STAT_TARGET_VOCAB,
                           temperature=temperature, top_k=top_k, top_p=top_p, seed=1000)
    if wrapper:
        return run_wrapper(impl_or_device, args, offset)
    return run_impl(impl_or_device, args, offset)


def check_draws(result, setting) -> None:
    probs, tokens, draft_tokens = result
    q = spec_probs(*setting)
    torch.testing.assert_close(probs[0].double(), q, rtol=0, atol=PROBS_ATOL)
    assert torch.equal(tokens, STAT_IDS[draft_tokens])
    assert (q[tokens] > 0).all(), "a zero-probability id was drafted"
    assert chisquare_pvalue(tokens, q) > P_VALUE_MIN


@pytest.mark.parametrize("setting", STAT_SETTINGS, ids=["plain", "top_p", "top_k"])
def test_draft_statistics(device, setting):
    # The public wrapper: the C++ kernel on CPU, Triton on CUDA.
    check_draws(draw(device, N_DRAWS, setting, wrapper=True), setting)


@pytest.mark.slow
@needs_triton
def test_triton_draft_statistics():
    # In the interpreter (tens of ms a row) only a few draws: this catches gross errors and any
    # zero-probability draft; on a GPU the full count. The exact agreement above carries the rest.
    n = N_DRAWS if torch.cuda.is_available() else 300
    check_draws(draw("triton", n, STAT_SETTINGS[0]), STAT_SETTINGS[0])


class TestStatisticsCanFail:
    """The chi-square check above rejects the distributions of plausible bugs on the same draws."""

    def test_rejects_filtering_before_masking(self):
        # top-p over the whole drafter vocabulary (where unmapped id 0 holds much of the mass) keeps
        # fewer ids than top-p over the intersection: the draws include ids that q gives 0.
        setting = STAT_SETTINGS[1]
        wrong = filter_then_mask_probs(*setting)
        assert (spec_probs(*setting) > 0).sum() > (wrong > 0).sum()
        tokens = draw("cpp", N_DRAWS, setting)[1]
        assert (wrong[tokens] == 0).any()

    def test_rejects_ignoring_the_temperature(self):
        # Same support (the top 4 of the intersection), other probabilities: T = 1 instead of 1.3.
        temperature, top_k, top_p = STAT_SETTINGS[2]
        wrong = spec_probs(1.0, top_k, top_p)
        assert torch.equal(wrong > 0, spec_probs(temperature, top_k, top_p) > 0)
        tokens = draw("cpp", N_DRAWS, STAT_SETTINGS[2])[1]
        assert chisquare_pvalue(tokens, wrong) < P_VALUE_MIN

    def test_rejects_the_unrenormalized_distribution(self):
        # A drafter that samples its full distribution and, on an id outside the intersection, drafts
        # the intersection's argmax: q without renormalization, the missing mass on one id.
        setting = STAT_SETTINGS[0]
        full = torch.softmax(STAT_LOGITS.double(), -1)
        wrong = torch.zeros(STAT_TARGET_VOCAB, dtype=torch.float64)
        wrong[STAT_IDS[STAT_IDS >= 0]] = full[STAT_IDS >= 0]
        wrong[STAT_IDS[STAT_LOGITS.masked_fill(STAT_IDS < 0, NEG_INF).argmax()]] += full[STAT_IDS < 0].sum()
        gen = torch.Generator().manual_seed(9)
        tokens = torch.multinomial(wrong, N_DRAWS, replacement=True, generator=gen)
        assert chisquare_pvalue(tokens, spec_probs(*setting)) < P_VALUE_MIN

    def test_rejects_a_one_percent_error(self):
        # Move 0.01 of probability between the two most likely ids: the hardest 1% error to see.
        p = spec_probs(*STAT_SETTINGS[0])
        top = p.argsort(descending=True)
        wrong = p.clone()
        wrong[top[0]] -= 0.01
        wrong[top[1]] += 0.01
        gen = torch.Generator().manual_seed(9)
        tokens = torch.multinomial(wrong, N_DRAWS, replacement=True, generator=gen)
        assert chisquare_pvalue(tokens, p) < P_VALUE_MIN
        # And the same sampler, unperturbed, passes with this seed: the rejection is the error's doing.
        gen = torch.Generator().manual_seed(9)
        tokens = torch.multinomial(p, N_DRAWS, replacement=True, generator=gen)
        assert chisquare_pvalue(tokens, p) > P_VALUE_MIN


# ==== 4. Bad inputs ====

def _valid_inputs(device: str) -> dict:
    gen = torch.Generator().manual_seed(800)
    return {
        "draft_logits": torch.randn(3, 7, generator=gen).to(device),
        "target_ids": torch.tensor([3, -1, 0, 5, -1, 9, 1], device=device), "target_vocab": 10,
        "temperature": torch.tensor([1.0, 0.0, 0.5], device=device), "top_k": 0, "top_p": 1.0, "seed": 1,
        "offset": 0}


def _with(name: str, make):
    """A change to the valid inputs: input `name` becomes make(inputs)."""
    def change(inputs):
        inputs[name] = make(inputs)
    return change


def _logit_set(index, value):
    def make(inputs):
        logits = inputs["draft_logits"].clone()
        logits[index] = value
        return logits
    return make


def _id_set(index, value):
    def make(inputs):
        ids = inputs["target_ids"].clone()
        ids[index] = value
        return ids
    return make


def _row_tensor(values):
    return lambda inputs: torch.tensor(values, device=inputs["draft_logits"].device)


NAN_OR_INF = r"draft_logits.*NaN or \+inf"
ID_RANGE = r"target_ids.*must be -1 or in \[0, 10\)"
TARGET_VOCAB_INT = r"target_vocab must be an int >= 1"
# Values inside the tensors: the op checks them (the C++ kernel on CPU, its contract before the Triton kernel on
# accelerators). Patterns match both messages.
BAD_VALUES = {
    "nan_mapped_logit": (_with("draft_logits", _logit_set((1, 0), float("nan"))), NAN_OR_INF),
    "nan_unmapped_logit": (_with("draft_logits", _logit_set((2, 1), float("nan"))), NAN_OR_INF),
    "plus_inf_logit": (_with("draft_logits", _logit_set((0, 5), float("inf"))), NAN_OR_INF),
    "no_finite_mapped_logit": (_with("draft_logits", _logit_set((2, [0, 2, 3, 5, 6]), NEG_INF)),
                               r"no finite logit inside the intersection"),
    "id_below_minus_one": (_with("target_ids", _id_set(1, -2)), ID_RANGE),
    "id_equal_to_target_vocab": (_with("target_ids", _id_set(0, 10)), ID_RANGE),
    "repeated_target_id": (_with("target_ids", _id_set(6, 5)),
                           r"target_ids maps two drafter ids to the same target id"),
    "negative_temperature": (_with("temperature", lambda i: -0.5), r"temperature.*must be finite and >= 0"),
    "inf_temperature_row": (_with("temperature", _row_tensor([1.0, float("inf"), 0.0])),
                            r"temperature.*must be finite and >= 0"),
    "nan_temperature_row": (_with("temperature", _row_tensor([1.0, 0.0, float("nan")])),
                            r"temperature.*must be finite and >= 0"),
    "negative_top_k": (_with("top_k", lambda i: -1), r"top_k.*must be >= 0"),
    "top_p_zero": (_with("top_p", lambda i: 0.0), r"top_p.*must be in \(0, 1\]"),
    "top_p_above_one_row": (_with("top_p", _row_tensor([1.0, 1.5, 0.5])), r"top_p.*must be in \(0, 1\]"),
}
# Shapes, types and scalars: the op checks them (the C++ kernel on CPU, its contract elsewhere); the wrapper itself
# refuses only an argument of the wrong kind (a non-tensor, a non-int) and an int that int64 cannot hold.
BAD_ARGUMENTS = {
    "logits_rank": (_with("draft_logits", lambda i: i["draft_logits"][0]), ValueError,
                    r"draft_logits must be an \[N, V_d\] tensor"),
    "int_logits": (_with("draft_logits", lambda i: i["draft_logits"].long()), TypeError,
                   r"draft_logits must be float32, bfloat16 or float16"),
    "float64_logits": (_with("draft_logits", lambda i: i["draft_logits"].double()), TypeError,
                       r"draft_logits must be float32, bfloat16 or float16"),
    "no_columns": (lambda i: i.update(draft_logits=i["draft_logits"][:, :0], target_ids=i["target_ids"][:0]),
                   ValueError, r"draft_logits has no columns"),
    "ids_length": (_with("target_ids", lambda i: i["target_ids"][:5]), ValueError,
                   r"target_ids must be \[V_d\] = \[7\] to match draft_logits"),
    "ids_not_a_tensor": (_with("target_ids", lambda i: i["target_ids"].tolist()), TypeError,
                         r"target_ids must be a tensor, got list"),
    "int32_ids": (_with("target_ids", lambda i: i["target_ids"].int()), TypeError,
                  r"target_ids must be int64"),
    "target_vocab_zero": (_with("target_vocab", lambda i: 0), ValueError, TARGET_VOCAB_INT),
    "target_vocab_float": (_with("target_vocab", lambda i: 10.0), TypeError, r"target_vocab must be an int, got float"),
    "target_vocab_bool": (_with("target_vocab", lambda i: True), TypeError, r"target_vocab must be an int, got bool"),
    "negative_offset": (_with("offset", lambda i: -1), ValueError, r"offset must be >= 0"),
    "huge_offset": (_with("offset", lambda i: 2**63), ValueError, r"offset must fit int64, got 9223372036854775808"),
    "float_offset": (_with("offset", lambda i: 1.0), TypeError, r"offset must be an int, got float"),
    "temperature_shape": (_with("temperature", _row_tensor([1.0, 0.5])), ValueError,
                          r"temperature and top_p must be \[N\] float32"),
    "float_top_k_tensor": (_with("top_k", _row_tensor([1.0, 2.0, 3.0])), ValueError,
                           r"top_k and seed must be \[N\] int64"),
    "fractional_top_k": (_with("top_k", lambda i: 2.5), TypeError, r"top_k must be an integer, got 2.5"),
    "string_top_p": (_with("top_p", lambda i: "0.9"), TypeError,
                     r"top_p must be a number or a tensor, got str"),
    "bool_seed": (_with("seed", lambda i: True), TypeError, r"seed must be a number or a tensor, got bool"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_raise(device, case):
    change, pattern = BAD_VALUES[case]
    inputs = _valid_inputs(device)
    specops.ops.vocab_project(**inputs)  # the unchanged inputs are fine
    change(inputs)
    with pytest.raises(ValueError, match=r"^vocab_project: .*" + pattern):
        specops.ops.vocab_project(**inputs)


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_accelerator_value_check_messages(case):
    # The op's contract is what accelerators run before the Triton kernel; here on CPU tensors, so that its
    # messages are tested on a machine without a GPU too.
    change, pattern = BAD_VALUES[case]
    inputs = _valid_inputs("cpu")
    change(inputs)
    args = normalized_args(inputs["draft_logits"], inputs["target_ids"], inputs["target_vocab"],
                           temperature=inputs["temperature"], top_k=inputs["top_k"], top_p=inputs["top_p"])
    with pytest.raises(ValueError, match=r"^vocab_project: .*" + pattern):
        specops.ops.CONTRACTS["vocab_project"](*args, 0)


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_raise(device, case):
    change, error, pattern = BAD_ARGUMENTS[case]
    inputs = _valid_inputs(device)
    change(inputs)
    with pytest.raises(error, match=pattern):
        specops.ops.vocab_project(**inputs)


@pytest.mark.parametrize("name", ["target_ids", "temperature", "top_p", "seed"])
def test_inputs_on_another_device_raise(device, name):
    # Without a second real device, "meta" tensors stand in for tensors on the wrong device.
    other = "meta" if device == "cpu" else "cpu"
    inputs = _valid_inputs(device)
    inputs[name] = inputs[name].to(other) if isinstance(inputs[name], torch.Tensor) else torch.tensor(
        [inputs[name]] * 3, device=other)
    message = rf"^vocab_project: {name} is on {other} but draft_logits is on {device}"
    with pytest.raises(ValueError, match=message):
        specops.ops.vocab_project(**inputs)


def _op_args(**changes) -> list:
    inputs = _valid_inputs("cpu")
    args = list(normalized_args(inputs["draft_logits"], inputs["target_ids"], 10,
                                temperature=inputs["temperature"]))
    names = ["draft_logits", "target_ids", "target_vocab", "temperature", "top_k", "top_p", "seed"]
    for name, value in changes.items():
        args[names.index(name)] = value
    return args


# The op called directly (as torch.compile or another package would), without the wrapper.
DIRECT_OP_CASES = {
    "logits_rank": ({"draft_logits": torch.zeros(2, 3, 7)}, r"draft_logits must be an \[N, V_d\] tensor"),
    "int_logits": ({"draft_logits": torch.zeros(3, 7, dtype=torch.int64)},
                   r"draft_logits must be float32, bfloat16 or float16"),
    "no_columns": ({"draft_logits": torch.zeros(3, 0), "target_ids": torch.zeros(0, dtype=torch.int64)},
                   r"draft_logits has no columns"),
    "ids_length": ({"target_ids": torch.zeros(5, dtype=torch.int64)}, r"target_ids must be \[V_d\] = \[7\]"),
    "int32_ids": ({"target_ids": torch.zeros(7, dtype=torch.int32)}, r"target_ids must be int64"),
    "target_vocab_zero": ({"target_vocab": 0}, r"target_vocab must be an int >= 1"),
    "target_vocab_2_31": ({"target_vocab": 2**31},
                          r"vocabularies of 2\*\*31 tokens or more are not supported"),
    "int32_top_k": ({"top_k": torch.zeros(3, dtype=torch.int32)}, r"top_k and seed must be \[N\] int64"),
    "seed_length": ({"seed": torch.zeros(2, dtype=torch.int64)}, r"top_k and seed must be \[N\] int64"),
    "float64_temperature": ({"temperature": torch.ones(3, dtype=torch.float64)},
                            r"temperature and top_p must be \[N\] float32"),
}


@pytest.mark.parametrize("case", list(DIRECT_OP_CASES))
def test_cpp_op_rejects_bad_arguments(case):
    changes, pattern = DIRECT_OP_CASES[case]
    with pytest.raises((ValueError, TypeError), match=r"^vocab_project: " + pattern):
        torch.ops.specops.vocab_project(*_op_args(**changes), 0, True)


def test_cpp_op_rejects_a_negative_offset():
    torch.ops.specops.vocab_project(*_op_args(), 0, True)
    with pytest.raises(ValueError, match=r"^vocab_project: offset must be >= 0"):
        torch.ops.specops.vocab_project(*_op_args(), -1, True)


def _bad_ids_case() -> tuple:
    """Valid logits with every kind of bad id: below -1, at and far above target_vocab, repeated."""
    gen = torch.Generator().manual_seed(900)
    ids = torch.tensor([3, -7, 0, 10, 2**40, 9, 3, -1, 4, 4])
    return normalized_args(torch.randn(4, 10, generator=gen), ids, 10,
                           temperature=torch.tensor([1.0, 0.0, 0.5, 1.0]),
                           top_p=torch.tensor([1.0, 1.0, 1.0, 0.6]))


@pytest.mark.parametrize("impl", KERNELS)
def test_bad_ids_without_validation_do_not_crash(impl):
    # Ids outside [0, target_vocab) count as unmapped; repeated ones give unspecified (in-range) results:
    # both weights go to one column, so a probs row no longer sums to 1.
    args = _bad_ids_case()
    probs, tokens, draft_tokens = run_impl(impl, args, validate=False)
    assert ((tokens >= 0) & (tokens < 10)).all()
    assert all(int(args[1][d]) in (3, 0, 9, 4) for d in draft_tokens)
    assert ((probs >= 0) & (probs <= 1)).all()
    with pytest.raises(ValueError, match=r"target_ids\[1\] = -7 must be -1 or in \[0, 10\)"):
        run_impl("cpp", args)
    ids = args[1].clone()
    ids[1], ids[3], ids[4] = -1, -1, -1
    with pytest.raises(ValueError, match=r"same target id \(drafter ids 0 and 6 to target id 3\)"):
        run_impl("cpp", (args[0], ids) + args[2:])


def test_cpp_without_validation_checks_only_the_logits_it_reads():
    # validate=False skips the unmapped logits and the ids; the mapped logits of every row are still
    # checked (the row passes need ordered values), and a row with nothing finite there raises.
    inputs = _valid_inputs("cpu")
    args = normalized_args(inputs["draft_logits"], inputs["target_ids"], 10,
                           temperature=inputs["temperature"])
    logits = args[0].clone()
    logits[1, 4] = float("nan")  # drafter id 4 is unmapped
    checked = run_impl("cpp", args)
    assert_same(run_impl("cpp", (logits,) + args[1:], validate=False), checked)
    with pytest.raises(ValueError, match=r"draft_logits\[1\] contains NaN"):
        run_impl("cpp", (logits,) + args[1:])
    logits[2, 6] = float("inf")  # drafter id 6 is mapped
    with pytest.raises(ValueError, match=r"draft_logits\[2\] contains NaN or \+inf"):
        run_impl("cpp", (logits,) + args[1:], validate=False)
    logits = args[0].clone()
    logits[0, inputs["target_ids"] >= 0] = NEG_INF
    with pytest.raises(ValueError, match=r"draft_logits\[0\] has no finite logit inside the intersection"):
        run_impl("cpp", (logits,) + args[1:], validate=False)


@needs_triton
def test_triton_without_validation_never_reads_out_of_bounds():
    # NaN / +inf mapped logits and rows with no finite mapped logit give unspecified values, but every
    # token is -1 or a valid id, and a row with nothing finite gives -1 and a zero probs row.
    inputs = _valid_inputs("cpu")
    args = normalized_args(inputs["draft_logits"], inputs["target_ids"], 10,
                           temperature=inputs["temperature"])
    logits = args[0].clone()
    logits[0, 0] = float("nan")
    logits[1, 2] = float("inf")
    logits[2, inputs["target_ids"] >= 0] = NEG_INF
    probs, tokens, draft_tokens = run_impl("triton", (logits,) + args[1:], validate=False)
    assert ((tokens >= -1) & (tokens < 10)).all() and ((draft_tokens >= -1) & (draft_tokens < 7)).all()
    assert tokens[2] == -1 and draft_tokens[2] == -1 and not probs[2].any()


# ==== 5. opcheck and torch.compile ====

def small_case(device: str = "cpu") -> tuple:
    gen = torch.Generator().manual_seed(600)
    args = random_case(gen, 4, 12, 20, torch.float32)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def test_opcheck(device):
    torch.library.opcheck(torch.ops.specops.vocab_project.default, small_case(device) + (5,))
    torch.library.opcheck(torch.ops.specops.vocab_project.default, small_case(device) + (2**40, False))


def _draft_step(logits, target_ids, target_vocab, temperature, top_k, top_p, seed, offset, validate=True):
    return specops.ops.vocab_project(logits, target_ids, target_vocab, temperature=temperature, top_k=top_k,
                                     top_p=top_p, seed=seed, offset=offset, validate=validate)


def test_torch_compile_matches_eager(device):
    # Inductor with fullgraph: the op must trace through its fake. On accelerators validate=True is a host
    # sync with a data-dependent raise, which no full graph can hold; compiled steps there use False.
    torch._dynamo.reset()
    compiled = torch.compile(_draft_step, fullgraph=True)
    args = small_case(device)
    assert_same(tuple(t.cpu() for t in compiled(*args, 3, device == "cpu")),
                tuple(t.cpu() for t in _draft_step(*args, 3)))


def test_torch_compile_does_not_recompile_per_offset():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(_draft_step, backend=counter, fullgraph=True)
    args = small_case()
    for offset in range(5):
        assert_same(compiled(*args, offset), _draft_step(*args, offset))
    # One recompile is allowed: dynamo marks an int dynamic only after seeing it change.
    assert counter.frame_count <= 2
