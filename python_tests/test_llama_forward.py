"""Tests of the Llama-family CPU forward path (specops/decoding/llama_forward.py); tiny random models only.

1. Which models take it: Llama (dense and grouped-query), Qwen2 without a window (q/k/v biases), Mistral
   without a window, Qwen3 (q/k norms), Gemma-3 (sliding-window and global layers, a window of 6 slots that
   the test's rows outgrow, with and without a final soft-cap, and with global layers only), in float32 and
   after `specops.quantize` (int8, int4, bf16), Qwen2 with sliding-window layers; refused with a reason:
   Mistral's window (no layer types),
   Gemma-2 (attention soft-cap), other families (Granite, Phi-3, GPT-2).
2. Its logits equal the model's own on a ragged batch of three rows over several chain steps of 1 to 5
   tokens with the cache it fills (20 slots: past Gemma-3's window), and the model's own forward can go on
   from that cache (the two paths share it).
3. The probe can fail: a norm that computes something else under Llama's name is caught, and the path is
   refused.
4. Fused products: q|k|v and gate|up of a quantized layer packed into one weight give the modules' outputs.
5. Re-quantizing a model after its probe gives a new path (the module signature changed); rows beyond
   `fits` (prefills) go the general way; draft trees take the path, and a tree over a ragged batch whose
   prefixes outgrow the window gives the general tree path's logits and cache.
6. A compaction the engine left pending in its cache layers is applied before the path appends.
7. Decoding: greedy `ar`, and `sd` with a quantized Llama drafter, equal `generate()` on a ragged batch.
"""

from __future__ import annotations

import arch_zoo
import pytest
import torch
import transformers

import specops
from specops.decoding.cpu_forward import _FEW_ROWS, CpuForward, _Product
from specops.decoding.engine import CausalLM
from specops.decoding.llama_forward import LlamaForward, _structure


def _qwen2(seed: int = 0):
    config = transformers.Qwen2Config(vocab_size=arch_zoo.BYTE_VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, use_sliding_window=False, **arch_zoo.COMMON)
    return arch_zoo._build(transformers.Qwen2ForCausalLM, config, seed)


def _mistral_full(seed: int = 0):
    config = transformers.MistralConfig(vocab_size=arch_zoo.BYTE_VOCAB, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=512, sliding_window=None, **arch_zoo.COMMON)
    return arch_zoo._build(transformers.MistralForCausalLM, config, seed)


def _gemma3_softcap(seed: int = 0):
    """Gemma-3 with a final logit soft-cap (the config allows one; the released models set none)."""
    model = arch_zoo.gemma3(seed=seed)
    model.config.final_logit_softcapping = 3.0
    return model


def _gemma3_global(seed: int = 0):
    """Gemma-3 with full-attention layers only: one rotary table, no window."""
    model = arch_zoo.gemma3(seed=seed)
    model.config.layer_types = ["full_attention"] * len(model.model.layers)
    for layer in model.model.layers:
        layer.self_attn.sliding_window, layer.self_attn.is_sliding = None, False
    return model


TAKEN = {"llama": arch_zoo.llama, "llama_gqa": arch_zoo.llama_gqa, "qwen2": _qwen2, "mistral": _mistral_full,
         "qwen3": arch_zoo.qwen3, "gemma3": arch_zoo.gemma3, "gemma3_softcap": _gemma3_softcap,
         "gemma3_global": _gemma3_global, "qwen2_sliding": arch_zoo.qwen2_sliding}
REFUSED = {"mistral_window": arch_zoo.mistral, "gemma2": arch_zoo.gemma2,
           "granite": arch_zoo.granite, "phi3": arch_zoo.phi3, "gpt2": arch_zoo.gpt2}


def _path(model):
    return LlamaForward.of(model, CpuForward(model) if CpuForward.usable(model) else None)


