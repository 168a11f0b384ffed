"""The engine below the decoding loop: a model adapter for any transformers causal LM (`CausalLM`) and a
batch's KV cache with rollback and compaction (`KVState`).

Ragged batches without holes. Each model keeps one KV cache for the whole batch, its rows left-padded.
When rows keep different numbers of the tokens a forward appended (rejected drafts, a draft tree's
unchosen nodes), the dropped slots are removed before the next forward by shifting each row right, so
every row's tokens stay contiguous and end at the last slot: the cache is always what the model's own
`generate()` would hold for a left-padded batch. Position ids count tokens, masks are the 2-D padding
mask, and every model computes windows, local attention, ALiBi and soft-caps its own way, exactly as in
`generate()`. Only draft trees need more: they go through `tree_forward.py`.

On a CPU, a batch's prompts are prefilled in groups of alike lengths and the groups' states joined
(`_prefill_groups`): the padding of one forward over them all costs a CPU what tokens cost.

Memory is linear in the context: the cache, a [B, L] mask and a [B, L] token record; prompts longer than
`PREFILL_CHUNK` are read in chunks, so the masks and attention scores of a forward cover at most
PREFILL_CHUNK x L (or N x L for N new tokens), never L x L.
"""

from __future__ import annotations

import inspect
import time
import weakref
from contextlib import nullcontext

import torch

from specops.decoding.tree_forward import TreeMask, is_transformers_model, tree_forward, weakly_keyed
from specops.decoding import greedy_head
from specops.decoding.cpu_forward import CpuForward
from specops.decoding.hf_compat import cache_argument
from specops.decoding.llama_forward import LlamaForward
from specops.decoding.llama_forward import settle as settle_layers

__all__ = ["OWN_POSITIONS", "PREFILL_CHUNK", "CausalLM", "KVState"]

PREFILL_CHUNK = 512  # prompt tokens per prefill forward
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length",
                   "n_ctx")
# Layer types (config.layer_types) that carry a recurrent state, which no KV cache rollback can cut back.
# Other types, attention of any kind (full, sliding, chunked, indexed / sparse, compressed), are decided by
# what the model does: probe.chain_support decodes, rolls back and compares before any prompt is decoded.
# Models whose positions follow another rule than the token count (probe.chain_support found that passing
# position ids breaks them): they get none and compute their own.
OWN_POSITIONS: weakref.WeakSet = weakref.WeakSet()
_RECURRENT_LAYERS = ("linear_attention", "hybrid", "hybrid_sliding", "conv", "mamba", "mamba2", "recurrent",
                     "rwkv", "ssm")


