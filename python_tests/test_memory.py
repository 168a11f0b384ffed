"""specops.NgramMemory: what it holds, its budget and least-recently-used eviction, runs written step by step,
files (round trip, and every way a file can be wrong), vocabularies, bad input, and several threads at once."""

from __future__ import annotations

import json
import random
import struct
import threading

import pytest
import torch

from specops import NgramMemory, reference
from specops.memory import _MAGIC, vocabulary_fingerprint


def runs_of(seed: int, count: int, vocab: int = 20, low: int = 5, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def lookup(memory: NgramMemory, context: list[int], k: int = 4, w: int = 4):
    found = memory.lookup(torch.tensor([context]), torch.tensor([len(context)]), num_candidates=k, width=w)
    return found.candidates[0].tolist(), found.counts[0].tolist(), int(found.match[0]), int(found.occurrences[0])


def check_index(memory: NgramMemory) -> None:
    """The memory's index is what the reference builds from its store: every followed token of every run,
    each level (oldest first, from the buffer's start) sorted."""
    tokens, entries = memory._tokens, memory._entries[:sum(memory._levels)]
    t = tokens.tolist()
    assert sorted(entries.tolist()) == [p for p in sorted(entries.tolist()) if t[p] >= 0 and t[p + 1] >= 0]
    start = 0
    for size in memory._levels:
        level = entries[start:start + size]
        keys = reference.memory_keys(tokens, level, memory.max_match).tolist()
        assert [tuple(k) + (int(e),) for k, e in zip(keys, level)] == sorted(
            tuple(k) + (int(e),) for k, e in zip(keys, level))
        start += size
    assert start == entries.numel()


def test_finds_what_was_added():
    memory = NgramMemory(max_match=8)
    memory.add([[1, 2, 3, 4, 5], [7, 3, 4, 6], [3, 4, 5, 9]], vocab_size=10)
    candidates, counts, match, occurrences = lookup(memory, [0, 2, 3, 4], w=2)
    assert match == 3 and occurrences == 1 and candidates[0] == [5, -1] and counts[0] == 1
    candidates, counts, match, occurrences = lookup(memory, [3, 4], w=1)
    assert match == 2 and occurrences == 3 and candidates[:2] == [[5], [6]] and counts[:2] == [2, 1]
    stats = memory.stats()
    assert stats["runs"] == 3 and stats["tokens"] == 13 and stats["entries"] == 10 and stats["vocab_size"] == 10
    assert stats["bytes"] == memory.nbytes <= memory.budget_bytes
    assert "3 runs" in repr(memory) and len(memory) == 13
    check_index(memory)


def test_runs_written_step_by_step_are_found_as_they_grow():
    memory = NgramMemory(max_match=16)
    memory.bind(50)
    first, second = memory.open([[1, 2, 3], [9]], [10, 10])
    # The last context token becomes an entry once a token follows it.
    memory.extend([first, second], [[4], []])
    assert lookup(memory, [2, 3], w=1)[0][0] == [4]
    memory.extend([first, second], [[5, 6], [8, 8]])
    candidates, _, match, _ = lookup(memory, [1, 2, 3, 4], w=3)
    assert match == 4 and candidates[0] == [5, 6, -1]  # its run is still being written
    assert memory.stats()["running"] == 2
    memory.close([first, second])
    assert memory.stats()["running"] == 0 and memory.stats()["runs"] == 2
    check_index(memory)


def test_a_run_longer_than_its_reservation_continues():
    memory = NgramMemory(max_match=4)
    memory.bind(100)
    (handle,) = memory.open([[]], [None])  # unknown length: 256 slots, then continued
    run = list(range(100)) * 7
    for i in range(0, len(run), 37):
        memory.extend([handle], [run[i:i + 37]])
    memory.close([handle])
    # Matches across the continuation: the 4 tokens before position 300 predict what followed them.
    candidates, _, match, _ = lookup(memory, run[296:300], w=3)
    assert match == 4 and candidates[0] == run[300:303]
    check_index(memory)


def test_budget_evicts_least_recently_used_runs():
    budget = 3000
    memory = NgramMemory(budget_bytes=budget, max_match=8)
    memory.bind(1000)
    runs = [[100 + i] + list(range(10 * i, 10 * i + 20)) for i in range(30)]
    for i, run in enumerate(runs):
        memory.add([run])
        if i == 5:
            keep = run
        if i > 5:  # run 5 is drafted from after every add: it stays recently used
            assert lookup(memory, keep[:3], w=1)[2] == 3
        assert memory.nbytes <= budget
    assert lookup(memory, runs[0][:3], w=1)[2] < 3  # long gone
    assert lookup(memory, keep[:3], w=1)[2] == 3
    assert lookup(memory, runs[-1][:3], w=1)[2] == 3  # the newest is there
    stats = memory.stats()
    assert stats["runs_evicted"] > 0 and stats["tokens_evicted"] > 0 and stats["bytes"] <= budget
    check_index(memory)


def test_running_requests_are_never_evicted():
    memory = NgramMemory(budget_bytes=2000, max_match=8)
    memory.bind(1000)
    (handle,) = memory.open([[1, 2, 3]], [50])
    memory.extend([handle], [[4, 5, 6]])
    for i in range(20):
        memory.add([list(range(10 * i, 10 * i + 20))])
    assert lookup(memory, [1, 2, 3], w=3)[0][0] == [4, 5, 6]
    assert memory.nbytes <= 2000
    # A run that cannot fit even when every finished run leaves is not recorded.
    assert memory.open([[1]], [10_000]) == [None]
    assert memory.stats()["runs_refused"] == 1


def test_budget_must_be_positive_and_max_match_in_range():
    for budget in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="budget_bytes must be an int > 0"):
            NgramMemory(budget_bytes=budget)
    for depth in (0, 65, 2.0):
        with pytest.raises(ValueError, match="max_match must be an int in"):
            NgramMemory(max_match=depth)


