"""Benchmark of `specops.ops.tree_attention` (draft-tree nodes attending to a KV-cached prefix and the
tree) against SDPA with a dense mask and against causal SDPA over as many query tokens.

    python bench/bench_tree_attention.py [--device cpu|cuda] [--quick] [--csv PATH] [--threads N]
        [--batches 1,8,32] [--prefixes 512,4096,32768] [--nodes 8,32,64,128] [--heads gemma,llama8b]
        [--plot PATH]

Providers, per case (B requests, a prefix of S - N cached tokens, N tree nodes, a head configuration):
- `specops`: the op (C++ kernel on CPU, Triton on CUDA), validate=False.
- `sdpa dense`: torch's scaled_dot_product_attention with the equivalent [B, 1, N, S] boolean mask,
  what transformers does with a 4-D mask today (the mask is built before timing).
- `sdpa causal`: the floor. SDPA over the same N query tokens as a chain, causal and aligned to the
  cache's end (torch.nn.attention.bias.causal_lower_right): a tree should cost no more than a chain
  of the same size.
- `flashinfer`: FlashInfer's single-request prefill with a packed custom mask, per request, where
  FlashInfer is installed (CUDA only).
Head configurations: `gemma` (Gemma-3-270M: 4 query heads, 1 key/value head, D 256) and `llama8b`
(Llama-3-8B: 32 query heads, 8 key/value heads, D 128). Grouped-query attention everywhere (SDPA with
enable_gqa). Trees: a random bushy tree of N nodes per request (each node's parent uniform among the
earlier nodes); every prefix slot holds a token. float32 on CPU, bfloat16 on CUDA.

FLOPs: 4 * B * Hq * N * S * D (scores and values; a causal chain does slightly less, a dense mask the
same); GFLOP/s reported against that for every provider. ratio: time / `sdpa causal` time of the same
case (<= 1.1 is the goal on a GPU, <= 1.15 on a CPU). Inputs are built before timing; medians after
warm-up. --plot writes a PNG of the ratio against N.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from _timing import (
    bench_parser,
    cuda_median_time,
    find_row,
    import_specops,
    int_list,
    machine_info,
    median_time,
    parse_bench_args,
    report,
    run_cases,
)

HEADS = {"gemma": (4, 1, 256), "llama8b": (32, 8, 128)}
COLUMNS = ["heads", "B", "prefix", "N", "provider", "median_us", "gflops", "ratio", "vs_dense", "others"]


def random_tree_mask(batch: int, nodes: int, generator: torch.Generator) -> torch.Tensor:
    """[B, N, ceil(N/32)] int32 ancestor words of a random bushy tree per request (RSD construction)."""
    words = (nodes + 31) // 32
    rows = torch.zeros(batch, nodes, words, dtype=torch.int64)
    for b in range(batch):
        for i in range(nodes):
            if i:
                rows[b, i] = rows[b, int(torch.randint(i, (), generator=generator))]
            rows[b, i, i // 32] |= 1 << (i % 32)
    return torch.where(rows >= 2**31, rows - 2**32, rows).to(torch.int32)


def dense_mask(tree_mask: torch.Tensor, prefix: int) -> torch.Tensor:
    """[B, 1, N, S] bool: every prefix slot, and the tree's ancestors."""
    from specops.reference import tree_visibility

    batch, nodes, _ = tree_mask.shape
    sees = tree_visibility(tree_mask, nodes)
    return torch.cat([torch.ones(batch, nodes, prefix, dtype=torch.bool), sees], dim=-1)[:, None]


@dataclass
class Case:
    heads: str
    batch: int
    prefix: int
    nodes: int


def run_case(specops, case: Case, device: str, quick: bool) -> list[dict]:
    heads, kv_heads, dim = HEADS[case.heads]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(case.batch * 1000 + case.nodes)
    slots = case.prefix + case.nodes
    query = torch.randn(case.batch, heads, case.nodes, dim, generator=g).to(device, dtype)
    key = torch.randn(case.batch, kv_heads, slots, dim, generator=g).to(device, dtype)
    value = torch.randn(case.batch, kv_heads, slots, dim, generator=g).to(device, dtype)
    tree_mask = random_tree_mask(case.batch, case.nodes, g)
    mask = dense_mask(tree_mask, case.prefix).to(device)
    tree_mask = tree_mask.to(device)
    from torch.nn.attention.bias import causal_lower_right

    causal = causal_lower_right(case.nodes, slots)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    providers = {
        "specops": lambda: specops.ops.tree_attention(query, key, value, tree_mask, validate=False),
        "sdpa dense": lambda: sdpa(query, key, value, attn_mask=mask, enable_gqa=True),
        "sdpa causal": lambda: sdpa(query, key, value, attn_mask=causal, enable_gqa=True),
    }
    if device == "cuda":
        flashinfer = _flashinfer(query, key, value, mask)
        if flashinfer is not None:
            providers["flashinfer"] = flashinfer
    flops = 4 * case.batch * heads * case.nodes * slots * dim
    rows = []
    for name, fn in providers.items():
        try:
            if device == "cpu":
                seconds, _ = median_time(fn, warmup=2, min_runs=3 if quick else 7, min_seconds=0.05 if quick else 0.5)
            else:
                seconds = cuda_median_time(fn)
        except RuntimeError as error:  # e.g. out of memory for the dense mask at 32K
            print(f"  {name}: {error}", file=sys.stderr)
            seconds = None
        rows.append({"heads": case.heads, "B": case.batch, "prefix": case.prefix, "N": case.nodes,
                     "provider": name, "median_us": seconds * 1e6 if seconds else None,
                     "gflops": flops / seconds / 1e9 if seconds else None})
    floor = find_row(rows, "sdpa causal", heads=case.heads, B=case.batch, prefix=case.prefix, N=case.nodes)
    dense = find_row(rows, "sdpa dense", heads=case.heads, B=case.batch, prefix=case.prefix, N=case.nodes)
    for row in rows:
        if row["median_us"] and floor:
            row["ratio"] = row["median_us"] / floor["median_us"]
        if row["median_us"] and dense and row["provider"] != "sdpa dense":
            row["vs_dense"] = dense["median_us"] / row["median_us"]
    return rows


