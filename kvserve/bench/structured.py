"""`kvserve bench structured`: structured output end to end, and what a constraint costs.

1. Schemas (--schemas DIR: JSON schema files, e.g. a JSONSchemaBench sample): each one is sent
   through a kvserve server as a chat request with `response_format: json_schema` (temperature
   0, --max-tokens), --concurrency at a time. Reports the compile rate (answered, not 400), the
   validity rate of finished outputs (checked with jsonschema: must be 100%), the truncation
   rate (finish_reason length) and the mask time per constrained token (the server's
   kvserve:structured_mask_seconds / kvserve:structured_masks).
2. Cost (offline, kvserve.LLM): time per output token after the first (TPOT) of the same chat
   prompts with and without a constraint (a JSON schema), at batch 1 and batch --batch.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from kvserve.bench import common
from kvserve.bench.loadgen import auth_headers, served_model
from kvserve.bench.servers import kvserve_server
from kvserve.bench.throughput import add_output_args

ASK = "Give one example JSON document that follows this JSON schema:\n{schema}"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "hobbies"],
}
COST_PROMPTS = [
    f"Describe person number {i} of a small village, as a JSON object." for i in range(64)
]


def add_args(p) -> None:
    from kvserve.config import add_engine_args

    g = p.add_argument_group("structured")
    g.add_argument(
        "--schemas",
        default=None,
        help="directory of JSON schema files (*.json) to run through a server",
    )
    g.add_argument(
        "--max-tokens", type=int, default=512, help="per schema request (default: %(default)s)"
    )
    g.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="schema requests in flight (default: %(default)s)",
    )
    g.add_argument(
        "--server-args",
        default="--threads 1 --max-model-len 4096",
        help="flags of the kvserve server started for the schemas (default: %(default)s)",
    )
    g.add_argument(
        "--batch", type=int, default=16, help="batch size of the cost run (default: %(default)s)"
    )
    g.add_argument(
        "--cost-tokens", type=int, default=64, help="max tokens per request in the cost run"
    )
    g.add_argument("--skip-cost", action="store_true", help="run the schemas only")
    add_output_args(p)
    add_engine_args(p)


async def run_schemas(
    base_url: str,
    api_key: str | None,
    schemas: list[tuple[str, dict]],
    max_tokens: int,
    concurrency: int,
    progress: bool,
) -> list[dict]:
    from tqdm import tqdm

    model = served_model(base_url, api_key)
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(schemas), desc="schemas", unit="schema", disable=not progress)

    async def one(client, name: str, schema: dict) -> dict:
        body = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [{"role": "user", "content": ASK.format(schema=json.dumps(schema)[:4000])}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "out", "schema": schema},
            },
        }
        async with sem:
            t0 = time.perf_counter()
            r = await client.post("/v1/chat/completions", json=body)
            seconds = time.perf_counter() - t0
        bar.update(1)
        row = {"schema": name, "status": r.status_code, "seconds": seconds}
        if r.status_code != 200:
            row["error"] = r.json().get("error", {}).get("message", "")[:300]
            return row
        choice = r.json()["choices"][0]
        text = choice["message"]["content"]
        row.update(
            finish_reason=choice["finish_reason"],
            tokens=r.json()["usage"]["completion_tokens"],
            valid=validate(text, schema) if choice["finish_reason"] == "stop" else None,
        )
        if choice["finish_reason"] == "length":
            row["tail"] = text[-160:]  # what the model was doing when max_tokens cut it
        return row

    import httpx

    async with httpx.AsyncClient(
        base_url=base_url, headers=auth_headers(api_key), timeout=3600
    ) as client:
        rows = await asyncio.gather(*(one(client, n, s) for n, s in schemas))
    bar.close()
    return rows


def validate(text: str, schema: dict) -> bool | str:
    """True, or why not: the output must parse and validate against its schema."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e)[:200]}"
    except jsonschema.SchemaError:
        return True  # jsonschema cannot read the schema itself: nothing to check against
    return True


def mask_figures(base_url: str, api_key: str | None) -> dict:
    from kvserve.bench.soak import read_metrics

    values = read_metrics(base_url, api_key)
    seconds, masks = (
        values.get("kvserve:structured_mask_seconds_total", 0),
        values.get("kvserve:structured_masks_total", 0),
    )
    return {
        "mask_seconds": seconds,
        "masks": masks,
        "mask_ms_per_token": 1000 * seconds / masks if masks else None,
    }


