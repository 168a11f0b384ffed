"""specops.tools.compile_check: every Triton kernel specops launches compiles for a GPU (sm_90), checked on
this CPU-only machine.

The test process runs Triton's interpreter (conftest.py), under which kernels cannot be compiled, so each
check runs in a child process without it. The suite compiles one configuration per kernel; the full
table (every configuration, sm_90 and sm_80) is `python -m specops.tools.compile_check`, in docs/gpu.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")


def _child(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_every_kernel_a_launcher_launches_is_compiled():
    """The cases reach every kernel that a module in specops/kernels launches (`name[grid](...)`): a new
    kernel, or a launcher branch that starts launching another, without a case here fails."""
    out = _child("""
import json
from specops.tools import compile_check as c
launched = {(l.kernel.fn.__module__, l.name) for l in c.kernels_launched()}
defined = {(m, n) for m, names in c.kernels_defined().items() for n in names}
print(json.dumps({"missing": sorted(map(list, defined - launched)), "defined": len(defined)}))
""")
    found = json.loads(out.strip().splitlines()[-1])
    assert found["defined"] >= 19 and not found["missing"], found


@pytest.mark.slow
def test_each_kernel_compiles_for_hopper():
    """One configuration per kernel (its largest case) compiles for sm_90, within 255 registers and the
    shared memory of a block, and spills only where `compile_check.EXPLAINED_SPILLS` says why, at most as
    much as it says (the table in docs/gpu.md has every configuration)."""
    out = _child("""
import json
from specops.tools import compile_check as c
print(json.dumps([c.check((90,), quick=True), c.EXPLAINED_SPILLS]))
""")
    rows, explained = json.loads(out.strip().splitlines()[-1])
    broken = [(r["kernel"], r.get("error") or r) for r in rows if not r.get("ok")]
    assert len(rows) >= 19 and not broken, broken
    spills = {f"{r['module']}.{r['kernel']}": r["spill_bytes"] for r in rows if r["spill_bytes"]}
    unexplained = {k: v for k, v in spills.items() if k not in explained or v > explained[k][0]}
    assert not unexplained, f"spills without a reason in compile_check.EXPLAINED_SPILLS (or above it): {unexplained}"


_BAD_KERNEL = """
import triton
import triton.language as tl

_BAD = float("-inf")


@triton.jit
def _bad_kernel(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.full((BLOCK,), _BAD, tl.float32))
"""


@pytest.mark.slow
def test_a_kernel_that_does_not_compile_is_reported(tmp_path):
    """The check can fail: a kernel reading a plain float global (what ensemble_logits once did) is
    reported as not compiling, with the compiler's reason, rather than crashing the check."""
    (tmp_path / "bad_kernel.py").write_text(_BAD_KERNEL)
    out = _child(f"""
import json, sys
sys.path.insert(0, {str(tmp_path)!r})
from bad_kernel import _bad_kernel
from specops.tools import compile_check as c
launch = c.Launch(_bad_kernel, {{"x_ptr": "*fp32", "BLOCK": "constexpr"}}, {{"BLOCK": 16}}, {{}})
print(json.dumps(c.compile_launch(launch, 90)))
""")
    row = json.loads(out.strip().splitlines()[-1])
    assert not row["ok"] and "_BAD" in row["error"], row
