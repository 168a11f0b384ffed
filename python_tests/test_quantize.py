"""Tests of `specops.quantize`: weight-only bf16 / int8 / int4 linear layers (specops/quantization.py) and
what decoding does with them; tiny random models only, nothing downloads.

1. `pack`: the round-trip error bounds that follow from each format's rule, in float64 (u = 2^-24):
   - int8, s = fl(max|w| / 127), q = round(fl(w / s)): |fl(w / s) - w / s| <= 128 u, so
     |q s - w| <= s (1/2 + 2^-17); the largest |w| of a group gets q = +-127 and 127 s = max|w| (1 + d),
     |d| <= u.
   - int4, s = fl(fl(max - min) / 15), q = round(fl(fl(w - min) / s)) in 0..15: t = fl(w - min) / s is
     within 15 * 2^-22 of (w - min) / s, so |q s + min - w| <= s (1/2 + 2^-18) (+ float64's rounding of
     the sum, 2^-52 |w|); the minimum is exact (q = 0) and the maximum within 2^-22 (max - min).
   - bf16: rounding to 8 significant bits, relative error <= 2^-8.
   All-zero rows and constant groups give no NaN and come back exactly (int8: to the max rule's u).
   Bad group sizes and an int4 K that is not a multiple of 32 raise.
2. `QuantizedLinear`: its forward on [B, T, K] equals x @ W^T + b with W the layer's de-quantized weight,
   within the C++ kernel's bound of test_quantized_linear.py; rows do not depend on their batch; bf16
   input is computed in float32 and returned as bf16; extra_repr.
3. `quantize` on Llama, GPT-2 (Conv1D), Gemma-3 (tied embeddings) and Qwen2 (biases): every linear layer
   replaced, embeddings untouched, the tied head quantized on its own copy, int4's int8 head, `head=` /
   `head_group_size=`, the int8 fallback for K that int4 (or a group) does not fit, and the errors.
4. A quantized model computes the float model with de-quantized weights (to float32 rounding), so its
   logits are as close to the float model's as its weights are; CpuForward reproduces them.
5. Exactness: greedy sd / tli / slem with a quantized drafter equal greedy ar, on a ragged batch; with a
   quantized target they equal the quantized target's own ar.
6. Statistics: sampled sd (same vocabulary) and tli (another vocabulary) with an int4 toy drafter follow
   the target's exact distribution (the chi-square of test_decode.py / test_decode_hetero.py), and the
   same check rejects a 1% shift and the drafter's own distribution.
7. `specops.models`: ":weights" suffixes, their errors before anything loads, and the weights an
   embedded drafter gets by default.
8. The draft-length controller drafts at least as long (here strictly longer) with a cheaper drafter.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import arch_zoo
import specops
from specops import models, reference
from specops.decoding.cpu_forward import CpuForward
from specops.decoding.cost_model import DraftLength
from specops.quantization import QuantizedLinear, pack, quantize, weights_of
from stats_helpers import (ALPHA, CLOSE_TABLE, DRAFTER_TOKENS, MERGED_WORDS, N_SEQUENCES, PROMPTS,
                           SD_DRAFTER_TABLE, SD_STAT_PROMPTS, SD_TARGET_TABLE, STAT_K, TARGET_TOKENS,
                           TLI_STAT_NEW, TLI_STAT_PROMPTS, TLI_TARGET_TABLE, _exact, _fit, _pooled_fit,
                           _simulate, _true_rate, assert_follows_target, cpu_like)
from stats_helpers import SD_STAT_NEW as STAT_NEW
from stats_helpers import mass_moved
from toy_models import (BYTE_VOCAB, TableLM, byte_tokenizer, letter_tokenizer, merged_byte_tokenizer,
                        sequence_distribution, tiny_gemma3, tiny_llama, token_tokenizer)

# Vocabulary maps (tli, slem) go to a temporary cache; tiny models run on one thread.
pytestmark = pytest.mark.usefixtures("one_torch_thread", "private_specops_cache")

FORMATS = ["bf16", "int8", "int4"]
FORMATS_GROUP = {"bf16": None, "int8": None, "int4": 32}  # each format's default group (None: per channel)
U = 2.0**-24  # float32's unit roundoff


def _rows(n: int, k: int, seed: int) -> torch.Tensor:
    """A float32 [n, k] weight whose rows span four orders of magnitude, so scales differ per row."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 10.0 ** torch.empty(n, 1).uniform_(-3, 1, generator=g)


