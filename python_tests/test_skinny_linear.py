"""Tests of `specops.ops.skinny_linear`: input @ weight^T + bias with `torch.nn.functional.linear`'s semantics.

Implementations: "reference" (specops.reference.skinny_linear, the spec: float64, then cast), "cpp"
(torch.ops.specops.skinny_linear on CPU tensors: panels of 16 weight rows, input rows in 4x4 tiles and
the last 1-3 in <4,3>, <8,2>, <16,1> tiles, weight rows past the last panel in tail_rows, the k % 16
tail after the lane tree) and "triton" (skinny_linear_triton on the Triton device, 16 x 16 tiles unless
a test says otherwise so that the N and K tails run), all called with the op's arguments ([M, K] input).

1. Exact: permutation weights, one-hot rows and small integers (every float32 partial sum exact) give the
   reference's bits; K = 0 gives the bias; M = 0 and N = 0 give empty outputs of the right shape.
2. Agreement with the reference for M in 1..20, N and K with and without their tails, bias or none,
   leading batch dims, non-contiguous input, weight and bias, and with F.linear at a real layer's size.
   Tolerance, per output: 1e-5 of sum_k |x_k w_k| + |b|. The C++ kernel adds at most K/16 + 4 + 15 + 1
   (61 at K = 640) float32 terms in a chain, so it errs by at most 61 * 2^-24 = 3.6e-6 of that sum, the
   reference's rounding adds 2^-24; Triton's 16-wide dot steps chain fewer.
3. Batch invariance on the CPU: a row's bits do not depend on M, on its place, on which other rows come
   with it or on the number of threads.
4. Bad input raises naming the problem; the fake agrees with the kernel (opcheck, FakeTensorMode, meta,
   torch.compile).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from _triton import IMPLS, KERNELS, TRITON_DEVICE, needs_triton, triton_launcher
from torch._subclasses.fake_tensor import FakeTensorMode

import specops
from specops import reference

skinny_linear_triton = triton_launcher("skinny_linear")


def run_impl(impl: str, input, weight, bias=None, block_n=16, block_k=16):
    if impl == "reference":
        return reference.skinny_linear(input, weight, bias)
    if impl == "cpp":
        return torch.ops.specops.skinny_linear(input, weight, bias)
    moved_bias = None if bias is None else bias.to(TRITON_DEVICE)
    out = skinny_linear_triton(input.to(TRITON_DEVICE), weight.to(TRITON_DEVICE), moved_bias, block_n=block_n,
                               block_k=block_k)
    return out.cpu()


def random_case(m: int, n: int, k: int, seed: int, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


def assert_within_products(got, x, w, b, rel=1e-5):
    """|got - reference| <= rel * (sum_k |x_k w_k| + |b|) in every output (the bound: module docstring)."""
    want = reference.skinny_linear(x, w, b).double()
    scale = x.double().abs() @ w.double().abs().T
    if b is not None:
        scale = scale + b.double().abs()
    error = (got.double() - want).abs()
    assert got.shape == want.shape and got.dtype == x.dtype
    assert (error <= rel * scale).all(), f"max error {error.max():.3g}, at most {(rel * scale).max():.3g} allowed"


# Every C++ tile path: M % 4 = 0..3 below and above 4. N: under one panel, one panel, panels plus a tail.
# K: under 16 lanes, 16 - 1, exactly 16, lanes plus a tail, a long run of lanes.
ROWS = list(range(1, 21))
OUT_FEATURES = [1, 7, 16, 31, 48, 100]
IN_FEATURES = [1, 15, 16, 33, 640]


# ---- 1. exact ----

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k", [5, 16, 37])
def test_permutation_weight_picks_input_columns(impl, k):
    """weight = rows of the identity in a shuffled order (N = K: panels plus tail rows): out = x[:, perm] + b."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(k))
    weight = torch.eye(k)[perm]
    bias = torch.randn(k, generator=torch.Generator().manual_seed(1))
    for m in (1, 2, 3, 4, 7):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        assert torch.equal(run_impl(impl, x, weight), x[:, perm])
        assert torch.equal(run_impl(impl, x, weight, bias), x[:, perm] + bias)


@pytest.mark.parametrize("impl", IMPLS)
def test_one_hot_rows_pick_weight_columns(impl):
    """Input row r one-hot at column c: out[r] = weight[:, c] + b."""
    k, n = 35, 37
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    columns = [0, 1, 15, 16, 31, 32, 34, 7, 20]  # lanes and the k % 16 tail
    x = F.one_hot(torch.tensor(columns), k).float()
    out = run_impl(impl, x, weight, bias)
    assert torch.equal(out, weight[:, columns].T + bias)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k", IN_FEATURES)
