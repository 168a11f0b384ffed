"""N-grams derived from a model's own weights (paper 001, section 4.1): learning-free drafts that need
no data and no drafter.

- Unigram: tokens ranked by d(x) = ||u_x - mean(u)||_C, the distance of a token's output embedding to
  the mean output embedding under the covariance C = V^T V / |V| of the input embeddings. The paper
  prints p(x) ~ e^-d(x), but its appendix code ranks the other way round, and so do the weights: on
  Gemma-3 the tokens nearest the mean are rare, barely trained ones, the farthest are " ", ",", "\n".
  So the most likely tokens here are the farthest.
- Bigram: for every token x, the top-k next tokens of p_M(. | x) (after BOS when the tokenizer adds
  one), computed once by batched forwards over the whole vocabulary and cached on disk. Only the top-k
  ids are kept: a full V x V table is impossible at V = 262,144.
- Extended bigram (w > 1 tokens): continue a bigram draft by chaining the bigram's top-1 (section 4.1,
  Extensions); a lookup per token, no extra table.

The tables only choose which drafts to propose; verification decides what is emitted, so ranks computed
in bfloat16 (faster on CPUs with AVX512-BF16) never change an output.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import weakref
from pathlib import Path

import torch

from specops._kept import per_object
from specops._files import cache_root, write_atomically
from specops.decoding.hf_compat import cache_argument

__all__ = ["unigram", "bigram", "bigram_successors", "bigram_ready", "folder_bigram", "successors", "extend",
           "cache_dir"]


# Tables already computed or loaded in this process, per model object.
_IN_MEMORY: "weakref.WeakKeyDictionary[object, dict]" = per_object(
    "n-gram tables", "the model's bigram and unigram tables, loaded or computed, the bigram's successors, and "
    "the name of the bigram's file")


def _versioned(model, key) -> tuple:
    """key, extended with the version counters of the model's weights (they move with every in-place
    update; inference tensors keep none, and can only change inside inference mode)."""
    return (*key, *(-1 if w.is_inference() else w._version for w in model.parameters()))


def _in_memory(model, key) -> bool:
    """Whether _remembered(model, key, ...) holds a table for the weights as they are now."""
    try:
        return _versioned(model, key) in _IN_MEMORY.get(model, {})
    except TypeError:
        return False


def _remembered(model, key, compute):
    """compute(), once per model and key while its weights are unchanged."""
    key = _versioned(model, key)
    try:
        tables = _IN_MEMORY.setdefault(model, {})
    except TypeError:  # not weak-referenceable
        return compute()
    if key not in tables:
        tables[key] = compute()
    return tables[key]


def cache_dir() -> Path:
    return cache_root() / "ngrams"


def unigram(model, top: int = 64) -> torch.Tensor:
    """The `top` most likely tokens of the model-derived unigram, most likely first ([top] int64)."""
    return _remembered(model, ("unigram", top), lambda: _compute_unigram(model, top))


def _compute_unigram(model, top: int) -> torch.Tensor:
    inputs = model.get_input_embeddings().weight.detach().float()
    outputs = model.get_output_embeddings().weight.detach().float()
    covariance = inputs.T @ inputs / inputs.shape[0]
    centered = outputs - outputs.mean(0, keepdim=True)
    distance = ((centered @ covariance) * centered).sum(-1)  # squared C-norm: same order as the norm
    return torch.topk(distance, min(top, distance.shape[0])).indices


# Config entries that record how a model was loaded (the transformers version a config is written out with;
# its folder, where a config keeps it), not what it computes: a key holding the version made every
# environment build its own table (10 minutes for gemma-3-270m on two cores).
_NOT_THE_MODEL = ("transformers_version", "_name_or_path", "_commit_hash", "_attn_implementation",
                  "_attn_implementation_internal", "_attn_implementation_autoset", "_experts_implementation")


def _config_text(config) -> str:
    """The model's config as text: what differs from its class's defaults (so that a newer transformers adding
    an entry with its default changes nothing), without the entries in _NOT_THE_MODEL, sub-configs too."""
    read = getattr(config, "to_diff_dict", None) or getattr(config, "to_dict", None)
    if read is None:
        return repr(config)

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in _NOT_THE_MODEL}
        if isinstance(value, (list, tuple)):
            return [strip(v) for v in value]
        return value

    return json.dumps(strip(read()), sort_keys=True, default=repr)


def _fingerprint(model, bos: int | None, top: int) -> str:
    """A key that changes when the weights, the architecture or the table settings do."""
    digest = hashlib.sha256()
    digest.update(f"{type(model).__name__}|{_config_text(getattr(model, 'config', None))}|bos={bos}|top={top}"
                  "|v2".encode())
    for name, weight in model.named_parameters():
        flat = weight.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 4096)].float().cpu()
        digest.update(f"{name}{tuple(weight.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:24]


def _bos_of(tokenizer) -> int | None:
    """The BOS id the tokenizer puts before every prompt, or None if it adds none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return int(bos) if ids and ids[0] == bos else None


