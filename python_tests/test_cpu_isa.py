"""SPECOPS_CPU_ISA: the switch that makes the C++ kernels take a lower instruction set's copy (AVX2 on an
AVX-512 machine, or the baseline), for benchmarking both x86 paths on one machine (bench/bench_floor.py).
Each setting runs in a fresh process: the kernels read it once. The copies compute the same products to a few
ulps (16 rows: every tile shape of both), quantized_linear gives skinny_linear's bits in every copy (its
buffered path on AVX2 and the baseline, the in-register tiles below 16 rows with AVX-512), and the row
passes (written in vectors as wide as each copy's registers) give the same verification, attention and
ensemble results to float32 rounding."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = r"""
import json, torch, specops
from specops import _C
g = torch.Generator().manual_seed(0)
x, w = torch.randn(16, 300, generator=g), torch.randn(70, 300, generator=g)
out = torch.ops.specops.skinny_linear(x, w, None)
alone = all(torch.equal(out[i:i + 3], torch.ops.specops.skinny_linear(x[i:i + 3], w, None)) for i in range(14))
q = torch.randint(-127, 128, (70, 300), generator=g, dtype=torch.int8)
s = torch.rand(70, 1, generator=g) / 64
qbits = all(torch.equal(torch.ops.specops.quantized_linear(x[:m], q, s, None, None),
                        torch.ops.specops.skinny_linear(x[:m], q.float() * s, None)) for m in (1, 3, 16))
logits = torch.randn(3, 5, 1000, generator=g) * 3
drafts = torch.randint(0, 1000, (3, 4), generator=g)
probs = torch.softmax(logits[:, :4] + torch.randn(3, 4, 1000, generator=g) * 0.6, -1)
accepted, tokens = specops.ops.chain_verify(logits, drafts, probs, seed=7)
qkv = [torch.randn(1, 2, n, 64, generator=g) for n in (5, 40, 40)]
chain = torch.tensor([[[(2 << i) - 1] for i in range(5)]], dtype=torch.int32)  # node i sees nodes 0..i
attention = specops.ops.tree_attention(*qkv, chain, softcap=30.0)
members = list(torch.randn(3, 2, 1000, generator=g))
ensemble = specops.ops.ensemble_logits(members, torch.tensor([0.5, 0.3, 0.2]))
print(json.dumps({"isa": _C.cpu_isa(), "out": out.flatten().tolist(), "alone": alone, "qbits": qbits,
                  "verified": [accepted.tolist(), tokens.tolist()], "attention": attention.flatten().tolist(),
                  "ensemble": ensemble.flatten().tolist()}))
"""


def _run(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SPECOPS_CPU_ISA"}
    if value is not None:
        env["SPECOPS_CPU_ISA"] = value
    return subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)


def test_the_switch_caps_the_instruction_set_and_keeps_the_results():
    runs = {value: _run(value) for value in (None, "avx2", "base")}
    for value, run in runs.items():
        assert run.returncode == 0, (value, run.stderr[-2000:])
    found = {value: json.loads(run.stdout.strip().splitlines()[-1]) for value, run in runs.items()}
    native = found[None]["isa"]
    assert native in ("avx512", "avx2", "base")
    assert found["base"]["isa"] == "base"
    assert found["avx2"]["isa"] == ("avx2" if native == "avx512" else native)  # a cap, never a raise
    # The copies sum the same 16 lanes in the same order; the k % 16 tail and the baseline's missing FMA round
    # differently (a few ulps: the bits are promised within one copy, whatever M, not across copies).
    for value in ("avx2", "base"):
        assert found[value]["out"] == pytest.approx(found[None]["out"], rel=1e-5, abs=1e-4)
    # Within a copy a row's bits do not depend on how many rows came with it (3 rows: other tile shapes).
    assert all(found[value]["alone"] for value in found), {value: found[value]["alone"] for value in found}
    assert all(found[value]["qbits"] for value in found), {value: found[value]["qbits"] for value in found}
    for value in ("avx2", "base"):
        assert found[value]["verified"] == found[None]["verified"]
        for key in ("attention", "ensemble"):
            assert found[value][key] == pytest.approx(found[None][key], rel=1e-5, abs=1e-5), key


def test_a_bad_value_is_refused_at_import():
    run = _run("avx1024")
    assert run.returncode != 0
    assert "SPECOPS_CPU_ISA must be avx512, avx2 or base (or unset), got 'avx1024'" in run.stderr
