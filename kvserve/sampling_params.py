"""Per-request sampling parameters, validated on construction.

Every invalid value raises ParamError (a ValueError) naming the field and the allowed range, so
the server can turn it into an HTTP 400 with `param` set. Nothing a request carries past this
check can make the sampler raise or produce NaN: floats are finite and bounded, ints fit the
types torch holds them in.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

MAX_N = 128
MAX_BEAM_WIDTH = 32  # beams of one request (each offers 2-3x this many candidates a step)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MIN_TEMPERATURE = (
    0.01  # 0 < temperature < this is raised to it (as vLLM does): logits / 1e-40 overflow
)
SEED_RANGE = (-(2**63), 2**64)  # torch.Generator.manual_seed takes [-2**63, 2**64)


class ParamError(ValueError):
    """A request parameter the engine refuses: `param` names it (an HTTP 400's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (0: only the chosen one)
    prompt_logprobs: int | None = None  # top-N logprobs of every prompt token after the first
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: "StructuredOutputs | None" = (
        None  # constrain the output (JSON schema, regex, ...)
    )
    # Beam search instead of sampling: the n best of `best_of` (default n) beams, scored as
    # transformers scores them (kvserve/core/beam.py); temperature and seed do not apply.
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0  # a finished beam's score: logprob / length ** length_penalty
    early_stopping: bool | str = (
        False  # True: stop once best_of beams finished; False: heuristic; "never"
    )

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.check()
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    def check(self) -> None:
        """Raise ParamError naming the first field out of its range (run at construction and
        again at admission)."""

        def bad(name: str, rule: str) -> None:
            value = repr(getattr(self, name))
            raise ParamError(
                name, f"{name} {rule}, got {value[:80]}{'...' if len(value) > 80 else ''}"
            )

        def integer(name: str) -> bool:
            v = getattr(self, name)
            return isinstance(v, int) and not isinstance(v, bool)

        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> bool:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return False
            v = float(v) if abs(v) < 2**1023 else math.inf
            return math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi

        if not integer("n") or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
        if not number("temperature", 0, math.inf):
            bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not number("top_p", 0, 1, lo_open=True):
            bad("top_p", "must be in (0, 1]")
        if not integer("top_k") or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not number("min_p", 0, 1):
            bad("min_p", "must be in [0, 1]")
        if not number("repetition_penalty", 0.01, 100):
            bad("repetition_penalty", "must be in [0.01, 100] (1 disables it)")
        if not number("presence_penalty", -2, 2):
            bad("presence_penalty", "must be in [-2, 2]")
        if not number("frequency_penalty", -2, 2):
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (not integer("max_tokens") or self.max_tokens < 0):
            bad("max_tokens", "must be an integer >= 1")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            bad("max_tokens", "must be >= 1 (0, scoring the prompt only, needs prompt_logprobs)")
        if not integer("min_tokens") or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not integer("logprobs") or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be in [0, 20]")
        if self.prompt_logprobs is not None and (
            not integer("prompt_logprobs") or not 0 <= self.prompt_logprobs <= 20
        ):
            bad("prompt_logprobs", "must be in [0, 20]")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"must hold at most {MAX_STOP_STRINGS} strings")
        if any(
            not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop
        ):
            bad("stop", f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if any(not is_text(s) for s in self.stop):
            bad("stop", "must be valid Unicode text (no lone surrogates)")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"must hold at most {MAX_STOP_TOKEN_IDS} token ids")
        if any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**63
            for t in self.stop_token_ids
        ):
            bad("stop_token_ids", "must be token ids (non-negative integers)")
        if self.seed is not None:
            lo, hi = SEED_RANGE
            if not integer("seed") or not lo <= self.seed or self.seed + self.n - 1 >= hi:
                bad("seed", f"must be an integer with {lo} <= seed and seed + n - 1 < 2**64")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                bad("structured_outputs", "must be a StructuredOutputs")
            self.structured_outputs.check()
        self._check_beam_search(bad, integer, number)

    def _check_beam_search(self, bad, integer, number) -> None:
        if not isinstance(self.use_beam_search, bool):
            bad("use_beam_search", "must be true or false")
        if not number("length_penalty", -100, 100):
            bad("length_penalty", "must be a number in [-100, 100]")
        if not (
            self.early_stopping is True
            or self.early_stopping is False
            or self.early_stopping == "never"
        ):
            bad("early_stopping", 'must be true, false or "never"')
        if self.best_of is not None:
            limit = MAX_BEAM_WIDTH if self.use_beam_search else self.n
            if not integer("best_of") or not self.n <= self.best_of <= limit:
                bad(
                    "best_of",
                    f"must be an integer in [n, {MAX_BEAM_WIDTH}] with use_beam_search"
                    if self.use_beam_search
                    else "must equal n (more than n needs use_beam_search)",
                )
        if not self.use_beam_search:
            return
        if self.n > MAX_BEAM_WIDTH:
            bad("n", f"must be at most {MAX_BEAM_WIDTH} with use_beam_search")
        defaults = {
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "min_tokens": 0,
            "logprobs": None,
            "prompt_logprobs": None,
            "structured_outputs": None,
        }
        for name, default in defaults.items():
            if getattr(self, name) != default:
                bad(
                    name,
                    "does not apply to beam search (use_beam_search ranks beams by the model's "
                    f"own logprobs): leave it at {'unset' if default is None else default}",
                )
        if self.stop:
            bad("stop", "stop strings are not supported with use_beam_search (stop_token_ids are)")
        if self.max_tokens == 0:
            bad("max_tokens", "must be >= 1 with use_beam_search")

    @property
    def beam_width(self) -> int:
        """Beams searched with use_beam_search."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def child(self, index: int) -> "SamplingParams":
        """Params for sample `index` of an n > 1 request: n=1, its own derived seed."""
        from dataclasses import replace

        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def is_text(s: str) -> bool:
    """True when `s` encodes to UTF-8 (no lone surrogates)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")