def test_small_integers_are_exact(impl, k):
    """Integers in [-8, 8): every product and partial sum (|.| <= 640 * 64 + 8 < 2^24) is exact in float32,
    so any summation order gives the integer result."""
    g = torch.Generator().manual_seed(k)
    n = 37
    weight = torch.randint(-8, 8, (n, k), generator=g)
    bias = torch.randint(-8, 8, (n,), generator=g)
    # Triton in the interpreter: fewer rows, and K = 640 in 64-wide steps (the 16-wide ones take seconds).
    rows = ROWS if impl != "triton" else [1, 2, 3, 4, 5, 17]
    block_k = 64 if k > 64 else 16
    for m in rows:
        x = torch.randint(-8, 8, (m, k), generator=g)
        want = x @ weight.T
        assert torch.equal(run_impl(impl, x.float(), weight.float(), block_k=block_k), want.float()), m
        assert torch.equal(run_impl(impl, x.float(), weight.float(), bias.float(), block_k=block_k),
                           (want + bias).float()), m


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_inner_dim_gives_the_bias(impl):
    bias = torch.arange(5.0)
    out = run_impl(impl, torch.zeros(3, 0), torch.zeros(5, 0), bias)
    assert torch.equal(out, bias.expand(3, 5))
    assert torch.equal(run_impl(impl, torch.zeros(3, 0), torch.zeros(5, 0)), torch.zeros(3, 5))


@pytest.mark.parametrize("shape", [(3, 0), (2, 3, 0), (0,)])
def test_wrapper_empty_inner_dim_gives_the_bias(shape):
    """F.linear with K = 0 returns the bias broadcast over the leading dims."""
    bias = torch.arange(5.0)
    out = specops.ops.skinny_linear(torch.zeros(shape), torch.zeros(5, 0), bias)
    assert torch.equal(out, F.linear(torch.zeros(shape), torch.zeros(5, 0), bias))


@pytest.mark.parametrize("impl", IMPLS)
def test_no_rows_or_no_outputs_are_empty(impl):
    x, w, b = random_case(4, 7, 9, seed=0)
    assert run_impl(impl, x[:0], w, b).shape == (0, 7)
    out = run_impl(impl, x, w[:0], b[:0])
    assert out.shape == (4, 0) and out.dtype == torch.float32


def test_no_backward_is_refused():
    """The op has no autograd kernel: with gradients on and a tensor that requires them it must raise
    rather than return an output whose backward silently gives no gradient."""
    x, w, b = random_case(2, 7, 9, seed=0)
    with pytest.raises(RuntimeError, match="no backward"):
        specops.ops.skinny_linear(x, w.requires_grad_(), b)
    with torch.no_grad():
        assert torch.equal(specops.ops.skinny_linear(x, w, b), specops.ops.skinny_linear(x, w.detach(), b))


def test_wrapper_empty_shapes():
    x, w, b = random_case(4, 7, 9, seed=0)
    assert specops.ops.skinny_linear(torch.zeros(2, 0, 9), w, b).shape == (2, 0, 7)
    assert specops.ops.skinny_linear(torch.zeros(0, 9), w).shape == (0, 7)
    assert specops.ops.skinny_linear(x.view(2, 2, 9), w[:0], b[:0]).shape == (2, 2, 0)


# ---- 2. agreement on random inputs ----