def test_tokens_outside_the_vocabulary_are_refused():
    memory = NgramMemory()
    memory.add([[1, 2, 3]], vocab_size=4)
    with pytest.raises(ValueError, match=r"run 0 holds the token id 4, outside the vocabulary \(\[0, 4\)\)"):
        memory.add([[1, 4]])
    with pytest.raises(ValueError, match="run 1 holds the token id -1"):
        memory.add([[1], [-1]])
    with pytest.raises(TypeError, match="runs must be a list of lists"):
        memory.add([1, 2])
    with pytest.raises(ValueError, match="another vocabulary"):
        memory.add([[1]], vocab_size=5)


def test_vocabulary_binding():
    memory = NgramMemory()
    memory.bind(100, "abc")
    memory.bind(100, "abc")
    memory.bind(100, None)  # a caller without a tokenizer: the size must agree
    with pytest.raises(ValueError, match="another vocabulary"):
        memory.bind(100, "def")
    with pytest.raises(ValueError, match="another vocabulary"):
        memory.bind(101, "abc")


def test_fingerprint_tells_vocabularies_apart():
    from toy_models import byte_tokenizer, letter_tokenizer

    assert vocabulary_fingerprint(byte_tokenizer()) == vocabulary_fingerprint(byte_tokenizer())
    assert vocabulary_fingerprint(byte_tokenizer()) != vocabulary_fingerprint(letter_tokenizer())
    assert vocabulary_fingerprint(None) is None


def test_save_and_load_round_trip(tmp_path):
    memory = NgramMemory(budget_bytes=1 << 20, max_match=12)
    memory.bind(20, "vocab")
    memory.add(runs_of(0, 40))
    (handle,) = memory.open([[1, 2]], [30])
    memory.extend([handle], [[3, 4, 5]])  # a running request is saved as it stands
    path = tmp_path / "memory.bin"
    memory.save(path)
    loaded = NgramMemory.load(path)
    assert loaded.max_match == 12 and loaded.budget_bytes == 1 << 20
    assert loaded.vocab_size == 20 and loaded.vocabulary == "vocab"
    assert loaded.stats()["tokens"] == memory.stats()["tokens"] and loaded.stats()["running"] == 0
    contexts = torch.tensor([r[:8] for r in runs_of(0, 40) if len(r) >= 8] + [[0, 0, 0, 0, 0, 1, 2, 3]])
    lengths = torch.full((contexts.shape[0],), 8)
    a = memory.lookup(contexts, lengths, num_candidates=4, width=5)
    b = loaded.lookup(contexts, lengths, num_candidates=4, width=5)
    for x, y in zip((a.candidates, a.counts, a.match, a.occurrences), (b.candidates, b.counts, b.match, b.occurrences)):
        assert torch.equal(x, y)
    check_index(loaded)
    smaller = NgramMemory.load(path, budget_bytes=4000)  # a smaller budget: the least recently used leave
    assert smaller.nbytes <= 4000 and smaller.stats()["runs"] < loaded.stats()["runs"]
    check_index(smaller)


