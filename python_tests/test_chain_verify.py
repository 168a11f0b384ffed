"""Tests of `specops::chain_verify`, in the four layers of DEVELOPERS.md ("Tests"), plus bad inputs.

1. Exact: greedy and one-hot hand tables whose answer does not depend on the random numbers.
2. Agreement: the C++ CPU kernel, the Triton kernel (interpreted on CPU without a GPU) and the public
   wrapper return exactly the tokens of `specops.reference` for the same seeds.
3. Statistics: emitted tokens follow the target distribution p (chi-square), drafts are accepted with
   probability sum(min(p, q)), zero-probability tokens never appear; and the tests can fail.
4. `torch.library.opcheck` and a `torch.compile` smoke test.
5. Bad inputs raise ValueError / TypeError naming the problem.

Every batch is ragged (several requests, different num_draft, including 0). Implementations are
named: "reference" (the spec), "cpp" (torch.ops.specops.chain_verify on CPU tensors) and "triton"
(chain_verify_triton on the Triton device), all called with the op's normalized per-row arguments.
"""

from __future__ import annotations

import math

import pytest
import torch
from _triton import IMPLS, KERNELS, TRITON_DEVICE, needs_triton, triton_launcher
from chain_cases import NEG_INF, OFFSETS, assert_same, normalized_args, random_case
from stats_helpers import N_DRAWS, P_VALUE_MIN, chisquare_pvalue

import specops
from specops import reference

chain_verify_triton = triton_launcher("chain_verify")

LOGIT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Small vocabulary tiles for the Triton kernel, so that hand tables with V ~ 10 span several tiles
# (cross-tile maximum, first argmax, inverse CDF). Used where cheap: in the interpreter, top-k/top-p
# bisection costs 32 passes over every tile, so sampled tests mostly run with one tile.
SMALL_BLOCK_V = 4


# ---- helpers ----

def run_impl(impl: str, args: tuple, offset: int = 0, block_v: int | None = None):
    """(out_tokens, num_accepted) on CPU from one implementation, given normalized CPU arguments."""
    if impl == "reference":
        return reference.chain_verify(*args, offset)
    if impl == "cpp":
        return torch.ops.specops.chain_verify(*args, offset)
    if impl == "triton":
        moved = [None if a is None else a.to(TRITON_DEVICE) for a in args]
        out, accepted = chain_verify_triton(*moved, offset, block_v=block_v)
        return out.cpu(), accepted.cpu()
    raise AssertionError(impl)


def run_wrapper(device: str, args: tuple, offset: int = 0):
    """The public wrapper on `device` (CPU: the C++ kernel; CUDA: Triton), normalized CPU arguments."""
    logits, drafts, probs, num_draft, temperature, top_k, top_p, seed = (
        None if a is None else a.to(device) for a in args)
    out, accepted = specops.ops.chain_verify(logits, drafts, probs, num_draft=num_draft,
                                             temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                             offset=offset)
    return out.cpu(), accepted.cpu()


def assert_result(result, expected_out, expected_accepted) -> None:
    out, accepted = result
    assert out.tolist() == expected_out
    assert accepted.tolist() == expected_accepted


def peaked_logits(best: list[list[int]], vocab: int, generator: torch.Generator) -> torch.Tensor:
    """[B, K+1, V] random logits whose argmax at [b, j] is best[b][j] by a wide margin."""
    best_t = torch.tensor(best)
    logits = torch.randn(*best_t.shape, vocab, generator=generator)
    return logits.scatter(-1, best_t.unsqueeze(-1), 10.0)


def one_hot_logits(hot: torch.Tensor, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Logits with a single finite entry per row, at `hot`: p is one-hot for any T, top-k, top-p."""
    values = torch.randn(*hot.shape, 1, generator=generator)
    return torch.full((*hot.shape, vocab), NEG_INF).scatter(-1, hot.unsqueeze(-1), values)


def target_probs(logits_row: torch.Tensor, temperature: float, top_k: int = 0,
                 top_p: float = 1.0) -> torch.Tensor:
    """Exact target distribution [V] (float64) of one logit row: softmax of the spec's filtered logits."""
    filtered = reference.filter_logits(logits_row.reshape(1, -1), torch.tensor([temperature]),
                                       torch.tensor([top_k]), torch.tensor([top_p]))
    return torch.softmax(filtered.double(), dim=-1)[0]


# ==== 1. Exact: answers that do not depend on the random numbers ====

@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_hand_table(impl, dtype):
    gen = torch.Generator().manual_seed(1)
    best = [[1, 4, 2, 5], [3, 3, 0, 1], [2, 0, 4, 4], [5, 1, 1, 0], [0, 0, 0, 0]]
    logits = peaked_logits(best, vocab=6, generator=gen).to(dtype)
    drafts = torch.tensor([
        [1, 4, 2],  # every draft is the argmax: all accepted, then the bonus argmax of row K
        [0, 3, 0],  # first draft wrong: nothing accepted, the argmax is emitted
        [2, 0, 1],  # third draft wrong
        [5, 1, 3],  # num_draft 1: drafts past it are ignored, the bonus comes from row 1
        [0, 0, 0],  # num_draft 0: right drafts, but none to verify; the bonus comes from row 0
    ])
    args = normalized_args(logits, drafts, num_draft=torch.tensor([3, 3, 3, 1, 0]), temperature=0.0)
    assert_result(run_impl(impl, args, block_v=SMALL_BLOCK_V),
                  [[1, 4, 2, 5], [3, -1, -1, -1], [2, 0, 4, -1], [5, 1, -1, -1], [0, -1, -1, -1]],
                  [3, 0, 2, 1, 0])


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_ties_take_first_index(impl):
    # With 4-wide Triton tiles, the ties below sit in different tiles, and a whole tile can be -inf.
    rows = torch.tensor([
        [[0.0, 3.0, 1.0, 3.0, 3.0, NEG_INF, 3.0, 0.0, 0.0, 0.0],   # tie inside and across tiles: 1
         [NEG_INF] * 5 + [2.0, 2.0, 1.0, 0.0, 2.0]],               # first tile all -inf: 5
        [[0.0, 0.0, 0.0, 5.0, 5.0, 0.0, 0.0, 0.0, 5.0, 1.0],       # tie across a tile edge: 3
         [-1.0, -0.0, 0.0, -2.0, -0.0, -3.0, -4.0, -5.0, -6.0, -7.0]],  # -0.0 == 0.0: 1
        [[7.0] * 10, [NEG_INF] * 9 + [1.0]],                       # all equal: 0; single finite: 9
    ])
    drafts = torch.tensor([[4], [3], [0]])  # row 0 drafts a later tied index: rejected
    args = normalized_args(rows, drafts, num_draft=torch.tensor([1, 1, 1]), temperature=0.0)
    assert_result(run_impl(impl, args, block_v=SMALL_BLOCK_V), [[1, -1], [3, 1], [0, 9]], [0, 1, 1])


@pytest.mark.parametrize("impl", IMPLS)
def test_no_drafts(impl):
    # K = 0: draft_tokens is [B, 0]; one token per request, greedy or sampled from a one-hot p.
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 1, 9, generator=gen)
    logits[2:] = one_hot_logits(torch.tensor([[6], [0]]), 9, gen)
    args = normalized_args(logits, torch.empty(4, 0, dtype=torch.int64), draft_probs=torch.empty(4, 0, 9),
                           temperature=torch.tensor([0.0, 0.0, 1.0, 0.3]), top_k=torch.tensor([0, 2, 0, 5]))
    greedy = logits[:2, 0].argmax(-1).tolist()
    assert_result(run_impl(impl, args, block_v=SMALL_BLOCK_V), [[greedy[0]], [greedy[1]], [6], [0]],
                  [0, 0, 0, 0])