class _Progress:
    """tqdm when installed, else a line on stderr every ~10 s."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.bar = None
        self.enabled = enabled
        self.total, self.done, self.desc = total, 0, desc
        self.start = self.last = time.perf_counter()
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="tok", file=sys.stderr)
            except ImportError:
                pass

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and time.perf_counter() - self.last > 10:
            self.last = time.perf_counter()
            rate = self.done / (self.last - self.start)
            print(f"{self.desc}: {self.done}/{self.total} tokens, {(self.total - self.done) / rate:.0f} s left",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_SAVE_EVERY = 120.0  # seconds between checkpoints of a table being built


def _compute_bigram(model, bos: int | None, top: int, chunk: int, progress: bool,
                    checkpoint: Path | None = None) -> torch.Tensor:
    """The table, one batched forward per chunk. With `checkpoint`, the rows done so far are saved there
    every couple of minutes and a later call resumes from them (a CPU build takes a while)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    vocab = int(model.get_output_embeddings().weight.shape[0])
    table = torch.empty(vocab, top, dtype=torch.int32)
    done = 0
    if checkpoint is not None and checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=True)
        if saved["table"].shape == table.shape:
            table, done = saved["table"], int(saved["done"])
    saved_at = time.perf_counter()
    # fp32 models rank in bfloat16 on CPU: ~2x faster with AVX512-BF16, and ranks need no more precision.
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if (
        device.type == "cpu" and next(model.parameters()).dtype == torch.float32) else torch.autocast(
        device.type, enabled=False)
    bar = _Progress(vocab, "specops: model bigram", progress)
    bar.update(done)
    with torch.inference_mode(), autocast:
        bos_kv = None
        if bos is not None:  # run BOS once and share its keys and values with every chunk
            cache = DynamicCache()
            model(input_ids=torch.tensor([[bos]], device=device), use_cache=True, logits_to_keep=1,
                  **{cache_argument(model): cache})
            bos_kv = [(layer.keys, layer.values) for layer in cache.layers]
        for start in range(done, vocab, chunk):
            ids = torch.arange(start, min(start + chunk, vocab), device=device).unsqueeze(1)
            rows = ids.shape[0]
            kwargs = {"use_cache": False}
            if bos_kv is not None:
                cache = DynamicCache()
                for layer, (keys, values) in enumerate(bos_kv):
                    cache.update(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1), layer)
                kwargs = {"use_cache": True, cache_argument(model): cache,
                          "position_ids": torch.ones_like(ids),
                          "cache_position": torch.ones(1, dtype=torch.long, device=device)}
            logits = model(input_ids=ids, logits_to_keep=1, **kwargs).logits[:, -1]
            table[start:start + rows] = torch.topk(logits.float(), top, dim=-1).indices.to(torch.int32).cpu()
            bar.update(rows)
            if checkpoint is not None and time.perf_counter() - saved_at > _SAVE_EVERY:
                _save({"table": table, "done": start + rows}, checkpoint)
                saved_at = time.perf_counter()
    bar.close()
    return table


