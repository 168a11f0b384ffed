"""The engine under every method (specops/decoding/engine.py, tree_forward.py): memory linear in the
context, the context limit, models whose LM head or tokenizer do not fit the usual pattern, per-method
options, and the KV cache's compaction; nothing downloads.

1. Long context: a prompt of thousands of tokens decodes (greedy sd and ngram equal ar), and the largest
   attention mask any forward builds grows linearly with the prompt (measured by wrapping every mask
   function transformers calls and specops' own tree mask), while a single forward over the whole
   prompt would build L x L. A prompt past the model's context raises before any forward.
2. Robustness: an LM head that is not an nn.Linear decodes; one pruned by transformers' universal
   assisted generation is refused; a tokenizer with ids the model cannot embed is refused; the cache goes
   under the argument name each forward declares, and a deprecated name fails the tests.
3. Options: per-method options travel in one dict; unknown ones are refused.
4. Compaction: after ragged acceptance every row's tokens are contiguous and end at the last slot.
5. Tree attention: the window read off transformers' mask functions; tree forwards attend through
   specops.ops.tree_attention where every layer's mask is causal with at most a window, and through the
   model's own attention with a dense mask otherwise, with the same greedy tokens either way.
"""

from __future__ import annotations

import pytest
import torch
from toy_models import BYTE_VOCAB, TRANSFORMERS, TableLM, byte_tokenizer, random_table, tiny_gemma3, tiny_llama

import specops
from specops.decoding import probe, tree_forward
from specops.decoding import engine
from specops.decoding.engine import PREFILL_CHUNK, CausalLM, KVState


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


# ---- 1. long context ----

class _MaskSizes:
    """Wraps every mask function transformers can call and specops' tree mask; records the elements of
    each mask they return."""

    def __init__(self, monkeypatch):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        self.sizes: list[int] = []
        mapping = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
        for name, function in list(mapping.items()):
            monkeypatch.setitem(mapping, name, self._wrap(function))
        monkeypatch.setattr(tree_forward.TreeMask, "dense", self._wrap(tree_forward.TreeMask.dense))

    def _wrap(self, function):
        def wrapped(*args, **kwargs):
            mask = function(*args, **kwargs)
            if isinstance(mask, torch.Tensor):
                self.sizes.append(mask.numel())
            return mask

        return wrapped