def _one_hot_chain_expected(hot: torch.Tensor, drafts: torch.Tensor, num_draft: torch.Tensor):
    """With one-hot p, verification is deterministic: accept while the draft is the hot token, then
    emit the hot token (recovered after a rejection, bonus after the last draft)."""
    outs, accepted = [], []
    k1 = hot.shape[1]
    for b in range(hot.shape[0]):
        row = []
        for j in range(k1):
            if j < num_draft[b] and drafts[b, j] == hot[b, j]:
                row.append(int(hot[b, j]))
                continue
            row.append(int(hot[b, j]))
            break
        accepted.append(len(row) - 1)
        outs.append(row + [-1] * (k1 - len(row)))
    return outs, accepted


@pytest.mark.slow
@pytest.mark.parametrize("draft_probs_kind", ["none", "random", "one_hot_on_draft"])
@pytest.mark.parametrize("impl", IMPLS)
def test_one_hot_target(impl, draft_probs_kind):
    # A draft equal to the only possible token is always accepted (u * q < 1 = p); any other draft has
    # p = 0 and is always rejected, and the recovered token is the hot one. 12 rows with different
    # seeds and three offsets give 36 independent tries per row pattern.
    gen = torch.Generator().manual_seed(3)
    batch, k, vocab = 12, 3, 11
    hot = torch.randint(0, vocab, (batch, k + 1), generator=gen)
    drafts = hot[:, :k].clone()
    wrong_at = torch.randint(0, k + 1, (batch,), generator=gen)  # k: no wrong draft
    for b in range(batch):
        if wrong_at[b] < k:
            drafts[b, wrong_at[b]] = (hot[b, wrong_at[b]] + 1 + b % (vocab - 1)) % vocab
    if draft_probs_kind == "none":
        probs = None
    elif draft_probs_kind == "random":
        probs = torch.softmax(2 * torch.randn(batch, k, vocab, generator=gen), -1)
    else:  # q one-hot on the draft: where the draft is right, q equals p exactly
        probs = torch.nn.functional.one_hot(drafts, vocab).float()
    num_draft = torch.tensor([3, 0, 1, 2] * 3)
    args = normalized_args(one_hot_logits(hot, vocab, gen), drafts, probs, num_draft=num_draft,
                           temperature=torch.tensor([1.0, 0.3, 2.5] * 4),
                           top_k=torch.tensor([0, 0, 2, 0] * 3), top_p=torch.tensor([1.0, 0.5, 1.0] * 4),
                           seed=17)
    expected = _one_hot_chain_expected(hot, drafts, num_draft)
    for offset in (0, 1, 2**40):
        assert_result(run_impl(impl, args, offset), *expected)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["top_k", "top_p", "minus_inf"])
@pytest.mark.parametrize("impl", IMPLS)
def test_draft_with_zero_target_probability_is_rejected(impl, how):
    # p(draft) = 0, so u * q(draft) < p(draft) never holds, whatever q and u are.
    gen = torch.Generator().manual_seed(4)
    batch, vocab = 8, 12
    logits = torch.randn(batch, 2, vocab, generator=gen)
    order = logits[:, 0].argsort(-1, descending=True)
    kept = order[:, :3]  # the 3 most likely tokens
    drafts = order[:, -1:].clone()  # the least likely token
    top_k, top_p = 0, 1.0
    if how == "top_k":
        top_k = 3
    elif how == "top_p":
        # Keep exactly the top 3: top_p just above the mass of the top 2 (at T = 1).
        p = torch.softmax(logits[:, 0].double(), -1)
        top2 = p.gather(-1, order[:, :2]).sum(-1)
        top3 = p.gather(-1, order[:, :3]).sum(-1)
        top_p = ((top2 + top3) / 2).float()
    else:
        logits[:, 0] = logits[:, 0].scatter(-1, order[:, 3:], NEG_INF)
    # The drafter was confident, and wrong: q(draft) = 0.9, the other 0.1 spread over the rest (q is a
    # distribution, as validation requires).
    rest = torch.softmax(torch.randn(batch, 1, vocab, generator=gen), -1).scatter(-1, drafts.unsqueeze(-1), 0.0)
    probs = (0.1 * rest / rest.sum(-1, keepdim=True)).scatter(-1, drafts.unsqueeze(-1), 0.9)
    args = normalized_args(logits, drafts, probs, num_draft=torch.tensor([1, 1, 0, 1] * 2),
                           top_k=top_k, top_p=top_p, seed=40)
    for offset in (0, 5, 2**33 + 1):
        out, accepted = run_impl(impl, args, offset)
        assert accepted.tolist() == [0] * batch
        assert out[:, 1].tolist() == [-1] * batch
        assert all(int(out[b, 0]) in kept[b].tolist() for b in range(batch)), (out, kept)