def prompts_bos(model, rows: list[list[int]]) -> int | None:
    """The model's BOS id when every prompt (token ids) starts with it, else None: what `_bos_of` says of
    the tokenizer that encoded them, for prompts that come without one."""
    bos = getattr(model.generation_config, "bos_token_id", None)
    bos = getattr(model.config, "bos_token_id", None) if bos is None else bos
    if isinstance(bos, (list, tuple)):
        bos = bos[0] if bos else None
    return int(bos) if bos is not None and rows and all(row and row[0] == bos for row in rows) else None


# Rough forward throughput for estimating a bigram build (2 x parameters FLOPs per vocabulary token).
_BUILD_FLOPS = {"cpu": 5e10, "cuda": 1e13}
BUILD_BUDGET_S = 60.0  # "auto" tables build a bigram estimated to take at most this long


def bigram_ready(model, tokenizer, top: int = 8, *, bos: int | None = None) -> bool:
    """Whether `bigram` with these arguments returns soon: its table is cached on disk, or building it is
    estimated to take under BUILD_BUDGET_S (V forwards' worth of tokens: seconds on a GPU, 7 to 25 minutes
    for Gemma-3-270M on two CPU cores)."""
    top, bos = _settings(model, tokenizer, top, bos)
    if _in_memory(model, ("bigram", top, bos, True)) or _table_path(model, bos, top).exists():
        return True  # (hashing the weights for the file name takes ~15 ms on Gemma-3-270M: asked second)
    device = next(model.parameters()).device.type
    vocab = int(model.get_output_embeddings().weight.shape[0])
    flops = 2.0 * vocab * sum(p.numel() for p in model.parameters())
    return flops / _BUILD_FLOPS.get(device, _BUILD_FLOPS["cpu"]) <= BUILD_BUDGET_S


