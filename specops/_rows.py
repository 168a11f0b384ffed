"""Per-row arguments: how a scalar or a tensor becomes one value per row of a batch (the ops'
temperature, top_k, top_p and tensor seeds; `specops._seeds` builds the seed rules on it)."""

from __future__ import annotations

import torch


def per_row(name: str, value, rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A number, a 0-d tensor or a [rows] tensor as a contiguous [rows] tensor of `dtype` on `device`.
    Integer dtypes take integers only (an integral float is accepted, a float tensor is not)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.reshape(1).expand(rows)
        if value.shape != (rows,):
            raise ValueError(f"{name} must be a scalar or a [{rows}] tensor, got shape {tuple(value.shape)}")
        if value.is_floating_point() and not dtype.is_floating_point:
            raise TypeError(f"{name} must hold integers, got {value.dtype}")
        return value.to(device=device, dtype=dtype).contiguous()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    if isinstance(value, float) and not dtype.is_floating_point:
        if not value.is_integer():
            raise TypeError(f"{name} must be an integer, got {value}")
        value = int(value)
    if not dtype.is_floating_point and not torch.iinfo(dtype).min <= value <= torch.iinfo(dtype).max:
        raise ValueError(f"{name} must fit {str(dtype).removeprefix('torch.')}, got {value}")
    return torch.full((rows,), value, dtype=dtype, device=device)
