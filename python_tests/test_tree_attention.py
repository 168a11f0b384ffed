"""Tests of `specops.ops.tree_attention`: the four layers of DEVELOPERS.md ("Tests").

Implementations: "reference" (specops.reference.tree_attention, the spec: a dense mask and a softmax in
float32), "cpp" (torch.ops.specops.tree_attention on CPU tensors) and "triton" (tree_attention_triton on
the Triton device, small tiles so that every path runs), all called with the op's normalized arguments.

1. Exact: with zero queries every visible key gets the same weight, so a node's output is the mean of
   the values it sees: hand-made chains, stars, bushy trees, ragged trees (padding nodes see only
   themselves), holes in kv_mask, windows counted in tokens across holes, sinks, and a row that sees
   nothing (zeros, never NaN). A chain equals causal attention over prefix + chain.
2. Agreement: C++ and Triton (interpreter) against the reference on random trees, holes, GQA, windows,
   soft-caps and sinks, in float32, bfloat16 and float16, across several tiles and key splits.
   Tolerances: float32 results differ from the reference only by summation order (1e-5 of the values'
   scale); for 16-bit inputs the kernels accumulate in float32 from the same rounded inputs and round
   the output once (C++: one 16-bit ulp); Triton also rounds the softmax weights to the input dtype
   before the value product, as FlashAttention does (a few ulps).
3. opcheck on the op; torch.compile of the wrapper.
4. Bad input: every shape, dtype, device and value check raises naming the problem.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from _triton import IMPLS, KERNELS, TRITON_DEVICE, needs_triton, triton_launcher

import specops
from specops import reference

tree_attention_triton = triton_launcher("tree_attention")


def tree_words(parents: list[list[int]], nodes: int) -> torch.Tensor:
    """[B, nodes, ceil(nodes/32)] int32 ancestor words, built the RSD way (a child's row is its parent's
    row plus its own bit). parents[b][i]: node i's parent (-1: a root); nodes past len(parents[b]) are
    padding that sees only itself."""
    words = (nodes + 31) // 32
    out = torch.zeros(len(parents), nodes, words, dtype=torch.int64)
    for b, row_parents in enumerate(parents):
        for i in range(nodes):
            parent = row_parents[i] if i < len(row_parents) else -1
            if parent >= 0:
                out[b, i] = out[b, parent]
            out[b, i, i // 32] |= 1 << (i % 32)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def run_impl(impl: str, query, key, value, tree_mask, kv_mask=None, scale=None, window=0, softcap=0.0,
             sinks=None, block=16):
    batch, _, nodes, dim = query.shape
    if kv_mask is None:
        kv_mask = torch.ones(batch, key.shape[2] - nodes, dtype=torch.bool)
    scale = dim ** -0.5 if scale is None else scale
    args = (query, key, value, tree_mask, kv_mask)
    if impl == "reference":
        return reference.tree_attention(*args, scale, window, softcap, sinks)
    if impl == "cpp":
        return torch.ops.specops.tree_attention(*args, scale, window, softcap, sinks, True)
    moved = [a.to(TRITON_DEVICE) for a in args]
    sinks = None if sinks is None else sinks.to(TRITON_DEVICE)
    out = tree_attention_triton(*moved, scale, window, softcap, sinks, True, block_m=block, block_n=block)
    return out.cpu()


def _mean_case(parents, prefix_valid, nodes, dim=4, heads=2, kv_heads=1, seed=0):
    """Zero queries (uniform weights) and random values: inputs and, per (request, node), the keys it
    sees as slot indices, for the exact tests."""
    batch = len(parents)
    prefix = len(prefix_valid[0])
    g = torch.Generator().manual_seed(seed)
    query = torch.zeros(batch, heads, nodes, dim)
    key = torch.randn(batch, kv_heads, prefix + nodes, dim, generator=g)
    value = torch.randn(batch, kv_heads, prefix + nodes, dim, generator=g)
    kv_mask = torch.tensor(prefix_valid, dtype=torch.bool)
    return query, key, value, tree_words(parents, nodes), kv_mask


def _ancestors(parents_row: list[int], i: int) -> list[int]:
    if i >= len(parents_row):
        return [i]
    out = []
    while i >= 0:
        out.append(i)
        i = parents_row[i]
    return out


def _expected_means(value, parents, kv_mask, nodes, heads, window=0, sinks=None):
    batch, kv_heads, slots, dim = value.shape
    prefix = slots - nodes
    group = heads // kv_heads
    out = torch.zeros(batch, heads, nodes, dim, dtype=torch.float64)
    for b in range(batch):
        valid = [t for t in range(prefix) if kv_mask[b, t]]
        for i in range(nodes):
            chain = _ancestors(parents[b], i)
            depth = len(chain) - 1
            position = len(valid) + depth
            seen = [t for n, t in enumerate(valid) if not window or position - n < window]
            seen += [prefix + j for j in chain if not window or depth - (len(_ancestors(parents[b], j)) - 1) < window]
            for h in range(heads):
                vals = value[b, h // group, seen].double()
                weight = len(seen) + (math.exp(float(sinks[h])) if sinks is not None else 0.0)
                out[b, h, i] = vals.sum(0) / weight if weight else 0.0
    return out.float()


# ---- 1. exact ----

HAND_TREES = {
    "chain": [[-1, 0, 1, 2, 3]],
    "star": [[-1, 0, 0, 0, 0]],
    "bushy": [[-1, 0, 0, 1, 1, 2, 3, 3]],
    "ragged": [[-1, 0, 1], [-1, 0, 0, 1, 2], [-1]],  # padding nodes see only themselves
    "forest": [[-1, -1, 0, 1]],  # two roots: each node sees its own line only
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(HAND_TREES))
def test_zero_queries_average_what_each_node_sees(impl, name):
    parents = HAND_TREES[name]
    nodes = max(len(p) for p in parents)
    prefix_valid = [[True, False, True, True, False, True][: 6] for _ in parents]  # holes in the prefix
    query, key, value, mask, kv_mask = _mean_case(parents, prefix_valid, nodes)
    got = run_impl(impl, query, key, value, mask, kv_mask)
    want = _expected_means(value, parents, kv_mask, nodes, heads=2)
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_window_counts_tokens_across_holes(impl, window):
    parents = [[-1, 0, 1, 1], [-1, 0]]
    prefix_valid = [[True, False, False, True, True, False, True], [False, True, True, True, False, False, True]]
    query, key, value, mask, kv_mask = _mean_case(parents, prefix_valid, 4)
    got = run_impl(impl, query, key, value, mask, kv_mask, window=window)
    want = _expected_means(value, parents, kv_mask, 4, heads=2, window=window)
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_sinks_take_their_share_of_the_denominator(impl):
    parents = [[-1, 0, 0]]
    query, key, value, mask, kv_mask = _mean_case(parents, [[True, True, False]], 3, heads=4, kv_heads=2)
    sinks = torch.tensor([0.0, 1.5, -2.0, 3.0])
    got = run_impl(impl, query, key, value, mask, kv_mask, sinks=sinks)
    want = _expected_means(value, parents, kv_mask, 3, heads=4, sinks=sinks)
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "cpp", pytest.param("triton", marks=needs_triton)])
def test_row_that_sees_nothing_is_zero(impl):
    """validate=False lets through a node whose row is empty; with an all-empty prefix it sees nothing."""
    query, key, value, _, _ = _mean_case([[-1, 0]], [[False, False]], 2)
    mask = torch.tensor([[[1], [0]]], dtype=torch.int32)  # node 1 sees nobody, not even itself
    kv_mask = torch.zeros(1, 2, dtype=torch.bool)
    if impl == "cpp":
        out = torch.ops.specops.tree_attention(query, key, value, mask, kv_mask, 0.5, 0, 0.0, None, False)
    elif impl == "triton":
        out = tree_attention_triton(*(t.to(TRITON_DEVICE) for t in (query, key, value, mask, kv_mask)), 0.5, 0, 0.0,
                                    None, False, block_m=16, block_n=16).cpu()
    else:
        out = reference.tree_attention(query, key, value, mask, kv_mask, 0.5, 0, 0.0, None)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
    assert torch.allclose(out[0, :, 0], value[0, 0, 2].expand(2, -1))


@pytest.mark.parametrize("impl", IMPLS)
def test_chain_equals_causal_attention(impl):
    """A tree that is a chain is causal attention over the prefix and the chain (bottom-right aligned)."""
    g = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, nodes, prefix, dim = 2, 4, 2, 7, 21, 8
    query = torch.randn(batch, heads, nodes, dim, generator=g)
    key = torch.randn(batch, kv_heads, prefix + nodes, dim, generator=g)
    value = torch.randn(batch, kv_heads, prefix + nodes, dim, generator=g)
    mask = tree_words([list(range(-1, nodes - 1))] * batch, nodes)
    got = run_impl(impl, query, key, value, mask)
    causal = torch.ones(nodes, prefix + nodes, dtype=torch.bool).tril(prefix)
    want = torch.nn.functional.scaled_dot_product_attention(
        query.double(), key.double().repeat_interleave(2, 1), value.double().repeat_interleave(2, 1),
        attn_mask=causal).float()
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


# ---- 2. agreement on random inputs ----

def _random_case(seed: int, dtype=torch.float32, batch=3, heads=4, kv_heads=2, nodes=11, prefix=40, dim=16):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    parents = []
    for _ in range(batch):
        size = rng.randint(1, nodes)
        parents.append([-1] + [rng.randrange(i) for i in range(1, size)])
    query = torch.randn(batch, heads, nodes, dim, generator=g).to(dtype)
    key = torch.randn(batch, kv_heads, prefix + nodes, dim, generator=g).to(dtype)
    value = torch.randn(batch, kv_heads, prefix + nodes, dim, generator=g).to(dtype)
    kv_mask = torch.rand(batch, prefix, generator=g) < 0.8
    return query, key, value, tree_words(parents, nodes), kv_mask


_TOLERANCE = {("cpp", torch.float32): 1e-5, ("triton", torch.float32): 1e-5,
              ("cpp", torch.bfloat16): 2**-7, ("cpp", torch.float16): 2**-10,
              ("triton", torch.bfloat16): 2**-5, ("triton", torch.float16): 2**-8}

SETTINGS = [dict(), dict(window=6), dict(softcap=2.0), dict(sinks=True), dict(window=3, softcap=5.0, sinks=True)]


@pytest.mark.slow
@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("setting", range(len(SETTINGS)), ids=["plain", "window", "softcap", "sinks", "all"])
def test_kernels_match_reference(impl, dtype, setting):
    for seed in range(3):
        kwargs = dict(SETTINGS[setting])
        query, key, value, mask, kv_mask = _random_case(seed, dtype)
        if kwargs.get("sinks"):
            kwargs["sinks"] = torch.randn(query.shape[1], generator=torch.Generator().manual_seed(seed))
        got = run_impl(impl, query, key, value, mask, kv_mask, **kwargs)
        want = run_impl("reference", query, key, value, mask, kv_mask, **kwargs)
        assert got.dtype == dtype
        tolerance = _TOLERANCE[(impl, dtype)]
        scale = want.float().abs().max()
        assert (got.float() - want.float()).abs().max() <= tolerance * scale, (seed, impl, dtype)


@pytest.mark.parametrize("prefix", [0, 1, 255, 256, 600])
def test_cpp_across_tiles_and_splits(prefix):
    """The C++ kernel's key tiles (256) and key splits (with one request and one head, the prefix is split
    across threads and the partial softmaxes merged) give the reference's result."""
    g = torch.Generator().manual_seed(prefix)
    for batch, heads, kv_heads in ((1, 1, 1), (2, 8, 2)):
        query = torch.randn(batch, heads, 5, 32, generator=g)
        key = torch.randn(batch, kv_heads, prefix + 5, 32, generator=g)
        value = torch.randn(batch, kv_heads, prefix + 5, 32, generator=g)
        kv_mask = torch.rand(batch, prefix, generator=g) < 0.9
        mask = tree_words([[-1, 0, 0, 1, 2]] * batch, 5)
        for kwargs in (dict(), dict(window=100, sinks=torch.ones(heads))):
            got = run_impl("cpp", query, key, value, mask, kv_mask, **kwargs)
            want = run_impl("reference", query, key, value, mask, kv_mask, **kwargs)
            assert torch.allclose(got, want, atol=1e-5), (batch, kwargs)