@pytest.mark.parametrize("weights", ["float32", "int8", "int4", "bf16"])
@pytest.mark.parametrize("arch", sorted(TAKEN))
def test_taken_and_exact_on_ragged_chains(arch, weights):
    model = TAKEN[arch]()
    if weights != "float32":
        specops.quantize(model, weights)
    path = _path(model)
    assert path is not None, _structure(model)
    lm = CausalLM(model)
    assert lm.llama_forward is path
    rows = [[5, 9, 14, 3, 8, 2, 7], [11, 4, 6], [20, 21, 22, 23, 24]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    valid = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.bool)
    torch.manual_seed(0)
    steps = [torch.randint(2, 200, (3, n)) for n in (1, 3, 5, 2, 1)]
    with torch.inference_mode():
        cache = lm.new_cache()
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        lm.forward(ids, valid, positions, cache, keep=1)  # a prefill: the general path
        mask, got = valid, []
        for tokens in steps:
            n = tokens.shape[1]
            start = mask.sum(1, keepdim=True)
            mask = torch.cat([mask, torch.ones(3, n, dtype=torch.bool)], dim=1)
            got.append(path(n, cache, input_ids=tokens, attention_mask=mask.long(),
                            position_ids=start + torch.arange(n)))
        # the model's own forward goes on from the cache this path filled
        last = torch.tensor([[30], [31], [32]])
        start = mask.sum(1, keepdim=True)
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.bool)], dim=1)
        own_next = model(input_ids=last, attention_mask=mask.long(), position_ids=start, use_cache=True,
                         **{lm.cache_argument: cache}).logits.float()
        full = torch.cat([ids, *steps, last], dim=1)
        want = model(input_ids=full, attention_mask=mask.long(), position_ids=(mask.long().cumsum(1) - 1).clamp(min=0),
                     use_cache=False).logits.float()
    got = torch.cat(got, dim=1)
    scale = want.abs().max()
    assert (got - want[:, width:-1]).abs().max() <= 1e-4 * scale
    assert (own_next - want[:, -1:]).abs().max() <= 1e-4 * scale


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_refused_with_a_reason(arch):
    model = REFUSED[arch]()
    assert _structure(model) is not None
    assert _path(model) is None


def test_probe_catches_a_norm_that_differs():
    model = arch_zoo.llama()

    class ShiftedRMSNorm(type(model.model.norm)):  # Llama's name and fields, Gemma's (1 + w) scale
        def forward(self, x):
            return super().forward(x) * (1.0 + self.weight) / self.weight

    for layer in model.model.layers:
        layer.post_attention_layernorm.__class__ = ShiftedRMSNorm
    assert _structure(model) is None
    assert _path(model) is None


@pytest.mark.parametrize("weights", ["int8", "int4", "bf16"])
def test_fused_products_equal_the_modules(weights):
    model = specops.quantize(_qwen2(), weights)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    x = torch.randn(5, 64)
    with torch.inference_mode():
        for modules in ([attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]):
            product = _Product(modules)
            assert product.fused is not None
            want = torch.cat([m(x) for m in modules], dim=1)
            assert torch.allclose(product(x), want, rtol=1e-5, atol=1e-5)


def test_requantizing_gives_a_new_path_and_big_forwards_go_the_general_way():
    model = arch_zoo.llama()
    first = _path(model)
    assert first is not None and _path(model) is first  # probed once
    specops.quantize(model, "int8")
    second = _path(model)
    assert second is not None and second is not first
    for layer in range(len(model.model.layers)):  # q|k|v and gate|up fused: the k, v and up slots empty
        slots = second.linears[28 * layer:28 * (layer + 1):4]
        assert slots[0].dtype == torch.int8 and slots[1] is None and slots[2] is None and slots[5] is None
    assert second.fits(_FEW_ROWS) and not second.fits(_FEW_ROWS + 1) and _FEW_ROWS >= 32


