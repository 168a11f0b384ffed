"""End-to-end benchmark: `specops.decode` against transformers' `generate` on the same model, prompts
and settings, in one run.

    python bench/bench_e2e.py [--prompts 6] [--first 0] [--new-tokens 64] [--modes greedy,sample]
                              [--configs ar,sd,ngram,slem,tli,hf-generate,hf-assisted,hf-lookup,hf-uag]
                              [--early-exit 6] [--fixed-k K] [--tree-shape 2,2] [--beam-shape 3,2] [--hetero-k K]
                              [--hf-assistant-tokens N]
                              [--hf-lookup-tokens 10] [--ngram-shape K,W] [--ngram-tables bigram]
                              [--schemes token,joint]
                              [--no-batched] [--threads 2] [--csv PATH] [--plot]
    python bench/bench_e2e.py --configs ensembles [--prompts 4] ...   # bench_ensemble.py: se, ensemble-SD
                                                                       # and transformers' ensemble weight
                                                                       # against the standard ensemble
    python bench/bench_e2e.py --configs drafters [--prompts 4] ...    # bench_drafters.py: the drafter
                                                                       # SmolLM2-135M in float32, bf16, int8
                                                                       # and int4 side by side

Target Gemma-3-270M (float32, the embedded model), prompts HumanEval/<first>..<first+prompts-1>
(problems 0-99 are for tuning), batch size 1 per prompt. Each mode (greedy; sampling at temperature 1,
top-k 0, top-p 1) runs these configurations (--configs names in brackets select them; default all but
union; "all" adds it):

  hf generate        [hf-generate] transformers `generate`, autoregressive (greedy: do_sample=False;
                     sample: do_sample=True, top_k=0)
  specops ar         [ar] `specops.decode(method="ar")`
  hf assisted        [hf-assisted] transformers assisted generation with `assistant_early_exit=N`: the
                     target's first N layers draft (transformers' layer-truncated self-drafter), with
                     transformers' default draft schedule (num_assistant_tokens 20, "constant", and
                     drafting stops early when the drafter's top probability falls below
                     assistant_confidence_threshold 0.4); --hf-assistant-tokens overrides the number
  specops sd         [sd] `specops.decode(method="sd", drafter="self:N")`, num_draft_tokens "auto"
  specops sd K=k     [sd] the same with a fixed draft length (--fixed-k)
  specops rsd-c      [trees] `specops.decode(method="rsd-c", drafter="self:N", num_draft_tokens=(b1, ...))`:
                     a draft tree of --tree-shape children per node and level (default 2,2), siblings drawn
                     without replacement, verified by recursive rejection sampling (not run by default)
  specops specinfer  [trees] the same tree with i.i.d. siblings (method "specinfer")
  specops rsd-s      [trees] `specops.decode(method="rsd-s", drafter="self:N", num_draft_tokens=(W, L))`: W
                     sequences of L tokens by Stochastic Beam Search (--beam-shape, default 3,2)
  hf prompt lookup   [hf-lookup] transformers prompt lookup decoding, `prompt_lookup_num_tokens=N`
                     (--hf-lookup-tokens, default 10 as in /work/shared/baselines/hf_baseline.py), with
                     transformers' default max_matching_ngram_size 2: the draft is what followed the
                     first earlier occurrence of the last 2 (else 1) tokens
  specops ngram      [ngram] `specops.decode(method="ngram", num_draft_tokens="auto",
                     options={"tables": T})` (--ngram-tables, default "bigram")
  specops ngram k,w  [ngram] the same with a fixed draft shape, k rows of w tokens (--ngram-shape K,W)
  hf uag             [hf-uag] transformers universal assisted generation with the drafter SmolLM2-135M
                     and its own tokenizer (`assistant_model=..., tokenizer=..., assistant_tokenizer=...`,
                     as /work/shared/baselines/hf_baseline.py calls it). Greedy: string-level re-encoding
                     (AssistedCandidateGeneratorDifferentTokenizers; target_lookbehind 10 and
                     assistant_lookbehind 10 tokens re-encoded around each draft, aligned by their longest
                     common run), the baseline of specops slem; sampling: transformers' TLI
                     (UniversalSpeculativeDecodingGenerator: drafter LM head pruned to the tokens whose
                     strings both vocabularies have, verified by speculative sampling), the baseline of
                     specops tli. Both with transformers' defaults, none overridden: num_assistant_tokens
                     20 drafter tokens, schedule "constant", and drafting stops early when the drafter's
                     probability of its token falls below assistant_confidence_threshold 0.4 (fixed: the
                     threshold's adaptation runs only for same-vocabulary assisted generation)
  specops slem       [slem] `specops.decode(method="slem", drafter=SmolLM2-135M, drafter_tokenizer=its
                     tokenizer, num_draft_tokens="auto")`: string-level exact match; the drafter runs with
                     its default weights (int8: `specops.models.drafter_weights`)
  specops tli        [tli] the same with method "tli": token-level intersection
  specops union      [union] the same with method "union": drafts over the union of both vocabularies,
                     the baseline tli improves on (not run by default)
  specops <m> K=k    [slem, tli, union] the same with a fixed draft length (--hetero-k)
  ... (batch)        specops ar / sd / ngram / slem / tli and transformers `generate` on all prompts as
                     one batch (transformers' assisted generation, prompt lookup and universal assisted
                     generation are batch-1 only)

specops and transformers get separate SmolLM2-135M objects: transformers' sampling path prunes the
assistant's LM head and remaps its embeddings in place, so it gets a copy of its own (and greedy another).

Both libraries stop at EOS or after --new-tokens tokens (no min_new_tokens, unlike
/work/shared/baselines/hf_baseline.py, so that both decode the same sequences). Every configuration
does one untimed warm-up generation first; for ngram with bigram tables that is where the model's
bigram table is built if it is not cached yet (~15 min for Gemma on a 2-core CPU), while the timed
calls include whatever each `decode` call spends on getting its tables. ngram "auto" keeps the step
costs it measured for the life of the process (ngram_shape.py), so they carry over from the warm-up
and the earlier prompts, as in a serving process. Configurations run round-robin, prompt by prompt, so that
load from other processes on a shared machine spreads over all of them; `others` reports how many
cores other processes kept busy meanwhile. Seeds: prompt i samples with seed --seed + i in both
libraries.

Reported per configuration: new tokens, tok/s (total new tokens / total wall time of the generate or
decode calls), target forward calls per generated token (transformers: a forward hook on the model,
whose drafting calls are told apart by the truncated layer count), drafter calls and drafter calls per
generated token (hf uag: a forward hook on its drafter), acceptance (accepted
/ drafted; transformers' from its candidate generator; ngram: drafts of the row each step verified),
mean draft length mean_K (draft tokens per request per target call: sd the draft length K; ngram the
draft tree's nodes, i.e. the tokens in flight, with prefixes the rows share counted once; transformers
the candidate length), the time split (specops stats; transformers: time inside model forwards from
hooks), the share of time outside model forwards, and for greedy whether every prompt's token ids
equal specops `ar`'s and transformers `generate`'s. Ratios: vs_peer is tok/s against transformers'
counterpart (ar: generate, sd: assisted, ngram: prompt lookup, batch: batched generate); vs_ar is tok/s
against specops ar in the same mode (batch rows: specops ar (batch)); slem, tli and union are compared
with hf uag. With a heterogeneous drafter, drafted and accepted count target tokens (after re-encoding:
slem, hf uag) and mean_K counts drafter tokens per step (hf uag: the candidate's target tokens); the
header gives the vocabulary intersection (`specops.vocab.vocab_map(...).summary()`).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from _timing import CpuLoad, e2e_parser, format_table, load_prompts, machine_info, parse_e2e_args, write_csv

MODES = {"greedy": dict(temperature=0.0, top_k=0, top_p=1.0), "sample": dict(temperature=1.0, top_k=0, top_p=1.0),
         "nucleus": dict(temperature=0.8, top_k=0, top_p=0.95)}  # --modes nucleus: on request
HETERO = ("slem", "tli", "union")  # specops methods for a drafter with another vocabulary
GROUPS = ("ar", "sd", "ngram", *HETERO, "trees",  # --configs
          "hf-generate", "hf-assisted", "hf-lookup", "hf-uag")
# union is the baseline tli improves on; trees (rsd-c, specinfer) are run on request
DEFAULT_GROUPS = tuple(g for g in GROUPS if g not in ("union", "trees"))
DRAFTER = "smollm2-135m"  # the heterogeneous drafter, with its own tokenizer
UAG = "hf uag"
WARMUP_TOKENS = 8
COLUMNS = ["mode", "config", "tokens", "seconds", "tok/s", "vs_peer", "vs_ar", "calls/tok", "drafter_calls",
           "drafter/tok", "acceptance", "mean_K", "prefill_s", "draft_s", "verify_s", "other_s",
           "outside_fwd", "same_as_ar", "same_as_hf", "others"]


@dataclass
class Config:
    """One configuration: what runs it and what it is compared with."""

    name: str
    family: str  # "hf" or "specops"
    group: str  # the --configs name that selects it
    peer: str | None  # the transformers configuration it is compared with
    kwargs: dict  # hf: extra `generate` arguments; specops: `specops.decode` arguments


@dataclass
class Record:
    """One configuration's totals over the prompts."""

    mode: str
    config: str
    family: str  # "hf" or "specops"
    peer: str | None = None  # the transformers configuration it is compared with
    group: str = ""  # the --configs name that selected it
    tokens: int = 0
    seconds: float = 0.0
    target_calls: int = 0
    drafter_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    in_flight: int = 0  # draft tokens per request summed over target calls (mean_K = in_flight / steps)
    prefill_seconds: float | None = None
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    forward_seconds: float = 0.0
    others: list[float] = field(default_factory=list)
    outputs: dict[int, list[int]] = field(default_factory=dict)

    def add_stats(self, stats) -> None:
        self.target_calls += stats.target_calls
        self.drafter_calls += stats.drafter_calls
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        self.steps += stats.steps
        self.in_flight += sum(stats.draft_lengths)  # sd: K per step; ngram: draft tree nodes per step
        self.prefill_seconds = (self.prefill_seconds or 0.0) + stats.prefill_seconds
        self.draft_seconds = (self.draft_seconds or 0.0) + stats.draft_seconds
        self.verify_seconds = (self.verify_seconds or 0.0) + stats.verify_seconds
        self.forward_seconds += stats.forward_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def outside_forwards(self) -> float:
        return max(0.0, self.seconds - self.forward_seconds) / self.seconds if self.seconds else 0.0


