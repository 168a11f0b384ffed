"""Weight-only low-precision linear layers: `specops.quantize(model, weights="int8" | "int4" | "bf16")`.

A decoding forward carries a few tokens, and reading the weights is most of its cost, so storing them
in fewer bytes makes it faster; the activations stay float32, which keeps the model's choices close to
the float model's (quantizing activations too, as fbgemm's dynamic int8 does, changed SmolLM2-135M's
greedy token on 25-57 % of positions). Every linear layer, the output head included, becomes a
`QuantizedLinear` computing through `specops.ops.quantized_linear`. Embeddings stay float: a forward
reads only the rows of its tokens.

For a drafter this changes only speed and acceptance: verification keeps the output exactly the
target's whatever the drafter computes. A quantized target is a different model, and decoding gives
exactly that quantized model's output.
"""

from __future__ import annotations

import torch

from specops._blas import many_rows_linear

__all__ = ["FORMATS", "QuantizedLinear", "quantize", "weights_of"]

# Format -> default group size along K (None: one scale per output channel).
FORMATS = {"bf16": None, "int8": None, "int4": 32}
_ALIASES = {"bfloat16": "bf16", "int4": "int4", "int8": "int8", "bf16": "bf16"}
_STORAGE = {"bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8}
_ATTRIBUTE = "_specops_weights"  # set on a quantized model: its format
# Beyond this many rows (a long prefill chunk) a CPU layer multiplies a float32 copy of its weight by BLAS, or
# by oneDNN where the BLAS is MKL on a CPU that is not Intel's (specops/_blas.py). Below, the op is faster on
# AMD EPYC (2 threads, SmolLM2's layers, 119 rows: 0.5-1.5 ms against 1.3-3.6 for de-quantizing and MKL; at
# 512 rows about even with MKL); on an Intel Xeon with MKL, BLAS won from a few dozen. A batch of 8 prompts
# prefills a thousand rows: on a 2-vCPU Zen 5 EPYC that prefill was 1.4-1.6 s of a 2.4-2.8 s call of 8
# prompts and 48 tokens on Gemma-3-270M int8 with MKL there (2026-12-07).
_OP_ROWS = 256


def _format(weights) -> str:
    name = _ALIASES.get(weights) if isinstance(weights, str) else None
    if name is None:
        raise ValueError(f"quantize: weights must be one of {', '.join(FORMATS)}, got {weights!r}")
    return name


def _groups(weight: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """weight [N, K] as [N, G, K / G] (G = 1 for group_size None)."""
    n, k = weight.shape
    size = k if group_size is None else group_size
    return weight.reshape(n, k // size, size)


def pack(weight: torch.Tensor, weights: str, group_size: int | None = None):
    """(stored weight, scales, mins) of a float weight [N, K] in `weights` format, as
    `specops.ops.quantized_linear` takes them; scales and mins None where the format has none.

    - bf16: the weight rounded to bfloat16 (to nearest, ties to even).
    - int8: symmetric, q = round(w / s) in [-127, 127] with s = max |w| / 127 over each group (default:
      the whole row, one scale per output channel). The largest weight of a group is exact; the others
      are off by at most s / 2.
    - int4: asymmetric over groups of 32 along K (the default), q = round((w - min) / s) in [0, 15] with
      s = (max - min) / 15: GGUF's Q4_1 rule, the block structure of Q4_K too, so the weights of the
      embedded models, which come from those files, map back onto their original grid (to float32
      rounding). The group's minimum and maximum are exact (to rounding); others are off by at most s / 2.
    """
    fmt = _format(weights)
    n, k = weight.shape
    size = group_size if group_size is not None else FORMATS[fmt]
    if fmt == "bf16":
        if group_size is not None:
            raise ValueError("quantize: bf16 weights have no groups (group_size must be None)")
        return weight.to(torch.bfloat16).contiguous(), None, None
    if fmt == "int4" and k % 32:
        raise ValueError(f"quantize: int4 needs K (in_features) a multiple of 32, got K = {k}")
    if size is not None and (size <= 0 or size % 32 or k % size):
        raise ValueError(f"quantize: group_size must be a multiple of 32 dividing K = {k}, got {size}")
    w = _groups(weight.float(), size)
    if fmt == "int8":
        scales = w.abs().amax(-1) / 127
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group: q = 0
        q = torch.round(w / scales[..., None]).clamp_(-127, 127).to(torch.int8)
        return q.reshape(n, k).contiguous(), scales.contiguous(), None
    low, high = w.amin(-1), w.amax(-1)
    scales = (high - low) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: q = 0, w = min
    q = torch.round((w - low[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.uint8)
    blocks = q.reshape(n, k // 32, 32)
    packed = (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(n, k // 2)
    return packed.contiguous(), scales.contiguous(), low.contiguous()


class QuantizedLinear(torch.nn.Module):
    """A linear layer y = x W^T + b whose weight is stored in low precision (bf16, int8 or int4; see
    `pack`) and de-quantized as it is read, by `specops.ops.quantized_linear`; x stays in its float type
    (on the CPU a non-float32 input is computed in float32 and cast back). Forward only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, weights: str,
                 group_size: int | None = None):
        super().__init__()
        self.format = _format(weights)
        self.out_features, self.in_features = weight.shape
        stored, scales, mins = pack(weight.detach(), self.format, group_size)
        self.group_size = None if scales is None or scales.shape[1] == 1 else self.in_features // scales.shape[1]
        self.register_buffer("weight", stored)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 and rows.device.type == "cpu":
            rows = rows.float()
        if self.scales is not None and self.scales.dtype != torch.float32:
            raise TypeError(f"QuantizedLinear: scales became {self.scales.dtype} (a model.to(dtype) after "
                            "quantize?); quantize the model after changing its dtype")
        bias = self.bias if self.bias is not None and self.bias.dtype == rows.dtype else None
        if rows.shape[0] > _OP_ROWS and rows.device.type == "cpu":
            # A long prefill chunk: the products outweigh reading the weight, and BLAS on the float32
            # weight (made for this call only) computes them faster than de-quantizing per 4 rows.
            out = many_rows_linear(rows, self.dequantize_float32(), bias)
        else:
            # The op directly: the wrapper's checks cost more than a small layer's product, and the
            # shapes were checked when the weight was packed.
            out = torch.ops.specops.quantized_linear(rows, self.weight, self.scales, self.mins, bias)
        if bias is None and self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this layer multiplies by (the float64 reference, rounded)."""
        from specops.reference import dequantize

        return dequantize(self.weight, self.scales, self.mins).float()

    def dequantize_float32(self) -> torch.Tensor:
        """The weight [N, K] de-quantized in float32 arithmetic (fast; within a rounding of `dequantize`)."""
        if self.format == "bf16":
            return self.weight.float()
        n, k = self.out_features, self.in_features
        if self.format == "int8":
            q = self.weight.float()
        else:
            blocks = self.weight.view(n, k // 32, 16)
            q = torch.cat([blocks & 15, blocks >> 4], dim=-1).reshape(n, k).float()
        groups = self.scales.shape[1]
        w = q.view(n, groups, k // groups) * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.view(n, k)

    def extra_repr(self) -> str:
        group = "" if self.group_size is None else f", group_size={self.group_size}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, weights={self.format}"
                f"{group}, bias={self.bias is not None}")


def _linear_weight(module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [out, in], bias) of a float linear layer: torch's Linear, or transformers' Conv1D (GPT-2
    style, weight stored [in, out]); None for anything else."""
    if isinstance(module, torch.nn.Linear):
        weight = module.weight
    elif type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        weight = module.weight.t()
    else:
        return None
    if not weight.is_floating_point() or weight.dim() != 2:
        return None
    return weight, module.bias


def quantize(model, weights: str = "int8", *, group_size: int | None = None, head: str | None = None,
             head_group_size: int | None = None):
    """Make `model`'s linear layers (every `torch.nn.Linear` and transformers `Conv1D`, the output head
    included) weight-only low-precision `QuantizedLinear` layers, in place; returns the model.

    weights: "int8" (symmetric, one scale per output channel: 1 byte per weight), "int4" (asymmetric,
    scale and minimum per group of 32 along K, two weights per byte: 0.75 byte per weight with the group
    parameters) or "bf16" (2 bytes). `pack` says how the scales are chosen. group_size: the int8 / int4
    group along K (a multiple of 32; None: the format's default). A layer whose K does not fit the
    format (int4 needs K % 32 == 0; groups must divide K) is stored as int8 per channel instead.

    head, head_group_size: the output head's format and group (`model.get_output_embeddings()`). By
    default the head takes `weights` and group_size (head_group_size defaults to group_size when the
    head has the layers' format), except that int4 models get an int8 head in groups of 32: the head's
    logits pick the token directly, and 4 bits there cost most of the greedy agreement (SmolLM2-135M:
    its float greedy token on 91 % of positions with an int4 head, 100 % with this one, whose forward
    was no slower).

    Embeddings stay float, and a head tied to the input embedding gets its own quantized copy, the
    embedding keeping its float weight. Works on CPU and CUDA models; the model's own forward then runs
    through `specops.ops.quantized_linear`, and so does specops' CPU decoding path. Quantizing a model
    twice raises (quantize the float model); so does a model without any linear layer.
    """
    fmt = _format(weights)
    for name, size in (("group_size", group_size), ("head_group_size", head_group_size)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0 or size % 32):
            raise ValueError(f"quantize: {name} must be None or a positive multiple of 32, got {size!r}")
    if head is None and fmt == "int4":
        head, head_group_size = "int8", head_group_size or 32
    elif head_group_size is None and (head is None or _format(head) == fmt):
        head_group_size = group_size  # the head follows the layers' settings unless given its own
    head_fmt = _format(head) if head is not None else fmt
    if getattr(model, _ATTRIBUTE, None) is not None:
        raise ValueError(f"quantize: the model is already quantized ({getattr(model, _ATTRIBUTE)}); "
                         "quantize the float model")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"quantize: model must be a torch.nn.Module, got {type(model).__name__}")
    targets = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            found = _linear_weight(child)
            if found is not None:
                targets.append((parent, name, found))
    if not targets:
        raise ValueError(f"quantize: {type(model).__name__} has no linear layers to quantize")
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    with torch.no_grad():
        for parent, name, (weight, bias) in targets:
            is_head = output is not None and getattr(parent, name) is output
            layer_fmt, layer_group = (head_fmt, head_group_size) if is_head else (fmt, group_size)
            k = weight.shape[1]
            size = layer_group if layer_group is not None else FORMATS[layer_fmt]
            fits = layer_fmt == "bf16" or ((layer_fmt != "int4" or k % 32 == 0) and (size is None or k % size == 0))
            layer = (QuantizedLinear(weight, bias, layer_fmt, layer_group) if fits
                     else QuantizedLinear(weight, bias, "int8"))
            setattr(parent, name, layer)
    if output is not None and _ties_head(model):
        # The head now has its own weights: a later tie_weights() (transformers calls it from
        # resize_token_embeddings, for one) must not put the float embedding back in its place.
        for config in {id(c): c for c in (model.config, _text_config(model))}.values():
            config.tie_word_embeddings = False
    setattr(model, _ATTRIBUTE, fmt)
    return model


def _text_config(model):
    config = getattr(model, "config", None)
    return getattr(config, "get_text_config", lambda: config)()


def _ties_head(model) -> bool:
    config = getattr(model, "config", None)
    return bool(config is not None and (getattr(config, "tie_word_embeddings", False)
                                        or getattr(_text_config(model), "tie_word_embeddings", False)))


def weights_of(model) -> str:
    """The format `quantize` gave `model`, or "float" for a model it did not quantize."""
    return getattr(model, _ATTRIBUTE, None) or "float"