def _text_config(model):
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _vocab_size(model, name: str) -> int:
    """Rows of the LM head: its weight's, else the config's (checked against the first logits)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head).__name__ == "_PruneReindexingLMHead":
        raise ValueError(f"decode: the {name}'s LM head was pruned in place by transformers' universal assisted "
                         "generation (_PruneReindexingLMHead), so its logits no longer index its vocabulary; pass "
                         f"an unmodified {name} (load it again, or keep a separate copy for transformers)")
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    size = getattr(_text_config(model), "vocab_size", None)
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"decode: cannot tell the {name}'s vocabulary size: its LM head "
                         f"({type(head).__name__}) has no weight and its config no vocab_size")
    return size


def _embedding_rows(model) -> int | None:
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def _context(config) -> tuple[int | None, str | None]:
    for field in _CONTEXT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, field
    return None, None


def _refuse_recurrent(model, config, name: str) -> None:
    """Recurrent and linear-attention layers carry a state that cannot be cut back to an accepted prefix."""
    kinds = sorted({str(t) for t in getattr(config, "layer_types", None) or []} & set(_RECURRENT_LAYERS))
    if getattr(model, "_is_stateful", False) or kinds:
        what = f"layers of type {', '.join(kinds)}" if kinds else "recurrent state"
        raise ValueError(f"decode: the {name} ({type(model).__name__}) has {what}, which cannot be rolled back "
                         "to the accepted tokens; specops decodes attention-only models. Methods that work with "
                         "it: none (decode it with its own generate())")


class CausalLM:
    """Adapter for a transformers causal LM: KV-cached forwards returning float32 logits, with the
    model's vocabulary size, context length and a record of its forward calls."""

    def __init__(self, model, name: str = "model"):
        if not hasattr(model, "forward") or not hasattr(model, "config"):
            raise TypeError(f"{name} must be a transformers causal LM, got {type(model).__name__}")
        self.model = model.eval()
        self.name = name
        self.arch = type(model).__name__
        config = _text_config(model)
        _refuse_recurrent(model, config, name)
        self.vocab_size = _vocab_size(model, name)
        self.embedding_rows = _embedding_rows(model)
        # A model quantize() made low-precision may hold its weights in buffers only.
        parameter = next(model.parameters(), None)
        if parameter is None:
            parameter = next((b for b in model.buffers() if b.is_floating_point()), None)
        if parameter is None:
            raise TypeError(f"{name} ({type(model).__name__}) has no float parameters or buffers")
        self.device, self.dtype = parameter.device, parameter.dtype
        self.context, self.context_field = _context(config)
        layers = getattr(model, "_specops_layers", None) or getattr(config, "num_hidden_layers", None)
        self.attention_layers = layers if isinstance(layers, int) else None
        accepted = inspect.signature(model.forward).parameters
        self.takes = {name for name in ("position_ids", "cache_position", "logits_to_keep") if name in accepted}
        if weakly_keyed(model) and model in OWN_POSITIONS:
            self.takes.discard("position_ids")  # probe.chain_support: the model computes its own
        self.cache_argument = cache_argument(model)
        self.transformers = is_transformers_model(model)
        self._cpu_forward: CpuForward | None | bool = False  # probed on first use
        self._llama_forward: LlamaForward | None | bool = False
        self.tree_kernel = False  # tree forwards through specops.ops.tree_attention (probe.tree_support)
        # Only the argmax of this model's logits is read (a greedy call's target): the CPU paths may read the
        # output head through its int8 screen (greedy_head.py). Set by decode for the call's loop only.
        self.argmax_only = False
        self.calls = 0
        self.seconds = 0.0
        self.log: list[tuple[int, float]] = []  # (tokens fed, seconds) of each forward since the last clear

    @property
    def cpu_forward(self) -> CpuForward | None:
        """The skinny_linear CPU path (cpu_forward.py) if this model reproduces its logits through it."""
        if self._cpu_forward is False:
            self._cpu_forward = CpuForward(self.model) if CpuForward.usable(self.model) else None
        return self._cpu_forward

    @property
    def llama_forward(self) -> LlamaForward | None:
        """The few-call CPU path (llama_forward.py) for forwards of few rows, if it reproduces this model's
        logits."""
        if self._llama_forward is False:
            self._llama_forward = LlamaForward.of(self.model, self.cpu_forward)
        return self._llama_forward

    def prepare_greedy(self, rows: int | None) -> None:
        """Before a greedy call's clock (argmax_only set): the int8 screen of the output head that the CPU
        paths read, for steps of `rows` rows (None: any number; greedy_head.prepare)."""
        if self.argmax_only and self.cpu_forward is not None and self.cpu_forward.usable(self.model):
            greedy_head.prepare(self.cpu_forward.head, rows)

    def new_cache(self):
        # A cache of full layers: windows are applied by the model's masks, and every layer can be cut
        # back and compacted (transformers' sliding-window layers drop what they no longer attend to).
        from transformers import DynamicCache

        cache = DynamicCache()
        layer = _compacting_layer()
        if layer is not None and getattr(cache, "layer_class_to_replicate", None) is layer.__base__:
            cache.layer_class_to_replicate = layer
        return cache

    def check_prompts(self, rows: list[list[int]], new_tokens: int, role: str) -> None:
        """Clear errors, before any forward, for ids the model has no embedding for and for prompts that
        with `new_tokens` more tokens do not fit the model's context."""
        if self.embedding_rows is not None:
            for index, row in enumerate(rows):
                bad = [t for t in row if not 0 <= t < self.embedding_rows]
                if bad:
                    raise ValueError(f"decode: the {role} tokenizer gives prompt {index} the id {bad[0]}, but the "
                                     f"{self.name} ({self.arch}) embeds only ids 0..{self.embedding_rows - 1}; the "
                                     "tokenizer does not belong to this model")
        if self.context is not None:
            for index, row in enumerate(rows):
                if len(row) + new_tokens > self.context:
                    raise ValueError(f"decode: prompt {index} is {len(row)} {role} tokens and max_new_tokens asks for "
                                     f"{new_tokens} more, but the {self.name} ({self.arch}) has a context of "
                                     f"{self.context} positions ({self.context_field})")

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache, keep: int,
                tree: TreeMask | None = None, follow=None) -> torch.Tensor:
        """Logits [B, keep, V] (float32) of the last `keep` inputs, appending the inputs to `cache`.
        mask [B, L]: valid slots, the inputs' included; positions [B, n]: the inputs' position ids; tree:
        the inputs are a draft tree (tree_forward.py); follow: (parent, token) [B, keep] of a greedy
        verification, read where only argmaxes are (greedy_head.greedy_logits)."""
        start = time.perf_counter()
        past = cache.get_seq_length()
        n = tokens.shape[1]
        attention_mask = mask.long()
        if tree is not None and not self.transformers:
            attention_mask = tree.dense()  # other models take the tree as a 4-D boolean mask
        kwargs = dict(input_ids=tokens, attention_mask=attention_mask, use_cache=True)
        if "position_ids" in self.takes:
            kwargs["position_ids"] = positions
        if "cache_position" in self.takes:
            kwargs["cache_position"] = torch.arange(past, past + n, device=tokens.device)
        with tree_forward(self.model, tree) if tree is not None else nullcontext():
            if self.cpu_forward is not None and self.cpu_forward.usable(self.model):
                head = dict(argmax_only=self.argmax_only, follow=follow if self.argmax_only else None)
                llama = self.llama_forward  # the few-call path, for chains and trees of few rows
                if llama is not None and llama.fits(tokens.numel()) and "position_ids" in kwargs:
                    logits = llama(keep, cache, tree=tree, **head, **kwargs)
                else:
                    logits = self.cpu_forward(keep, cache, **head, **kwargs)
            else:
                kwargs[self.cache_argument] = cache
                if "logits_to_keep" in self.takes:
                    kwargs["logits_to_keep"] = keep
                logits = self.model(**kwargs).logits[:, -keep:].float()
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"decode: the {self.name} ({self.arch}) returned {logits.shape[-1]} logits per token, "
                             f"but its vocabulary has {self.vocab_size} ids")
        seconds = time.perf_counter() - start
        self.seconds += seconds
        self.calls += 1
        self.log.append((n, seconds))
        return logits