class ForwardCounter:
    """Counts and times a model's forward calls (the target's, or a transformers assistant's); calls made
    while transformers' early-exit drafter has truncated the layer count (EarlyExitCandidateGenerator)
    count as drafter calls."""

    def __init__(self, model):
        self.base = getattr(model, model.base_model_prefix)
        self.layers = self.base.config.num_hidden_layers
        self.target_calls = self.drafter_calls = 0
        self.seconds = 0.0
        self._start = 0.0
        model.register_forward_pre_hook(self._before)
        model.register_forward_hook(self._after)

    def _before(self, *_):
        self._start = time.perf_counter()

    def _after(self, *_):
        self.seconds += time.perf_counter() - self._start
        if self.base.config.num_hidden_layers < self.layers:
            self.drafter_calls += 1
        else:
            self.target_calls += 1

    def snapshot(self) -> tuple[int, int, float]:
        return self.target_calls, self.drafter_calls, self.seconds


class CandidateCounter:
    """Drafted and accepted tokens of transformers' early-exit assisted generation, prompt lookup decoding
    and universal assisted generation, read where the candidate generator is told each step's outcome, in
    target tokens (a prompt lookup step that found no match drafts 0 tokens)."""

    def __init__(self):
        from transformers.generation.candidate_generator import (
            AssistedCandidateGeneratorDifferentTokenizers,
            EarlyExitCandidateGenerator,
            PromptLookupCandidateGenerator,
            UniversalSpeculativeDecodingGenerator,
        )

        self.drafted = self.accepted = self.steps = 0
        self.settings: dict[str, str] = {}  # generator kind -> the settings it ran with, as first seen
        self._count(EarlyExitCandidateGenerator, "assisted generation", lambda generator: (
            f"num_assistant_tokens {generator.num_assistant_tokens}, schedule "
            f"{generator.assistant_generation_config.num_assistant_tokens_schedule!r}, "
            f"assistant_confidence_threshold {generator.generation_config.assistant_confidence_threshold}"))
        self._count(PromptLookupCandidateGenerator, "prompt lookup", lambda generator: (
            f"prompt_lookup_num_tokens {generator.num_output_tokens}, "
            f"max_matching_ngram_size {generator.max_matching_ngram_size}"))
        self._count(AssistedCandidateGeneratorDifferentTokenizers, "universal assisted generation (greedy)",
                    self._describe_universal)
        self._count(UniversalSpeculativeDecodingGenerator, "universal assisted generation (sampling, TLI)",
                    lambda generator: (f"{self._describe_universal(generator)}, intersection "
                                       f"{len(generator._atm_translator.target_to_assistant_input_ids):,} "
                                       "tokens"))

    @staticmethod
    def _describe_universal(generator) -> str:
        config = generator.assistant_generation_config
        return (f"num_assistant_tokens {generator.num_assistant_tokens}, schedule "
                f"{config.num_assistant_tokens_schedule!r}, assistant_confidence_threshold "
                f"{generator.generation_config.assistant_confidence_threshold}, target_lookbehind "
                f"{generator.target_lookbehind}, assistant_lookbehind {generator.assistant_lookbehind}")

    def _count(self, generator_class, kind: str, describe) -> None:
        original = generator_class.update_candidate_strategy
        counter = self

        def update_candidate_strategy(generator, input_ids, scores, num_matches):
            # A subclass patched too reaches this through its own wrapper: count each step once.
            if type(generator) is generator_class:
                counter.settings.setdefault(kind, describe(generator))
                counter.drafted += scores.shape[1] - 1
                counter.accepted += int(num_matches)
                counter.steps += 1
            return original(generator, input_ids, scores, num_matches)

        generator_class.update_candidate_strategy = update_candidate_strategy

    def snapshot(self) -> tuple[int, int, int]:
        return self.drafted, self.accepted, self.steps