def test_prefills_do_not_take_it_and_trees_do(monkeypatch):
    from specops.decoding.tree_forward import TreeMask

    model = arch_zoo.llama()
    lm = CausalLM(model)
    assert lm.llama_forward is not None
    calls = []
    original = LlamaForward.__call__

    def counting(self, keep, cache, **kwargs):
        calls.append(tuple(kwargs["input_ids"].shape))
        return original(self, keep, cache, **kwargs)

    monkeypatch.setattr(LlamaForward, "__call__", counting)
    with torch.inference_mode():
        cache = lm.new_cache()
        prompt = torch.arange(3, 73).unsqueeze(0)  # 70 rows: a prefill, beyond `fits`
        lm.forward(prompt, torch.ones(1, 70, dtype=torch.bool), torch.arange(70).unsqueeze(0), cache, keep=1)
        assert calls == []
        lm.forward(torch.tensor([[7]]), torch.ones(1, 71, dtype=torch.bool), torch.tensor([[70]]), cache, keep=1)
        assert calls == [(1, 1)]
        # a tree of three nodes: the root's two children see the root and themselves
        visible = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
        tree = TreeMask(valid=torch.ones(1, 74, dtype=torch.bool), depth=torch.tensor([[0, 1, 1]]), visible=visible)
        logits = lm.forward(torch.tensor([[8, 9, 10]]), tree.valid, torch.tensor([[71, 72, 72]]), cache, keep=3,
                            tree=tree)
    assert calls == [(1, 1), (1, 3)] and logits.shape[:2] == (1, 3)


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen3", "gemma3", "qwen2_sliding"])
def test_a_tree_forward_equals_the_general_tree_path(arch):
    """A draft tree over a ragged batch whose prefixes outgrow the window of 6 slots (a node's window counts
    tokens along its own path): logits and the cache's new keys and values equal the general path's
    (transformers' layers under specops' tree attention)."""
    from specops.decoding.tree_forward import TreeMask

    model = TAKEN[arch]()
    fused, general = CausalLM(model), CausalLM(model)
    general._llama_forward = None
    assert fused.llama_forward is not None
    rows = [[5, 9, 14, 3, 8, 2, 7, 30, 31], [11, 4, 6, 12, 13]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    valid = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.bool)
    # node 0 continues the row; 1 and 2 hang from it, 3 from 1, 4 from 3 (depth 3), 5 from 2
    parent = [-1, 0, 0, 1, 3, 2]
    depth = torch.tensor([[0, 1, 1, 2, 3, 2]] * 2)
    visible = torch.zeros(2, 6, 6, dtype=torch.bool)
    for node in range(6):
        ancestor = node
        while ancestor >= 0:
            visible[:, node, ancestor] = True
            ancestor = parent[ancestor]
    nodes_valid = torch.tensor([[1] * 6, [1, 1, 1, 1, 1, 0]], dtype=torch.bool)  # row 1's last node: padding
    tokens = torch.tensor([[40, 41, 42, 43, 44, 45], [50, 51, 52, 53, 54, 0]])
    results = []
    with torch.inference_mode():
        for lm in (fused, general):
            cache = lm.new_cache()
            lm.forward(ids, valid, (valid.long().cumsum(1) - 1).clamp(min=0), cache, keep=1)
            mask = torch.cat([valid, nodes_valid], dim=1)
            tree = TreeMask(mask, depth, visible)
            positions = valid.sum(1, keepdim=True) + depth
            logits = lm.forward(tokens, mask, positions, cache, keep=6, tree=tree)
            results.append((logits, [(layer.keys[:, :, width:], layer.values[:, :, width:]) for layer in cache.layers]))
    (got, got_kv), (want, want_kv) = results
    scale = want.abs().max()
    assert (got - want)[nodes_valid].abs().max() <= 1e-4 * scale
    for (k, v), (wk, wv) in zip(got_kv, want_kv):
        assert torch.allclose(k, wk, atol=1e-5) and torch.allclose(v, wv, atol=1e-5)


