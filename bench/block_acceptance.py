"""How many drafts block verification keeps against token-level verification, on (p, q) pairs of the real
pair: Gemma-3-270M target, SmolLM2-135M drafter (float32 weights) across vocabularies through TLI's q
(`vocab_project`: the drafter restricted to the shared tokens, renormalized), teacher-forced on code, chains
of K = 4 and 8, target and drafter at the same temperature.

    python bench/block_acceptance.py [--prompts 8] [--new-tokens 96] [--draws 4096] [--temperatures 1.0,0.7]
                                     [--csv docs/block_acceptance.csv]

Text: Gemma's own T = 1 continuation of each HumanEval prompt (seed = prompt index). At every position t of
it, p_t is Gemma's next-token distribution and q_t the drafter's on the same text re-encoded by its
tokenizer (as tli's text crossing gives it), both at temperature T. A chain at t is K drafts x_j ~ q_{t+j}
verified against p_{t+j} (teacher forcing: the distributions along the chain are the text's, not
conditioned on the drafts). Per window, --draws chains are sampled, and for each the expected number kept is
computed exactly for both schemes (`specops.reference.expected_block_kept` for block; S_k(W) from the
position's sorted q/p ratios, so the full vocabulary is used without a pass per draw): only the drafts'
randomness is sampled. Printed per setting: mean kept per chain, block / token, and the standard error of
the paired difference with each text as one observation (its windows overlap, so neither draws nor windows
are independent); the CSV also has the standard error of the draws alone (diff_se_draws).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


class Position:
    """One position's p and q (float64, [V]) and what S(W) = sum max(0, W p - q) needs: the ratios q/p sorted
    ascending (inf where p = 0) with the running sums of p and q in that order."""

    def __init__(self, p: torch.Tensor, q: torch.Tensor):
        self.p, self.q = p, q
        ratio = torch.where(p > 0, q / p.clamp(min=1e-300), torch.inf)
        self.ratio, order = torch.sort(ratio)
        self.cum_p = torch.cumsum(p[order], 0)
        self.cum_q = torch.cumsum(q[order], 0)

    def residual_mass(self, w: torch.Tensor) -> torch.Tensor:
        """S(W) for a vector of W: the tokens with q < W p contribute W p - q."""
        i = torch.searchsorted(self.ratio, w)  # how many ratios are < W
        take = (i - 1).clamp(min=0)
        mass = w * self.cum_p[take] - self.cum_q[take]
        return torch.where(i > 0, mass.clamp(min=0.0), torch.zeros_like(w))


def expected_kept(window: list[Position], draws: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """E[kept | chain] under token-level and block verification for `draws` chains drawn from the window's q."""
    from specops.reference import expected_block_kept

    drafts = [torch.multinomial(pos.q.float(), draws, replacement=True, generator=gen) for pos in window]
    p_d = torch.stack([pos.p[x] for pos, x in zip(window, drafts)], 1)
    q_d = torch.stack([pos.q[x] for pos, x in zip(window, drafts)], 1)
    token = torch.cumprod(torch.clamp(p_d / q_d, max=1.0), 1).sum(1)
    return token, expected_block_kept(p_d, q_d, lambda j, w: window[j].residual_mass(w))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--draws", type=int, default=4096, help="chains sampled per window")
    parser.add_argument("--temperatures", default="1.0,0.7")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()

    from _timing import load_prompts

    from specops import models, ops
    from specops.vocab import vocab_map

    torch.set_num_threads(args.threads)
    target, target_tok = models.load("gemma-3-270m")
    # float32: the int8 default is built for decoding's few rows, and this reads a whole context per position
    drafter, drafter_tok = models.load("smollm2-135m")
    drafter_rows = drafter.get_output_embeddings().weight.shape[0]
    target_vocab = target.get_output_embeddings().weight.shape[0]
    target_ids = vocab_map(target_tok, drafter_tok).projection(drafter_rows)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    kept = {(t, k): ([], []) for t in temperatures for k in (4, 8)}
    text_starts = {key: [] for key in kept}  # where each text's windows begin in kept's lists
    gen = torch.Generator().manual_seed(0)
    for index, prompt in enumerate(load_prompts(0, args.prompts)):
        ids = target_tok(prompt, return_tensors="pt").input_ids
        torch.manual_seed(index)
        with torch.inference_mode():
            text = target.generate(ids, max_new_tokens=args.new_tokens, do_sample=True, temperature=1.0, top_k=0,
                                   top_p=1.0)
            start = ids.shape[1]
            target_logits = target(text).logits[0, start - 1:-1].float()
            drafter_logits = []
            for t in range(text.shape[1] - start):
                context = target_tok.decode(text[0, :start + t], skip_special_tokens=True)
                drafter_logits.append(drafter(drafter_tok(context, return_tensors="pt").input_ids).logits[0, -1])
        for temperature in temperatures:
            rows = len(drafter_logits)
            q, _, _ = ops.vocab_project(torch.stack(drafter_logits).float(), target_ids, target_vocab,
                                        temperature=temperature, seed=0)
            p = torch.softmax(target_logits.double() / temperature, -1)
            positions = [Position(p[t], q[t].double()) for t in range(rows)]
            for k in (4, 8):
                text_starts[(temperature, k)].append(len(kept[(temperature, k)][0]))
                for t in range(rows - k + 1):
                    token, block = expected_kept(positions[t:t + k], args.draws, gen)
                    kept[(temperature, k)][0].append(token)
                    kept[(temperature, k)][1].append(block)
            del positions
        done = ", ".join(f"T={t:g} K={k}: {torch.cat(kept[(t, k)][1]).mean():.3f} / "
                         f"{torch.cat(kept[(t, k)][0]).mean():.3f}" for t in temperatures for k in (4, 8))
        print(f"after prompt {index} (mean kept, block / token): {done}", flush=True)

    rows = []
    print("\n| T | K | windows | chains | token: drafts kept | block: drafts kept | block / token | "
          "difference (s.e.) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for temperature in temperatures:
        for k in (4, 8):
            tokens, blocks = kept[(temperature, k)]
            token, block = torch.cat(tokens), torch.cat(blocks)
            diff = block - token
            n = diff.numel()
            # Windows of one text overlap and share positions, so neither draws nor windows are independent:
            # the standard error takes each text (prompt) as one observation, its mean difference.
            per_text = []
            for first, last in zip(text_starts[(temperature, k)], text_starts[(temperature, k)][1:] + [len(tokens)]):
                per_text.append(torch.cat(blocks[first:last]).mean() - torch.cat(tokens[first:last]).mean())
            per_text = torch.stack(per_text)
            se = float(per_text.std()) / math.sqrt(per_text.numel())
            row = {"T": temperature, "K": k, "texts": per_text.numel(), "windows": len(tokens), "chains": n,
                   "token": float(token.mean()), "block": float(block.mean()),
                   "ratio": float(block.mean() / token.mean()), "diff": float(diff.mean()), "diff_se": se,
                   # the sampling error of the drafts alone (the texts held fixed)
                   "diff_se_draws": float(diff.std()) / math.sqrt(n)}
            rows.append(row)
            print(f"| {temperature:g} | {k} | {row['windows']} | {n} | {row['token']:.4f} | {row['block']:.4f} | "
                  f"{row['ratio']:.4f} | {row['diff']:.4f} ({se:.4f}) |")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