class Bench:
    def __init__(self, specops, model, tokenizer, args, drafter=None):
        self.specops = specops
        self.model = model
        self.tokenizer = tokenizer
        self.args = args
        self.drafter = drafter  # (model, tokenizer) of DRAFTER for specops; transformers gets copies
        self.forwards = ForwardCounter(model)
        self.candidates = CandidateCounter()
        self.assistants: dict[bool, tuple] = {}  # do_sample -> transformers' own DRAFTER (model, tokenizer)
        self.assistant_forwards: list[ForwardCounter] = []

    def generate(self, config: Config, prompts, mode: str, seed: int, new_tokens: int):
        """One untimed generation (warm-up): a prompt string for batch 1, a list for a batch."""
        if config.family == "hf":
            self.hf_generate([prompts] if isinstance(prompts, str) else prompts, mode, seed, new_tokens,
                             config.kwargs)
        else:
            self.decode(prompts, mode, seed, new_tokens, config.kwargs)

    def run(self, config: Config, record: Record, index: int, prompts) -> None:
        """One timed generation, added to `record`; prompt `index` is the first of `prompts`."""
        if config.family == "hf":
            self.run_hf(record, index, [prompts] if isinstance(prompts, str) else prompts, config.kwargs)
        else:
            self.run_specops(record, index, prompts, config.kwargs)

    # transformers

    def assistant(self, sample: bool) -> tuple:
        """transformers' own copy of DRAFTER for universal assisted generation, one per do_sample value,
        with a forward hook counting its calls. A copy, never specops' drafter: with do_sample=True,
        transformers prunes the assistant's LM head to the vocabulary intersection and remaps its input
        embeddings in place (assistant_prune_lm_head), and caches that translator per tokenizer pair, so
        the pruned model may serve only that path (the greedy path needs the whole LM head)."""
        if sample not in self.assistants:
            model, tokenizer = self.specops.models.load(DRAFTER, device=self.args.device)
            self.assistant_forwards.append(ForwardCounter(model))
            self.assistants[sample] = model, tokenizer
        return self.assistants[sample]

    def assistant_snapshot(self) -> tuple[int, float]:
        """Forward calls and seconds of transformers' assistant copies so far."""
        return (sum(c.target_calls for c in self.assistant_forwards),
                sum(c.seconds for c in self.assistant_forwards))

    def hf_generate(self, prompts: list[str], mode: str, seed: int, new_tokens: int, assist: dict):
        """transformers generate on one prompt or a left-padded batch, with `assist` (assisted generation,
        prompt lookup or universal assisted generation arguments; assistant_model=DRAFTER stands for
        transformers' copy of it) added; returns generated ids per prompt."""
        encoded = self.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(self.model.device)
        settings = MODES[mode]
        do_sample = settings["temperature"] > 0
        if assist.get("assistant_model") == DRAFTER:
            assistant, assistant_tokenizer = self.assistant(do_sample)
            assist = {**assist, "assistant_model": assistant, "tokenizer": self.tokenizer,
                      "assistant_tokenizer": assistant_tokenizer}
        kwargs = dict(max_new_tokens=new_tokens, do_sample=do_sample,
                      pad_token_id=self.tokenizer.pad_token_id, **assist)
        if kwargs["do_sample"]:
            kwargs.update(temperature=settings["temperature"], top_k=settings["top_k"], top_p=settings["top_p"])
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = self.model.generate(**encoded, **kwargs)
        width = encoded["input_ids"].shape[1]
        pad = self.tokenizer.pad_token_id
        rows = []
        for row in out[:, width:].tolist():
            while row and row[-1] == pad:  # rows that stopped early are padded on the right
                row.pop()
            rows.append(row)
        return rows

    def run_hf(self, record: Record, index: int, prompts: list[str], assist: dict):
        calls, load = self.forwards.snapshot(), CpuLoad().start()
        drafts, assistant = self.candidates.snapshot(), self.assistant_snapshot()
        start = time.perf_counter()
        rows = self.hf_generate(prompts, record.mode, self.args.seed + index, self.args.new_tokens, assist)
        record.seconds += time.perf_counter() - start
        record.others.append(load.stop())
        target_calls, drafter_calls, seconds = (a - b for a, b in zip(self.forwards.snapshot(), calls))
        assistant_calls, assistant_seconds = (a - b for a, b in zip(self.assistant_snapshot(), assistant))
        record.target_calls += target_calls
        record.drafter_calls += drafter_calls + assistant_calls
        record.forward_seconds += seconds + assistant_seconds
        drafted, accepted, steps = (a - b for a, b in zip(self.candidates.snapshot(), drafts))
        record.drafted += drafted
        record.accepted += accepted
        record.steps += steps
        record.in_flight += drafted  # batch 1: every drafted token is in its step's forward
        for offset, row in enumerate(rows):
            record.outputs[index + offset] = row
            record.tokens += len(row)

    # specops

    def decode(self, prompts, mode: str, seed: int, new_tokens: int, kwargs: dict):
        if kwargs.get("drafter") == DRAFTER:  # the loaded model, so that no decode call loads it
            kwargs = {**kwargs, "drafter": self.drafter[0], "drafter_tokenizer": self.drafter[1]}
        return self.specops.decode(prompts, target=self.model, tokenizer=self.tokenizer, max_new_tokens=new_tokens,
                                   seed=seed, **kwargs, **MODES[mode])

    def run_specops(self, record: Record, index: int, prompts, kwargs: dict):
        load = CpuLoad().start()
        start = time.perf_counter()
        result = self.decode(prompts, record.mode, self.args.seed + index, self.args.new_tokens, kwargs)
        record.seconds += time.perf_counter() - start
        record.others.append(load.stop())
        record.add_stats(result.stats)
        rows = [result.tokens] if isinstance(prompts, str) else result.tokens
        for offset, row in enumerate(rows):
            record.outputs[index + offset] = list(row)
            record.tokens += len(row)