@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
@pytest.mark.parametrize("impl", IMPLS)
def test_draft_with_q_at_most_half_p_is_accepted(impl, with_probs):
    # q(d) <= p(d) / 2 means u * q(d) < p(d) for every u < 1, with a margin round-off cannot cross.
    # Drafts are each row's argmax, so p(d) is large. Without draft_probs q is one-hot (q(d) = 1), so
    # the drafts are only certain to be accepted where p(d) = 1: there top_k = 1.
    gen = torch.Generator().manual_seed(5)
    batch, k, vocab = 6, 3, 9
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.7, 1.3])
    drafts = logits[:, :k].argmax(-1)
    top_k = 0 if with_probs else 1
    probs = None
    if with_probs:
        p = torch.softmax(logits[:, :k] / temperature[:, None, None], -1)
        other = (drafts + 1) % vocab
        probs = (p + torch.nn.functional.one_hot(other, vocab)) / 2  # q(d) = p(d) / 2
    num_draft = torch.tensor([3, 2, 0, 1, 3, 3])
    args = normalized_args(logits, drafts, probs, num_draft=num_draft, temperature=temperature,
                           top_k=top_k, seed=50)
    out, accepted = run_impl(impl, args, offset=3)
    assert accepted.tolist() == num_draft.tolist()
    for b in range(batch):
        n = int(num_draft[b])
        assert out[b, :n].tolist() == drafts[b, :n].tolist()
        assert 0 <= out[b, n] < vocab  # the bonus token
        if not with_probs:  # top_k = 1: the bonus is the argmax
            assert out[b, n] == logits[b, n].argmax()
        assert out[b, n + 1:].tolist() == [-1] * (k - n)


@pytest.mark.parametrize("impl", IMPLS)
def test_mixed_per_row_sampling_parameters(impl):
    # Every row's answer is forced: greedy ignores top-k/top-p; top_k = 1 or a tiny top_p leave one
    # token (logits are distinct), so a sampled row emits its argmax too.
    gen = torch.Generator().manual_seed(6)
    batch, k, vocab = 6, 2, 10
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    best = logits.argmax(-1)
    drafts = best[:, :k].clone()
    drafts[3, 0] = (best[3, 0] + 1) % vocab  # row 3: first draft has p = 0 under top_k = 1
    args = normalized_args(
        logits, drafts, num_draft=torch.tensor([2, 2, 2, 2, 0, 1]),
        temperature=torch.tensor([0.0, 1.0, 0.5, 2.0, 1.0, 0.0]),
        top_k=torch.tensor([3, 1, 0, 1, 1, 0]),
        top_p=torch.tensor([0.5, 1.0, 1e-3, 0.9, 1.0, 0.2]), seed=60)
    b = best.tolist()
    assert_result(run_impl(impl, args, offset=9),
                  [b[0], b[1], b[2], [b[3][0], -1, -1], [b[4][0], -1, -1], [b[5][0], b[5][1], -1]],
                  [2, 2, 2, 0, 0, 1])


# ==== 2. Agreement with the reference, same seeds ====

@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_cpp_matches_reference(dtype, with_probs):
    # V = 2049 and 5000 cross the C++ kernel's 2048-token residual chunks; V = 1 has a single token.
    gen = torch.Generator().manual_seed(100 + LOGIT_DTYPES.index(dtype) + 3 * with_probs)
    shapes = [(6, 4, 7), (5, 3, 300), (4, 2, 2049), (3, 3, 5000), (3, 2, 1), (4, 0, 33)]
    for i, (batch, k, vocab) in enumerate(shapes):
        args = random_case(gen, batch, k, vocab, dtype, with_probs)
        offset = OFFSETS[i % len(OFFSETS)]
        assert_same(run_impl("cpp", args, offset), run_impl("reference", args, offset), f"case {i}: ")


@pytest.mark.parametrize("shape", ["gaussian", "peaked", "heavy_tail", "uniform", "ties", "underflow",
                                   "neg_inf"])
