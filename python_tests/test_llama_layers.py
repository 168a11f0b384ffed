"""Tests of the llama_layers op (csrc/cpu/llama_layers.cpp) against its reference (specops/reference.py).

1. Equal to the float64 reference over weight formats (float32 layers one per slot, float32 fused,
   int8, int4, bfloat16 fused), multi-head and grouped-query attention, one or several new rows, a
   ragged mask or none, an existing cache or none, q|k|v biases; the new rows' keys and values are
   written into the caches' room (views of larger buffers included), the cache's own slots untouched.
2. The comparison can fail: one changed weight, or the rotary sine with the other sign, is caught.
3. Bad arguments get clear Python errors, never a crash; the fake agrees with the kernel (opcheck).
4. The Gemma-3 / Qwen3 options (q and k norms, four norms a layer, 1 + w norms, GELU-tanh, sliding-window
   layers with their own rotary tables and mask) equal the reference, each of them changes the result
   (so a kernel that ignored one would fail), and their bad values get clear errors.
"""

from __future__ import annotations

import pytest
import torch

from specops import ops, reference
from specops.quantization import pack

D_MODEL, HEAD_DIM, INTER, LAYERS = 64, 16, 96, 3


def _weights(fmt: str, out: int, inp: int, gen: torch.Generator) -> list:
    w = torch.randn(out, inp, generator=gen) / inp ** 0.5
    if fmt.startswith("float32"):
        return [w, None, None]
    return list(pack(w, fmt))


def _layers(fmt: str, heads: int, kv_heads: int, bias: bool, seed: int = 0):
    """norms and the 28-per-layer linear entries of LAYERS random layers."""
    gen = torch.Generator().manual_seed(seed)
    norms, linears = [], []
    q_out, kv_out = heads * HEAD_DIM, kv_heads * HEAD_DIM
    for _ in range(LAYERS):
        norms += [torch.rand(D_MODEL, generator=gen) + 0.5, torch.rand(D_MODEL, generator=gen) + 0.5]
        if fmt == "float32":  # one weight per slot, as a float model's layers are
            for out, inp in ((q_out, D_MODEL), (kv_out, D_MODEL), (kv_out, D_MODEL)):
                b = torch.randn(out, generator=gen) * 0.1 if bias else None
                linears += [*_weights(fmt, out, inp, gen), b]
            linears += [*_weights(fmt, D_MODEL, q_out, gen), None]
            linears += [*_weights(fmt, INTER, D_MODEL, gen), None, *_weights(fmt, INTER, D_MODEL, gen), None]
        else:  # q|k|v and gate|up fused into the q and gate slots
            b = torch.randn(q_out + 2 * kv_out, generator=gen) * 0.1 if bias else None
            linears += [*_weights(fmt, q_out + 2 * kv_out, D_MODEL, gen), b] + [None] * 8
            linears += [*_weights(fmt, D_MODEL, q_out, gen), None]
            linears += [*_weights(fmt, 2 * INTER, D_MODEL, gen), None] + [None] * 4
        linears += [*_weights(fmt, D_MODEL, INTER, gen), None]
    return norms, linears


def _inputs(batch: int, n: int, past: int, kv_heads: int, masked: bool, seed: int = 1, spare: int = 0):
    """hidden, cos, sin, mask, keys, values: each layer's keys and values [B, kv_heads, past + n, D] hold
    `past` random cached slots and n slots of room (NaN, so a slot the op should write and did not
    shows); with spare > 0 they are views of buffers `spare` slots longer, as a decoding cache is."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch * n, D_MODEL, generator=gen)
    angle = (torch.rand(batch, n, HEAD_DIM // 2, generator=gen) * 6).repeat(1, 1, 2)

    def cache():
        buf = torch.full((batch, kv_heads, past + n + spare, HEAD_DIM), float("nan"))
        buf[:, :, :past] = torch.randn(batch, kv_heads, past, HEAD_DIM, generator=gen)
        return buf[:, :, :past + n]

    keys = [cache() for _ in range(LAYERS)]
    values = [cache() for _ in range(LAYERS)]
    mask = None
    if masked:  # the earlier rows padded at random (a ragged batch), causal over the new rows
        mask = torch.rand(batch, 1, n, past + n, generator=gen) > 0.3
        mask[..., past:] = torch.ones(n, n, dtype=torch.bool).tril()
    return hidden, angle.cos(), angle.sin(), mask, keys, values


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of t laid out alike: a view of a copy of its buffer if it is a view."""
    if t._base is None:
        return t.clone()
    return t._base.clone().as_strided(t.shape, t.stride(), t.storage_offset())