@needs_triton
def test_triton_across_tiles():
    """Several query-row blocks, prefix tiles (some with no token: skipped), tree tiles and mask words."""
    query, key, value, mask, kv_mask = _random_case(7, nodes=37, prefix=70, heads=2, kv_heads=1)
    kv_mask[:, 16:40] = False  # whole tiles without a token
    for window in (0, 9):
        got = run_impl("triton", query, key, value, mask, kv_mask, window=window)
        want = run_impl("reference", query, key, value, mask, kv_mask, window=window)
        assert torch.allclose(got, want, atol=1e-5), window


def test_wrapper_defaults_match_reference():
    query, key, value, mask, kv_mask = _random_case(11)
    got = specops.ops.tree_attention(query, key, value, mask)
    want = reference.tree_attention(query, key, value, mask, torch.ones_like(kv_mask), query.shape[-1] ** -0.5, 0,
                                    0.0, None)
    assert torch.allclose(got, want, atol=1e-5)
    got = specops.ops.tree_attention(query, key, value, mask, kv_mask=kv_mask, scale=0.3, window=4, softcap=3.0,
                                     sinks=torch.zeros(4))
    want = reference.tree_attention(query, key, value, mask, kv_mask, 0.3, 4, 3.0, torch.zeros(4))
    assert torch.allclose(got, want, atol=1e-5)


