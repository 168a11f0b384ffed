"""How often a tli draft would be accepted at target temperature 1, and whether drafting at another
temperature would change it: the expected acceptance sum_x min(p(x), q_tau(x)) of one draft, where p is
Gemma-3-270M's next-token distribution at T = 1 and q_tau is SmolLM2-135M's (default weights) at
temperature tau, restricted to the shared vocabulary and renormalized (what `vocab_project` draws from).

    python bench/tli_acceptance.py [--prompts 6] [--new-tokens 64] [--taus 0.5,0.6,0.7,0.8,0.9,1.0,1.1]

Positions: Gemma's own T = 1 sample of --new-tokens after each HumanEval prompt (seed = prompt index),
teacher-forced; the drafter reads the same text re-encoded by its tokenizer, as slem / tli's text
crossing gives it. Prints the running mean per tau after each prompt. Verification stays exact at any
tau (q is what the draft is drawn from); this measures only whether tau is worth exposing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--taus", default="0.5,0.6,0.7,0.8,0.9,1.0,1.1")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    taus = [float(t) for t in args.taus.split(",")]
    if not taus or any(t <= 0 for t in taus):
        parser.error("--taus: positive temperatures")

    from _timing import load_prompts

    from specops import models
    from specops.vocab import vocab_map

    torch.set_num_threads(args.threads)
    target, target_tok = models.load("gemma-3-270m")
    drafter, drafter_tok = models.load_drafter("smollm2-135m")
    drafter_rows = drafter.get_output_embeddings().weight.shape[0]
    target_rows = target.get_output_embeddings().weight.shape[0]
    target_ids = vocab_map(target_tok, drafter_tok).projection(drafter_rows)
    mapped = target_ids >= 0
    totals, positions = {t: 0.0 for t in taus}, 0
    with torch.inference_mode():
        for index, prompt in enumerate(load_prompts(0, args.prompts)):
            ids = target_tok(prompt, return_tensors="pt").input_ids
            torch.manual_seed(index)
            out = target.generate(ids, max_new_tokens=args.new_tokens, do_sample=True, temperature=1.0, top_k=0,
                                  top_p=1.0)
            start = ids.shape[1]
            p = torch.softmax(target(out).logits[0, start - 1:-1].float(), dim=-1)
            for j in range(out.shape[1] - start):
                context = target_tok.decode(out[0, :start + j], skip_special_tokens=True)
                logits = drafter(drafter_tok(context, return_tensors="pt").input_ids).logits[0, -1].float()
                for tau in taus:
                    q = torch.softmax(torch.where(mapped, logits / tau, float("-inf")), dim=-1)
                    q_target = torch.zeros(target_rows)
                    q_target[target_ids[mapped]] = q[mapped]
                    totals[tau] += float(torch.minimum(p[j], q_target).sum())
                positions += 1
            means = ", ".join(f"tau {tau:g}: {totals[tau] / positions:.3f}" for tau in taus)
            print(f"after prompt {index} ({positions} positions): {means}", flush=True)


if __name__ == "__main__":
    main()
