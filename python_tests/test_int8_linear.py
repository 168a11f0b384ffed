"""Tests of `specops.ops.int8_linear`: int8 input [M, K] times int8 weight [N, K]^T with exact integer sums,
out[m, n] = float32(sum_k x[m, k] w[n, k]) * input_scales[m] * weight_scales[n].

Implementations: "cpp" (torch.ops.specops.int8_linear on CPU tensors, in the copy this CPU takes:
`specops._C.int8_dot_isa()`, and the "avx2" and "base" copies in child processes with SPECOPS_CPU_ISA) and
"triton" (int8_linear_triton on the Triton device, 16 x 32 tiles unless a test says otherwise, so that the N
and K tails run). The kernels' bits are `(x.long() @ w.long().T).float() * xs[:, None] * ws[None, :]` in
torch: the sum is an exact integer, converted once (round to nearest) and multiplied by the two scales in
that order, each product rounded in float32 (`torch_bits`).

1. Exact: the C++ kernel gives torch_bits over M = 1..17, K in {0, 1, 63, 64, 65, 129, 640} (around the
   VNNI copy's 64-byte steps and the AVX2 copy's 16), N in {1, 3, 70, 333} (tails of the tiles of 4 and
   of the panels of 64), negative scales included; and it is within 3u (1 + 2u) |ref| of the float64
   reference, u = 2^-24, per output: for K <= 1023 the sum (|.| <= 1023 * 128^2 < 2^24) converts exactly,
   the kernel rounds its two products (2u + u^2 of the exact value e) and the reference rounds e once (u),
   and |e| <= |ref| / (1 - u).
2. Extremes: all -128, all 127 and mixed signs, up to K = INT8_LINEAR_MOST_K (131,072) with M = 1, N = 2,
   against the int64 sums; the largest sum int32 holds (K = 131,071 of (-128)^2). Every output of the
   C++ kernel, in every copy this CPU can take (the same cases in each), has the same bits.
3. Triton (the interpreter without a GPU) gives the C++ kernel's bits, on the tails of its tiles and with
   its default tiles, and over a long K.
4. The wrapper's [..., K] input; non-contiguous arguments; threads; bad input raises the C++ kernel's
   messages (wrapper and op); scales that require gradients are refused; the fake (opcheck,
   FakeTensorMode, meta) gives [M, N] float32.
5. The packed weight (`int8_linear_pack`): its layout by hand; the same bits as the [N, K] weight in every
   copy (across the packed VNNI copy's pairs of 16-row blocks, its groups of up to 4 input rows and its
   4-byte steps of K), in Triton, over threads (section 4's test); its shape checked against N (weight_scales)
   and K.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
from _triton import TRITON_DEVICE, needs_triton, triton_launcher
from torch._subclasses.fake_tensor import FakeTensorMode

import specops
from specops import _C, reference
from specops.reference import INT8_LINEAR_MOST_K

int8_linear_triton = triton_launcher("int8_linear")

U = 2.0**-24  # float32's unit roundoff
ROWS = list(range(1, 18))
IN_FEATURES = [0, 1, 63, 64, 65, 129, 640]
OUT_FEATURES = [1, 3, 70, 333]


def random_case(m: int, n: int, k: int, seed: int):
    """int8 x [M, K] and w [N, K] over the whole range, scales of both signs (a negative one flips the
    output; every copy must round it the same)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    xs = (torch.rand(m, generator=g) - 0.25) / 64
    ws = (torch.rand(n, generator=g) + 0.01) / 128
    return x, xs, w, ws


def torch_bits(x, xs, w, ws) -> torch.Tensor:
    """The kernels' result, in torch: the exact int64 sum, converted once, times each scale in turn."""
    return (x.long() @ w.long().T).float() * xs[:, None] * ws[None, :]


def run_impl(impl: str, x, xs, w, ws, block_n=16, block_k=32):
    if impl == "cpp":
        return torch.ops.specops.int8_linear(x, xs, w, ws)
    moved = [t.to(TRITON_DEVICE) for t in (x, xs, w, ws)]
    return int8_linear_triton(*moved, block_n=block_n, block_k=block_k).cpu()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


# ---- 1. exact ----

