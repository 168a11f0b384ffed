"""`specops.hf.generate` inside transformers' `model.generate(..., custom_generate=specops.hf.generate)`, on
tiny random-weight models; nothing downloads.

1. Greedy identity: the returned tensor (prompts, left padding, new tokens, padding of finished rows) is
   `model.generate(do_sample=False)`'s, token for token, on a ragged left-padded batch, for every method
   (auto, ar, ngram, sd with "self:1" and with a drafter model object, rsd-c, rsd-s, specinfer) on four
   architectures, and for a drafter with another vocabulary (slem, tli, union, slrs, auto) given as
   draft_model= / draft_tokenizer= / target_tokenizer= (or the target's tokenizer found through a
   streamer or beside the model's weights); "auto" on a model that cannot take draft trees is "ar";
   ensemble_models= equals specops.decode's ensemble.
2. Lengths: max_new_tokens, max_length, both, neither, max_new_tokens=1.
3. EOS (one id, several ids) and pad_token_id for finished rows.
4. Streamers: a BaseStreamer subclass (the same tokens as generate's streamer gets, end() once),
   TextStreamer, TextIteratorStreamer in a thread; a batch of two raises; end() is called on an error.
5. Stopping criteria: a custom one, StopStringCriteria, MaxTimeCriteria / max_time; stop_strings= raises.
6. return_dict_in_generate.
7. Sampling: seed= and torch.manual_seed reproduce a call, other seeds differ; on a model over 8 tokens the
   sampled token sequences follow the distribution transformers' temperature / top-k / top-p warpers give
   (chi-square), and the same check rejects a wrong distribution.
8. num_return_sequences with sampling.
9. Refusals: ValueError (TypeError for a bad call) naming the option, raised before any forward.
10. stats= is filled.
"""

from __future__ import annotations

import collections
import copy
import threading

import pytest
import torch
from arch_zoo import ARCHITECTURES
from scipy import stats as scipy_stats
from toy_models import BYTE_VOCAB, PAD_ID, byte_tokenizer, merged_byte_tokenizer, tiny_llama
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    LogitsProcessor,
    LogitsProcessorList,
    MaxTimeCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TextIteratorStreamer,
    TextStreamer,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

import specops
import specops.hf
from specops.decoding import METHODS
from specops.decoding.cost_model import CatchUp
from specops.decoding.hf_compat import cache_argument
from specops.decoding.stats import Stats

pytestmark = pytest.mark.usefixtures("private_specops_cache", "one_torch_thread")

# Ragged (5, 18 and 18 bytes), left-padded to 18; repeated substrings, so n-grams of the context draft.
PROMPTS = ["abcab", "the cat; the cat; ", "Hello hello, Hello"]
ONE_PROMPT = "the cat; the cat; "
NEW = 12
ARCHS = ["llama", "gpt2", "qwen2_sliding", "gemma3"]

# Method id -> generate keywords; draft_model="model" stands for a drafter model object of the target's
# vocabulary (another tiny Llama), given without draft_tokenizer.
GREEDY_METHODS = {
    "auto": {"method": "auto"},
    "ar": {"method": "ar"},
    "ngram": {"method": "ngram", "options": {"tables": "unigram"}},
    "ngram-tree": {"method": "ngram", "options": {"tables": "none"}, "num_draft_tokens": (2, 3)},
    "sd-self": {"method": "sd", "draft_model": "self:1", "num_draft_tokens": 3},
    "sd-self-auto": {"method": "sd", "draft_model": "self:1"},
    "sd-model": {"method": "sd", "draft_model": "model", "num_draft_tokens": 2},
    "auto-model": {"draft_model": "model"},
    "rsd-c": {"method": "rsd-c", "draft_model": "self:1", "num_draft_tokens": (2, 2)},
    "rsd-s": {"method": "rsd-s", "draft_model": "self:1", "num_draft_tokens": (2, 2)},
    "specinfer": {"method": "specinfer", "draft_model": "self:1", "num_draft_tokens": (2, 2)},
}
# What "auto" resolves to (stats.method).
RESOLVED = {"auto": "ngram", "auto-model": "sd"}


# ---- models, tokenizers, helpers ----

@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def batch(tok):
    encoded = tok(PROMPTS, return_tensors="pt", padding=True)
    assert encoded["attention_mask"][0, 0] == 0 and encoded["attention_mask"][0, -1] == 1  # left-padded
    return dict(encoded)


@pytest.fixture(scope="module")
def one(tok):
    return dict(tok([ONE_PROMPT], return_tensors="pt"))


@pytest.fixture(scope="module")
def zoo():
    models = {}

    def get(name: str, seed: int = 0, layers: int | None = None):
        key = (name, seed, layers)
        if key not in models:
            kwargs = {} if layers is None else {"layers": layers}
            models[key] = ARCHITECTURES[name](seed=seed, **kwargs)
        return models[key]

    return get


@pytest.fixture(scope="module")
def llama(zoo):
    return zoo("llama")


@pytest.fixture(scope="module")
def drafter(zoo):
    """A drafter model object over the byte vocabulary (one layer, other weights than the targets')."""
    return zoo("llama", seed=1, layers=1)


def plain(model, inputs, **kwargs):
    return model.generate(**inputs, **kwargs)


def hf(model, inputs, **kwargs):
    return model.generate(**inputs, custom_generate=specops.hf.generate, **kwargs)