def _long_prompt(length: int) -> str:
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    return (text * (length // len(text) + 1))[:length]


@pytest.mark.parametrize("method", ["ar", "sd", "ngram"])
def test_mask_memory_linear_in_context(tok, monkeypatch, method):
    """Prompts of 1,200 and 2,400 tokens (byte tokenizer: one token per byte), ragged with a short one:
    the largest mask of any forward stays within B x PREFILL_CHUNK x L elements and doubles (not
    quadruples) with the prompt; greedy outputs equal ar's."""
    model = tiny_gemma3(layers=2, seed=3, sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    model.config.max_position_embeddings = 4096
    kwargs = dict(target=model, tokenizer=tok, max_new_tokens=8, num_draft_tokens=(2, 3) if method == "ngram" else 2)
    if method == "sd":
        kwargs["drafter"] = "self:1"
    if method == "ngram":
        kwargs["options"] = {"tables": "none"}
    peaks = {}
    for length in (1200, 2400):
        prompts = [_long_prompt(length), "short prompt"]
        with monkeypatch.context() as patch:
            sizes = _MaskSizes(patch)
            result = specops.decode(prompts, method=method, **kwargs)
        peaks[length] = max(sizes.sizes)
        assert peaks[length] <= len(prompts) * PREFILL_CHUNK * (length + 16)
        assert result.tokens == specops.decode(prompts, method="ar", target=model, tokenizer=tok,
                                               max_new_tokens=8).tokens
    assert peaks[2400] <= 2.2 * peaks[1200], peaks  # linear: L x L would be 4x


def test_chunked_prefill_matches_one_forward():
    """A prompt read in PREFILL_CHUNK pieces gives the logits of one forward over the whole prompt."""
    model = tiny_llama(layers=2, seed=4)
    ids = torch.randint(2, BYTE_VOCAB, (1, 2 * PREFILL_CHUNK + 37), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(input_ids=ids).logits[0, -1]
        got = KVState(CausalLM(model), 1).prefill([ids[0].tolist()])[0]
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_prefill_groups_of_alike_lengths():
    """Longest first; a row joins the group before it while that pads it by at most _GROUP_PADDING slots."""
    pad = engine._GROUP_PADDING
    assert engine._prefill_groups([282, 157, 78, 90, 84, 130, 173, 102]) == [[0], [6, 1], [5], [7, 3], [4, 2]]
    assert engine._prefill_groups([40, 40 - pad, 40 - pad - 1]) == [[0, 1], [2]]
    assert engine._prefill_groups([7, 7, 7]) == [[0, 1, 2]]
    assert engine._prefill_groups([5]) == [[0]]


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_grouped_prefill_decodes_as_the_padded_one(name, monkeypatch):
    """Prompts of 3 to 90 tokens prefilled in groups of alike lengths (joined, rows back in their order) give
    the logits of the prefill padded to the longest and of each prompt alone, count as one call (one log
    entry, as wide as the longest row), and the state goes on decoding alike (ragged steps and a rollback
    after it)."""
    model = tiny_llama(layers=2, seed=4) if name == "llama" else tiny_gemma3()
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(2, BYTE_VOCAB, (n,), generator=generator).tolist() for n in (40, 3, 90, 44, 20)]
    results = {}
    for padding in (engine._GROUP_PADDING, 1 << 30):  # grouped, then one group padded to the longest
        monkeypatch.setattr(engine, "_GROUP_PADDING", padding)
        lm = CausalLM(model)
        state = KVState(lm, len(rows))
        with torch.inference_mode():
            first = state.prefill(rows)
            calls = (lm.calls, len(lm.log), lm.log[-1][0])
            state.append(torch.tensor([[10, 11]] * len(rows)))
            state.rollback(2, torch.tensor([1, 2, 0, 1, 2]))
            after = state.extend([[12], [13], [14, 15], [16], [17]])
        results[padding] = (first, after, calls, state.mask.sum(1).tolist())
    (first, after, calls, kept), (first_padded, after_padded, calls_padded, kept_padded) = results.values()
    assert calls == calls_padded == (1, 1, 90) and kept == kept_padded
    assert torch.allclose(first, first_padded, atol=1e-5, rtol=1e-4)
    assert torch.allclose(after, after_padded, atol=1e-5, rtol=1e-4)
    with torch.inference_mode():
        for b, row in enumerate(rows):
            alone = model(input_ids=torch.tensor([row])).logits[0, -1]
            assert torch.allclose(first[b], alone, atol=1e-5, rtol=1e-4), b


def test_prompt_past_context_raises_before_any_forward(tok):
    model = tiny_llama(layers=1, seed=0)  # 2,048 positions
    calls = []
    handle = model.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"prompt 1 is 2100 target tokens .* context of 2048 positions "
                                             r"\(max_position_embeddings\)"):
            specops.decode(["ok", "x" * 2100], target=model, tokenizer=tok, max_new_tokens=4)
        with pytest.raises(ValueError, match="max_new_tokens asks for 100 more"):
            specops.decode("x" * 2000, target=model, tokenizer=tok, max_new_tokens=100)
    finally:
        handle.remove()
    assert not calls


# ---- 2. robustness ----

class _Head(torch.nn.Module):
    """An LM head that is not an nn.Linear and has no weight attribute of its own."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.inner = linear

    def forward(self, hidden):
        return self.inner(hidden)


def test_lm_head_not_linear_decodes(tok):
    model = tiny_llama(layers=2, seed=8)
    expected = specops.decode(["Hello", "a b c"], target=model, tokenizer=tok, method="ar", max_new_tokens=10).tokens
    wrapped = tiny_llama(layers=2, seed=8)
    wrapped.lm_head = _Head(wrapped.lm_head)
    for method, extra in (("ar", {}), ("sd", {"drafter": "self:1"}), ("ngram", {"options": {"tables": "none"}})):
        result = specops.decode(["Hello", "a b c"], target=wrapped, tokenizer=tok, method=method, max_new_tokens=10,
                                **extra)
        assert result.tokens == expected, method


def test_pruned_drafter_refused(tok):
    from transformers.generation.candidate_generator import _PruneReindexingLMHead

    target = tiny_llama(layers=2, seed=0)
    drafter = tiny_llama(layers=1, seed=1)
    drafter.set_output_embeddings(_PruneReindexingLMHead(drafter.get_output_embeddings(), torch.arange(100)))
    with pytest.raises(ValueError, match=r"drafter's LM head was pruned in place .*pass an unmodified drafter"):
        specops.decode("hi", target=target, tokenizer=tok, drafter=drafter, drafter_tokenizer=tok, max_new_tokens=2)


def test_tokenizer_larger_than_model_refused(tok):
    small = tiny_llama(layers=1, seed=0, vocab=100)  # the byte tokenizer's ids go up to 257
    with pytest.raises(ValueError, match=r"gives prompt 0 the id \d+, but the target \(LlamaForCausalLM\) embeds "
                                         r"only ids 0\.\.99"):
        specops.decode("héllo", target=small, tokenizer=tok, max_new_tokens=2)


def test_cache_passed_under_the_name_forward_takes(tok):
    """transformers 5.24 renamed the cache argument `past_key_values` to `cache` (the old name warns until
    5.40); a model outside transformers may keep either. The engine passes the one forward() declares."""
    from specops.decoding.hf_compat import cache_argument

    model = tiny_llama(layers=1, seed=3)
    assert CausalLM(model).cache_argument == ("cache" if TRANSFORMERS >= (5, 24) else "past_key_values")
    assert cache_argument(model.get_decoder()) == CausalLM(model).cache_argument
    assert CausalLM(TableLM(random_table(0))).cache_argument == "past_key_values"

    class Wrapped(torch.nn.Module):  # forward(**kwargs): transformers' older name, which 5.24 maps
        def forward(self, **kwargs):
            return kwargs

    assert cache_argument(Wrapped()) == "past_key_values"


@pytest.mark.skipif(TRANSFORMERS < (5, 24), reason="transformers deprecated past_key_values= in 5.24")
def test_deprecated_argument_names_fail_the_tests():
    """pyproject.toml's filterwarnings makes transformers' deprecation warnings errors in the tests, so a
    call of specops' under a deprecated name fails where it is made: the check is live."""
    from transformers import DynamicCache

    model = tiny_llama(layers=1, seed=3)
    with torch.no_grad(), pytest.raises(FutureWarning, match="past_key_values` is deprecated"):
        model(input_ids=torch.tensor([[3, 4]]), past_key_values=DynamicCache(), use_cache=True)


# ---- 3. options ----

@pytest.mark.parametrize("method,options,match", [
    ("ngram", {"tabels": "none"}, r"unknown option 'tabels' for method 'ngram'; it takes scheme, tables"),
    ("ar", {"tables": "none"}, r"unknown option 'tables' for method 'ar'; it takes none"),
    ("ngram", {"tables": "trigram"},
     "option 'tables' of method ngram must be one of auto, bigram, unigram, none, got 'trigram'"),
    ("auto", {"draws": "mixture"}, r"options \['draws'\] belong to se, and method 'auto' picks ar, ngram here"),
])
def test_bad_options(tok, method, options, match):
    with pytest.raises(ValueError, match=match):
        specops.decode("hi", target=tiny_llama(layers=1), tokenizer=tok, method=method, options=options,
                       max_new_tokens=2)


# ---- 4. compaction ----

def test_rows_contiguous_after_ragged_rollback():
    """Rows that keep different numbers of appended tokens are compacted before the next forward: each
    row's tokens end at the last slot, padding only in front, and logits equal a fresh run."""
    model = tiny_llama(layers=2, seed=9)
    lm = CausalLM(model)
    state = KVState(lm, 3)
    rows = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    with torch.inference_mode():
        state.prefill(rows)
        state.append(torch.tensor([[20, 21, 22], [30, 31, 32], [40, 41, 42]]), keep=3)
        state.rollback(3, torch.tensor([3, 1, 2]))
        logits = state.append(torch.tensor([[50], [51], [52]]))[:, -1]
    kept = [rows[0] + [20, 21, 22, 50], rows[1] + [30, 51], rows[2] + [40, 41, 52]]
    assert state.next_pos.tolist() == [len(k) for k in kept]
    width = state.mask.shape[1]
    for b, sequence in enumerate(kept):
        assert state.mask[b].tolist() == [False] * (width - len(sequence)) + [True] * len(sequence)
        assert state.tokens[b, width - len(sequence):].tolist() == sequence
        with torch.inference_mode():
            fresh = model(input_ids=torch.tensor([sequence])).logits[0, -1]
        assert torch.allclose(logits[b], fresh, atol=1e-5, rtol=1e-4), b
    assert state.cache.get_seq_length() == width == max(len(k) for k in kept)


def test_extend_rereads_for_ragged_catch_up():
    """A drafter catching up on 1 token in one row and 3 in another: the short row re-reads its own last
    tokens, so the logits after each row's last token equal a fresh run."""
    model = tiny_llama(layers=2, seed=10)
    state = KVState(CausalLM(model), 2)
    with torch.inference_mode():
        state.extend([[5, 6, 7], [8, 9]])
        logits = state.extend([[10], [11, 12, 13]])
    for b, sequence in enumerate([[5, 6, 7, 10], [8, 9, 11, 12, 13]]):
        with torch.inference_mode():
            fresh = model(input_ids=torch.tensor([sequence])).logits[0, -1]
        assert torch.allclose(logits[b], fresh, atol=1e-5, rtol=1e-4), b


def _tiny_dsa(index_topk: int):
    """A tiny DeepSeek-V3.2 (sparse attention: an indexer with a key cache of its own beside the layer's)."""
    import causal_lm_sweep

    causal_lm_sweep.FIXES["deepseek_v32"] = {"index_topk": index_topk}
    try:
        return causal_lm_sweep.tiny("deepseek_v32", seed=11)
    finally:
        del causal_lm_sweep.FIXES["deepseek_v32"]


@pytest.mark.parametrize("joining", ["prefilled", "longer", "empty"])
@pytest.mark.parametrize("kind", ["llama", "indexer"])
def test_join_appends_rows_to_a_running_batch(joining, kind):
    """Requests joining a running batch (vLLM's continuous batching): rows read in a state of their own and
    joined after ragged steps and a rollback decode as if each row had run alone; a state that has read
    nothing joins as rows that read their prompt with the next extend. "indexer": a sparse-attention model
    whose indexer keeps keys of its own per slot (cut, compacted and joined with the layer's), its top-k
    above every length here so that the check is exact arithmetic, not a tie-break."""
    model = tiny_llama(layers=2, seed=11) if kind == "llama" else _tiny_dsa(64)
    lm = CausalLM(model)
    running = KVState(lm, 2)
    rows = [[5, 6, 7], [8, 9]]
    new = {"prefilled": [[20, 21, 22, 23]], "longer": [list(range(30, 44)), [50, 51]], "empty": [[]]}[joining]
    with torch.inference_mode():
        running.extend(rows)
        running.append(torch.tensor([[10, 11], [12, 13]]))
        running.rollback(2, torch.tensor([1, 2]))  # row 0 keeps 10, row 1 keeps 12 13
        rows = [rows[0] + [10], rows[1] + [12, 13]]
        joined = KVState(lm, len(new))
        if joining != "empty":
            joined.extend(new)
        running.join(joined)
        assert running.rows == 2 + len(new)
        step = [[14], [15, 16]] + ([[24]] if joining == "prefilled" else [[44], [52]] if joining == "longer"
                                   else [[60, 61]])
        logits = running.extend(step)
        empty = KVState(lm, 0)
        empty.join(running)  # into a state with no rows: it takes the rows over
        after = empty.extend([[70]] * empty.rows)
    for b, sequence in enumerate(rows + new):
        sequence = sequence + step[b]
        with torch.inference_mode():
            fresh = model(input_ids=torch.tensor([sequence])).logits[0, -1]
            fresh_after = model(input_ids=torch.tensor([sequence + [70]])).logits[0, -1]
        assert torch.allclose(logits[b], fresh, atol=1e-5, rtol=1e-4), b
        assert torch.allclose(after[b], fresh_after, atol=1e-5, rtol=1e-4), b


def test_engine_module_has_no_quadratic_buffers():
    """What the engine keeps per request is O(L): a [B, L] mask and token record next to the cache."""
    state = KVState(CausalLM(tiny_llama(layers=1)), 2)
    with torch.inference_mode():
        state.prefill([[5] * 300, [6] * 20])
    assert state.mask.shape == state.tokens.shape == (2, 300)
    assert not [name for name, value in vars(state).items()
                if isinstance(value, torch.Tensor) and value.dim() > 2]


# ---- 5. tree attention ----

def test_causal_window_read_from_mask_functions():
    from transformers import masking_utils as mu

    window = lambda function: tree_forward._causal_window(function, torch.device("cpu"))
    assert window(None) == 0
    assert window(mu.causal_mask_function) == 0
    for size in (1, 5, 64, 511, 512, 4096, 12345):
        assert window(mu.sliding_window_causal_mask_function(size)) == size
        assert window(mu.and_masks(mu.causal_mask_function, mu.sliding_window_overlay(size))) == size
    assert window(mu.chunked_causal_mask_function(16, torch.zeros(1, dtype=torch.long))) is None
    assert window(mu.bidirectional_mask_function) is None
    assert window(mu.sliding_window_bidirectional_mask_function(8)) is None
    blocks = torch.tensor([[0, 0, -1, -1]])  # per-token groups, as multimodal models overlay them
    assert window(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(blocks))) is None


def test_causal_windows_cached_by_what_the_function_computes():
    """transformers builds new mask closures every forward: the window is probed once per distinct
    code-and-closure, never reused across different windows, and never cached for functions over data."""
    from transformers import masking_utils as mu

    fingerprint = tree_forward._fingerprint
    assert fingerprint(mu.sliding_window_causal_mask_function(8)) == fingerprint(mu.sliding_window_causal_mask_function(8))
    assert fingerprint(mu.sliding_window_causal_mask_function(8)) != fingerprint(mu.sliding_window_causal_mask_function(9))
    assert fingerprint(mu.sliding_window_overlay(8)) != fingerprint(mu.sliding_window_causal_mask_function(8))
    assert fingerprint(mu.chunked_causal_mask_function(16, torch.zeros(1, dtype=torch.long))) is None
    probes = []
    real = tree_forward._probe_window
    try:
        tree_forward._probe_window = lambda *a: probes.append(1) or real(*a)
        for _ in range(3):
            for size in (3, 77):
                assert tree_forward._causal_window(mu.sliding_window_causal_mask_function(size), torch.device("cpu")) == size
    finally:
        tree_forward._probe_window = real
    assert len(probes) <= 2


def _ngram_greedy(model, tok, prompts):
    return specops.decode(prompts, method="ngram", target=model, tokenizer=tok, max_new_tokens=12,
                          temperature=0.0, options={"tables": "none"}, num_draft_tokens=(2, 3))


@pytest.mark.parametrize("build", [
    lambda: tiny_llama(layers=2, seed=11),
    lambda: tiny_gemma3(layers=2, seed=12, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
], ids=["llama", "gemma3-sliding"])
def test_tree_forwards_use_the_kernel_or_the_dense_mask(tok, monkeypatch, build):
    """Kernel mode on models whose masks are causal with a window; forcing the dense path (a mask the
    kernel could not reproduce) changes no greedy token, and the kernel is then never called."""
    prompts = ["def add(a, b): return a + b\ndef add(", "x = x + 1; x = x + 1; x = x"]
    calls = []
    real = specops.ops.tree_attention
    monkeypatch.setattr(specops.ops, "tree_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = build()
    want = specops.decode(prompts, method="ar", target=model, tokenizer=tok, max_new_tokens=12).tokens
    lm = CausalLM(model)
    assert probe.tree_support(lm, list(range(3, 40))) is None and lm.tree_kernel
    result = _ngram_greedy(model, tok, prompts)
    assert result.tokens == want and result.stats.drafted > 0
    assert calls, "no tree forward reached specops.ops.tree_attention"

    dense = build()  # a fresh model: support is probed once per model
    monkeypatch.setattr(tree_forward, "_causal_window", lambda function, device: None)
    lm = CausalLM(dense)
    assert probe.tree_support(lm, list(range(3, 40))) is None and not lm.tree_kernel
    calls.clear()
    assert _ngram_greedy(dense, tok, prompts).tokens == want
    assert not calls
