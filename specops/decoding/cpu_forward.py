"""Forwards of CPU float32 models with every linear layer weight-stationary.

MKL on AMD EPYC reads a weight about once per row for few-row GEMMs (F.linear's layout) and runs GEMV
at a third of the bandwidth; decoding feeds 1 to a few tokens per forward, exactly where that is slowest,
and verification feeds several, so on such a CPU this decides whether speculation can pay (DEVELOPERS.md,
"Model forwards on CPU"). On others (an Intel Xeon with MKL) F.linear is the faster one, so the path is
taken only where a timing on the machine itself shows it faster. The model's own modules are routed for
the duration of a call only.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["CpuForward"]


_CPU_FORWARD_OK: weakref.WeakKeyDictionary[object, bool] = weakref.WeakKeyDictionary()
_STATIONARY_ROWS = 8  # beyond this many rows F.linear's GEMM is as fast
# Heads of at least this many weights decide by timing: which product is faster depends on the CPU and
# its BLAS (on an Intel Xeon with MKL, F.linear's few-row GEMM is the faster one, 2.3x on Gemma-3-270M).
# Smaller models take well under a millisecond either way, and a timing would be noise.
_TIMED_HEAD = 1 << 23


def _stationary(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """rows [n, d] @ weight[out, d]^T computed as weight @ rows^T, which streams the weight once.

    For a few rows, the BLAS path F.linear takes reads the weight about once per row on our CPUs (MKL on
    AMD EPYC: Gemma-3-270M's 262,144 x 640 output head takes 57 ms for 1 row, 126 ms for 2, 105 ms for
    4), while weight @ rows^T streams it once (23 ms for 2 rows, 26 ms for 4). One row is padded to two
    so that it does not fall to GEMV, which is as slow. Rows must be row-major: with a transposed layout
    (attention outputs of several tokens come that way) the same product is about 6x slower."""
    n = rows.shape[0]
    rows = torch.cat([rows, rows]) if n == 1 else rows.contiguous()
    return (weight @ rows.T).T[:n]


def _linear_forward(module: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > _STATIONARY_ROWS:
            return torch.nn.functional.linear(x, module.weight, module.bias)
        out = _stationary(module.weight, rows)
        if module.bias is not None:
            out = out + module.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


class CpuForward:
    """Forwards of a CPU float32 model with every linear layer weight-stationary (`_stationary`).

    Decoding feeds 1 to a few tokens per forward, exactly where F.linear is slowest on our CPUs, and
    verification feeds several: this decides whether speculation can pay on a CPU, and plain decoding
    gets the same forwards. The model's own modules are routed for the duration of a call only, and the
    output projection is applied here (then the final soft-cap, if the model has one). Used only after a
    probe shows the result reproduces the model's own logits."""

    def __init__(self, model):
        self.base = model.get_decoder()
        self.weight = model.get_output_embeddings().weight
        config = getattr(model.config, "get_text_config", lambda: model.config)()
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.linears = [m for m in self.base.modules() if type(m) is torch.nn.Linear]

    def __call__(self, keep: int, **kwargs) -> torch.Tensor:
        """Logits [B, keep, V] of the last `keep` inputs of base(**kwargs)."""
        saved = [module.__dict__.get("forward") for module in self.linears]
        for module in self.linears:
            module.forward = _linear_forward(module)
        try:
            hidden = self.base(**kwargs).last_hidden_state[:, -keep:]
        finally:
            for module, forward in zip(self.linears, saved):
                if forward is None:
                    del module.forward
                else:
                    module.forward = forward
        batch, n, dim = hidden.shape
        logits = _stationary(self.weight, hidden.reshape(batch * n, dim)).reshape(batch, n, -1)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    @staticmethod
    def usable(model) -> bool:
        """Whether `model` is a CPU float32 causal LM whose logits this path reproduces (probed once)."""
        head = model.get_output_embeddings()
        if not (isinstance(head, torch.nn.Linear) and head.weight.device.type == "cpu"
                and head.weight.dtype == torch.float32):  # checked on every call: a model may move
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
                # Summation order differs (about 1e-5 of the logit scale after 18 layers); a missing
                # scale or soft-cap would differ by percents.
                ok = want.shape == got.shape and bool((want - got).abs().max() <= 1e-3 * want.abs().max())
                if ok and head.weight.numel() >= _TIMED_HEAD:
                    ok = _faster(model)
        except Exception:  # any model that does not fit the pattern keeps its own forward
            ok = False
        try:
            _CPU_FORWARD_OK[model] = ok
        except TypeError:
            pass
        return ok


def _faster(model, tokens: int = 2, rounds: int = 3) -> bool:
    """Whether a forward over `tokens` new tokens is at least 5% faster through CpuForward than through
    the model's own modules on this machine (the best of `rounds` interleaved runs of each)."""
    import time

    ids = torch.arange(tokens).unsqueeze(0)
    routed = CpuForward(model)
    best = {"model": float("inf"), "stationary": float("inf")}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, run in (("model", lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1)),
                              ("stationary", lambda: routed(1, input_ids=ids, use_cache=False))):
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
    return best["stationary"] < 0.95 * best["model"]