def _kwargs(method_id: str, drafter) -> dict:
    kwargs = dict(GREEDY_METHODS[method_id])
    if kwargs.get("draft_model") == "model":
        kwargs["draft_model"] = drafter
    return kwargs


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str = ""):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != generate's {tuple(want.shape)}"
    if not torch.equal(got, want):
        row = next(r for r in range(got.shape[0]) if not torch.equal(got[r], want[r]))
        raise AssertionError(f"{what}: row {row} differs from generate():\n specops  {got[row].tolist()}\n"
                             f" generate {want[row].tolist()}")


class Recorder(BaseStreamer):
    """Records every put (as lists) and counts end() calls."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.puts: list = []
        self.ends = 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ends += 1

    def new_tokens(self) -> list[int]:
        """Everything put after the prompt, flattened."""
        out = []
        for piece in self.puts[1:]:
            out.extend(torch.tensor(piece).flatten().tolist())
        return out


# ---- 1. greedy identity ----

@pytest.mark.slow
@pytest.mark.parametrize("method_id", list(GREEDY_METHODS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_generate(zoo, batch, drafter, arch, method_id):
    model = zoo(arch)
    want = plain(model, batch, do_sample=False, max_new_tokens=NEW)
    stats = Stats()
    got = hf(model, batch, do_sample=False, max_new_tokens=NEW, stats=stats, **_kwargs(method_id, drafter))
    _assert_same(got, want, f"{arch} {method_id}")
    expected = RESOLVED.get(method_id, GREEDY_METHODS[method_id].get("method"))
    assert stats.method == expected
    if expected != "ar" and GREEDY_METHODS[method_id].get("num_draft_tokens", "auto") != "auto":
        assert stats.drafted > 0  # a fixed draft length drafts on every step


def test_greedy_cases_cover_every_method():
    """Every method of the registry has a greedy case (GREEDY_METHODS, HETERO_METHODS, ENSEMBLE_METHODS)."""
    cases = [*GREEDY_METHODS.values(), *HETERO_METHODS.values()]
    covered = ({k.get("method") for k in cases} | set(ENSEMBLE_METHODS)) - {None, "auto"}
    assert covered == set(METHODS) - {"auto"}, set(METHODS) ^ covered


# A drafter with another vocabulary: byte-level against multi-byte tokens (test_decode_hetero.py), both ways.
MERGED_WORDS = ["Ġthe", "Ġqu", "Ġw", "he", "ll", "or", "ow", "Ã¼", "Ġcat", "ca", "Hello", "ab"]
HETERO_METHODS = {"slem": {"method": "slem", "num_draft_tokens": 3},
                  "tli": {"method": "tli", "num_draft_tokens": 3},
                  "auto": {}, "union": {"method": "union", "num_draft_tokens": 2},
                  "slrs": {"method": "slrs", "num_draft_tokens": 2}}


def _multi_byte(model):
    with torch.no_grad():
        model.lm_head.weight[BYTE_VOCAB:] *= 2
    return model


@pytest.fixture(scope="module")
def hetero(tok):
    merged = merged_byte_tokenizer(MERGED_WORDS)
    return {
        "byte": (tiny_llama(layers=2, seed=0), tok,
                 _multi_byte(tiny_llama(layers=1, seed=1, vocab=len(merged))), merged),
        "merged": (_multi_byte(tiny_llama(layers=2, seed=2, vocab=len(merged))), merged,
                   tiny_llama(layers=1, seed=3), tok),
    }


@pytest.mark.parametrize("method_id", list(HETERO_METHODS))
@pytest.mark.parametrize("target", ["byte", "merged"])
def test_greedy_hetero_equals_generate(hetero, target, method_id, monkeypatch):
    # "auto" drafts where measured seconds say it pays; reading the prompt never repays itself on these toy
    # models, whose steps take a millisecond, once an earlier test measured a read. Here the drafter must run
    # (that pricing: test_cost_model.py, test_decode.py).
    monkeypatch.setattr(CatchUp, "pays", lambda self, *args: True)
    model, target_tok, draft, draft_tok = hetero[target]
    inputs = dict(target_tok(PROMPTS, return_tensors="pt", padding=True))
    want = plain(model, inputs, do_sample=False, max_new_tokens=NEW)
    stats = Stats()
    got = hf(model, inputs, do_sample=False, max_new_tokens=NEW, draft_model=draft, draft_tokenizer=draft_tok,
             target_tokenizer=target_tok, stats=stats, **HETERO_METHODS[method_id])
    _assert_same(got, want, f"{target} {method_id}")
    assert stats.method == HETERO_METHODS[method_id].get("method", "slem")
    assert stats.drafted > 0


def test_hetero_target_tokenizer_from_streamer(hetero):
    """Without target_tokenizer=, the streamer's tokenizer is the target's."""
    model, target_tok, draft, draft_tok = hetero["byte"]
    inputs = dict(target_tok([ONE_PROMPT], return_tensors="pt"))
    want = plain(model, inputs, do_sample=False, max_new_tokens=NEW)
    got = hf(model, inputs, do_sample=False, max_new_tokens=NEW, draft_model=draft, draft_tokenizer=draft_tok,
             method="slem", streamer=Recorder(target_tok))
    _assert_same(got, want)


def test_hetero_target_tokenizer_beside_weights(hetero, tmp_path):
    """Without target_tokenizer= or a streamer, the tokenizer saved beside the model's weights."""
    model, target_tok, draft, draft_tok = hetero["byte"]
    model.save_pretrained(tmp_path)
    target_tok.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    inputs = dict(target_tok(PROMPTS, return_tensors="pt", padding=True))
    want = plain(model, inputs, do_sample=False, max_new_tokens=NEW)
    got = hf(loaded, inputs, do_sample=False, max_new_tokens=NEW, draft_model=draft,
             draft_tokenizer=draft_tok, method="tli")
    _assert_same(got, want)


