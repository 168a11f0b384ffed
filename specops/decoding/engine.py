"""The engine every decoding method shares: model adapter, KV caches with ragged rollback, batching,
stopping, streaming and statistics. A method module only says how to propose and how to verify.

Ragged batches: each model keeps one KV cache for the whole batch. Prompts are left-padded; when rows
accept different numbers of drafts, the rejected positions stay in the cache as holes, masked out by
the attention mask, and position ids count only valid tokens, so every row computes exactly what it
would alone. Positions that are invalid for every row are cropped from the cache. Models with
sliding-window layers get masks built here from position ids (a window counts tokens, not cache
slots, so holes must not count) over a cache that keeps every slot.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from specops import ops

__all__ = ["CausalLM", "KVState", "Batch", "Stats", "SamplingParams"]


_CPU_FORWARD_OK: "weakref.WeakKeyDictionary[object, bool]" = weakref.WeakKeyDictionary()
_STATIONARY_ROWS = 8  # beyond this many rows F.linear's GEMM is as fast


def _stationary(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """rows [n, d] @ weight[out, d]^T computed as weight @ rows^T, which streams the weight once.

    For a few rows, the BLAS path F.linear takes reads the weight about once per row on our CPUs (MKL on
    AMD EPYC: Gemma-3-270M's 262,144 x 640 output head takes 57 ms for 1 row, 126 ms for 2, 105 ms for
    4), while weight @ rows^T streams it once (23 ms for 2 rows, 26 ms for 4). One row is padded to two
    so that it does not fall to GEMV, which is as slow. Rows must be row-major: with a transposed layout
    (attention outputs of several tokens come that way) the same product is about 6x slower."""
    n = rows.shape[0]
    rows = torch.cat([rows, rows]) if n == 1 else rows.contiguous()
    return (weight @ rows.T).T[:n]


def _linear_forward(module: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > _STATIONARY_ROWS:
            return torch.nn.functional.linear(x, module.weight, module.bias)
        out = _stationary(module.weight, rows)
        if module.bias is not None:
            out = out + module.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


class _CpuForward:
    """Forwards of a CPU float32 model with every linear layer weight-stationary (`_stationary`).

    Decoding feeds 1 to a few tokens per forward, exactly where F.linear is slowest on our CPUs, and
    verification feeds several: this decides whether speculation can pay on a CPU, and plain decoding
    gets the same forwards. The model's own modules are routed for the duration of a call only, and the
    output projection is applied here (then the final soft-cap, if the model has one). Used only after a
    probe shows the result reproduces the model's own logits."""

    def __init__(self, model):
        self.base = model.get_decoder()
        self.weight = model.get_output_embeddings().weight
        config = getattr(model.config, "get_text_config", lambda: model.config)()
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.linears = [m for m in self.base.modules() if type(m) is torch.nn.Linear]

    def __call__(self, keep: int, **kwargs) -> torch.Tensor:
        """Logits [B, keep, V] of the last `keep` inputs of base(**kwargs)."""
        saved = [module.__dict__.get("forward") for module in self.linears]
        for module in self.linears:
            module.forward = _linear_forward(module)
        try:
            hidden = self.base(**kwargs).last_hidden_state[:, -keep:]
        finally:
            for module, forward in zip(self.linears, saved):
                if forward is None:
                    del module.forward
                else:
                    module.forward = forward
        batch, n, dim = hidden.shape
        logits = _stationary(self.weight, hidden.reshape(batch * n, dim)).reshape(batch, n, -1)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    @staticmethod
    def usable(model) -> bool:
        """Whether `model` is a CPU float32 causal LM whose logits this path reproduces (probed once)."""
        head = model.get_output_embeddings()
        if not (isinstance(head, torch.nn.Linear) and head.weight.device.type == "cpu"
                and head.weight.dtype == torch.float32):  # checked on every call: a model may move
            return False
        known = _CPU_FORWARD_OK.get(model)
        if known is not None:
            return known
        ok = False
        try:
            if head.bias is None and hasattr(model, "get_decoder"):
                ids = torch.arange(3).unsqueeze(0) % head.weight.shape[0]
                with torch.inference_mode():
                    want = model(input_ids=ids, use_cache=False).logits
                    got = _CpuForward(model)(3, input_ids=ids, use_cache=False)
                # Summation order differs (about 1e-5 of the logit scale after 18 layers); a missing
                # scale or soft-cap would differ by percents.
                ok = want.shape == got.shape and bool((want - got).abs().max() <= 1e-3 * want.abs().max())
        except Exception:  # any model that does not fit the pattern keeps its own forward
            ok = False
        try:
            _CPU_FORWARD_OK[model] = ok
        except TypeError:
            pass
        return ok