def bigram(model, tokenizer, top: int = 8, chunk: int = 512, progress: bool = True,
           cache: bool = True, *, bos: int | None = None) -> torch.Tensor:
    """[V, top] int32: row x holds the `top` most likely tokens after x under the model, most likely
    first. Computed once per model (one batched forward per `chunk` tokens, with a progress bar) and
    cached under $SPECOPS_CACHE/ngrams (default ~/.cache/specops/ngrams); later calls load the file.
    The rows are scored after the BOS the tokenizer puts before prompts; with tokenizer None, after `bos`
    (None: no BOS)."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"bigram: top must be an int >= 1, got {top!r}")
    top, bos = _settings(model, tokenizer, top, bos)
    return _remembered(model, ("bigram", top, bos, cache), lambda: _load_or_build(model, bos, top, chunk, progress, cache))


def bigram_successors(model, tokenizer, depth: int, top: int = 8, *, bos: int | None = None) -> torch.Tensor:
    """successors(bigram(model, tokenizer, top, bos=bos), depth), computed once per model and settings: each
    decode call would otherwise redo it (25 ms at depth 15 for Gemma-3's 262,144 words on a 2-vCPU Xeon:
    its gathers read the vocabulary in random order)."""
    table = bigram(model, tokenizer, top=top, bos=bos)
    top, bos = _settings(model, tokenizer, top, bos)
    return _remembered(model, ("successors", top, bos, depth), lambda: successors(table, depth))


# "auto" loads a model folder to look for (or quickly build) its table only up to this many bytes of weights.
_FOLDER_LOAD_LIMIT = 2 << 30


def folder_bigram(folder, top: int = 8, *, tables: str = "auto", progress: bool = True) -> torch.Tensor | None:
    """`bigram` of the transformers causal LM saved in `folder` (its tokenizer beside it), for callers that
    hold no model object (specops.vllm). A table found or built once is remembered under the folder's files
    (names, sizes, times), so later calls load it without loading the model.

    tables "bigram": the table, built now if needed (the model is loaded on the CPU for it); "auto": the
    table when it is remembered, or when the folder's weights are at most 2 GiB and `bigram_ready` says it
    is cached under the model's fingerprint or quick to build, else None; "none": None."""
    if tables not in ("auto", "bigram", "none"):
        raise ValueError(f"folder_bigram: tables must be auto, bigram or none, got {tables!r}")
    folder = Path(folder).expanduser().resolve()
    if tables == "none":
        return None
    if not (folder / "config.json").is_file():
        if tables == "bigram":
            raise ValueError(f"folder_bigram: {str(folder)!r} is not a transformers model folder (no config.json)")
        return None
    files = sorted(f for f in folder.iterdir() if f.is_file())
    digest = hashlib.sha256(f"{folder}|top={top}|v1".encode())
    for f in files:
        stat = f.stat()
        digest.update(f"|{f.name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    alias = cache_dir() / f"folder-{digest.hexdigest()[:24]}.pt"
    if alias.exists():
        return torch.load(alias, weights_only=True)
    weights = sum(f.stat().st_size for f in files if f.suffix in (".safetensors", ".bin", ".pt", ".gguf"))
    if tables == "auto" and weights > _FOLDER_LOAD_LIMIT:
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tables == "auto" and not bigram_ready(model, tokenizer, top):
        return None
    table = bigram(model, tokenizer, top=top, progress=progress)
    alias.parent.mkdir(parents=True, exist_ok=True)
    _save(table, alias)
    return table


def _settings(model, tokenizer, top: int, bos: int | None) -> tuple[int, int | None]:
    """The table's (top, bos): top at most the vocabulary; the tokenizer's BOS, or `bos` without one."""
    top = min(top, int(model.get_output_embeddings().weight.shape[0]))
    return top, (_bos_of(tokenizer) if tokenizer is not None else bos)


def _table_path(model, bos: int | None, top: int) -> Path:
    """The table's file. Its name hashes a sample of every weight: 8 ms for Gemma-3-270M on a 2-vCPU AMD EPYC,
    paid by every `ngram` call that asks whether the table is cached (it is not, on a CPU that never built
    it), so the name is kept per model object while its weights and configuration are unchanged."""
    key = ("fingerprint", bos, top, _config_text(getattr(model, "config", None)))
    return cache_dir() / f"bigram-{_remembered(model, key, lambda: _fingerprint(model, bos, top))}.pt"


def _load_or_build(model, bos: int | None, top: int, chunk: int, progress: bool, cache: bool) -> torch.Tensor:
    path = _table_path(model, bos, top)
    if cache and path.exists():
        return torch.load(path, weights_only=True)
    checkpoint = path.with_suffix(".checkpoint") if cache else None
    if checkpoint is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    table = _compute_bigram(model, bos, top, chunk, progress, checkpoint)
    if cache:
        _save(table, path)
        checkpoint.unlink(missing_ok=True)
        with open(path.with_suffix(".json"), "w") as f:
            json.dump({"model": getattr(model.config, "_name_or_path", type(model).__name__), "top": top,
                       "bos": bos, "vocab": table.shape[0]}, f)
    return table


def _save(obj, path: Path) -> None:
    write_atomically(path, lambda temporary: torch.save(obj, temporary))


def successors(table: torch.Tensor, depth: int) -> torch.Tensor:
    """[V, depth] int64: column d holds each token's top-1 successor under the bigram `table` [V, top],
    d + 1 times over (the extended bigram's continuation, looked up in one gather per draft)."""
    top1 = table[:, 0].long()
    out = torch.empty(top1.shape[0], depth, dtype=torch.int64, device=top1.device)
    current = top1
    for d in range(depth):
        out[:, d] = current
        current = top1[current]
    return out


def extend(first: torch.Tensor, follow: torch.Tensor) -> torch.Tensor:
    """Extended bigram: drafts [..., width] that start with `first` [...] (int64) and continue with the
    bigram's top-1 after each token, from follow = successors(table, width - 1) (-1 stays -1)."""
    rest = follow[first.clamp(min=0)].masked_fill((first < 0)[..., None], -1)
    return torch.cat([first[..., None].long(), rest], dim=-1)