def test_hetero_without_target_tokenizer_raises(hetero):
    model, target_tok, draft, draft_tok = hetero["byte"]
    inputs = dict(target_tok(PROMPTS, return_tensors="pt", padding=True))
    with pytest.raises(ValueError, match="target_tokenizer"):
        hf(model, inputs, max_new_tokens=4, draft_model=draft, draft_tokenizer=draft_tok, method="slem")


def test_auto_without_trees_is_ar(zoo, batch):
    """method="auto" without a drafter on a model whose attention cannot take draft trees (Bloom's ALiBi)
    decodes plainly ("ar"); "ngram" is refused, naming the model's class."""
    bloom = zoo("bloom")
    stats = Stats()
    want = plain(bloom, batch, do_sample=False, max_new_tokens=NEW)
    _assert_same(hf(bloom, batch, do_sample=False, max_new_tokens=NEW, stats=stats), want)
    assert stats.method == "ar"
    with pytest.raises(ValueError, match="BloomForCausalLM"):
        hf(bloom, batch, max_new_tokens=NEW, method="ngram")


ENSEMBLE_METHODS = ["ensemble", "se"]


@pytest.mark.parametrize("weights", [None, (0.3, 0.7)])
@pytest.mark.parametrize("method", ENSEMBLE_METHODS)
def test_ensemble_equals_decode(zoo, batch, tok, method, weights):
    """ensemble_models= decodes what specops.decode decodes for target=[model, *members] (padded as generate
    pads finished rows)."""
    model, member = zoo("llama"), zoo("qwen3", seed=2)
    rule = None if weights is None else specops.WeightedEnsemble(list(weights))
    stats = Stats()
    got = hf(model, batch, do_sample=False, max_new_tokens=NEW, ensemble_models=[member],
             ensemble_tokenizers=[tok], target_tokenizer=tok, method=method, ensemble=rule, stats=stats)
    ref = specops.decode(PROMPTS, target=[model, member], tokenizer=[tok, tok], method=method,
                         max_new_tokens=NEW, ensemble=rule)
    width = batch["input_ids"].shape[1]
    assert got[:, width:].tolist() == [row + [PAD_ID] * (NEW - len(row)) for row in ref.tokens]
    assert torch.equal(got[:, :width], batch["input_ids"]) and stats.method == method