def test_a_pending_compaction_is_applied_before_the_append(monkeypatch):
    """Rows that move (they kept different numbers of drafts) are moved straight into the buffers the forward
    then writes into: one copy of the cache, not a move and then a copy into room behind it."""
    import specops.decoding.engine as engine
    from specops.decoding.engine import _layers, _moved
    from specops.decoding.llama_forward import _ROOM

    written = []

    def spy(old, offsets, length, new=None, out=None):
        written.append(None if out is None else out.data_ptr())
        return _moved(old, offsets, length, new, out)

    monkeypatch.setattr(engine, "_moved", spy)

    model = arch_zoo.llama_gqa()
    lm = CausalLM(model)
    assert lm.llama_forward is not None
    ids = torch.tensor([[5, 9, 14, 3], [11, 4, 6, 8]])
    valid = torch.ones(2, 4, dtype=torch.bool)
    offsets = [0, -1]  # row 1 drops its last token: its slots move right by one, its first becomes padding
    caches = []
    with torch.inference_mode():
        for _ in range(2):
            cache = lm.new_cache()
            lm.forward(ids, valid, torch.arange(4).expand(2, 4), cache, keep=1)
            caches.append(cache)
        for layer in _layers(caches[0]):
            assert hasattr(layer, "settle")
            layer.pending = (offsets, 4)
        for layer in _layers(caches[1]):
            layer.keys, layer.values = _moved(layer.keys, offsets, 4), _moved(layer.values, offsets, 4)
        mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
        step = torch.tensor([[7], [2]])
        positions = torch.tensor([[4], [3]])
        got = lm.llama_forward(1, caches[0], input_ids=step, attention_mask=mask, position_ids=positions)
        want = model(input_ids=step, attention_mask=mask, position_ids=positions, use_cache=True,
                     **{lm.cache_argument: caches[1]}).logits.float()
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert all(layer.pending is None for layer in _layers(caches[0]))
    rooms = [getattr(layer, _ROOM) for layer in _layers(caches[0])]
    assert written == [ptr for kbuf, vbuf, _, _ in rooms for ptr in (kbuf.data_ptr(), vbuf.data_ptr())]
    for a, b in zip(_layers(caches[0]), _layers(caches[1])):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


def test_rows_kept_ragged_move_when_the_step_settles_and_decode_on_exactly(monkeypatch):
    """KVState.settle moves the rows a rollback left ragged at once, into buffers the next forward writes into
    (so the step that made them ragged is the one timed with the move), and the loop settles after every
    verification: no forward of the target finds a move pending, and greedy output is the model's own."""
    from specops.decoding.engine import KVState, _layers
    from specops.decoding.llama_forward import _ROOM

    model = arch_zoo.gemma3(seed=3)
    lm = CausalLM(model)
    assert lm.llama_forward is not None
    torch.manual_seed(0)
    prompt = torch.randint(2, 200, (2, 5))
    drafts = torch.randint(2, 200, (2, 3))
    with torch.inference_mode():
        state = KVState(lm, 2)
        state.prefill(prompt.tolist())
        state.append(drafts, keep=3)
        state.rollback(3, torch.tensor([3, 1]))  # row 0 keeps its drafts, row 1 one of them
        before = lm.seconds
        state.settle()
        assert not bool(state.trim.any()) and lm.seconds > before  # the move counts as the model's time
        for layer in _layers(state.cache):
            assert layer.pending is None and layer.keys.data_ptr() == getattr(layer, _ROOM)[0].data_ptr()
        step = torch.randint(2, 200, (2, 1))
        got = state.append(step)[:, -1]
        rows = [torch.cat([prompt[0], drafts[0], step[0]]), torch.cat([prompt[1], drafts[1, :1], step[1]])]
        want = torch.stack([model(input_ids=r[None]).logits[0, -1].float() for r in rows])
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()

    pending = []
    forward = LlamaForward.__call__

    def spy(self, keep, cache, **kwargs):
        pending.append(any(getattr(layer, "pending", None) is not None for layer in cache.layers))
        return forward(self, keep, cache, **kwargs)

    monkeypatch.setattr(LlamaForward, "__call__", spy)
    tok = _tokenizer()
    prompts = ["def fib(n):", "hello", "a longer prompt than the others"]
    kwargs = dict(target=model, tokenizer=tok, method="ngram", max_new_tokens=12, num_draft_tokens=(2, 3))
    specops.decode(prompts, **kwargs)  # the model's probes (their own caches, rolled back unsettled) run once
    pending.clear()
    out = specops.decode(prompts, **kwargs)
    assert pending and not any(pending)
    for prompt_text, tokens in zip(prompts, out.tokens):
        ids = tok(prompt_text, return_tensors="pt").input_ids
        want = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
        assert tokens == want[:len(tokens)] and len(tokens) == len(want)


