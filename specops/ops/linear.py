"""The linear-layer ops of a decoding step: skinny_linear, quantized_linear and llama_layers."""

from __future__ import annotations

import math

import torch

from specops.ops._checks import (_c_dtype, _check_bias, _check_devices, _check_int, _check_linear_input,
                                 _linear_input_dtypes, _require)

__all__ = ["skinny_linear", "quantized_linear", "llama_layers"]


def skinny_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """input @ weight^T + bias for the few rows a decoding forward carries (one token, a draft chain or a
    tree), reading the weight once whatever the number of rows: `torch.nn.functional.linear`'s semantics.

    BLAS GEMMs are tuned for many rows; for a few they re-read the weight (MKL on an Intel Xeon once per
    three rows, on AMD EPYC about once per row), and a forward's cost is mostly reading weights. On the
    CPU each output is a 16-lane dot product summed by one fixed tree, so a row's result has the same
    bits whatever the number of rows is and wherever the row sits (batch invariance). Best for up to a
    few dozen rows; beyond that a BLAS GEMM is as fast. Forward only: with gradients enabled and a
    tensor that requires them it raises (use F.linear to train).

    Shape:
        input: [..., K]; float32 on CPU; float32, bfloat16 or float16 on CUDA.
        weight: [N, K] of input's dtype (a non-contiguous weight is copied first: pass a contiguous one).
        bias: [N] of input's dtype, or None.

    NaN and inf propagate as in F.linear, row by row: a NaN in an input row makes that output row NaN and
    leaves the other rows as they are.

    Returns [..., N] in input's dtype.
    """
    op = "skinny_linear"
    if not isinstance(input, torch.Tensor) or input.dim() < 1:
        raise ValueError(f"{op}: input must be a tensor [..., K]")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != input.shape[-1]:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{op}: weight must be [N, K] with K = {input.shape[-1]} (input's last dim), got {got}")
    device = input.device
    _check_linear_input(op, input)
    tensors = {"weight": weight}
    if bias is not None:
        _check_bias(op, bias, weight.shape[0])
        tensors["bias"] = bias
    for name, t in tensors.items():
        if t.dtype != input.dtype:
            raise TypeError(f"{op}: {name} must have input's dtype {input.dtype}, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but input is on {device}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias)):
        raise RuntimeError(f"{op} has no backward: call it under torch.no_grad() or torch.inference_mode() "
                           "(a decoding forward), or use torch.nn.functional.linear to train")
    rows = input.reshape(math.prod(input.shape[:-1]), input.shape[-1])
    out = torch.ops.specops.skinny_linear(rows, weight, bias)
    return out.reshape(*input.shape[:-1], weight.shape[0])


def _input_rule(input: torch.Tensor) -> tuple[tuple, str]:
    """The input dtypes the kernel on input's device takes (`_linear_input_dtypes`), and their names as the C++
    kernel's messages give them."""
    allowed = _linear_input_dtypes(input.device)
    return allowed, ", ".join(_dtype_name(d) for d in allowed[:-1]) + (" or " if len(allowed) > 1 else "") + \
        _dtype_name(allowed[-1])


def check_skinny_linear(input, weight, bias) -> None:
    """skinny_linear's contract where its kernel cannot check: the C++ kernel's checks and messages, with the
    dtypes of the device's kernel (`specops.ops.sampling.check_chain_verify` says more)."""
    op = "skinny_linear"
    _require(input.dim() == 2 and weight.dim() == 2, op, "input must be [M, K] and weight [N, K]")
    allowed, names = _input_rule(input)
    rule = ("the CPU kernel takes float32 input and weight" if input.device.type == "cpu"
            else f"input and weight must be {names}, of one dtype")
    _require(input.dtype in allowed and weight.dtype == input.dtype, op, rule, TypeError)
    k, n = input.shape[1], weight.shape[0]
    _require(weight.shape[1] == k, op, f"weight must be [N, K] with K = {k}, got [{n}, {weight.shape[1]}]")
    _require(bias is None or (bias.dim() == 1 and bias.shape[0] == n and bias.dtype == input.dtype), op,
             f"bias must be {_dtype_name(input.dtype)} [N] with N = {n}")
    _check_devices(op, "input", input.device, {"weight": weight, "bias": bias})


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@torch.library.register_fake("specops::skinny_linear")
def _skinny_linear_fake(input, weight, bias):
    return input.new_empty((input.shape[0], weight.shape[0]))


_QUANTIZED_FORMATS = {torch.bfloat16: "bfloat16", torch.int8: "int8", torch.uint8: "int4"}


def _check_quantized_weight(op: str, label: str, weight, scales, mins, k: int, k_rule: str) -> dict:
    """A quantized_linear weight (the format its dtype names) with its scales and mins, for inputs of
    width k (`k_rule` says where k comes from); messages start with `label`. Returns the tensors by name."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{op}: {label}weight must be a 2-D tensor")
    fmt = _QUANTIZED_FORMATS.get(weight.dtype)
    article = "an" if fmt in ("int8", "int4") else "a"
    if fmt is None:
        raise TypeError(f"{op}: {label}weight must be bfloat16, int8 or uint8 (packed int4), got "
                        f"{weight.dtype}")
    n = weight.shape[0]
    width = k // 2 if fmt == "int4" else k
    if weight.shape[1] != width or (fmt == "int4" and k % 32):
        rule = "[N, K / 2] with K a multiple of 32" if fmt == "int4" else "[N, K]"
        raise ValueError(f"{op}: {label}{article} {fmt} weight must be {rule}, K = {k} ({k_rule}); got "
                         f"{tuple(weight.shape)}")
    tensors = {"weight": weight}
    needs = {"bfloat16": (), "int8": ("scales",), "int4": ("scales", "mins")}[fmt]
    for name, value in (("scales", scales), ("mins", mins)):
        if name not in needs:
            if value is not None:
                raise ValueError(f"{op}: {label}{article} {fmt} weight takes no {name}")
            continue
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[0] != n:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{op}: {label}{name} must be [N, G] = [{n}, G] for {article} {fmt} weight, got "
                             f"{got}")
        if value.dtype != torch.float32:
            raise TypeError(f"{op}: {label}{name} must be float32, got {value.dtype}")
        tensors[name] = value
    if "scales" in needs:
        groups = scales.shape[1]
        if groups < 1 or k % groups or (groups > 1 and (k // groups) % 32):
            raise ValueError(f"{op}: {label}scales [N, G] must split K = {k} into G groups of a multiple of "
                             f"32 weights (or G = 1), got G = {groups}")
        if mins is not None and mins.shape != scales.shape:
            raise ValueError(f"{op}: {label}mins must have the shape of scales {tuple(scales.shape)}, got "
                             f"{tuple(mins.shape)}")
    return tensors


def quantized_linear(input: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None,
                     mins: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """input @ W^T + bias with W stored in low precision and de-quantized as it is read (weight-only
    quantization: the input stays in its float type), for the few rows of a decoding forward: a
    skinny_linear that reads 2, 1 or 0.5 bytes per weight instead of 4. `specops.quantize` builds these
    weights from a model's linear layers. The weight's dtype names the format (exact definition:
    `specops.reference.dequantize`):

    - bfloat16 [N, K]: W = weight; no scales or mins.
    - int8 [N, K] with float32 scales [N, G]: W[n, k] = weight[n, k] * scales[n, k // (K / G)].
    - uint8 [N, K / 2] (int4, two per byte) with float32 scales and mins [N, G]:
      W[n, k] = q[n, k] * scales[n, g] + mins[n, g], q in 0..15; in each block of 32 weights along K,
      byte j holds weight j in its low nibble and weight j + 16 in its high nibble (K % 32 == 0).

    G = 1 is one scale per output channel; with G > 1 a group spans K / G weights, a multiple of 32. On
    the CPU each output is float32 de-quantized weights times inputs in 16 lanes summed by a fixed tree,
    so a row's result has the same bits whatever the number of rows (as skinny_linear). Forward only.

    Shape:
        input: [..., K]; float32 on CPU; float32, bfloat16 or float16 on CUDA.
        weight, scales, mins: as above, on input's device. bias: [N] of input's dtype, or None.

    NaN and inf propagate as in F.linear, row by row (as skinny_linear).

    Returns [..., N] in input's dtype.
    """
    op = "quantized_linear"
    if not isinstance(input, torch.Tensor) or input.dim() < 1:
        raise ValueError(f"{op}: input must be a tensor [..., K]")
    device = input.device
    _check_linear_input(op, input)
    k = input.shape[-1]
    tensors = _check_quantized_weight(op, "", weight, scales, mins, k, "input's last dim")
    n = weight.shape[0]
    if bias is not None:
        _check_bias(op, bias, n)
        if bias.dtype != input.dtype:
            raise TypeError(f"{op}: bias must have input's dtype {input.dtype}, got {bias.dtype}")
        tensors["bias"] = bias
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but input is on {device}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, scales, mins, bias)):
        raise RuntimeError(f"{op} has no backward: call it under torch.no_grad() or torch.inference_mode()")
    rows = input.reshape(math.prod(input.shape[:-1]), k)
    out = torch.ops.specops.quantized_linear(rows, weight, scales, mins, bias)
    return out.reshape(*input.shape[:-1], n)


def check_quantized_linear(input, weight, scales, mins, bias) -> None:
    """quantized_linear's contract where its kernel cannot check: the C++ kernel's checks and messages, with the
    input dtypes of the device's kernel."""
    op = "quantized_linear"
    allowed, names = _input_rule(input)
    _require(input.dim() == 2 and input.dtype in allowed, op, f"input must be {names} [M, K]")
    _require(weight.dim() == 2, op, "weight must be 2-D")
    k, n = input.shape[1], weight.shape[0]

    def params(t, name):
        _require(t is not None, op, f"this weight format needs {name}")
        _require(t.dim() == 2 and t.shape[0] == n and t.shape[1] >= 1 and t.dtype == torch.float32, op,
                 f"{name} must be float32 [N, G] with N = {n}")
    if weight.dtype == torch.bfloat16:
        _require(weight.shape[1] == k, op, f"a bfloat16 weight must be [N, K] with K = {k}")
        _require(scales is None and mins is None, op, "a bfloat16 weight takes no scales or mins")
    elif weight.dtype in (torch.int8, torch.uint8):
        int4 = weight.dtype == torch.uint8
        _require(weight.shape[1] * (2 if int4 else 1) == k, op, f"an {'int4 (uint8)' if int4 else 'int8'} weight "
                 f"must be [N, {'K / 2' if int4 else 'K'}] with K = {k}")
        params(scales, "scales")
        groups = scales.shape[1]
        _require(k % groups == 0 and (groups == 1 or (k // groups) % 32 == 0), op,
                 f"scales [N, G] must split K = {k} into G groups of a multiple of 32 (or G = 1)")
        _require(not int4 or k % 32 == 0, op, f"int4 weights need K a multiple of 32, got {k}")
        if int4:
            params(mins, "mins")
            _require(mins.shape[1] == groups, op, "mins must have the shape of scales")
        else:
            _require(mins is None, op, "int8 weights are symmetric: no mins")
    else:
        _require(False, op, f"weight must be bfloat16, int8 or uint8 (packed int4), got {_c_dtype(weight.dtype)}",
                 TypeError)
    _require(bias is None or (bias.dim() == 1 and bias.shape[0] == n and bias.dtype == input.dtype), op,
             f"bias must be {_dtype_name(input.dtype)} [N] with N = {n}")
    _check_devices(op, "input", input.device, {"weight": weight, "scales": scales, "mins": mins, "bias": bias})


@torch.library.register_fake("specops::quantized_linear")
def _quantized_linear_fake(input, weight, scales, mins, bias):
    return input.new_empty((input.shape[0], weight.shape[0]))


_LLAMA_SLOTS = ("q", "k", "v", "o", "gate", "up", "down")


# The products of a layer: slots multiplied by one input, whose outputs are concatenated (a slot without
# a weight is fused into the slot before it in its product).
_LLAMA_PRODUCTS = ((0, 1, 2), (3,), (4, 5), (6,))


def _check_llama_layer(op: str, linears: list, layer: int, d: int, heads: int, kv_heads: int,
                       dim: int) -> None:
    """Each present weight of one llama_layers layer must have the shape its slot (and the absent slots
    fused into it) needs: q [heads * D, d], k and v [kv_heads * D, d], o [d, heads * D], gate and up
    [inter, d] alike (gate|up fused: [2 inter, d]), down [d, inter]; its scales, mins and bias to match.
    Only totals would reach the kernel, which would split a wrong-width q|k or gate|up elsewhere."""
    base = 28 * layer
    gate = linears[base + 16]
    if not isinstance(gate, torch.Tensor) or gate.dim() != 2:
        raise ValueError(f"{op}: linears[{base + 16}] (layer {layer}'s gate weight) must be a 2-D tensor")
    fused_up = linears[base + 20] is None
    if fused_up and gate.shape[0] % 2:
        raise ValueError(f"{op}: linears[{base + 16}] (layer {layer}'s gate|up weight) must be [2 inter, d] "
                         f"with an even 2 inter, got {tuple(gate.shape)}")
    inter = gate.shape[0] // 2 if fused_up else gate.shape[0]
    rows = {"q": (heads * dim, "heads * D"), "k": (kv_heads * dim, "kv_heads * D"),
            "v": (kv_heads * dim, "kv_heads * D"), "o": (d, "d"), "gate": (inter, "inter"),
            "up": (inter, "inter (the gate weight's)"), "down": (d, "d")}
    inputs = {"q": (d, "d"), "k": (d, "d"), "v": (d, "d"), "o": (heads * dim, "heads * D"), "gate": (d, "d"),
              "up": (d, "d"), "down": (inter, "inter")}
    for product in _LLAMA_PRODUCTS:
        covered: list[list[int]] = []
        for slot in product:
            if linears[base + 4 * slot] is not None or not covered:
                covered.append([slot])
            else:
                covered[-1].append(slot)
        for slots in covered:
            names = [_LLAMA_SLOTS[s] for s in slots]
            _check_llama_weight(op, linears, base + 4 * slots[0], layer, names, rows, inputs)


def _check_llama_weight(op: str, linears: list, index: int, layer: int, names: list[str], rows: dict,
                        inputs: dict) -> None:
    """linears[index .. index + 3], the weight, scales, mins and bias giving the outputs of slots `names`
    (concatenated), of input width inputs[names[0]]; the entries of the fused slots after it must be None."""
    weight, scales, mins, bias = linears[index:index + 4]
    label = f"linears[{index}] (layer {layer}'s {'|'.join(names)} weight)"
    n = sum(rows[name][0] for name in names)
    n_rule = " + ".join(rows[name][1] for name in names)
    k, k_rule = inputs[names[0]]
    for extra in range(index + 4, index + 4 * len(names)):
        if linears[extra] is not None:
            raise ValueError(f"{op}: linears[{extra}] must be None: its slot has no weight (fused into "
                             f"{label})")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{op}: {label} must be a 2-D tensor")
    if weight.device.type != "cpu":
        raise ValueError(f"{op} runs on the CPU; {label} is on {weight.device}")
    packed = weight.dtype == torch.uint8  # int4, two weights a byte
    want = (n, k // 2 if packed else k)
    if weight.shape != want:
        rule = f"[{n_rule}, {k_rule}{' / 2' if packed else ''}]"
        raise ValueError(f"{op}: {label} must be {rule} = {list(want)}, got {tuple(weight.shape)}")
    if weight.dtype == torch.float32:
        if scales is not None or mins is not None:
            raise ValueError(f"{op}: {label} is float32 and takes no scales or mins")
    else:
        parts = _check_quantized_weight(op, f"{label}: ", weight, scales, mins, k, k_rule)
        for name, t in parts.items():
            if t.device.type != "cpu":
                raise ValueError(f"{op} runs on the CPU; {label}'s {name} is on {t.device}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (n,) or
                             bias.dtype != torch.float32 or bias.device.type != "cpu"):
        got = (tuple(bias.shape), bias.dtype, bias.device.type) if isinstance(bias, torch.Tensor) else \
            type(bias).__name__
        raise ValueError(f"{op}: the bias of {label} must be float32 [{n_rule}] = [{n}] on the CPU, "
                         f"got {got}")


def llama_layers(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None,
                 norms: list[torch.Tensor], linears: list[torch.Tensor | None], keys: list[torch.Tensor],
                 values: list[torch.Tensor], heads: int, kv_heads: int, eps: float, scale: float,
                 qk_norms: list[torch.Tensor] | None = None, norm_offset: float = 0.0, activation: str = "silu",
                 local_layers: list[int] = (), local_cos: torch.Tensor | None = None,
                 local_sin: torch.Tensor | None = None, local_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder layers of a Llama-family model (RMSNorm pre-norm, rotary attention over a KV cache,
    SiLU-gated MLP), or of Gemma-3 and Qwen3 (the options below), over the few new rows of a CPU decoding
    forward, in one call: what a Python loop over
    the layers spends in framework calls (about a third of SmolLM2-135M's int8 forward) becomes plain
    loops. Semantics and argument layout: `specops.reference.llama_layers`. Products go through
    skinny_linear (float32 weights) or quantized_linear (its formats); attention is a loop over the
    cache. The CPU only: on accelerators, a model's own forward under CUDA graphs has no such overhead.
    Forward only.

    The caches are written in place: each layer's keys and values hold the cache followed by room for
    the n new rows, which the op fills with their keys (after rotary embedding) and values. A caller
    keeps a cache in a buffer with spare slots and passes views of it, so nothing is copied per forward.

    Shape:
        hidden: [B * n, d] float32. cos, sin: [B, n, D] float32 (the model's rotary embedding).
        attn_mask: [B, 1, n, past + n] bool (True: seen) or None (every slot seen). A row that sees no
            slot attends to nothing (zeros). A slot a row does not see never enters it, whatever it holds
            (an unwritten cache slot is ordinary input); a NaN in what it sees makes it NaN, as in
            `tree_attention`.
        norms: 2 L weights [d] (each layer's input and post-attention norm), or 4 L (Gemma-3's input,
            post-attention, pre-MLP and post-MLP norms: the attention's and the MLP's outputs are normed
            before they are added).
        linears: 28 L entries, per layer (weight, scales, mins, bias) for q, k, v, o, gate, up, down:
            a float32 weight (no scales or mins) or a `quantized_linear` one, each [N, K] (int4: [N, K / 2])
            with q [heads * D, d], k and v [kv_heads * D, d], o [d, heads * D], gate and up [inter, d],
            down [d, inter]. A slot whose entries are all None is fused into the slot before: that weight
            gives both outputs (q|k|v [(heads + 2 kv_heads) * D, d], gate|up [2 inter, d]). Each shape is
            checked (ValueError naming the entry and the shape it needs).
        heads, kv_heads: ints >= 1, heads a multiple of kv_heads. eps, scale: finite numbers.
        keys, values: L float32 tensors [B, kv_heads, past + n, D], contiguous along D (other strides
            free: views of a larger buffer): slots past .. past + n - 1 are written.

        qk_norms: None, or 2 L weights [D]: each layer's q and k norm, over each head before the rotary
            embedding (Gemma-3, Qwen3).
        norm_offset: a finite number added to every norm weight (Gemma's norms scale by 1 + w: 1).
        activation: "silu" or "gelu_tanh" (GELU with the tanh approximation, Gemma's).
        local_layers: indices of the layers (Gemma-3's sliding-window ones) that read local_cos, local_sin
            ([B, n, D] float32, required then) and local_mask (like attn_mask) in place of cos, sin and
            attn_mask.

    Returns hidden [B * n, d].
    """
    _check_llama_layers(hidden, cos, sin, attn_mask, norms, linears, keys, values, heads, kv_heads, eps, scale,
                        qk_norms, norm_offset, activation, local_layers, local_cos, local_sin, local_mask)
    return torch.ops.specops.llama_layers(hidden, cos, sin, attn_mask, list(norms), list(linears), list(keys),
                                          list(values), heads, kv_heads, float(eps), float(scale),
                                          None if qk_norms is None else list(qk_norms), float(norm_offset),
                                          activation, list(local_layers), local_cos, local_sin, local_mask)


def _check_llama_layers(hidden, cos, sin, attn_mask, norms, linears, keys, values, heads, kv_heads, eps, scale,
                        qk_norms, norm_offset, activation, local_layers, local_cos, local_sin, local_mask) -> None:
    """llama_layers' arguments, checked before the C++ op reads them (its docstring says what each must be):
    ValueError naming the argument and the shape or value it needs, TypeError for a dtype."""
    op = "llama_layers"
    if not isinstance(cos, torch.Tensor) or cos.dim() != 3 or not isinstance(sin, torch.Tensor) or \
            sin.shape != cos.shape:
        raise ValueError(f"{op}: cos and sin must be tensors [B, n, D] of one shape")
    batch, n, dim = cos.shape
    if dim % 2:
        raise ValueError(f"{op}: the head dim D must be even, got {dim}")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[0] != batch * n:
        raise ValueError(f"{op}: hidden must be [B * n, d] = [{batch * n}, d]")
    for name, value in (("heads", heads), ("kv_heads", kv_heads)):
        _check_int(op, name, value, 1, 2**31 - 1, "an int >= 1 and < 2**31")
    if heads % kv_heads:
        raise ValueError(f"{op}: heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
    layers = len(keys)
    if layers < 1 or len(values) != layers or len(norms) not in (2 * layers, 4 * layers) or \
            len(linears) != 28 * layers:
        raise ValueError(f"{op}: for L >= 1 layers give L keys, L values, 2 L or 4 L norms and 28 L linears; got "
                         f"{layers}, {len(values)}, {len(norms)} and {len(linears)}")
    tensors = [("hidden", hidden), ("cos", cos), ("sin", sin)] + [("a norm", w) for w in norms]
    slots = keys[0].shape[2] if isinstance(keys[0], torch.Tensor) and keys[0].dim() == 4 else -1
    if slots < n:
        raise ValueError(f"{op}: keys[0] must be [B, kv_heads, past + n, D] with room for the n = {n} new rows")
    for layer, (k, v) in enumerate(zip(keys, values)):
        for name, t in ((f"keys[{layer}]", k), (f"values[{layer}]", v)):
            if not isinstance(t, torch.Tensor) or t.shape != (batch, kv_heads, slots, dim):
                raise ValueError(f"{op}: {name} must be [B, kv_heads, past + n, D] = [{batch}, {kv_heads}, "
                                 f"{slots}, {dim}] like keys[0], got {tuple(getattr(t, 'shape', ()))}")
            if t.stride(-1) != 1:
                raise ValueError(f"{op}: {name} must be contiguous along D")
            tensors.append((name, t))
    for name, t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"{op} runs on the CPU; {name} is on {t.device}")
        if t.dtype != torch.float32:
            raise TypeError(f"{op}: {name} must be float32, got {t.dtype}")
    if any(w.shape != (hidden.shape[1],) for w in norms):
        raise ValueError(f"{op}: norm weights must be [d] = [{hidden.shape[1]}]")
    for name, mask in (("attn_mask", attn_mask), ("local_mask", local_mask)):
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or
                                 mask.shape != (batch, 1, n, slots)):
            raise ValueError(f"{op}: {name} must be bool [B, 1, n, past + n] = [{batch}, 1, {n}, {slots}] or None")
    _check_gemma_options(op, layers, dim, qk_norms, activation, local_layers, local_cos, local_sin, cos)
    for name, number in (("eps", eps), ("scale", scale), ("norm_offset", norm_offset)):
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            raise ValueError(f"{op}: {name} must be a finite number, got {number!r}")
    for layer in range(layers):
        if linears[28 * layer] is None or linears[28 * layer + 12] is None or linears[28 * layer + 16] is None or \
                linears[28 * layer + 24] is None:
            raise ValueError(f"{op}: layer {layer} needs q, o, gate and down weights")
        _check_llama_layer(op, linears, layer, hidden.shape[1], heads, kv_heads, dim)


def _check_gemma_options(op: str, layers: int, dim: int, qk_norms, activation, local_layers, local_cos, local_sin,
                         cos: torch.Tensor) -> None:
    """The Gemma-3 / Qwen3 options of llama_layers: qk_norms None or 2 L float32 [D] CPU weights; activation
    one of the two; local_layers layer indices, with local_cos and local_sin shaped like cos."""
    if qk_norms is not None:
        if len(qk_norms) != 2 * layers:
            raise ValueError(f"{op}: qk_norms must be None or 2 L = {2 * layers} weights [D], got {len(qk_norms)}")
        for w in qk_norms:
            if not isinstance(w, torch.Tensor) or w.shape != (dim,) or w.dtype != torch.float32 or \
                    w.device.type != "cpu":
                raise ValueError(f"{op}: q and k norm weights must be float32 [D] = [{dim}] on the CPU")
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"{op}: activation must be 'silu' or 'gelu_tanh', got {activation!r}")
    for index in local_layers:
        _check_int(op, "a local_layers entry", index, 0, layers - 1, f"a layer index in [0, {layers})")
    if len(local_layers):
        for name, t in (("local_cos", local_cos), ("local_sin", local_sin)):
            if not isinstance(t, torch.Tensor) or t.shape != cos.shape or t.dtype != torch.float32 or \
                    t.device.type != "cpu":
                raise ValueError(f"{op}: local_layers needs {name} float32 [B, n, D] = {list(cos.shape)} on the CPU")


@torch.library.register_fake("specops::llama_layers")
def _llama_layers_fake(hidden, cos, sin, attn_mask, norms, linears, keys, values, heads, kv_heads, eps, scale,
                       qk_norms=None, norm_offset=0.0, activation="silu", local_layers=(), local_cos=None,
                       local_sin=None, local_mask=None):
    return hidden.new_empty(hidden.shape)