@pytest.mark.parametrize("kwargs,match", [
    ({"ensemble_models": ["member"]}, "target_tokenizer"),
    ({"ensemble_tokenizers": ["tok"], "target_tokenizer": "tok"},
     "ensemble_tokenizers= needs ensemble_models"),
    ({"ensemble_models": ["member"], "ensemble_tokenizers": ["tok", "tok"], "target_tokenizer": "tok"},
     "1 ensemble_models but 2 ensemble_tokenizers"),
    ({"ensemble": specops.WeightedEnsemble([0.5, 0.5])}, "ensemble of targets"),
], ids=["no target tokenizer", "tokenizers alone", "count mismatch", "rule alone"])
def test_ensemble_refusals(zoo, batch, tok, kwargs, match):
    member = zoo("qwen3", seed=2)
    swap = {"member": member, "tok": tok}
    kwargs = {key: ([swap.get(v, v) for v in value] if isinstance(value, list) else swap.get(value, value))
              for key, value in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        hf(zoo("llama"), batch, max_new_tokens=4, **kwargs)


# ---- 2. lengths ----

@pytest.mark.filterwarnings("ignore:Using the model-agnostic default")
@pytest.mark.parametrize("method_id", ["ar", "sd-self", "ngram-tree"])
@pytest.mark.parametrize("limit", ["new1", "new7", "length", "both", "neither"])
def test_lengths(llama, batch, drafter, method_id, limit):
    width = batch["input_ids"].shape[1]
    kwargs, new = {"new1": ({"max_new_tokens": 1}, 1), "new7": ({"max_new_tokens": 7}, 7),
                   "length": ({"max_length": width + 5}, 5),
                   "both": ({"max_new_tokens": 3, "max_length": width + 9}, 3),  # max_new_tokens wins
                   "neither": ({}, None)}[limit]
    want = plain(llama, batch, do_sample=False, **kwargs)
    got = hf(llama, batch, do_sample=False, **_kwargs(method_id, drafter), **kwargs)
    _assert_same(got, want, limit)
    if new is not None:
        assert got.shape[1] == width + new  # llama's first greedy tokens hold no EOS: every row runs on


# ---- 3. EOS and padding ----

def _first(row: list[int], token: int) -> int | None:
    return row.index(token) if token in row else None


def _pick_eos(rows: list[list[int]], count: int) -> list[int]:
    """`count` token ids of the greedy continuations that end some rows early while another row runs to
    the end, each first seen in a different row."""
    chosen, rows_hit = [], set()
    for r, row in enumerate(rows):
        for token in row[:-2]:
            hit = {i for i, other in enumerate(rows) if token in other}
            if r in rows_hit or token in chosen or len(hit) == len(rows) or hit & rows_hit:
                continue
            chosen.append(token)
            rows_hit |= hit
            break
        if len(chosen) == count:
            return chosen
    raise AssertionError(f"no {count} EOS candidates in {rows}")


@pytest.mark.parametrize("pad", [7, None])
@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("method_id", ["ar", "sd-self", "ngram"])
def test_eos_and_padding(llama, batch, drafter, method_id, count, pad):
    width = batch["input_ids"].shape[1]
    free = plain(llama, batch, do_sample=False, max_new_tokens=NEW)[:, width:].tolist()
    eos = _pick_eos(free, count)
    kwargs = {"do_sample": False, "max_new_tokens": NEW, "eos_token_id": eos[0] if count == 1 else eos}
    if pad is not None:
        kwargs["pad_token_id"] = pad
    want = plain(llama, batch, **kwargs)
    got = hf(llama, batch, **_kwargs(method_id, drafter), **kwargs)
    _assert_same(got, want, f"eos {eos}")
    _assert_padded(got[:, width:].tolist(), free, eos, PAD_ID if pad is None else pad)


def _assert_padded(new: list[list[int]], free: list[list[int]], eos: list[int], fill: int):
    """Each row of `new` is its greedy continuation `free` up to its first EOS, then `fill`; some row was
    padded."""
    padded = 0
    for r, (got, row) in enumerate(zip(new, free, strict=True)):
        stops = [at for at in (_first(row, t) for t in eos) if at is not None]
        if stops:
            at = min(stops)
            assert got[:at + 1] == row[:at + 1] and all(t == fill for t in got[at + 1:]), (r, got, row)
            padded += at + 1 < len(got)
        else:
            assert got == row[:len(got)]
    assert padded >= 1, "no row was padded after its EOS"


def test_pad_defaults_to_first_eos(llama, batch):
    """Without any pad id (model or call), finished rows are padded with the first EOS id, as generate's."""
    model = copy.deepcopy(llama)
    model.config.pad_token_id = model.generation_config.pad_token_id = None
    width = batch["input_ids"].shape[1]
    free = plain(llama, batch, do_sample=False, max_new_tokens=NEW)[:, width:].tolist()
    eos = _pick_eos(free, 2)
    want = plain(model, batch, do_sample=False, max_new_tokens=NEW, eos_token_id=eos)
    got = hf(model, batch, do_sample=False, max_new_tokens=NEW, eos_token_id=eos, method="sd",
             draft_model="self:1")
    _assert_same(got, want)
    _assert_padded(got[:, width:].tolist(), free, eos, eos[0])


# ---- 4. streamers ----

@pytest.mark.parametrize("method_id", ["ar", "sd-self", "ngram-tree"])
def test_base_streamer(llama, one, drafter, method_id):
    mine, theirs = Recorder(), Recorder()
    want = plain(llama, one, do_sample=False, max_new_tokens=NEW, streamer=theirs)
    got = hf(llama, one, do_sample=False, max_new_tokens=NEW, streamer=mine, **_kwargs(method_id, drafter))
    _assert_same(got, want)
    assert mine.puts[0] == one["input_ids"].tolist() == theirs.puts[0]  # the prompt, from transformers
    assert mine.new_tokens() == theirs.new_tokens() == got[0, one["input_ids"].shape[1]:].tolist()
    assert mine.ends == 1 and theirs.ends == 1
    if method_id != "ar":
        assert len(mine.puts) - 1 < NEW  # pieces of several tokens


@pytest.mark.parametrize("method_id", ["ar", "sd-self"])
def test_text_streamer(llama, one, tok, drafter, method_id, capsys):
    capsys.readouterr()
    want = plain(llama, one, do_sample=False, max_new_tokens=NEW,
                 streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True))
    printed_by_generate = capsys.readouterr().out
    got = hf(llama, one, do_sample=False, max_new_tokens=NEW,
             streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True),
             **_kwargs(method_id, drafter))
    printed = capsys.readouterr().out
    _assert_same(got, want)
    text = tok.decode(got[0, one["input_ids"].shape[1]:], skip_special_tokens=True)
    assert printed == printed_by_generate == text + "\n"


def _threaded(call):
    """Runs call() in a thread; returns (thread, result dict with 'out' or 'error')."""
    result = {}

    def target():
        try:
            result["out"] = call()
        except BaseException as error:  # noqa: BLE001  (the test checks it)
            result["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    return thread, result


@pytest.mark.parametrize("method_id", ["ar", "sd-self", "rsd-s"])
def test_text_iterator_streamer(llama, one, tok, drafter, method_id):
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True, timeout=60)
    thread, result = _threaded(lambda: hf(llama, one, do_sample=False, max_new_tokens=NEW, streamer=streamer,
                                          **_kwargs(method_id, drafter)))
    pieces = list(streamer)
    thread.join(60)
    assert "error" not in result, result.get("error")
    out = result["out"]
    _assert_same(out, plain(llama, one, do_sample=False, max_new_tokens=NEW))
    assert "".join(pieces) == tok.decode(out[0, one["input_ids"].shape[1]:], skip_special_tokens=True)


def test_streamer_needs_batch_of_one(llama, batch):
    streamer = Recorder()
    with pytest.raises(ValueError, match="streamer"):
        hf(llama, {"input_ids": batch["input_ids"][:2], "attention_mask": batch["attention_mask"][:2]},
           max_new_tokens=4, streamer=streamer)
    assert streamer.ends == 1


class Boom(StoppingCriteria):
    """Raises on its `after`-th call."""

    def __init__(self, after: int):
        self.after, self.calls = after, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls >= self.after:
            raise RuntimeError("boom")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("method_id", ["ar", "sd-self"])
def test_streamer_ended_on_error(llama, one, tok, drafter, method_id):
    streamer = Recorder()
    with pytest.raises(RuntimeError, match="boom"):
        hf(llama, one, max_new_tokens=NEW, streamer=streamer,
           stopping_criteria=StoppingCriteriaList([Boom(3)]), **_kwargs(method_id, drafter))
    assert streamer.ends == 1
    assert 1 <= len(streamer.new_tokens()) < NEW  # decoding had begun

    # A TextIteratorStreamer's reader is released too (it would wait for its timeout otherwise).
    text_streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=60)
    thread, result = _threaded(lambda: hf(llama, one, max_new_tokens=NEW, streamer=text_streamer,
                                          stopping_criteria=StoppingCriteriaList([Boom(3)]),
                                          **_kwargs(method_id, drafter)))
    list(text_streamer)
    thread.join(60)
    assert isinstance(result.get("error"), RuntimeError)


