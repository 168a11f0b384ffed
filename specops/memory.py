"""`NgramMemory`: token sequences that earlier requests wrote, for n-gram drafting across requests.

    memory = specops.NgramMemory(budget_bytes=256 << 20)
    specops.decode(prompts, target="gemma-3-270m", memory=memory)   # method "auto" is then "ngram"
    memory.save("memory.bin");  memory = specops.NgramMemory.load("memory.bin")

What it holds: runs of token ids (a request's prompt, each request's prompt tail and output, a corpus text),
laid out apart in one int32 store, and an index of every position that has a token after it, sorted by the
tokens before it (`specops.ops.ngram_memory_insert` / `ngram_memory_lookup`; reference.py defines the order). A
lookup finds the longest earlier occurrence of a context's last tokens (up to `max_match` of them) and the
continuations that followed it, with how often each did. A decode call writes its requests into it as they
run, step by step, so the requests of one call draft from each other, later calls from earlier ones, and a
file carries it to another process.

Bounded: the store, the index and the run table together stay within `budget_bytes`. When a new run does not
fit, the least recently used finished runs leave (a run is used when it is written or when a lookup drafts
from it) and the store is compacted; a running request's run that cannot fit even then is not recorded.
`stats()` says what it holds. One lock serializes every call, so decode calls in several threads may share
one memory. The memory binds to the vocabulary of the first model it is used with (its size, and a
fingerprint of the tokenizer's tokens when there is one) and refuses any other.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from specops import ops
from specops._files import write_atomically
from specops.ops.ngram import MEMORY_MAX_DEPTH

__all__ = ["Matches", "NgramMemory"]

_MAGIC = b"SPECOPS NGRAM MEMORY\n"
_VERSION = 1
_RUN_BYTES = 48  # a run's row in the run table, as the budget counts it
_TOKEN_BYTES = 4  # int32 store slot
_ENTRY_BYTES = 4  # int32 index entry
_AFTER_EVICTION = 0.9  # eviction frees down to this share of the budget, so it does not run at every insert
_GROWTH = 0.5  # the store grows by this share of itself (within the budget) when a run does not fit
_SEGMENT = 256  # slots reserved for a run of unknown length (vLLM's requests), and by which it continues
_FINGERPRINT_TOKENS = 4096


def vocabulary_fingerprint(tokenizer) -> str | None:
    """A fingerprint of a tokenizer's vocabulary: its size and 4,096 of its tokens spread over it (None without a
    tokenizer). Two tokenizers of one vocabulary agree; another vocabulary differs, in practice always."""
    if tokenizer is None:
        return None
    size = len(tokenizer)
    step = max(1, size // _FINGERPRINT_TOKENS)
    ids = list(range(0, size, step))[:_FINGERPRINT_TOKENS] + list(range(max(0, size - 64), size))
    tokens = tokenizer.convert_ids_to_tokens(ids)
    text = json.dumps([size, [str(t) for t in tokens]], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass
class Matches:
    """A lookup's answer for each row: candidates [B, k, w] (continuations, -1 past their end and where there
    is none), counts [B, k] (how many of the occurrences read continue that way), match [B] (the longest match,
    in tokens; 0 for none) and occurrences [B] (how many stored positions match that long)."""

    candidates: torch.Tensor
    counts: torch.Tensor
    match: torch.Tensor
    occurrences: torch.Tensor


@dataclass
class _Run:
    start: int  # first slot in the store
    context: int  # leading tokens that are not entries but the last (a copy of what came before)
    length: int  # tokens written
    capacity: int  # slots reserved (a separator follows them)
    last_used: int
    live: bool  # still being written (a running request): never evicted
    entries: int = 0  # entries of it in the index

    @property
    def first_entry(self) -> int:
        return self.start + max(self.context - 1, 0)

    def span(self) -> int:
        """Slots it needs after a compaction: all it reserved while live, its tokens once finished."""
        return (self.capacity if self.live else self.length) + 1


class NgramMemory:
    """Token sequences that earlier requests wrote, and their index, within a byte budget (module docstring).

    budget_bytes: the most the memory holds, its store, index and run table together (> 0).
    max_match: the longest match a lookup finds, in tokens (1 to 64)."""

    def __init__(self, budget_bytes: int = 256 << 20, *, max_match: int = MEMORY_MAX_DEPTH, device="cpu"):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"NgramMemory: budget_bytes must be an int > 0, got {budget_bytes!r}")
        if isinstance(max_match, bool) or not isinstance(max_match, int) or not 1 <= max_match <= MEMORY_MAX_DEPTH:
            raise ValueError(f"NgramMemory: max_match must be an int in [1, {MEMORY_MAX_DEPTH}], got {max_match!r}")
        self.budget_bytes = budget_bytes
        self.max_match = max_match
        self.device = torch.device(device)
        self.vocab_size: int | None = None
        self.vocabulary: str | None = None
        self._lock = threading.RLock()
        self._tokens = torch.full((0,), -1, dtype=torch.int32, device=self.device)
        self._used = 0  # store slots in use (runs and their separators)
        self._entries = torch.empty(0, dtype=torch.int32, device=self.device)  # a buffer: the levels, then room
        self._levels: list[int] = []  # level sizes, oldest first
        self._runs: dict[int, _Run] = {}  # run id -> run; ids increase with the run's start
        self._next_id = 0
        self._clock = 0
        self._handles: dict[int, int] = {}  # a decoder's handle -> the run it writes now
        self._next_handle = 0
        self._held_slots = 0  # sum of the runs' spans: the store they need compacted
        self._held_entries = 0
        self._start_list: list[int] = []  # the runs' starts, increasing, and their ids
        self._start_ids: list[int] = []
        self._starts: torch.Tensor | None = None  # _start_list as a tensor, built when a lookup needs it
        self.counters = {"lookups": 0, "rows_looked_up": 0, "rows_matched": 0, "runs_evicted": 0,
                         "tokens_evicted": 0, "runs_refused": 0, "compactions": 0}

    # ---- what it holds ----

    @property
    def nbytes(self) -> int:
        """Bytes held: the store, the index and the run table."""
        return (self._tokens.numel() * _TOKEN_BYTES + self._entries.numel() * _ENTRY_BYTES
                + len(self._runs) * _RUN_BYTES)

    def stats(self) -> dict:
        """What the memory holds: runs (finished and running), tokens, index entries and levels, bytes against
        the budget, its vocabulary, and counts of lookups, matches, evictions and refusals."""
        with self._lock:
            live = sum(r.live for r in self._runs.values())
            return {"runs": len(self._runs) - live, "running": live,
                    "tokens": sum(r.length - r.context for r in self._runs.values()),
                    "entries": sum(self._levels), "levels": list(self._levels), "bytes": self.nbytes,
                    "budget_bytes": self.budget_bytes, "max_match": self.max_match, "vocab_size": self.vocab_size,
                    "vocabulary": self.vocabulary, **self.counters}

    def __repr__(self) -> str:
        s = self.stats()
        return (f"NgramMemory({s['runs']} runs + {s['running']} running, {s['tokens']:,} tokens, "
                f"{s['bytes']:,} of {s['budget_bytes']:,} bytes, max_match {s['max_match']})")

    def __len__(self) -> int:
        """Tokens held."""
        return self.stats()["tokens"]

    # ---- vocabulary ----

    def bind(self, vocab_size: int, vocabulary: str | None = None, *, who: str = "decode") -> None:
        """Tie the memory to a vocabulary (its size, and a `vocabulary_fingerprint` when known) on first use;
        raise ValueError for another one afterwards."""
        with self._lock:
            if self.vocab_size is None:
                self.vocab_size, self.vocabulary = int(vocab_size), vocabulary
                return
            if self.vocab_size != vocab_size or (vocabulary and self.vocabulary and vocabulary != self.vocabulary):
                raise ValueError(f"{who}: the memory holds token ids of another vocabulary ({self.vocab_size:,} ids, "
                                 f"fingerprint {self.vocabulary}) than this model's ({vocab_size:,} ids, fingerprint "
                                 f"{vocabulary}); use a memory per vocabulary")
            if self.vocabulary is None:
                self.vocabulary = vocabulary

    def _check_ids(self, runs: list[list[int]], who: str) -> None:
        for i, run in enumerate(runs):
            if not run:
                continue
            low, high = min(run), max(run)
            if low < 0 or (self.vocab_size is not None and high >= self.vocab_size):
                bad = low if low < 0 else high
                bound = f"[0, {self.vocab_size})" if self.vocab_size is not None else ">= 0"
                raise ValueError(f"{who}: run {i} holds the token id {bad}, outside the vocabulary ({bound})")

    # ---- writing ----

    def add(self, runs, *, vocab_size: int | None = None) -> None:
        """Add finished runs of token ids (a list of lists of ints, e.g. a corpus encoded by the model's
        tokenizer). vocab_size binds the memory to that many ids if it is not bound yet."""
        runs = _as_runs(runs, "NgramMemory.add")
        with self._lock:
            if vocab_size is not None:
                self.bind(vocab_size, who="NgramMemory.add")
            self._check_ids(runs, "NgramMemory.add")
            handles = self.open([[] for _ in runs], [len(r) for r in runs])
            self.extend(handles, runs)
            self.close(handles)

    def add_texts(self, texts, tokenizer) -> None:
        """Add texts (a str or a list of them) encoded with `tokenizer` (binding the memory to its vocabulary)."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("NgramMemory.add_texts: texts must be a str or a list of str")
        with self._lock:
            self.bind(len(tokenizer), vocabulary_fingerprint(tokenizer), who="NgramMemory.add_texts")
            self.add([list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts])

    def open(self, contexts: list[list[int]], reserve: list[int | None]) -> list[int | None]:
        """Start a run per row, for a decoder: contexts[i], the tokens before what the run will hold (their last
        max_match are copied in, so what is written next matches across them; the last becomes an entry once a
        token follows it), and room for reserve[i] more tokens (None: unknown, grown as needed). Returns a
        handle per row, None where the run cannot fit in the budget (that row is not recorded)."""
        with self._lock:
            self._check_ids(contexts, "NgramMemory.open")
            handles: list[int | None] = []
            for context, room in zip(contexts, reserve):
                tail = list(context[-self.max_match:]) if context else []
                run = self._new_run(tail, len(tail) + (_SEGMENT if room is None else room))
                if run is None:
                    handles.append(None)
                    continue
                self._handles[self._next_handle] = run
                handles.append(self._next_handle)
                self._next_handle += 1
            return handles

    def extend(self, handles: list[int | None], tokens: list[list[int]]) -> None:
        """Append tokens to each handle's run and index every position that now has a token after it."""
        with self._lock:
            self._check_ids(tokens, "NgramMemory.extend")
            self._clock += 1
            positions: list[int] = []
            for handle, new in zip(handles, tokens):
                if handle is None or handle not in self._handles or not new:
                    continue
                new = list(new)
                while new:
                    run = self._runs[self._handles[handle]]
                    room = run.capacity - run.length
                    if room == 0:
                        if not self._continue(handle):
                            break
                        continue
                    part, new = new[:room], new[room:]
                    at = run.start + run.length
                    if self._tokens.device.type == "cpu":  # a view: 1.2 us where a tensor per run took 5.6
                        self._tokens.numpy()[at:at + len(part)] = part
                    else:
                        self._tokens[at:at + len(part)] = torch.tensor(part, dtype=torch.int32, device=self.device)
                    run.length += len(part)
                    run.last_used = self._clock
                    first = max(run.first_entry + run.entries, run.first_entry)
                    ready = list(range(first, run.start + run.length - 1))
                    run.entries += len(ready)
                    self._held_entries += len(ready)
                    positions += ready
            self._insert(positions)

    def close(self, handles: list[int | None]) -> None:
        """The handles' runs are finished: they may be evicted from now on."""
        with self._lock:
            for handle in handles:
                run_id = self._handles.pop(handle, None) if handle is not None else None
                if run_id is not None:
                    self._finish(run_id)

    def clear(self) -> None:
        """Forget every finished run (running ones stay)."""
        with self._lock:
            for run in self._runs.values():
                if not run.live:
                    run.last_used = -1
            self._evict_to(0)

    # ---- reading ----

    def lookup(self, contexts: torch.Tensor, lengths: torch.Tensor, *, num_candidates: int, width: int,
               min_match: int = 1, max_occurrences: int = 64) -> Matches:
        """The longest match of each context's last tokens (contexts [B, C] int64, right-padded; lengths [B]) and
        up to num_candidates continuations of `width` tokens, ranked by how often they followed it
        (`specops.ops.ngram_memory_lookup`). Runs drafted from count as used."""
        device = contexts.device
        with self._lock:
            self.counters["lookups"] += 1
            self.counters["rows_looked_up"] += contexts.shape[0]
            candidates, counts, latest, match, occurrences = ops.ngram_memory_lookup(
                self._tokens, self._entries, self._levels, contexts.to(self.device), lengths.to(self.device),
                depth=self.max_match, min_match=min(min_match, self.max_match), num_candidates=num_candidates,
                width=width, max_occurrences=max_occurrences, validate=False)
            used = latest[latest >= 0]
            if used.numel():
                self.counters["rows_matched"] += int((match > 0).sum())
                self._mark_used(used)
        return Matches(candidates.to(device), counts.to(device), match.to(device), occurrences.to(device))

    # ---- files ----

    def save(self, path) -> None:
        """Write the memory to `path` (atomically: a temporary file renamed over it). Running runs are saved as
        they stand, as finished ones."""
        path = Path(path)
        with self._lock:
            runs = sorted(self._runs.items(), key=lambda item: item[1].start)
            tokens, entries, levels, table = self._packed(runs, trim=True)
        payload = b"".join([table.numpy().tobytes(), tokens.numpy().tobytes(), entries.numpy().tobytes()])
        header = {"version": _VERSION, "max_match": self.max_match, "budget_bytes": self.budget_bytes,
                  "vocab_size": self.vocab_size, "vocabulary": self.vocabulary, "runs": int(table.shape[0]),
                  "tokens": int(tokens.numel()), "entries": int(entries.numel()), "levels": levels,
                  "sha256": hashlib.sha256(payload).hexdigest()}
        raw = json.dumps(header).encode()
        def write(temporary):
            with open(temporary, "wb") as f:
                f.write(_MAGIC + struct.pack("<I", len(raw)) + raw + payload)

        write_atomically(path, write)

    @classmethod
    def load(cls, path, *, budget_bytes: int | None = None, device="cpu") -> NgramMemory:
        """A memory saved by `save`. Raises ValueError for a file that is not one (another format, a truncated
        or altered file, another version). budget_bytes: the new budget (default: the saved one); runs that do
        not fit leave, least recently used first."""
        path = Path(path)
        data = path.read_bytes()
        where = f"NgramMemory.load: {path}"
        if not data.startswith(_MAGIC):
            raise ValueError(f"{where} is not a specops n-gram memory file")
        body = len(_MAGIC) + 4
        if len(data) < body:
            raise ValueError(f"{where} is truncated")
        (size,) = struct.unpack("<I", data[len(_MAGIC):body])
        try:
            header = json.loads(data[body:body + size])
        except ValueError:
            raise ValueError(f"{where} has a damaged header") from None
        if not isinstance(header, dict) or "version" not in header:
            raise ValueError(f"{where} has a damaged header")
        if header["version"] != _VERSION:
            raise ValueError(f"{where} was written by another version of specops (memory format "
                             f"{header['version']}, this one reads {_VERSION})")
        try:
            runs, n_tokens, n_entries = int(header["runs"]), int(header["tokens"]), int(header["entries"])
            levels = [int(v) for v in header["levels"]]
            memory = cls(budget_bytes or int(header["budget_bytes"]), max_match=int(header["max_match"]),
                         device=device)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{where} has a damaged header ({error})") from None
        payload = data[body + size:]
        expected = runs * 5 * 8 + n_tokens * _TOKEN_BYTES + n_entries * _ENTRY_BYTES
        if len(payload) != expected:
            raise ValueError(f"{where} is truncated or has trailing bytes ({len(payload):,} bytes of data, the header "
                             f"says {expected:,})")
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            raise ValueError(f"{where} is damaged: its data does not match its checksum")
        table = torch.frombuffer(bytearray(payload[:runs * 40]), dtype=torch.int64).view(runs, 5)
        tokens = torch.frombuffer(bytearray(payload[runs * 40:runs * 40 + n_tokens * 4]), dtype=torch.int32)
        entries = torch.frombuffer(bytearray(payload[runs * 40 + n_tokens * 4:]), dtype=torch.int32)
        _check_loaded(where, table, tokens, entries, levels, header.get("vocab_size"))
        with memory._lock:
            memory.vocab_size, memory.vocabulary = header.get("vocab_size"), header.get("vocabulary")
            memory._tokens, memory._entries = tokens.clone().to(memory.device), entries.clone().to(memory.device)
            memory._levels, memory._used = levels, n_tokens
            for start, context, length, entry_count, last_used in table.tolist():
                memory._runs[memory._next_id] = _Run(start, context, length, length, last_used, False, entry_count)
                memory._next_id += 1
                memory._clock = max(memory._clock, last_used)
                memory._held_slots += length + 1
                memory._held_entries += entry_count
            memory._index_starts()
            memory._evict_to(memory.budget_bytes)
        return memory

    # ---- inside ----

    def _new_run(self, tail: list[int], capacity: int) -> int | None:
        """A live run of `capacity` slots starting with `tail` (its context), or None if it cannot fit."""
        capacity = max(capacity, len(tail), 1)
        need = (capacity + 1) * _TOKEN_BYTES + _RUN_BYTES + capacity * _ENTRY_BYTES
        if need > self.budget_bytes * _AFTER_EVICTION:
            self.counters["runs_refused"] += 1
            return None
        if not self._make_room(capacity + 1):
            self.counters["runs_refused"] += 1
            return None
        self._clock += 1
        start = self._used
        self._used += capacity + 1
        if tail:
            self._tokens[start:start + len(tail)] = torch.tensor(tail, dtype=torch.int32, device=self.device)
        run_id = self._next_id
        self._next_id += 1
        self._runs[run_id] = _Run(start, len(tail), len(tail), capacity, self._clock, True)
        self._held_slots += capacity + 1
        self._start_list.append(start)
        self._start_ids.append(run_id)
        self._starts = None
        return run_id

    def _continue(self, handle: int) -> bool:
        """The handle's run is full: a new run continues it (its last max_match tokens as context)."""
        old = self._runs[self._handles[handle]]
        tail = self._tokens[old.start + old.length - min(old.length, self.max_match):old.start + old.length].tolist()
        run_id = self._new_run(tail, len(tail) + max(_SEGMENT, old.capacity))
        self._finish(self._handles[handle])
        if run_id is None:
            del self._handles[handle]
            return False
        self._handles[handle] = run_id
        return True

    def _finish(self, run_id: int) -> None:
        run = self._runs.get(run_id)
        if run is None or not run.live:
            return
        self._held_slots -= run.span()
        run.live = False
        self._held_slots += run.span()
        if run.length == run.context:  # nothing was written after its context: it holds nothing of its own
            run.last_used = -1

    def _compact_bytes(self) -> int:
        """Bytes the memory would hold compacted now (finished runs trimmed to their tokens, no free slots)."""
        return (self._held_slots * _TOKEN_BYTES + self._held_entries * _ENTRY_BYTES
                + len(self._runs) * _RUN_BYTES)

    def _make_room(self, slots: int) -> bool:
        """Make room for a run of `slots` store slots (its capacity and separator; as many index entries at most):
        evict finished runs until it fits in the budget, then make sure the store has that many free slots at its
        end, compacting or growing it within the budget. False if it cannot fit."""
        need = slots * _TOKEN_BYTES + (slots - 1) * _ENTRY_BYTES + _RUN_BYTES
        if self._compact_bytes() + need > self.budget_bytes:
            self._evict_to(int(self.budget_bytes * _AFTER_EVICTION) - need)
            if self._compact_bytes() + need > self.budget_bytes:
                return False
        # The most store slots the budget allows beside the index (with this run's entries) and the run table.
        others = (max(self._entries.numel(), sum(self._levels) + slots - 1) * _ENTRY_BYTES
                  + (len(self._runs) + 1) * _RUN_BYTES)
        largest = (self.budget_bytes - others) // _TOKEN_BYTES
        if self._used + slots <= self._tokens.numel() <= largest:
            return True
        grow = max(0, min(int(self._tokens.numel() * _GROWTH), largest - self._held_slots - slots))
        garbage = self._tokens.numel() - self._held_slots
        if garbage > self._tokens.numel() // 4 or self._used + slots + grow > largest:
            self._compact(extra=slots + grow)
        else:
            bigger = torch.full((self._used + slots + grow,), -1, dtype=torch.int32, device=self.device)
            bigger[:self._used] = self._tokens[:self._used]
            self._tokens = bigger
        return True

    def _evict_to(self, target: int) -> None:
        """Evict finished runs, least recently used first, until the compacted memory fits in `target` bytes
        (or none is left), and compact."""
        finished = sorted((r.last_used, run_id) for run_id, r in self._runs.items() if not r.live)
        held = self._compact_bytes()
        gone = set()
        for _, run_id in finished:
            if held <= target and self._runs[run_id].last_used >= 0:
                break
            run = self._runs[run_id]
            held -= run.span() * _TOKEN_BYTES + run.entries * _ENTRY_BYTES + _RUN_BYTES
            gone.add(run_id)
            if run.length > run.context:
                self.counters["runs_evicted"] += 1
                self.counters["tokens_evicted"] += run.length - run.context
        if gone:
            for run_id in gone:
                run = self._runs.pop(run_id)
                self._held_slots -= run.span()
                self._held_entries -= run.entries
            self._compact()

    def _packed(self, runs: list[tuple[int, _Run]], trim: bool, extra: int = 0):
        """(store, entries, levels, run table [R, 5] int64: start, context, length, entries, last_used) with
        `runs` (sorted by start) packed one after another in that order, each followed by one separator; `trim`:
        live runs too keep only their tokens; `extra` free slots at the end."""
        device = self.device
        spans = [(r.length + 1) if (trim or not r.live) else r.span() for _, r in runs]
        new_starts = torch.tensor([0, *spans], dtype=torch.int64).cumsum(0)
        total = int(new_starts[-1])
        tokens = torch.full((total + extra,), -1, dtype=torch.int32, device=device)
        if runs:
            old = torch.tensor([r.start for _, r in runs], dtype=torch.int64)
            lengths = torch.tensor([r.length for _, r in runs], dtype=torch.int64)
            owner = torch.repeat_interleave(torch.arange(len(runs)), lengths)
            offset = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
            tokens[(new_starts[:-1][owner] + offset).to(device)] = self._tokens[(old[owner] + offset).to(device)]
            # Entries: each maps to the run holding it, by start (of every run the index has seen since the last
            # compaction, evicted ones included); those of runs not kept leave.
            all_starts = torch.tensor(self._start_list, dtype=torch.int64)
            kept_at = {r.start: i for i, (_, r) in enumerate(runs)}
            shift = torch.full((len(all_starts),), -1, dtype=torch.int64)
            keep_run = torch.zeros(len(all_starts), dtype=torch.bool)
            for j, start in enumerate(all_starts.tolist()):
                i = kept_at.get(start)
                if i is not None:
                    shift[j] = int(new_starts[i]) - start
                    keep_run[j] = True
            entries = self._entries[:sum(self._levels)].cpu().long()
            owner_of = torch.searchsorted(all_starts, entries, right=True) - 1
            keep = (owner_of >= 0) & keep_run[owner_of.clamp(min=0)]
            moved = (entries + shift[owner_of.clamp(min=0)]).int()
            parts, levels, start = [], [], 0
            for size in self._levels:
                part = moved[start:start + size][keep[start:start + size]]
                if part.numel():
                    parts.append(part)
                    levels.append(int(part.numel()))
                start += size
            entries = torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.int32, device=device)
        else:
            entries, levels = torch.empty(0, dtype=torch.int32, device=device), []
        table = torch.tensor([[int(new_starts[i]), r.context, r.length, r.entries, r.last_used]
                              for i, (_, r) in enumerate(runs)], dtype=torch.int64).view(len(runs), 5)
        return tokens, entries, levels, table

    def _compact(self, extra: int = 0) -> None:
        """Pack the runs one after another (finished ones trimmed to their tokens), dropping evicted runs' slots
        and index entries."""
        runs = sorted(self._runs.items(), key=lambda item: item[1].start)
        tokens, entries, levels, table = self._packed(runs, trim=False, extra=extra)
        for (_, run), start in zip(runs, table[:, 0].tolist()):
            if not run.live:
                run.capacity = run.length
            run.start = start
        self._tokens, self._entries, self._levels = tokens, entries, levels
        self._used = self._held_slots
        self._index_starts()
        self.counters["compactions"] += 1

    def _insert(self, positions: list[int]) -> None:
        if not positions:
            return
        added = torch.tensor(sorted(positions), dtype=torch.int64, device=self.device)
        held, needed = sum(self._levels), sum(self._levels) + len(positions)
        if needed > self._entries.numel():  # grow the buffer, with room for what comes next within the budget
            others = self._tokens.numel() * _TOKEN_BYTES + len(self._runs) * _RUN_BYTES
            room = max(0, (self.budget_bytes - others) // _ENTRY_BYTES - needed)
            bigger = torch.empty(needed + min(needed // 4, room), dtype=torch.int32, device=self.device)
            bigger[:held] = self._entries[:held]
            self._entries = bigger
        self._levels = ops.ngram_memory_insert(self._tokens, self._entries, self._levels, added,
                                               depth=self.max_match, validate=False)

    def _index_starts(self) -> None:
        order = sorted(self._runs.items(), key=lambda item: item[1].start)
        self._start_ids = [run_id for run_id, _ in order]
        self._start_list = [r.start for _, r in order]
        self._starts = None

    def _mark_used(self, positions: torch.Tensor) -> None:
        self._clock += 1
        if self._starts is None:
            self._starts = torch.tensor(self._start_list, dtype=torch.int64)
        at = torch.searchsorted(self._starts, positions.cpu(), right=True) - 1
        for i in set(at.tolist()):
            if i >= 0:
                self._runs[self._start_ids[i]].last_used = self._clock


def _as_runs(runs, who: str) -> list[list[int]]:
    if isinstance(runs, torch.Tensor):
        runs = runs.tolist() if runs.dim() == 2 else [runs.tolist()]
    if not isinstance(runs, (list, tuple)) or not all(isinstance(r, (list, tuple)) for r in runs):
        raise TypeError(f"{who}: runs must be a list of lists of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) for r in runs for t in r):
        raise TypeError(f"{who}: token ids must be ints")
    return [list(r) for r in runs]


def _check_loaded(where: str, table, tokens, entries, levels, vocab_size) -> None:
    """What a file that passed its checksum must still be, so that nothing built from it reads out of bounds."""
    size = tokens.numel()
    if sum(levels) != entries.numel() or any(v < 1 for v in levels):
        raise ValueError(f"{where} is damaged: its index levels do not add up")
    if entries.numel() and (int(entries.min()) < 0 or int(entries.max()) + 1 >= size):
        raise ValueError(f"{where} is damaged: an index entry points outside its tokens")
    if entries.numel() and bool(((tokens[entries.long()] < 0) | (tokens[entries.long() + 1] < 0)).any()):
        raise ValueError(f"{where} is damaged: an index entry is not a token followed by a token")
    if vocab_size is not None and bool((tokens >= vocab_size).any()):
        raise ValueError(f"{where} is damaged: it holds token ids outside its vocabulary of {vocab_size}")
    end = 0
    for start, context, length, entry_count, _ in table.tolist():
        if start < end or context < 0 or length < context or start + length >= size or entry_count < 0:
            raise ValueError(f"{where} is damaged: its run table does not fit its tokens")
        end = start + length + 1