# ---- 3. opcheck and torch.compile ----

def test_opcheck():
    query, key, value, mask, kv_mask = _random_case(2)
    for sinks in (None, torch.randn(4)):
        torch.library.opcheck(torch.ops.specops.tree_attention.default,
                              (query, key, value, mask, kv_mask, 0.25, 5, 0.0, sinks, True))


def test_torch_compile():
    query, key, value, mask, kv_mask = _random_case(4)

    def step(q, k, v):
        return specops.ops.tree_attention(q, k, v, mask, kv_mask=kv_mask) * 2

    compiled = torch.compile(step, fullgraph=True)
    assert torch.allclose(compiled(query, key, value), step(query, key, value))


# ---- 4. bad input ----

def _bad(**change):
    query, key, value, mask, kv_mask = _random_case(0, batch=2, heads=4, kv_heads=2, nodes=5, prefix=6, dim=8)
    args = dict(query=query, key=key, value=value, tree_mask=mask, kv_mask=kv_mask)
    args.update(change)
    return args


BAD = [
    (dict(query=torch.zeros(2, 4, 5)), ValueError, "query, key and value must be 4-D"),
    (dict(query=torch.zeros(2, 4, 5, 8, dtype=torch.int64)), TypeError, "query must be float32, bfloat16 or float16"),
    (dict(key=torch.zeros(2, 2, 11, 4)), ValueError, r"key and value must be \[B, Hkv, S, D\]"),
    (dict(value=torch.zeros(2, 2, 10, 8)), ValueError, r"key and value must be \[B, Hkv, S, D\]"),
    (dict(key=torch.zeros(2, 2, 11, 8, dtype=torch.float16)), TypeError, "must have query's dtype"),
    (dict(key=torch.zeros(2, 3, 11, 8), value=torch.zeros(2, 3, 11, 8)), ValueError,
     "need N >= 1, Hq a multiple of Hkv and S >= N"),
    (dict(key=torch.zeros(2, 2, 4, 8), value=torch.zeros(2, 2, 4, 8)), ValueError,
     "need N >= 1, Hq a multiple of Hkv and S >= N"),
    (dict(tree_mask=torch.zeros(2, 5, 2, dtype=torch.int32)), ValueError, r"tree_mask must be \[B, N, ceil\(N/32\)\]"),
    (dict(tree_mask=torch.zeros(2, 5, 1, dtype=torch.int64)), ValueError,
     r"tree_mask must be \[B, N, ceil\(N/32\)\] int32"),
    (dict(kv_mask=torch.ones(2, 7, dtype=torch.bool)), ValueError, r"kv_mask must be \[B, S - N\] bool"),
    (dict(kv_mask=torch.ones(2, 6, dtype=torch.int64)), ValueError, r"kv_mask must be \[B, S - N\] bool"),
    (dict(sinks=torch.zeros(3)), ValueError, r"sinks must be a float32 \[Hq\] tensor"),
    (dict(scale=0.0), ValueError, "scale must be finite and > 0, got 0"),
    (dict(scale=float("nan")), ValueError, "scale must be finite and > 0, got nan"),
    (dict(softcap=-1.0), ValueError, r"softcap must be finite and >= 0 \(0: no soft-cap\), got -1"),
    (dict(window=-1), ValueError, r"window must be >= 0 \(0: no window\), got -1"),
    (dict(window=2.5), TypeError, "window must be an int, got float"),
]


