"""Tests of the screened output head of greedy steps (specops/decoding/greedy_head.py).

1. The screen's logits have the full float32 head's argmax, ties to the lowest id included, on random heads
   whose vocabulary is not a whole number of blocks, with and without a soft-cap, on rows of 1 to 16; every
   id it computes has the full head's bits; non-finite rows are left to the full head. Each test of the
   screen runs with float32 rows and with rows quantized to int8 (the VNNI path).
2. The check can fail: with the bounds taken away, a hand-made pair of rows whose int8 copies reverse their
   order gives the wrong argmax, and the bound is what keeps it; likewise a row whose int8 image misreads
   one feature, and the rows' own term of the bound, which holds on rows of every magnitude.
3. Decoding: greedy `ar` and `ngram` through the screen (forced onto tiny Llama and Gemma-3 models with a
   soft-cap) equal `generate()` on a ragged batch, and the screen did serve their steps; a sampled call
   never reads it; a head changed in place gets a new screen; `specops.kept` names it and `forget` drops it.
"""

from __future__ import annotations

import pytest
import torch

import specops
from specops.decoding import greedy_head
from specops.decoding.greedy_head import _Screen, capped
from specops.quantization import QuantizedLinear
from toy_models import byte_tokenizer, tiny_gemma3, tiny_llama


def _full(weight, rows, softcap):
    logits = torch.ops.specops.skinny_linear(rows, weight, None)
    return torch.tanh(logits / softcap) * softcap if softcap is not None else logits


def _head(vocab: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, dim, generator=g) / dim ** 0.5
    weight[11] = weight[vocab - 3]  # an exact tie: id 11 must win wherever the pair leads
    weight[20] = weight[21] * (1 + 1e-6)  # a near tie
    return weight


@pytest.fixture(params=["float32 rows", "int8 rows"])
def rows_kind(request, monkeypatch):
    """Both ways the screen multiplies: float32 rows by the int8 copy (quantized_linear), and rows quantized
    to two int8 rows each (int8_linear; taken where the CPU has VNNI, and correct on every CPU)."""
    monkeypatch.setattr(greedy_head, "_int8_rows", lambda: request.param == "int8 rows")
    return request.param


@pytest.mark.parametrize("softcap", [None, 30.0, 3.0])
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_screen_gives_the_full_heads_argmax_and_bits(rows, softcap, rows_kind):
    vocab, dim = 1000, 64  # 1,000 ids: four blocks, the last one padded
    for seed in range(4):
        weight = _head(vocab, dim, seed)
        screen = _Screen(weight)
        g = torch.Generator().manual_seed(100 + seed)
        x = torch.randn(rows, dim, generator=g) * (1 + 4 * seed)
        x[0] = weight[vocab - 3] * 8  # the tied pair leads row 0
        if rows > 1:
            x[1] = weight[21] * 8  # the near-tied pair leads row 1
        full = _full(weight, x, softcap)
        got = screen.logits(weight, x, softcap)
        if got is None:  # soft-capped logits near the cap are left to the full head
            assert softcap is not None and (full.abs() > 0.9 * softcap).any()
            continue
        assert torch.equal(got.argmax(1), full.argmax(1))
        assert got.argmax(1)[0] == 11
        kept = torch.isfinite(got)
        assert torch.equal(got[kept], full[kept])  # the ids it computes carry the full head's bits
        assert kept.sum(1).min() >= 1


def test_screen_keeps_few_ids_where_one_leads(rows_kind):
    weight = _head(4096, 64, 0)
    x = weight[1234:1235] * 20  # id 1234 leads by far
    got = _Screen(weight).logits(weight, x, None)
    assert got.argmax(1).item() == 1234 and int(torch.isfinite(got).sum()) < 64


def test_non_finite_rows_go_to_the_full_head():
    weight = _head(600, 32, 1)
    screen = _Screen(weight)
    x = torch.randn(2, 32)
    x[1, 3] = float("nan")
    assert screen.logits(weight, x, None) is None
    x[1, 3] = float("inf")
    assert screen.logits(weight, x, None) is None