def _tokenizer():
    from toy_models import byte_tokenizer

    return byte_tokenizer()


@pytest.mark.parametrize("method,family", [("ar", "llama"), ("sd", "llama"), ("ar", "gemma3"), ("sd", "gemma3")])
def test_greedy_decoding_equals_generate(method, family):
    target = arch_zoo.llama_gqa(seed=1) if family == "llama" else arch_zoo.gemma3(seed=1)
    drafter = specops.quantize(arch_zoo.llama(seed=2, layers=2), "int8")
    tok = _tokenizer()
    prompts = ["def fib(n):", "hello", "a longer prompt than the others"]
    kwargs = {"drafter": drafter, "drafter_tokenizer": tok} if method == "sd" else {}
    out = specops.decode(prompts, target=target, tokenizer=tok, method=method, max_new_tokens=12, **kwargs)
    assert CausalLM(target).llama_forward is not None and CausalLM(drafter).llama_forward is not None
    for prompt, tokens in zip(prompts, out.tokens):
        ids = tok(prompt, return_tensors="pt").input_ids
        want = target.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
        assert tokens == want[:len(tokens)] and len(tokens) == len(want)


def test_cache_room_is_reused_across_crops_and_regrown():
    """The path writes new rows into buffers with room behind the cache (no copy per forward): drafts
    rejected by a crop are overwritten by the next forward, a full buffer is regrown with the cache
    copied, and the logits stay the model's own throughout."""
    from specops.decoding.llama_forward import _ROOM

    model = arch_zoo.llama_gqa()
    lm = CausalLM(model)
    path = lm.llama_forward
    torch.manual_seed(0)
    ids = torch.randint(2, 200, (2, 6))
    kept = [ids]
    with torch.inference_mode():
        cache = lm.new_cache()
        lm.forward(ids, torch.ones(2, 6, dtype=torch.bool), torch.arange(6).expand(2, 6), cache, keep=1)
        buffers = set()
        for step in range(40):
            n = 1 + step % 4
            tokens = torch.randint(2, 200, (2, n))
            length = cache.get_seq_length()
            got = path(n, cache, input_ids=tokens, attention_mask=torch.ones(2, length + n, dtype=torch.long),
                       position_ids=length + torch.arange(n).expand(2, n))
            full = torch.cat([*kept, tokens], dim=1)
            want = model(input_ids=full, use_cache=False).logits[:, -n:].float()
            assert (got - want).abs().max() <= 1e-4 * want.abs().max(), step
            drop = step % 3 if n > step % 3 else 0  # reject some of the new tokens, as verification does
            if drop:
                cache.crop(-drop)
            kept.append(tokens[:, :n - drop])
            layer = cache.layers[0]
            kbuf = getattr(layer, _ROOM)[0]
            assert layer.keys.data_ptr() == kbuf.data_ptr() and layer.keys.shape[2] == cache.get_seq_length()
            buffers.add(kbuf.data_ptr())
    # grown from 6 cached slots by about 1.5 per step: first room 6 + 1 + 64, then regrown
    assert 2 <= len(buffers) <= 3


def test_dropping_trailing_slots_keeps_the_room():
    """A compaction that only drops trailing slots (a batch-1 rejection) leaves the cache's tensors views
    of their buffers: no copy, and the next forward writes into the same room. One that moves rows
    copies."""
    from specops.decoding.engine import _moved

    t = torch.randn(2, 3, 10, 4)
    kept = _moved(t, [0, 0], 7)
    assert kept.data_ptr() == t.data_ptr() and torch.equal(kept, t[:, :, :7])
    moved = _moved(t, [0, -1], 7)
    assert moved.data_ptr() != t.data_ptr() and torch.equal(moved[1, :, 1:], t[1, :, :6])
    assert torch.equal(moved[1, :, 0], torch.zeros(3, 4))


