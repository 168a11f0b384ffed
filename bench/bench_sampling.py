"""What drawing a token costs on a language model's own logits: `specops.ops.chain_verify` sampling one token
per row (no drafts: the bonus token, as sampled `ar` and positional verification draw every position); with
`--kernel tree` (or `traversal`) `specops.ops.tree_verify` verifying an n-gram-like draft tree per request
(one-hot q) by its recursive walk (or traversal verification); with `--kernel block` `chain_verify`'s block
verification of 3 drafts per request with a drafter's q.

    python bench/bench_sampling.py [--kernel chain|tree|traversal|block] [--rows 1,8]
        [--settings "0.8:1.0,0.8:0.95,1.3:0.95"] [--csv PATH]

Logits: Gemma-3-270M (embedded, float32, 262,144 words) over HumanEval/40-47, the last 40 positions of each
prompt: 320 rows, computed once. Each setting T:P (temperature, top-p) is timed over groups of `rows` rows
taken from 8 places in those 320 (median over 20 calls of each group after a warm-up), then the median over
the groups. Besides: how many ids lie within 9.21 of a row's largest logit / T (the top-p cut's candidates in
the C++ kernel) and how many the cut keeps. 2 threads. The tree (`--kernel tree` or `traversal`, `rows`
requests): two rows of three drafts under the root, as `ngram` drafts them, each request's 7 nodes on 7
consecutive logits rows; the first row's drafts are the argmax of their parent's row (mostly accepted), the
second row's first draft the root row's second-best id, so walks accept drafts, reject them and draw from
residuals. The synthetic N(0, 3^2) rows of bench_chain_verify.py are flat where a language model's are peaked;
this is the case decoding meets.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from _timing import load_prompts, machine_info, markdown_table, write_csv_columns  # noqa: E402

COLUMNS = ["kernel", "rows", "temperature", "top_p", "ms", "ms_min", "ms_max", "candidates_median",
           "kept_median"]
SPAN = 9.21  # csrc/cpu/sampling.h kCandidateSpan


def real_logits(torch, specops):
    """[320, V] float32: Gemma-3-270M's logits at the last 40 positions of HumanEval/40-47."""
    model, tokenizer = specops.models.load("gemma-3-270m")
    rows = []
    with torch.no_grad():
        for prompt in load_prompts(40, 8):
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            rows.append(model(ids).logits[0, -40:].float())
    return torch.cat(rows)


def row_stats(torch, logits, temperature: float, top_p: float) -> tuple[float, float]:
    """Median candidates (ids within SPAN of the maximum of logits / T) and kept ids under top-p per row (one
    each when greedy)."""
    if temperature == 0.0:
        return 1.0, 1.0
    x = logits.double() / temperature
    m = x.max(-1, keepdim=True).values
    candidates = (x >= m - SPAN).sum(-1).double()
    w = torch.exp(x - m)
    if top_p >= 1.0:
        kept = (w > 0).sum(-1)
    else:
        sorted_w = w.sort(-1, descending=True).values
        kept = ((sorted_w.cumsum(-1) < top_p * w.sum(-1, keepdim=True)).sum(-1) + 1).clamp(max=x.shape[-1])
    return float(candidates.median()), float(kept.double().median())


TREE_PARENTS = [-1, 0, 1, 2, 0, 4, 5]  # two rows of three drafts under the root


def tree_inputs(torch, logits, start: int, batch: int):
    """(logits [B, 7, V], tokens [B, 7], parents [B, 7]) of `batch` requests from rows start, start + 7,
    ..."""
    nodes = len(TREE_PARENTS)
    rows = logits[start:start + batch * nodes].view(batch, nodes, -1).contiguous()
    best = rows.topk(2, dim=-1).indices  # [B, 7, 2]
    tokens = torch.zeros(batch, nodes, dtype=torch.long)
    for c in range(1, nodes):
        tokens[:, c] = best[:, TREE_PARENTS[c], 1 if c == 4 else 0]
    parents = torch.tensor(TREE_PARENTS).expand(batch, nodes).contiguous()
    return rows, tokens, parents


BLOCK_DRAFTS = 3


def block_inputs(torch, logits, start: int, batch: int, temperature: float):
    """(logits [B, 4, V], drafts [B, 3], q [B, 3, V]) of `batch` requests from rows start, start + 4, ...:
    each draft the argmax of its row, q a drafter's law, softmax((logits + N(0, 1)) / T)."""
    rows = logits[start:start + batch * (BLOCK_DRAFTS + 1)].view(batch, BLOCK_DRAFTS + 1, -1).contiguous()
    drafts = rows[:, :BLOCK_DRAFTS].argmax(-1)
    gen = torch.Generator().manual_seed(start)
    noisy = rows[:, :BLOCK_DRAFTS] + torch.randn(rows[:, :BLOCK_DRAFTS].shape, generator=gen)
    q = torch.softmax(noisy / max(temperature, 1e-3), -1).contiguous()
    return rows, drafts, q


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", default="chain", choices=["chain", "tree", "traversal", "block"])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--settings", default="0.8:1.0,0.8:0.95,1.3:0.95", help="temperature:top_p, comma-separated")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    import torch

    import specops
    torch.set_num_threads(2)
    logits = real_logits(torch, specops)
    total = logits.shape[0]
    results = []
    for setting in args.settings.split(","):
        temperature, top_p = (float(v) for v in setting.split(":"))
        candidates, kept = row_stats(torch, logits, temperature, top_p)
        for batch in (int(v) for v in args.rows.split(",")):
            times = []
            nodes = len(TREE_PARENTS)
            span = batch * {"tree": nodes, "traversal": nodes, "block": BLOCK_DRAFTS + 1}.get(args.kernel, 1)
            step = total // 8 if args.kernel == "chain" else (total - span) // 7
            for start in range(0, total - span + 1, step):
                kwargs = dict(temperature=torch.full((batch,), temperature),
                              top_k=torch.zeros(batch, dtype=torch.int64), top_p=torch.full((batch,), top_p),
                              seed=torch.arange(batch, dtype=torch.int64), offset=0, validate=False)
                if args.kernel == "block":
                    rows, drafts, q = block_inputs(torch, logits, start, batch, temperature)

                    def call():
                        specops.ops.chain_verify(rows, drafts, q, scheme="block", **kwargs)
                elif args.kernel in ("tree", "traversal"):
                    rows, tokens, parents = tree_inputs(torch, logits, start, batch)
                    scheme = "recursive" if args.kernel == "tree" else "traversal"

                    def call():
                        specops.ops.tree_verify(rows, tokens, parents, None, scheme=scheme, **kwargs)
                else:
                    rows = logits[start:start + batch].unsqueeze(1).contiguous()
                    none = torch.empty(batch, 0, dtype=torch.long)

                    def call():
                        specops.ops.chain_verify(rows, none, None, num_draft=None, **kwargs)
                call()
                calls = []
                for _ in range(20):
                    begin = time.perf_counter()
                    call()
                    calls.append(time.perf_counter() - begin)
                times.append(1e3 * statistics.median(calls))
            results.append(dict(kernel=args.kernel, rows=batch, temperature=temperature, top_p=top_p,
                                ms=statistics.median(times),
                                ms_min=min(times), ms_max=max(times), candidates_median=candidates,
                                kept_median=kept))
    info = machine_info("cpu")
    print(f"{info.get('machine', '')}, 2 threads; ms per call, median over {len(times)} groups of rows")
    print(markdown_table(results, COLUMNS))
    if args.csv:
        write_csv_columns(args.csv, results, COLUMNS, info)


if __name__ == "__main__":
    main()