def _flashinfer(query, key, value, mask):
    """FlashInfer's single-request prefill with a custom mask, one call per request, or None."""
    try:
        import flashinfer
    except ImportError:
        return None
    batch = query.shape[0]
    per_request = [(query[b].transpose(0, 1).contiguous(), key[b].transpose(0, 1).contiguous(),
                    value[b].transpose(0, 1).contiguous(), mask[b, 0].contiguous()) for b in range(batch)]

    def run():
        for q, k, v, m in per_request:
            flashinfer.single_prefill_with_kv_cache(q, k, v, custom_mask=m)

    return run


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    for ax, provider in zip(axes, ("specops", "sdpa dense")):
        series = {}
        for r in rows:
            if r["provider"] == provider and r.get("ratio"):
                series.setdefault((r["heads"], r["B"], r["prefix"]), []).append((r["N"], r["ratio"]))
        for (heads, batch, prefix), points in sorted(series.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                    label=f"{heads} B={batch} prefix={prefix}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.15, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        nodes = sorted({r["N"] for r in rows})
        ax.set_xticks(nodes, [str(n) for n in nodes])
        ax.set_xlabel("tree nodes N")
        ax.set_title(provider)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("time / causal SDPA over N tokens")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.83, 1))
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = bench_parser(__doc__, "tree_attention", "B 1,8, prefix 512,4096, N 8,64 and fewer runs")
    parser.add_argument("--batches", type=int_list, default=None, help="B values (CPU default 1,8; CUDA 1,8,32)")
    parser.add_argument("--prefixes", type=int_list, default=None,
                        help="prefix lengths (CPU default 512,4096; CUDA 512,4096,32768)")
    parser.add_argument("--nodes", type=int_list, default=[8, 32, 64, 128], help="N values")
    parser.add_argument("--heads", default="gemma,llama8b", help="head configurations: gemma, llama8b")
    parser.add_argument("--plot", default=None, help="PNG of the ratio to causal SDPA against N")
    args, csv_path = parse_bench_args(parser, "tree_attention")
    cpu = args.device == "cpu"
    batches = args.batches or ([1, 8] if cpu else [1, 8, 32])
    prefixes = args.prefixes or ([512, 4096] if cpu else [512, 4096, 32768])
    nodes = args.nodes
    if args.quick:
        batches, prefixes, nodes = [1, 8], [512, 4096], [8, 64]
    heads = [h for h in args.heads.split(",") if h]
    if any(h not in HEADS for h in heads):
        parser.error(f"--heads: choose from {', '.join(HEADS)}")

    specops = import_specops()
    info = machine_info(args.device)
    info.update(dtype="fp32" if cpu else "bf16")
    cases = [Case(h, b, p, n) for h in heads for b in batches for p in prefixes for n in nodes]
    rows, elapsed, other_load = run_cases(
        cases, lambda c: f"{c.heads} B={c.batch} prefix={c.prefix} N={c.nodes}",
        lambda c: run_case(specops, c, args.device, args.quick), info)
    notes = [("ratio: time / sdpa causal (the same N tokens as a chain, the floor); vs_dense: sdpa dense time / "
              "this time; gflops: 4*B*Hq*N*S*D over the median time.")]
    goal_batch, limit = (8, 1.15) if cpu else (32, 1.1)  # the must-reach points
    goal = find_row(rows, "specops", heads="gemma", B=goal_batch, prefix=4096, N=64)
    dense = find_row(rows, "sdpa dense", heads="gemma", B=goal_batch, prefix=4096, N=64)
    if goal and goal.get("ratio") and dense:
        notes.append(f"goal (gemma, B={goal_batch}, prefix 4096, N=64): specops / causal SDPA = {goal['ratio']:.3f} "
                     f"(goal <= {limit}), specops vs dense-mask SDPA = {dense['median_us'] / goal['median_us']:.2f}x "
                     f"faster (goal > 1) -> {'met' if goal['ratio'] <= limit and dense['median_us'] > goal['median_us'] else 'NOT met'}")
    if args.device == "cuda":
        notes.append("CUDA times: CUDA events with L2 flushed (triton.testing.do_bench).")
    report(rows, COLUMNS, info, csv_path, other_load, args.device, notes, elapsed)
    if args.plot:
        threads = f", {info['threads']} threads" if cpu else ""
        plot(rows, args.plot, f"tree_attention, {info.get('machine', args.device)}, {info.get('dtype')}{threads}")
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
