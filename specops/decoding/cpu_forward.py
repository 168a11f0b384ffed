"""Forwards of CPU float32 models with every linear layer through specops' skinny_linear.

A decoding forward carries 1 token, or a draft chain or tree of a few, and reading the weights is most
of its cost. BLAS GEMMs re-read a weight for few rows (MKL on an Intel Xeon once per three rows, on AMD
EPYC about once per row), so verifying several tokens cost several times one token's forward, which
decides whether speculation can pay on a CPU. `specops.ops.skinny_linear` reads each weight once for
any number of rows up to a few dozen; a prefill's many rows go through a BLAS, or through oneDNN where
the BLAS is MKL on a CPU that is not Intel's (`_product`). The path is taken only where a probe reproduces
the model's logits and, for large models on a CPU without the kernels' x86 SIMD copies, a timing on the
machine itself shows it faster. The model's linear layers are routed
while a call runs, and for its own thread only: another thread using the same model meanwhile runs it as
it is, and the last call to finish puts the layers back.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from functools import partial

import torch

from specops._C import cpu_isa
from specops._blas import onednn_linear, onednn_pays, onednn_works, slow_here
from specops._kept import per_object
from specops.decoding.greedy_head import capped, greedy_logits
from specops.decoding.held import HeldSwitch
from specops.decoding.hf_compat import cache_argument
from specops.quantization import QuantizedLinear

__all__ = ["CpuForward"]


_CPU_FORWARD_OK: weakref.WeakKeyDictionary[object, bool] = per_object(
    "CPU forward probe", "whether the CPU forward through skinny_linear reproduces the model's logits (probed once)")


# Up to how many rows a product goes through skinny_linear rather than torch's BLAS: 32 where the BLAS is fast
# from about that many rows on (Gemma-3-270M's head on a Xeon: MKL 1.15x faster at 24 rows), every row count
# where it is not.
_SKINNY_ROWS = 1 << 30 if slow_here() else 32
_FEW_ROWS = min(64, _SKINNY_ROWS)  # the few-call path's forwards (llama_forward.py): decoding steps, not prefills
# From how many rows a product goes through oneDNN where MKL is slow (specops/_blas.py): a prefill's. On a
# 2-vCPU AMD EPYC (Zen 5; bench/bench_prefill.py, docs/benchmarks.md, 2026-12-07) oneDNN's float32 linear on
# the weight as it is took, against skinny_linear, 0.74-1.27x the time at 48 rows, 0.64-1.09x at 64,
# 0.58-0.89x at 96-128 and 0.52-0.76x at 256-512 (Gemma-3-270M's 2048 x 640, 640 x 2048 and 256 x 640
# weights; 291-320 GFLOP/s at 128 rows against 198-251): skinny_linear's tiles are made for reading a weight
# once for few rows. A prefill of 78-188 tokens took 0.84-0.91x the time (products large enough only:
# _blas.onednn_pays).
_ONEDNN_ROWS = 64
# Heads of at least this many weights decide by timing where the C++ kernels run their portable copy (no
# x86 SIMD: an ARM CPU's BLAS may beat it). Their AVX2 and AVX-512 copies read a weight once where BLAS
# re-reads it per row or few rows, and were faster for 1 and 4 rows on every x86 machine measured (Xeon:
# 1.0-2x; AMD EPYC: 2-4x), so there the path is taken without the timing, which was a second of a first
# call (12 forwards). Smaller models take well under a millisecond either way, and a timing would be noise.
_TIMED_HEAD = 1 << 23


def _onednn() -> bool:
    """Whether a product of _ONEDNN_ROWS rows or more goes through oneDNN: where MKL is slow (every row count
    below is skinny_linear's) and oneDNN runs."""
    return _SKINNY_ROWS > _ONEDNN_ROWS and onednn_works()


def _product(weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """rows [n, d] @ weight[out, d]^T (+ bias): skinny_linear for up to _SKINNY_ROWS rows, F.linear
    beyond (a prefill) and for a weight stored transposed (skinny_linear would copy it on every call); where
    MKL is slow, oneDNN from _ONEDNN_ROWS rows (a prefill) instead of skinny_linear for a product large
    enough to repay oneDNN's making a primitive for its shape (specops/_blas.py, onednn_pays)."""
    if rows.shape[0] > _SKINNY_ROWS or not weight.is_contiguous():
        return torch.nn.functional.linear(rows, weight, bias)
    if rows.shape[0] >= _ONEDNN_ROWS and onednn_pays(rows, weight) and _onednn():
        return onednn_linear(rows, weight, bias)
    return torch.ops.specops.skinny_linear(rows, weight, bias)


class _Product:
    """x [n, d] @ W^T (+ b) for one or several linear layers whose outputs are concatenated: one
    quantized_linear on a weight packed once for layers `specops.quantize` made (same format and groups),
    else each float32 layer through skinny_linear."""

    def __init__(self, modules: list):
        self.modules = modules
        self.fused = None
        quantized = all(isinstance(m, QuantizedLinear) for m in modules)
        if quantized and len({m.format for m in modules}) == 1 and \
                len({None if m.scales is None else m.scales.shape[1] for m in modules}) == 1:
            def cat(name):  # a single layer's own tensors, not a copy
                parts = [getattr(m, name) for m in modules]
                if parts[0] is None or len(parts) == 1:
                    return parts[0]
                return torch.cat(parts).contiguous()

            biases = [m.bias for m in modules]
            bias = biases[0] if len(modules) == 1 else None
            if len(modules) > 1 and any(b is not None for b in biases):
                bias = torch.cat([b if b is not None else torch.zeros(m.out_features, dtype=torch.float32)
                                  for b, m in zip(biases, modules)])
            self.fused = (cat("weight"), cat("scales"), cat("mins"), bias)
        elif not all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 for m in modules):
            raise TypeError("layers neither float32 nn.Linear nor specops.quantize'd alike")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return torch.ops.specops.quantized_linear(x, *self.fused)
        outs = [_product(m.weight, m.bias, x) for m in self.modules]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


# While any thread runs a CpuForward call, the model's float linear layers hold a forward that routes the
# products of the threads inside such a call (_INSIDE) through `_product` and runs every other thread's as
# the layer's own; the last call to leave puts the layer back as it was. (A torch function mode would touch
# no module, but it intercepts every op of a forward: 8-12 % of a Gemma-3-270M step on two CPU cores.)
_INSIDE = threading.local()  # .depth: this thread's CpuForward calls in progress


def _route(module: torch.nn.Linear):
    """Give `module` the routing forward; returns its own instance forward (None: the class's)."""
    own = module.__dict__.get("forward")

    def forward(x: torch.Tensor) -> torch.Tensor:
        if getattr(_INSIDE, "depth", 0):
            out = _product(module.weight, module.bias, x.reshape(-1, x.shape[-1]))
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return own(x) if own is not None else torch.nn.Linear.forward(module, x)

    module.forward = forward
    return own


def _unroute(module: torch.nn.Linear, own) -> None:
    if own is None:
        del module.forward
    else:
        module.forward = own


_ROUTED = HeldSwitch(_route, _unroute)


@contextmanager
def _routed(linears: list[torch.nn.Linear]):
    """This thread's products through `_product` for the duration of the block (the comment above)."""
    with _ROUTED.hold(linears):
        _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
        try:
            yield
        finally:
            _INSIDE.depth -= 1


class CpuForward:
    """Forwards of a CPU float32 model with every float linear layer of its decoder, and its output head,
    through skinny_linear (`_product`); layers `specops.quantize` made low-precision run as they are.
    Plain decoding gets the same forwards as verification. The products are routed in the calling thread
    for the duration of a call only (`_routed`), and the output projection is applied here (then the final
    soft-cap, if the model has one). Used only after a probe shows the result reproduces the model's own logits."""

    def __init__(self, model):
        self.base = model.get_decoder()
        self.cache_argument = cache_argument(self.base)
        self.head = model.get_output_embeddings()
        config = getattr(model.config, "get_text_config", lambda: model.config)()
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.linears = [m for m in self.base.modules()
                        if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32]

    def __call__(self, keep: int, cache=None, argmax_only: bool = False, follow=None,
                 **kwargs) -> torch.Tensor:
        """Logits [B, keep, V] of the last `keep` inputs of base(**kwargs), appending them to `cache` (a
        transformers cache, passed under the name the base model takes it by) if given. argmax_only: only
        each row's argmax is read; follow: which rows a greedy verification can read (greedy_head.py)."""
        if cache is not None:
            kwargs[self.cache_argument] = cache
        with _routed(self.linears):
            hidden = self.base(**kwargs).last_hidden_state[:, -keep:]
        batch, n, dim = hidden.shape
        rows = hidden.reshape(batch * n, dim)
        # A float head through skinny_linear; a quantized one (specops.quantize) computes itself.
        head = self.head
        product = head if isinstance(head, QuantizedLinear) else partial(_product, head.weight, None)
        logits = greedy_logits(head, rows, self.softcap, product, follow) if argmax_only else \
            capped(product(rows), self.softcap)
        return logits.reshape(batch, n, -1).float()

    @staticmethod
    def usable(model) -> bool:
        """Whether `model` is a CPU float32 causal LM whose logits this path reproduces (probed once)."""
        head = model.get_output_embeddings()
        float_head = isinstance(head, torch.nn.Linear) and head.weight.dtype == torch.float32
        if not ((float_head or isinstance(head, QuantizedLinear))
                and head.weight.device.type == "cpu"):  # checked on every call: a model may move
            return False
        known = _CPU_FORWARD_OK.get(model)
        if known is not None:
            return known
        ok = False
        try:
            if head.bias is None and hasattr(model, "get_decoder"):
                ids = torch.arange(3).unsqueeze(0) % head.weight.shape[0]
                with torch.inference_mode():
                    want = model(input_ids=ids, use_cache=False).logits
                    got = CpuForward(model)(3, input_ids=ids, use_cache=False)
                ok = reproduces(want, got)
                if ok and float_head and head.weight.numel() >= _TIMED_HEAD and cpu_isa() == "base":
                    ok = _faster(model)
        except Exception:  # any model that does not fit the pattern keeps its own forward
            ok = False
        return remember(_CPU_FORWARD_OK, model, ok)


def reproduces(want: torch.Tensor, got: torch.Tensor) -> bool:
    """Whether a probe's logits `got` are the model's own `want`: the same shape and within 1e-3 of the
    logit scale (summation order differs by about 1e-5 after 18 layers; a missing scale or soft-cap would
    differ by percents)."""
    return want.shape == got.shape and bool((want - got).abs().max() <= 1e-3 * want.abs().max())


def remember(table: weakref.WeakKeyDictionary, model, value):
    """table[model] = value where the model can be weakly referenced (else nothing is kept); returns value."""
    try:
        table[model] = value
    except TypeError:
        pass
    return value


def _faster(model, rounds: int = 3) -> bool:
    """Whether forwards over 1 and 4 new tokens (plain decoding and a typical verification) take at least
    5% less time in all through CpuForward than through the model's own modules on this machine (the best
    of `rounds` interleaved runs of each)."""
    import time

    routed = CpuForward(model)
    best = {}
    with torch.inference_mode():
        for tokens in (1, 4):
            ids = torch.arange(tokens).unsqueeze(0)
            for _ in range(rounds):
                for name in ("model", "skinny"):
                    start = time.perf_counter()
                    if name == "model":
                        model(input_ids=ids, use_cache=False, logits_to_keep=tokens)
                    else:
                        routed(tokens, input_ids=ids, use_cache=False)
                    best[name, tokens] = min(best.get((name, tokens), float("inf")), time.perf_counter() - start)
    total = {name: best[name, 1] + best[name, 4] for name in ("model", "skinny")}
    return total["skinny"] < 0.95 * total["model"]
