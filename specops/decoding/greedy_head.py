"""The output head of a greedy step on a CPU, read through an int8 copy of it and exact where it decides.

A greedy step reads only the argmax of each row's logits, and on a CPU the output head is most of what a
step reads: Gemma-3-270M's is 671 MB of its 1.07 GB of float32 weights. The head's rows are copied once to
int8 with one scale a row (a quarter of the bytes; `quantized_linear` reads them). For every vocabulary id v
a bound B_v holds, from Cauchy-Schwarz and float32 rounding over the K products of a sum (γ_K):

    |x . w_v - screened_v| <= ||x|| (||w_v - d_v|| + γ_K (||w_v|| + ||d_v||)) = ||x|| B_v,

where d_v is the int8 row de-quantized and x . w_v also stands for the float32 head's own result. The
largest exact logit is at least L = screened_u - ||x|| B_u for any u, so an id whose screened logit plus its
bound falls below L cannot be the argmax; every other id (2 or 3 of 262,144 at the median of Gemma-3-270M's
greedy steps on HumanEval, 153 at the most) is computed exactly with skinny_linear on its rows of the
float32 head, whose bits for an id do not depend on the other ids of the call. The rest get -inf. So the
argmax, ties included, is the full float32 head's. A slack of 0.1 % on L covers the rounding of the
comparisons themselves and keeps ids that a final soft-cap could round onto the maximum.

On a CPU with AVX-512 VNNI (`specops._C.int8_dot_isa()`) the rows are quantized too, so that the product
multiplies bytes by bytes (`int8_linear`, 64 pairs an instruction where a float FMA takes 16): each row is
written x = s1 q1 + s2 q2 + e, q1 its int8 image at one scale, q2 that of what q1 leaves (two int8 rows for
each row, so e is about 2^-14 of x), and the bound grows by what the rows' own quantization can move a logit:

    |x . d_v - screened_v| <= ||e|| ||d_v|| + the float32 rounding of the scaled sums.

Where rows stay float32 the int8 product is bound by its arithmetic from about 8 rows; with both operands
in int8 it stays bound by reading the copy to about 16 rows and more (the copy kept in int8_linear's packed
layout, whose products need no sums across lanes). It serves up to `_screen_rows()` rows and heads of at least
`_SCREEN_WEIGHTS` weights; the copy is made before a greedy call's loop where the call will read it
(`prepare`), else on the first step that does, kept with the head module (`specops.kept`), and rebuilt if the
head's weight changes.

`greedy_logits` is what the CPU forwards call: the screen where it serves, the whole head where it does not,
and for a greedy verification only the rows the verifier can read (a row whose path has a rejected draft is
never read), in at most two passes.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch

from specops._C import int8_dot_isa
from specops._kept import per_object
from specops.quantization import QuantizedLinear, pack
from specops.reference import int8_linear_pack, int8_linear_unpack

__all__ = ["capped", "greedy_logits", "prepare", "screened_logits"]

# Gemma-3-270M's head on a 2-vCPU Zen 4 (bench/bench_greedy_head.py): with float32 rows screened 8.2 / 14.3 /
# 26.7 ms against float32 23.2 / 24.5 / 27.2 ms at 1 / 4 / 8 rows (from about 8 rows the int8 product is bound
# by arithmetic); with int8 rows (VNNI) screened 6.0 / 10.0 / 14.8 / 24.4 ms against the whole head's 16.3 /
# 23.4 / 24.2 / 33.5 at 1 / 4 / 8 / 16 rows (past 16 rows a screen of two parts saved 12 % at most).
# With the copy in int8_linear's packed layout (no sums across lanes) on a 2-vCPU Zen 5 (bench/
# bench_int8_linear.py, 2026-12-07): screened 10.3 / 15.3 / 21.3 / 26.9 ms against the whole head's 19.3 /
# 29.2 / 39.1 / 49.6 at 8 / 16 / 24 / 32 rows (row by row the copy took 22.3 ms at 16 rows, and lost to the
# whole head from 28).
_SCREEN_ROWS = 8  # float32 rows
_SCREEN_ROWS_INT8 = 32  # int8 rows (VNNI), the copy packed
# An int8 head (specops.quantize) reads as many bytes screened as whole, and its own product is compute-bound
# from a few rows only: Gemma-3-270M:int8's head on the Zen 4, screened 5.1 / 5.8 / 6.8 / 8.0 / 14.5 / 26.5 ms
# against 4.9 / 5.6 / 7.5 / 9.1 / 17.7 / 33.6 whole at 1 / 2 / 3 / 4 / 8 / 16 rows. Its rows are the model's
# own, [N, K] (a packed copy would add a quarter of the float32 model's bytes to an int8 model): on the Zen 5
# 23.5 ms against 29.2 at 16 rows, 46.7 against 37.0 at 20.
_SCREEN_ROWS_OWN = 16
_OWN_FROM = 3
_SCREEN_WEIGHTS = 1 << 24  # smaller heads are a small share of a step (tests lower it)
_BLOCK = 256  # ids per block: a block whose largest screened logit plus largest bound is below L is skipped
_CHUNK = 8192  # rows of the head quantized at a time (bounded temporaries)
_SLACK = 1e-3  # relative (and absolute) slack on L
_CAP_RANGE = 2.0  # soft-capped logits screened while L <= 2 * cap (tanh' >= 0.07: no rounding onto the max)
# Most ids a call computes exactly (the union over its rows): rows whose logits are flat (no id leads, as
# for random tokens) keep tens of thousands of candidates, and gathering their float32 rows made a step of 8
# such rows take 373 ms against 42 with the whole head (Gemma-3-270M, Zen 4); past this, the whole head.
_MOST_IDS = 1 << 13
# Most blocks a row may pass the coarse test (a block's largest screened logit plus its largest bound) before
# the call goes to the whole head: the fine test then reads 256 logits a passing block, so this bounds its
# work (a quarter of Gemma-3-270M's 1,024 blocks). Flat rows pass nearly all. Led rows pass few, but not
# always 32 or fewer (the limit was _MOST_IDS / _BLOCK): over 384 greedy steps of HumanEval/0-7 the blocks
# passing were a median 2, 21 at the 90th percentile, 88 at the 99th and 136 at most, and the 23 rows (6 %)
# past 32 held 33-154 ids after the fine test, screened in 4.4-6.6 ms where the whole head took about 18 (on a
# Zen 5, 2026-12-07).
_MOST_BLOCKS = 256
_FIRST_DEPTH = 1  # a verification's first pass computes the rows of its roots and their children
_FOLLOW = True  # False: every row of a verification is computed (bench/bench_peers.py's -all-rows switch)

_KEPT: weakref.WeakKeyDictionary = per_object(
    "greedy head", "an int8 copy of the float32 output head (a quarter of its bytes; none for an int8 head) "
    "and each id's error bound, for greedy steps")
_BUILD = threading.Lock()


class _Screen:
    """The int8 rows in the order of their bounds (`order`: the id of each; padded to whole blocks with zero
    rows), their scales, and each row's bound B_v: `low` (+inf on padding, never lowers L) and `high` (-inf on
    padding, never a candidate), with each block's largest `high`. Ordered so, a block's largest bound is
    close to each of its rows' (Gemma-3-270M's bounds span 0.009-0.053), so few blocks pass as a whole.

    Made from a float32 head, the int8 rows are a copy of it; given `scales`, `weight` is an int8 head that
    `specops.quantize` made (one scale a row), and the screen reads its own rows in their own order (no copy),
    computes the ids it cannot rule out with quantized_linear, as that head does, and B_v covers only the
    float32 rounding of the head's own product: B_v = (2 γ_K + 2^-24) ||d_v||."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor | None = None):
        n, k = weight.shape
        self.padded = padded = n + (-n % _BLOCK)
        self.key = _key(weight)
        self.vocab = n
        self.k = k
        self.own = scales is not None
        bound = torch.empty(n, dtype=torch.float64)
        self.dmax = 0.0
        unit = 2.0 ** -24
        gamma = (k + 2) * unit / (1 - (k + 2) * unit)  # the sums' products, and the de-quantizing product
        if self.own:
            self.q, self.scales = weight, scales
        else:
            self.q = torch.zeros(padded, k, dtype=torch.int8)
            self.scales = torch.ones(padded, 1)
        for start in range(0, n, _CHUNK):
            if self.own:
                d = self.q[start:start + _CHUNK].float() * self.scales[start:start + _CHUNK]
                wide = (2 * gamma + unit) * d.norm(dim=1).double()
            else:
                w = weight[start:start + _CHUNK].float()
                q, scale, _ = pack(w, "int8")  # specops.quantize's int8 rule: one scale a row
                d = q.float() * scale
                wide = (w - d).norm(dim=1).double() + gamma * (w.norm(dim=1).double() + d.norm(dim=1).double())
                self.q[start:start + len(w)] = q
                self.scales[start:start + len(w)] = scale
            bound[start:start + len(d)] = wide * (1 + 1e-4)  # the norms' own float32 rounding
            self.dmax = max(self.dmax, float(d.norm(dim=1).max()) if len(d) else 0.0)
        self.dmax *= 1 + 1e-4  # ||d_v|| for every v, for the rows' own quantization (int8 rows)
        bound = bound.float()
        order = torch.arange(n) if self.own else torch.argsort(bound, stable=True)
        self.order = torch.cat([order, torch.zeros(padded - n, dtype=torch.long)])
        if not self.own:
            self.q[:n] = self.q[order]
            self.scales[:n] = self.scales[order]
            if _int8_rows():  # int8_linear's packed layout (whole blocks of 16 rows: padded is a multiple of 256)
                self.q = _packed(self.q)
        inf = torch.full((padded - n,), float("inf"))
        self.low = torch.cat([bound[order], inf]).view(-1, _BLOCK)
        self.high = torch.cat([bound[order], -inf]).view(-1, _BLOCK)
        self.block_high = self.high.amax(1)
        self.flat_scales = self.scales.view(-1)

    def int8_rows(self) -> torch.Tensor:
        """The int8 rows [padded, K] (unpacked where `q` holds them packed)."""
        if self.q.dim() == 2:
            return self.q
        return int8_linear_unpack(self.q, self.padded, self.k)

    def logits(self, weight: torch.Tensor, rows: torch.Tensor, softcap: float | None) -> torch.Tensor | None:
        """Logits [R, V] of rows [R, K] whose argmax is the full head's (-inf where an id cannot be it), or
        None where the screen cannot tell (non-finite rows; soft-capped logits near the cap), or would test
        more than _MOST_BLOCKS blocks a row or compute more than _MOST_IDS ids exactly."""
        count = rows.shape[0]
        norm = torch.linalg.vector_norm(rows, dim=1) * (1 + 1e-3)
        if not bool(torch.isfinite(norm).all()):
            return None
        if self.own or self.q.dim() == 3:  # int8 rows (the screen's copy packed for them, or the head's own)
            screened, moved = self._int8_product(rows)
        else:
            screened = torch.ops.specops.quantized_linear(rows, self.q, self.scales, None, None)
            moved = torch.zeros_like(norm)
        blocks = screened.view(count, -1, _BLOCK)
        peak = blocks.amax(2)  # [R, blocks]
        top = peak.argmax(1)
        index = torch.arange(count)
        # L, from the best block
        floor = (blocks[index, top] - norm[:, None] * self.low[top] - moved[:, None]).amax(1)
        if not bool(torch.isfinite(floor).all()):
            return None
        if softcap is not None and bool((floor > _CAP_RANGE * softcap).any()):
            return None
        floor = floor - _SLACK * (1 + floor.abs())
        floor = floor - moved  # so that each upper bound below need not add it
        row, block = torch.nonzero(peak + norm[:, None] * self.block_high >= floor[:, None], as_tuple=True)
        if row.numel() > count * _MOST_BLOCKS:  # flat rows: most blocks pass
            return None
        keep = blocks[row, block] + norm[row, None] * self.high[block] >= floor[row, None]
        at, column = torch.nonzero(keep, as_tuple=True)
        row, ids = row[at], self.order[block[at] * _BLOCK + column]
        unique, where = torch.unique(ids, return_inverse=True)
        if unique.numel() > _MOST_IDS:
            return None
        if self.own:
            exact = torch.ops.specops.quantized_linear(rows, self.q[unique], self.scales[unique], None, None)
        else:
            exact = torch.ops.specops.skinny_linear(rows, weight[unique], None)
        exact = exact[row, where]
        exact = capped(exact, softcap)
        out = rows.new_full((count, self.vocab), float("-inf"))
        out[row, ids] = exact
        return out

    def _int8_product(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The screened logits [R, V] of rows [R, K] quantized to two int8 rows each (x = s1 q1 + s2 q2 + e),
        and for each row how far its quantization and the product's float32 rounding can move a screened
        logit: ||e|| max_v ||d_v|| + 5 * 2^-24 (||s1 q1|| + ||s2 q2||) max_v ||d_v|| (int8_linear rounds the
        sum times two scales, and the two halves' sum, in float32)."""
        x = rows.double()
        parts, scales, norms = [], [], []
        for _ in range(2):
            scale = (x.abs().amax(1) / 127).float()
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round(x / scale.double()[:, None]).clamp_(-127, 127)
            part = q * scale.double()[:, None]
            x = x - part
            parts.append(q.to(torch.int8))
            scales.append(scale)
            norms.append(torch.linalg.vector_norm(part, dim=1))
        out = torch.ops.specops.int8_linear(torch.cat(parts), torch.cat(scales), self.q, self.flat_scales)
        count = rows.shape[0]
        left = torch.linalg.vector_norm(x, dim=1) * (1 + 1e-3)
        moved = (left + 5 * 2.0 ** -24 * (norms[0] + norms[1])) * self.dmax
        if out.shape[1] == self.padded:
            screened = out[:count].add_(out[count:])
        else:  # a head of its own rows, not a whole number of blocks: zeros past them, as padding rows give
            screened = out.new_zeros(count, self.padded)
            torch.add(out[:count], out[count:], out=screened[:, :self.vocab])
        return screened, (moved * (1 + 1e-3) + 1e-30).float()


def _packed(q: torch.Tensor) -> torch.Tensor:
    """int8 rows [N, K] (N a multiple of 16) in int8_linear's packed layout, _CHUNK rows at a time (bounded
    temporaries)."""
    n, k = q.shape
    out = torch.empty(n // 16, -(-k // 4), 64, dtype=torch.uint8)
    for start in range(0, n, _CHUNK):
        out[start // 16:(start + _CHUNK) // 16] = int8_linear_pack(q[start:start + _CHUNK])
    return out


@functools.cache
def _int8_rows() -> bool:
    """Whether this CPU multiplies bytes by bytes fast (AVX-512 VNNI): then the screen quantizes its rows."""
    return int8_dot_isa() == "avx512_vnni"


def _screen_rows(own: bool = False) -> int:
    """The most rows the screen serves on this CPU (own: an int8 head's screen, on its own rows)."""
    if own:
        return _SCREEN_ROWS_OWN
    return _SCREEN_ROWS_INT8 if _int8_rows() else _SCREEN_ROWS


def _serves(own: bool, rows: int) -> bool:
    """Whether the screen takes a call of `rows` rows on this CPU (own: an int8 head's, on its own rows)."""
    return rows <= _screen_rows(own) and not (own and rows < _OWN_FROM)


def _key(weight: torch.Tensor) -> tuple:
    """What tells a changed weight: its storage, shape and version counter (an inference tensor keeps none:
    changed in place inside inference mode, it keeps its screen until `specops.forget`)."""
    try:
        version = weight._version
    except RuntimeError:
        version = None
    return weight.data_ptr(), version, tuple(weight.shape)


def _screen(head) -> _Screen | None:
    """The head's screen, made on first use; None for a head it does not serve: a float32 nn.Linear, or where
    the CPU multiplies int8 rows fast (VNNI) an int8 QuantizedLinear with one scale a row, without a bias and
    of at least _SCREEN_WEIGHTS weights."""
    weight = getattr(head, "weight", None)
    own = type(head) is QuantizedLinear and head.format == "int8" and head.scales is not None and \
        head.scales.dim() == 2 and head.scales.shape[1] == 1 and head.scales.dtype == torch.float32 and \
        head.scales.is_contiguous() and head.mins is None and _int8_rows()
    if (type(head) is not torch.nn.Linear and not own) or head.bias is not None or weight is None or \
            weight.dtype != (torch.int8 if own else torch.float32) or weight.device.type != "cpu" or \
            not weight.is_contiguous() or weight.numel() < _SCREEN_WEIGHTS:
        return None
    key = _key(weight)
    screen = _KEPT.get(head)
    if screen is None or screen.key != key:
        with _BUILD:
            screen = _KEPT.get(head)
            if screen is None or screen.key != key:
                with torch.inference_mode():
                    screen = _Screen(weight.detach(), head.scales.detach() if own else None)
                _KEPT[head] = screen
    return screen


def prepare(head, rows: int | None) -> None:
    """Make `head`'s screen now, where a greedy call's steps of `rows` rows would read it (None: steps of any
    number, a call that may draft), so that it is made before the call's clock and not inside the step that
    first reads it: a step's seconds are what the cost model learns from. (Gemma-3-270M:int8's first step of
    3 rows, which made its screen, took 178 ms against 11 for one token, and the cost model, pricing 2 tokens
    at 75 ms from then on, never let `ngram` draft again in that process; 2026-12-07, Zen 5.)"""
    if rows is None or _serves(type(head) is QuantizedLinear, rows):
        _screen(head)


def screened_logits(head, rows: torch.Tensor, softcap: float | None) -> torch.Tensor | None:
    """Logits [R, V] of hidden rows [R, K] through `head`, soft-capped at `softcap` if given, whose argmax is
    the full head's and which hold -inf where an id cannot be it; None where the screen does not serve (more
    than `_screen_rows()` rows, a head it does not take, rows it cannot tell): the caller computes them all."""
    if not _serves(type(head) is QuantizedLinear, rows.shape[0]):
        return None
    screen = _screen(head)
    if screen is None or (screen.own and rows.shape[0] < _OWN_FROM):
        return None
    return screen.logits(head.weight, rows.contiguous(), softcap)


def capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Logits soft-capped at `softcap` as the models cap them (none where None)."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def greedy_logits(head, rows: torch.Tensor, softcap: float | None, product, follow=None) -> torch.Tensor:
    """Logits [R, V] of hidden rows [R, K] through `head`, soft-capped at `softcap`, for a step that reads
    only argmaxes: screened (`screened_logits`) where the screen serves, else through `product(rows)` (the
    whole head's product).

    follow: (parent, token), each [B, n] int64 with R = B n, for a greedy verification: the verifier reads
    request b's row j only if its row parent[b, j]'s argmax is token[b, j] (parent -1: a root, always
    read; token -1: never read; a parent comes before its children). Rows that
    cannot be read are not computed, and hold zeros: the first pass computes the roots and their children
    (depth <= _FIRST_DEPTH), the second only the rows below whose every computed ancestor's maximum is the
    token of the path. A parent "matches" where its row's largest logit is the token's, so a tie read either
    way keeps the child; a row whose maximum is NaN keeps all its children."""
    if follow is None or not _FOLLOW or follow[0].numel() != rows.shape[0] or not rows.shape[0]:
        return _computed(head, rows, softcap, product)
    parent, token = (t.cpu() for t in follow)
    if bool((parent >= torch.arange(parent.shape[1])).any()):  # not parents first: read every row
        return _computed(head, rows, softcap, product)
    offset = torch.arange(parent.shape[0])[:, None] * parent.shape[1]
    parent = torch.where(parent >= 0, parent + offset, -1).view(-1).tolist()
    token = token.reshape(-1).tolist()
    count = len(parent)
    depth = [0] * count
    for j in range(count):
        if parent[j] >= 0:
            depth[j] = depth[parent[j]] + 1
    out = None
    top: list[float | None] = [None] * count  # the largest logit of each computed row
    for first in (True, False):
        live = [False] * count
        for j in range(count):
            p = parent[j]
            if p < 0:
                live[j] = True
            elif token[j] >= 0 and live[p]:
                live[j] = top[p] is None or _matches(out, p, token[j], top[p])
        wanted = [j for j in range(count)
                  if live[j] and top[j] is None and (not first or depth[j] <= _FIRST_DEPTH)]
        if not wanted:
            continue
        if out is None and len(wanted) == count:
            return _computed(head, rows, softcap, product)
        index = torch.tensor(wanted)
        logits = _computed(head, rows[index], softcap, product)
        if out is None:
            out = logits.new_zeros(count, logits.shape[1])
        out[index] = logits
        for j, value in zip(wanted, logits.amax(1).tolist()):
            top[j] = value
    return out


def _matches(out: torch.Tensor, row: int, token: int, top: float) -> bool:
    """Whether `token` may be the argmax of the computed row `row`, whose largest logit is `top`."""
    return top != top or (token < out.shape[1] and float(out[row, token]) >= top)


def _computed(head, rows: torch.Tensor, softcap: float | None, product) -> torch.Tensor:
    logits = screened_logits(head, rows, softcap)
    return capped(product(rows), softcap) if logits is None else logits
