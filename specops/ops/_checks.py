"""Argument checks the op wrappers share: shapes, dtypes and devices without touching values, and the
one-sync value checks for devices whose kernels cannot raise."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from specops._rows import per_row
from specops._seeds import draw_seed, row_seeds


_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# How far from 1 a used draft_probs row may sum with validate=True (reasons: chain_verify's docstring;
# csrc/cpu/sampling.h holds the same kProbSumTolerance).
_PROBS_SUM_TOLERANCE = 1e-3


def _check_logits(op: str, name: str, value, dims: int, shape: str) -> None:
    """`value` must be a `dims`-dimensional logits tensor (`shape` describes it) of a _LOGIT_DTYPES type."""
    if not isinstance(value, torch.Tensor) or value.dim() != dims:
        raise ValueError(f"{op}: {name} must be {shape} tensor")
    if value.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16, got {value.dtype}")


def _check_tensor(op: str, name: str, value, shape: tuple[int, ...], shape_rule: str, dtype: torch.dtype) -> None:
    """`value` must be a tensor of `shape` (the message says `shape_rule`) and `dtype`."""
    if not isinstance(value, torch.Tensor) or value.shape != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{op}: {name} must be {shape_rule}, got {got}")
    if value.dtype != dtype:
        raise TypeError(f"{op}: {name} must be {str(dtype).removeprefix('torch.')}, got {value.dtype}")


def _count_arg(op: str, name: str, value, rows: int, full: int, device: torch.device, tensors: dict) -> torch.Tensor:
    """A per-request count argument (chain_verify's num_draft, tree_verify's num_nodes): a [rows] int64
    tensor (recorded in `tensors` for the device check), or None for `full` in every row."""
    if value is None:
        return torch.full((rows,), full, dtype=torch.int64, device=device)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a [B] int64 tensor or None")
    if value.dtype != torch.int64 or value.shape != (rows,):
        raise ValueError(f"{op}: {name} must be a [{rows}] int64 tensor, got {tuple(value.shape)} {value.dtype}")
    tensors[name] = value
    return value


def _check_int(op: str, name: str, value, low: int, high: int, rule: str) -> None:
    """`value` must be an int (not a bool) in [low, high], which `rule` states: a ValueError naming it
    otherwise. Checked here because the dispatcher rejects an int outside int64 as if it were no int
    ("Expected a value of type 'int' ... found type 'int'")."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{op}: {name} must be {rule}, got {value!r}")


_INT64_MAX = 2**63 - 1


def _sampling_args(op: str, anchor: str, device: torch.device, rows: int, tensors: dict, temperature, top_k,
                   top_p, seed, offset) -> tuple[torch.Tensor, ...]:
    """The sampling arguments every stochastic op takes, checked (devices of all tensor arguments,
    `tensors` included, and the offset) and normalized to per-row tensors on `device`."""
    tensors = dict(tensors)
    for value, name in ((temperature, "temperature"), (top_k, "top_k"), (top_p, "top_p"), (seed, "seed")):
        if isinstance(value, torch.Tensor):
            tensors[name] = value
    _check_devices(op, anchor, device, tensors)
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"{op}: offset must be an int, got {type(offset).__name__}")
    if not 0 <= offset < 2**63:
        raise ValueError(f"{op}: offset must be in [0, 2**63), got {offset}")
    return (per_row("temperature", temperature, rows, torch.float32, device),
            per_row("top_k", top_k, rows, torch.int64, device),
            per_row("top_p", top_p, rows, torch.float32, device),
            row_seeds(draw_seed() if seed is None else seed, rows, device))


def _c_number(value) -> str:
    """`value` as the C++ kernels print it in their messages (an ostream's defaults: %g, 6 digits), so
    that a check made here says exactly what the CPU kernel says."""
    value = value.item() if isinstance(value, torch.Tensor) else value
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "-nan" if math.copysign(1.0, value) < 0 else "nan"
    return "%g" % value


_C_DTYPE_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
                  torch.int8: "Char", torch.uint8: "Byte", torch.int16: "Short", torch.int32: "Int",
                  torch.int64: "Long", torch.bool: "Bool"}


def _c_dtype(dtype: torch.dtype) -> str:
    """A dtype as the C++ kernels print it (c10's ScalarType names)."""
    return _C_DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _c_sizes(t: torch.Tensor) -> str:
    """A shape as the C++ kernels print it: [2, 3]."""
    return "[" + ", ".join(map(str, t.shape)) + "]"


def _first(mask: torch.Tensor) -> list[int]:
    """The index of the first set element of `mask`, in row-major order (the order the C++ kernels scan)."""
    return mask.nonzero()[0].tolist()


def _require(ok: bool, op: str, message: str, error: type[Exception] = ValueError) -> None:
    if not ok:
        raise error(f"{op}: {message}")


