"""Every model type of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES through specops.decode
(causal_lm_sweep.py): each case exact, or refused before decoding with a ValueError that names the
model's class and lists only methods that work. A type that cannot be built here is reported, not failed;
one that crashes or hangs its worker fails.

The sweep runs once per test session, in two worker processes (one torch thread each), before the per-type
tests read its results. SPECOPS_SWEEP_TYPES (comma-separated) limits it to some types."""

from __future__ import annotations

import fcntl
import json
import os

import pytest

import causal_lm_sweep as sweep

_TYPES = os.environ.get("SPECOPS_SWEEP_TYPES")
TYPES = _TYPES.split(",") if _TYPES else sweep.all_types()


# With --dist loadgroup (README) one pytest-xdist worker takes every test here. pytest 9.2 no longer lets
# pytest-xdist 3.8 put a group in a test's id, so the tests spread over the workers anyway: `results` then
# runs the sweep in the first worker that needs it and hands the others its results through a file.
pytestmark = pytest.mark.xdist_group("causal-lm-sweep")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return sweep.sweep(TYPES, workers=2)
    # The workers' temporary folders share a parent that is new for every session.
    shared = tmp_path_factory.getbasetemp().parent / "causal-lm-sweep.json"
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a worker that comes second waits for the first one's sweep
        if not shared.exists():
            shared.write_text(json.dumps(sweep.sweep(TYPES, workers=2)))
        return json.loads(shared.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("model_type", TYPES)
def test_exact_or_refused(results, model_type):
    result = results[model_type]
    problems = sweep.verdict(result)
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_sweep_reports_counts(results):
    counts = sweep.counts(results)
    assert counts["types"] == len(TYPES)
    assert counts["failing"] == 0, counts


# ---- the checks themselves can fail ----

_REFUSAL = ("refused: decode: method 'ngram' scores draft trees with the target, and FooForCausalLM cannot take "
            "them exactly: x. Methods that work with it: ar, sd, tli")


def _result(**cases):
    base = {"type": "foo", "class": "FooForCausalLM", "build": "ok", **{c: "exact" for c in sweep.CASES}}
    base.update(cases)
    return base


def test_verdict_passes_exact_and_true_refusals():
    assert sweep.verdict(_result()) == []
    assert sweep.verdict(_result(ngram=_REFUSAL, **{"rsd-c": _REFUSAL})) == []


@pytest.mark.parametrize("case, status", [
    ("ar", "differs: row 1 [3, 4] vs [3, 5]"),
    ("sd", "error: RuntimeError at x.py:1: boom"),
    ("ngram", "refused: decode: FooForCausalLM cannot take trees"),  # no list of working methods
])
def test_verdict_catches_failures(case, status):
    assert sweep.verdict(_result(**{case: status}))


def test_verdict_catches_a_refusal_that_lists_a_failing_method():
    problems = sweep.verdict(_result(sd="differs: row 0 [1] vs [2]", ngram=_REFUSAL))
    assert any("refusal lists 'sd'" in p for p in problems), problems


def test_verdict_catches_crashes_and_a_missing_case():
    assert sweep.verdict({"type": "foo", "crash": "the worker died (exit -11)"})
    result = _result()
    del result["sd"]
    assert sweep.verdict(result)


def test_moshi_follows_its_forward_where_generate_follows_its_cache():
    """Moshi's forward attends to every earlier token (create_causal_mask, no window) while the cache its
    generate() builds (DynamicCache(config)) keeps only the last sliding_window keys: past the window,
    generate() attends differently after the prefill than a forward over the same tokens. specops follows
    the forward, so it gives what generate(use_cache=False) and a full forward per token give."""
    import torch

    import specops
    from toy_models import EOS_ID, PAD_ID, byte_tokenizer

    model = sweep.tiny("moshi")
    model.config.sliding_window = 6  # the prompt and the new tokens run well past it
    tok = byte_tokenizer()
    prompt = "the cat; the cat; "
    ids = torch.tensor([tok(prompt)["input_ids"]])
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                  max_new_tokens=sweep.MAX_NEW, pad_token_id=PAD_ID, eos_token_id=EOS_ID)
    with torch.inference_mode():
        uncached = model.generate(use_cache=False, **kwargs)[0, ids.shape[1]:].tolist()
    out = specops.decode(prompt, target=model, tokenizer=tok, method="ar", max_new_tokens=sweep.MAX_NEW)
    assert out.tokens == sweep._cut_at_eos(uncached) == sweep._greedy_no_cache(model, tok, prompt)