def _both(args, norms, linears, heads, kv_heads):
    """(the op's hidden, keys, values), (the reference's), each on its own copy of the caches."""
    hidden, cos, sin, mask, keys, values = args
    results = []
    for fn in (ops.llama_layers, reference.llama_layers):
        k, v = [_copy(t) for t in keys], [_copy(t) for t in values]
        with torch.inference_mode():
            x = fn(hidden, cos, sin, mask, norms, linears, k, v, heads, kv_heads, 1e-5, HEAD_DIM ** -0.5)
        results.append((x, k, v))
    return results


def _close(got, want, tol=2e-5):
    return (got - want).abs().max() <= tol * max(want.abs().max(), 1.0)


@pytest.mark.parametrize("fmt", ["float32", "float32_fused", "int8", "int4", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("batch,n,past,masked,spare", [(1, 1, 7, False, 0), (2, 3, 5, True, 4), (3, 4, 0, True, 0),
                                                       (2, 1, 6, True, 9), (1, 2, 40, False, 3)])
def test_equals_the_reference(fmt, heads, kv_heads, batch, n, past, masked, spare):
    norms, linears = _layers(fmt.removesuffix("_fused"), heads, kv_heads, bias=heads == kv_heads)
    if fmt == "float32_fused":  # a float32 weight in the fused layout goes through skinny_linear
        norms, linears = _layers("float32", heads, kv_heads, bias=False)
        fused = []
        for layer in range(LAYERS):
            slots = linears[28 * layer:28 * (layer + 1)]
            qkv = torch.cat([slots[0], slots[4], slots[8]])
            gate_up = torch.cat([slots[16], slots[20]])
            fused += [qkv, None, None, None] + [None] * 8 + slots[12:16] + [gate_up, None, None, None] + [None] * 4 + \
                slots[24:28]
        linears = fused
    args = _inputs(batch, n, past, kv_heads, masked, spare=spare)
    (x, keys, values), (want_x, want_keys, want_values) = _both(args, norms, linears, heads, kv_heads)
    assert x.shape == (batch * n, D_MODEL) and x.dtype == torch.float32
    assert _close(x, want_x)
    for layer in range(LAYERS):
        assert keys[layer].shape == (batch, kv_heads, past + n, HEAD_DIM)
        assert _close(keys[layer], want_keys[layer]) and _close(values[layer], want_values[layer])
        assert keys[layer].isfinite().all() and values[layer].isfinite().all()  # every new slot written
        if past:  # the cache's own slots come back unchanged
            assert torch.equal(keys[layer][:, :, :past], args[4][layer][:, :, :past])
            assert torch.equal(values[layer][:, :, :past], args[5][layer][:, :, :past])
        if spare:  # nothing written past the room
            assert keys[layer]._base[:, :, past + n:].isnan().all()
            assert values[layer]._base[:, :, past + n:].isnan().all()


def test_the_comparison_can_fail():
    norms, linears = _layers("int8", 4, 2, bias=False)
    args = _inputs(2, 3, 5, 2, masked=True)
    (x, _, _), (want, _, _) = _both(args, norms, linears, 4, 2)
    assert _close(x, want)
    changed = list(linears)
    changed[28 + 24] = changed[28 + 24].clone()
    changed[28 + 24][3, 7] += 5  # one int8 weight of the second layer's down projection
    (other, _, _), _ = _both(args, norms, changed, 4, 2)
    assert not _close(other, want)
    hidden, cos, sin, mask, keys, values = args
    (flipped, _, _), _ = _both((hidden, cos, -sin, mask, keys, values), norms, linears, 4, 2)
    assert not _close(flipped, want)


@pytest.mark.parametrize("batch,n,past", [(1, 1, 7), (2, 3, 5), (1, 8, 4)])
def test_float32_slots_one_per_weight_or_fused_give_the_same_bits(batch, n, past):
    """A layer's float32 q, k and v (and gate and up) go through skinny_linear's products in one call, their
    outputs side by side: each weight's outputs are the bits it gives alone, its bias added in its own
    columns. So the same weights one per slot and fused into the first slot give the same bits, also where
    a weight's rows are not a multiple of the 16-row panels (gate and up of 40 rows: 8 tail rows each, the
    second weight's after the first's columns), with biases on q, k, v and up."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, inter = 3, 1, 40
    q_out, kv_out = heads * HEAD_DIM, kv_heads * HEAD_DIM

    def w(out, inp):
        return torch.randn(out, inp, generator=gen) / inp ** 0.5

    norms, apart, fused = [], [], []
    for _ in range(LAYERS):
        norms += [torch.rand(D_MODEL, generator=gen) + 0.5, torch.rand(D_MODEL, generator=gen) + 0.5]
        q, k, v, o = w(q_out, D_MODEL), w(kv_out, D_MODEL), w(kv_out, D_MODEL), w(D_MODEL, q_out)
        gate, up, down = w(inter, D_MODEL), w(inter, D_MODEL), w(D_MODEL, inter)
        qb, kb, vb, ub = (torch.randn(size, generator=gen) * 0.1 for size in (q_out, kv_out, kv_out, inter))
        apart += [q, None, None, qb, k, None, None, kb, v, None, None, vb, o, None, None, None,
                  gate, None, None, None, up, None, None, ub, down, None, None, None]
        fused += [torch.cat([q, k, v]), None, None, torch.cat([qb, kb, vb])] + [None] * 8 + \
            [o, None, None, None, torch.cat([gate, up]), None, None, torch.cat([torch.zeros(inter), ub])] + \
            [None] * 4 + [down, None, None, None]
    args = _inputs(batch, n, past, kv_heads, masked=batch > 1)
    (x, keys, values), (want, _, _) = _both(args, norms, apart, heads, kv_heads)
    (fx, fkeys, fvalues), _ = _both(args, norms, fused, heads, kv_heads)
    assert _close(x, want)
    assert torch.equal(x, fx)
    for layer in range(LAYERS):
        assert torch.equal(keys[layer], fkeys[layer]) and torch.equal(values[layer], fvalues[layer])


def test_strided_norm_weights_give_the_same_bits():
    """Norm weights that are views with a stride (a column of a larger tensor) are read as their values."""
    norms, linears = _layers("float32", 4, 2, bias=False)
    args = _inputs(2, 3, 5, 2, masked=True)
    (want, _, _), _ = _both(args, norms, linears, 4, 2)
    strided = [torch.stack([w, -w], 1)[:, 0] for w in norms]
    assert not strided[0].is_contiguous()
    (got, _, _), _ = _both(args, strided, linears, 4, 2)
    assert torch.equal(got, want)


def test_bad_arguments_raise_clear_errors():
    norms, linears = _layers("int8", 4, 2, bias=False)
    hidden, cos, sin, mask, keys, values = _inputs(2, 3, 5, 2, masked=True)
    good = dict(hidden=hidden, cos=cos, sin=sin, attn_mask=mask, norms=norms, linears=linears, keys=keys,
                values=values, heads=4, kv_heads=2, eps=1e-5, scale=0.25)

    def call(**change):
        with torch.inference_mode():
            return ops.llama_layers(**{**good, **change})

    cases = [
        (dict(linears=linears[:-1]), ValueError, "28 L linears"),
        (dict(norms=norms[:-1]), ValueError, "2 L or 4 L norms"),
        (dict(hidden=hidden[:-1]), ValueError, "hidden must be"),
        (dict(hidden=hidden.double()), TypeError, "float32"),
        (dict(sin=sin[:, :2]), ValueError, "cos and sin"),
        (dict(heads=3), ValueError, "multiple of kv_heads"),
        (dict(attn_mask=mask.long()), ValueError, "attn_mask"),
        (dict(attn_mask=mask[..., 1:]), ValueError, "attn_mask"),
        (dict(keys=[k[:, :1] for k in keys]), ValueError, "keys"),
        (dict(values=[v[:, :, 1:] for v in values]), ValueError, "like keys"),
        (dict(keys=[k[:, :, :2] for k in keys]), ValueError, "room for the n = 3 new rows"),
        (dict(keys=[k.transpose(2, 3).contiguous().transpose(2, 3) for k in keys]), ValueError, "contiguous along D"),
        (dict(values=[v.double() for v in values]), TypeError, "float32"),
        (dict(linears=[None] + linears[1:]), ValueError, "needs q, o, gate and down"),
        # q|k|v wider than 2 heads + 2 kv heads
        (dict(heads=2, kv_heads=2), ValueError,
         (r"linears\[0\] \(layer 0's q\|k\|v weight\) must be "
          r"\[heads \* D \+ kv_heads \* D \+ kv_heads \* D, d\] = \[96, 64\], got \[128, 64\]")),
        (dict(linears=[linears[0].float()] + linears[1:]), ValueError,
         r"linears\[0\] .* is float32 and takes no scales"),
        (dict(linears=linears[:1] + [None] + linears[2:]), ValueError,
         r"scales must be \[N, G\] = \[128, G\] for an int8 weight, got None"),
        (dict(eps=float("inf")), ValueError, "eps must be a finite number"),
    ]
    for change, error, words in cases:
        with pytest.raises(error, match=words):
            call(**change)
        # The C++ kernel is the one checker: called directly it raises the same, before any read or write.
        args = {**good, **change}
        with pytest.raises(error, match=words), torch.inference_mode():
            torch.ops.specops.llama_layers(**args)


@pytest.mark.parametrize("past", [0, 5])
def test_opcheck(past):
    norms, linears = _layers("int8", 4, 2, bias=False)
    hidden, cos, sin, mask, keys, values = _inputs(2, 3, past, 2, masked=True)
    torch.library.opcheck(torch.ops.specops.llama_layers.default,
                          (hidden, cos, sin, mask, norms, linears, keys, values, 4, 2, 1e-5, 0.25))


def test_a_row_that_sees_no_slot_attends_to_nothing():
    """A query row whose mask is all False gets zero attention in the kernel and the reference alike
    (SDPA would give NaN): the hidden rows stay finite and agree."""
    norms, linears = _layers("int8", 4, 2, bias=False)
    hidden, cos, sin, mask, keys, values = _inputs(2, 3, 5, 2, masked=True)
    mask[1, 0, 2] = False  # request 1's last new row sees nothing, not even itself
    (x, _, _), (want, _, _) = _both((hidden, cos, sin, mask, keys, values), norms, linears, 4, 2)
    assert x.isfinite().all() and _close(x, want)
    mask[1, 0, 2, -1] = True  # seeing itself again changes that row
    (other, _, _), _ = _both((hidden, cos, sin, mask, keys, values), norms, linears, 4, 2)
    assert not _close(other[5], x[5]) and torch.equal(other[:5], x[:5])


# ---- the Gemma-3 / Qwen3 options ----

def _gemma_options(batch: int, n: int, past: int, masked: bool, seed: int = 5, *, qk: bool = True,
                   sandwich: bool = True) -> tuple[dict, list]:
    """The options of a Gemma-3-like stack: q and k norms, four norms a layer (returned as the norms list),
    offset 1, GELU-tanh, layers 0 and 2 local with their own rotary tables and a window mask."""
    gen = torch.Generator().manual_seed(seed)
    norms = [torch.randn(D_MODEL, generator=gen) * 0.3 for _ in range((4 if sandwich else 2) * LAYERS)]
    angle = (torch.rand(batch, n, HEAD_DIM // 2, generator=gen) * 3).repeat(1, 1, 2)
    window = torch.ones(batch, 1, n, past + n, dtype=torch.bool)
    window[..., :max(past - 2, 0)] = False  # the slots before the window
    window[..., past:] = torch.ones(n, n, dtype=torch.bool).tril()
    if masked:
        window &= torch.rand(batch, 1, n, past + n, generator=gen) > 0.2
        window[..., past:] |= torch.eye(n, dtype=torch.bool)
    options = dict(qk_norms=[torch.randn(HEAD_DIM, generator=gen) * 0.3 for _ in range(2 * LAYERS)] if qk else None,
                   norm_offset=1.0, activation="gelu_tanh", local_layers=[0, 2], local_cos=angle.cos(),
                   local_sin=angle.sin(), local_mask=window)
    return options, norms


def _both_with(args, norms, linears, options, heads=4, kv_heads=2):
    hidden, cos, sin, mask, keys, values = args
    results = []
    for fn in (ops.llama_layers, reference.llama_layers):
        k, v = [_copy(t) for t in keys], [_copy(t) for t in values]
        with torch.inference_mode():
            x = fn(hidden, cos, sin, mask, norms, linears, k, v, heads, kv_heads, 1e-6, HEAD_DIM ** -0.5, **options)
        results.append((x, k, v))
    return results


@pytest.mark.parametrize("fmt", ["float32", "int8"])
@pytest.mark.parametrize("batch,n,past,masked", [(1, 1, 7, False), (2, 3, 5, True), (3, 4, 0, True)])
@pytest.mark.parametrize("variant", ["gemma3", "qwen3"])
def test_gemma_and_qwen3_options_equal_the_reference(fmt, batch, n, past, masked, variant):
    _, linears = _layers(fmt, 4, 2, bias=False)
    args = _inputs(batch, n, past, 2, masked)
    options, norms = _gemma_options(batch, n, past, masked)
    if variant == "qwen3":  # q and k norms on Llama's layer: two norms a layer, w itself, SiLU, no local layers
        norms = norms[:2 * LAYERS]
        options = dict(qk_norms=options["qk_norms"])
    (x, keys, values), (want, want_keys, want_values) = _both_with(args, norms, linears, options)
    assert x.isfinite().all() and _close(x, want)
    for layer in range(LAYERS):
        assert _close(keys[layer], want_keys[layer]) and _close(values[layer], want_values[layer])


def test_each_gemma_option_changes_the_result():
    """Dropping or changing any one option moves the output: the kernel cannot ignore one and pass."""
    _, linears = _layers("float32", 4, 2, bias=False)
    args = _inputs(2, 3, 5, 2, masked=True)
    options, norms = _gemma_options(2, 3, 5, True)
    (x, _, _), (want, _, _) = _both_with(args, norms, linears, options)
    assert _close(x, want)
    variants = [
        dict(options, qk_norms=None),
        dict(options, norm_offset=0.0),
        dict(options, activation="silu"),
        dict(options, local_layers=[0]),
        dict(options, local_mask=None),
        dict(options, local_sin=-options["local_sin"]),
    ]
    for changed in variants:
        (other, _, _), (other_want, _, _) = _both_with(args, norms, linears, changed)
        assert _close(other, other_want) and not _close(other, want)
    (other, _, _), _ = _both_with(args, norms[:2 * LAYERS] * 2, linears, options)  # the post-norms differ
    assert not _close(other, want)


def test_gemma_options_bad_values_raise_clear_errors():
    norms, linears = _layers("int8", 4, 2, bias=False)
    hidden, cos, sin, mask, keys, values = _inputs(2, 3, 5, 2, masked=True)
    options, norms4 = _gemma_options(2, 3, 5, True)
    good = dict(hidden=hidden, cos=cos, sin=sin, attn_mask=mask, norms=norms4, linears=linears, keys=keys,
                values=values, heads=4, kv_heads=2, eps=1e-6, scale=0.25, **options)

    cases = [
        (dict(qk_norms=options["qk_norms"][:-1]), "qk_norms must be None or 2 L"),
        (dict(qk_norms=[w[:-1] for w in options["qk_norms"]]), r"q and k norm weights must be float32 \[D\]"),
        (dict(activation="gelu"), "activation must be 'silu' or 'gelu_tanh'"),
        (dict(local_layers=[3]), r"a layer index in \[0, 3\)"),
        (dict(local_cos=None), "local_layers needs local_cos"),
        (dict(local_sin=options["local_sin"][:, :2]), "local_layers needs local_sin"),
        (dict(local_mask=options["local_mask"][..., 1:]), "local_mask must be bool"),
        (dict(norm_offset=float("nan")), "norm_offset must be a finite number"),
        (dict(norms=norms4[:-1]), "2 L or 4 L norms"),
    ]
    for change, words in cases:
        with pytest.raises(ValueError, match=words), torch.inference_mode():
            ops.llama_layers(**{**good, **change})
        # The C++ kernel is the one checker: called directly it raises the same.
        args = {**good, **change}
        with pytest.raises(ValueError, match=words), torch.inference_mode():
            torch.ops.specops.llama_layers(**args)


def test_opcheck_gemma_options():
    _, linears = _layers("float32", 4, 2, bias=False)
    hidden, cos, sin, mask, keys, values = _inputs(2, 3, 5, 2, masked=True)
    options, norms = _gemma_options(2, 3, 5, True)
    torch.library.opcheck(torch.ops.specops.llama_layers.default,
                          (hidden, cos, sin, mask, norms, linears, keys, values, 4, 2, 1e-6, 0.25),
                          {k: v for k, v in options.items()})