# ---- 5. stopping criteria ----

class Repeat(StoppingCriteria):
    """Stops a row when its last two tokens are equal."""

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == input_ids[:, -2]


@pytest.mark.parametrize("method_id", ["ar", "sd-self", "ngram-tree", "rsd-c"])
def test_custom_stopping_criteria(llama, batch, drafter, method_id):
    criteria = StoppingCriteriaList([Repeat()])
    want = plain(llama, batch, do_sample=False, max_new_tokens=NEW, stopping_criteria=criteria)
    got = hf(llama, batch, do_sample=False, max_new_tokens=NEW, stopping_criteria=criteria,
             **_kwargs(method_id, drafter))
    _assert_same(got, want)
    width = batch["input_ids"].shape[1]
    assert (got[:, width + 2:] == PAD_ID).any()  # some row stopped early and was padded


def _ascii_window(tok, tokens: list[int], size: int = 2) -> str:
    """The text of the first `size` consecutive tokens (from the third) that decode to printable ASCII."""
    for at in range(2, len(tokens) - size):
        text = tok.decode(tokens[at:at + size])
        if text.isascii() and text.isprintable() and len(text) == size:
            return text
    raise AssertionError(f"no printable window in {tokens}")


@pytest.mark.parametrize("method_id", ["ar", "sd-self"])
def test_stop_string_criteria(llama, batch, tok, drafter, method_id):
    width = batch["input_ids"].shape[1]
    free = plain(llama, batch, do_sample=False, max_new_tokens=NEW)[:, width:].tolist()
    stop = _ascii_window(tok, free[0])
    criteria = StoppingCriteriaList([StopStringCriteria(tok, [stop])])
    want = plain(llama, batch, do_sample=False, max_new_tokens=NEW, stopping_criteria=criteria)
    got = hf(llama, batch, do_sample=False, max_new_tokens=NEW, stopping_criteria=criteria,
             **_kwargs(method_id, drafter))
    _assert_same(got, want, f"stop {stop!r}")
    assert got[0, -1] == PAD_ID  # row 0 stopped early, at the end of the stop string
    assert tok.decode(got[0, width:], skip_special_tokens=True).endswith(stop)


def test_stop_strings_keyword_raises(llama, batch, tok):
    """transformers drops tokenizer= for a custom_generate callable, so stop_strings= cannot work (the
    module docstring says to pass StopStringCriteria instead); whatever transformers raises, it raises."""
    with pytest.raises(ValueError, match="tokenizer"):
        hf(llama, batch, max_new_tokens=4, stop_strings=["ab"], tokenizer=tok)


@pytest.mark.parametrize("how", ["criterion", "keyword"])
def test_max_time(llama, batch, drafter, how):
    width = batch["input_ids"].shape[1]
    criteria = StoppingCriteriaList([MaxTimeCriteria(max_time=0.0)])
    kwargs = {"stopping_criteria": criteria} if how == "criterion" else {"max_time": 0.0}
    got = hf(llama, batch, do_sample=False, max_new_tokens=NEW, **_kwargs("sd-self", drafter), **kwargs)
    assert width < got.shape[1] < width + NEW
    assert torch.equal(got[:, :width], batch["input_ids"])


# ---- 6. return_dict_in_generate ----

def test_return_dict(llama, batch):
    tensor = hf(llama, batch, do_sample=False, max_new_tokens=NEW, method="sd", draft_model="self:1")
    out = hf(llama, batch, do_sample=False, max_new_tokens=NEW, method="sd", draft_model="self:1",
             return_dict_in_generate=True)
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, tensor)
    assert torch.equal(out.sequences, plain(llama, batch, do_sample=False, max_new_tokens=NEW))


# ---- 7. sampling ----

SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.95, "max_new_tokens": 10}


@pytest.mark.parametrize("method_id", ["ar", "sd-self", "rsd-s"])
def test_sampling_reproducible(llama, batch, drafter, method_id):
    kwargs = {**_kwargs(method_id, drafter), **SAMPLING}
    first = hf(llama, batch, seed=5, **kwargs)
    assert torch.equal(first, hf(llama, batch, seed=5, **kwargs))
    assert not torch.equal(first, hf(llama, batch, seed=6, **kwargs))
    torch.manual_seed(3)
    drawn = hf(llama, batch, **kwargs)  # seed=None: drawn from torch's generator
    torch.manual_seed(3)
    assert torch.equal(drawn, hf(llama, batch, **kwargs))
    torch.manual_seed(4)
    assert not torch.equal(drawn, hf(llama, batch, **kwargs))
    assert not torch.equal(first, plain(llama, batch, do_sample=False, max_new_tokens=10))


@pytest.mark.parametrize("method", ["tli", "union", "slrs"])
def test_hetero_sampling_reproducible(hetero, method):
    model, target_tok, draft, draft_tok = hetero["byte"]
    inputs = dict(target_tok(PROMPTS, return_tensors="pt", padding=True))
    kwargs = dict(draft_model=draft, draft_tokenizer=draft_tok, target_tokenizer=target_tok, method=method,
                  num_draft_tokens=2, **SAMPLING)
    first = hf(model, inputs, seed=1, **kwargs)
    assert torch.equal(first, hf(model, inputs, seed=1, **kwargs))
    assert not torch.equal(first, hf(model, inputs, seed=2, **kwargs))