@pytest.mark.parametrize("k", IN_FEATURES)
def test_cpp_gives_the_torch_bits_and_is_within_3u_of_the_reference(k):
    for m in ROWS:
        for n in OUT_FEATURES:
            x, xs, w, ws = random_case(m, n, k, seed=1000 * m + n + k)
            got = torch.ops.specops.int8_linear(x, xs, w, ws)
            assert got.shape == (m, n) and got.dtype == torch.float32
            assert torch.equal(bits(got), bits(torch_bits(x, xs, w, ws))), (m, n)
            ref = reference.int8_linear(x, xs, w, ws).double()
            error = (got.double() - ref).abs()
            assert (error <= 3 * U * (1 + 2 * U) * ref.abs()).all(), (m, n, (error / ref.abs()).max() / U)


@pytest.mark.parametrize("m,k", [(16, 640), (33, 640), (48, 8193), (35, 20000)])
def test_input_blocks_and_weight_sweeps(m, k):
    """The VNNI copy takes input rows in blocks of 16, each sweeping up to 64 weight rows (fewer for a long K:
    12 at K = 20,000, 28 at K = 8,193): whole blocks, a block of one or three rows after them, and sweeps that
    end inside a task's weight rows all give the torch bits."""
    x, xs, w, ws = random_case(m, 70, k, seed=k + m)
    assert torch.equal(bits(torch.ops.specops.int8_linear(x, xs, w, ws)), bits(torch_bits(x, xs, w, ws)))


def test_the_order_of_the_products_shows_in_the_bits():
    """The bit comparison is not vacuous: scaling by the product of the two scales instead (one rounding
    fewer, in another place) changes some outputs' bits."""
    x, xs, w, ws = random_case(17, 333, 640, seed=3)
    other = (x.long() @ w.long().T).float() * (xs[:, None] * ws[None, :])
    got = torch.ops.specops.int8_linear(x, xs, w, ws)
    assert torch.equal(bits(got), bits(torch_bits(x, xs, w, ws))) and not torch.equal(bits(got), bits(other))


def test_k_zero_scales_zero():
    """K = 0: every sum is 0, scaled as any other (a negative scale gives -0.0, as in torch)."""
    xs, ws = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 0.5, -1.0])
    no_k = torch.zeros(2, 0, dtype=torch.int8), torch.zeros(3, 0, dtype=torch.int8)
    got = torch.ops.specops.int8_linear(no_k[0], xs, no_k[1], ws)
    want = torch.zeros(2, 3) * xs[:, None] * ws[None, :]
    assert torch.equal(bits(got), bits(want)) and bool(torch.signbit(got[1, 0]))


def test_no_rows_or_no_outputs_are_empty():
    x, xs, w, ws = random_case(4, 7, 9, seed=0)
    assert torch.ops.specops.int8_linear(x[:0], xs[:0], w, ws).shape == (0, 7)
    out = torch.ops.specops.int8_linear(x, xs, w[:0], ws[:0])
    assert out.shape == (4, 0) and out.dtype == torch.float32


# ---- 2. extremes ----

def extreme_cases() -> dict[str, tuple]:
    """name -> (x, xs, w, ws): constant operands at the int8 ends, one row against two weight rows, up to
    the op's longest K; and mixed signs."""
    cases = {}
    ones = torch.ones
    for k in (64, 640, 4097, INT8_LINEAR_MOST_K - 1):
        for a, b in ((127, 127), (-128, 127), (127, -128), (-128, -128)):
            x = torch.full((1, k), a, dtype=torch.int8)
            w = torch.full((2, k), b, dtype=torch.int8)
            w[1, ::2] = 127  # row 1 alternates: a sum between the two ends
            cases[f"K{k}_{a}_{b}"] = (x, ones(1), w, torch.tensor([1.0, 0.5]))
    g = torch.Generator().manual_seed(5)
    k = INT8_LINEAR_MOST_K
    signs = torch.randint(0, 2, (3, k), generator=g, dtype=torch.bool)
    x = torch.where(signs[0], 127, -128).to(torch.int8)[None]
    w = torch.stack([torch.where(signs[1], 127, -128), torch.where(signs[2], 127, -128)]).to(torch.int8)
    cases[f"K{k}_mixed"] = (x, torch.tensor([3e-3]), w, torch.tensor([-7e-5, 1.5]))
    return cases


