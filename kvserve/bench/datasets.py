"""Benchmark workloads as token ids, so that kvserve and every peer get identical input.

random   uniform prompt / output lengths over random token ids (seeded)
w1, w2   the project's standard workloads (kvserve/bench/data/w1-w2.json)
sharegpt conversations from a ShareGPT JSON file (first human turn -> first reply's length)
prefix   groups of requests sharing a long system prompt, each with its own question
multiturn conversations of several turns, each with its own system prompt; round t sends
         system + q1 + a1 + ... + q_t (throughput only: the answers come from the engine)
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from kvserve.bench.common import model_path, workloads_path

DATASETS = ("random", "w1", "w2", "sharegpt", "prefix")
MULTITURN = (
    "multiturn"  # only `kvserve bench throughput` offers it (add_dataset_args(multiturn=True))
)


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int


def parse_range(text: str | int) -> tuple[int, int]:
    """'128' -> (128, 128); '16:256' -> (16, 256), both ends included."""
    if isinstance(text, int):
        return text, text
    lo, _, hi = str(text).partition(":")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise ValueError(f"bad length range {text!r}: write N or LO:HI with 1 <= LO <= HI")
    return a, b


def random_requests(
    num: int, input_len: str | int, output_len: str | int, seed: int, vocab_size: int
) -> list[BenchRequest]:
    """Prompt ids drawn uniformly from the vocabulary (ids below 1% of it, mostly specials,
    skipped)."""
    rng = random.Random(seed)
    (ilo, ihi), (olo, ohi) = parse_range(input_len), parse_range(output_len)
    low = max(1, vocab_size // 100)
    return [
        BenchRequest(
            [rng.randrange(low, vocab_size) for _ in range(rng.randint(ilo, ihi))],
            rng.randint(olo, ohi),
        )
        for _ in range(num)
    ]


def standard_requests(
    name: str, path: str | None = None, model: str | None = None
) -> list[BenchRequest]:
    """W1 or W2. Their prompts are token ids of the default model; for a `model` whose vocabulary
    differs (Gemma 3), each prompt is decoded to its text and encoded again by that model's
    tokenizer (with its BOS when it adds one), output lengths unchanged: the same text
    everywhere."""
    data = json.loads(workloads_path(path).read_text())
    items = data[name] if isinstance(data[name], list) else [data[name]]
    reqs = [BenchRequest(list(it["prompt_ids"]), int(it["max_tokens"])) for it in items]
    return retokenized(reqs, model) if model is not None else reqs


def retokenized(reqs: list[BenchRequest], model: str) -> list[BenchRequest]:
    """`reqs` (default-model token ids) in `model`'s tokens; unchanged when it has the same
    vocabulary."""
    from kvserve.bench.tokenize import tokenizer_of

    source, target = tokenizer_of(model_path(None)), tokenizer_of(model)
    if target.get_vocab() == source.get_vocab():
        return reqs
    return [
        BenchRequest(
            target.encode(
                source.decode(r.prompt_ids, skip_special_tokens=False), add_special_tokens=True
            ),
            r.max_tokens,
        )
        for r in reqs
    ]


def text_stream(path: str | None = None) -> list[int]:
    """Real text as token ids (the W2 prompts, docstring windows, end to end) for synthetic
    workloads."""
    return [t for r in standard_requests("w2", path) for t in r.prompt_ids]


def _window(stream: list[int], start: int, n: int) -> list[int]:
    """n tokens of the stream from `start`, wrapping around at its end."""
    return [stream[(start + i) % len(stream)] for i in range(n)]


def prefix_requests(
    num: int,
    groups: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    seed: int,
    path: str | None = None,
) -> list[BenchRequest]:
    """`num` requests in `groups` groups; a group shares one `prefix_len`-token system prompt and
    each request adds its own `question_len`-token question. Groups are interleaved (request i is
    in group i % groups), so the cache must serve a prefix while other groups run."""
    stream = text_stream(path)
    rng = random.Random(seed)

    def window(n: int) -> list[int]:
        return _window(stream, rng.randrange(len(stream)), n)

    prefixes = [window(prefix_len) for _ in range(groups)]
    return [
        BenchRequest(prefixes[i % groups] + window(question_len), output_len) for i in range(num)
    ]


@dataclass
class Conversation:
    """One chat: its system prompt and the user's question for each turn (token ids)."""

    system_ids: list[int]
    questions: list[list[int]]