def _specops_kwargs(args) -> dict[str, dict]:
    """specops.decode arguments of sd, ngram, slem, tli and union with automatic draft sizes, by group."""
    kwargs = {"sd": {"method": "sd", "drafter": f"self:{args.early_exit}", "num_draft_tokens": "auto"},
              "ngram": {"method": "ngram", "num_draft_tokens": "auto", "options": {"tables": args.ngram_tables}}}
    for method in HETERO:
        kwargs[method] = {"method": method, "drafter": DRAFTER, "num_draft_tokens": "auto"}
    return kwargs


def configurations(args) -> list[Config]:
    """The batch-1 configurations --configs selects, in run order."""
    n = args.early_exit
    kwargs = _specops_kwargs(args)
    sd, ngram = kwargs["sd"], kwargs["ngram"]
    assisted = f"hf assisted early_exit={n}"
    assist = dict(assistant_early_exit=n)
    if args.hf_assistant_tokens:
        assist.update(num_assistant_tokens=args.hf_assistant_tokens)
    configs = [Config("hf generate", "hf", "hf-generate", None, {}),
               Config("specops ar", "specops", "ar", "hf generate", dict(method="ar")),
               Config(assisted, "hf", "hf-assisted", None, assist),
               Config(f"specops sd self:{n}", "specops", "sd", assisted, sd)]
    if args.fixed_k:
        configs.append(Config(f"specops sd self:{n} K={args.fixed_k}", "specops", "sd", assisted,
                              {**sd, "num_draft_tokens": args.fixed_k}))
    configs += _with_schemes(args, configs[-1])
    shape = args.tree_shape if args.tree_shape == "auto" else ",".join(map(str, args.tree_shape))
    for method in ("rsd-c", "specinfer"):
        configs.append(Config(f"specops {method} self:{n} ({shape})", "specops", "trees", assisted,
                              {**sd, "method": method, "num_draft_tokens": args.tree_shape}))
    beams = args.beam_shape if args.beam_shape == "auto" else ",".join(map(str, args.beam_shape))
    configs.append(Config(f"specops rsd-s self:{n} ({beams})", "specops", "trees", assisted,
                          {**sd, "method": "rsd-s", "num_draft_tokens": args.beam_shape}))
    configs += [Config("hf prompt lookup", "hf", "hf-lookup", None,
                       dict(prompt_lookup_num_tokens=args.hf_lookup_tokens)),
                Config("specops ngram", "specops", "ngram", "hf prompt lookup", ngram)]
    if args.ngram_shape:
        k, w = args.ngram_shape
        configs.append(Config(f"specops ngram {k},{w}", "specops", "ngram", "hf prompt lookup",
                              {**ngram, "num_draft_tokens": (k, w)}))
    configs += _with_schemes(args, configs[-1])
    configs.append(Config(UAG, "hf", "hf-uag", None, {"assistant_model": DRAFTER}))
    for method in HETERO:
        configs.append(Config(f"specops {method}", "specops", method, UAG, kwargs[method]))
        if args.hetero_k:
            configs.append(Config(f"specops {method} K={args.hetero_k}", "specops", method, UAG,
                                  {**kwargs[method], "num_draft_tokens": args.hetero_k}))
        configs += _with_schemes(args, configs[-1])
    return [c for c in configs if c.group in args.configs]