@pytest.mark.parametrize("vendor,mkl,slow", [("AuthenticAMD", True, True), ("GenuineIntel", True, False),
                                             ("AuthenticAMD", False, False), (None, True, False)])
def test_blas_is_slow_only_for_mkl_on_another_vendors_cpu(monkeypatch, tmp_path, vendor, mkl, slow):
    """Products of more than 32 rows leave skinny_linear for torch's BLAS only where it is fast: not MKL on
    a CPU that is not Intel's (measured: 1.4-4x slower than skinny_linear at 16-512 rows on an AMD EPYC)."""
    import builtins

    from specops import _blas

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\n" + (f"vendor_id\t: {vendor}\n" if vendor else "") + "flags\t: avx2\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path,
                                                                          *a, **k))
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    assert _blas.blas_is_slow_here() is slow


@pytest.fixture
def slow_blas(monkeypatch):
    """cpu_forward as on a CPU whose BLAS is slow (every product below oneDNN's rows through skinny_linear)."""
    from specops.decoding import cpu_forward

    monkeypatch.setattr(cpu_forward, "_SKINNY_ROWS", 1 << 30)
    return cpu_forward


@pytest.mark.parametrize("bias", [False, True])
def test_prefill_products_go_through_onednn_where_mkl_is_slow(slow_blas, bias):
    """From _ONEDNN_ROWS rows (a prefill) a product goes through oneDNN, below through skinny_linear: the
    bits tell which ran (the two sum in different orders), and both are the product."""
    cpu_forward = slow_blas
    if not cpu_forward._onednn():
        pytest.skip("this torch build has no oneDNN linear")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1024, 640, generator=gen)  # 64 rows of it are enough work for oneDNN (_blas.onednn_pays)
    b = torch.randn(1024, generator=gen) if bias else None
    rows = cpu_forward._ONEDNN_ROWS
    for n, through_onednn in ((rows - 1, False), (rows, True), (3 * rows, True)):
        x = torch.randn(n, 640, generator=gen)
        got = cpu_forward._product(weight, b, x)
        skinny = torch.ops.specops.skinny_linear(x, weight, b)
        onednn = torch.ops.mkldnn._linear_pointwise(x, weight, b, "none", [], "")
        assert torch.equal(got, onednn if through_onednn else skinny)
        assert not torch.equal(skinny, onednn)  # the bits can tell the two apart
        want = x.double() @ weight.double().T + (0 if b is None else b.double())
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_small_products_stay_on_skinny_linear(slow_blas):
    """A product too small to repay oneDNN's making a primitive for a new row count (_blas._ONEDNN_WORK) stays
    on skinny_linear at any row count: a tiny model's prefill."""
    from specops import _blas

    cpu_forward = slow_blas
    weight = torch.randn(96, 200)
    for n in (cpu_forward._ONEDNN_ROWS, 1000):
        x = torch.randn(n, 200)
        assert not _blas.onednn_pays(x, weight)
        assert torch.equal(cpu_forward._product(weight, None, x), torch.ops.specops.skinny_linear(x, weight, None))
    big = torch.randn(_blas._ONEDNN_WORK // (96 * 200) + 1, 200)
    assert _blas.onednn_pays(big, weight)


def test_without_onednn_prefill_products_stay_on_skinny_linear(slow_blas, monkeypatch):
    cpu_forward = slow_blas
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    x, weight = torch.randn(2 * cpu_forward._ONEDNN_ROWS, 40), torch.randn(24, 40)
    assert not cpu_forward._onednn()
    assert torch.equal(cpu_forward._product(weight, None, x), torch.ops.specops.skinny_linear(x, weight, None))


def test_onednn_is_not_asked_where_the_blas_is_fast(monkeypatch):
    """Where MKL is fast (an Intel CPU: from 32 rows through F.linear), oneDNN's rows are never reached."""
    from specops.decoding import cpu_forward

    monkeypatch.setattr(cpu_forward, "_SKINNY_ROWS", 32)
    assert not cpu_forward._onednn()
    x, weight = torch.randn(80, 40), torch.randn(24, 40)
    assert torch.equal(cpu_forward._product(weight, None, x), torch.nn.functional.linear(x, weight))