def summarize_schemas(rows: list[dict]) -> dict:
    compiled = [r for r in rows if r["status"] == 200]
    finished = [r for r in compiled if r["finish_reason"] == "stop"]
    valid = [r for r in finished if r["valid"] is True]
    return {
        "schemas": len(rows),
        "compiled": len(compiled),
        "finished": len(finished),
        "valid": len(valid),
        "truncated": sum(r["finish_reason"] == "length" for r in compiled),
        "compile_rate": len(compiled) / len(rows),
        "validity_rate": len(valid) / len(finished) if finished else None,
        "truncation_rate": (len(compiled) - len(finished)) / len(compiled) if compiled else None,
        "failures": [r for r in rows if r["status"] != 200 or (r.get("valid") not in (True, None))],
    }


def cost_run(args) -> list[dict]:
    """Mean TPOT with and without a constraint, at batch 1 and --batch, offline."""
    from kvserve import LLM, SamplingParams
    from kvserve.config import engine_config_from_args
    from kvserve.sampling_params import StructuredOutputs

    llm = LLM(config=engine_config_from_args(args))
    llm.engine.grammar.compiler  # the tokenizer bridge, before timing
    runs = []
    for batch in (1, args.batch):
        prompts = [[{"role": "user", "content": p}] for p in COST_PROMPTS[: max(batch, 4)]]
        for constrained in (False, True, False, True):  # interleaved: machine drift hits both
            so = StructuredOutputs(json=PERSON) if constrained else None
            params = SamplingParams(
                temperature=0, max_tokens=args.cost_tokens, structured_outputs=so
            )
            t0 = time.perf_counter()
            outs = []
            for i in range(0, len(prompts), batch):
                outs += llm.chat(prompts[i : i + batch], params, use_tqdm=False)
            wall = time.perf_counter() - t0
            tpots = [o.metrics.tpot for o in outs if o.metrics and o.metrics.tpot]
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            runs.append(
                {
                    "batch": batch,
                    "constrained": constrained,
                    "requests": len(outs),
                    "tokens": tokens,
                    "wall_s": wall,
                    "tpot_ms": 1000 * statistics.mean(tpots) if tpots else None,
                }
            )
    return runs


def cost_table(runs: list[dict]) -> tuple[list[list], dict]:
    rows, ratios = [], {}
    for batch in sorted({r["batch"] for r in runs}):
        free = [
            r["tpot_ms"]
            for r in runs
            if r["batch"] == batch and not r["constrained"] and r["tpot_ms"]
        ]
        cons = [
            r["tpot_ms"] for r in runs if r["batch"] == batch and r["constrained"] and r["tpot_ms"]
        ]
        if free and cons:
            ratio = statistics.mean(cons) / statistics.mean(free)
            ratios[batch] = ratio
            rows.append(
                [
                    batch,
                    common.fmt(statistics.mean(free)),
                    common.fmt(statistics.mean(cons)),
                    f"{100 * (ratio - 1):+.1f}%",
                ]
            )
    return rows, ratios


def main(args, argv: list[str]) -> int:
    result = common.new_result("structured", argv, args)
    progress = not args.no_progress
    if args.schemas:
        files = sorted(Path(args.schemas).glob("*.json"))
        schemas = [(f.name, json.loads(f.read_text())) for f in files]
        if not schemas:
            return common.die(f"no *.json schema files in {args.schemas}")
        with kvserve_server(args.model, args.server_args.split()) as url:
            rows = asyncio.run(
                run_schemas(url, None, schemas, args.max_tokens, args.concurrency, progress)
            )
            masks = mask_figures(url, None)
        summary = summarize_schemas(rows)
        result["schemas"] = {"rows": rows, **summary, **masks}
        print(
            common.table(
                [
                    "schemas",
                    "compiled",
                    "finished",
                    "valid of finished",
                    "truncated",
                    "mask ms/token",
                ],
                [
                    [
                        summary["schemas"],
                        summary["compiled"],
                        summary["finished"],
                        summary["valid"],
                        summary["truncated"],
                        common.fmt(masks["mask_ms_per_token"], 3),
                    ]
                ],
            )
        )
        for r in summary["failures"]:
            print(f"  {r['schema']}: {r.get('error') or r.get('valid')}", file=sys.stderr)
    if not args.skip_cost:
        runs = cost_run(args)
        rows, ratios = cost_table(runs)
        result["cost"] = {"runs": runs, "tpot_ratio": ratios}
        print(common.table(["batch", "TPOT ms, free", "TPOT ms, JSON schema", "cost"], rows))
    common.save_result(result, args.output, args.save, "structured")
    return 0