def multiturn_conversations(
    num: int,
    turns: int,
    system_len: int,
    question_len: int,
    seed: int,
    path: str | None = None,
    stream: list[int] | None = None,
) -> list[Conversation]:
    """`num` conversations of `turns` turns. Each has its own `system_len`-token system prompt and a
    `question_len`-token question per turn, all windows of the real token stream (`stream`, default
    text_stream(path)) at seeded random starts. System prompts are distinct: no two begin with the
    same tokens (first min(system_len, 32)), so one conversation's cache never serves another."""
    if num < 1 or turns < 1 or system_len < 1 or question_len < 1:
        raise ValueError(
            "multiturn: --num-prompts, --turns, --prefix-len and --question-len must be >= 1"
        )
    stream = text_stream(path) if stream is None else stream
    rng = random.Random(seed)
    key_len = min(system_len, 32)
    systems: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for _ in range(100 * num):
        if len(systems) == num:
            break
        w = _window(stream, rng.randrange(len(stream)), system_len)
        if tuple(w[:key_len]) not in seen:
            seen.add(tuple(w[:key_len]))
            systems.append(w)
    if len(systems) < num:
        raise SystemExit(
            f"multiturn: could not find {num} distinct system prompts in {len(stream)} tokens "
            "of text"
        )
    return [
        Conversation(
            sys_ids,
            [_window(stream, rng.randrange(len(stream)), question_len) for _ in range(turns)],
        )
        for sys_ids in systems
    ]


def multiturn_prompt(
    system_ids: list[int], questions: list[list[int]], answers: list[list[int]]
) -> list[int]:
    """What a chat client sends at turn t = len(answers) + 1:
    system + q1 + a1 + ... + a_{t-1} + q_t."""
    if len(answers) >= len(questions):
        raise ValueError(
            f"{len(answers)} answers but only {len(questions)} questions: no turn left to ask"
        )
    ids = list(system_ids)
    for q, a in zip(questions, answers):
        ids += q
        ids += a
    return ids + list(questions[len(answers)])


def sharegpt_requests(
    path: str,
    num: int,
    seed: int,
    encode,
    output_len: int | None = None,
    max_prompt: int = 1024,
    max_total: int = 2048,
) -> list[BenchRequest]:
    """First human turn as the prompt; the first reply's token count as max_tokens (vLLM's recipe:
    skip prompts or replies under 4 tokens and pairs over the length limits)."""
    convs = json.loads(Path(path).read_text())
    random.Random(seed).shuffle(convs)
    out: list[BenchRequest] = []
    for c in convs:
        turns = c.get("conversations") or c.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt = encode(turns[0]["value"])
        reply_len = output_len or len(encode(turns[1]["value"]))
        if (
            len(prompt) < 4
            or reply_len < 4
            or len(prompt) > max_prompt
            or len(prompt) + reply_len > max_total
        ):
            continue
        out.append(BenchRequest(prompt, reply_len))
        if len(out) == num:
            break
    if not out:
        raise SystemExit(f"no usable conversation in {path}")
    return out


def gguf_vocab_size(path: str) -> int:
    """Vocabulary size from a GGUF file's tokenizer metadata, or a Hugging Face directory's
    config.json (no model load)."""
    if os.path.isdir(path):
        try:
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                vocab = json.load(f).get("vocab_size")
        except (OSError, ValueError) as e:
            raise SystemExit(f"{path}: cannot read config.json ({e}): pass --vocab-size") from e
        if not isinstance(vocab, int) or vocab <= 0:
            raise SystemExit(f"{path}/config.json has no vocab_size: pass --vocab-size")
        return vocab
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise SystemExit(f"{path} has no tokenizer.ggml.tokens: pass --vocab-size")
    return len(field.data)


