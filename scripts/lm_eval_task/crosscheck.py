"""Cross-check lm-eval's loglikelihoods (from its --log_samples file) against our own
scoring through the server: for each (context, continuation) we tokenize as lm-eval does,
send /v1/completions {echo: true, logprobs: 1, max_tokens: 0} and sum token_logprobs[ctxlen:],
and also sum vLLM-style `prompt_logprobs` over the same positions.

usage: python scripts/lm_eval_task/crosscheck.py SAMPLES_JSONL [BASE_URL] [TOK_DIR] [N_DOCS]
"""

import json
import sys

import requests
import transformers

samples_path = sys.argv[1]
base = (sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:8123").rstrip("/")
tok_dir = sys.argv[3] if len(sys.argv) > 3 else "/tmp/kvserve_lm_eval_tok"
n_docs = int(sys.argv[4]) if len(sys.argv) > 4 else 10**9
tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
url = f"{base}/v1/completions"


def encode_pair(context: str, continuation: str):
    """lm-eval's TemplateLM._encode_pair (trailing context spaces move to the continuation)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx) :]


def post(body):
    r = requests.post(url, json=body, timeout=60)
    if r.status_code != 200:
        raise SystemExit(f"HTTP {r.status_code}\nrequest: {json.dumps(body)}\nresponse: {r.text}")
    return r.json()


worst = 0.0
count = 0
mismatched_greedy = 0
for line_no, line in enumerate(open(samples_path)):
    if line_no >= n_docs:
        break
    s = json.loads(line)
    args = [s["arguments"][k] for k in sorted(s["arguments"], key=lambda k: int(k.split("_")[-1]))]
    for a, resp in zip(args, s["filtered_resps"]):
        ll_lmeval, greedy_lmeval = float(resp[0]), resp[1] == "True"
        ctx, cont = encode_pair(a["arg_0"], a["arg_1"])
        ctxlen, ids = len(ctx), ctx + cont
        # 1) echo + logprobs + max_tokens 0: the legacy shape, summed by hand
        out = post(
            {
                "model": "SmolLM2-135M-Instruct",
                "prompt": ids,
                "max_tokens": 0,
                "echo": True,
                "logprobs": 1,
                "temperature": 0,
            }
        )
        lp = out["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids), (len(lp["token_logprobs"]), len(ids))
        ll_echo = sum(lp["token_logprobs"][ctxlen:])
        greedy_echo = all(
            t == max(top.values())
            for t, top in zip(lp["token_logprobs"][ctxlen:], lp["top_logprobs"][ctxlen:])
        )
        # 2) vLLM's prompt_logprobs field
        out2 = post(
            {
                "model": "SmolLM2-135M-Instruct",
                "prompt": ids,
                "max_tokens": 0,
                "prompt_logprobs": 0,
                "temperature": 0,
            }
        )
        plp = out2["choices"][0]["prompt_logprobs"]
        ll_plp = sum(plp[p][str(ids[p])]["logprob"] for p in range(ctxlen, len(ids)))
        d = max(abs(ll_echo - ll_lmeval), abs(ll_plp - ll_lmeval))
        worst = max(worst, d)
        count += 1
        mismatched_greedy += greedy_echo != greedy_lmeval
        if line_no < 3:
            print(
                f"doc {s['doc_id']} {a['arg_0']!r} + {a['arg_1']!r}: ctxlen={ctxlen} cont={cont} "
                f"lm-eval={ll_lmeval:.6f} echo-sum={ll_echo:.6f} prompt_logprobs-sum={ll_plp:.6f} "
                f"greedy lm-eval={greedy_lmeval} ours={greedy_echo}"
            )
print(
    f"{count} (context, continuation) pairs checked; max |difference| = {worst:.3g}; "
    f"is_greedy mismatches = {mismatched_greedy}"
)