def _per_weight(values: torch.Tensor, k: int) -> torch.Tensor:
    """Per-group values [N, G] repeated over the group's weights: [N, K] float64."""
    return values.double().repeat_interleave(k // values.shape[1], dim=1)


def _error_bound(w: torch.Tensor, fmt: str, scales: torch.Tensor | None) -> torch.Tensor:
    """The largest |dequantized - w| per weight that `pack`'s rule allows (the derivations: docstring, 1)."""
    w = w.double()
    if fmt == "bf16":
        return 2.0**-8 * w.abs()
    s = _per_weight(scales, w.shape[1])
    if fmt == "int8":
        return s * (0.5 + 2.0**-17)
    return s * (0.5 + 2.0**-18) + 2.0**-52 * w.abs()


# ---- 1. pack ----

@pytest.mark.parametrize("fmt,group", [("bf16", None), ("int8", None), ("int8", 32), ("int8", 128),
                                       ("int4", None), ("int4", 64), ("int4", 128)])
def test_pack_round_trip_bounds(fmt, group):
    n, k = 12, 256
    w = _rows(n, k, seed=1)
    stored, scales, mins = pack(w, fmt, group)
    deq = reference.dequantize(stored, scales, mins)
    assert deq.shape == (n, k) and not deq.isnan().any()
    assert ((deq - w.double()).abs() <= _error_bound(w, fmt, scales)).all()
    if fmt == "bf16":
        assert scales is None and mins is None and stored.dtype == torch.bfloat16
        return
    size = group or {"int8": k, "int4": 32}[fmt]
    assert scales.shape == (n, k // size) and scales.dtype == torch.float32
    grouped, deq_grouped = w.double().view(n, k // size, size), deq.view(n, k // size, size)
    if fmt == "int8":
        assert stored.dtype == torch.int8 and mins is None
        assert int(stored.abs().max()) <= 127
        # The largest |w| of each group comes back to within one float32 rounding of its scale.
        top = grouped.abs().argmax(-1, keepdim=True)
        w_top, deq_top = grouped.gather(-1, top), deq_grouped.gather(-1, top)
        assert ((deq_top - w_top).abs() <= U * w_top.abs()).all()
    else:
        assert stored.dtype == torch.uint8 and stored.shape == (n, k // 2)
        low, high = grouped.amin(-1), grouped.amax(-1)
        assert torch.equal(deq_grouped.amin(-1), low)  # q = 0: the minimum itself
        assert ((deq_grouped.amax(-1) - high).abs() <= 2.0**-22 * (high - low) + 2.0**-52 * high.abs()).all()


@pytest.mark.parametrize("fmt,group", [("bf16", None), ("int8", None), ("int8", 32), ("int4", None)])
def test_pack_zero_rows_and_constant_groups(fmt, group):
    w = _rows(4, 64, seed=2)
    w[1] = 0.0
    w[2, :32] = 0.37  # a constant group (of 32: int4's group and the grouped int8)
    w[3] = -1.5  # a constant row
    deq = reference.dequantize(*pack(w, fmt, group))
    assert not deq.isnan().any() and not deq.isinf().any()
    assert (deq[1] == 0).all()
    constant = [(2, slice(0, 32)), (3, slice(None))] if fmt != "int8" or group else [(3, slice(None))]
    for row, cols in constant:
        expected = w[row, cols].double()
        if fmt == "int8":  # every weight is the group's largest: 127 * fl(|c| / 127), one rounding
            assert ((deq[row, cols] - expected).abs() <= U * expected.abs()).all()
        else:  # bf16: the value rounded once; int4: q = 0, so the group's minimum itself
            assert torch.equal(deq[row, cols], expected if fmt == "int4" else expected.bfloat16().double())


def test_pack_bad_arguments():
    w = _rows(4, 96, seed=3)
    with pytest.raises(ValueError, match="bf16 weights have no groups"):
        pack(w, "bf16", 32)
    for fmt in ("int8", "int4"):
        for group in (48, 64, 0, -32, 192):  # not a multiple of 32, not dividing K, not positive, > K
            with pytest.raises(ValueError, match=rf"multiple of 32 dividing K = 96, got {group}"):
                pack(w, fmt, group)
    with pytest.raises(ValueError, match="K = 48"):  # int4's blocks of 32 along K
        pack(_rows(4, 48, seed=3), "int4")
    with pytest.raises(ValueError, match="weights must be one of bf16, int8, int4, got 'fp8'"):
        pack(w, "fp8")


# ---- 2. QuantizedLinear ----

LAYER_CASES = [("bf16", None), ("int8", None), ("int8", 32), ("int4", None), ("int4", 64)]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("fmt,group", LAYER_CASES)
def test_quantized_linear_forward(fmt, group, bias):
    n, k = 40, 128
    g = torch.Generator().manual_seed(4)
    w = torch.randn(n, k, generator=g) * 0.1
    b = torch.randn(n, generator=g) if bias else None
    layer = QuantizedLinear(w, b, fmt, group)
    x = torch.randn(2, 3, k, generator=g)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (2, 3, n) and out.dtype == torch.float32
    deq = reference.dequantize(layer.weight, layer.scales, layer.mins)
    assert torch.equal(layer.dequantize(), deq.float())
    expected = x.double() @ deq.T + (b.double() if bias else 0.0)
    # The C++ kernel's bound (test_quantized_linear.py, 2): (K/16 + 25) u S with S = sum_k |x_k|
    # (|q_k s_g| + |m_g|) + |b|, covering the float32 de-quantization, the lane tree's sums and its tails.
    magnitude = reference.dequantize(layer.weight, layer.scales).abs()  # |q s| (bf16: |w|)
    if layer.mins is not None:
        magnitude = magnitude + _per_weight(layer.mins, k).abs()
    scale = x.double().abs() @ magnitude.T + (b.double().abs() if bias else 0.0)
    assert ((out.double() - expected).abs() <= (k / 16 + 25) * U * scale).all()
    # The op wrapper on the same buffers, and each row alone: the same bits.
    op = specops.ops.quantized_linear(x, layer.weight, layer.scales, layer.mins, layer.bias)
    assert torch.equal(out, op)
    with torch.no_grad():
        assert torch.equal(layer(x[1:, 2:]), out[1:, 2:])
    assert layer.format == fmt and layer.group_size == (group or FORMATS_GROUP[fmt])
    assert (layer.bias is not None) == bias


@pytest.mark.parametrize("slow_mkl", [True, False], ids=["mkl-slow", "blas-fast"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_long_prefill_chunk_multiplies_the_float32_weight(monkeypatch, fmt, slow_mkl):
    """Beyond _OP_ROWS rows a CPU layer multiplies its de-quantized float32 weight: through oneDNN where MKL
    is slow (specops/_blas.py; 256 x 576 weights make the product large enough for it), else through F.linear;
    at _OP_ROWS rows through the op. The bits tell which ran, and each is the product."""
    from specops import _blas, quantization

    monkeypatch.setattr(_blas, "slow_here", lambda: slow_mkl)
    g = torch.Generator().manual_seed(6)
    layer = QuantizedLinear(torch.randn(256, 576, generator=g) * 0.1, torch.randn(256, generator=g), fmt)
    weight = layer.dequantize_float32()
    for rows in (quantization._OP_ROWS, quantization._OP_ROWS + 1, 3 * quantization._OP_ROWS):
        x = torch.randn(rows, 576, generator=g)
        with torch.no_grad():
            out = layer(x)
        blas = torch.nn.functional.linear(x, weight, layer.bias)
        op = specops.ops.quantized_linear(x, layer.weight, layer.scales, layer.mins, layer.bias)
        if rows <= quantization._OP_ROWS:
            want = op
        elif slow_mkl and _blas.onednn_works():
            want = _blas.onednn_linear(x, weight, layer.bias)
            assert not torch.equal(want, blas)  # the bits tell oneDNN from F.linear (K = 576; at 128 they agree)
        else:
            want = blas
        assert torch.equal(out, want)
        torch.testing.assert_close(out.double(), x.double() @ weight.double().T + layer.bias.double(),
                                   rtol=1e-5, atol=1e-4)


def test_quantized_linear_bf16_input_on_cpu():
    g = torch.Generator().manual_seed(5)
    layer = QuantizedLinear(torch.randn(24, 64, generator=g), torch.randn(24, generator=g), "int4")
    x = torch.randn(3, 5, 64, generator=g).bfloat16()
    with torch.no_grad():
        out = layer(x)
        computed = layer(x.float())  # what the CPU computes: the float32 forward, then cast
    assert out.dtype == torch.bfloat16 and out.shape == (3, 5, 24)
    assert torch.equal(out, computed.bfloat16())


def test_quantized_linear_extra_repr():
    w = torch.zeros(40, 128)
    assert repr(QuantizedLinear(w, torch.zeros(40), "int4", 64)) == (
        "QuantizedLinear(in_features=128, out_features=40, weights=int4, group_size=64, bias=True)")
    assert QuantizedLinear(w, None, "int8").extra_repr() == (
        "in_features=128, out_features=40, weights=int8, bias=False")
    assert QuantizedLinear(w, None, "bfloat16").extra_repr() == (
        "in_features=128, out_features=40, weights=bf16, bias=False")


# ---- 3. quantize(model) ----

ARCHITECTURES = {
    # builder, linear layers (Linear or Conv1D, the head included)
    "llama": (arch_zoo.llama, 3 * 7 + 1),
    "gpt2": (arch_zoo.gpt2, 2 * 4 + 1),  # c_attn, c_proj, c_fc, c_proj are Conv1D; lm_head Linear
    "gemma3-tied": (lambda: tiny_gemma3(layers=2), 2 * 7 + 1),
    "qwen2-bias": (arch_zoo.qwen2_sliding, 4 * 7 + 1),
}


def _float_linears(model) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """name -> (weight [out, in], bias) of every float linear layer (transformers' Conv1D: [in, out])."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            found[name] = module.weight.detach().clone(), module.bias
        elif type(module).__name__ == "Conv1D":
            found[name] = module.weight.detach().t().clone(), module.bias
    return {name: (w, None if b is None else b.detach().clone()) for name, (w, b) in found.items()}


def _embeddings(model) -> dict[str, torch.Tensor]:
    return {name: module.weight for name, module in model.named_modules()
            if isinstance(module, torch.nn.Embedding)}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_quantize_replaces_every_linear(arch, fmt):
    build, count = ARCHITECTURES[arch]
    model = build()
    linears = _float_linears(model)
    assert len(linears) == count
    embeddings = {name: weight.detach().clone() for name, weight in _embeddings(model).items()}
    assert embeddings
    head = model.get_output_embeddings()
    head_name = next(name for name, module in model.named_modules() if module is head)
    assert quantize(model, fmt) is model
    assert weights_of(model) == fmt
    assert not _float_linears(model)
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert quantized.keys() == linears.keys()
    for name, layer in quantized.items():
        w, b = linears[name]
        want = ("int8", 32) if fmt == "int4" and name == head_name else (fmt, FORMATS_GROUP[fmt])
        assert (layer.format, layer.group_size) == want, name
        deq = reference.dequantize(layer.weight, layer.scales, layer.mins)
        assert ((deq - w.double()).abs() <= _error_bound(w, layer.format, layer.scales)).all(), name
        assert (b is None) == (layer.bias is None) and (b is None or torch.equal(layer.bias, b)), name
    if arch == "qwen2-bias":
        assert quantized["model.layers.0.self_attn.q_proj"].bias is not None
    for name, weight in _embeddings(model).items():  # untouched, float, still parameters
        assert isinstance(weight, torch.nn.Parameter) and weight.dtype == torch.float32
        assert torch.equal(weight, embeddings[name]), name


def test_quantize_tied_head_gets_its_own_copy():
    model = tiny_gemma3(layers=1)
    embedding = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embedding  # tied
    original = embedding.detach().clone()
    quantize(model, "int8")
    head = model.get_output_embeddings()
    assert isinstance(head, QuantizedLinear) and head.weight.dtype == torch.int8
    assert model.get_input_embeddings().weight is embedding and torch.equal(embedding, original)
    deq = reference.dequantize(head.weight, head.scales)
    assert ((deq - original.double()).abs() <= _error_bound(original, "int8", head.scales)).all()
    with torch.no_grad():  # and the model runs, reading float embeddings
        logits = model(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, head.out_features) and logits.isfinite().all()


@pytest.mark.parametrize("kwargs,layers,head", [
    ({"weights": "int4"}, ("int4", 32), ("int8", 32)),  # the default int4 model: an int8 head in groups of 32
    ({"weights": "int4", "head": "bf16"}, ("int4", 32), ("bf16", None)),
    ({"weights": "int4", "head": "int4", "head_group_size": 64}, ("int4", 32), ("int4", 64)),
    ({"weights": "int4", "head_group_size": 64}, ("int4", 32), ("int8", 64)),
    ({"weights": "int4", "group_size": 64}, ("int4", 64), ("int8", 32)),
    ({"weights": "int8"}, ("int8", None), ("int8", None)),
    ({"weights": "int8", "head_group_size": 32}, ("int8", None), ("int8", 32)),
    ({"weights": "int8", "group_size": 64}, ("int8", 64), ("int8", 64)),  # the head follows group_size
    ({"weights": "bf16", "head": "int8"}, ("bf16", None), ("int8", None)),
], ids=["int4", "int4-head-bf16", "int4-head-int4-64", "int4-head-group-64", "int4-group-64", "int8",
        "int8-head-group-32", "int8-group-64", "bf16-head-int8"])
def test_quantize_head_settings(kwargs, layers, head):
    """hidden 128 (down_proj K = 256), so that groups of 64 are real groups."""
    model = quantize(tiny_llama(layers=1, hidden=128), **kwargs)
    got = {(name, m.format, m.group_size) for name, m in model.named_modules()
           if isinstance(m, QuantizedLinear)}
    assert ("lm_head", *head) in got
    assert {(f, g) for name, f, g in got if name != "lm_head"} == {layers}
    assert model.lm_head.scales is None or model.lm_head.scales.shape[1] == 128 // (head[1] or 128)


def test_quantize_falls_back_to_int8_where_k_does_not_fit():
    """hidden 48: the attention, gate and up projections and the head have K = 48 (no int4 block of 32
    fits, and groups of 32 do not divide it); down_proj has K = 96."""
    model = quantize(tiny_llama(layers=1, hidden=48), "int4")
    got = {name.rsplit(".", 1)[-1]: (m.format, m.group_size) for name, m in model.named_modules()
           if isinstance(m, QuantizedLinear)}
    k48 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "lm_head")
    assert got == {**{p: ("int8", None) for p in k48}, "down_proj": ("int4", 32)}
    model = quantize(tiny_llama(layers=1, hidden=48), "int8", group_size=64)  # 64 divides neither 48 nor 96
    formats = {(m.format, m.group_size) for m in model.modules() if isinstance(m, QuantizedLinear)}
    assert formats == {("int8", None)}
    # A plain module without an output head: every layer is an ordinary one.
    g = torch.Generator().manual_seed(6)
    float_mlp = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    mlp = quantize(copy.deepcopy(float_mlp), "int4")
    assert [(m.format, m.group_size) for m in mlp[::2]] == [("int8", None), ("int4", 32)]
    x = torch.randn(5, 48, generator=g)
    with torch.no_grad():
        hidden = torch.relu(x @ mlp[0].dequantize().T + mlp[0].bias)
        expected = hidden @ mlp[2].dequantize().T + mlp[2].bias
        torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)  # float32 summation order only


def test_quantize_errors():
    model = quantize(tiny_llama(layers=1), "int8")
    head = model.lm_head
    with pytest.raises(ValueError, match=r"already quantized \(int8\); quantize the float model"):
        quantize(model, "int4")
    assert model.lm_head is head and weights_of(model) == "int8"  # untouched
    with pytest.raises(ValueError, match="Sequential has no linear layers to quantize"):
        quantize(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Embedding(4, 4)), "int8")
    for bad in ("int3", "fp8", "float32", "INT8", None, 8):
        with pytest.raises(ValueError, match="weights must be one of bf16, int8, int4"):
            quantize(tiny_llama(layers=1), bad)
    with pytest.raises(ValueError, match="got 'fp8'"):
        quantize(tiny_llama(layers=1), "int4", head="fp8")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        quantize("llama", "int8")


def test_weights_of():
    model = tiny_llama(layers=1)
    assert weights_of(model) == "float"
    assert weights_of(quantize(model, "bfloat16")) == "bf16"  # the alias names the format
    assert weights_of(quantize(tiny_llama(layers=1), "int4")) == "int4"


# ---- 4. logits of a quantized model ----

def _dequantized_copy(float_model, quantized_model):
    """float_model with every layer that quantized_model quantized given that layer's de-quantized float32
    weight (a tied head gets its own parameter, the embedding keeps the float weight)."""
    model = copy.deepcopy(float_model)
    for name, layer in quantized_model.named_modules():
        if isinstance(layer, QuantizedLinear):
            module = model.get_submodule(name)
            weight = layer.dequantize()
            module.weight = torch.nn.Parameter(weight.t().contiguous() if type(module).__name__ == "Conv1D"
                                               else weight)
    return model


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_quantized_logits_close_to_float(arch, fmt):
    float_model = ARCHITECTURES[arch][0]()
    model = quantize(copy.deepcopy(float_model), fmt)
    ids = torch.arange(2, 26).view(2, 12) * 7 % 250 + 2
    with torch.no_grad():
        want = float_model(input_ids=ids).logits
        got = model(input_ids=ids).logits
        same_weights = _dequantized_copy(float_model, model)(input_ids=ids).logits
    # The quantized model is the float model with its de-quantized weights: they differ by float32
    # summation order (7e-7 of the logit scale measured; 1e-5 is about 170 u).
    assert (got - same_weights).abs().max() <= 1e-5 * same_weights.abs().max()
    # So its logits are as far from the float model's as its weights are. A relative weight error e
    # (rms over the layers) enters each of the n linear layers on the way to the logits as an
    # independent error of about e; they add in quadrature: e sqrt(n). Measured 0.4-0.83 of that on
    # these models in every format; 1.5 leaves room. e itself: a rounding error uniform within half a
    # step has an rms of step / sqrt(12); bf16's step is <= 2^-7 |w|, int8's max|w| / 127 (about 3 rms(w)
    # for these Gaussian rows), int4's (max - min) / 15 over 32 weights (about 4 rms(w)).
    errors = []
    for name, layer in model.named_modules():
        if isinstance(layer, QuantizedLinear):
            w = float_model.get_submodule(name).weight.detach()
            w = w.t() if type(float_model.get_submodule(name)).__name__ == "Conv1D" else w
            errors.append(float((layer.dequantize() - w).norm() / w.norm()))
    e = math.sqrt(sum(x * x for x in errors) / len(errors))
    assert e <= {"bf16": 2.0**-7, "int8": 4 / 127, "int4": 5 / 15}[fmt] / math.sqrt(12)
    assert (got - want).norm() <= 1.5 * e * math.sqrt(len(errors)) * want.norm()


@pytest.mark.parametrize("build", [lambda: tiny_llama(layers=2), lambda: tiny_gemma3(layers=2)],
                         ids=["llama", "gemma3"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_forward_reproduces_quantized_model(build, fmt):
    model = quantize(build(), fmt)
    assert CpuForward.usable(model)
    routed = CpuForward(model)
    assert routed.head is model.get_output_embeddings() and not routed.linears  # nothing left to route
    ids = torch.arange(2, 18).view(2, 8) * 11 % 250 + 2
    with torch.inference_mode():
        want = model(input_ids=ids, use_cache=False).logits
        got = routed(8, input_ids=ids, use_cache=False)
    assert got.shape == want.shape
    assert (want - got).abs().max() <= 1e-3 * want.abs().max()  # CpuForward.usable's probe


# ---- 5. exactness with quantized drafters and targets ----

MAX_NEW = 20


@pytest.fixture(scope="module")
def llama_target():
    return tiny_llama(layers=4, seed=0), byte_tokenizer()


@pytest.fixture(scope="module")
def llama_ar(llama_target):
    model, tok = llama_target
    return specops.decode(PROMPTS, target=model, tokenizer=tok, method="ar", max_new_tokens=MAX_NEW).tokens


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("drafter", ["target-copy", "independent"])
def test_greedy_sd_with_quantized_drafter_equals_ar(llama_target, llama_ar, fmt, drafter):
    """The drafter: the target itself, quantized (its drafts mostly accepted), or an independent model."""
    model, tok = llama_target
    float_drafter = copy.deepcopy(model) if drafter == "target-copy" else tiny_llama(layers=2, seed=1)
    result = specops.decode(PROMPTS, target=model, tokenizer=tok, drafter=quantize(float_drafter, fmt),
                            drafter_tokenizer=tok, method="sd", max_new_tokens=MAX_NEW, num_draft_tokens=3)
    assert result.tokens == llama_ar
    assert result.stats.drafted > 0
    if drafter == "target-copy":
        assert result.stats.accepted > result.stats.drafted / 2


def _merged_twin(model):
    """`model` (a byte-level tiny Llama) over merged_byte_tokenizer(MERGED_WORDS): every weight copied, the
    multi-byte tokens' embedding and head rows random (small: rarely chosen). It reads the text in other
    tokens, so it drafts the target's choices often, not always."""
    twin = tiny_llama(layers=model.config.num_hidden_layers, seed=5,
                      vocab=len(merged_byte_tokenizer(MERGED_WORDS)))
    state = twin.state_dict()
    for name, value in model.state_dict().items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            state[name][:BYTE_VOCAB] = value  # the byte tokens keep their ids in the merged tokenizer
        else:
            state[name] = value
    twin.load_state_dict(state)
    return twin


@pytest.fixture(scope="module")
def byte_target_merged_drafter():
    """A byte-level tiny Llama target and its int4 twin over multi-byte tokens as the drafter."""
    target = tiny_llama(layers=2, seed=0)
    drafter = quantize(_merged_twin(target), "int4")
    return target, byte_tokenizer(), drafter, merged_byte_tokenizer(MERGED_WORDS)


@pytest.mark.parametrize("method", ["tli", "slem"])
def test_greedy_heterogeneous_with_quantized_drafter_equals_ar(byte_target_merged_drafter, method):
    target, tok, drafter, drafter_tok = byte_target_merged_drafter
    expected = specops.decode(PROMPTS, target=target, tokenizer=tok, method="ar",
                              max_new_tokens=MAX_NEW).tokens
    result = specops.decode(PROMPTS, target=target, tokenizer=tok, drafter=drafter,
                            drafter_tokenizer=drafter_tok, method=method, max_new_tokens=MAX_NEW,
                            num_draft_tokens=2)
    assert result.tokens == expected
    assert 0 < result.stats.accepted < result.stats.drafted  # both paths: accepted and rejected drafts


def test_greedy_with_quantized_target_equals_its_ar(llama_target, llama_ar, byte_target_merged_drafter):
    """A quantized target is another model: decoding gives exactly its own greedy output, whatever drafts."""
    model, tok = llama_target
    target = quantize(copy.deepcopy(model), "int4")
    expected = specops.decode(PROMPTS, target=target, tokenizer=tok, method="ar",
                              max_new_tokens=MAX_NEW).tokens
    assert expected != llama_ar  # int4 changed some greedy choice of the random model
    drafters = [("self:2", None, "sd"), (quantize(tiny_llama(layers=2, seed=1), "int8"), tok, "sd"),
                (byte_target_merged_drafter[2], byte_target_merged_drafter[3], "slem")]
    for drafter, drafter_tok, method in drafters:
        result = specops.decode(PROMPTS, target=target, tokenizer=tok, drafter=drafter,
                                drafter_tokenizer=drafter_tok, method=method, max_new_tokens=MAX_NEW,
                                num_draft_tokens=3)
        assert result.tokens == expected, (drafter if isinstance(drafter, str) else method)


# ---- 6. statistics with a quantized toy drafter ----

class LinearTableLM(TableLM):
    """A `TableLM` whose logits come out of a linear layer, so `specops.quantize` changes its distribution:
    the one-hot vector of the context (prev2, prev1) times W^T, W[:, context] = the log of the table row
    (0 where the table is 0: those tokens stay impossible, masked to -inf after the layer, as <pad> must
    be). The one-hot vectors are a frozen parameter: the model's embedding."""

    def __init__(self, table: torch.Tensor):
        super().__init__(table)
        rows, n, vocab = table.shape
        contexts = rows * n
        width = 32 * math.ceil(contexts / 32)  # K: whole blocks of 32 for int4
        del self.log_table  # TableLM's forward now gathers one-hot features instead of logits
        one_hot = torch.eye(width)[:contexts].view(rows, n, width)
        self.log_table = torch.nn.Parameter(one_hot, requires_grad=False)
        self.register_buffer("impossible", (table == 0).reshape(contexts, vocab))
        self.lm_head = torch.nn.Linear(width, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.zero_()
            logs = table.log().float().reshape(contexts, vocab)
            self.lm_head.weight[:, :contexts] = torch.where(self.impossible, 0.0, logs).T

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache=True,
                logits_to_keep=0, cache_position=None, **kwargs):
        # TableLM's signature spelled out: the engine passes the arguments forward() names.
        out = super().forward(input_ids, attention_mask, position_ids, past_key_values, use_cache,
                              logits_to_keep, cache_position, **kwargs)
        features = out.logits
        out.logits = self.lm_head(features).masked_fill(self.impossible[features.argmax(-1)], float("-inf"))
        return out

    def probabilities(self) -> torch.Tensor:
        """The table [n+1, n, V] this model samples from (float64)."""
        rows, n = self.log_table.shape[:2]
        weight = (self.lm_head.dequantize() if isinstance(self.lm_head, QuantizedLinear)
                  else self.lm_head.weight.detach()).double()
        logits = weight[:, :rows * n].T.masked_fill(self.impossible, float("-inf"))
        return torch.softmax(logits, -1).reshape(rows, n, -1)


def _int4_drafter(table: torch.Tensor) -> LinearTableLM:
    """The table's LinearTableLM with an int4 head (groups of 32), checked to differ from the float one."""
    float_probs = LinearTableLM(table).probabilities()
    drafter = quantize(LinearTableLM(table), "int4", head="int4")
    assert drafter.lm_head.format == "int4"
    assert (drafter.probabilities() - float_probs).abs().max() > 0.01
    return drafter


@pytest.fixture(scope="module")
def sd_samples():
    """N_SEQUENCES sampled sd continuations of test_decode's STAT_PROMPTS, drafted by an int4 drafter."""
    tok = letter_tokenizer()
    drafter = _int4_drafter(SD_DRAFTER_TABLE)
    prompts = [SD_STAT_PROMPTS[i % len(SD_STAT_PROMPTS)] for i in range(N_SEQUENCES)]
    result = specops.decode(prompts, target=TableLM(SD_TARGET_TABLE), tokenizer=tok, drafter=drafter,
                            drafter_tokenizer=tok, method="sd", max_new_tokens=STAT_NEW, temperature=1.0,
                            seed=2024, num_draft_tokens=2)
    assert all(len(t) == STAT_NEW for t in result.tokens)
    return result, drafter


@pytest.fixture(scope="module")
def tli_samples():
    """N_SEQUENCES sampled tli continuations of test_decode_hetero's pair, its close drafter in int4."""
    target_tok, drafter_tok = token_tokenizer(TARGET_TOKENS), token_tokenizer(DRAFTER_TOKENS)
    prompts = [TLI_STAT_PROMPTS[i % len(TLI_STAT_PROMPTS)] for i in range(N_SEQUENCES)]
    result = specops.decode(prompts, target=TableLM(TLI_TARGET_TABLE), tokenizer=target_tok,
                            drafter=_int4_drafter(CLOSE_TABLE), drafter_tokenizer=drafter_tok, method="tli",
                            max_new_tokens=TLI_STAT_NEW, temperature=1.0, seed=2025, num_draft_tokens=STAT_K)
    assert all(len(t) == TLI_STAT_NEW for t in result.tokens)
    return result


@pytest.mark.slow
def test_sampled_sd_with_int4_drafter_follows_target(sd_samples):
    result, _ = sd_samples
    assert_follows_target(result.text, 1.0, 0)
    assert 0 < result.stats.accepted < result.stats.drafted


@pytest.mark.slow
def test_sampled_tli_with_int4_drafter_follows_target(tli_samples):
    pvalue, impossible = _pooled_fit(tli_samples.tokens, _exact())
    assert impossible == 0, "sequences with probability 0 under the target were produced"
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e}"
    assert 0 < tli_samples.stats.accepted < tli_samples.stats.drafted


def _shifted(exact: dict) -> dict:
    """`exact` with 1% of probability moved between its two likeliest sequences."""
    shifted = mass_moved(exact)
    return shifted


@pytest.mark.slow
def test_chisquare_can_fail(sd_samples, tli_samples):
    """The checks above reject the same samples against the target distribution with 1% of mass moved,
    and (sd) against the int4 drafter's own distribution."""
    result, drafter = sd_samples
    exact = sequence_distribution(SD_TARGET_TABLE, "ab", STAT_NEW)
    assert _fit(result.text, exact)[0] > ALPHA
    assert _fit(result.text, _shifted(exact))[0] < ALPHA
    pvalue, impossible = _fit(result.text, sequence_distribution(drafter.probabilities(), "ab", STAT_NEW))
    assert impossible > 0 or pvalue < ALPHA
    assert _pooled_fit(tli_samples.tokens, _exact())[0] > ALPHA
    assert _pooled_fit(tli_samples.tokens, _shifted(_exact()))[0] < ALPHA


# ---- 7. embedded models: weights suffixes and the default drafter weights ----

@pytest.fixture
def no_loading(monkeypatch):
    """Any attempt to read or convert an embedded model fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("an embedded model was loaded")

    monkeypatch.setattr(models, "_load_or_convert", refuse)


def test_split_weights():
    assert models.split_weights("smollm2-135m:int4") == ("smollm2-135m", "int4")
    assert models.split_weights("gemma-3-270m:float32") == ("gemma-3-270m", "float32")
    assert models.split_weights("smollm2-135m") == ("smollm2-135m", None)
    for bad in ("smollm2-135m:int3", "smollm2-135m:", "smollm2-135m:fp8"):
        with pytest.raises(ValueError, match=r"unknown weights .* after ':'; known: float32, bf16, int8"):
            models.split_weights(bad)


def test_drafter_weights():
    assert models.drafter_weights("smollm2-135m") == "int8"
    assert models.drafter_weights("SmolLM2:int4") == "int8"  # the default, whatever the name asks
    assert models.drafter_weights("gemma-3-270m") == "float32"
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        models.drafter_weights("no-such-model:int4")


def test_load_weights_errors_before_loading(no_loading):
    with pytest.raises(ValueError, match="unknown weights 'int3'"):
        models.load("smollm2-135m:int3")
    with pytest.raises(ValueError, match=r"load: weights must be one of float32, .*, got 'int3'"):
        models.load("smollm2-135m", weights="int3")
    with pytest.raises(ValueError, match=r"the name asks for int4 weights but weights='int8'"):
        models.load("smollm2-135m:int4", weights="int8")
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        models.load("no-such-model:int4")
    with pytest.raises(ValueError, match="unknown weights 'int3'"):
        specops.decode("ab", target=TableLM(SD_TARGET_TABLE), tokenizer=letter_tokenizer(),
                       drafter="smollm2-135m:int3", max_new_tokens=2)
    with pytest.raises(AssertionError, match="was loaded"):  # the guard itself works
        models.load("smollm2-135m:int4")


def test_decode_gives_embedded_drafters_their_default_weights(monkeypatch, llama_target):
    """An embedded drafter named without a suffix is loaded with `drafter_weights`; a suffix, or the
    target role, keeps what the name says. `models.load` is replaced by tiny models here."""
    model, tok = llama_target
    calls = []

    def load(name, weights=None, **kwargs):
        calls.append((name, weights))
        loaded = copy.deepcopy(model)
        return (loaded if weights in (None, "float32") else quantize(loaded, weights)), byte_tokenizer()

    monkeypatch.setattr(models, "load", load)
    for drafter, weights in [("smollm2-135m", "int8"), ("smollm2-135m:float32", None),
                             ("smollm2-135m:int8", None), ("gemma-3-270m", "float32")]:
        calls.clear()
        specops.decode("ab", target=model, tokenizer=tok, drafter=drafter, method="sd", max_new_tokens=2)
        assert calls == [(drafter, weights)]
    calls.clear()
    specops.decode("ab", target="smollm2-135m", method="ar", max_new_tokens=2)
    assert calls == [("smollm2-135m", None)]


# ---- 8. the draft-length controller and a cheaper drafter ----

@pytest.mark.slow
def test_cheaper_drafter_drafts_longer():
    """The same target costs and acceptance; the drafter's forward at float32 cost (20 ms) and at a
    quarter of it (int4 weights read 1/8 of the bytes, plus the activations). The controller's choice
    never gets shorter as the drafter gets cheaper, and here gets strictly longer, as the true best does."""
    def settled(draft_cost: float, acceptance: float) -> int:
        chosen = _simulate(cpu_like, draft_cost, acceptance)[-50:]
        return max(set(chosen), key=chosen.count)

    def best(draft_cost: float, acceptance: float) -> int:
        return max(range(9), key=lambda k: _true_rate(cpu_like, draft_cost, acceptance, k))

    for acceptance in (0.5, 0.7, 0.85, 0.95):
        lengths = [settled(cost, acceptance) for cost in (0.02, 0.01, 0.005, 0.0025)]
        assert lengths == sorted(lengths), (acceptance, lengths)
    assert best(0.02, 0.85) < best(0.005, 0.85)
    assert settled(0.02, 0.85) < settled(0.005, 0.85)
    # The rule itself on fixed measurements: every size measured, so choose() is the argmax.
    for acceptance in (0.6, 0.85):
        chosen = []
        for draft_cost in (0.02, 0.005):
            controller = DraftLength("auto")
            for n in range(1, controller.max_drafts + 2):
                controller.cost.observe(1, n, cpu_like(n))
            controller.cost.drafter, controller.cost.outside = draft_cost, 0.002
            controller.acceptance.hits[1], controller.acceptance.seen[1] = 100 * acceptance - 1, 98
            assert controller.choose() == best(draft_cost, acceptance)
            chosen.append(controller.choose())
        assert chosen[0] < chosen[1]  # 1 -> 2 drafts at acceptance 0.6, 2 -> 4 at 0.85


@pytest.mark.parametrize("size", [0, 48, -32, 1.5, True])
def test_quantize_rejects_a_bad_group_size_before_touching_the_model(size):
    model = tiny_llama(layers=1)
    with pytest.raises(ValueError, match="group_size must be None or a positive multiple of 32"):
        quantize(model, "int8", group_size=size)
    with pytest.raises(ValueError, match="head_group_size must be None or a positive multiple of 32"):
        quantize(model, "int8", head_group_size=size)
    assert weights_of(model) == "float"


def test_tie_weights_after_quantize_keeps_the_quantized_head():
    """transformers re-ties a tied head in tie_weights() (resize_token_embeddings calls it); after quantize
    the head has its own weights and must stay quantized."""
    from specops.quantization import QuantizedLinear

    model = quantize(tiny_gemma3(layers=1), "int8")
    model.tie_weights()
    assert isinstance(model.lm_head, QuantizedLinear)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))


def test_weights_suffix_is_case_insensitive():
    assert models.split_weights("SmolLM2-135M:INT4") == ("SmolLM2-135M", "int4")
    assert models.split_weights("smollm2-135m:bfloat16") == ("smollm2-135m", "bf16")


def test_a_drafter_with_only_buffers_decodes():
    """A toy drafter whose every weight is in its linear head has buffers and no parameters after
    quantize: the engine finds its device and dtype from them."""
    from specops.decoding.engine import CausalLM

    drafter = _int4_drafter(SD_TARGET_TABLE)
    drafter.log_table = torch.nn.Parameter(drafter.log_table.detach(), requires_grad=False)
    one_hot = drafter.log_table.detach()
    del drafter.log_table
    drafter.register_buffer("log_table", one_hot)  # the frozen parameter becomes a buffer
    assert next(drafter.parameters(), None) is None
    lm = CausalLM(drafter, "drafter")
    assert lm.device.type == "cpu" and lm.dtype == torch.float32


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_prefill_rows_take_blas_on_the_float32_weight(fmt):
    """Beyond 256 rows a CPU layer multiplies a float32 copy of its weight by BLAS: the same products as
    the op's (the float32 de-quantization equals the reference's rounding to a float32 ulp), summed in
    another order."""
    torch.manual_seed(0)
    layer = QuantizedLinear(torch.randn(96, 128) / 11, torch.randn(96), fmt)
    assert (layer.dequantize_float32() - layer.dequantize()).abs().max() <= 1e-6 * layer.dequantize().abs().max()
    x = torch.randn(300, 128)
    with torch.inference_mode():
        got = layer(x)
        want = torch.ops.specops.quantized_linear(x, layer.weight, layer.scales, layer.mins, layer.bias)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