def _with_schemes(args, config: Config) -> list[Config]:
    """`config` again with option scheme = each of --schemes that its method takes (its registry choices),
    so that the schemes of a method run at the same draft setting: the fixed one where one is given."""
    from specops.decoding import registry

    choices = registry.METHODS[config.kwargs["method"]].option_choices.get("scheme", ())
    return [Config(f"{config.name} scheme={scheme}", config.family, config.group, config.peer,
                   {**config.kwargs, "options": {**config.kwargs.get("options", {}), "scheme": scheme}})
            for scheme in args.schemes if scheme in choices]


def batched_configurations(args) -> list[Config]:
    kwargs = _specops_kwargs(args)
    configs = [Config("hf generate (batch)", "hf", "hf-generate", None, {}),
               Config("specops ar (batch)", "specops", "ar", "hf generate (batch)", dict(method="ar")),
               Config(f"specops sd self:{args.early_exit} (batch)", "specops", "sd", "hf generate (batch)",
                      kwargs["sd"])]
    configs += [Config(f"specops {group} (batch)", "specops", group, "hf generate (batch)", kwargs[group])
                for group in ("ngram", "slem", "tli")]
    return [c for c in configs if c.group in args.configs]


def run_mode(bench: Bench, mode: str, prompts: list[str], args) -> list[Record]:
    single = configurations(args)
    records = [Record(mode, c.name, c.family, c.peer, c.group) for c in single]
    for config in single:  # warm-up, untimed
        bench.generate(config, prompts[0], mode, 0, WARMUP_TOKENS)
    for index, prompt in enumerate(prompts):
        for record, config in zip(records, single):
            bench.run(config, record, index, prompt)
        print(f"  {mode}: prompt {index + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    if args.batched:
        for config in batched_configurations(args):
            record = Record(mode, config.name, config.family, config.peer, config.group)
            bench.generate(config, prompts, mode, 0, WARMUP_TOKENS)
            bench.run(config, record, 0, prompts)
            records.append(record)
    return records


def identical(record: Record, reference: Record | None) -> str | None:
    if reference is None or record.mode != "greedy" or record is reference:
        return None
    same = sum(record.outputs.get(i) == tokens for i, tokens in reference.outputs.items())
    return f"{same}/{len(reference.outputs)}"


def rows_of(records: list[Record]) -> list[dict]:
    by_name = {(r.mode, r.config): r for r in records}
    rows = []
    for r in records:
        ar = by_name.get((r.mode, "specops ar"))
        hf = by_name.get((r.mode, "hf generate"))
        peer = by_name.get((r.mode, r.peer)) if r.peer else None
        if r.config.endswith("(batch)") and r.family == "specops" and r.config != "specops ar (batch)":
            ar_ref = by_name.get((r.mode, "specops ar (batch)"))
        else:
            ar_ref = ar
        other = (r.seconds - r.prefill_seconds - r.draft_seconds - r.verify_seconds
                 if r.draft_seconds is not None else None)
        rows.append({
            "mode": r.mode, "config": r.config, "tokens": r.tokens, "seconds": round(r.seconds, 3),
            "tok/s": round(r.tokens_per_second, 2),
            "vs_peer": round(r.tokens_per_second / peer.tokens_per_second, 3) if peer else None,
            "vs_ar": (round(r.tokens_per_second / ar_ref.tokens_per_second, 3)
                      if ar_ref is not None and r.family == "specops" and r is not ar_ref else None),
            "calls/tok": round(r.target_calls / r.tokens, 3) if r.tokens else None,
            "drafter_calls": r.drafter_calls if r.drafter_calls else None,
            "drafter/tok": round(r.drafter_calls / r.tokens, 3) if r.drafter_calls and r.tokens else None,
            "acceptance": round(r.accepted / r.drafted, 3) if r.drafted else None,
            "mean_K": round(r.in_flight / r.steps, 2) if r.in_flight and r.steps else None,
            "prefill_s": round(r.prefill_seconds, 3) if r.prefill_seconds is not None else None,
            "draft_s": round(r.draft_seconds, 3) if r.draft_seconds is not None else None,
            "verify_s": round(r.verify_seconds, 3) if r.verify_seconds is not None else None,
            "other_s": round(other, 3) if other is not None else None,
            "outside_fwd": f"{r.outside_forwards:.1%}",
            "same_as_ar": identical(r, ar), "same_as_hf": identical(r, hf),
            "others": round(sum(r.others) / len(r.others), 2) if r.others else None,
        })
    return rows


def _same_outputs(records: list[Record], reference: Record) -> tuple[int, int]:
    """Prompts whose token ids equal `reference`'s, and prompts compared, summed over `records`."""
    same = total = 0
    for r in records:
        for i, tokens in reference.outputs.items():
            same += r.outputs.get(i) == tokens
            total += 1
    return same, total


def _method_goals(record: Record, label: str, ar: Record | None, peer: Record | None, peer_name: str, *,
                  ar_goal: float | None, peer_goal: float, calls_goal: float, note: str = "") -> list[str]:
    """must_reach lines of one specops method in one mode: tok/s over specops ar (ar_goal None: reported
    only) and over its transformers peer, and target calls per token."""
    lines = []
    goal = f" (goal >= {ar_goal})" if ar_goal is not None else ""
    if ar and ar.tokens_per_second:
        lines.append(f"{record.config} / specops ar, {label} = "
                     f"{record.tokens_per_second / ar.tokens_per_second:.3f}{goal}{note}")
    if peer and peer.tokens_per_second:
        lines.append(f"{record.config} / {peer_name}, {label} = "
                     f"{record.tokens_per_second / peer.tokens_per_second:.3f} (goal >= {peer_goal}){note}")
    if record.tokens:
        lines.append(f"{record.config} target calls per token, {label} = "
                     f"{record.target_calls / record.tokens:.3f} (goal <= {calls_goal}){note}")
    return lines


def must_reach(records: list[Record], args) -> list[str]:
    by_name = {(r.mode, r.config): r for r in records}
    lines = []
    for mode in MODES:
        ar, hf = by_name.get((mode, "specops ar")), by_name.get((mode, "hf generate"))
        if ar and hf:
            label = "greedy" if mode == "greedy" else "sampling"
            lines.append(f"specops ar / transformers {label} generate = "
                         f"{ar.tokens_per_second / hf.tokens_per_second:.3f} (goal >= 0.95)")
    for r in records:
        if r.family == "specops" and " sd " in f" {r.config} ":
            lines.append(f"sd time outside forwards = {r.outside_forwards:.1%} (goal <= 10%)  [{r.mode}, {r.config}]")
    greedy_ar = by_name.get(("greedy", "specops ar"))
    ngram = by_name.get(("greedy", "specops ngram"))
    if ngram:
        # The goals are set for the model bigram tables; say so when a run used others.
        tables = "" if args.ngram_tables == "bigram" else f"  [ngram_tables={args.ngram_tables}]"
        lines += _method_goals(ngram, "greedy", greedy_ar, by_name.get(("greedy", "hf prompt lookup")),
                               "transformers prompt lookup", ar_goal=1.2, peer_goal=2, calls_goal=0.85,
                               note=tables)
        if greedy_ar:
            same, total = _same_outputs([ngram], greedy_ar)
            lines.append(f"specops ngram greedy outputs identical to ar: {same}/{total} (goal {total}/{total})")
    # The drafter with another vocabulary: slem against transformers' greedy UAG, tli against its TLI.
    for mode, method, label, peer, peer_goal, calls_goal in (
            ("greedy", "slem", "greedy", "transformers UAG", 2.5, 0.5),
            ("sample", "tli", "sampling", "transformers UAG (TLI)", 1.2, 0.7)):
        record = by_name.get((mode, f"specops {method}"))
        if record:
            lines += _method_goals(record, label, by_name.get((mode, "specops ar")), by_name.get((mode, UAG)),
                                   peer, ar_goal=None, peer_goal=peer_goal, calls_goal=calls_goal)
    lossless = [r for r in records if r.mode == "greedy" and r.group in HETERO]
    if greedy_ar and lossless:
        same, total = _same_outputs(lossless, greedy_ar)
        methods = ", ".join(dict.fromkeys(r.group for r in lossless))
        lines.append(f"specops {methods} greedy outputs identical to ar: {same}/{total} "
                     f"(goal {total}/{total})")
    if greedy_ar:
        others = [r for r in records if r.mode == "greedy" and r.family == "specops" and r is not greedy_ar]
        same, total = _same_outputs(others, greedy_ar)
        lines.append(f"greedy outputs identical to ar: {same}/{total} (every greedy specops configuration x prompt)")
    return lines


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _shape(text: str) -> tuple[int, int]:
    try:
        k, w = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K,W (rows, tokens per row), got {text!r}") from None
    if k < 1 or w < 1:
        raise argparse.ArgumentTypeError(f"K and W must be >= 1, got {text!r}")
    return k, w


def _auto_or(parse):
    """An argument type: "auto" (the shape chosen every step), else what `parse` makes of the text."""
    return lambda text: "auto" if text == "auto" else parse(text)


def _parser():
    from specops.decoding.ngram import TABLES as NGRAM_TABLES

    parser = e2e_parser(__doc__, "e2e", prompts=6)
    parser.add_argument("--configs", default=",".join(DEFAULT_GROUPS),
                        help="comma-separated configurations to run (module docstring), or all (adds union); "
                             "'ensembles' alone runs bench_ensemble.py, 'drafters' alone bench_drafters.py")
    parser.add_argument("--target", default="gemma-3-270m", help="embedded target model")
    parser.add_argument("--early-exit", type=int, default=6,
                        help="drafter layers: transformers assistant_early_exit=N and specops drafter self:N")
    parser.add_argument("--fixed-k", type=int, default=0, help="also run specops sd with this fixed K (0: skip)")
    parser.add_argument("--hetero-k", type=int, default=0,
                        help="also run specops slem / tli / union with this fixed K (0: skip)")
    parser.add_argument("--hf-assistant-tokens", type=int, default=0,
                        help="transformers num_assistant_tokens (0: transformers' default)")
    parser.add_argument("--hf-lookup-tokens", type=int, default=10,
                        help="transformers prompt_lookup_num_tokens (hf prompt lookup)")
    parser.add_argument("--ngram-shape", type=_shape, default=None, metavar="K,W",
                        help="also run specops ngram with a fixed shape of K rows of W tokens (with bigram tables, "
                             "K > 8 needs a bigram table of its own, built on first use)")
    parser.add_argument("--tree-shape", type=_auto_or(lambda text: tuple(int(b) for b in text.split(","))),
                        default=(2, 2), metavar="B1,B2,...|auto",
                        help="children per node at each level for specops rsd-c and specinfer (configs trees)")
    parser.add_argument("--beam-shape", type=_auto_or(_shape), default=(3, 2), metavar="W,L|auto",
                        help="beams W and levels L for specops rsd-s (configs trees)")
    parser.add_argument("--ngram-tables", default="bigram", choices=NGRAM_TABLES,
                        help="specops ngram's option tables: model n-grams that fill rows the context does not")
    parser.add_argument("--schemes", type=lambda text: [v for v in text.split(",") if v], default=[],
                        help="also run sd, ngram, slem, tli and union with option scheme = each of these that "
                             "the method takes (positional, token, joint), at the fixed draft setting where one "
                             "is given (--fixed-k, --ngram-shape, --hetero-k); sampling only changes")
    parser.add_argument("--no-batched", dest="batched", action="store_false",
                        help="skip the runs with all prompts as one batch")
    parser.add_argument("--plot", action="store_true", help="also draw docs/e2e_<device>.png")
    return parser


def _hand_off(args, modes: list[str]) -> bool:
    """--configs drafters / ensembles: the run of bench_drafters.py / bench_ensemble.py on these prompts.
    Whether one ran."""
    if "drafters" in _names(args.configs):  # drafter weights side by side: bench_drafters.py's run
        if _names(args.configs) != ["drafters"]:
            raise SystemExit("--configs drafters runs alone (bench/bench_drafters.py)")
        import bench_drafters

        bench_drafters.run(argparse.Namespace(
            prompts=args.prompts, first=args.first, new_tokens=args.new_tokens, modes=",".join(modes),
            weights=",".join(bench_drafters.WEIGHTS), threads=args.threads, seed=args.seed, device=args.device,
            csv=args.csv, plot=args.plot))
        return True
    if "ensembles" in _names(args.configs):  # ensembles of targets: bench_ensemble.py's run, on these prompts
        if _names(args.configs) != ["ensembles"]:
            raise SystemExit("--configs ensembles runs alone (bench/bench_ensemble.py)")
        import bench_ensemble

        bench_ensemble.run(argparse.Namespace(
            prompts=args.prompts, first=args.first, new_tokens=args.new_tokens, modes=",".join(modes),
            pairs="hetero,same", rules="w55,w73,cd", methods="all", early_exit=args.early_exit,
            threads=args.threads,
            seed=args.seed, device=args.device, csv=args.csv))
        return True
    return False


def main() -> None:
    parser = _parser()
    args = parse_e2e_args(parser)
    modes = _names(args.modes)
    if any(m not in MODES for m in modes):
        parser.error(f"--modes: choose from {', '.join(MODES)}")
    if _hand_off(args, modes):
        return
    args.configs = list(GROUPS) if _names(args.configs) == ["all"] else _names(args.configs)
    if not args.configs or any(c not in GROUPS for c in args.configs):
        parser.error(f"--configs: choose from {', '.join(GROUPS)} (or all)")
    if args.hf_lookup_tokens < 1:
        parser.error("--hf-lookup-tokens must be >= 1")
    if args.hetero_k < 0:
        parser.error("--hetero-k must be >= 0")
    if args.ngram_shape and args.ngram_shape[0] > 8 and args.ngram_tables == "bigram" and "ngram" in args.configs:
        print(f"note: --ngram-shape {args.ngram_shape[0]},{args.ngram_shape[1]} needs a bigram table of the top "
              f"{args.ngram_shape[0]} tokens; the warm-up builds it if it is not cached", file=sys.stderr)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import specops
    import specops.models

    start = time.perf_counter()
    model, tokenizer = specops.models.load(args.target, device=args.device)
    layers = model.config.num_hidden_layers
    if {"sd", "hf-assisted"} & set(args.configs) and not 1 <= args.early_exit < layers:
        parser.error(f"--early-exit must be in 1..{layers - 1} ({args.target} has {layers} layers)")
    drafter = vocabulary = None
    if {*HETERO, "hf-uag"} & set(args.configs):
        import specops.vocab

        # specops' drafter with its default weights (int8 for SmolLM2: bench_drafters.py); transformers'
        # assistants are float32 copies of their own.
        weights = specops.models.drafter_weights(DRAFTER)
        drafter = specops.models.load(DRAFTER, device=args.device, weights=weights)
        vocabulary = (f"drafter {DRAFTER} ({weights} weights for specops, float32 for transformers) with its own tokenizer: "
                      f"{specops.vocab.vocab_map(tokenizer, drafter[1]).summary()}")
    prompts = load_prompts(args.first, args.prompts)
    print(f"{args.target}: {layers} layers, loaded in {time.perf_counter() - start:.1f} s; "
          f"{len(prompts)} prompts (HumanEval/{args.first}..{args.first + len(prompts) - 1}), "
          f"{args.new_tokens} new tokens, {torch.get_num_threads()} threads; configs {','.join(args.configs)}",
          file=sys.stderr, flush=True)

    bench = Bench(specops, model, tokenizer, args, drafter)
    records = []
    run_start = time.perf_counter()
    for mode in modes:
        records += run_mode(bench, mode, prompts, args)
    rows = rows_of(records)

    _report(args, bench, records, rows, prompts, drafter, vocabulary, run_start)


def _report(args, bench, records, rows, prompts, drafter, vocabulary, run_start: float) -> None:
    """The table, the settings each peer used, the must-reach lines, the CSV and (--plot) the figure."""
    info = machine_info(args.device)
    print(f"\nend to end: {args.target} fp32, {len(prompts)} HumanEval prompts from {args.first}, "
          f"{args.new_tokens} new tokens, batch 1 unless (batch); {info['machine']}, {info['threads']} threads, "
          f"torch {info['torch']}; run took {time.perf_counter() - run_start:.0f} s")
    if vocabulary:
        print(vocabulary)
    print(format_table(rows, COLUMNS))
    print("\nvs_peer: tok/s over transformers' counterpart; vs_ar: over specops ar (batch rows: over specops ar "
          "(batch)); calls/tok: target forwards per new token; drafter/tok: drafter forwards per new token; "
          "mean_K: draft tokens per request per target call (ngram: draft tree nodes in flight; slem, tli, "
          "union: drafter tokens; hf uag: the candidate's target tokens); outside_fwd: time outside model "
          "forwards; others: cores kept busy by other processes.")
    for kind, settings in bench.candidates.settings.items():
        print(f"transformers {kind} used: {settings}")
    if "ngram" in args.configs:
        print(f"specops ngram used: ngram_tables {args.ngram_tables!r}")
    print()
    for line in must_reach(records, args):
        print(line)
    path = Path(args.csv or Path(__file__).parent / "results" / f"e2e_{args.device}.csv")
    write_csv(path, rows, {**info, "target": args.target, "prompts": f"{args.first}+{len(prompts)}",
                           "new_tokens": str(args.new_tokens), "early_exit": str(args.early_exit),
                           "hf_lookup_tokens": str(args.hf_lookup_tokens), "ngram_tables": args.ngram_tables,
                           "drafter": DRAFTER if drafter else "", "hetero_k": str(args.hetero_k)})
    print(f"\nwrote {path}")
    if args.plot:
        plot(rows, Path(__file__).parent.parent / "docs" / f"e2e_{args.device}.png",
             f"{args.target}, {len(prompts)} HumanEval prompts, {args.new_tokens} new tokens, "
             f"{info['machine']}, {info['threads']} threads")


def plot(rows: list[dict], png: Path, title: str) -> None:
    """tok/s of every configuration, one panel per mode; specops bars say their ratio to transformers'
    counterpart (the peer) and to specops ar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(1, len(modes), figsize=(6.2 * len(modes), 0.34 * len(rows) / len(modes) + 1.8),
                             squeeze=False)
    for ax, mode in zip(axes[0], modes):
        mine = [r for r in rows if r["mode"] == mode][::-1]
        colors = ["#1f77b4" if r["config"].startswith("specops") else "#9e9e9e" for r in mine]
        ax.barh(range(len(mine)), [r["tok/s"] for r in mine], color=colors)
        for y, r in enumerate(mine):
            notes = [f"{r['vs_peer']:.2f}x peer" if r.get("vs_peer") else "",
                     f"{r['vs_ar']:.2f}x ar" if r.get("vs_ar") else ""]
            text = ", ".join(n for n in notes if n)
            if text:
                ax.annotate(text, (r["tok/s"], y), xytext=(3, -3), textcoords="offset points", fontsize=7)
        ax.set_yticks(range(len(mine)))
        ax.set_yticklabels([r["config"] for r in mine], fontsize=7.5)
        ax.set_xlabel("tokens / s (grey: transformers, blue: specops)")
        ax.set_title(mode, fontsize=10)
        ax.set_xlim(0, max(r["tok/s"] for r in mine) * 1.35)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(w_pad=4)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120, bbox_inches="tight")
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