# Limits on a structured-output constraint, refused when a request is made (docs/server.md,
# "Limits on structured output"): what the native grammar compiler takes within its stack and
# time, far above what real schemas and grammars need.
MAX_CONSTRAINT_BYTES = 1 << 20  # a grammar, a schema's JSON text, or all choices together
MAX_REGEX_BYTES = 64 << 10
MAX_GRAMMAR_RULES = 2000  # rule definitions of a Lark or GBNF grammar
MAX_SCHEMA_DEPTH = 128  # nesting of a schema's JSON objects and arrays
MAX_SCHEMA_REFS = 1000  # "$ref"s of a schema (or of the %json blocks of a grammar)
MAX_CHOICES = 20000
MAX_WHITESPACE_PATTERN_BYTES = 1024

_RULE_LINE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(::=|:)", re.MULTILINE)
# A "$ref" key however its characters are spelled in JSON text ("\u0024ref" is "$ref" too).
_REF_KEY = re.compile(r'"(?:\$|\\u0024)(?:r|\\u0072)(?:e|\\u0065)(?:f|\\u0066)"')


def json_text_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON text (or text with JSON inside), found
    without parsing it (json.loads recurses: a 5,000-deep document is a RecursionError)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "}]":
            depth -= 1
    return deepest


def json_value_depth(value) -> int:
    """The deepest nesting of dicts and lists in a parsed JSON value, walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:  # deep enough to refuse: no need to walk on
            break
        stack.extend((c, depth + 1) for c in children)
    return deepest


def closed_objects(schema):
    """A copy of a JSON schema where every object schema with `properties` and no
    `additionalProperties` has `additionalProperties: false`; not inside allOf (each branch lists
    only part of the keys), nor where `required` names a key `properties` does not list."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: (v if k in ("allOf", "const", "enum", "default", "examples") else closed_objects(v))
        for k, v in schema.items()
    }
    props, required = out.get("properties"), out.get("required", [])
    if (
        isinstance(props, dict)
        and "additionalProperties" not in out
        and "patternProperties" not in out
        and "unevaluatedProperties" not in out
        and isinstance(required, list)
        and all(name in props for name in required)
    ):
        out["additionalProperties"] = False
    return out


