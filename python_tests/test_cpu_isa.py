"""SPECOPS_CPU_ISA: the switch that makes the C++ kernels take a lower instruction set's copy (AVX2 on an
AVX-512 machine, or the baseline), for benchmarking both x86 paths on one machine (bench/bench_floor.py).
Each setting runs in a fresh process: the kernels read it once. The copies compute the same products to a few
ulps (16 rows: every tile shape of both)."""

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
print(json.dumps({"isa": _C.cpu_isa(), "out": out.flatten().tolist(), "alone": alone}))
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


def test_a_bad_value_is_refused_at_import():
    run = _run("avx1024")
    assert run.returncode != 0
    assert "SPECOPS_CPU_ISA must be avx512, avx2 or base (or unset), got 'avx1024'" in run.stderr