def _check_per_row(op: str, tensors: tuple, rows: int, dtype: torch.dtype, rule: str) -> None:
    """Per-row tensors, each [rows] of `dtype` (the C++ kernels' check_per_row, with its message)."""
    for t in tensors:
        _require(isinstance(t, torch.Tensor) and t.dim() == 1 and t.shape[0] == rows and t.dtype == dtype, op, rule)


def _check_logit_dtype(op: str, name: str, t: torch.Tensor) -> None:
    _require(t.dtype in _LOGIT_DTYPES, op, f"{name} must be float32, bfloat16 or float16", TypeError)


def _check_devices(op: str, anchor: str, device: torch.device, tensors: dict) -> None:
    """Every tensor of `tensors` (name -> tensor or None) on `device`, where argument `anchor` is. The C++
    kernels need no such check: the dispatcher sends a call with a CUDA tensor among its arguments to CUDA."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but {anchor} is on {device}")


def _raise_first(op: str, checks: list[tuple[torch.Tensor, str | Callable[[], str]]]) -> None:
    """Value checks for devices whose kernels cannot raise: the flags of all (flag, message) checks in
    one host sync, then ValueError with the message of the first flag that is set (a callable message,
    one that names where the problem is, is called only then)."""
    if not checks:
        return
    flags = torch.stack([flag for flag, _ in checks]).tolist()
    for flag, (_, message) in zip(flags, checks):
        if flag:
            raise ValueError(f"{op}: {message() if callable(message) else message}")


def _where(mask: torch.Tensor, message: Callable[[list[int]], str]) -> tuple[torch.Tensor, Callable[[], str]]:
    """A `_raise_first` check: set where any element of `mask` is; its message names the first one."""
    return mask.any(), lambda: message(_first(mask))


def _sampling_checks(temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> list:
    """The value checks of the per-row sampling arguments, for `_raise_first` (the C++ SamplingRows::check)."""
    return [_where((temperature < 0) | ~torch.isfinite(temperature),
                   lambda at: f"temperature[{at[0]}] = {_c_number(temperature[at[0]])} must be finite and >= 0"),
            _where(top_k < 0, lambda at: f"top_k[{at[0]}] = {_c_number(top_k[at[0]])} must be >= 0"),
            _where(~((top_p > 0) & (top_p <= 1)),
                   lambda at: f"top_p[{at[0]}] = {_c_number(top_p[at[0]])} must be in (0, 1]")]


def _logit_row_checks(op: str, name: str, logits: torch.Tensor, rows: torch.Tensor | None = None,
                      no_finite: str | None = "has no finite logit") -> list:
    """NaN / +inf and no finite value in the logit rows [..., V] (those `rows` marks, default all), named
    `name[i, j]` as the C++ kernels' checked_row_max names them. no_finite None: only NaN / +inf (the
    caller checks for finite values its own way)."""
    x = logits.float()
    bad = (torch.isnan(x) | torch.isposinf(x)).any(-1)
    if rows is not None:
        bad = bad & rows

    def index(at: list[int]) -> str:
        return ", ".join(map(str, at))
    checks = [_where(bad, lambda at: f"{name}[{index(at)}] contains NaN or +inf")]
    if no_finite is not None:
        empty = ~(x > float("-inf")).any(-1)
        if rows is not None:
            empty = empty & rows
        checks.append(_where(empty, lambda at: f"{name}[{index(at)}] {no_finite}"))
    return checks


def guarded(check: Callable, launcher: Callable) -> Callable:
    """The kernel to register for a device whose kernels cannot raise: the op's contract `check` (the
    checks its C++ kernel makes, with the same messages), then `launcher`. So the same bad input gets the
    same error whether it reaches the CPU kernel or a Triton one, through the wrapper or torch.ops."""
    def run(*args, **kwargs):
        check(*args, **kwargs)
        return launcher(*args, **kwargs)
    run.__name__, run.__doc__, run.__wrapped__ = launcher.__name__, launcher.__doc__, launcher
    return run


def _finite_positive(number) -> bool:
    """Whether `number` is an int or float (not a bool) that is finite and > 0 as a float."""
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        return False
    try:
        return 0 < float(number) < float("inf")
    except OverflowError:  # an int beyond float's range
        return False


def _linear_input_dtypes(device: torch.device) -> tuple:
    """The input dtypes of the skinny_linear / quantized_linear kernel on `device`: float32 on the CPU, the
    logit dtypes on accelerators."""
    return (torch.float32,) if device.type == "cpu" else _LOGIT_DTYPES


def _check_linear_input(op: str, input: torch.Tensor) -> None:
    """The input of skinny_linear / quantized_linear, for the wrappers: `_linear_input_dtypes` of its device."""
    allowed = _linear_input_dtypes(input.device)
    if input.dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{op}: input on {input.device.type} must be {names}, got {input.dtype}")


def _check_bias(op: str, bias, n: int) -> None:
    if not isinstance(bias, torch.Tensor) or bias.shape != (n,):
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"{op}: bias must be [N] = [{n}] or None, got {got}")