class CausalLM:
    """Adapter for a transformers causal LM: KV-cached forwards returning float32 logits."""

    def __init__(self, model, name: str = "model"):
        if not hasattr(model, "forward") or not hasattr(model, "config"):
            raise TypeError(f"{name} must be a transformers causal LM, got {type(model).__name__}")
        self.model = model.eval()
        self.name = name
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.device = next(model.parameters()).device
        config = getattr(model.config, "get_text_config", lambda: model.config)()
        self.layer_types = sorted(set(getattr(config, "layer_types", None) or []))
        window = getattr(config, "sliding_window", None)
        self.window = window if window and "sliding_attention" in self.layer_types else None
        self.eager = getattr(config, "_attn_implementation", None) == "eager"
        self.cpu_forward = _CpuForward(model) if _CpuForward.usable(model) else None
        self.calls = 0
        self.seconds = 0.0

    def new_cache(self):
        from transformers import DynamicCache

        if self.window is not None:
            return DynamicCache()  # keeps every slot: the masks below do the windowing
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers: no config argument
            return DynamicCache()

    def _masks(self, valid: torch.Tensor, positions: torch.Tensor, new: int, tree: torch.Tensor | None = None):
        """Per-layer-type 4-D masks [B, 1, new, L] from slot validity and position ids: a query sees the
        valid keys at positions <= its own (and, in sliding layers, within the window), and always its
        own slot, so padding and hole queries never attend to nothing. With `tree` [B, new, new] (query
        i may see new slot j), the new slots see each other only along the tree: a draft tree's nodes
        see their ancestors, not their cousins."""
        total = valid.shape[1]
        delta = positions[:, -new:, None] - positions[:, None, :]
        own = torch.arange(total, device=valid.device)[None, :] == torch.arange(total - new, total,
                                                                                 device=valid.device)[:, None]
        full = valid.bool()[:, None, :] & (delta >= 0)
        if tree is not None:
            full[:, :, total - new:] &= tree
        full |= own
        masks = {"full_attention": full}
        if self.window is not None:
            masks["sliding_attention"] = (full & (delta < self.window)) | own
        for name, mask in masks.items():
            mask = mask.unsqueeze(1)
            if self.eager:  # eager attention adds the mask to its scores
                mask = torch.zeros(mask.shape, dtype=self.model.dtype, device=mask.device).masked_fill(
                    ~mask, torch.finfo(self.model.dtype).min)
            masks[name] = mask
        if len(self.layer_types) > 1:
            return {t: masks[t] for t in self.layer_types}
        return masks[self.layer_types[0] if self.layer_types else "full_attention"]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache,
                keep: int, all_positions: torch.Tensor, tree: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, keep, V] (float32) of the last `keep` inputs, appending the inputs to `cache`.
        attention_mask [B, L] marks valid slots (cache and inputs); all_positions [B, L] their positions;
        tree [B, n, n] restricts which inputs see each other (default: causal)."""
        start = time.perf_counter()
        past = cache.get_seq_length()
        if self.window is not None or tree is not None:
            attention_mask = self._masks(attention_mask, all_positions, input_ids.shape[1], tree)
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      past_key_values=cache, use_cache=True,
                      cache_position=torch.arange(past, past + input_ids.shape[1], device=input_ids.device))
        if self.cpu_forward is not None:
            logits = self.cpu_forward(keep, **kwargs)
        else:
            logits = self.model(logits_to_keep=keep, **kwargs).logits[:, -keep:].float()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return logits


def _cache_tensors(cache) -> list[tuple[torch.Tensor, ...]]:
    """The (keys, values) tensors [B, H, L, D] of every layer of a transformers cache, for in-place
    compaction."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers if getattr(layer, "keys", None) is not None]
    if hasattr(cache, "key_cache"):  # transformers 4.x
        return list(zip(cache.key_cache, cache.value_cache))
    raise TypeError(f"cannot compact a {type(cache).__name__}: unknown cache layout")


