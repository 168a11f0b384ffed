"""Two threads decoding with one model object at once, as a user serving requests from threads would: each
gets the output it gets alone, and the model is left as it was.

What is shared while they run: the model's configs switch to specops' tree attention while a tree forward is in
flight in any thread (tree_forward.tree_forward), and its float linear layers route the products of threads inside
a CPU forward (cpu_forward._routed); a forward of another thread meanwhile must run as the model's own. A
`threads` left at None leaves torch's thread count as the user set it.
"""

from __future__ import annotations

import threading

import pytest
import torch
from toy_models import byte_tokenizer, tiny_gemma3, tiny_llama

import specops

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["abcabcabcabc abc", "Hello", "the cat sat; the cat sat; the cat"]
ROUNDS = 4

# Pairs run at once, every method in at least one: a tree verifier beside plain forwards, two tree verifiers,
# a drafter's chain beside trees, a sampled tree beside a sampled chain, the string-level drafters beside
# the vocabulary-level ones, and the two ensembles (target and drafter as members) beside each other.
PAIRS = [("ngram", "ar"), ("ngram", "ngram"), ("rsd-c", "sd"), ("specinfer", "ar"), ("slem", "tli"),
         ("union", "rsd-s"), ("slrs", "ngram"), ("se", "ensemble")]
_DRAFTERS = ("sd", "tli", "union", "slem", "slrs", "rsd-c", "rsd-s", "specinfer")


def _call(method: str, model, drafter, tok, sampled: bool, shape):
    kwargs = dict(temperature=0.9, seed=11) if sampled else {}
    target = model
    if method in _DRAFTERS:
        kwargs.update(drafter=drafter, drafter_tokenizer=tok)
    if method == "ngram":
        kwargs["num_draft_tokens"] = shape  # fixed: every step verifies a tree
    if method == "slrs":  # its random numbers are keyed by step: the same text needs fixed draft lengths
        kwargs["num_draft_tokens"] = 3
    if method in ("se", "ensemble"):  # an ensemble of the two models, one object each, shared with the others
        target = [model, drafter]
        kwargs.update(tokenizer=[tok, tok], ensemble=specops.WeightedEnsemble([0.5, 0.5]))
    else:
        kwargs["tokenizer"] = tok
    return lambda: specops.decode(PROMPTS, target=target, method=method, max_new_tokens=12, **kwargs).tokens


def _together(calls) -> list[list]:
    """Run each call ROUNDS times in its own thread, all starting at once; each thread's results in order."""
    start = threading.Barrier(len(calls))
    results: list[list] = [[] for _ in calls]
    errors: list[BaseException] = []

    def work(i, call):
        try:
            start.wait()
            for _ in range(ROUNDS):
                results[i].append(call())
        except BaseException as error:  # noqa: BLE001 - reported below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("first,second", PAIRS)
@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_two_threads_share_one_model(name, first, second, sampled):
    model = tiny_llama(layers=2, seed=0) if name == "llama" else tiny_gemma3(layers=2, seed=0, sliding_window=8)
    drafter = tiny_llama(layers=1, seed=1) if name == "llama" else tiny_gemma3(layers=1, seed=1, sliding_window=8)
    tok = byte_tokenizer()
    implementation = model.config._attn_implementation
    calls = [_call(first, model, drafter, tok, sampled, (4, 3)), _call(second, model, drafter, tok, sampled, (2, 4))]
    alone = [call() for call in calls]
    threads_before = torch.get_num_threads()
    results = _together(calls)
    for i, call in enumerate(calls):
        assert results[i] == [alone[i]] * ROUNDS, (i, (first, second)[i])
    assert model.config._attn_implementation == implementation
    assert all("forward" not in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert torch.get_num_threads() == threads_before


def test_a_plain_forward_beside_a_tree_forward_is_the_models_own():
    """While one thread holds a tree forward open, another thread's forward of the same model (transformers'
    own, not through specops) gives the logits it gives alone, bit for bit."""
    from specops.decoding.tree_forward import TreeMask, tree_forward

    model = tiny_llama(layers=2, seed=0)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        alone = model(ids).logits
    tree = TreeMask(valid=torch.ones(1, 5, dtype=torch.bool), depth=torch.zeros(1, 1, dtype=torch.long),
                    visible=torch.ones(1, 1, 1, dtype=torch.bool))
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with tree_forward(model, tree):
            inside.set()
            leave.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert inside.wait(30)
        assert model.config._attn_implementation == "specops_tree"  # switched: the other thread's tree is open
        with torch.inference_mode():
            beside = model(ids).logits
    finally:
        leave.set()
        holder.join()
    assert torch.equal(beside, alone)
    assert model.config._attn_implementation != "specops_tree"


def test_held_switch_switches_once_and_restores_when_the_last_holder_leaves():
    """The first holder of an object switches it, later ones find it switched, the last to leave restores what
    it had; `saved` tells what that was while it is held."""
    from specops.decoding.held import HeldSwitch

    state = {"a": "own-a", "b": "own-b"}
    calls = []

    def install(key):
        calls.append(("install", key))
        before, state[key] = state[key], "switched"
        return before

    def restore(key, before):
        calls.append(("restore", key))
        state[key] = before

    switch = HeldSwitch(install, restore)
    with switch.hold(["a"]):
        with switch.hold(["a", "b"]):
            assert state == {"a": "switched", "b": "switched"} and switch.saved("a") == (True, "own-a")
        assert state == {"a": "switched", "b": "own-b"} and switch.saved("b") == (False, None)
        assert switch.saved_values() == ["own-a"]
    assert state == {"a": "own-a", "b": "own-b"}
    assert calls == [("install", "a"), ("install", "b"), ("restore", "b"), ("restore", "a")]


def test_what_a_call_keeps_is_listed_and_forgotten_on_request():
    """docs/methods.md, "What specops keeps between calls": after a call, specops.kept(model) names what is
    held for the model; forget(model) drops it all (the next call probes and learns again, with the same
    output), and another model's state stays."""
    model, other, tok = tiny_llama(layers=2, seed=0), tiny_llama(layers=2, seed=3), byte_tokenizer()

    def call(m):
        return specops.decode(PROMPTS, target=m, tokenizer=tok, method="ngram", max_new_tokens=8).tokens

    assert specops.kept(model) == {}
    first = call(model)
    call(other)
    held = specops.kept(model)
    assert {"chain probe", "tree probe", "n-gram acceptance", "cache argument"} <= set(held), held
    assert set(specops.forget(model)) == set(held)
    assert specops.kept(model) == {} and specops.kept(other) == held
    assert call(model) == first and set(specops.kept(model)) == set(held)
    specops.forget(model)
    specops.forget(other)


def test_every_table_kept_per_object_is_registered():
    """A module-level weak table in specops is state a later call reuses: it must come from
    specops._kept.per_object, so that kept() lists it and forget() drops it."""
    import re
    from pathlib import Path

    root = Path(specops.__file__).parent
    unregistered = []
    for path in root.rglob("*.py"):
        for line in path.read_text(encoding="utf-8").splitlines():
            if re.match(r"^_?[A-Z_]+\b.*=\s*weakref\.WeakKeyDictionary\(\)", line):
                unregistered.append(f"{path.relative_to(root)}: {line.strip()}")
    assert unregistered == [], unregistered