@pytest.mark.parametrize("k", IN_FEATURES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_cpp_matches_reference(k, bias):
    for m in ROWS:
        for n in OUT_FEATURES:
            x, w, b = random_case(m, n, k, seed=1000 * m + n, bias=bias)
            assert_within_products(run_impl("cpp", x, w, b), x, w, b)


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("k", [1, 15, 16, 33, 80])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_triton_matches_reference(k, bias):
    """16 x 16 tiles: N and K tails masked; M = 17 and 20 take a second row block."""
    for m in (1, 2, 3, 4, 5, 16, 17, 20):
        for n in (7, 16, 33):
            x, w, b = random_case(m, n, k, seed=1000 * m + n, bias=bias)
            assert_within_products(run_impl("triton", x, w, b), x, w, b)


@needs_triton
def test_triton_default_tiles():
    x, w, b = random_case(9, 100, 640, seed=5)
    assert_within_products(skinny_linear_triton(x.to(TRITON_DEVICE), w.to(TRITON_DEVICE), b.to(TRITON_DEVICE)).cpu(),
                           x, w, b)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_16_bit(dtype):
    """float32 accumulation from the same 16-bit inputs, rounded once: one ulp of the output's dtype."""
    x, w, b = (t.to(dtype) for t in random_case(5, 40, 72, seed=3))
    got = run_impl("triton", x, w, b).float()
    want = reference.skinny_linear(x, w, b).float()
    ulp = torch.finfo(dtype).eps
    scale = x.float().abs() @ w.float().abs().T + b.float().abs()
    assert ((got - want).abs() <= ulp * want.abs() + 1e-5 * scale).all()


@pytest.mark.parametrize("impl", KERNELS)
def test_non_contiguous_arguments(impl):
    """A transposed input, a strided input slice, a transposed weight and a strided bias."""
    g = torch.Generator().manual_seed(7)
    m, n, k = 6, 37, 33
    x_t = torch.randn(k, m, generator=g).T
    x_strided = torch.randn(m, 2 * k, generator=g)[:, ::2]
    w_t = torch.randn(k, n, generator=g).T
    b_strided = torch.randn(2 * n, generator=g)[::2]
    assert not (x_t.is_contiguous() or x_strided.is_contiguous() or w_t.is_contiguous() or b_strided.is_contiguous())
    for x in (x_t, x_strided):
        for w in (w_t, w_t.contiguous()):
            for b in (None, b_strided):
                got = run_impl(impl, x, w, b)
                assert_within_products(got, x, w, b)
                assert torch.equal(got, run_impl(impl, x.contiguous(), w.contiguous(),
                                                 None if b is None else b.contiguous()))


def test_wrapper_matches_reference(device):
    """Leading batch dims ([2, 3, K] gives [2, 3, N]), a 1-D input ([K] gives [N]), with and without bias."""
    x, w, b = random_case(6, 37, 33, seed=11)
    x, w, b = x.to(device), w.to(device), b.to(device)
    for bias in (None, b):
        out = specops.ops.skinny_linear(x.view(2, 3, 33), w, bias)
        assert out.shape == (2, 3, 37)
        assert_within_products(out.reshape(6, 37).cpu(), x.cpu(), w.cpu(), None if bias is None else bias.cpu())
        out = specops.ops.skinny_linear(x[2], w, bias)
        assert out.shape == (37,)
        assert torch.equal(out, specops.ops.skinny_linear(x[2:3], w, bias)[0])
    assert torch.equal(specops.ops.skinny_linear(x, w), specops.ops.skinny_linear(x, w, bias=None))


@pytest.mark.parametrize("m", [1, 4, 9])
def test_matches_f_linear_on_a_real_layer(m):
    """A 4096 x 640 projection (Gemma-3-270M's MLP width): 256 panels split across threads."""
    x, w, b = random_case(m, 4096, 640, seed=m)
    got = specops.ops.skinny_linear(x, w, b)
    want = F.linear(x, w, b)
    scale = x.abs() @ w.abs().T + b.abs()
    # Both sides err by at most 3.6e-6 of scale in float32 (F.linear's BLAS order included).
    assert ((got - want).abs() <= 1e-5 * scale).all(), (got - want).abs().max()
    assert_within_products(got, x, w, b)


# ---- 3. batch invariance (the C++ kernel) ----

@pytest.mark.parametrize("k", [83, 640])
def test_row_bits_do_not_depend_on_the_batch(k):
    """Each row of x[:M] for M = 1..20 and of random subsets in random orders equals, bit for bit, the row
    computed alone: every tile shape (4x4, <4,3>, <8,2>, <16,1>, <2,5> to <2,8>) and tail_rows give one
    result."""
    x, w, b = random_case(20, 37, k, seed=k)
    rng = random.Random(k)
    for bias in (None, b):
        alone = torch.cat([specops.ops.skinny_linear(x[r:r + 1], w, bias) for r in range(20)])
        for m in ROWS:
            assert torch.equal(specops.ops.skinny_linear(x[:m], w, bias), alone[:m]), m
            assert torch.equal(specops.ops.skinny_linear(x[20 - m:], w, bias), alone[20 - m:]), m
        for _ in range(30):
            rows = rng.sample(range(20), rng.randint(1, 20))
            assert torch.equal(specops.ops.skinny_linear(x[rows], w, bias), alone[rows]), rows


def test_row_bits_do_not_depend_on_leading_dims():
    x, w, b = random_case(12, 37, 83, seed=2)
    flat = specops.ops.skinny_linear(x, w, b)
    assert torch.equal(specops.ops.skinny_linear(x.view(3, 4, 83), w, b), flat.view(3, 4, 37))
    assert torch.equal(specops.ops.skinny_linear(x.T.contiguous().T, w, b), flat)  # column-major input


def test_thread_count_does_not_change_the_bits():
    """N = 1029, K = 647: 64 panels in tasks of 6 (the 256 KB grain) and 5 tail rows."""
    x, w, b = random_case(7, 1029, 647, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = specops.ops.skinny_linear(x, w, b)
        torch.set_num_threads(2)
        two = specops.ops.skinny_linear(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert_within_products(two, x, w, b)


# ---- 4. bad input, and the fake ----

def _bad(**change):
    x, w, b = random_case(3, 5, 8, seed=0)
    args = {"input": x, "weight": w, "bias": b}
    args.update(change)
    return args


# change to the valid arguments, error, message: the op's checks (the C++ kernel's on CPU, its contract's
# elsewhere); the wrapper itself refuses only a non-tensor.
BAD = [
    ({"input": [[1.0] * 8] * 3}, TypeError, "skinny_linear: input must be a tensor, got list"),
    ({"input": torch.tensor(1.0)}, ValueError, r"input must be \[M, K\] and weight \[N, K\]"),
    ({"weight": torch.zeros(8)}, ValueError, r"input must be \[M, K\] and weight \[N, K\]"),
    ({"weight": torch.zeros(1, 5, 8)}, ValueError, r"input must be \[M, K\] and weight \[N, K\]"),
    ({"weight": torch.zeros(5, 7)}, ValueError, r"weight must be \[N, K\] with K = 8, got \[5, 7\]"),
    ({"weight": "weight"}, TypeError, "weight must be a tensor, got str"),
    ({"bias": torch.zeros(4)}, ValueError, r"bias must be float32 \[N\] with N = 5"),
    ({"bias": torch.zeros(1, 5)}, ValueError, r"bias must be float32 \[N\] with N = 5"),
    ({"bias": 1.0}, TypeError, "bias must be a tensor or None, got float"),
    ({"input": torch.zeros(3, 8, dtype=torch.float64), "weight": torch.zeros(5, 8, dtype=torch.float64),
     "bias": None}, TypeError, "the CPU kernel takes float32 input and weight"),
    ({"input": torch.zeros(3, 8, dtype=torch.bfloat16), "weight": torch.zeros(5, 8, dtype=torch.bfloat16),
     "bias": None}, TypeError, "the CPU kernel takes float32 input and weight"),
    ({"input": torch.zeros(3, 8, dtype=torch.int64)}, TypeError, "the CPU kernel takes float32 input"),
    ({"weight": torch.zeros(5, 8, dtype=torch.float64)}, TypeError, "the CPU kernel takes float32 input and weight"),
    ({"bias": torch.zeros(5, dtype=torch.float16)}, ValueError, r"bias must be float32 \[N\] with N = 5"),
    ({"weight": torch.zeros(5, 8, device="meta")}, ValueError, "weight is on meta but input is on cpu"),
    ({"bias": torch.zeros(5, device="meta")}, ValueError, "bias is on meta but input is on cpu"),
]


@pytest.mark.parametrize("change,error,match", BAD)
def test_bad_arguments(change, error, match):
    args = _bad(**change)
    with pytest.raises(error, match=match):
        specops.ops.skinny_linear(args["input"], args["weight"], args["bias"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_devices_must_match_on_cuda():
    args = _bad()
    with pytest.raises(ValueError, match="weight is on cuda:0 but input is on cpu"):
        specops.ops.skinny_linear(args["input"], args["weight"].cuda(), args["bias"])


def test_cpp_kernel_checks_its_arguments():
    """The op called directly (no wrapper) refuses what its kernel cannot run."""
    x, w, b = random_case(3, 5, 8, seed=0)
    op = torch.ops.specops.skinny_linear
    with pytest.raises(TypeError, match="the CPU kernel takes float32"):
        op(x.double(), w.double(), None)
    with pytest.raises(ValueError, match=r"input must be \[M, K\] and weight \[N, K\]"):
        op(x.view(3, 2, 4), w, b)
    with pytest.raises(ValueError, match=r"weight must be \[N, K\] with K = 8, got \[5, 7\]"):
        op(x, w[:, :7], b)
    with pytest.raises(ValueError, match="bias must be float32 \\[N\\] with N = 5"):
        op(x, w, b[:4])


@pytest.mark.parametrize("m", [0, 1, 5])
def test_opcheck(m):
    x, w, b = random_case(m, 37, 33, seed=m)
    for bias in (None, b):
        torch.library.opcheck(torch.ops.specops.skinny_linear.default, (x, w, bias))


def test_fake_and_meta_shapes():
    with FakeTensorMode():
        out = specops.ops.skinny_linear(torch.empty(2, 3, 33), torch.empty(37, 33), torch.empty(37))
        assert out.shape == (2, 3, 37) and out.dtype == torch.float32
    out = specops.ops.skinny_linear(torch.empty(4, 33, device="meta"), torch.empty(37, 33, device="meta"))
    assert out.shape == (4, 37) and out.device.type == "meta" and out.is_contiguous()


def test_torch_compile_matches_eager():
    # aot_eager traces the op through its fake with fullgraph and skips Inductor's C++ build (seconds here).
    x, w, b = random_case(5, 37, 33, seed=9)

    def project(rows):
        return specops.ops.skinny_linear(rows, w, b) * 2

    compiled = torch.compile(project, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x.view(5, 1, 33)), project(x.view(5, 1, 33)))