# A model over 8 tokens and no EOS: every sequence runs to its length, and the exact distribution of its
# first tokens is a product of 1 + 8 + 64 softmaxes.
SMALL_VOCAB = 8
STAT_PROMPT = [2, 5, 3, 7]
N_SAMPLES = 20_000
ALPHA = 1e-3
MIN_EXPECTED = 5  # sequences expected fewer times share one chi-square cell


@pytest.fixture(scope="module")
def small():
    model = ARCHITECTURES["llama"](vocab=SMALL_VOCAB, seed=3)
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    return model


def _warped(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Sampling probabilities after transformers' warpers, in the order generate() applies them."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    dummy = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    return torch.softmax(warpers(dummy, logits.clone()).double(), -1)


def _exact(model, length: int, temperature: float, top_k: int, top_p: float) -> dict[tuple, float]:
    """Probability of every `length`-token continuation of STAT_PROMPT under the warped model."""
    out = {(): 1.0}
    for _ in range(length):
        seqs = list(out)
        ids = torch.tensor([STAT_PROMPT + list(s) for s in seqs])
        with torch.no_grad():
            probs = _warped(model(ids).logits[:, -1].float(), temperature, top_k, top_p)
        out = {s + (t,): out[s] * float(probs[i, t]) for i, s in enumerate(seqs) for t in range(SMALL_VOCAB)}
    return out


def _pvalue(samples: list[tuple], exact: dict[tuple, float]) -> tuple[float, int]:
    """(chi-square p-value, number of samples of probability 0)."""
    counts = collections.Counter(samples)
    impossible = sum(n for seq, n in counts.items() if exact.get(seq, 0.0) == 0.0)
    n = len(samples)
    cells = sorted((seq for seq, p in exact.items() if p > 0), key=exact.get)
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for seq in cells:
        if exact[seq] * n < MIN_EXPECTED:
            rest_o, rest_e = rest_o + counts[seq], rest_e + exact[seq] * n
        else:
            observed.append(counts[seq])
            expected.append(exact[seq] * n)
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    scale = sum(observed) / sum(expected)  # impossible samples are counted apart
    return float(scipy_stats.chisquare(observed, [e * scale for e in expected]).pvalue), impossible


# (id, generate keywords, new tokens, temperature, top_k, top_p)
STAT_CASES = [
    ("ar-T0.5", {"method": "ar"}, 1, 0.5, 0, 1.0),
    ("ar-warped", {"method": "ar"}, 3, 0.7, 5, 0.9),
    ("sd-warped", {"method": "sd", "draft_model": "self:1", "num_draft_tokens": 1}, 3, 0.7, 5, 0.9),
    ("rsd-c-T1", {"method": "rsd-c", "draft_model": "self:1", "num_draft_tokens": (2,)}, 3, 1.0, 0, 1.0),
    ("specinfer-topk", {"method": "specinfer", "draft_model": "self:1", "num_draft_tokens": (2,)},
     3, 1.0, 4, 1.0),
]
_samples: dict = {}


def _sample(model, case_id: str, use_specops: bool = True) -> tuple[list[tuple], Stats]:
    key = (case_id, use_specops)
    if key not in _samples:
        _, kwargs, new, temperature, top_k, top_p = next(c for c in STAT_CASES if c[0] == case_id)
        ids = torch.tensor([STAT_PROMPT]).repeat(N_SAMPLES, 1)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                    "max_new_tokens": new}
        stats = Stats()
        if use_specops:
            out = hf(model, inputs, seed=11, stats=stats, **kwargs, **sampling)
        else:
            with torch.random.fork_rng():
                torch.manual_seed(11)
                out = plain(model, inputs, **sampling)
        assert out.shape == (N_SAMPLES, len(STAT_PROMPT) + new)
        _samples[key] = ([tuple(row) for row in out[:, len(STAT_PROMPT):].tolist()], stats)
    return _samples[key]


@pytest.mark.slow
@pytest.mark.parametrize("case", STAT_CASES, ids=[c[0] for c in STAT_CASES])
def test_sampled_distribution(small, case):
    case_id, kwargs, new, temperature, top_k, top_p = case
    exact = _exact(small, new, temperature, top_k, top_p)
    samples, stats = _sample(small, case_id)
    pvalue, impossible = _pvalue(samples, exact)
    assert impossible == 0, f"{impossible} samples of probability 0 (outside top-k / top-p)"
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e}"
    if kwargs["method"] != "ar":
        assert 0 < stats.accepted < stats.drafted  # drafts were verified, some rejected


@pytest.mark.slow
def test_sampled_distribution_check_can_fail(small):
    """The same check rejects the right samples against a wrong temperature, and a wrong top-k; and
    transformers' own sampler passes it (the expected distribution is what its warpers define)."""
    samples, _ = _sample(small, "ar-T0.5")
    assert _pvalue(samples, _exact(small, 1, 0.5, 0, 1.0))[0] > ALPHA
    assert _pvalue(samples, _exact(small, 1, 1.0, 0, 1.0))[0] < ALPHA
    warped, _ = _sample(small, "sd-warped")
    pvalue, impossible = _pvalue(warped, _exact(small, 3, 0.7, 0, 0.9))  # top_k 5 left out
    assert pvalue < ALPHA or impossible > 0
    pvalue, impossible = _pvalue(warped, _exact(small, 3, 1.0, 5, 0.9))  # temperature 1
    assert pvalue < ALPHA or impossible > 0
    reference, _ = _sample(small, "ar-warped", use_specops=False)
    pvalue, impossible = _pvalue(reference, _exact(small, 3, 0.7, 5, 0.9))
    assert impossible == 0 and pvalue > ALPHA, "transformers' own samples do not fit the warped distribution"