def _crop(cache, length: int) -> None:
    """Drop cache positions past `length` (a negative crop removes that many tokens in every
    transformers version we support)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class KVState:
    """One model's KV cache for a batch, with the attention mask of valid positions and the next
    position id of every row."""

    def __init__(self, lm: CausalLM, batch: int):
        self.lm = lm
        self.cache = lm.new_cache()
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=lm.device)
        self.positions = torch.zeros(batch, 0, dtype=torch.long, device=lm.device)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=lm.device)

    def append(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, keep: int = 1) -> torch.Tensor:
        """Feed tokens [B, n] (valid [B, n] marks real tokens; invalid ones become holes) and return the
        logits of the last `keep` inputs."""
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        valid = valid.long()
        positions = self.next_pos.unsqueeze(1) + valid.cumsum(1) - valid
        self.mask = torch.cat([self.mask, valid], dim=1)
        self.positions = torch.cat([self.positions, positions], dim=1)
        self.next_pos = self.next_pos + valid.sum(1)
        return self.lm.forward(tokens, self.mask, positions, self.cache, keep, self.positions)

    def append_tree(self, tokens: torch.Tensor, valid: torch.Tensor, depth: torch.Tensor,
                    tree: torch.Tensor) -> torch.Tensor:
        """Feed a token tree per row: tokens, valid, depth [B, n] (the root at depth 0 continues the row)
        and tree [B, n, n] (node i sees node j: j is i or an ancestor of i). Returns logits [B, n, V].
        The row does not advance until `commit` says which nodes it keeps."""
        valid = valid.long()
        positions = self.next_pos.unsqueeze(1) + depth
        self.mask = torch.cat([self.mask, valid], dim=1)
        self.positions = torch.cat([self.positions, positions], dim=1)
        return self.lm.forward(tokens, self.mask, positions, self.cache, tokens.shape[1], self.positions, tree)

    def commit(self, appended: int, slots: torch.Tensor, count: torch.Tensor) -> None:
        """Of the last `appended` slots (from `append_tree`), row b keeps slots[b, :count[b]] (a root to
        node path, in order): they move to the front of the block, so the cache stays contiguous, and
        the rest is cropped or left as holes."""
        length = self.mask.shape[1]
        base = length - appended
        slots = slots[:, :appended]  # a path never holds more slots than were appended
        width = slots.shape[1]
        index = slots.clamp(min=0, max=appended - 1)
        for tensors in _cache_tensors(self.cache):
            for t in tensors:
                gather = index[:, None, :, None].expand(t.shape[0], t.shape[1], width, t.shape[3])
                t[:, :, base:base + width] = torch.gather(t[:, :, base:], 2, gather)
        kept = torch.arange(width, device=slots.device).unsqueeze(0) < count.unsqueeze(1)
        self.positions[:, base:base + width] = torch.gather(self.positions[:, base:], 1, index)
        self.mask[:, base:base + width] = kept.long()
        self.next_pos = self.next_pos + count
        end = base + (int(count.max()) if count.numel() else 0)  # slots past every row's path go
        self.mask = self.mask[:, :end]
        self.positions = self.positions[:, :end]
        _crop(self.cache, end)

    def discard(self, appended: int) -> None:
        """Drop the last `appended` slots (a tree that was only scored) from every row."""
        end = self.mask.shape[1] - appended
        self.mask = self.mask[:, :end]
        self.positions = self.positions[:, :end]
        _crop(self.cache, end)

    def rollback(self, appended: int, keep: torch.Tensor) -> None:
        """Of the last `appended` positions, keep the first keep[b] of each row; the rest become holes
        (or are cropped where every row drops them). Assumes those positions were all valid."""
        length = self.mask.shape[1]
        offsets = torch.arange(appended, device=self.mask.device)
        drop = offsets.unsqueeze(0) >= keep.unsqueeze(1)
        self.mask[:, length - appended:] = self.mask[:, length - appended:].masked_fill(drop, 0)
        self.next_pos = self.next_pos - drop.sum(1)
        kept_any = (~drop).any(0)
        tail = appended - (int(kept_any.nonzero().max()) + 1 if bool(kept_any.any()) else 0)
        if tail:
            self.mask = self.mask[:, : length - tail]
            self.positions = self.positions[:, : length - tail]
            _crop(self.cache, length - tail)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` of the batch (finished requests leave)."""
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        self.positions = self.positions[rows]
        self.next_pos = self.next_pos[rows]


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Stats:
    """What a decode call did and where its time went."""

    new_tokens: int = 0
    target_calls: int = 0
    drafter_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    forward_seconds: float = 0.0
    draft_lengths: list[int] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def target_calls_per_token(self) -> float:
        return self.target_calls / self.new_tokens if self.new_tokens else 0.0

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def overhead_fraction(self) -> float:
        """Share of the wall time spent outside model forward passes."""
        return max(0.0, self.seconds - self.forward_seconds) / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        text = (f"{self.new_tokens} tokens in {self.seconds:.2f} s ({self.tokens_per_second:.1f} tok/s), "
                f"target calls {self.target_calls} ({self.target_calls_per_token:.2f}/token)")
        if self.drafted:
            text += (f", drafter calls {self.drafter_calls}" if self.drafter_calls else "")
            text += (f", accepted {self.accepted}/{self.drafted} "
                     f"({self.acceptance:.0%})")
        text += (f", time: prefill {self.prefill_seconds:.2f} s, draft {self.draft_seconds:.2f} s, "
                 f"verify {self.verify_seconds:.2f} s, other {self.other_seconds:.2f} s, "
                 f"outside forwards {self.overhead_fraction:.1%}")
        return text


