"""int8_linear against quantized_linear on the embedded target's output head, and the greedy head's screen with
int8 rows against float32 rows and the whole head, on hidden rows of real greedy steps (CPU).

    python bench/bench_int8_linear.py [--rows 1,2,4,8,16,32] [--rounds 9] [--csv PATH]

1. kernel: Gemma-3-270M's head shape (262,144 x 640), random int8 weight, M int8 rows through int8_linear
   (the weight as [N, K], and packed by int8_linear_pack) against M float32 rows through quantized_linear on
   the same int8 weight (what the screen multiplied before its rows were quantized), alternating, each call
   reading the next of two weight copies (336 MB: never cached); medians and minima in ms.
2. screen: hidden rows of `ar` decoding 4 HumanEval prompts greedily (32 tokens each) on `gemma-3-270m` and
   `gemma-3-270m:int8`; then greedy_head.screened_logits on the first n of them with int8 rows (and with
   float32 rows where the CPU lacks VNNI: the screen's copy is then kept as [N, K]) against the whole head
   (skinny_linear, or the int8 head's quantized_linear), alternating; every screened argmax is checked against
   the whole head's. `ids` is the median number of ids a row computed exactly. Row counts past the decoder's
   limits (`_SCREEN_ROWS_INT8`, `_SCREEN_ROWS_OWN`) are screened too, the limits raised for the run: where
   the screen stops paying is what sets them.
The host's read bandwidth is measured at the start and the end.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _timing import int_list, load_prompts, machine_info, read_bandwidth_gbs, write_csv_columns


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 2)


def kernel_rows(rows: list[int], rounds: int) -> list[dict]:
    import specops

    n, k = 262144, 640
    g = torch.Generator().manual_seed(0)
    weights = [torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g) for _ in range(2)]
    scales = torch.rand(n, generator=g) / 100
    packed = {id(w): specops.ops.int8_linear_pack(w) for w in weights}
    out = []
    for m in rows:
        x8 = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
        xs = torch.rand(m, generator=g)
        xf = torch.randn(m, k, generator=g)
        calls = {"int8_linear": lambda w: torch.ops.specops.int8_linear(x8, xs, w, scales),
                 "int8_linear packed": lambda w: torch.ops.specops.int8_linear(x8, xs, packed[id(w)], scales),
                 "quantized_linear": lambda w: torch.ops.specops.quantized_linear(xf, w, scales[:, None], None, None)}
        times = {name: [] for name in calls}
        for r in range(rounds):
            order = list(calls) if r % 2 == 0 else list(reversed(calls))
            for name in order:
                t = time.perf_counter()
                calls[name](weights[r % 2])
                times[name].append(time.perf_counter() - t)
        row = {"part": "kernel", "case": f"{m} rows"}
        for name, ts in times.items():
            row[f"{name} median ms"] = _median_ms(ts)
            row[f"{name} min ms"] = round(min(ts) * 1e3, 2)
        row["ratio"] = round(row["quantized_linear median ms"] / row["int8_linear median ms"], 2)
        row["packed ratio"] = round(row["int8_linear median ms"] / row["int8_linear packed median ms"], 2)
        out.append(row)
        print(row, flush=True)
    return out


def screen_rows(target: str, rows: list[int], rounds: int) -> list[dict]:
    import specops
    from specops.decoding import greedy_head

    model, tokenizer = specops.models.load(target)
    head = model.get_output_embeddings()
    softcap = model.config.get_text_config().final_logit_softcapping
    hidden: list[torch.Tensor] = []
    own = greedy_head.screened_logits

    def record(head_, rows_, softcap_):
        hidden.extend(rows_.clone())
        return own(head_, rows_, softcap_)

    greedy_head.screened_logits = record
    try:
        for prompt in load_prompts(0, 4):
            specops.decode([prompt], target=model, tokenizer=tokenizer, method="ar", max_new_tokens=32,
                           temperature=0)
    finally:
        greedy_head.screened_logits = own
    if hasattr(head, "scales"):
        whole = lambda x: torch.ops.specops.quantized_linear(x, head.weight, head.scales, None, None)  # noqa: E731
        kinds = {"int8 rows": True}
    else:
        whole = lambda x: torch.ops.specops.skinny_linear(x, head.weight, None)  # noqa: E731
        kinds = {"int8 rows": True} if greedy_head._int8_rows() else {"float32 rows": False}
    fast = greedy_head._int8_rows
    out = []
    limits = greedy_head._SCREEN_ROWS_INT8, greedy_head._SCREEN_ROWS_OWN
    limit = limits[1] if hasattr(head, "scales") else limits[0]
    greedy_head._SCREEN_ROWS_INT8 = greedy_head._SCREEN_ROWS_OWN = max(rows)
    with torch.inference_mode():
        for n in rows:
            if n > len(hidden):
                continue
            x = torch.stack(hidden[:n]).contiguous()
            want = greedy_head.capped(whole(x), softcap).argmax(1)
            times = {name: [] for name in [*kinds, "whole"]}
            ids = {}
            for r in range(rounds):
                for name in (list(times) if r % 2 == 0 else list(reversed(times))):
                    if name == "whole":
                        t = time.perf_counter()
                        whole(x)
                        times[name].append(time.perf_counter() - t)
                        continue
                    greedy_head._int8_rows = (lambda flag=kinds[name]: flag)
                    saved = greedy_head._OWN_FROM
                    greedy_head._OWN_FROM = 1
                    try:
                        t = time.perf_counter()
                        got = greedy_head.screened_logits(head, x, softcap)
                        times[name].append(time.perf_counter() - t)
                    finally:
                        greedy_head._int8_rows, greedy_head._OWN_FROM = fast, saved
                    if got is None:
                        times[name][-1] = float("nan")
                        continue
                    assert torch.equal(got.argmax(1), want), (target, name, n)
                    ids[name] = statistics.median(torch.isfinite(got).sum(1).tolist())
            row = {"part": "screen", "case": f"{target}, {n} rows", "decoder limit": limit}
            for name, ts in times.items():
                row[f"{name} median ms"] = _median_ms(ts)
            for name, count in ids.items():
                row[f"{name} ids"] = count
            out.append(row)
            print(row, flush=True)
    greedy_head._SCREEN_ROWS_INT8, greedy_head._SCREEN_ROWS_OWN = limits
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int_list, default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    import specops

    print("int8_linear copy:", specops._C.int8_dot_isa(), flush=True)
    start_bw = read_bandwidth_gbs()
    rows = kernel_rows(args.rows, args.rounds)
    for target in ("gemma-3-270m", "gemma-3-270m:int8"):
        rows += screen_rows(target, args.rows, args.rounds)
    end_bw = read_bandwidth_gbs()
    info = {**machine_info("cpu"), "int8_copy": specops._C.int8_dot_isa(), "read_gbs_start": f"{start_bw:.1f}",
            "read_gbs_end": f"{end_bw:.1f}"}
    print(info)
    if args.csv:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        write_csv_columns(args.csv, rows, columns, info)
        print("wrote", args.csv)


if __name__ == "__main__":
    main()