def check_schema_text(text: str, what: str, bad) -> None:
    """Refuse (bad(message)) schema or grammar text past the byte, depth and $ref limits."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONSTRAINT_BYTES:
        bad(f"{what} is {size} bytes; the limit is {MAX_CONSTRAINT_BYTES}")
    depth = json_text_depth(text)
    if depth > MAX_SCHEMA_DEPTH:
        bad(f"{what} nests {depth} levels of objects and arrays; the limit is {MAX_SCHEMA_DEPTH}")
    refs = len(_REF_KEY.findall(text))
    if refs > MAX_SCHEMA_REFS:
        bad(f"{what} has {refs} $ref; the limit is {MAX_SCHEMA_REFS}")


@dataclass
class StructuredOutputs:
    """A constraint on the generated text (vLLM's `structured_outputs`): exactly one of
    `json` (a JSON schema: a dict or its JSON text), `json_object` (any JSON object), `regex`,
    `choice` (one of these strings) or `grammar` (Lark syntax as llguidance reads it, or GBNF).
    `disable_any_whitespace` makes JSON compact (no whitespace between its tokens), as in vLLM;
    `whitespace_pattern` (a regex, outlines' and vLLM's option) is the whitespace JSON may take
    between its tokens instead."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        self.check()

    @property
    def kind(self) -> str:
        """The constraint's kind: one of STRUCTURED_OUTPUT_KINDS (after check())."""
        return self._kinds_set()[0]

    def _kinds_set(self) -> list[str]:
        return [
            k
            for k in STRUCTURED_OUTPUT_KINDS
            if (self.json_object is True if k == "json_object" else getattr(self, k) is not None)
        ]

    def check(self) -> None:
        """Raise ParamError("structured_outputs", ...) unless exactly one kind is set, with a value
        of the right type."""
        bad = _structured_outputs_error
        for flag in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, flag), bool):
                bad(f"{flag} must be true or false")
        kinds = self._kinds_set()
        if len(kinds) != 1:
            bad(
                f"exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)} must be set, got "
                f"{', '.join(kinds) if kinds else 'none'}"
            )
        kind = kinds[0]
        pattern = self.whitespace_pattern
        if pattern is not None:
            if not isinstance(pattern, str) or not pattern or not is_text(pattern):
                bad("whitespace_pattern must be a non-empty string (a regex)")
            if len(pattern.encode()) > MAX_WHITESPACE_PATTERN_BYTES:
                bad(f"whitespace_pattern is longer than {MAX_WHITESPACE_PATTERN_BYTES} bytes")
            if kind not in ("json", "json_object"):
                bad(f"whitespace_pattern applies to json and json_object, not {kind}")
        if kind == "json":
            if not isinstance(self.json, (dict, str)):
                bad("json must be a JSON schema (an object, or its JSON text)")
            if isinstance(self.json, str):
                check_schema_text(self.json, "json", bad)
            elif json_value_depth(self.json) > MAX_SCHEMA_DEPTH:
                bad(f"json nests more than {MAX_SCHEMA_DEPTH} levels of objects and arrays")
            check_schema_text(self._canonical_schema(), "json", bad)
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value or not is_text(value):
                bad(f"{kind} must be a non-empty string")
            if kind == "regex" and len(value.encode()) > MAX_REGEX_BYTES:
                bad(f"regex is {len(value.encode())} bytes; the limit is {MAX_REGEX_BYTES}")
            if kind == "grammar":
                check_schema_text(value, "grammar", bad)
                rules = len(_RULE_LINE.findall(value))
                if rules > MAX_GRAMMAR_RULES:
                    bad(f"grammar has {rules} rules; the limit is {MAX_GRAMMAR_RULES}")
        elif kind == "choice":
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or any(not isinstance(c, str) or not is_text(c) for c in self.choice)
            ):
                bad("choice must be a non-empty list of strings")
            if len(self.choice) > MAX_CHOICES:
                bad(f"choice has {len(self.choice)} strings; the limit is {MAX_CHOICES}")
            size = sum(len(c.encode()) for c in self.choice)
            if size > MAX_CONSTRAINT_BYTES:
                bad(
                    f"choice's strings are {size} bytes together; the limit is "
                    f"{MAX_CONSTRAINT_BYTES}"
                )

    def _canonical_schema(self) -> str:
        """The JSON schema as compact JSON text, keys in their given order (the order of
        `properties` is the order the output's keys take, so it is never sorted)."""
        from json import dumps, loads

        bad = _structured_outputs_error
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = loads(schema)
            except ValueError as e:
                bad(f"json is not valid JSON: {e}")
        if not isinstance(schema, dict):
            bad("json must be a JSON schema object")
        try:
            return dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            bad(f"json is not serializable as JSON: {e}")

    def key(self) -> tuple:
        """A hashable canonical form: equal constraints (whatever their spelling) give equal
        keys."""
        kind = self.kind
        if kind == "json":
            return (
                "json",
                self._canonical_schema(),
                self.disable_any_whitespace,
                self.whitespace_pattern,
            )
        if kind == "json_object":
            return ("json_object", self.disable_any_whitespace, self.whitespace_pattern)
        if kind == "choice":
            return ("choice", tuple(self.choice))
        return (kind, getattr(self, kind))


def _structured_outputs_error(message: str):
    raise ParamError("structured_outputs", f"structured_outputs: {message}")