class Batch:
    """Requests decoded together: their tokens so far, stopping, streaming and row bookkeeping.

    Rows are the requests still running; `index[row]` is the request they belong to. Finished requests
    leave the batch (their caches shrink with them)."""

    def __init__(self, tokenizer, prompts: list[str], max_new_tokens: int, stop: list[str] | None, stream,
                 eos_ids: set[int], device: torch.device):
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.stop = stop or []
        self.stream = stream
        self.eos_ids = eos_ids
        self.prompts = prompts
        self.device = device
        self.index = list(range(len(prompts)))
        self.prompt_ids, self.prompt_mask = self.encode(tokenizer)
        self.generated: list[list[int]] = [[] for _ in prompts]
        self.text_sent = [0] * len(prompts)
        self.stop_text: list[str | None] = [None] * len(prompts)

    def encode(self, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
        """The running requests' prompts as [rows, L] ids and mask, left-padded, in `tokenizer`'s ids
        (a drafter with another vocabulary encodes the prompts itself)."""
        encoded = [tokenizer(self.prompts[i])["input_ids"] for i in self.index]
        if any(not ids for ids in encoded):
            raise ValueError("decode: a prompt encodes to no tokens")
        width = max(len(ids) for ids in encoded)
        ids = torch.zeros(len(encoded), width, dtype=torch.long)  # holes: any id, the mask hides them
        mask = torch.zeros(len(encoded), width, dtype=torch.long)
        for row, row_ids in enumerate(encoded):
            ids[row, width - len(row_ids):] = torch.tensor(row_ids, dtype=torch.long)
            mask[row, width - len(row_ids):] = 1
        return ids.to(self.device), mask.to(self.device)

    @property
    def rows(self) -> int:
        return len(self.index)

    def remaining(self) -> torch.Tensor:
        """[rows] tokens each running request may still emit."""
        return torch.tensor([self.max_new_tokens - len(self.generated[i]) for i in self.index])

    def emit(self, row_tokens: list[list[int]]) -> tuple[list[int], list[int]]:
        """Append each row's new tokens one at a time, stopping at EOS, at the token that completes a
        stop string, or at the token budget (so every method stops at the same token); stream the new
        text. Returns the rows that finished and how many of each row's tokens were used."""
        finished, used = [], []
        for row, tokens in enumerate(row_tokens):
            request = self.index[row]
            out = self.generated[request]
            done = False
            count = 0
            for token in tokens:
                out.append(token)
                count += 1
                stopped = self._stopped(request)  # also on the last allowed token: it may complete a stop
                done = stopped or token in self.eos_ids or len(out) >= self.max_new_tokens
                if done:
                    break
            if self.stream is not None:
                self._stream(request, done)
            used.append(count)
            if done:
                finished.append(row)
        return finished, used

    def _stopped(self, request: int) -> bool:
        """Whether the request's text now contains a stop string; if so its text ends before the first."""
        if not self.stop:
            return False
        text = self.tokenizer.decode(self.generated[request], skip_special_tokens=True)
        hits = [at for at in (text.find(stop) for stop in self.stop) if at >= 0]
        if hits:
            self.stop_text[request] = text[: min(hits)]
        return bool(hits)

    def _stream(self, request: int, done: bool) -> None:
        text = self.stop_text[request]
        if text is None:
            text = self.tokenizer.decode(self.generated[request], skip_special_tokens=True)
        ready = len(text)
        if not done:
            # Hold back what the next tokens may still change: a trailing replacement character (an
            # incomplete UTF-8 sequence) and a suffix that could begin a stop string.
            ready = len(text.rstrip("\ufffd"))
            ready -= max((size for stop in self.stop for size in range(1, min(len(stop), ready + 1))
                          if text[ready - size:ready] == stop[:size]), default=0)
        if ready > self.text_sent[request]:
            self.stream(request, text[self.text_sent[request]:ready])
            self.text_sent[request] = ready

    def drop(self, finished: list[int]) -> torch.Tensor | None:
        """Remove finished rows; returns the surviving row indices (None if nothing changed)."""
        if not finished:
            return None
        gone = set(finished)
        survivors = [row for row in range(self.rows) if row not in gone]
        self.index = [self.index[row] for row in survivors]
        return torch.tensor(survivors, dtype=torch.long)

    def texts(self) -> list[str]:
        out = []
        for request, tokens in enumerate(self.generated):
            if self.stop_text[request] is not None:
                out.append(self.stop_text[request])
            else:
                out.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        return out


def sample_tokens(logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, offset: int) -> torch.Tensor:
    """One token per row from logits [B, V] with the request's sampling parameters (greedy at T = 0):
    chain_verify with no drafts, so sampling and verification share one implementation."""
    batch = logits.shape[0]
    out, _ = ops.chain_verify(logits.unsqueeze(1), torch.empty(batch, 0, dtype=torch.long, device=logits.device),
                              temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                              seed=seeds, offset=offset, validate=False)
    return out[:, 0]