def _reversed_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows 0 and 1 whose exact products with x order 0 > 1 and whose int8 copies (one scale a row,
    1/127 here) order 1 > 0: 0.0035 rounds to 0, 0.004 to 1/127."""
    weight = torch.zeros(300, 32)
    weight[:, 0] = -1.0
    weight[0, :2] = torch.tensor([1.0, 0.0035])
    weight[1, :3] = torch.tensor([1.0, 0.0040, -0.0010])
    x = torch.zeros(1, 32)
    x[0, :3] = 1.0
    return weight, x


def test_the_bound_is_what_keeps_the_argmax(rows_kind):
    weight, x = _reversed_pair()
    assert _full(weight, x, None).argmax(1).item() == 0
    screen = _Screen(weight)
    assert screen.logits(weight, x, None).argmax(1).item() == 0
    screen.low.zero_()
    screen.high.zero_()
    screen.block_high.zero_()
    slack = greedy_head._SLACK
    try:
        greedy_head._SLACK = 0.0
        assert screen.logits(weight, x, None).argmax(1).item() == 1  # without bounds: the int8 copy's order
    finally:
        greedy_head._SLACK = slack


def _quantization_flips_a_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """A head whose int8 copy is exact (B_v holds only rounding) and a row whose two int8 rows misread its last
    feature: x = (1, 0.002, 1e-5) is read as (1, 0.002, 1.575e-5) (the second row's scale is 0.002 / 127), so
    id 1 (1e-5 * ... read 1.575e-5) screens above id 0 (1.2e-5), which is the exact argmax."""
    weight = torch.zeros(300, 3)
    weight[:, 0] = -1.0
    weight[0] = torch.tensor([1.2e-5, 0.0, 0.0])
    weight[1] = torch.tensor([0.0, 0.0, 1.0])
    x = torch.tensor([[1.0, 0.002, 1e-5]])
    return weight, x


@pytest.mark.parametrize("head_kind", ["float32", "int8"])
def test_the_rows_quantization_bound_is_what_keeps_the_argmax(monkeypatch, head_kind):
    monkeypatch.setattr(greedy_head, "_int8_rows", lambda: True)
    monkeypatch.setattr(greedy_head, "_SLACK", 0.0)
    weight, x = _quantization_flips_a_pair()
    assert _full(weight, x, None).argmax(1).item() == 0
    if head_kind == "int8":
        layer = QuantizedLinear(weight, None, "int8")
        assert torch.ops.specops.quantized_linear(x, layer.weight, layer.scales, None, None).argmax(1).item() == 0
        screen = _Screen(layer.weight, layer.scales)
    else:
        screen = _Screen(weight)
    screened, moved = screen._int8_product(x)
    assert screened[0, screen.order.tolist().index(1)] > screened[0, screen.order.tolist().index(0)]
    assert screen.logits(weight, x, None).argmax(1).item() == 0
    own = _Screen._int8_product
    monkeypatch.setattr(_Screen, "_int8_product", lambda self, rows: (own(self, rows)[0], torch.zeros(len(rows))))
    assert screen.logits(weight, x, None).argmax(1).item() == 1  # without the rows' term: the misread order


@pytest.mark.parametrize("seed", range(4))
def test_the_rows_quantization_bound_holds(seed):
    """|x . d_v - screened_v| <= moved for every id, on rows with outliers, tiny and huge magnitudes, zeros."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(700, 96, generator=g) / 10
    screen = _Screen(weight)
    x = torch.randn(6, 96, generator=g)
    x[1, 5] *= 1e3  # an outlier feature
    x[2] *= 1e-30
    x[3] *= 1e30
    x[4] = 0.0
    x[5, ::2] = 0.0
    screened, moved = screen._int8_product(x)
    d = screen.int8_rows().double() * screen.scales.double()
    exact = x.double() @ d.T
    assert bool(((exact - screened.double()).abs() <= moved.double()[:, None]).all())
    assert float(moved[4]) <= 1e-29  # a zero row moves nothing
    plain = torch.tensor([0, 1, 5])
    assert bool((moved[plain] < 1e-3 * torch.linalg.vector_norm(x[plain], dim=1) * screen.dmax).all())  # tight


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_an_int8_head_is_screened_through_its_own_rows(monkeypatch, rows, softcap):
    """A head `specops.quantize` made (int8, one scale a row): the screen reads its rows where they are (no
    copy) and computes the ids it keeps with quantized_linear, so argmax and bits are that head's."""
    monkeypatch.setattr(greedy_head, "_int8_rows", lambda: True)
    monkeypatch.setattr(greedy_head, "_SCREEN_WEIGHTS", 0)
    monkeypatch.setattr(greedy_head, "_OWN_FROM", 1)
    vocab, dim = 1000, 64
    for seed in range(3):
        head = QuantizedLinear(_head(vocab, dim, seed), None, "int8")
        g = torch.Generator().manual_seed(200 + seed)
        x = torch.randn(rows, dim, generator=g) * (1 + 4 * seed)
        x[0] = head.dequantize()[vocab - 3] * 8  # the tied pair (equal int8 rows too) leads row 0
        full = capped(torch.ops.specops.quantized_linear(x, head.weight, head.scales, None, None), softcap)
        got = greedy_head.screened_logits(head, x, softcap)
        if got is None:
            assert softcap is not None and (full.abs() > 0.9 * softcap).any()
            continue
        assert greedy_head._screen(head).q.data_ptr() == head.weight.data_ptr()  # its own rows, no copy
        assert torch.equal(got.argmax(1), full.argmax(1)) and got.argmax(1)[0] == 11
        kept = torch.isfinite(got)
        assert torch.equal(got[kept], full[kept]) and kept.sum(1).max() < vocab // 4


def test_an_int8_head_is_screened_only_where_int8_rows_are_fast(monkeypatch):
    monkeypatch.setattr(greedy_head, "_SCREEN_WEIGHTS", 0)
    head = QuantizedLinear(_head(600, 32, 3), None, "int8")
    x = torch.randn(2, 32)
    monkeypatch.setattr(greedy_head, "_int8_rows", lambda: False)
    assert greedy_head.screened_logits(head, x, None) is None
    monkeypatch.setattr(greedy_head, "_int8_rows", lambda: True)
    assert greedy_head.screened_logits(head, x, None) is None  # 2 rows: read whole (as fast)
    assert greedy_head.screened_logits(head, x.repeat(2, 1), None) is not None
    grouped = QuantizedLinear(_head(600, 64, 3), None, "int8", group_size=32)  # scales per group: not served
    assert greedy_head.screened_logits(grouped, torch.randn(2, 64), None) is None


@pytest.mark.parametrize("method", ["ar", "ngram"])
def test_greedy_decoding_of_an_int8_model_through_its_screen_equals_generate(monkeypatch, method):
    monkeypatch.setattr(greedy_head, "_int8_rows", lambda: True)
    monkeypatch.setattr(greedy_head, "_OWN_FROM", 1)
    _decodes_as_generate(monkeypatch, specops.quantize(tiny_llama(), "int8"), method)


def test_screened_logits_serve_few_rows_of_a_large_float_head(monkeypatch):
    weight, x = _reversed_pair()
    head = torch.nn.Linear(32, 300, bias=False)
    head.weight.data = weight
    assert greedy_head.screened_logits(head, x, None) is None  # below _SCREEN_WEIGHTS
    monkeypatch.setattr(greedy_head, "_SCREEN_WEIGHTS", 0)
    screened = greedy_head.screened_logits(head, x, None)
    assert torch.isinf(screened).any() and screened.argmax(1).item() == 0
    assert greedy_head.screened_logits(head, x.repeat(greedy_head._screen_rows() + 1, 1), None) is None
    biased = torch.nn.Linear(32, 300)
    assert greedy_head.screened_logits(biased, x, None) is None


def _spy(monkeypatch) -> list[int]:
    calls = []
    own = _Screen.logits

    def logits(self, weight, rows, softcap):
        calls.append(rows.shape[0])
        return own(self, weight, rows, softcap)

    monkeypatch.setattr(_Screen, "logits", logits)
    monkeypatch.setattr(greedy_head, "_SCREEN_WEIGHTS", 0)
    return calls


def _softcapped_gemma3():
    model = tiny_gemma3(layers=3, seed=2, sliding_window=6)
    model.config.final_logit_softcapping = 3.0
    return model


PROMPTS = ["def f(x):", "hello there, world", "a"]


def _decodes_as_generate(monkeypatch, model, method: str) -> None:
    """Greedy `method` on PROMPTS (a ragged batch) through the screen gives `model.generate()`'s tokens."""
    calls = _spy(monkeypatch)
    tokenizer = byte_tokenizer()
    result = specops.decode(PROMPTS, target=model, tokenizer=tokenizer, method=method, max_new_tokens=12,
                            temperature=0)
    assert calls, "the screen served no step"
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    out = model.generate(**encoded, max_new_tokens=12, do_sample=False)
    width = encoded.input_ids.shape[1]
    for row, tokens in enumerate(result.tokens):
        want = out[row, width:].tolist()
        assert tokens == want[:len(tokens)] and len(tokens) > 0


@pytest.mark.parametrize("method", ["ar", "ngram"])
@pytest.mark.parametrize("make", [tiny_llama, _softcapped_gemma3], ids=["llama", "gemma3_softcap"])
def test_greedy_decoding_through_the_screen_equals_generate(monkeypatch, make, method, rows_kind):
    model = make()
    _decodes_as_generate(monkeypatch, model, method)
    assert "greedy head" in specops.kept(model)
    assert "greedy head" in specops.forget(model) and "greedy head" not in specops.kept(model)


def test_sampled_decoding_reads_the_full_head(monkeypatch):
    calls = _spy(monkeypatch)
    specops.decode(PROMPTS, target=tiny_llama(), tokenizer=byte_tokenizer(), method="ngram", max_new_tokens=8,
                   temperature=0.8, seed=3)
    assert not calls


def test_a_head_changed_in_place_gets_a_new_screen(monkeypatch):
    _spy(monkeypatch)
    model, tokenizer = tiny_llama(seed=4), byte_tokenizer()
    specops.decode(PROMPTS, target=model, tokenizer=tokenizer, method="ar", max_new_tokens=4, temperature=0)
    first = greedy_head._KEPT[model.lm_head]
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    result = specops.decode(PROMPTS[:1], target=model, tokenizer=tokenizer, method="ar", max_new_tokens=6,
                            temperature=0)
    assert greedy_head._KEPT[model.lm_head] is not first
    encoded = tokenizer(PROMPTS[:1], return_tensors="pt")
    want = model.generate(**encoded, max_new_tokens=6, do_sample=False)[0, encoded.input_ids.shape[1]:]
    assert result.tokens[0] == want.tolist()[:len(result.tokens[0])]


def test_a_model_made_in_inference_mode_is_screened(monkeypatch):
    calls = _spy(monkeypatch)
    with torch.inference_mode():  # its weights are inference tensors: no version counter
        model = tiny_llama(seed=5)
    tokenizer = byte_tokenizer()
    result = specops.decode(PROMPTS[:2], target=model, tokenizer=tokenizer, method="ar", max_new_tokens=6,
                            temperature=0)
    assert calls
    encoded = tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = model.generate(**encoded, max_new_tokens=6, do_sample=False)[:, encoded.input_ids.shape[1]:]
    for row, tokens in enumerate(result.tokens):
        assert tokens == out[row].tolist()[:len(tokens)]


# Greedy verification reads only the rows its path reaches (greedy_head.greedy_logits with `follow`).


def _reached(parent: list[int], token: list[int], logits: torch.Tensor) -> list[bool]:
    """The rows a greedy verification can read: a root, or a row whose parent is reached and whose
    token is one of the parent row's largest logits (any tie-break)."""
    reached = []
    for j, p in enumerate(parent):
        row = logits[p] if p >= 0 else None
        reached.append(p < 0 or (token[j] >= 0 and reached[p] and bool(row[token[j]] == row.max())))
    return reached


def _counting(weight):
    """A whole-head function that counts the rows it is given."""
    seen = []

    def full(rows):
        seen.append(rows.shape[0])
        return torch.ops.specops.skinny_linear(rows, weight, None)

    return full, seen


@pytest.mark.parametrize("seed", range(6))
def test_staged_rows_equal_the_full_head_wherever_verification_reads(monkeypatch, seed):
    monkeypatch.setattr(greedy_head, "_SCREEN_WEIGHTS", 1 << 62)  # whole rows: every bit comparable
    vocab, dim = 700, 48
    weight = _head(vocab, dim, seed)
    head = torch.nn.Linear(dim, vocab, bias=False)
    head.weight.data = weight
    g = torch.Generator().manual_seed(1000 + seed)
    batch, n = 3, 7
    rows = torch.randn(batch * n, dim, generator=g) * 4
    full = torch.ops.specops.skinny_linear(rows, weight, None)
    # random trees, parents first; tokens the parent's argmax half the time, else another id or -1
    parent = torch.full((batch, n), -1, dtype=torch.long)
    token = torch.full((batch, n), -1, dtype=torch.long)
    for b in range(batch):
        for j in range(1, n):
            p = int(torch.randint(0, j, (1,), generator=g))
            best = int(full[b * n + p].argmax())
            pick = float(torch.rand(1, generator=g))
            parent[b, j] = p
            token[b, j] = best if pick < 0.6 else (-1 if pick > 0.9 else (best + 1) % vocab)
    compute, seen = _counting(weight)
    got = greedy_head.greedy_logits(head, rows, None, compute, (parent, token))
    flat_parent = [(-1 if p < 0 else p + b * n) for b in range(batch) for p in parent[b].tolist()]
    reached = torch.tensor(_reached(flat_parent, token.view(-1).tolist(), full))
    assert torch.equal(got[reached], full[reached])  # the full head's bits on every row verification reads
    # The first pass computes every row down to _FIRST_DEPTH; the second, every row below whose path
    # matches at each parent the first pass computed, and nothing else.
    depth, first, second = [], [], []
    for j, p in enumerate(flat_parent):
        token_j = int(token.view(-1)[j])
        if p < 0:
            depth.append(0), first.append(True), second.append(True)
            continue
        depth.append(depth[p] + 1)
        first.append(token_j >= 0 and first[p] and depth[j] <= greedy_head._FIRST_DEPTH)
        shallow = depth[p] <= greedy_head._FIRST_DEPTH
        edge = token_j >= 0 and (not shallow or bool(full[p, token_j] == full[p].max()))
        second.append(edge and (flat_parent[p] < 0 or second[p]))  # matches wherever the first pass tells
    for j in range(len(flat_parent)):
        computed = first[j] or second[j]
        assert torch.equal(got[j], full[j]) if computed else not got[j].any()
    assert sum(seen) < batch * n and len(seen) <= 2


def test_a_tied_parent_keeps_its_child():
    """The check can fail: a child whose token ties the parent's largest logit with a lower id must be
    computed (a verifier may break the tie either way); read by argmax alone it would be zeros."""
    vocab, dim = 64, 16
    weight = _head(vocab, dim, 7)
    weight[40] = weight[5]  # ids 5 and 40 tie wherever they lead
    head = torch.nn.Linear(dim, vocab, bias=False)
    head.weight.data = weight
    rows = torch.randn(3, dim)
    rows[0] = weight[5] * 10  # row 0: 5 and 40 lead together
    compute, _ = _counting(weight)
    parent = torch.tensor([[-1, 0, 1]])
    for child_token in (40, 5):
        follow = (parent, torch.tensor([[-1, child_token, 3]]))
        got = greedy_head.greedy_logits(head, rows, None, compute, follow)
        assert got[1].any(), "a tied child was skipped"
    got = greedy_head.greedy_logits(head, rows, None, compute, (parent, torch.tensor([[-1, 6, 3]])))
    assert not got[2].any()  # row 1 is in the first pass; row 2, below a child that cannot be read, is not


def test_a_nan_row_keeps_its_children():
    vocab, dim = 64, 16
    weight = _head(vocab, dim, 8)
    head = torch.nn.Linear(dim, vocab, bias=False)
    head.weight.data = weight
    rows = torch.randn(3, dim)
    rows[0, 2] = float("nan")
    compute, _ = _counting(weight)
    follow = (torch.tensor([[-1, 0, 1]]), torch.tensor([[-1, 9, 3]]))
    got = greedy_head.greedy_logits(head, rows, None, compute, follow)
    assert got[1].any()


@pytest.mark.parametrize("method", ["sd", "ngram"])
def test_greedy_verification_computes_fewer_rows_and_equals_generate(monkeypatch, method):
    """Chains drafted by another model (sd) and n-gram trees, greedy, on a ragged batch: the head computes
    fewer rows than the steps carry, and the tokens are generate()'s."""
    computed, offered = [], []
    own = greedy_head.greedy_logits

    def spy(head, rows, softcap, full, follow=None):
        out = own(head, rows, softcap, full, follow)
        if follow is not None:
            offered.append(rows.shape[0])
            computed.append(int(out.any(1).sum()))
        return out

    import specops.decoding.cpu_forward as cpu_forward
    import specops.decoding.llama_forward as llama_forward
    monkeypatch.setattr(cpu_forward, "greedy_logits", spy)
    monkeypatch.setattr(llama_forward, "greedy_logits", spy)
    model, tokenizer = tiny_llama(seed=6), byte_tokenizer()
    prompts = ["abcabcabcabcabcabc", "the cat the cat the cat the"]
    drafter = tiny_llama(seed=7) if method == "sd" else None
    result = specops.decode(prompts, target=model, drafter=drafter, tokenizer=tokenizer,
                            drafter_tokenizer=tokenizer if drafter is not None else None, method=method,
                            max_new_tokens=40, temperature=0,
                            num_draft_tokens=4 if method == "sd" else (3, 4))
    assert offered and sum(computed) < sum(offered)
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**encoded, max_new_tokens=40, do_sample=False)
    width = encoded.input_ids.shape[1]
    for row, tokens in enumerate(result.tokens):
        assert tokens == out[row, width:].tolist()[:len(tokens)] and len(tokens) > 0


