#!/usr/bin/env bash
# Run an lm-evaluation-harness loglikelihood task (local data, no hub download)
# against a running kvserve server through lm-eval's `local-completions` model,
# which scores each choice with /v1/completions {echo: true, logprobs: 1, max_tokens: 1}.
#
# usage: scripts/lm_eval_local.sh [BASE_URL] [extra lm_eval args...]
#   BASE_URL  server root, default http://127.0.0.1:8123 (the /v1/completions path is added)
#   env: TOK_DIR (where the default model's tokenizer is exported, default /tmp/kvserve_lm_eval_tok),
#        OUT_DIR (results + per-sample logs, default /tmp/kvserve_lm_eval_out),
#        MODEL (served model name, default SmolLM2-135M-Instruct), LIMIT (items, default all),
#        BATCH_SIZE (prompts per request, default 1), NUM_CONCURRENT (requests in flight, default 1)
# needs: pip install lm-eval  (0.4.x), and the server started e.g. with
#   python -m kvserve serve --threads 1 --port 8123 --max-model-len 2048
set -euo pipefail
cd "$(dirname "$0")/.."                       # repository root: the task's data path is relative to it

BASE_URL="${1:-http://127.0.0.1:8123}"; shift || true
BASE_URL="${BASE_URL%/}"; BASE_URL="${BASE_URL%/v1/completions}"; BASE_URL="${BASE_URL%/v1}"
TOK_DIR="${TOK_DIR:-/tmp/kvserve_lm_eval_tok}"
OUT_DIR="${OUT_DIR:-/tmp/kvserve_lm_eval_out}"
MODEL="${MODEL:-SmolLM2-135M-Instruct}"

# lm-eval needs a tokenizer to split context / continuation: export the default model's
# (GGUF) tokenizer as a Hugging Face fast tokenizer directory.
if [ ! -f "$TOK_DIR/tokenizer.json" ]; then
  mkdir -p "$TOK_DIR"
  python - "$TOK_DIR" <<'PY'
import json, sys
from kvserve.model.loader import default_model_path
from kvserve.model.tokenizer import Tokenizer
d = sys.argv[1]
t = Tokenizer.from_gguf(default_model_path())
t.backend.save(f"{d}/tokenizer.json")
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": t.bos_token,
           "eos_token": t.eos_token, "pad_token": t.eos_token, "unk_token": "<|endoftext|>",
           "add_bos_token": False, "model_max_length": 8192, "clean_up_tokenization_spaces": False},
          open(f"{d}/tokenizer_config.json", "w"), indent=1)
PY
fi

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
LIMIT_ARGS=()
[ -n "${LIMIT:-}" ] && LIMIT_ARGS=(--limit "$LIMIT")

set -x
time lm_eval \
  --model local-completions \
  --model_args "model=$MODEL,base_url=$BASE_URL/v1/completions,num_concurrent=${NUM_CONCURRENT:-1},max_retries=1,tokenized_requests=True,tokenizer_backend=huggingface,tokenizer=$TOK_DIR,max_length=2048" \
  --include_path scripts/lm_eval_task \
  --tasks kvserve_local_facts \
  --batch_size "${BATCH_SIZE:-1}" \
  --output_path "$OUT_DIR" --log_samples \
  "${LIMIT_ARGS[@]}" "$@"