def test_cpp_top_p_cut_matches_reference_at_a_large_vocabulary(shape):
    """The C++ top-p cut keeps the reference's tokens at 262,144 ids, by both of its paths: the candidates
    near the maximum where they hold the mass needed (peaked, underflow), the mass histogram where there are
    too many (gaussian, uniform, ties, neg_inf) or they hold too little (heavy_tail: four tokens 12 above a
    floor of 262,140, which outweighs them at T >= 1). The cut falls in a heavy bucket, among ties, after
    underflowed weights and -inf logits, alone and after top-k."""
    gen = torch.Generator().manual_seed(17)
    vocab, rows = 262_144, 6
    logits = {"gaussian": 3 * torch.randn(rows, 1, vocab, generator=gen),
              "peaked": torch.where(torch.rand(rows, 1, vocab, generator=gen) < 1e-3, 12.0, 0.0)
              + torch.randn(rows, 1, vocab, generator=gen),
              "heavy_tail": torch.where(torch.rand(rows, 1, vocab, generator=gen) < 1.6e-5, 12.0, 0.0)
              + 1e-3 * torch.randn(rows, 1, vocab, generator=gen),
              "uniform": torch.zeros(rows, 1, vocab),
              "ties": torch.randint(0, 4, (rows, 1, vocab), generator=gen).float(),
              "underflow": torch.cat([torch.full((rows, 1, 8), 200.0), 200.0 * torch.rand(rows, 1, vocab - 8,
                                                                                          generator=gen)], -1),
              "neg_inf": torch.where(torch.rand(rows, 1, vocab, generator=gen) < 0.5, NEG_INF,
                                     torch.randn(rows, 1, vocab, generator=gen))}[shape]
    none = torch.empty(rows, 0, dtype=torch.long)
    args = normalized_args(logits, none, temperature=torch.tensor([1.0, 0.8, 0.8, 1.3, 0.5, 1.0]),
                           top_k=torch.tensor([0, 0, 1000, 0, 0, 50_000]),
                           top_p=torch.tensor([0.95, 0.9, 0.95, 0.5, 0.999, 0.7]), seed=3)
    for offset in OFFSETS[:2]:
        assert_same(run_impl("cpp", args, offset), run_impl("reference", args, offset), f"{shape}: ")
    # The kept set itself: sample_without_replacement's q is the filtered softmax, through the same C++ cut.
    rows_args = dict(temperature=args[4], top_k=args[5], top_p=args[6], seed=args[7])
    _, q = specops.ops.sample_without_replacement(logits[:, 0], 1, **rows_args)
    _, q_ref = reference.sample_without_replacement(logits[:, 0], 1, *rows_args.values(), 0)
    assert torch.equal(q > 0, q_ref > 0), f"{shape}: kept sets differ in {int(((q > 0) != (q_ref > 0)).sum())} ids"
    torch.testing.assert_close(q, q_ref, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
def test_cpp_top_p_chains_match_reference_at_a_large_vocabulary(with_probs):
    """Chains at 262,144 ids under top-p: where the cut keeps few tokens the C++ kernel normalizes, accepts
    and draws the recovered or bonus token over those alone (sample_kept); the same tokens as the reference,
    drafts accepted and rejected, with one-hot q and with q given, beside rows whose cut the histogram
    finds."""
    gen = torch.Generator().manual_seed(23)
    vocab, rows, k = 262_144, 8, 3
    # a few likely tokens over a spread of unlikely ones, as a language model's logits are; the last two rows
    # are flat enough that the candidates cannot hold the mass (the histogram's cut, dense passes)
    logits = torch.randn(rows, k + 1, vocab, generator=gen)
    likely = torch.randint(0, vocab, (rows, k + 1, 6), generator=gen)
    logits.scatter_(-1, likely, 16.0 + 2 * torch.rand(rows, k + 1, 6, generator=gen))
    logits[-2:] *= 0.1
    pick = torch.randint(0, 6, (rows, k), generator=gen)
    drafts = likely[:, :k].gather(-1, pick[..., None])[..., 0]
    drafts[:, 1] = torch.where(torch.rand(rows, generator=gen) < 0.3, 0, drafts[:, 1])  # some unlikely ones
    q = None
    if with_probs:
        q = torch.softmax(logits[:, :k] + torch.randn(rows, k, vocab, generator=gen), -1)
    args = normalized_args(logits, drafts, q, num_draft=torch.tensor([3, 3, 2, 1, 3, 0, 3, 3]),
                           temperature=torch.tensor([1.0, 0.8, 0.8, 1.3, 0.5, 1.0, 0.8, 1.0]),
                           top_k=torch.tensor([0, 0, 1000, 0, 0, 50_000, 0, 0]),
                           top_p=torch.tensor([0.95, 0.9, 0.95, 0.5, 0.999, 0.7, 0.95, 0.9]), seed=5)
    for offset in OFFSETS:
        assert_same(run_impl("cpp", args, offset), run_impl("reference", args, offset), f"offset {offset}: ")


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_triton_matches_reference(dtype, with_probs):
    # Small cases, one vocabulary tile: the interpreter is slow. Multi-tile cases follow.
    gen = torch.Generator().manual_seed(200 + LOGIT_DTYPES.index(dtype) + 3 * with_probs)
    for i, (batch, k, vocab) in enumerate([(5, 3, 150), (4, 2, 37), (3, 1, 1)]):
        args = random_case(gen, batch, k, vocab, dtype, with_probs)
        offset = OFFSETS[(i + LOGIT_DTYPES.index(dtype)) % len(OFFSETS)]
        assert_same(run_impl("triton", args, offset), run_impl("reference", args, offset), f"case {i}: ")


@needs_triton
@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
def test_triton_matches_reference_across_tiles(with_probs):
    # block_v = 32 splits V = 100 into 4 tiles (the last one partial): per-tile maxima and sums,
    # top-k/top-p bisection over tiles, and the two-level inverse CDF.
    gen = torch.Generator().manual_seed(250 + with_probs)
    args = random_case(gen, 4, 3, 100, torch.bfloat16 if with_probs else torch.float32, with_probs)
    assert_same(run_impl("triton", args, 2**32 + 9, block_v=32), run_impl("reference", args, 2**32 + 9))


@pytest.mark.slow
@needs_triton
def test_triton_matches_reference_with_masked_tiles():
    # Whole -inf tiles (their max is -inf, their exp sum must count as 0) and a V that is not a
    # multiple of the tile.
    gen = torch.Generator().manual_seed(300)
    args = random_case(gen, 4, 2, 203, torch.float32, True, neg_inf_fraction=0.0)
    logits = args[0].clone()
    logits[..., 32:96] = NEG_INF
    logits[1, :, :32] = NEG_INF
    args = (logits,) + args[1:]
    assert_same(run_impl("triton", args, 11, block_v=32), run_impl("reference", args, 11))


@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
def test_wrapper_matches_reference(device, with_probs):
    gen = torch.Generator().manual_seed(400 + with_probs)
    for i, dtype in enumerate(LOGIT_DTYPES):
        args = random_case(gen, 6, 3, 64, dtype, with_probs)
        offset = OFFSETS[i]
        assert_same(run_wrapper(device, args, offset), run_impl("reference", args, offset), f"{dtype}: ")


def test_wrapper_scalars_and_int_seed(device):
    # Scalars broadcast to every row; an int seed s gives row b the seed s + b * 0x9E3779B97F4A7C15
    # (mod 2**64), as documented.
    gen = torch.Generator().manual_seed(450)
    logits = torch.randn(5, 3, 20, generator=gen)
    drafts = torch.randint(0, 20, (5, 2), generator=gen)
    seed = 2**63 - 5  # wraps around 2**64 for later rows
    out = specops.ops.chain_verify(logits.to(device), drafts.to(device), temperature=0.8, top_k=7, top_p=0.9,
                                   seed=seed, offset=4)
    row_seeds = [(seed + b * 0x9E3779B97F4A7C15) % 2**64 for b in range(5)]
    row_seeds = torch.tensor([s - 2**64 if s >= 2**63 else s for s in row_seeds])
    expected = run_impl("reference", normalized_args(logits, drafts, temperature=0.8, top_k=7, top_p=0.9,
                                                     seed=row_seeds), 4)
    assert_same((out[0].cpu(), out[1].cpu()), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_do_not_depend_on_the_batch(impl):
    # A request's tokens depend only on its own inputs and seed: the same rows inside another batch
    # (reordered, fewer neighbours) give the same tokens.
    gen = torch.Generator().manual_seed(500)
    args = random_case(gen, 6, 3, 40, torch.float32, True)
    full = run_impl(impl, args, offset=2)
    rows = torch.tensor([4, 1, 5])
    subset = tuple(None if a is None else a[rows] for a in args)
    out, accepted = run_impl(impl, subset, offset=2)
    assert torch.equal(out, full[0][rows]) and torch.equal(accepted, full[1][rows])


@pytest.mark.parametrize("impl", IMPLS)
def test_drafts_past_num_draft_are_ignored(impl):
    gen = torch.Generator().manual_seed(550)
    args = random_case(gen, 5, 3, 30, torch.float32, True)
    drafts, probs, num_draft = args[1].clone(), args[2].clone(), args[3]
    for b in range(5):
        n = int(num_draft[b])
        drafts[b, n:] = torch.randint(0, 30, (3 - n,), generator=gen)
        probs[b, n:] = torch.rand(3 - n, 30, generator=gen)
    padded = (args[0], drafts, probs) + args[3:]
    assert_same(run_impl(impl, padded, 1), run_impl(impl, args, 1))


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_offsets_give_different_draws(impl):
    # Uniform p over 64 tokens, no drafts: two independent draws of a row agree with probability
    # 1/64, so of 32 rows about 0.5 agree; requiring at least 24 to differ leaves a wide margin.
    logits = torch.zeros(32, 1, 64)
    args = normalized_args(logits, torch.empty(32, 0, dtype=torch.int64), seed=123)
    draws = {offset: run_impl(impl, args, offset)[0][:, 0] for offset in (0, 1, 2**32, 2**63 - 1)}
    assert torch.equal(run_impl(impl, args, 1)[0][:, 0], draws[1])  # same offset, same draw
    values = list(draws.values())
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            assert int((values[i] != values[j]).sum()) >= 24


# ==== 3. Statistics ====
#
# N_DRAWS draws per test, P_VALUE_MIN and chisquare_pvalue: stats_helpers.py (the power of the test
# there). The seeds below are fixed, so every run computes the same p-values.
Z_MAX = 3.29  # two-sided normal test at level 1e-3

TARGET_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, NEG_INF, 1.5])
# q puts mass on token 6, where p = 0: such drafts must always be rejected.
DRAFT_PROBS = torch.softmax(torch.tensor([0.0, 1.5, 0.5, 1.0, -1.0, 0.0, 0.5, -2.0]), -1)


