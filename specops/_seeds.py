"""Seeds: the one rule for drawing a default seed and the one for giving every row of a batch its own.

Every stochastic path (the ops' `seed=None`, `specops.decode`, the command line) draws a missing seed
with `draw_seed` and spreads a seed over a batch with `row_seeds`, so one int seed names the same
random numbers wherever it is given. The kernels key Philox4x32-10 with the 64-bit row seeds.
"""

from __future__ import annotations

import torch

from specops._rows import per_row

__all__ = ["beam_seeds", "draw_seed", "position_seeds", "row_seeds"]

# Row b of an int seed s gets s + b * 0x9E3779B97F4A7C15 (mod 2**64): the 64-bit golden-ratio Weyl
# increment, so a batch's rows get distinct, well-spread keys (also for consecutive s).
_ROW_STRIDE = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed int64
# Beam (or tree parent) w of a row with seed s draws with s + w * 0x632BE59BD9B4E019 (mod 2**64): odd, so
# a row's beams get distinct keys, and unrelated to the row stride, so they do not land on other rows'.
BEAM_STRIDE = 0x632BE59BD9B4E019
# Output position t of a row with seed s draws with s + (t + 1) * 0xD1B54A32D192ED03 (mod 2**64), when a
# token is keyed by where it lands rather than by the step that emits it (position_seeds).
POSITION_STRIDE = 0xD1B54A32D192ED03 - 2**64  # as a signed int64


def draw_seed() -> int:
    """A seed uniform in [0, 2**63), from torch's default generator (so torch.manual_seed fixes it).
    Non-negative and below 2**63: it prints, parses and fits an int64 as it is."""
    high = int(torch.randint(0, 2**31, ()))
    low = int(torch.randint(0, 2**32, ()))
    return high << 32 | low


def row_seeds(seed: int | torch.Tensor, rows: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[rows] int64 seeds on `device`, one per row. An int s (any size; taken mod 2**64) gives row b the
    seed s + b * 0x9E3779B97F4A7C15 mod 2**64, as a signed int64. A tensor gives the rows' seeds
    themselves: [rows] (or 0-d: every row the same), integer values."""
    if isinstance(seed, int) and not isinstance(seed, bool):
        base = torch.tensor(seed & 0xFFFFFFFFFFFFFFFF, dtype=torch.uint64).view(torch.int64)
        return (torch.arange(rows, dtype=torch.int64) * _ROW_STRIDE + base).to(device)
    return per_row("seed", seed, rows, torch.int64, device)


def beam_seeds(seeds: torch.Tensor, beams: int) -> torch.Tensor:
    """[rows, beams] int64: beam w of row n keyed by seeds[n] + w * 0x632BE59BD9B4E019 (mod 2**64), the
    keys every per-beam draw uses (`stochastic_beam_step`, the parents of a draft-tree level)."""
    return seeds[:, None] + BEAM_STRIDE * torch.arange(beams, dtype=torch.int64, device=seeds.device)


def position_seeds(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[rows, n] int64: the key of the token at sequence position positions[b, j] of row b, seeds[b] +
    (position + 1) * 0xD1B54A32D192ED03 (mod 2**64). A token drawn with it depends on the row's seed and
    where it lands, not on the step or the batch that drew it."""
    return seeds[:, None] + (positions + 1) * POSITION_STRIDE