@pytest.mark.parametrize("change,error,match", BAD)
def test_bad_arguments(change, error, match):
    args = _bad(**change)
    with pytest.raises(error, match=match):
        specops.ops.tree_attention(args.pop("query"), args.pop("key"), args.pop("value"), args.pop("tree_mask"),
                                   **args)


def test_bad_mask_values():
    args = _bad()
    mask = args["tree_mask"].clone()
    mask[1, 3, 0] |= 1 << 7  # node 7 of 5
    with pytest.raises(ValueError, match="tree_mask has a bit set at or past node N = 5"):
        specops.ops.tree_attention(args["query"], args["key"], args["value"], mask)
    mask = args["tree_mask"].clone()
    mask[0, 2, 0] &= ~(1 << 2)
    with pytest.raises(ValueError, match="tree_mask has a node that does not see itself"):
        specops.ops.tree_attention(args["query"], args["key"], args["value"], mask)
    # validate=False skips the value checks and still returns finite numbers.
    out = specops.ops.tree_attention(args["query"], args["key"], args["value"], mask, validate=False)
    assert torch.isfinite(out).all()


def test_value_checks_on_the_accelerator_path():
    """specops.ops checks the mask's values with one host sync where kernels cannot raise: the same messages."""
    from specops.ops._checks import _raise_first
    from specops.ops.attention import _tree_mask_checks

    mask = tree_words([[-1, 0, 0]], 3)
    _raise_first("tree_attention", _tree_mask_checks(mask, 3))  # a good mask passes
    bad = mask.clone()
    bad[0, 1, 0] |= -(2**31)  # bit 31: node 31 of 3
    with pytest.raises(ValueError, match="bit set at or past node N = 3"):
        _raise_first("tree_attention", _tree_mask_checks(bad, 3))
    bad = mask.clone()
    bad[0, 0, 0] = 0
    with pytest.raises(ValueError, match="does not see itself"):
        _raise_first("tree_attention", _tree_mask_checks(bad, 3))


def test_devices_must_match():
    args = _bad()
    with pytest.raises(ValueError, match="kv_mask is on meta but query is on cpu"):
        specops.ops.tree_attention(args["query"], args["key"], args["value"], args["tree_mask"],
                                   kv_mask=args["kv_mask"].to("meta"))