def acceptance_z(accepted: torch.Tensor, rate: float) -> float:
    """z score of the observed fraction of accepted first drafts against the exact rate."""
    observed = float((accepted.cpu() >= 1).double().mean())
    return (observed - rate) / math.sqrt(rate * (1 - rate) / accepted.numel())


def sample_chain(device: str, logits: torch.Tensor, draft_probs: torch.Tensor, *, with_probs: bool = True,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, draft_seed: int = 0,
                 seed_base: int = 0, offset: int = 0):
    """N_DRAWS requests with the same target rows `logits` [K+1, V] and draft rows `draft_probs` [K, V];
    drafts sampled from q with a fixed generator; request n has seed seed_base + n."""
    k = draft_probs.shape[0]
    gen = torch.Generator().manual_seed(draft_seed)
    drafts = torch.empty(N_DRAWS, k, dtype=torch.int64)
    for j in range(k):
        drafts[:, j] = torch.multinomial(draft_probs[j], N_DRAWS, replacement=True, generator=gen)
    batch_logits = logits.expand(N_DRAWS, *logits.shape)
    probs = draft_probs.expand(N_DRAWS, *draft_probs.shape) if with_probs else None
    seeds = torch.arange(N_DRAWS, dtype=torch.int64) + seed_base
    out, accepted = specops.ops.chain_verify(
        batch_logits.to(device), drafts.to(device), None if probs is None else probs.to(device),
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seeds.to(device), offset=offset)
    return out.cpu(), accepted.cpu(), drafts


STAT_CASES = {  # name: (with_probs, temperature, top_k, top_p)
    "q_given": (True, 1.0, 0, 1.0),
    "q_one_hot": (False, 1.0, 0, 1.0),
    "temperature_0.6": (True, 0.6, 0, 1.0),
    "temperature_1.8_q_one_hot": (False, 1.8, 0, 1.0),
    "top_k_3": (True, 1.3, 3, 1.0),
    "top_p_0.7": (True, 1.0, 0, 0.7),
    "top_k_5_top_p_0.8_q_one_hot": (False, 0.9, 5, 0.8),
}


@pytest.mark.parametrize("case", list(STAT_CASES))
def test_first_token_follows_target(device, case):
    with_probs, temperature, top_k, top_p = STAT_CASES[case]
    logits = torch.stack([TARGET_LOGITS, TARGET_LOGITS.flip(0)])  # K = 1
    out, accepted, drafts = sample_chain(device, logits, DRAFT_PROBS[None], with_probs=with_probs,
                                         temperature=temperature, top_k=top_k, top_p=top_p, draft_seed=7)
    p = target_probs(TARGET_LOGITS, temperature, top_k, top_p)
    tokens = out[:, 0]
    # (c) tokens with p = 0 (-inf, or removed by top-k / top-p) never appear.
    zero = (p == 0).nonzero().flatten()
    emitted_zero = torch.isin(tokens, zero)
    assert not emitted_zero.any(), f"tokens with p = 0 emitted: {torch.unique(tokens[emitted_zero]).tolist()}"
    # (a) the first emitted token follows p exactly.
    assert chisquare_pvalue(tokens, p) > P_VALUE_MIN
    # (b) the first draft is accepted with probability sum_x min(p(x), q(x)); with one-hot q the
    # drafts still come from DRAFT_PROBS, so the rate is sum_x DRAFT_PROBS(x) p(x).
    q = DRAFT_PROBS.double()
    rate = float(torch.minimum(p, q).sum()) if with_probs else float((q * p).sum())
    assert abs(acceptance_z(accepted, rate)) < Z_MAX
    # Accepted tokens are the drafts; after the last draft or a rejection comes exactly one more token.
    assert torch.equal(out[accepted >= 1, 0], drafts[accepted >= 1, 0])
    assert ((out[:, 1] >= 0) == (accepted >= 1)).all()


def test_two_token_chain_follows_target(device):
    # A toy order-1 Markov target and drafter over V = 6: the target row at position j + 1 is the one
    # conditioned on draft j. K = 3 drafts per request; the first two emitted tokens (x0, x1) must
    # follow p0(x0) * p1(x1 | x0). Where the chain stops at position 0, x1 comes from a second call,
    # as the next decoding step would. 36 cells: N = 200,000 leaves > 150 expected draws in each.
    vocab, k = 6, 3
    gen = torch.Generator().manual_seed(8)
    first_logits = torch.randn(vocab, generator=gen)
    next_logits = 1.5 * torch.randn(vocab, vocab, generator=gen)  # [previous token, V]
    first_q = torch.softmax(first_logits + torch.randn(vocab, generator=gen), -1)
    next_q = torch.softmax(next_logits + torch.randn(vocab, vocab, generator=gen), -1)
    drafts = [torch.multinomial(first_q, N_DRAWS, replacement=True, generator=gen)]
    for _ in range(k - 1):
        drafts.append(torch.multinomial(next_q[drafts[-1]], 1, generator=gen)[:, 0])
    drafts = torch.stack(drafts, dim=1)
    logits = torch.cat([first_logits.expand(N_DRAWS, 1, vocab), next_logits[drafts]], dim=1)  # [N, K+1, V]
    probs = torch.cat([first_q.expand(N_DRAWS, 1, vocab), next_q[drafts[:, :-1]]], dim=1)  # [N, K, V]
    seeds = torch.arange(N_DRAWS, dtype=torch.int64).to(device)
    out, accepted = specops.ops.chain_verify(logits.to(device), drafts.to(device), probs.to(device),
                                             seed=seeds)
    out, accepted = out.cpu(), accepted.cpu()
    x0, x1 = out[:, 0], out[:, 1].clone()
    stopped = accepted == 0
    no_drafts = torch.empty(int(stopped.sum()), 0, dtype=torch.int64, device=device)
    next_out, _ = specops.ops.chain_verify(next_logits[x0[stopped]][:, None].to(device), no_drafts,
                                           seed=seeds[stopped.to(device)], offset=1)
    x1[stopped] = next_out[:, 0].cpu()
    joint = torch.softmax(first_logits.double(), -1)[:, None] * torch.softmax(next_logits.double(), -1)
    assert chisquare_pvalue(x0 * vocab + x1, joint.flatten()) > P_VALUE_MIN
    # Chains do run deep: some requests accept all three drafts.
    assert int((accepted == k).sum()) > 1000