def test_flat_rows_go_to_the_full_head(monkeypatch):
    """Rows with no leading id keep most of the vocabulary as candidates: past _MOST_IDS the screen gives
    up (the caller reads the whole head) rather than gather that much of the float32 head."""
    vocab, dim = 4096, 32
    weight = _head(vocab, dim, 9)
    screen = _Screen(weight)
    flat = torch.zeros(2, dim)
    flat[:, 0] = 1e-3  # every logit within the bounds of every other
    monkeypatch.setattr(greedy_head, "_MOST_IDS", 512)  # two blocks a row
    assert screen.logits(weight, flat, None) is None
    leading = weight[100:101] * 20
    got = screen.logits(weight, leading, None)
    assert got is not None and got.argmax(1).item() == 100


def test_leaders_spread_over_many_blocks_stay_screened(rows_kind, monkeypatch):
    """A row's candidates may lie one to a block, in more blocks than _MOST_IDS / _BLOCK (32): the screen still
    computes just them (Gemma-3-270M's greedy rows do that in 6 % of steps), and gives up only past
    _MOST_BLOCKS blocks a row. 64 tied leaders, their int8 steps (and so their bounds and places in the
    screen's order) spread by a coordinate the row does not read."""
    vocab, dim = 256 * 80, 64
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(vocab, dim, generator=g) / dim ** 0.5
    weight[:, 0] = torch.rand(vocab, generator=g) * 8
    lead = torch.arange(64) * 311 + 7
    u = torch.randn(dim, generator=g)
    u[0] = 0
    u /= u.norm()
    weight[lead, 1:] = 4 * u[1:]
    weight[lead, 0] = torch.linspace(0.0, 8.0, 64)
    screen = _Screen(weight)
    place = torch.argsort(screen.order[:vocab])
    assert len(set((place[lead] // greedy_head._BLOCK).tolist())) > 32  # the premise
    x = (u * 8)[None]
    got = screen.logits(weight, x, None)
    assert got is not None
    assert set(torch.isfinite(got[0]).nonzero().view(-1).tolist()) == set(lead.tolist())
    assert got.argmax(1).item() == 7 == (x @ weight.t()).argmax(1).item()  # the tie goes to the lowest id
    monkeypatch.setattr(greedy_head, "_MOST_BLOCKS", 32)
    assert screen.logits(weight, x, None) is None


@pytest.mark.parametrize("int8, method, prompts, temperature, tokens, made", [
    (False, "ar", 1, 0.0, 6, True),
    (False, "ngram", 1, 0.0, 6, True),
    (False, "ar", 1, 0.0, 1, True),  # the prefill's token reads it
    (False, "ngram", 1, 0.8, 6, False),  # sampled: the whole head
    (True, "ar", 1, 0.0, 6, False),  # steps of one row: an int8 head's own product (_OWN_FROM)
    (True, "ar", 3, 0.0, 6, True),
    (True, "ngram", 1, 0.0, 6, True),
])
def test_the_screen_is_made_before_the_clock(monkeypatch, int8, method, prompts, temperature, tokens, made):
    """A greedy call makes the screen it will read before its loop starts (greedy_head.prepare): made inside
    the step that first read it, it was that step's time to the cost model, which then priced every larger
    step by it. Calls that cannot read it do not make it, before or after."""
    import specops.decoding as decoding

    _spy(monkeypatch)
    model = tiny_llama(seed=6)
    if int8:
        model = specops.quantize(model, "int8")
    head = model.get_output_embeddings()
    seen = []
    run = decoding.run

    def clocked(*args, **kwargs):
        seen.append(head in greedy_head._KEPT)
        return run(*args, **kwargs)

    monkeypatch.setattr(decoding, "run", clocked)
    specops.decode(PROMPTS[:prompts], target=model, tokenizer=byte_tokenizer(), method=method,
                   max_new_tokens=tokens, temperature=temperature, seed=1)
    assert seen == [made]
    assert (head in greedy_head._KEPT) == made