def _layers(cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"cannot compact a {type(cache).__name__}: unknown cache layout")
    return [layer for layer in layers if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4]


def _map_cache(cache, function) -> None:
    """Replace every key and value tensor [B, H, L, D] of a transformers cache by function(tensor), and
    a sparse-attention indexer's keys [B, L, D] (`_indexer_keys`) alike."""
    for layer in _layers(cache):
        layer.keys, layer.values = function(layer.keys), function(layer.values)
        if _indexer_keys(layer) is not None:
            layer.indexer_keys = function(layer.indexer_keys.unsqueeze(1)).squeeze(1)


def _indexer_keys(layer) -> torch.Tensor | None:
    """The keys [B, L, D] a DeepSeek sparse-attention (DSA) indexer keeps beside the layer's cache, one per
    slot like the layer's own keys (transformers' `update_indexer`), or None."""
    keys = getattr(layer, "indexer_keys", None)
    return keys if isinstance(keys, torch.Tensor) and keys.dim() == 3 and keys.numel() else None


def _gather_slots(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [B, L] or [B, H, L, D] gathered along its slot dim by index [B, L']."""
    if t.dim() == 2:
        return t.gather(1, index)
    return t.gather(2, index[:, None, :, None].expand(t.shape[0], t.shape[1], index.shape[1], t.shape[3]))


def _moved(old: torch.Tensor, offsets: list[int], length: int, new: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H, length (+ new's slots), D]: row b's slot j is old's slot j + offsets[b] (zeros where that
    is before old's first slot: padding, and never NaN, which masked attention would still multiply),
    then `new` [B, H, n, D] if given. One copy per row; one for all rows when they move alike; none when
    nothing moves and nothing is appended (dropped trailing slots, as after a batch-1 rejection): old's
    leading slots as a view, so a forward that keeps room behind the cache (llama_forward) goes on
    writing into it. `out` (no `new`): a tensor of at least `length` slots that does not overlap old, written
    and returned as its first `length` slots (a buffer with room behind them)."""
    batch, heads, _, dim = old.shape
    if new is None and out is None and min(offsets) == max(offsets) == 0:
        return old[:, :, :length]
    extra = 0 if new is None else new.shape[2]
    if out is None:
        out = old.new_empty(batch, heads, length + extra, dim)
    else:
        out = out[:, :, :length]
    if min(offsets) == max(offsets) >= 0:
        out[:, :, :length] = old[:, :, offsets[0]:offsets[0] + length]
    else:
        for b, offset in enumerate(offsets):
            start = max(0, -offset)
            out[b, :, :start] = 0
            out[b, :, start:length] = old[b, :, start + offset:length + offset]
    if new is not None:
        out[:, :, length:] = new
    return out


_LAYER = []


def _compacting_layer():
    """A transformers DynamicLayer that applies a pending compaction in the concatenation it does anyway
    when it next grows, so moving rows costs no extra pass over the cache (None without transformers'
    layered caches)."""
    if _LAYER:
        return _LAYER[0]
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        _LAYER.append(None)
        return None

    class CompactingLayer(DynamicLayer):
        pending: tuple[list[int], int] | None = None  # (row offsets, length): see _moved
        indexer_keys: torch.Tensor | None = None  # a DSA indexer's keys [B, L, D], when the model has one

        def get_seq_length(self) -> int:
            return self.pending[1] if self.pending is not None else super().get_seq_length()

        def update(self, key_states, value_states, *args, **kwargs):
            if self.pending is None:
                return super().update(key_states, value_states, *args, **kwargs)
            offsets, length = self.pending
            self.pending = None
            self.keys = _moved(self.keys, offsets, length, key_states)
            self.values = _moved(self.values, offsets, length, value_states)
            self._move_indexer(offsets, length)
            return self.keys, self.values

        def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
            """A sparse-attention indexer's keys [B, n, D] for the slots `update` just appended (DeepSeek
            V3.2, GLM-MoE-DSA call it after `update`); returns all of them [B, L, D]."""
            keys = self.indexer_keys
            self.indexer_keys = indexer_key_states if keys is None else torch.cat([keys, indexer_key_states], 1)
            return self.indexer_keys

        def _move_indexer(self, offsets: list[int], length: int) -> None:
            if _indexer_keys(self) is not None:
                self.indexer_keys = _moved(self.indexer_keys.unsqueeze(1), offsets, length).squeeze(1)

        def settle(self, capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
            """Apply a pending compaction now (for a caller that appends to keys and values itself). With
            `capacity`, rows that move go straight into new buffers of at least that many slots, returned as
            (keys, values), the layer's tensors being their first slots: room for the caller's appends at the
            cost of one copy. None where nothing went into new buffers."""
            if self.pending is None:
                return None
            offsets, length = self.pending
            self.pending = None
            buffers = None
            if capacity is not None and not min(offsets) == max(offsets) == 0:
                buffers = tuple(t.new_empty(t.shape[0], t.shape[1], max(capacity, length), t.shape[3])
                                for t in (self.keys, self.values))
            self.keys = _moved(self.keys, offsets, length, out=None if buffers is None else buffers[0])
            self.values = _moved(self.values, offsets, length, out=None if buffers is None else buffers[1])
            self._move_indexer(offsets, length)
            return buffers

    _LAYER.append(CompactingLayer)
    return CompactingLayer


class KVState:
    """One model's KV cache for a batch: `mask` [B, L] (valid slots: each row's tokens contiguous at the
    end, padding before them), `tokens` [B, L] (the ids in the slots), `next_pos` [B] (tokens per row)."""

    def __init__(self, lm: CausalLM, batch: int):
        self.lm = lm
        self.cache = lm.new_cache()
        self.mask = torch.zeros(batch, 0, dtype=torch.bool, device=lm.device)
        self.tokens = torch.zeros(batch, 0, dtype=torch.long, device=lm.device)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=lm.device)
        self.trim = torch.zeros(batch, dtype=torch.long, device=lm.device)  # trailing slots to drop
        self.last_tree: TreeMask | None = None

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    def prefill(self, rows: list[list[int]]) -> torch.Tensor:
        """Read each row's tokens (an empty state; ragged rows are left-padded, and on a CPU read in groups of
        alike lengths: `_prefill_groups`); returns the logits [B, V] after each row's last token. Long inputs
        go in chunks of PREFILL_CHUNK slots."""
        if self.mask.shape[1]:
            raise RuntimeError("KVState.prefill needs an empty state; use extend")
        if len(rows) != self.rows or any(not r for r in rows):
            raise ValueError(f"KVState.prefill needs {self.rows} non-empty rows")
        if self.lm.device.type == "cpu" and len(groups := _prefill_groups([len(r) for r in rows])) > 1:
            return self._prefill_grouped(rows, groups)
        return self._prefill_padded(rows)

    def _prefill_padded(self, rows: list[list[int]]) -> torch.Tensor:
        """prefill in one left-padded batch."""
        tokens, valid = _left_padded(rows, self.lm.device)
        logits = None
        for start in range(0, tokens.shape[1], PREFILL_CHUNK):
            end = start + PREFILL_CHUNK
            logits = self._feed(tokens[:, start:end], valid[:, start:end], keep=1)
        return logits[:, -1]

    def _prefill_grouped(self, rows: list[list[int]], groups: list[list[int]]) -> torch.Tensor:
        """prefill, each group of rows (indices) in states of its own, joined in order (`join`). It counts as
        one call of the model (`CausalLM.calls`; one entry of its log, as wide as the longest row), as the
        prefill of the whole batch would: the step loop leaves a drafter's first call out of its per-draft
        time when it read a prompt."""
        calls, logged, state, logits = self.lm.calls, len(self.lm.log), None, []
        for group in groups:
            part = KVState(self.lm, len(group))
            logits.append(part._prefill_padded([rows[i] for i in group]))
            if state is None:
                state = part
            else:
                state.join(part)
        back = torch.argsort(torch.tensor([i for group in groups for i in group]))
        state.select(back)
        self.cache, self.mask, self.tokens = state.cache, state.mask, state.tokens
        self.next_pos, self.trim = state.next_pos, state.trim
        self.lm.calls = calls + 1
        forwards = self.lm.log[logged:]
        self.lm.log[logged:] = [(max(n for n, _ in forwards), sum(t for _, t in forwards))]
        return torch.cat(logits)[back.to(logits[0].device)]

    def append(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, keep: int = 1,
               follow=None) -> torch.Tensor:
        """Feed tokens [B, n] (every row n tokens) and return the logits [B, keep, V] of the last `keep`.
        `valid` [B, n] (holes first: left padding) is accepted only on an empty state, as a prefill. follow:
        a greedy verification's (parent, token) [B, keep] (CausalLM.forward)."""
        if valid is not None and not bool(valid.all()):
            if self.mask.shape[1]:
                raise ValueError("KVState.append: ragged rows after the prefill go through extend")
            lengths = valid.sum(1).tolist()
            rows = [row[row.shape[0] - n:].tolist() for row, n in zip(tokens, lengths)]
            return self.prefill(rows).unsqueeze(1)
        return self._feed(tokens, torch.ones_like(tokens, dtype=torch.bool), keep, follow)

    def extend(self, rows: list[list[int]], keep: int | None = None) -> torch.Tensor:
        """Feed a ragged list of tokens per row (at least one each); returns the logits [B, V] after each
        row's last token, or with `keep` the logits [B, keep, V] of the last `keep` slots (a row that feeds
        fewer has its re-read tokens' logits first). A shorter row re-reads its own last cached tokens so that every row
        feeds the same number and ends on the last slot (a drafter catching up with what the target
        emitted, an ensemble member scoring drafts after what it has not read yet)."""
        if len(rows) != self.rows or any(not r for r in rows):
            raise ValueError(f"KVState.extend needs {self.rows} non-empty rows")
        if keep is not None and keep > max(len(r) for r in rows):
            raise ValueError(f"KVState.extend: keep={keep} is more than any row feeds")
        if not self.mask.shape[1]:
            if keep is not None:
                raise ValueError("KVState.extend with keep needs a prefilled state")
            return self.prefill(rows)
        width = max(len(r) for r in rows)
        reread = torch.clamp(width - torch.tensor([len(r) for r in rows], device=self.lm.device), max=self.next_pos)
        if bool(reread.any()):
            end = (self.tokens.shape[1] - self.trim).tolist()
            rows = [self.tokens[b, end[b] - n:end[b]].tolist() + r if n else r
                    for b, (n, r) in enumerate(zip(reread.tolist(), rows))]
            self._drop_last(reread)
        tokens, valid = _left_padded(rows, self.lm.device)  # holes only where a row holds nothing else
        if keep is not None:
            return self._feed(tokens, valid, keep=keep)
        return self._feed(tokens, valid, keep=1)[:, -1]

    def drop_last(self, counts: torch.Tensor) -> None:
        """Row b forgets its last counts[b] tokens (they leave before the next forward)."""
        self._drop_last(counts.to(self.mask.device))

    def _feed(self, tokens: torch.Tensor, valid: torch.Tensor, keep: int, follow=None) -> torch.Tensor:
        self._compact()
        valid = valid.bool()
        counts = valid.long()
        positions = self.next_pos.unsqueeze(1) + counts.cumsum(1) - counts
        self.mask = torch.cat([self.mask, valid], dim=1)
        self.tokens = torch.cat([self.tokens, tokens], dim=1)
        self.next_pos = self.next_pos + counts.sum(1)
        return self.lm.forward(tokens, self.mask, positions, self.cache, keep, follow=follow)

    def rollback(self, appended: int, keep: torch.Tensor) -> None:
        """Of the last `appended` slots (all valid), row b keeps the first keep[b]; the rest leave before the
        next forward."""
        self._drop_last(appended - keep)

    def _drop_last(self, counts: torch.Tensor) -> None:
        """Row b drops its last counts[b] tokens; dropped slots leave before the next forward, all at once."""
        length = self.mask.shape[1]
        trim = self.trim + counts
        slot = torch.arange(length, device=counts.device)[None]
        self.mask = self.mask & (slot < (length - trim)[:, None])
        self.next_pos = self.next_pos - counts
        self.trim = trim

    def append_tree(self, tokens: torch.Tensor, valid: torch.Tensor, depth: torch.Tensor,
                    visible: torch.Tensor, follow=None) -> torch.Tensor:
        """Feed a token tree per row: tokens, valid, depth [B, N] (node 0, at depth 0, continues the row)
        and visible [B, N, N] (node i sees node j: j is i or an ancestor of i). Returns logits [B, N, V].
        The row does not advance until `commit` says which nodes it keeps. follow: as `append`'s."""
        self._compact()
        positions = self.next_pos.unsqueeze(1) + depth
        self.mask = torch.cat([self.mask, valid.bool()], dim=1)
        self.tokens = torch.cat([self.tokens, tokens], dim=1)
        self.last_tree = TreeMask(self.mask, depth, visible.bool(), kernel=self.lm.tree_kernel)
        return self.lm.forward(tokens, self.mask, positions, self.cache, tokens.shape[1], self.last_tree,
                               follow)

    def commit(self, appended: int, slots: torch.Tensor, count: torch.Tensor) -> None:
        """Of the last `appended` slots (from `append_tree`), row b keeps slots[b, :count[b]] (a root to
        node path, in order): they move to the front of the block, the rest leaves."""
        length = self.mask.shape[1]
        base = length - appended
        slots = slots[:, :appended].clamp(0, appended - 1)  # a path never holds more slots than were appended
        width = slots.shape[1]
        order = torch.arange(width, device=slots.device).unsqueeze(0)
        kept = order < count.unsqueeze(1)
        moves = bool(((slots != order) & kept).any())  # often not: the first row's path, or the root alone

        def gather(t):
            block = _gather_slots(t[:, base:] if t.dim() == 2 else t[:, :, base:], slots)
            if t.dim() == 2:
                t[:, base:base + width] = block
            else:
                t[:, :, base:base + width] = block
            return t

        if moves:
            _map_cache(self.cache, gather)
            gather(self.tokens)
        self.mask[:, base:] = torch.arange(appended, device=slots.device).unsqueeze(0) < count.unsqueeze(1)
        self.next_pos = self.next_pos + count
        self.trim = appended - count

    def discard(self, appended: int) -> None:
        """Drop the last `appended` slots (a tree that was only scored) from every row."""
        end = self.mask.shape[1] - appended
        self._cut(end)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` of the batch (finished requests leave)."""
        rows = rows.to(self.mask.device)
        _map_cache(self.cache, lambda t: t[rows])
        self.mask, self.tokens = self.mask[rows], self.tokens[rows]
        self.next_pos, self.trim = self.next_pos[rows], self.trim[rows]

    def join(self, other: KVState) -> None:
        """Append `other`'s rows after this state's (requests joining a running batch, read in a state of
        their own, which is used up). Both hold caches of the same model; the shorter one is left-padded
        with empty slots, so every row still ends at the last slot."""
        if other.lm is not self.lm:
            raise ValueError("KVState.join: the states belong to different models")
        if not other.rows:
            return
        if not self.rows:
            self.cache, self.mask, self.tokens = other.cache, other.mask, other.tokens
            self.next_pos, self.trim = other.next_pos, other.trim
            return
        for state in (self, other):
            state._compact()
            for layer in getattr(state.cache, "layers", None) or []:
                if getattr(layer, "pending", None) is not None:
                    layer.settle()
        length = max(self.mask.shape[1], other.mask.shape[1])
        mine, theirs = _layers(self.cache), _layers(other.cache)
        if mine or theirs:
            base = self.cache if mine else other.cache  # a state that holds no slots has no layers yet
            for i, layer in enumerate(_layers(base)):
                a, b = (mine[i] if mine else None), (theirs[i] if theirs else None)
                for name in ("keys", "values"):
                    like = getattr(layer, name)
                    setattr(layer, name, torch.cat([
                        _widened(getattr(a, name) if a is not None else None, self.rows, like, length),
                        _widened(getattr(b, name) if b is not None else None, other.rows, like, length)]))
                if _indexer_keys(layer) is not None:  # one head: widened as [B, 1, L, D]
                    like = layer.indexer_keys.unsqueeze(1)
                    parts = [_indexer_keys(x) if x is not None else None for x in (a, b)]
                    layer.indexer_keys = torch.cat([
                        _widened(None if parts[0] is None else parts[0].unsqueeze(1), self.rows, like, length),
                        _widened(None if parts[1] is None else parts[1].unsqueeze(1), other.rows, like, length),
                    ]).squeeze(1)
            self.cache = base
        self.mask = torch.cat([_widened(self.mask, 0, self.mask, length), _widened(other.mask, 0, other.mask, length)])
        self.tokens = torch.cat([_widened(self.tokens, 0, self.tokens, length),
                                 _widened(other.tokens, 0, other.tokens, length)])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.trim = torch.cat([self.trim, other.trim])

    def settle(self) -> None:
        """Move the rows that dropped different numbers of slots now, where the model's next forward would
        move them anyway before appending (the few-call path, llama_forward.py), so that the step that made
        them ragged is the one whose time holds the move: timed in the next step, it priced plain steps after
        drafting ones 10 ms (13 %) above plain steps after plain ones (Gemma-3-270M, 8 requests, 2-vCPU Xeon),
        and drafts below their cost. Other forwards merge the move into the concatenation they do anyway,
        and keep it pending."""
        if not isinstance(self.lm._llama_forward, LlamaForward) or not bool(self.trim.any()):
            return
        start = time.perf_counter()
        self._compact()
        settle_layers(self.cache)
        self.lm.seconds += time.perf_counter() - start  # the model's work: chains price steps by it

    def _cut(self, end: int) -> None:
        self.mask, self.tokens = self.mask[:, :end], self.tokens[:, :end]
        _map_cache(self.cache, lambda t: t[:, :, :end])

    def _compact(self) -> None:
        """Remove the trailing slots rows dropped: every row ends at the new last slot (its padding grows)
        and leading slots no row uses leave. Layers that can (`_compacting_layer`) move their rows in their
        next concatenation; any other cache moves them now."""
        if not bool(self.trim.any()):
            return
        length = self.mask.shape[1]
        index = torch.arange(length - int(self.trim.min()), device=self.trim.device)[None] - (
            self.trim - self.trim.min())[:, None]  # [B, L']: each slot's old slot (< 0: padding)
        self.trim = torch.zeros_like(self.trim)
        self.mask = self.mask.gather(1, index.clamp(min=0)) & (index >= 0)
        used = self.mask.any(0)
        lead = int(used.long().argmax()) if bool(used.any()) else index.shape[1]
        index, self.mask = index[:, lead:], self.mask[:, lead:]
        self.tokens = self.tokens.gather(1, index.clamp(min=0))
        size = index.shape[1]
        offsets = index[:, 0].tolist() if size else [0] * index.shape[0]
        for layer in _layers(self.cache):
            if isinstance(layer, _compacting_layer() or ()):
                layer.pending = (offsets, size)
            else:
                layer.keys, layer.values = _moved(layer.keys, offsets, size), _moved(layer.values, offsets, size)
                if _indexer_keys(layer) is not None:
                    layer.indexer_keys = _moved(layer.indexer_keys.unsqueeze(1), offsets, size).squeeze(1)


def _widened(t: torch.Tensor | None, rows: int, like: torch.Tensor, length: int) -> torch.Tensor:
    """t ([B, L] or [B, H, L, D]) left-padded with zero slots to `length` slots; for t None, `rows` rows of
    zeros shaped like `like` (a state that holds no slots yet)."""
    dim = 1 if like.dim() == 2 else 2
    if t is None:
        shape = list(like.shape)
        shape[0], shape[dim] = rows, length
        return like.new_zeros(shape)
    missing = length - t.shape[dim]
    if not missing:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


# A prompt joins the prefill group of the longer ones before it only if that pads it by at most this many
# slots. On a CPU a prefill is bound by arithmetic, and every padded slot costs what a token does; a group of
# its own costs one more read of the weights, about what 10 tokens' arithmetic takes (reading a float32
# weight at 30-40 GB/s against 200 GFLOP/s of products: 4 bytes against 2 FLOPs a weight and token). 8
# HumanEval prompts of 78-282 tokens (1,096 tokens) padded to the longest took 2,256 slots and 3.6-4.3 s,
# twice the 1.8-2.2 s of the same prompts read one at a time (Gemma-3-270M, 2-vCPU AMD EPYC Zen 4,
# bench/bench_prefill_ragged.py, 2026-12-07). Not on accelerators, where a forward of more slots costs little
# more and each group adds a forward's latency.
_GROUP_PADDING = 16


def _prefill_groups(lengths: list[int]) -> list[list[int]]:
    """The rows (indices) of a prefill in groups of alike lengths, longest first: each row joins the current
    group unless that pads it by more than _GROUP_PADDING slots."""
    order = sorted(range(len(lengths)), key=lambda b: -lengths[b])
    groups: list[list[int]] = []
    for b in order:
        if groups and lengths[groups[-1][0]] - lengths[b] <= _GROUP_PADDING:
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


def _left_padded(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists as [B, n] tokens and validity, holes first so every row ends on a real token."""
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        if r:
            tokens[b, width - len(r):] = torch.tensor(r, dtype=torch.long)
            valid[b, width - len(r):] = True
    return tokens.to(device), valid.to(device)