class TestStatisticsCanFail:
    """The chi-square check above rejects samplers that are wrong by the margin it claims to catch."""

    def test_rejects_a_one_percent_error(self):
        # Move 0.01 of probability between the two most likely tokens: the hardest 1% error to see.
        p = target_probs(TARGET_LOGITS, 1.0)
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

    def test_rejects_sampling_the_draft_distribution(self, device):
        # A verifier handed q where it should use p: its tokens follow q.
        q_logits = DRAFT_PROBS.log()
        out, _, _ = sample_chain(device, torch.stack([q_logits, q_logits]), DRAFT_PROBS[None], draft_seed=10)
        assert chisquare_pvalue(out[:, 0], target_probs(TARGET_LOGITS, 1.0)) < P_VALUE_MIN

    def test_rejects_recovering_from_p_instead_of_the_residual(self, device):
        # The classic bug: after a rejection, sample from p rather than norm(max(0, p - q)).
        logits = torch.stack([TARGET_LOGITS, TARGET_LOGITS])
        out, accepted, _ = sample_chain(device, logits, DRAFT_PROBS[None], draft_seed=11)
        rejected = accepted == 0
        no_drafts = DRAFT_PROBS[None][:0]  # K = 0: the token comes from p
        resampled, _, _ = sample_chain(device, logits[:1], no_drafts, seed_base=N_DRAWS)
        tokens = torch.where(rejected, resampled[:, 0], out[:, 0])
        assert chisquare_pvalue(tokens, target_probs(TARGET_LOGITS, 1.0)) < P_VALUE_MIN


