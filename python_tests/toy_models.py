"""Tiny models and tokenizers for the decoder tests; nothing here touches the model hub.

- `byte_tokenizer()`: a byte-level tokenizer (every byte one token, ids 2..257) with <pad> = 0 and
  <eos> = 1, built with the `tokenizers` library; with bos=True it also puts <bos> = 258 before every
  text (models for it need vocab=BYTE_VOCAB + 1).
- `tiny_llama()` / `tiny_gemma3()`: randomly initialised transformers causal LMs over that vocabulary,
  small enough that a forward costs a few milliseconds on a CPU.
- `TableLM`: a table-defined toy language model whose next-token distribution is known exactly: it
  depends on the last two *valid* tokens of the context (a trigram table), which the model reads back
  from its own KV cache through the attention mask. So cache holes, rollback, cropping and row
  selection by the engine all change its output if they are wrong, and its exact sequence
  distribution is a product of table rows. It also checks, on every call, that the position ids the
  engine passes count only valid tokens. It reads draft trees too: given the engine's 4-D boolean mask
  [B, 1, n, L], a query's previous token is the latest key it may see, so a node reads its parent.
- `letter_tokenizer()`: one token per letter of `LETTERS`, plus <pad>, for `TableLM` prompts.
- `token_tokenizer(tokens)`: a BPE tokenizer over given (multi-letter) token strings, for a target and a
  drafter with different vocabularies; `TableLM` takes a table over any number of tokens, and
  `token_sequence_distribution` gives the exact distribution of its token-id sequences.
  `merged_byte_tokenizer(words)`: `byte_tokenizer()` plus multi-byte tokens, for a tiny model whose
  vocabulary differs from a byte-level one.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GenerationConfig, LlamaConfig,
                          LlamaForCausalLM, PretrainedConfig, PreTrainedTokenizerFast)

# The installed transformers as (major, minor), for tests whose expectations follow its version.
TRANSFORMERS = tuple(int(part) for part in transformers.__version__.split(".")[:2])
PAD_ID, EOS_ID = 0, 1
BYTE_VOCAB = 258  # <pad>, <eos>, 256 bytes
BOS_ID = BYTE_VOCAB  # only in byte_tokenizer(bos=True)


def _byte_level_tokenizer(vocab: dict[str, int], eos: str | None, bos: str | None = None
                          ) -> PreTrainedTokenizerFast:
    # BPE with no merges over ByteLevel symbols: every byte of the text is one token.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                           special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token=eos, bos_token=bos,
                                   padding_side="left")


def byte_tokenizer(bos: bool = False) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": PAD_ID, "<eos>": EOS_ID}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    if bos:
        vocab["<bos>"] = BOS_ID
    return _byte_level_tokenizer(vocab, "<eos>", "<bos>" if bos else None)


def tiny_llama(layers: int = 4, seed: int = 0, vocab: int = BYTE_VOCAB, hidden: int = 64) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
                         bos_token_id=None)
    with torch.random.fork_rng():  # the same weights for the same seed, without touching the global RNG
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


def tiny_gemma3(layers: int = 4, seed: int = 0, vocab: int = BYTE_VOCAB, sliding_window: int = 4096,
                layer_types: list[str] | None = None) -> Gemma3ForCausalLM:
    """layer_types: e.g. ["sliding_attention", "full_attention", ...]; default Gemma-3's pattern (five
    sliding layers, then a full one), so up to 5 layers are all sliding."""
    config = Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1,
                              head_dim=16, max_position_embeddings=2048, sliding_window=sliding_window,
                              layer_types=layer_types, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
                              bos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Gemma3ForCausalLM(config).eval()


# ---- table-defined toy LM ----

LETTERS = "abcd"  # token ids 0..3; <pad> is id 4 and is never generated (probability 0)
TOY_PAD = len(LETTERS)
TOY_VOCAB = len(LETTERS) + 1
START = len(LETTERS)  # table row used as "previous token" when the context has a single token


def letter_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {ch: i for i, ch in enumerate(LETTERS)}
    vocab["<pad>"] = TOY_PAD
    return _byte_level_tokenizer(vocab, None)


def token_tokenizer(tokens: list[str]) -> PreTrainedTokenizerFast:
    """A tokenizer whose ids 0..n-1 are `tokens` in order, then <pad> = n, for a `TableLM` over n tokens.

    Tokens are written in the byte-level alphabet (ASCII letters stand for themselves). A multi-letter
    token is one BPE merge of its prefix (itself a token) and its last letter; merges apply in the
    order the tokens are listed, so the encoding of any text over the single letters is deterministic
    and decodes back to it."""
    vocab = {t: i for i, t in enumerate(tokens)}
    vocab["<pad>"] = len(tokens)
    return _with_merges(_byte_level_tokenizer(vocab, None), vocab, tokens)


def merged_byte_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """`byte_tokenizer()` plus multi-byte tokens: every prefix of each word (2 bytes and longer, in the
    byte-level alphabet: "Ġthe" is " the") becomes a token, ids from BYTE_VOCAB on in order of first
    appearance. Models for it need vocab=len(tokenizer)."""
    tokenizer = byte_tokenizer()
    vocab = tokenizer.get_vocab()
    tokens = list(dict.fromkeys(word[:end] for word in words for end in range(2, len(word) + 1)))
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    return _with_merges(_byte_level_tokenizer(vocab, "<eos>"), vocab, tokens)


def _with_merges(tokenizer: PreTrainedTokenizerFast, vocab: dict[str, int], tokens: list[str]
                 ) -> PreTrainedTokenizerFast:
    """The byte-level tokenizer over `vocab` with one BPE merge per multi-letter token (its prefix and
    its last letter), in the order of `tokens`."""
    merges = []
    for token in tokens:
        if len(token) > 1:
            if token[:-1] not in vocab:
                raise ValueError(f"toy tokenizer: {token!r} needs its prefix {token[:-1]!r} as a token")
            merges.append((token[:-1], token[-1]))
    tokenizer.backend_tokenizer.model = models.BPE(vocab=vocab, merges=merges)
    return tokenizer


def random_table(seed: int, zeros: int = 6, tokens: int = len(LETTERS)) -> torch.Tensor:
    """Probabilities [tokens+1, tokens, tokens+1] (float64; tokens = len(LETTERS) gives TOY_VOCAB
    columns): row [prev2, prev1] is the next-token distribution (prev2 = START = tokens for a context of
    one token). `zeros` entries are exactly 0, at most one per row (so never a whole row when tokens > 1);
    the <pad> column is always 0."""
    g = torch.Generator().manual_seed(seed)
    n = tokens
    probs = torch.rand(n + 1, n, n, generator=g, dtype=torch.float64) + 0.05
    flat = probs.view(-1, n)
    for i in torch.randperm(flat.shape[0], generator=g)[:zeros].tolist():
        flat[i, int(torch.randint(n, (), generator=g))] = 0.0
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.cat([probs, torch.zeros(n + 1, n, 1, dtype=torch.float64)], dim=-1)


class TableLM(torch.nn.Module):
    """A causal LM over `letter_tokenizer()` whose next-token probabilities are `table[prev2, prev1]`.

    Speaks the interface the engine uses: forward(input_ids, attention_mask, position_ids,
    past_key_values, use_cache, logits_to_keep, cache_position) -> .logits [B, n, V] (the cache under
    transformers' name before 5.24, which a model outside transformers may keep: the engine passes it by
    the name forward() declares). The token ids
    themselves are stored as the cache's keys ([B, 1, n, 1]), so the model sees exactly what the
    engine kept in its cache, and the attention mask says which of those positions are valid."""

    def __init__(self, table: torch.Tensor):
        """table [n+1, n, n+1]: n tokens (ids 0..n-1, `LETTERS` for `random_table()`), then <pad> = n,
        which is also the START row."""
        super().__init__()
        self.register_buffer("log_table", table.log().float())  # log 0 = -inf: impossible tokens
        self.tokens = table.shape[1]
        self.config = PretrainedConfig(num_hidden_layers=1, vocab_size=table.shape[-1])
        self.generation_config = GenerationConfig()  # eos_token_id None: sequences end by length only
        self.lm_head = torch.nn.Linear(1, table.shape[-1], bias=False)  # only its shape is used
        self.calls = 0

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache=True,
                logits_to_keep=0, cache_position=None, **kwargs):
        """attention_mask: [B, L] valid slots (the previous token is the latest valid slot before a
        query), or [B, 1, n, L] bool, query i sees key j (the latest key a query sees before its own
        slot holds its previous token: a draft-tree node reads its parent)."""
        self.calls += 1
        batch, n = input_ids.shape
        ids = input_ids.to(torch.float32).view(batch, 1, n, 1)
        keys, _ = past_key_values.update(ids, ids, 0)
        tokens = keys[:, 0, :, 0].long()  # [B, L]: every position the cache holds, holes included
        length = tokens.shape[1]
        if cache_position is not None and cache_position.tolist() != list(range(length - n, length)):
            raise AssertionError(f"TableLM: cache_position {cache_position.tolist()} != "
                                 f"{length - n}..{length - 1}")
        if attention_mask.dim() == 4:
            prev2, prev1 = self._tree_context(tokens, attention_mask, position_ids, n, self.tokens)
        else:
            prev2, prev1 = self._chain_context(tokens, attention_mask, position_ids, n, self.tokens)
        logits = self.log_table[prev2, prev1]  # [B, n, V]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits)

    @staticmethod
    def _chain_context(tokens, attention_mask, position_ids, n, vocab):
        batch, length = tokens.shape
        if attention_mask.shape != (batch, length):
            raise AssertionError(f"TableLM: attention mask {tuple(attention_mask.shape)} does not cover "
                                 f"the cache ({batch}, {length})")
        valid = attention_mask.bool()
        expected_pos = valid.long().cumsum(1) - 1
        new_valid = valid[:, -n:]
        if not torch.equal(position_ids[new_valid], expected_pos[:, -n:][new_valid]):
            raise AssertionError("TableLM: position ids do not count the valid tokens before each input")
        if bool((tokens[valid] >= vocab).any()):
            raise AssertionError("TableLM: a valid cache position holds <pad>")
        # For every position i: the index of the last valid position <= i (-1 if none).
        index = torch.arange(length, device=tokens.device).expand(batch, length)
        last_valid = torch.where(valid, index, -1).cummax(1).values
        prev_index = torch.cat([torch.full_like(last_valid[:, :1], -1), last_valid[:, :-1]], dim=1)
        # Row `vocab` of the table is START.
        prev2 = torch.where(prev_index >= 0, tokens.gather(1, prev_index.clamp(min=0)), vocab)
        prev1 = tokens.clamp(max=vocab - 1)  # holes / pads get some row; their logits are never used
        return prev2[:, -n:], prev1[:, -n:]

    @staticmethod
    def _tree_context(tokens, attention_mask, position_ids, n, vocab):
        batch, length = tokens.shape
        if attention_mask.shape != (batch, 1, n, length) or attention_mask.dtype != torch.bool:
            raise AssertionError(f"TableLM: 4-D attention mask {tuple(attention_mask.shape)} "
                                 f"{attention_mask.dtype} is not a bool [{batch}, 1, {n}, {length}]")
        sees = attention_mask[:, 0]  # [B, n, L]
        slot = torch.arange(length, device=tokens.device)
        own = torch.arange(length - n, length, device=tokens.device)  # each query's own slot
        if not bool(sees[:, torch.arange(n), own].all()):
            raise AssertionError("TableLM: a query does not see its own slot")
        if bool((sees & (slot[None, None, :] > own[None, :, None])).any()):
            raise AssertionError("TableLM: a query sees a slot after its own")
        before = sees & (slot[None, None, :] < own[None, :, None])
        if not torch.equal(position_ids, before.sum(-1)):
            raise AssertionError("TableLM: position ids do not count the keys each query sees before itself")
        if bool((tokens[:, None, :].expand_as(sees)[sees] >= vocab).any()):
            raise AssertionError("TableLM: a query sees a slot holding <pad>")
        latest = torch.where(before, slot, -1).amax(-1)  # [B, n]: the previous token's slot, -1 if none
        prev2 = torch.where(latest >= 0, tokens.gather(1, latest.clamp(min=0)), vocab)  # row vocab: START
        return prev2, tokens[:, -n:]


def token_sequence_distribution(table: torch.Tensor, context: list[int], length: int,
                                temperature: float = 1.0, top_k: int = 0) -> dict[tuple[int, ...], float]:
    """Exact probability of every continuation of `length` token ids after the token ids `context`
    (>= 1; one token reads the START row) under a `TableLM` table [n+1, n, n+1], sampled at
    `temperature` with top-k filtering (ties at the k-th value kept). Sequences of probability 0 included."""
    logits = table.log()
    if temperature != 1.0:
        logits = logits / temperature
    if top_k:
        kth = logits.sort(-1, descending=True).values[..., top_k - 1:top_k]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    n = table.shape[1]
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, p in out.items():
            full = (n, *context, *seq)  # n = START, read only for a one-token context
            row = probs[full[-2], full[-1]]
            for t in range(n):
                grown[seq + (t,)] = p * float(row[t])
        out = grown
    return out


def sequence_distribution(table: torch.Tensor, context: str, length: int, temperature: float = 1.0,
                          top_k: int = 0) -> dict[str, float]:
    """Exact probability of every continuation of `length` letters after `context` (>= 2 letters) under
    `table`, sampled at `temperature` with top-k filtering (ties at the k-th value kept)."""
    ids = [LETTERS.index(ch) for ch in context]
    exact = token_sequence_distribution(table, ids, length, temperature, top_k)
    return {"".join(LETTERS[t] for t in seq): p for seq, p in exact.items()}


def cycle_table(peak: float = 0.85) -> torch.Tensor:
    """A table whose greedy continuation is known: after two equal letters the letter repeats
    ("aa" -> "aaaa..."), otherwise the next letter of the cycle a -> b -> c -> d -> a follows
    ("ab" -> "cdab..."). The greedy choice has probability `peak`; every other letter shares the rest."""
    n = len(LETTERS)
    probs = torch.full((n + 1, n, TOY_VOCAB), (1 - peak) / (n - 1), dtype=torch.float64)
    probs[..., TOY_PAD] = 0.0
    for prev2 in range(n + 1):
        for prev1 in range(n):
            probs[prev2, prev1, :n] = (1 - peak) / (n - 1)
            probs[prev2, prev1, prev1 if prev2 == prev1 else (prev1 + 1) % n] = peak
    return probs


def greedy_cycle(context: str, length: int) -> str:
    """The greedy continuation of `context` under `cycle_table()`."""
    text = context
    for _ in range(length):
        prev1 = text[-1]
        same = len(text) >= 2 and text[-2] == prev1
        text += prev1 if same else LETTERS[(LETTERS.index(prev1) + 1) % len(LETTERS)]
    return text[len(context):]
