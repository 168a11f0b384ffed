"""What the op wrappers share, and the contracts' checks.

One checker per device path: on the CPU the C++ kernel checks an op's arguments; on devices whose kernels cannot
raise, the op's contract (`check_<op>`, registered before the Triton launcher) makes the same checks with the same
messages. A wrapper only shapes arguments (numbers to per-row tensors, None to defaults, names to the op's codes);
it raises only where it cannot do that (an argument of the wrong kind, an int that int64 cannot carry).
`python_tests/test_validation.py` holds the wrapper, the contract and the C++ kernel to one outcome."""

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


def _tensor(op: str, name: str, value, optional: bool = False) -> torch.Tensor | None:
    """`value` for the op, contiguous: a wrapper's one check of a tensor argument is that it is one (or None where
    the op takes None); its shape, dtype and device are the op's to check."""
    if value is None and optional:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor{' or None' if optional else ''}, got {type(value).__name__}")
    return value.contiguous()


def _sizes(t: torch.Tensor, n: int) -> tuple[int, ...]:
    """The first `n` sizes of `t`, 0 for those it lacks: what a wrapper shapes defaults from, whether or not
    `t` has the shape the op needs (the op says so when it does not)."""
    return tuple(t.shape[:n]) + (0,) * max(0, n - t.dim())


def _int(op: str, name: str, value) -> int:
    """An int argument as the op takes it: a bool or a non-int is a TypeError, an int that int64 cannot carry a
    ValueError (the dispatcher's own message would only say that no int was found)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
    if not -2**63 <= value < 2**63:
        raise ValueError(f"{op}: {name} must fit int64, got {value}")
    return value


def _float(op: str, name: str, value) -> float:
    """A float argument as the op takes it: a number (not a bool) that a float can hold."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range
        raise ValueError(f"{op}: {name} must be a float, got {value}") from None


def _sampling_rows(op: str, rows: int, device: torch.device, temperature, top_k, top_p, seed,
                   offset) -> tuple[torch.Tensor, ...]:
    """The sampling arguments every stochastic op takes, as it takes them: numbers become [rows] tensors on
    `device` (a 0-d tensor too), a missing seed is drawn and an int seed spread over the rows (`specops._seeds`);
    [rows] tensors pass as they are."""
    _int(op, "offset", offset)

    def shaped(value, numbers) -> torch.Tensor:  # a [rows] tensor goes as it is: the op checks it
        return value if isinstance(value, torch.Tensor) and value.dim() else numbers(value)
    return (shaped(temperature, lambda v: per_row("temperature", v, rows, torch.float32, device)),
            shaped(top_k, lambda v: per_row("top_k", v, rows, torch.int64, device)),
            shaped(top_p, lambda v: per_row("top_p", v, rows, torch.float32, device)),
            shaped(draw_seed() if seed is None else seed, lambda v: row_seeds(v, rows, device)))


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


def _linear_input_dtypes(device: torch.device) -> tuple:
    """The input dtypes of the skinny_linear / quantized_linear kernel on `device`: float32 on the CPU, the
    logit dtypes on accelerators."""
    return (torch.float32,) if device.type == "cpu" else _LOGIT_DTYPES