EXTREMES = extreme_cases()


@pytest.mark.parametrize("name", list(EXTREMES))
def test_extremes_give_the_int64_sums(name):
    x, xs, w, ws = EXTREMES[name]
    got = torch.ops.specops.int8_linear(x, xs, w, ws)
    assert torch.equal(bits(got), bits(torch_bits(x, xs, w, ws))), (got, torch_bits(x, xs, w, ws))


def test_the_largest_sum_int32_holds():
    """(-128)^2 * 131,071 = 2^31 - 2^14: the largest sum of the longest K the op takes, in every copy (the VNNI
    copy's unsigned sums wrap on the way)."""
    k = INT8_LINEAR_MOST_K
    assert 128 * 128 * k < 2**31 <= 128 * 128 * (k + 1)
    x, w = torch.full((1, k), -128, dtype=torch.int8), torch.full((2, k), -128, dtype=torch.int8)
    got = torch.ops.specops.int8_linear(x, torch.ones(1), w, torch.ones(2))
    assert got.tolist() == [[2**31 - 2**14] * 2]
    w[1] = 127
    got = torch.ops.specops.int8_linear(x, torch.ones(1), w, torch.ones(2))
    assert got.tolist() == [[2**31 - 2**14, float(-128 * 127 * k)]]


@functools.cache
def isa_results() -> dict:
    """The C++ kernel's bits on the cases every copy must agree on: every tile and tail shape of the three
    copies (VNNI: 4 x 4 tiles, 1-3 row remainders, 64-byte steps; AVX2: 2 x 4 tiles, 16-byte steps; the
    panels of 64 weight rows) and the extremes. Run in a child per SPECOPS_CPU_ISA setting."""
    out = {"isa": _C.int8_dot_isa(), "bits": {}, "torch_bits": True}
    for m in (1, 2, 3, 4, 5, 9):
        for n in (1, 2, 3, 70):
            for k in (0, 1, 15, 16, 17, 63, 64, 65, 129, 640):
                x, xs, w, ws = random_case(m, n, k, seed=100 * m + 10 * n + k)
                got = torch.ops.specops.int8_linear(x, xs, w, ws)
                out["bits"][f"{m}x{n}x{k}"] = bits(got).flatten().tolist()
                out["torch_bits"] &= torch.equal(bits(got), bits(torch_bits(x, xs, w, ws)))
    for name, args in EXTREMES.items():
        got = torch.ops.specops.int8_linear(*args)
        out["bits"][name] = bits(got).flatten().tolist()
        out["torch_bits"] &= torch.equal(bits(got), bits(torch_bits(*args)))
    for m in (1, 4, 5, 9):  # the packed layout: one block, a pair and a half, groups of 4 and fewer rows
        for n in (1, 17, 33, 70):
            for k in (0, 3, 4, 65, 640):
                x, xs, w, ws = random_case(m, n, k, seed=7 * m + 3 * n + k)
                got = torch.ops.specops.int8_linear(x, xs, specops.ops.int8_linear_pack(w), ws)
                out["bits"][f"packed {m}x{n}x{k}"] = bits(got).flatten().tolist()
                out["torch_bits"] &= torch.equal(bits(got), bits(torch_bits(x, xs, w, ws)))
    return out


_CHILD = ("import json, sys; sys.path.insert(0, {path!r}); import test_int8_linear as t; "
          "print(json.dumps(t.isa_results()))")


