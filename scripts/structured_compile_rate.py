"""How many JSON schemas of a directory compile as structured-output constraints, and how fast.

Each *.json file of the directory is one JSON schema. Each is compiled once, cold (a fresh
GrammarCompiler cache entry: grammar text, matcher build, first mask), against the model's
tokenizer; then a matcher is taken from the warm cache. Prints the compile rate, the failures
with llguidance's message, and compile time p50 / p90 / max.

    PYTHONPATH=. python3 scripts/structured_compile_rate.py DIR [--model GGUF_OR_HF_DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from kvserve.model.loader import default_model_path
from kvserve.model.tokenizer import Tokenizer
from kvserve.sampling_params import ParamError, StructuredOutputs
from kvserve.structured.compiler import GrammarCompiler


def load_tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(path) if path.endswith(".gguf") else Tokenizer.from_pretrained(path)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory", help="a directory of JSON schema files (*.json)")
    ap.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: the default model)"
    )
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = ap.parse_args()

    tokenizer = load_tokenizer(args.model or default_model_path())
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    bridge_ms = (time.perf_counter() - t0) * 1e3

    files = sorted(Path(args.directory).glob("*.json"))
    if not files:
        print(f"no *.json files in {args.directory}", file=sys.stderr)
        return 2
    compile_ms, hit_ms, failures, slowest = [], [], [], ("", 0.0)
    for path in files:
        so = StructuredOutputs(json=path.read_text(encoding="utf-8"))
        t0 = time.perf_counter()
        try:
            compiler.compile(so)
        except ParamError as e:
            failures.append((path.name, str(e)))
            continue
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        slowest = max(slowest, (path.name, compile_ms[-1]), key=lambda item: item[1])
        t0 = time.perf_counter()
        compiler.matcher(so)
        hit_ms.append((time.perf_counter() - t0) * 1e3)

    result = {
        "schemas": len(files),
        "compiled": len(compile_ms),
        "failed": len(failures),
        "compile_rate": len(compile_ms) / len(files),
        "compile_ms_p50": statistics.median(compile_ms) if compile_ms else None,
        "compile_ms_p90": percentile(compile_ms, 0.9) if compile_ms else None,
        "compile_ms_max": max(compile_ms) if compile_ms else None,
        "slowest": slowest[0],
        "cached_matcher_ms_p50": statistics.median(hit_ms) if hit_ms else None,
        "tokenizer_bridge_ms": bridge_ms,
        "failures": [{"file": name, "error": error} for name, error in failures],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{result['compiled']}/{result['schemas']} schemas compile "
        f"({100 * result['compile_rate']:.1f}%)"
    )
    if compile_ms:
        print(
            f"compile (cold: grammar, matcher, first mask): p50 {result['compile_ms_p50']:.2f} ms, "
            f"p90 {result['compile_ms_p90']:.2f} ms, "
            f"max {result['compile_ms_max']:.2f} ms ({slowest[0]})"
        )
        print(f"matcher from the cache: p50 {result['cached_matcher_ms_p50']:.3f} ms")
    print(f"tokenizer bridge (once per model): {bridge_ms:.0f} ms")
    for name, error in failures:
        print(f"  FAILED {name}: {error.splitlines()[0][:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
