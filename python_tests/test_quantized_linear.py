"""Tests of `specops.ops.quantized_linear`: input @ W^T + bias with W stored as bfloat16, as int8 with
per-group scales, or as int4 (two per uint8 byte, ggml's Q4_1 block layout) with per-group scales and
minimums, de-quantized as it is read.

Implementations: "reference" (specops.reference.quantized_linear: de-quantized in float64, the product in
float64, then cast), "cpp" (torch.ops.specops.quantized_linear on CPU tensors: skinny_linear's panels and
tiles with the weight de-quantized in registers) and "triton" (quantized_linear_triton on the Triton
device, 16 x 32 tiles unless a test says otherwise, so that the N and K tails run), all called with the
op's arguments ([M, K] input).

1. Exact: one-hot input rows give the de-quantized weight's columns; a hand-packed int4 weight gives its
   known rows (the nibble layout); K = 0 gives the bias; M = 0 and N = 0 give empty outputs.
2. Agreement with the reference for every format, per-channel (G = 1) and grouped (groups of 32 and 64
   weights), M in 1, 2, 3, 4, 5, 8, 17, N = 37 (not a multiple of 16), K = 50 (not a multiple of 16) for
   bfloat16 and int8, bias or none. Tolerance, per output, as a fraction of
   S = sum_k |x_k| (|q_k s_g| + |m_g|) + |b| (>= sum_k |x_k w_k| + |b|), u = 2^-24:
   - de-quantization in float32: bfloat16 exact; int8's q * s one rounding; int4's q * s + m one rounding
     where the compiler fuses it, else two (2^-24 |q s| + 2^-24 |q s + m|): at most 2u S;
   - products and sums: the C++ kernel adds at most K/16 + 4 (lane tree) + 15 (k % 16 tail) + 1 (bias)
     terms in a chain, each a rounding of a partial sum <= S, and rounds each product at most once:
     (K/16 + 21)u S; Triton's tl.dot in its own order: at most (K + 1)u S;
   - the reference's cast to float32: u S.
   So (K/16 + 25)u S for the C++ kernel (3.9e-6 at K = 640) and (K + 5)u S for Triton (IEEE float32
   products: torch's default, allow_tf32 off). For 16-bit inputs (Triton) the de-quantized weight is also
   rounded to the input's type, one eps of 16 bits (the interpreter truncates: up to eps, not eps/2) of S,
   and both sides round the output once: 2 eps |out|.
3. The C++ kernel: a row's bits do not depend on M, on its place, on the other rows or on the number of
   threads; and they equal skinny_linear's on the float32 de-quantized weight (the same tiles, lanes and
   tree) wherever that weight is exact: bfloat16, int8 (q * s is one rounding in both), int4 with dyadic
   scales and minimums (q * s + m exact).
4. The tolerance is not vacuous: a wrongly packed or wrongly grouped int4 weight fails it.
5. Bad input raises naming the problem, in the wrapper and in the C++ kernel called directly (RuntimeError,
   never a crash); the fake agrees with the kernel (opcheck, FakeTensorMode, meta, torch.compile).
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

quantized_linear_triton = triton_launcher("quantized_linear")

FORMATS = ["bf16", "int8", "int4"]
U = 2.0**-24  # float32's unit roundoff
# M for Triton (slow in the interpreter): 1 to 8 rows of one 16-row block, and two blocks (M = 17).
TRITON_ROWS = [1, 2, 3, 4, 5, 8, 17]
ROWS = list(range(1, 21))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 packed as the op takes it: in each block of 32 weights, byte j = q[j] | q[j + 16] << 4.
    Written here from the format's definition, independently of specops.reference.dequantize."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def make_weight(fmt: str, n: int, k: int, group: int | None = None, seed: int = 0, dyadic: bool = False):
    """(weight, scales, mins) of `fmt` for an [N, K] matrix: groups of `group` weights (None: per channel).
    dyadic: int4 scales 2^-e and minimums j / 64, so that every q * s + m is exact in float32."""
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group is None else k // group
    if fmt == "bf16":
        return torch.randn(n, k, generator=g).bfloat16(), None, None
    if fmt == "int8":
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        return q, torch.rand(n, groups, generator=g) * 0.02 + 1e-3, None
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    if dyadic:
        scales = 2.0 ** -torch.randint(2, 8, (n, groups), generator=g).float()
        mins = torch.randint(-64, 64, (n, groups), generator=g).float() / 64
    else:
        scales = torch.rand(n, groups, generator=g) * 0.1 + 0.01
        mins = -8 * scales * (0.5 + torch.rand(n, groups, generator=g))  # about symmetric around zero
    return pack_int4(q), scales, mins


def float32_weight(weight, scales, mins) -> torch.Tensor:
    """The float32 weight torch de-quantizes in float32: weight, q * s or (q * s) + m, each op rounded."""
    if weight.dtype == torch.bfloat16:
        return weight.float()
    q = reference.dequantize(weight, torch.ones_like(scales)).float()  # the integers, exact
    per_k = q.shape[1] // scales.shape[1]
    out = q * scales.repeat_interleave(per_k, dim=1)
    return out if mins is None else out + mins.repeat_interleave(per_k, dim=1)


def random_case(fmt: str, m: int, n: int, k: int, group: int | None = None, seed: int = 0, bias: bool = True,
                dyadic: bool = False):
    weight, scales, mins = make_weight(fmt, n, k, group, seed, dyadic)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return x, weight, scales, mins, b


def run_impl(impl: str, input, weight, scales=None, mins=None, bias=None, block_n=16, block_k=32):
    if impl == "reference":
        return reference.quantized_linear(input, weight, scales, mins, bias)
    if impl == "cpp":
        return torch.ops.specops.quantized_linear(input, weight, scales, mins, bias)
    moved = [None if t is None else t.to(TRITON_DEVICE) for t in (input, weight, scales, mins, bias)]
    return quantized_linear_triton(*moved, block_n=block_n, block_k=block_k).cpu()


def magnitude(x, weight, scales, mins, bias) -> torch.Tensor:
    """S of the module docstring, per output: sum_k |x_k| (|q_k s_g| + |m_g|) + |b|, in float64."""
    if weight.dtype == torch.bfloat16:
        w_abs = weight.double().abs()
    else:
        w_abs = reference.dequantize(weight, scales).abs()
        if mins is not None:
            w_abs = w_abs + mins.double().abs().repeat_interleave(w_abs.shape[1] // mins.shape[1], dim=1)
    s = x.double().abs() @ w_abs.T
    return s if bias is None else s + bias.double().abs()


def relative_bound(impl: str, k: int) -> float:
    """The error bound of the module docstring, as a fraction of S."""
    return (k // 16 + 25) * U if impl == "cpp" else (k + 5) * U


def within_bound(got, x, weight, scales, mins, bias, rel) -> tuple[bool, str]:
    want = reference.quantized_linear(x, weight, scales, mins, bias).double()
    allowed = rel * magnitude(x, weight, scales, mins, bias)
    error = (got.double() - want).abs()
    ok = got.shape == want.shape and got.dtype == x.dtype and bool((error <= allowed).all())
    return ok, f"max error {error.max():.3g}, at most {allowed.min():.3g}-{allowed.max():.3g} allowed"


def assert_within_bound(impl, got, x, weight, scales, mins, bias):
    ok, message = within_bound(got, x, weight, scales, mins, bias, relative_bound(impl, x.shape[1]))
    assert ok, message


# (format, K, group) for the agreement tests: bf16 and per-channel int8 with a k % 16 tail, int4 per channel,
# and groups of 32 and 64 weights.
CASES = [("bf16", 50, None), ("int8", 50, None), ("int8", 128, 32), ("int8", 128, 64), ("int4", 64, None),
         ("int4", 128, 32), ("int4", 128, 64)]
CASE_IDS = [f"{fmt}-K{k}-{'g' + str(group) if group else 'per_channel'}" for fmt, k, group in CASES]


# ---- 1. exact ----

def test_pack_int4_matches_the_reference_layout():
    """The reference unpacks what pack_int4 packs (both written from the format's definition)."""
    q = torch.randint(0, 16, (5, 96), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    ones, zeros = torch.ones(5, 1), torch.zeros(5, 1)
    assert torch.equal(reference.dequantize(pack_int4(q), ones, zeros), q.double())


# Two rows of K = 64 (two blocks of 32), bytes written by hand. Row 0: block 0 bytes j = j | (15 - j) << 4,
# so weights 0..15 are 0..15 and weights 16..31 are 15..0; block 1 all 0xA5: 5 (low) then 10 (high).
# Row 1: block 0 all 0x0F (15 then 0), block 1 byte j = j << 4 (0 then 0..15).
HAND_BYTES = [[j | (15 - j) << 4 for j in range(16)] + [0xA5] * 16,
              [0x0F] * 16 + [j << 4 for j in range(16)]]
HAND_Q = [list(range(16)) + list(range(15, -1, -1)) + [5] * 16 + [10] * 16,
          [15] * 16 + [0] * 16 + [0] * 16 + list(range(16))]


@pytest.mark.parametrize("impl", IMPLS)
def test_int4_nibble_layout(impl):
    """The identity input reads the hand-packed rows back: per channel (scale 1, min 0) and in two groups
    of 32 with their own scales and minimums (powers of two: exact)."""
    weight = torch.tensor(HAND_BYTES, dtype=torch.uint8)
    q = torch.tensor(HAND_Q, dtype=torch.float32)
    eye = torch.eye(64)
    assert torch.equal(run_impl(impl, eye, weight, torch.ones(2, 1), torch.zeros(2, 1)), q.T)
    scales = torch.tensor([[0.5, 2.0], [0.25, -1.0]])
    mins = torch.tensor([[-4.0, 1.0], [0.0, -8.0]])
    want = q * scales.repeat_interleave(32, dim=1) + mins.repeat_interleave(32, dim=1)
    assert want[0, 16] == 15 * 0.5 - 4 and want[1, 63] == 15 * -1.0 - 8  # the layout, spelled out once
    assert torch.equal(run_impl(impl, eye, weight, scales, mins), want.T)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_hot_rows_pick_dequantized_columns(impl, fmt):
    """Input row r one-hot at column c: out[r] = W[:, c] (+ b), W the float32 de-quantized weight (exact for
    bf16 and for int8's single rounding; int4 with dyadic parameters), the bias added in float32 (the
    reference adds it to the float64 weight, then rounds once). Columns in lanes and tails of every kind,
    and both groups."""
    k = 64 if fmt == "int4" else 50
    weight, scales, mins = make_weight(fmt, 37, k, group=32 if fmt != "bf16" and k == 64 else None, seed=3,
                                       dyadic=True)
    bias = torch.randn(37, generator=torch.Generator().manual_seed(1))
    columns = [0, 1, 15, 16, 31, 32, 47, 48, 49, 7, 20]
    x = F.one_hot(torch.tensor(columns), k).float()
    w = float32_weight(weight, scales, mins)
    assert torch.equal(run_impl(impl, x, weight, scales, mins), w[:, columns].T)
    if impl == "reference":
        with_bias = (reference.dequantize(weight, scales, mins)[:, columns].T + bias.double()).float()
    else:
        with_bias = w[:, columns].T + bias
    assert torch.equal(run_impl(impl, x, weight, scales, mins, bias), with_bias)


def _empty_weight(fmt: str, n: int, k: int):
    if fmt == "bf16":
        return torch.zeros(n, k, dtype=torch.bfloat16), None, None
    if fmt == "int8":
        return torch.zeros(n, k, dtype=torch.int8), torch.ones(n, 1), None
    return torch.zeros(n, k // 2, dtype=torch.uint8), torch.ones(n, 1), torch.ones(n, 1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_inner_dim_gives_the_bias(impl, fmt):
    bias = torch.arange(5.0)
    weight, scales, mins = _empty_weight(fmt, 5, 0)
    assert torch.equal(run_impl(impl, torch.zeros(3, 0), weight, scales, mins, bias), bias.expand(3, 5))
    assert torch.equal(run_impl(impl, torch.zeros(3, 0), weight, scales, mins), torch.zeros(3, 5))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_no_rows_or_no_outputs_are_empty(impl, fmt):
    x, weight, scales, mins, b = random_case(fmt, 4, 7, 64, seed=0)
    assert run_impl(impl, x[:0], weight, scales, mins, b).shape == (0, 7)
    out = run_impl(impl, x, weight[:0], None if scales is None else scales[:0], None if mins is None else mins[:0],
                   b[:0])
    assert out.shape == (4, 0) and out.dtype == torch.float32


@pytest.mark.parametrize("fmt", FORMATS)
def test_wrapper_empty_shapes(fmt):
    weight, scales, mins = _empty_weight(fmt, 5, 0)
    bias = torch.arange(5.0)
    out = specops.ops.quantized_linear(torch.zeros(2, 3, 0), weight, scales, mins, bias)
    assert torch.equal(out, bias.expand(2, 3, 5))
    _, weight, scales, mins, b = random_case(fmt, 1, 7, 64, seed=0)
    assert specops.ops.quantized_linear(torch.zeros(2, 0, 64), weight, scales, mins, b).shape == (2, 0, 7)
    assert specops.ops.quantized_linear(torch.zeros(0, 64), weight, scales, mins).shape == (0, 7)
    no_scales = None if scales is None else scales[:0]
    no_mins = None if mins is None else mins[:0]
    out = specops.ops.quantized_linear(torch.zeros(2, 2, 64), weight[:0], no_scales, no_mins, b[:0])
    assert out.shape == (2, 2, 0)


# ---- 2. agreement on random inputs ----

@pytest.mark.parametrize("fmt,k,group", CASES + [("bf16", 640, None), ("int8", 640, None), ("int4", 640, None),
                                                  ("int4", 640, 64)],
                         ids=CASE_IDS + ["bf16-K640", "int8-K640", "int4-K640", "int4-K640-g64"])
def test_cpp_matches_reference(fmt, k, group):
    """Every C++ tile path (M % 4 = 0..3 below and above 4), N under one panel, one panel, panels and tail rows."""
    for m in ROWS:
        for n in (5, 16, 37):
            x, weight, scales, mins, b = random_case(fmt, m, n, k, group, seed=1000 * m + n, bias=m % 2 == 1)
            assert_within_bound("cpp", run_impl("cpp", x, weight, scales, mins, b), x, weight, scales, mins, b)


@needs_triton
@pytest.mark.parametrize("fmt,k,group", CASES, ids=CASE_IDS)
def test_triton_matches_reference(fmt, k, group):
    """16 x 32 tiles: N = 37 and K = 50 tails masked; M = 17 takes a second row block; bias on odd M."""
    for m in TRITON_ROWS:
        x, weight, scales, mins, b = random_case(fmt, m, 37, k, group, seed=1000 * m + k, bias=m % 2 == 1)
        assert_within_bound("triton", run_impl("triton", x, weight, scales, mins, b), x, weight, scales, mins, b)


@needs_triton
@pytest.mark.parametrize("block_k", [16, 64, 128])
def test_triton_int4_tiles_across_blocks_and_groups(block_k):
    """K steps of half a 32-weight block (only low or only high nibbles per step), of two blocks (two groups
    of 32 per step), and one step past K = 96 (the masked bytes are past the row's end)."""
    for m in (1, 5):
        x, weight, scales, mins, b = random_case("int4", m, 37, 96, 32, seed=m)
        got = run_impl("triton", x, weight, scales, mins, b, block_k=block_k)
        assert_within_bound("triton", got, x, weight, scales, mins, b)


@needs_triton
@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_default_tiles(fmt):
    x, weight, scales, mins, b = random_case(fmt, 9, 100, 640, 64 if fmt != "bf16" else None, seed=5)
    moved = [None if t is None else t.to(TRITON_DEVICE) for t in (x, weight, scales, mins, b)]
    got = quantized_linear_triton(*moved)
    assert_within_bound("triton", got.cpu(), x, weight, scales, mins, b)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_16_bit(fmt, dtype):
    """16-bit input and bias: the output in their type, within the bound of the module docstring."""
    x, weight, scales, mins, b = random_case(fmt, 5, 37, 64, 32 if fmt != "bf16" else None, seed=3)
    x, b = x.to(dtype), b.to(dtype)
    got = run_impl("triton", x, weight, scales, mins, b).double()
    want = reference.quantized_linear(x, weight, scales, mins, b).double()
    eps = torch.finfo(dtype).eps
    allowed = 2 * eps * want.abs() + (eps + (64 + 5) * U) * magnitude(x, weight, scales, mins, b)
    assert ((got - want).abs() <= allowed).all(), (got - want).abs().max()


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_non_contiguous_arguments(impl, fmt):
    """A transposed input, a strided input slice, a transposed weight, strided scales, mins and bias."""
    g = torch.Generator().manual_seed(7)
    m, n, k = 6, 37, 64
    x_t = torch.randn(k, m, generator=g).T
    x_strided = torch.randn(m, 2 * k, generator=g)[:, ::2]
    weight, scales, mins = make_weight(fmt, n, k, 32 if fmt != "bf16" else None, seed=7)
    w_t = weight.T.contiguous().T
    s_strided = None if scales is None else torch.stack([scales, scales], dim=-1)[..., 0]
    m_strided = None if mins is None else torch.stack([mins, mins], dim=-1)[..., 0]
    b_strided = torch.randn(2 * n, generator=g)[::2]
    assert not any(t.is_contiguous() for t in (x_t, x_strided, w_t, b_strided))
    assert s_strided is None or not s_strided.is_contiguous()
    want = run_impl(impl, x_t.contiguous(), weight, scales, mins, b_strided.contiguous())
    assert_within_bound(impl, want, x_t, weight, scales, mins, b_strided)
    assert torch.equal(run_impl(impl, x_t, w_t, s_strided, m_strided, b_strided), want)
    assert torch.equal(run_impl(impl, x_strided, weight, scales, mins),
                       run_impl(impl, x_strided.contiguous(), weight, scales, mins))


@pytest.mark.parametrize("fmt", FORMATS)
def test_wrapper_matches_reference(device, fmt):
    """Leading batch dims ([2, 3, K] gives [2, 3, N]), a 1-D input ([K] gives [N]), with and without bias."""
    x, weight, scales, mins, b = random_case(fmt, 6, 37, 64, 32 if fmt != "bf16" else None, seed=11)
    on = [None if t is None else t.to(device) for t in (x, weight, scales, mins, b)]
    impl = "cpp" if device == "cpu" else "triton"
    for bias in (None, on[4]):
        out = specops.ops.quantized_linear(on[0].view(2, 3, 64), on[1], on[2], on[3], bias)
        assert out.shape == (2, 3, 37)
        assert_within_bound(impl, out.reshape(6, 37).cpu(), x, weight, scales, mins, None if bias is None else b)
        out = specops.ops.quantized_linear(on[0][2], on[1], on[2], on[3], bias)
        assert out.shape == (37,)
        assert torch.equal(out, specops.ops.quantized_linear(on[0][2:3], on[1], on[2], on[3], bias)[0])
    assert torch.equal(specops.ops.quantized_linear(on[0], on[1], on[2], on[3]),
                       specops.ops.quantized_linear(on[0], on[1], scales=on[2], mins=on[3], bias=None))


# ---- 3. the C++ kernel: batch invariance, and skinny_linear's bits ----

@pytest.mark.parametrize("fmt", FORMATS)
def test_row_bits_do_not_depend_on_the_batch(fmt):
    """Each row of x[:M] for M = 1..20 and of random subsets in random orders equals, bit for bit, the row
    computed alone: every tile shape (4x4, <4,3>, <8,2>, <16,1>) and the rows past the last panel."""
    k = 96 if fmt == "int4" else 83
    x, weight, scales, mins, b = random_case(fmt, 20, 37, k, seed=k)
    rng = random.Random(k)
    for bias in (None, b):
        params = (weight, scales, mins, bias)
        alone = torch.cat([specops.ops.quantized_linear(x[r:r + 1], *params) for r in range(20)])
        for m in ROWS:
            assert torch.equal(specops.ops.quantized_linear(x[:m], *params), alone[:m]), m
            assert torch.equal(specops.ops.quantized_linear(x[20 - m:], *params), alone[20 - m:]), m
        for _ in range(30):
            subset = rng.sample(range(20), rng.randint(1, 20))
            assert torch.equal(specops.ops.quantized_linear(x[subset], *params), alone[subset]), subset


@pytest.mark.parametrize("fmt", FORMATS)
def test_thread_count_does_not_change_the_bits(fmt):
    """N = 1029, K = 640: 64 panels in several tasks (at least 256 KB of weight each) and 5 tail rows."""
    x, weight, scales, mins, b = random_case(fmt, 7, 1029, 640, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = specops.ops.quantized_linear(x, weight, scales, mins, b)
        torch.set_num_threads(2)
        two = specops.ops.quantized_linear(x, weight, scales, mins, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert_within_bound("cpp", two, x, weight, scales, mins, b)


@pytest.mark.parametrize("fmt,group,dyadic", [("bf16", None, False), ("int8", None, False), ("int8", 32, False),
                                               ("int4", None, True), ("int4", 32, True)],
                         ids=["bf16", "int8-per_channel", "int8-g32", "int4-dyadic", "int4-g32-dyadic"])
def test_cpp_gives_skinny_linear_bits(fmt, group, dyadic):
    """The C++ kernel sums as skinny_linear does, so on the same float32 weights it gives the same bits.
    int8: q * s rounds once in the kernel and in torch. int4 only with dyadic parameters: the kernel's
    q * s + m may be one fused multiply-add (the compiler contracts it where the instruction set has FMA),
    one rounding where torch's float32 (q * s) + m takes two, so arbitrary scales and minimums can differ
    by a float32 rounding of the weight (within the tolerance of section 2)."""
    # K % 16 of 2 and of 12 (a long scalar tail: with 2 only, a tail summed differently went unseen).
    for k in ((64,) if fmt == "int4" or group else (50, 60)):
        for m in (1, 3, 4, 9, 16):
            x, weight, scales, mins, b = random_case(fmt, m, 37, k, group, seed=m, dyadic=dyadic)
            want = specops.ops.skinny_linear(x, float32_weight(weight, scales, mins), b)
            assert torch.equal(specops.ops.quantized_linear(x, weight, scales, mins, b), want), (k, m)


# ---- 4. the tolerance rejects plausible bugs ----

def test_tolerance_rejects_wrong_int4_layouts():
    """The C++ kernel on a weight packed the wrong way, against the reference on the right one, is
    outside the bound: nibbles swapped, sequential pairs (byte j = q[2j] | q[2j + 1] << 4), scales and
    minimums of the neighbouring group. The right packing is inside it."""
    x, weight, scales, mins, _ = random_case("int4", 3, 37, 128, 32, seed=1, bias=False)
    q = reference.dequantize(weight, torch.ones(37, 1)).to(torch.uint8)
    rel = relative_bound("cpp", 128)
    assert within_bound(run_impl("cpp", x, weight, scales, mins), x, weight, scales, mins, None, rel)[0]
    swapped = (weight << 4) | (weight >> 4)
    sequential = q[:, 0::2] | (q[:, 1::2] << 4)
    wrong = [(swapped, scales, mins), (sequential, scales, mins), (weight, scales.roll(1, 1), mins.roll(1, 1))]
    for bad_weight, bad_scales, bad_mins in wrong:
        got = run_impl("cpp", x, bad_weight, bad_scales, bad_mins)
        assert not within_bound(got, x, weight, scales, mins, None, rel)[0]


# ---- 5. bad input, and the fake ----

W8, S8 = torch.zeros(5, 64, dtype=torch.int8), torch.ones(5, 1)
W4, S4 = torch.zeros(5, 32, dtype=torch.uint8), torch.ones(5, 2)
WB = torch.zeros(5, 64, dtype=torch.bfloat16)
X = torch.zeros(3, 64)

# (input, weight, scales, mins, bias), error, message: the op's checks (the C++ kernel's on CPU, its contract's
# elsewhere); the wrapper itself refuses only a non-tensor.
BAD = [
    (([[1.0] * 64], W8, S8, None, None), TypeError, "quantized_linear: input must be a tensor, got list"),
    ((torch.tensor(1.0), W8, S8, None, None), ValueError, r"input must be float32 \[M, K\]"),
    ((X.double(), W8, S8, None, None), ValueError, r"input must be float32 \[M, K\]"),
    ((X.bfloat16(), WB, None, None, None), ValueError, r"input must be float32 \[M, K\]"),
    ((X, W8[0], S8, None, None), ValueError, "weight must be 2-D"),
    ((X, "weight", S8, None, None), TypeError, "weight must be a tensor, got str"),
    ((X, torch.zeros(5, 64), None, None, None), TypeError,
     r"weight must be bfloat16, int8 or uint8 \(packed int4\), got Float"),
    ((X, W8.short(), S8, None, None), TypeError, r"weight must be bfloat16, int8 or uint8 \(packed int4\), got Short"),
    ((X, WB[:, :60], None, None, None), ValueError, r"a bfloat16 weight must be \[N, K\] with K = 64"),
    ((X, W8[:, :63], S8, None, None), ValueError, r"an int8 weight must be \[N, K\] with K = 64"),
    ((X, torch.zeros(5, 64, dtype=torch.uint8), S4, S4, None), ValueError,
     r"an int4 \(uint8\) weight must be \[N, K / 2\] with K = 64"),
    ((torch.zeros(3, 48), torch.zeros(5, 24, dtype=torch.uint8), S8, S8, None), ValueError,
     "int4 weights need K a multiple of 32, got 48"),
    ((X, WB, S8, None, None), ValueError, "bfloat16 weight takes no scales"),
    ((X, WB, None, S8, None), ValueError, "a bfloat16 weight takes no scales or mins"),
    ((X, W8, S8, S8, None), ValueError, "int8 weights are symmetric: no mins"),
    ((X, W8, None, None, None), ValueError, "this weight format needs scales"),
    ((X, W4, S4, None, None), ValueError, "this weight format needs mins"),
    ((X, W4, None, S4, None), ValueError, "this weight format needs scales"),
    ((X, W8, torch.ones(5), None, None), ValueError, r"scales must be float32 \[N, G\] with N = 5"),
    ((X, W8, torch.ones(4, 1), None, None), ValueError, r"scales must be float32 \[N, G\] with N = 5"),
    ((X, W8, S8.double(), None, None), ValueError, r"scales must be float32 \[N, G\] with N = 5"),
    ((X, W4, S4, S4.half(), None), ValueError, r"mins must be float32 \[N, G\] with N = 5"),
    ((X, W8, torch.ones(5, 3), None, None), ValueError,
     r"scales \[N, G\] must split K = 64 into G groups of a multiple of 32 \(or G = 1\)"),  # G does not divide K
    ((X, W8, torch.ones(5, 4), None, None), ValueError,
     r"scales \[N, G\] must split K = 64 into G groups of a multiple of 32"),  # groups of 16
    ((torch.zeros(3, 96), W8.repeat(1, 2)[:, :96], torch.ones(5, 2), None, None), ValueError,
     r"scales \[N, G\] must split K = 96 into G groups of a multiple of 32"),  # groups of 48
    ((X, W8, torch.ones(5, 0), None, None), ValueError, r"scales must be float32 \[N, G\] with N = 5"),  # G = 0
    ((X, W4, S4, S8, None), ValueError, "mins must have the shape of scales"),
    ((X, W8, S8, None, torch.zeros(4)), ValueError, r"bias must be float32 \[N\] with N = 5"),
    ((X, W8, S8, None, 1.0), TypeError, "bias must be a tensor or None, got float"),
    ((X, W8, S8, None, torch.zeros(5, dtype=torch.float64)), ValueError, r"bias must be float32 \[N\] with N = 5"),
    ((X, W8.to("meta"), S8, None, None), ValueError, "weight is on meta but input is on cpu"),
    ((X, W8, S8.to("meta"), None, None), ValueError, "scales is on meta but input is on cpu"),
    ((X, W4, S4, S4.to("meta"), None), ValueError, "mins is on meta but input is on cpu"),
    ((X, W8, S8, None, torch.zeros(5, device="meta")), ValueError, "bias is on meta but input is on cpu"),
]


@pytest.mark.parametrize("args,error,match", BAD, ids=range(len(BAD)))
def test_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        specops.ops.quantized_linear(*args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_devices_must_match_on_cuda():
    with pytest.raises(ValueError, match="scales is on cuda:0 but input is on cpu"):
        specops.ops.quantized_linear(X, W8, S8.cuda())


def test_no_backward_is_refused():
    """The op has no autograd kernel: an input that requires gradients, with gradients on, raises."""
    x, weight, scales, mins, b = random_case("int8", 2, 7, 64, seed=0)
    with pytest.raises(RuntimeError, match="no backward"):
        specops.ops.quantized_linear(x.requires_grad_(), weight, scales, mins, b)
    x = x.detach()
    for name in ("scales", "bias"):  # any tensor that would need a gradient, not only the input
        args = {"scales": scales, "bias": b}
        args[name] = args[name].clone().requires_grad_()
        with pytest.raises(RuntimeError, match="no backward"):
            specops.ops.quantized_linear(x, weight, args["scales"], mins, args["bias"])
    with torch.no_grad():
        assert torch.equal(specops.ops.quantized_linear(x, weight, scales, mins, b),
                           specops.ops.quantized_linear(x.detach(), weight, scales, mins, b))


CPP_BAD = [
    ((X.view(3, 2, 32), W8, S8, None, None), r"input must be float32 \[M, K\]"),
    ((X.double(), W8, S8, None, None), r"input must be float32 \[M, K\]"),
    ((X, W8[0], S8, None, None), "weight must be 2-D"),
    ((X, torch.zeros(5, 64), None, None, None), r"weight must be bfloat16, int8 or uint8 \(packed int4\)"),
    ((X, WB[:, :63], None, None, None), r"a bfloat16 weight must be \[N, K\] with K = 64"),
    ((X, WB, S8, None, None), "a bfloat16 weight takes no scales or mins"),
    ((X, WB, None, S8, None), "a bfloat16 weight takes no scales or mins"),
    ((X, W8[:, :63], S8, None, None), r"an int8 weight must be \[N, K\] with K = 64"),
    ((X, torch.zeros(5, 64, dtype=torch.uint8), S4, S4, None), r"an int4 \(uint8\) weight must be \[N, K / 2\]"),
    ((X, W8, None, None, None), "this weight format needs scales"),
    ((X, W8, torch.ones(5), None, None), r"scales must be float32 \[N, G\] with N = 5"),
    ((X, W8, torch.ones(4, 1), None, None), r"scales must be float32 \[N, G\] with N = 5"),
    ((X, W8, torch.ones(5, 0), None, None), r"scales must be float32 \[N, G\] with N = 5"),
    ((X, W8, S8.double(), None, None), r"scales must be float32 \[N, G\] with N = 5"),
    ((X, W8, torch.ones(5, 3), None, None), "must split K = 64 into G groups of a multiple of 32"),
    ((X, W8, torch.ones(5, 4), None, None), "must split K = 64 into G groups of a multiple of 32"),
    ((X, W8, S8, S8, None), "int8 weights are symmetric: no mins"),
    ((torch.zeros(3, 48), torch.zeros(5, 24, dtype=torch.uint8), S8, S8, None),
     "int4 weights need K a multiple of 32, got 48"),
    ((X, W4, S4, None, None), "this weight format needs mins"),
    ((X, W4, S4, S8, None), "mins must have the shape of scales"),
    ((X, W4, S4, S4.double(), None), r"mins must be float32 \[N, G\] with N = 5"),
    ((X, W8, S8, None, torch.zeros(4)), r"bias must be float32 \[N\] with N = 5"),
    ((X, W8, S8, None, torch.zeros(5, dtype=torch.float64)), r"bias must be float32 \[N\] with N = 5"),
    ((X, W8, S8, None, torch.zeros(1, 5)), r"bias must be float32 \[N\] with N = 5"),
]


@pytest.mark.parametrize("args,match", CPP_BAD, ids=range(len(CPP_BAD)))
def test_cpp_kernel_checks_its_arguments(args, match):
    """The op called directly (no wrapper) refuses what its kernel cannot run: a TypeError for a weight dtype no
    format has, a ValueError for the rest."""
    error = TypeError if "bfloat16, int8 or uint8" in match else ValueError
    with pytest.raises(error, match=match):
        torch.ops.specops.quantized_linear(*args)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [0, 1, 5])
def test_opcheck(fmt, m):
    x, weight, scales, mins, b = random_case(fmt, m, 37, 64, 32 if fmt != "bf16" else None, seed=m)
    for bias in (None, b):
        torch.library.opcheck(torch.ops.specops.quantized_linear.default, (x, weight, scales, mins, bias))


def test_fake_and_meta_shapes():
    with FakeTensorMode():
        out = specops.ops.quantized_linear(torch.empty(2, 3, 64), torch.empty(37, 32, dtype=torch.uint8),
                                           torch.empty(37, 2), torch.empty(37, 2), torch.empty(37))
        assert out.shape == (2, 3, 37) and out.dtype == torch.float32
    out = specops.ops.quantized_linear(torch.empty(4, 64, device="meta"),
                                       torch.empty(37, 64, dtype=torch.int8, device="meta"),
                                       torch.empty(37, 1, device="meta"))
    assert out.shape == (4, 37) and out.device.type == "meta" and out.is_contiguous()


def test_torch_compile_matches_eager():
    # aot_eager traces the op through its fake with fullgraph and skips Inductor's C++ build (seconds here).
    x, weight, scales, mins, b = random_case("int4", 5, 37, 64, 32, seed=9)

    def project(rows):
        return specops.ops.quantized_linear(rows, weight, scales, mins, b) * 2

    compiled = torch.compile(project, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x.view(5, 1, 64)), project(x.view(5, 1, 64)))