@pytest.mark.parametrize("copy", ["avx2", "base"])
def test_every_cpu_copy_gives_the_same_bits(copy):
    """The copy SPECOPS_CPU_ISA=`copy` takes (a child process: the kernels read it once) against this
    process's copy (VNNI where the CPU has it). A CPU that cannot take `copy` skips."""
    env = {key: value for key, value in os.environ.items() if key != "SPECOPS_CPU_ISA"}
    env["SPECOPS_CPU_ISA"] = copy
    child = _CHILD.format(path=os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", child], check=False, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    if found["isa"] != copy:
        pytest.skip(f"this CPU cannot take the {copy} copy (SPECOPS_CPU_ISA={copy} took {found['isa']})")
    here = isa_results()
    assert here["torch_bits"] and found["torch_bits"]
    differ = [name for name in here["bits"] if here["bits"][name] != found["bits"][name]]
    assert not differ, f"{here['isa']} and {copy} differ on {differ}"


def test_the_copy_is_named():
    assert _C.int8_dot_isa() in ("avx512_vnni", "avx2", "base")
    assert _C.int8_dot_isa() != "avx512_vnni" or _C.cpu_isa() == "avx512"


# ---- 3. Triton ----

@needs_triton
@pytest.mark.parametrize("k", IN_FEATURES)
def test_triton_gives_the_cpp_bits(k):
    """16 x 32 tiles: N and K tails masked; M = 17 and 33 take second and third row blocks."""
    for m in (1, 2, 5, 16, 17, 33):
        for n in (1, 3, 70):
            x, xs, w, ws = random_case(m, n, k, seed=1000 * m + n + k)
            got = run_impl("triton", x, xs, w, ws)
            assert torch.equal(bits(got), bits(run_impl("cpp", x, xs, w, ws))), (m, n)


@needs_triton
def test_triton_default_tiles():
    x, xs, w, ws = random_case(9, 333, 640, seed=5)
    got = int8_linear_triton(*(t.to(TRITON_DEVICE) for t in (x, xs, w, ws))).cpu()
    assert torch.equal(bits(got), bits(torch.ops.specops.int8_linear(x, xs, w, ws)))


@needs_triton
def test_triton_extremes():
    """The longest K in tiles of 8,192 (the interpreter's steps cost per step, not per byte)."""
    for name in (f"K{INT8_LINEAR_MOST_K - 1}_-128_-128", f"K{INT8_LINEAR_MOST_K}_mixed", "K4097_127_-128"):
        args = EXTREMES[name]
        got = run_impl("triton", *args, block_k=8192)
        assert torch.equal(bits(got), bits(torch.ops.specops.int8_linear(*args))), name


# ---- 4. wrapper, layouts, threads, bad input, fake ----

def test_wrapper_takes_leading_dims():
    """[2, 3, K] with scales [2, 3] gives [2, 3, N]; [K] with a 0-d scale gives [N]; [0, K] gives [0, N]."""
    x, xs, w, ws = random_case(6, 37, 65, seed=11)
    flat = torch.ops.specops.int8_linear(x, xs, w, ws)
    out = specops.ops.int8_linear(x.view(2, 3, 65), xs.view(2, 3), w, ws)
    assert out.shape == (2, 3, 37) and torch.equal(out, flat.view(2, 3, 37))
    out = specops.ops.int8_linear(x[2], xs[2], w, ws)
    assert out.shape == (37,) and torch.equal(out, flat[2])
    assert specops.ops.int8_linear(x[:0], xs[:0], w, ws).shape == (0, 37)
    assert specops.ops.int8_linear(x.view(2, 3, 65)[:, :0], xs.view(2, 3)[:, :0], w, ws).shape == (2, 0, 37)


def test_non_contiguous_arguments():
    g = torch.Generator().manual_seed(7)
    m, n, k = 6, 37, 65
    x_t = torch.randint(-128, 128, (k, m), generator=g, dtype=torch.int8).T
    w_strided = torch.randint(-128, 128, (n, 2 * k), generator=g, dtype=torch.int8)[:, ::2]
    xs_strided, ws_strided = torch.rand(2 * m, generator=g)[::2], torch.rand(2 * n, generator=g)[::2]
    args = (x_t, xs_strided, w_strided, ws_strided)
    assert not any(t.is_contiguous() for t in args)
    want = torch.ops.specops.int8_linear(*(t.contiguous() for t in args))
    assert torch.equal(torch.ops.specops.int8_linear(*args), want)
    assert torch.equal(specops.ops.int8_linear(*args), want)


def test_no_backward_is_refused():
    """The op has no autograd kernel: a float scale that requires gradients, with gradients on, raises in the
    wrapper (as the other linear ops); under no_grad the same call gives the plain call's bits."""
    x, xs, w, ws = random_case(3, 37, 65, seed=5)
    for which in (0, 1):
        scales = [xs.clone(), ws.clone()]
        scales[which].requires_grad_()
        with pytest.raises(RuntimeError, match="int8_linear has no backward"):
            specops.ops.int8_linear(x, scales[0], w, scales[1])
        with torch.no_grad():
            assert torch.equal(specops.ops.int8_linear(x, scales[0], w, scales[1]),
                               torch.ops.specops.int8_linear(x, xs, w, ws))


@pytest.mark.parametrize("packed", [False, True])
def test_thread_count_does_not_change_the_bits(packed):
    """N = 1029, K = 640: 17 panels of 64 rows, in tasks of 6 (the 256 KB grain); packed, 65 blocks in pairs,
    tasks of 12 pairs."""
    x, xs, w, ws = random_case(5, 1029, 640, seed=4)
    weight = specops.ops.int8_linear_pack(w) if packed else w
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.specops.int8_linear(x, xs, weight, ws)
        torch.set_num_threads(2)
        two = torch.ops.specops.int8_linear(x, xs, weight, ws)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(bits(one), bits(two)) and torch.equal(bits(two), bits(torch_bits(x, xs, w, ws)))


def _bad(**change):
    x, xs, w, ws = random_case(3, 5, 8, seed=0)
    args = {"input": x, "input_scales": xs, "weight": w, "weight_scales": ws}
    args.update(change)
    return args


_LONG_K = INT8_LINEAR_MOST_K + 1
# change to the valid arguments, error, message: the op's checks (the C++ kernel's on CPU, its contract's
# elsewhere), the same through the wrapper; the wrapper itself refuses only a non-tensor.
BAD = [
    ({"input": [[1] * 8] * 3}, TypeError, "int8_linear: input must be a tensor, got list"),
    ({"weight_scales": 1.0}, TypeError, "int8_linear: weight_scales must be a tensor, got float"),
    ({"input": torch.zeros(3, 8)}, ValueError, r"int8_linear: input must be int8 \[M, K\]"),
    ({"input": torch.zeros(3, 8, dtype=torch.uint8)}, ValueError, r"input must be int8 \[M, K\]"),
    ({"weight": torch.zeros(5, 8)}, ValueError, r"int8_linear: weight must be int8 \[N, K\]"),
    ({"weight": torch.zeros(8, dtype=torch.int8)}, ValueError, r"weight must be int8 \[N, K\]"),
    ({"weight": torch.zeros(1, 5, 8, dtype=torch.int8)}, ValueError, r"weight must be int8 \[N, K\]"),
    ({"weight": torch.zeros(5, 8, dtype=torch.uint8)}, ValueError,
     r"weight must be int8 \[N, K\], or uint8 \[ceil\(N / 16\), ceil\(K / 4\), 64\] packed by int8_linear_pack"),
    ({"weight": torch.zeros(1, 3, 64, dtype=torch.uint8)}, ValueError,
     r"int8_linear: a packed weight for N = 5 and K = 8 must be \[1, 2, 64\], got \[1, 3, 64\]"),
    ({"weight": torch.zeros(2, 2, 64, dtype=torch.uint8)}, ValueError,
     r"a packed weight for N = 5 and K = 8 must be \[1, 2, 64\], got \[2, 2, 64\]"),
    ({"weight": torch.zeros(1, 2, 64, dtype=torch.uint8), "weight_scales": torch.ones(17)}, ValueError,
     r"a packed weight for N = 17 and K = 8 must be \[2, 2, 64\], got \[1, 2, 64\]"),
    ({"weight": torch.zeros(1, 2, 64, dtype=torch.uint8), "weight_scales": torch.ones(5, 1)}, ValueError,
     r"int8_linear: weight_scales must be float32 \[N\]"),
    ({"weight": torch.zeros(5, 7, dtype=torch.int8)}, ValueError,
     r"int8_linear: weight must be \[N, K\] with K = 8, got \[5, 7\]"),
    ({"input": torch.zeros(1, _LONG_K, dtype=torch.int8), "input_scales": torch.ones(1),
      "weight": torch.zeros(5, _LONG_K, dtype=torch.int8)}, ValueError,
     rf"int8_linear: K = {_LONG_K} is longer than 131071 \(the int32 sums would overflow\)"),
    ({"input_scales": torch.ones(2)}, ValueError, r"int8_linear: input_scales must be float32 \[M\] with M = 3"),
    ({"input_scales": torch.ones(3, 1)}, ValueError, r"input_scales must be float32 \[M\] with M = 3"),
    ({"input_scales": torch.ones(3, dtype=torch.float64)}, ValueError,
     r"input_scales must be float32 \[M\] with M = 3"),
    ({"weight_scales": torch.ones(4)}, ValueError, r"int8_linear: weight_scales must be float32 \[N\] with N = 5"),
    ({"weight_scales": torch.ones(5, dtype=torch.float16)}, ValueError,
     r"weight_scales must be float32 \[N\] with N = 5"),
    ({"weight_scales": torch.ones(1, 5)}, ValueError, r"weight_scales must be float32 \[N\] with N = 5"),
    ({"weight": torch.zeros(5, 8, dtype=torch.int8, device="meta")}, ValueError,
     "int8_linear: weight is on meta but input is on cpu"),
    ({"input_scales": torch.ones(3, device="meta")}, ValueError, "input_scales is on meta but input is on cpu"),
]


@pytest.mark.parametrize("change,error,match", BAD)
def test_bad_arguments(change, error, match):
    args = _bad(**change)
    with pytest.raises(error, match=match):
        specops.ops.int8_linear(**args)
    if error is ValueError:  # the op called directly (no wrapper) says the same
        with pytest.raises(error, match=match):
            torch.ops.specops.int8_linear(*args.values())


def test_cpp_kernel_refuses_leading_dims():
    """The op takes [M, K] alone: a 1-D or 3-D input is the wrapper's to shape."""
    x, xs, w, ws = random_case(3, 5, 8, seed=0)
    for bad in (x[0], x[None]):
        with pytest.raises(ValueError, match=r"input must be int8 \[M, K\]"):
            torch.ops.specops.int8_linear(bad, xs, w, ws)


@pytest.mark.parametrize("m", [0, 1, 5])
def test_opcheck(m):
    torch.library.opcheck(torch.ops.specops.int8_linear.default, random_case(m, 37, 65, seed=m))


def test_fake_and_meta_shapes():
    i8 = torch.int8
    with FakeTensorMode():
        out = specops.ops.int8_linear(torch.empty(2, 3, 65, dtype=i8), torch.empty(2, 3),
                                      torch.empty(37, 65, dtype=i8), torch.empty(37))
        assert out.shape == (2, 3, 37) and out.dtype == torch.float32
        out = torch.ops.specops.int8_linear(torch.empty(4, 65, dtype=i8), torch.empty(4),
                                            torch.empty(37, 65, dtype=i8), torch.empty(37))
        assert out.shape == (4, 37) and out.dtype == torch.float32
        with pytest.raises(ValueError, match=r"weight must be \[N, K\] with K = 65, got \[37, 64\]"):
            torch.ops.specops.int8_linear(torch.empty(4, 65, dtype=i8), torch.empty(4),
                                          torch.empty(37, 64, dtype=i8), torch.empty(37))
    meta = {"device": "meta"}
    out = torch.ops.specops.int8_linear(torch.empty(4, 65, dtype=i8, **meta), torch.empty(4, **meta),
                                        torch.empty(37, 65, dtype=i8, **meta), torch.empty(37, **meta))
    assert out.shape == (4, 37) and out.dtype == torch.float32
    assert out.device.type == "meta" and out.is_contiguous()


# ---- 5. the packed weight ----

def test_pack_layout_by_hand():
    """weight[n, k] + 128 at [n // 16, k // 4, 4 (n % 16) + k % 4]; rows past N and columns past K hold 128
    (a weight of 0); unpacking gives the weight back."""
    w = (torch.arange(17 * 5) % 251 - 125).to(torch.int8).view(17, 5)
    p = specops.ops.int8_linear_pack(w)
    assert p.shape == (2, 2, 64) and p.dtype == torch.uint8
    for n in range(17):
        for k in range(5):
            assert int(p[n // 16, k // 4, 4 * (n % 16) + k % 4]) == int(w[n, k]) + 128
    assert int(p[0, 1, 3]) == 128 and int(p[1, 0, 4]) == 128  # k = 7 of row 0; row 17's k = 0
    assert (p[1, :, 4:] == 128).all() and (p[:, 1].view(2, 16, 4)[:, :, 1:] == 128).all()
    assert torch.equal(reference.int8_linear_unpack(p, 17, 5), w)
    assert specops.ops.int8_linear_pack(w[:0]).shape == (0, 2, 64)
    with pytest.raises(ValueError, match=r"int8_linear_pack: weight must be int8 \[N, K\]"):
        specops.ops.int8_linear_pack(w.to(torch.uint8))
    with pytest.raises(TypeError, match="int8_linear_pack: weight must be a tensor, got list"):
        specops.ops.int8_linear_pack([[1]])


@pytest.mark.parametrize("k", [0, 1, 3, 4, 5, 63, 64, 65, 640])
def test_packed_gives_the_same_bits(k):
    """The packed layout against the [N, K] weight and torch_bits: M = 1..17 and 33 (groups of 1-4 input
    rows), N = 1, 15, 16, 17, 31, 32, 33, 70 (whole and partial blocks, pairs and a last single block)."""
    for m in list(range(1, 18)) + [33]:
        for n in (1, 15, 16, 17, 31, 32, 33, 70):
            x, xs, w, ws = random_case(m, n, k, seed=31 * m + 7 * n + k)
            got = torch.ops.specops.int8_linear(x, xs, specops.ops.int8_linear_pack(w), ws)
            assert torch.equal(bits(got), bits(torch_bits(x, xs, w, ws))), (m, n)
            assert torch.equal(bits(got), bits(torch.ops.specops.int8_linear(x, xs, w, ws))), (m, n)


def test_packed_reference_and_wrapper():
    x, xs, w, ws = random_case(6, 37, 65, seed=12)
    p = specops.ops.int8_linear_pack(w)
    assert torch.equal(reference.int8_linear(x, xs, p, ws), reference.int8_linear(x, xs, w, ws))
    out = specops.ops.int8_linear(x.view(2, 3, 65), xs.view(2, 3), p, ws)
    assert out.shape == (2, 3, 37) and torch.equal(out.view(6, 37), torch.ops.specops.int8_linear(x, xs, w, ws))


def test_packed_extremes():
    """All -128 against all -128 and 127 at the longest K (the wrapping unsigned sums, and 128 sum_k x taken
    off them, in the packed copy)."""
    k = INT8_LINEAR_MOST_K
    x, w = torch.full((1, k), -128, dtype=torch.int8), torch.full((2, k), -128, dtype=torch.int8)
    w[1] = 127
    got = torch.ops.specops.int8_linear(x, torch.ones(1), specops.ops.int8_linear_pack(w), torch.ones(2))
    assert got.tolist() == [[2**31 - 2**14, float(-128 * 127 * k)]]


@needs_triton
@pytest.mark.parametrize("k", [1, 5, 65])
def test_triton_packed_gives_the_cpp_bits(k):
    for m in (1, 17):
        for n in (1, 17, 70):
            x, xs, w, ws = random_case(m, n, k, seed=100 * m + n + k)
            p = specops.ops.int8_linear_pack(w)
            got = run_impl("triton", x, xs, p, ws)
            assert torch.equal(bits(got), bits(torch.ops.specops.int8_linear(x, xs, w, ws))), (m, n)


def test_packed_opcheck_and_fake():
    x, xs, w, ws = random_case(5, 37, 65, seed=3)
    p = specops.ops.int8_linear_pack(w)
    torch.library.opcheck(torch.ops.specops.int8_linear.default, (x, xs, p, ws))
    with FakeTensorMode():
        out = torch.ops.specops.int8_linear(torch.empty(4, 65, dtype=torch.int8), torch.empty(4),
                                            torch.empty(3, 17, 64, dtype=torch.uint8), torch.empty(37))
        assert out.shape == (4, 37) and out.dtype == torch.float32