def _saved(tmp_path) -> bytes:
    memory = NgramMemory(max_match=8)
    memory.add(runs_of(1, 10), vocab_size=20)
    path = tmp_path / "good.bin"
    memory.save(path)
    return path.read_bytes()


def _header(data: bytes) -> tuple[dict, int]:
    (size,) = struct.unpack("<I", data[len(_MAGIC):len(_MAGIC) + 4])
    return json.loads(data[len(_MAGIC) + 4:len(_MAGIC) + 4 + size]), len(_MAGIC) + 4 + size


def _rewritten(data: bytes, **changes) -> bytes:
    header, end = _header(data)
    header.update(changes)
    raw = json.dumps(header).encode()
    return _MAGIC + struct.pack("<I", len(raw)) + raw + data[end:]


@pytest.mark.parametrize("name, damage, message", [
    ("not_a_memory", lambda d: b"PK\x03\x04" + d[4:], "is not a specops n-gram memory file"),
    ("empty", lambda d: b"", "is not a specops n-gram memory file"),
    ("cut_in_the_magic", lambda d: d[:10], "is not a specops n-gram memory file"),
    ("cut_in_the_header", lambda d: d[:len(_MAGIC) + 2], "is truncated"),
    ("cut_in_the_data", lambda d: d[:-5], "is truncated or has trailing bytes"),
    ("trailing_bytes", lambda d: d + b"\x00" * 8, "is truncated or has trailing bytes"),
    ("damaged_header", lambda d: d[:len(_MAGIC) + 4] + b"x" + d[len(_MAGIC) + 5:], "has a damaged header"),
    ("another_version", lambda d: _rewritten(d, version=2), "written by another version of specops"),
    ("flipped_byte", lambda d: d[:-3] + bytes([d[-3] ^ 1]) + d[-2:], "does not match its checksum"),
    ("header_lies", lambda d: _rewritten(d, entries=_header(d)[0]["entries"] - 1), "is truncated"),
])
def test_bad_files_are_refused(tmp_path, name, damage, message):
    path = tmp_path / f"{name}.bin"
    path.write_bytes(damage(_saved(tmp_path)))
    with pytest.raises(ValueError, match=message):
        NgramMemory.load(path)


def test_a_file_that_checks_out_is_still_checked(tmp_path):
    """A file whose checksum was recomputed over bad contents (an entry pointing past the tokens) is refused
    before anything reads it."""
    import hashlib

    data = _saved(tmp_path)
    header, end = _header(data)
    payload = bytearray(data[end:])
    runs, tokens = header["runs"], header["tokens"]
    at = runs * 40 + tokens * 4  # the first entry
    payload[at:at + 4] = struct.pack("<i", tokens + 5)
    header["sha256"] = hashlib.sha256(bytes(payload)).hexdigest()
    raw = json.dumps(header).encode()
    path = tmp_path / "lies.bin"
    path.write_bytes(_MAGIC + struct.pack("<I", len(raw)) + raw + bytes(payload))
    with pytest.raises(ValueError, match="an index entry points outside its tokens"):
        NgramMemory.load(path)


def test_threads_share_one_memory():
    memory = NgramMemory(budget_bytes=200_000, max_match=16)
    memory.bind(64)
    errors = []

    def work(seed):
        try:
            rng = random.Random(seed)
            for _ in range(30):
                (handle,) = memory.open([[rng.randrange(64) for _ in range(5)]], [40])
                for _ in range(5):
                    memory.extend([handle], [[rng.randrange(64) for _ in range(rng.randint(1, 6))]])
                    context = [rng.randrange(64) for _ in range(6)]
                    memory.lookup(torch.tensor([context]), torch.tensor([6]), num_candidates=2, width=3)
                memory.close([handle])
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert memory.stats()["running"] == 0 and memory.stats()["runs"] > 0
    check_index(memory)


def test_clear_forgets_finished_runs():
    memory = NgramMemory()
    memory.add(runs_of(2, 5), vocab_size=20)
    memory.clear()
    assert memory.stats()["runs"] == 0 and memory.stats()["entries"] == 0