def add_dataset_args(p, default_num: int = 64, multiturn: bool = False) -> None:
    """The workload flags; `multiturn` adds the multiturn dataset and --turns (throughput only)."""
    g = p.add_argument_group("workload")
    g.add_argument(
        "--dataset",
        default="w2",
        choices=DATASETS + ((MULTITURN,) if multiturn else ()),
        help="workload (default: %(default)s)",
    )
    g.add_argument(
        "--dataset-path",
        default=None,
        help="w1-w2.json for w1/w2/prefix (default: the copy in the package, "
        "kvserve/bench/data/w1-w2.json); the ShareGPT JSON file for sharegpt",
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests (default: all of w2, 32 for prefix, {default_num} otherwise); w1/w2: more "
        f"than the workload holds repeats it in order (W2 x 8 = 512 requests: a scaled-up W2)"
        + ("; multiturn: conversations (default 16)" if multiturn else ""),
    )
    g.add_argument(
        "--input-len",
        default="16:256",
        help="random: prompt tokens, N or LO:HI (default: %(default)s)",
    )
    g.add_argument(
        "--output-len",
        default=None,
        help="random: output tokens, N or LO:HI (default 32:256); prefix: N (default 64); "
        + ("multiturn: N per answer (default 64); " if multiturn else "")
        + "sharegpt: fixed N instead of the reply's length",
    )
    g.add_argument(
        "--prefix-len",
        type=int,
        default=1000,
        help="prefix: shared prompt tokens"
        + ("; multiturn: system prompt tokens" if multiturn else "")
        + " (default: %(default)s)",
    )
    g.add_argument(
        "--question-len",
        type=int,
        default=50,
        help="prefix: question tokens"
        + ("; multiturn: tokens per user turn" if multiturn else "")
        + " (default: %(default)s)",
    )
    g.add_argument(
        "--prefix-groups",
        type=int,
        default=4,
        help="prefix: groups sharing one system prompt (default: %(default)s)",
    )
    g.add_argument(
        "--vocab-size", type=int, default=None, help="random: token id range (default: the model's)"
    )
    if multiturn:
        g.add_argument(
            "--turns",
            type=int,
            default=4,
            help="multiturn: turns per conversation (default: %(default)s)",
        )


def multiturn_output_len(args) -> int:
    try:
        n = int(args.output_len or 64)
    except ValueError:
        raise SystemExit(
            f"multiturn: --output-len must be one number N, got {args.output_len!r}"
        ) from None
    if n < 1:
        raise SystemExit("multiturn: --output-len must be >= 1")
    return n


def load_conversations(args) -> list[Conversation]:
    """The multiturn workload the dataset flags describe (args.seed seeds it)."""
    try:
        return multiturn_conversations(
            args.num_prompts or 16,
            args.turns,
            args.prefix_len,
            args.question_len,
            args.seed,
            args.dataset_path,
        )
    except ValueError as e:
        raise SystemExit(str(e)) from None


def load_requests(args, model: str, encode=None, default_num: int = 64) -> list[BenchRequest]:
    """Build the workload the dataset flags describe (args.seed seeds it)."""
    d = args.dataset
    if d == MULTITURN:
        raise SystemExit(
            "--dataset multiturn runs in rounds that depend on the engine's answers: "
            "use load_conversations (kvserve bench throughput)"
        )
    std = args.dataset_path if d != "sharegpt" else None
    if d in ("w1", "w2"):
        reqs = standard_requests(d, std, model)
        if args.num_prompts:
            reqs = (reqs * -(-args.num_prompts // len(reqs)))[: args.num_prompts]
        return reqs
    if d == "random":
        vocab = args.vocab_size or gguf_vocab_size(model)
        return random_requests(
            args.num_prompts or default_num,
            args.input_len,
            args.output_len or "32:256",
            args.seed,
            vocab,
        )
    if d == "prefix":
        return prefix_requests(
            args.num_prompts or 32,
            args.prefix_groups,
            args.prefix_len,
            args.question_len,
            int(args.output_len or 64),
            args.seed,
            std,
        )
    if not args.dataset_path:
        raise SystemExit("--dataset sharegpt needs --dataset-path FILE.json")
    if encode is None:
        raise SystemExit("sharegpt needs a tokenizer")
    return sharegpt_requests(
        args.dataset_path,
        args.num_prompts or default_num,
        args.seed,
        encode,
        int(args.output_len) if args.output_len else None,
    )