# Random123 known-answer vectors for Philox4x32-10: (key words k0, k1), counter, expected output.
PHILOX_KAT = [
    ((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("key_words, counter, expected", PHILOX_KAT)
def test_philox_known_answers(key_words, counter, expected):
    k0, k1 = key_words
    key = (k1 << 32) | k0
    key = torch.tensor(key - 2**64 if key >= 2**63 else key, dtype=torch.int64)  # signed int64
    words = reference.philox4x32(key, *counter)
    assert tuple(int(w) for w in words) == expected


# ==== 4. opcheck and torch.compile ====

def small_case(device: str = "cpu", with_probs: bool = True) -> tuple:
    gen = torch.Generator().manual_seed(600)
    args = random_case(gen, 4, 3, 12, torch.float32, with_probs)
    return tuple(None if a is None else a.to(device) for a in args)


@pytest.mark.parametrize("with_probs", [False, True], ids=["q_one_hot", "q_given"])
def test_opcheck(device, with_probs):
    torch.library.opcheck(torch.ops.specops.chain_verify.default, small_case(device, with_probs) + (5,))


def _decode_step(logits, drafts, probs, num_draft, temperature, top_k, top_p, seed, offset):
    return specops.ops.chain_verify(logits, drafts, probs, num_draft=num_draft, temperature=temperature,
                                    top_k=top_k, top_p=top_p, seed=seed, offset=offset)


@pytest.mark.slow
def test_torch_compile_matches_eager(device):
    # Inductor (about 3 s to compile on CPU here) with fullgraph: the op must trace through its fake.
    torch._dynamo.reset()
    compiled = torch.compile(_decode_step, fullgraph=True)
    args = small_case(device)
    assert_same(compiled(*args, 3), _decode_step(*args, 3))


def test_torch_compile_does_not_recompile_per_offset():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(_decode_step, backend=counter, fullgraph=True)
    args = small_case()
    for offset in range(5):
        assert_same(compiled(*args, offset), _decode_step(*args, offset))
    # One recompile is allowed: dynamo marks an int dynamic only after seeing it change.
    assert counter.frame_count <= 2


# ==== Regressions for bugs found while writing these tests ====

@pytest.mark.parametrize("impl", IMPLS)
def test_tiny_temperature_overflow(impl):
    # logits / T overflowing float32 is the T -> 0 limit: a point mass on the argmax of the logits.
    logits = torch.tensor([[[1.0, 2.0, 3.0, -1.0]], [[0.5, -2.0, 0.0, 4.0]]])
    args = normalized_args(logits, torch.empty(2, 0, dtype=torch.int64), temperature=1e-40)
    out, _ = run_impl(impl, args)
    assert out[:, 0].tolist() == [2, 3]
    # Several logits overflow to +inf; the first of them (index 0) is not the largest logit (index 1).
    logits = torch.tensor([[[2e38, 3e38, 1.0, -1.0]], [[1.0, 2.5e38, 3e38, 0.0]]])
    args = normalized_args(logits, torch.empty(2, 0, dtype=torch.int64), temperature=0.5, top_p=0.9)
    out, _ = run_impl(impl, args)
    assert out[:, 0].tolist() == [1, 2]


def every_other(x: torch.Tensor, gap) -> torch.Tensor:
    """The values of x in a non-contiguous view (last-dim stride 2) of a buffer twice as long whose
    gaps hold `gap`. A kernel that ignores the stride reads gaps, yet stays inside the buffer."""
    buffer = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    buffer[..., ::2] = x
    buffer[..., 1::2] = gap
    return buffer[..., ::2]


# Gap values that change the answer if read: -inf at every draft's id, other (odd) drafts, q = 1 for
# drafts whose p is ~1/16, other num_draft, greedy, top_k = 1, a tiny top_p, other seeds.
STRIDED_GAPS = {
    "target_logits": lambda x: NEG_INF, "draft_tokens": lambda x: (x + 2) % 16, "draft_probs": lambda x: 1.0,
    "num_draft": lambda x: (x + 1) % 3, "temperature": lambda x: 0.0, "top_k": lambda x: 1,
    "top_p": lambda x: 0.01, "seed": lambda x: x + 1,
}
ARG_NAMES = ["target_logits", "draft_tokens", "draft_probs", "num_draft", "temperature", "top_k", "top_p",
             "seed"]


@pytest.mark.slow
@pytest.mark.parametrize("which", list(STRIDED_GAPS))
@pytest.mark.parametrize("impl", KERNELS)
def test_op_accepts_non_contiguous_inputs(impl, which):
    # The op itself, not only the wrapper (which makes inputs contiguous), must honour strides: it is
    # reachable directly as torch.ops.specops.chain_verify, and the C++ kernel does honour them.
    # Odd draft ids with q(d) = p(d) / 2: every draft is accepted, whatever the random numbers.
    gen = torch.Generator().manual_seed(700)
    batch, k, vocab = 8, 2, 16
    logits = 0.5 * torch.randn(batch, k + 1, vocab, generator=gen)
    drafts = 2 * torch.randint(0, vocab // 2, (batch, k), generator=gen) + 1
    p = torch.softmax(logits[:, :k], -1)
    probs = (p + torch.nn.functional.one_hot((drafts + 1) % vocab, vocab)) / 2
    args = normalized_args(logits, drafts, probs, num_draft=torch.tensor([2, 0, 1, 2, 1, 0, 2, 1]), seed=70)
    index = ARG_NAMES.index(which)
    strided = list(args)
    strided[index] = every_other(args[index], STRIDED_GAPS[which](args[index]))
    assert not strided[index].is_contiguous()
    assert_same(run_impl(impl, tuple(strided), 0), run_impl("reference", args, 0))


# ==== 5. Bad inputs ====

def _valid_inputs(device: str) -> dict:
    gen = torch.Generator().manual_seed(800)
    batch, k, vocab = 3, 2, 7
    return dict(
        target_logits=torch.randn(batch, k + 1, vocab, generator=gen).to(device),
        draft_tokens=torch.randint(0, vocab, (batch, k), generator=gen).to(device),
        draft_probs=torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1).to(device),
        num_draft=torch.tensor([2, 0, 1], device=device),
        temperature=torch.tensor([1.0, 0.0, 0.5], device=device), top_k=0, top_p=1.0, seed=1, offset=0)


def _with(name: str, make):
    """A change to the valid inputs: input `name` becomes make(inputs)."""
    def change(inputs):
        inputs[name] = make(inputs)
    return change


def _logit_set(value, row=(1, 2)):
    """Logits with one entry (or, for value=None, a whole row) changed."""
    def make(inputs):
        logits = inputs["target_logits"].clone()
        logits[row] = value
        return logits
    return make


def _row_tensor(values):
    return lambda inputs: torch.tensor(values, device=inputs["target_logits"].device)


# id: (change to the valid inputs, exception, message pattern): the op's messages, the C++ kernel's on CPU and
# its contract's (the same) on accelerators; the wrapper checks none of these itself.
BAD_INPUTS = {
    "logits_rank": (_with("target_logits", lambda i: i["target_logits"][0]),
                    ValueError, r"target_logits must be \[B, K\+1, V\]"),
    "int_logits": (_with("target_logits", lambda i: i["target_logits"].long()),
                   TypeError, r"target_logits must be float32, bfloat16 or float16"),
    "float64_draft_probs": (_with("draft_probs", lambda i: i["draft_probs"].double()),
                            TypeError, r"draft_probs must be float32"),
    "int32_draft_tokens": (_with("draft_tokens", lambda i: i["draft_tokens"].int()),
                           TypeError, r"draft_tokens must be int64"),
    "k_mismatch": (_with("draft_tokens", lambda i: i["draft_tokens"][:, :1]),
                   ValueError, r"draft_tokens must be \[B, K\] matching target_logits"),
    "v_mismatch": (_with("draft_probs", lambda i: torch.cat([i["draft_probs"]] * 2, -1)),
                   ValueError, r"draft_probs must be \[B, K, V\] matching target_logits"),
    "negative_id": (_with("draft_tokens", lambda i: i["draft_tokens"] - 10),
                    ValueError, r"draft_tokens.*outside.*\[0, 7\)"),
    "id_equal_to_v": (_with("draft_tokens", lambda i: torch.full_like(i["draft_tokens"], 7)),
                      ValueError, r"draft_tokens.*outside.*\[0, 7\)"),
    "nan_logit": (_with("target_logits", _logit_set(float("nan"), (1, 2, 3))),
                  ValueError, r"target_logits.*NaN or \+inf"),
    "plus_inf_logit": (_with("target_logits", _logit_set(float("inf"), (2, 0, 6))),
                       ValueError, r"target_logits.*NaN or \+inf"),
    "all_minus_inf_row": (_with("target_logits", _logit_set(NEG_INF, (2, 0))),
                          ValueError, r"target_logits.*no finite logit"),
    "num_draft_above_k": (_with("num_draft", _row_tensor([2, 3, 0])), ValueError, r"num_draft.*\[0, 2\]"),
    "num_draft_negative": (_with("num_draft", _row_tensor([2, -1, 0])), ValueError, r"num_draft.*\[0, 2\]"),
    "negative_temperature": (_with("temperature", lambda i: -0.5),
                             ValueError, r"temperature.*must be finite and >= 0"),
    "negative_temperature_row": (_with("temperature", _row_tensor([1.0, -1.0, 0.0])),
                                 ValueError, r"temperature.*must be finite and >= 0"),
    "top_p_zero": (_with("top_p", lambda i: 0.0), ValueError, r"top_p.*must be in \(0, 1\]"),
    "top_p_above_one": (_with("top_p", lambda i: 1.5), ValueError, r"top_p.*must be in \(0, 1\]"),
    "negative_top_k": (_with("top_k", lambda i: -1), ValueError, r"top_k.*must be >= 0"),
    "negative_offset": (_with("offset", lambda i: -1), ValueError, r"offset must be >= 0"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise(device, case):
    change, error, pattern = BAD_INPUTS[case]
    inputs = _valid_inputs(device)
    specops.ops.chain_verify(**inputs)  # the unchanged inputs are fine
    change(inputs)
    with pytest.raises(error, match=pattern):
        specops.ops.chain_verify(**inputs)


@pytest.mark.parametrize("name", ["draft_tokens", "draft_probs", "num_draft", "temperature"])
def test_inputs_on_another_device_raise(device, name):
    # Without a second real device, "meta" tensors stand in for tensors on the wrong device.
    other = "meta" if device == "cpu" else "cpu"
    inputs = _valid_inputs(device)
    inputs[name] = inputs[name].to(other)
    with pytest.raises(ValueError, match=rf"{name} is on {other} but target_logits is on {device}"):
        specops.ops.chain_verify(**inputs)


def _check_draft_probs(check: str, inputs: dict) -> None:
    """chain_verify's value checks on `inputs`, by `check`: "op" is the public wrapper (on CPU the C++
    kernel's validation pass, on CUDA the op's contract before its Triton kernel); "one_sync_check" calls
    that contract, `specops.ops.CONTRACTS["chain_verify"]`, directly, so that it is tested on machines
    without a GPU too."""
    if check == "op":
        specops.ops.chain_verify(**inputs)
    else:
        args = normalized_args(inputs["target_logits"], inputs["draft_tokens"], inputs["draft_probs"],
                               num_draft=inputs["num_draft"], temperature=inputs["temperature"],
                               top_k=inputs["top_k"], top_p=inputs["top_p"])
        device = inputs["target_logits"].device
        specops.ops.CONTRACTS["chain_verify"](*[a.to(device) if isinstance(a, torch.Tensor) else a for a in args], 0)


DRAFT_PROBS_CHECKS = ["op", "one_sync_check"]


@pytest.mark.parametrize("check", DRAFT_PROBS_CHECKS)
def test_draft_probs_row_that_does_not_sum_to_one_raises(device, check):
    # An unnormalized q biases the acceptance test and the recovered token; validation names the row.
    inputs = _valid_inputs(device)
    _check_draft_probs(check, inputs)  # the unchanged inputs are fine
    probs = inputs["draft_probs"].clone()
    probs[2, 0] *= 0.9  # num_draft = [2, 0, 1]: request 2 uses its row 0
    inputs["draft_probs"] = probs
    with pytest.raises(ValueError, match=r"^chain_verify: draft_probs\[2, 0\] sums to 0\.9, not 1 "
                                         r"\(each used row must be a distribution\)$"):
        _check_draft_probs(check, inputs)


@pytest.mark.parametrize("check", DRAFT_PROBS_CHECKS)
def test_draft_probs_rows_past_num_draft_are_not_checked(device, check):
    # Padding rows may hold anything finite and >= 0: zeros, or what a previous step left there.
    inputs = _valid_inputs(device)
    probs = inputs["draft_probs"].clone()
    probs[1] = 0.0  # num_draft = [2, 0, 1]: request 1 uses no row, request 2 not its row 1
    probs[2, 1] = 3.0
    inputs["draft_probs"] = probs
    _check_draft_probs(check, inputs)


@pytest.mark.parametrize("check", DRAFT_PROBS_CHECKS)
def test_softmax_draft_probs_over_a_large_vocabulary_pass(device, check):
    # float32 softmax rows over 262,144 tokens sum to 1 only within round-off (torch.softmax on CPU: up
    # to ~3e-5), which the tolerance (1e-3) accepts; a row 1% short is still caught at this width.
    gen = torch.Generator().manual_seed(810)
    batch, vocab = 2, 262_144
    probs = torch.softmax(3 * torch.randn(batch, 1, vocab, generator=gen), -1)
    assert float((probs.double().sum(-1) - 1).abs().max()) > 0  # round-off is there to be tolerated
    inputs = dict(target_logits=torch.randn(batch, 2, vocab, generator=gen).to(device),
                  draft_tokens=torch.zeros(batch, 1, dtype=torch.int64, device=device), draft_probs=probs.to(device),
                  num_draft=torch.ones(batch, dtype=torch.int64, device=device), temperature=1.0, top_k=0, top_p=1.0)
    _check_draft_probs(check, inputs)
    inputs["draft_probs"] = inputs["draft_probs"] * 0.99
    with pytest.raises(ValueError, match=r"draft_probs\[0, 0\] sums to 0\.99"):
        _check_draft_probs(check, inputs)


def test_validate_false_skips_the_draft_probs_sums(device):
    inputs = _valid_inputs(device)
    inputs["draft_probs"] = inputs["draft_probs"] * 0.9
    with pytest.raises(ValueError, match=r"draft_probs\[0, 0\] sums to 0\.9"):
        specops.ops.chain_verify(**inputs)
    out, accepted = specops.ops.chain_verify(**inputs, validate=False)
    assert out.shape == (3, 3) and accepted.shape == (3,)


def test_minus_inf_logits_are_legitimate(device):
    # Masked tokens are -inf; valid as long as each row keeps a finite logit. They are never emitted.
    inputs = _valid_inputs(device)
    logits = inputs["target_logits"].clone()
    logits[:, :, 1:] = NEG_INF
    inputs["target_logits"] = logits
    inputs["temperature"] = 1.0
    inputs["draft_tokens"] = torch.zeros_like(inputs["draft_tokens"])
    out, accepted = specops.ops.chain_verify(**inputs)
    assert out.cpu().tolist() == [[0, 0, 0], [0, -1, -1], [0, 0, -1]]
    assert accepted.cpu().tolist() == [2, 0, 1]


def test_validate_false_gives_the_same_tokens_and_still_rejects_rows_it_reads():
    torch.manual_seed(7)
    batch, k, vocab = 4, 3, 3000
    logits = torch.randn(batch, k + 1, vocab) * 3
    probs = torch.softmax(logits[:, :k] + torch.randn(batch, k, vocab), -1)
    drafts = torch.multinomial(probs.reshape(-1, vocab), 1).reshape(batch, k)
    kwargs = dict(num_draft=torch.tensor([3, 0, 2, 1]), temperature=torch.tensor([1.0, 0.0, 0.7, 1.0]),
                  seed=torch.arange(batch), offset=5)
    checked = specops.ops.chain_verify(logits, drafts, probs, **kwargs)
    assert_same(specops.ops.chain_verify(logits, drafts, probs, validate=False, **kwargs), checked)
    # Row 0 of every request is always read: a NaN there raises even without full validation.
    bad = logits.clone()
    bad[2, 0, 17] = float("nan")
    with pytest.raises(ValueError, match=r"target_logits\[2, 0\] contains NaN"):
        specops.ops.chain_verify(bad, drafts, probs, validate=False, **kwargs)
    # A row the chain never reaches (request 1 has no drafts: only its row 0 is read) is checked only
    # with validate=True, and cannot change the result.
    bad = logits.clone()
    bad[1, 3, 5] = float("nan")
    assert_same(specops.ops.chain_verify(bad, drafts, probs, validate=False, **kwargs), checked)
    with pytest.raises(ValueError, match=r"target_logits\[1, 3\] contains NaN"):
        specops.ops.chain_verify(bad, drafts, probs, **kwargs)