# ---- 8. num_return_sequences ----

@pytest.mark.parametrize("method_id", ["ar", "sd-self"])
def test_num_return_sequences(llama, batch, drafter, method_id):
    width = batch["input_ids"].shape[1]
    kwargs = dict(do_sample=True, num_return_sequences=3, max_new_tokens=8, **_kwargs(method_id, drafter))
    out = hf(llama, batch, seed=0, **kwargs)
    assert out.shape == (3 * len(PROMPTS), width + 8)
    assert out.shape == plain(llama, batch, do_sample=True, num_return_sequences=3, max_new_tokens=8).shape
    for p in range(len(PROMPTS)):
        group = out[3 * p:3 * p + 3]
        assert all(torch.equal(row[:width], batch["input_ids"][p]) for row in group)
        samples = {tuple(row[width:].tolist()) for row in group}
        assert len(samples) == 3, f"prompt {p}: the 3 samples are not all different: {samples}"
    assert torch.equal(out, hf(llama, batch, seed=0, **kwargs))


# ---- 9. refusals ----

class Identity(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores


REFUSALS = {
    "num_beams": ({"num_beams": 2}, "num_beams=2"),
    "num_beams-sample": ({"num_beams": 2, "do_sample": True}, "num_beams=2"),
    "repetition_penalty": ({"repetition_penalty": 1.2}, "repetition_penalty"),
    "no_repeat_ngram_size": ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size"),
    "min_new_tokens": ({"min_new_tokens": 2}, "min_new_tokens"),
    "min_length": ({"min_length": 20}, "min_length"),
    "bad_words_ids": ({"bad_words_ids": [[5]]}, "bad_words_ids"),
    "sequence_bias": ({"sequence_bias": {(5,): -1.0}}, "sequence_bias"),
    "suppress_tokens": ({"suppress_tokens": [5]}, "suppress_tokens"),
    "guidance_scale": ({"guidance_scale": 1.5}, "guidance_scale"),
    "output_scores": ({"output_scores": True, "return_dict_in_generate": True}, "output_scores"),
    "output_logits": ({"output_logits": True, "return_dict_in_generate": True}, "output_logits"),
    "output_attentions": ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
    "output_hidden_states": ({"output_hidden_states": True, "return_dict_in_generate": True},
                             "output_hidden_states"),
    "min_p": ({"do_sample": True, "min_p": 0.1}, "min_p"),
    "typical_p": ({"do_sample": True, "typical_p": 0.5}, "typical_p"),
    "epsilon_cutoff": ({"do_sample": True, "epsilon_cutoff": 0.01}, "epsilon_cutoff"),
    "prompt_lookup_num_tokens": ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens=3"),
    "penalty_alpha": ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha"),
    "dola_layers": ({"dola_layers": "low"}, "dola_layers"),
    "logits_processor": ({"logits_processor": LogitsProcessorList([Identity()])},
                         "logits processor Identity"),
    "assistant_model": ({"assistant_model": "drafter"}, "assistant_model="),
    "unknown method": ({"method": "nonsense"}, "unknown method 'nonsense'"),
    "embedded drafter": ({"draft_model": "smollm2-135m"}, "target_tokenizer"),
    "bad num_draft_tokens": ({"method": "rsd-c", "draft_model": "self:1", "num_draft_tokens": 3},
                             "num_draft_tokens"),
    "bad option": ({"method": "ar", "options": {"tables": "none"}}, "unknown option 'tables'"),
    "bad self drafter": ({"draft_model": "self:x"}, "self:N"),
    "method without drafter": ({"method": "sd"}, "needs a drafter"),
    "drafter of other width": ({"method": "sd", "draft_model": "other", "num_draft_tokens": 2}, "LM head"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals(llama, batch, drafter, hetero, case):
    kwargs, match = REFUSALS[case]
    kwargs = dict(kwargs)
    if kwargs.get("assistant_model") == "drafter":
        kwargs["assistant_model"] = drafter
    if kwargs.get("draft_model") == "other":
        kwargs["draft_model"] = hetero["byte"][2]  # over the merged vocabulary, without its tokenizer
    # The probes of a model's cached decoding run once per model, before its first decode, and decide what
    # it may be refused for: done here, so that what is checked does not depend on which test ran first.
    hf(llama, batch, max_new_tokens=1)
    calls = []
    hook = llama.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            hf(llama, batch, max_new_tokens=4, **kwargs)
    finally:
        hook.remove()
    assert not calls, "the model ran a forward before the refusal"


def test_right_padding_refused(llama, batch):
    mask = batch["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="left-padded"):
        hf(llama, {"input_ids": batch["input_ids"], "attention_mask": mask}, max_new_tokens=4)


def test_inputs_embeds_refused(llama, batch):
    embeds = llama.get_input_embeddings()(batch["input_ids"]).detach()
    with pytest.raises(ValueError, match="inputs_embeds"):
        llama.generate(inputs_embeds=embeds, attention_mask=batch["attention_mask"], max_new_tokens=4,
                       custom_generate=specops.hf.generate)


def test_prefilled_cache_refused(llama, batch):
    name = cache_argument(llama)  # "cache" from transformers 5.24, "past_key_values" before
    cache = DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(input_ids=batch["input_ids"][:, :3], attention_mask=batch["attention_mask"][:, :3],
              **{name: cache})
    with pytest.raises(ValueError, match=f"prefilled KV cache \\({name}=\\)"):
        hf(llama, batch, max_new_tokens=4, **{name: cache})


def test_encoder_decoder_refused(batch):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=BYTE_VOCAB, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16,
                      decoder_start_token_id=0)
    t5 = T5ForConditionalGeneration(config).eval()
    with pytest.raises(ValueError, match="encoder-decoder"):
        hf(t5, batch, max_new_tokens=3)


def test_direct_call_refused(llama, batch):
    with pytest.raises(TypeError, match="custom_generate"):
        specops.hf.generate(llama, batch["input_ids"])


def test_stats_must_be_stats(llama, batch):
    with pytest.raises(TypeError, match="stats"):
        hf(llama, batch, max_new_tokens=4, stats={})


# ---- 10. stats ----

def test_stats_filled(llama, batch):
    stats = Stats()
    out = hf(llama, batch, do_sample=False, max_new_tokens=NEW, method="sd", draft_model="self:1",
             num_draft_tokens=3, stats=stats)
    assert stats.method == "sd"
    assert stats.requests == len(PROMPTS)
    assert stats.new_tokens == out[:, batch["input_ids"].shape[1]:].numel() == NEW * len(PROMPTS)
    # The counts add up: one target forward for the prompts and one per step; every time the target reads a
    # request it gives that request one token, besides the drafts it accepts; `self:1` makes one forward per
    # draft token of a step, and a step drafts at most num_draft_tokens.
    assert stats.target_calls == stats.steps + 1
    assert stats.new_tokens == stats.accepted + stats.request_steps
    assert len(stats.draft_lengths) == stats.steps and max(stats.draft_lengths) == 3
    assert stats.drafter_calls == sum(stats.draft_lengths)
    assert 0 < stats.accepted <= stats.drafted <= 3 * (stats.request_steps - stats.requests)
    assert 0 < stats.prefill_seconds + stats.draft_seconds + stats.verify_seconds <= stats.seconds


# ---- bugs found while writing these tests, fixed ----

def test_synced_gpus_refused(llama, batch):
    with pytest.raises(ValueError, match="synced_gpus"):
        hf(llama, batch, max_new_tokens=4, synced_gpus=True)


@pytest.mark.parametrize("drafter_id", ["self", "model"])
@pytest.mark.parametrize("method", ["tli", "slem"])
def test_crossing_method_same_vocabulary_without_tokenizer(llama, batch, drafter, method, drafter_id):
    """The module docstring: the target's tokenizer is needed only for a drafter with another vocabulary.
    Either it decodes (equal to generate) or it raises a ValueError asking for target_tokenizer."""
    draft = "self:1" if drafter_id == "self" else drafter
    want = plain(llama, batch, do_sample=False, max_new_tokens=NEW)
    try:
        got = hf(llama, batch, do_sample=False, max_new_tokens=NEW, draft_model=draft, method=method)
    except ValueError as error:
        assert "target_tokenizer" in str(error)
    else:
        _assert_same(got, want)


def test_ensemble_member_without_tokenizer(zoo, batch, tok):
    model, member = zoo("llama"), zoo("qwen3", seed=2)
    try:
        got = hf(model, batch, do_sample=False, max_new_tokens=NEW, ensemble_models=[member],
                 target_tokenizer=tok, method="ensemble")
    except ValueError as error:
        assert "ensemble_tokenizers" in str(error)
    else:
        ref = specops.decode(PROMPTS, target=[model, member], tokenizer=[tok, tok], method="ensemble",
                             max_new_tokens=NEW)
        width = batch["input_ids"].shape[1]
        assert got[:, width:].tolist() == [row + [PAD_ID] * (NEW - len(row)) for row in ref.tokens]


# ---- memory= and num_return_sequences ----

def test_memory_greedy_equals_generate(llama, batch):
    """memory= through generate(): n-gram drafting from a memory that fills as it goes, the model's own greedy
    tokens in every call."""
    want = plain(llama, batch, max_new_tokens=NEW, do_sample=False)
    memory = specops.NgramMemory()
    for _ in range(2):
        _assert_same(hf(llama, batch, max_new_tokens=NEW, do_sample=False, memory=memory), want, "memory")
    assert memory.stats()["runs"] == 2 * len(PROMPTS)


@pytest.mark.parametrize("memory", [False, True])
def test_num_return_sequences_samples_each_prompt_once(llama, batch, tok, memory, monkeypatch):
    """generate() repeats each prompt num_return_sequences times; specops reads it once, forks its cache, and
    gives the samples decode(num_samples=) gives: the prompt list with each prompt repeated, row by row."""
    from specops.decoding.engine import KVState

    fed = []
    real = KVState.prefill
    monkeypatch.setattr(KVState, "prefill", lambda self, rows: fed.append(len(rows)) or real(self, rows))
    kwargs = dict(max_new_tokens=NEW, do_sample=True, temperature=1.0, top_k=0, num_return_sequences=3, seed=7)
    if memory:
        kwargs["memory"] = specops.NgramMemory()
    out = hf(llama, batch, **kwargs)
    # The probes run first (once per model); the decoding reads the prompts once, never their 3 * 3 copies.
    assert out.shape[0] == 3 * len(PROMPTS) and fed[-1] == len(PROMPTS) and 3 * len(PROMPTS) not in fed
    prompts = [tok.decode(row[row != PAD_ID]) for row in batch["input_ids"]]
    want = specops.decode(prompts, target=llama, tokenizer=tok, method="ar", max_new_tokens=NEW, temperature=1.0,
                          seed=7, num_samples=3)
    width = batch["input_ids"].shape[1]
    for row, tokens in enumerate(t for group in want.tokens for t in group):
        assert out[row, width:width + len(tokens)].tolist() == tokens
    assert not torch.equal(out[0], out[1])  # the samples of one prompt differ
