"""Tokenizer: a `tokenizers.Tokenizer` plus the model's special ids and chat template.

Built from a HF `tokenizer.json`, or directly from a GGUF file's metadata: byte-level BPE
(`tokenizer.ggml.model` "gpt2": tokens, merges, token types, pre-tokenizer name) or SentencePiece
BPE ("llama", as Gemma's files are: tokens, scores, token types, byte fallback; the merges are
implied by the vocabulary). No transformers, no torch.
"""

from __future__ import annotations

import json
import os
import warnings
from datetime import datetime
from functools import cached_property

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

# Special tokens that end a generation wherever a model marks them special (llama.cpp's EOG list).
EOG_TEXTS = {
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
    "<end_of_utterance>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
}

# Pre-tokenizer split regexes, by GGUF `tokenizer.ggml.pre` (the same as llama.cpp's).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = {
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen", "megrez"}
# GPT-2's regex after isolating every digit: SmolLM, StarCoder and kin (their tokenizer.json is
# Sequence[Digits(individual_digits=True), ByteLevel]; llama.cpp splits \p{N} first, the same).
_DIGITS_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_GPT2_PRE = {None, "gpt2", "gpt-2", "default"}

CONTROL, USER_DEFINED = 3, 4  # GGUF token types


def _byte_level_pre_tokenizer(pre: str | None):
    if pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in _GPT2_PRE:
        warnings.warn(
            f"unknown GGUF pre-tokenizer {pre!r}: splitting text like GPT-2", stacklevel=3
        )
    return byte_level


def backend_from_gguf(md: dict) -> Backend:
    """A tokenizers.Tokenizer equivalent to the GGUF's vocabulary: model 'gpt2' (byte-level BPE)
    or 'llama' (SentencePiece BPE without a prefix space: Gemma)."""
    kind = md.get("tokenizer.ggml.model")
    tokens = md["tokenizer.ggml.tokens"]
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tk, pieces = _byte_level_backend(md, tokens), tokens
    elif kind == "llama":
        tk, pieces = _sentencepiece_backend(md, tokens)
    else:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece); pass a tokenizer.json with --tokenizer"
        )
    tk.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == CONTROL
        ]
    )
    # User-defined pieces (Gemma's "\n\n", "<table>", tabs) match whole in the raw text; the
    # space runs, respelled as the vocabulary's "▁" pieces, are reached by merges instead.
    tk.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, p, ty in zip(tokens, pieces, types)
            if ty == USER_DEFINED and p == t
        ]
    )
    bos, eos = md.get("tokenizer.ggml.bos_token_id"), md.get("tokenizer.ggml.eos_token_id")
    pieces, special = ["$A:0"], []
    if md.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        pieces.insert(0, f"{tokens[bos]}:0")
        special.append((tokens[bos], bos))
    if md.get("tokenizer.ggml.add_eos_token", False) and eos is not None:
        pieces.append(f"{tokens[eos]}:0")
        special.append((tokens[eos], eos))
    if special:
        tk.post_processor = processors.TemplateProcessing(
            single=" ".join(pieces), special_tokens=special
        )
    return tk


def _byte_level_backend(md: dict, tokens: list[str]) -> Backend:
    pre = md.get("tokenizer.ggml.pre")
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tk = Backend(models.BPE(vocab, merges, ignore_merges=pre in _LLAMA3_PRE))
    tk.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tk.decoder = decoders.ByteLevel()
    return tk


SPACE = "\u2581"  # SentencePiece's visible space


def _sentencepiece_backend(md: dict, tokens: list[str]) -> tuple[Backend, list[str]]:
    """SentencePiece BPE as a tokenizers BPE: spaces become "▁", pieces merge pairwise best-first,
    bytes missing from the vocabulary fall back to the <0xNN> pieces. Returns the backend and the
    pieces as its vocabulary spells them.

    A GGUF lists no merges: each piece that splits into two pieces of the vocabulary gives a merge
    (left, right), ranked by the piece's place in the file for Gemma (its scores are not the merge
    order; the order of the file is), else by its score (higher first); among one piece's splits,
    the longer left part first (as transformers ranks them). Runs of spaces are stored as spaces;
    they are spelled with "▁" like every other piece here."""
    arch = md.get("general.architecture", "")
    if md.get("tokenizer.ggml.add_space_prefix", not arch.startswith("gemma")):
        raise ValueError(
            "GGUF SentencePiece tokenizers with a prefix space (Llama 2, Mistral GGUFs) are not "
            "supported yet; pass the model's tokenizer.json with --tokenizer"
        )
    pieces = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {p: i for i, p in enumerate(pieces)}
    if arch.startswith("gemma"):
        rank = list(range(len(pieces)))
    else:
        scores = md.get("tokenizer.ggml.scores") or [0.0] * len(pieces)
        order = sorted(range(len(pieces)), key=lambda i: (-scores[i], i))
        rank = [0] * len(pieces)
        for r, i in enumerate(order):
            rank[i] = r
    splits = []
    for piece, i in vocab.items():
        for k in range(len(piece) - 1, 0, -1):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                splits.append((rank[i], -k, left, right))
    splits.sort(key=lambda m: (m[0], m[1]))
    unk = md.get("tokenizer.ggml.unknown_token_id")
    tk = Backend(
        models.BPE(
            vocab,
            [(left, right) for _, _, left, right in splits],
            unk_token=pieces[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tk.normalizer = normalizers.Replace(" ", SPACE)
    tk.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tk, pieces


def _raise_exception(message):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


# Built-in chat templates, for models that ship none (a base model's GGUF), by GGUF
# general.architecture or HF config.json model_type. A model's own template always wins; a family
# without an entry gets a clear error for chat requests, never some other family's format.
#
# Gemma (1, 2, 3): turns "<start_of_turn>{user|model}\n{text}<end_of_turn>\n" after <bos>, roles
# alternating from the user; a system message is folded into the first user turn, followed by a
# blank line, as Google's own Gemma template does; the generation prompt opens a model turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] "
    "if messages and messages[0]['role'] == 'system' else none %}"
    "{% for m in (messages[1:] if system is not none else messages) %}"
    "{% if (m['role'] == 'user') != loop.index0 is even %}"
    "{{ raise_exception('Gemma conversations alternate user and assistant turns, "
    "starting with the user') }}"
    "{% endif %}"
    "{% set text = m['content'] if m['content'] is string else "
    "m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{{ '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else 'user') ~ '\n' }}"
    "{% if loop.first and system is not none %}{{ system ~ '\n\n' }}{% endif %}"
    "{{ text | trim ~ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
BUILTIN_CHAT_TEMPLATES = {
    "gemma": GEMMA_CHAT_TEMPLATE,
    "gemma2": GEMMA_CHAT_TEMPLATE,
    "gemma3": GEMMA_CHAT_TEMPLATE,
    "gemma3_text": GEMMA_CHAT_TEMPLATE,
}


GIL_FREE_CHARS = 4096  # texts at least this long are encoded with the GIL released
GIL_FREE_TOKENS = 4096  # and token lists this long decoded so


class Tokenizer:
    """encode/decode, special ids, chat template. `backend` is the tokenizers.Tokenizer."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        chat_template: str | None = None,
        extra_eos_ids: tuple[int, ...] = (),
        family: str | None = None,
    ):
        """`family`: the model's architecture (GGUF general.architecture or HF model_type); with
        no `chat_template`, its built-in template (BUILTIN_CHAT_TEMPLATES) is used, if it has
        one."""
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.family = family
        self.chat_template_source = "model" if chat_template else None
        if not chat_template and family in BUILTIN_CHAT_TEMPLATES:
            chat_template, self.chat_template_source = (
                BUILTIN_CHAT_TEMPLATES[family],
                f"built-in {family}",
            )
        self.chat_template = chat_template
        added = backend.get_added_tokens_decoder()
        self.all_special_ids = sorted(i for i, t in added.items() if t.special)
        # Every token that ends a generation: the file's EOS, any extra EOS ids it names
        # (EOT/EOM, generation_config), and special tokens that are end markers by name.
        eos = {i for i in (eos_token_id, *extra_eos_ids) if i is not None}
        eos |= {i for i in self.all_special_ids if added[i].content in EOG_TEXTS}
        self.eos_token_ids: set[int] = eos

    # ---- construction ----
    @classmethod
    def from_gguf_metadata(cls, md: dict) -> "Tokenizer":
        extra = tuple(
            md[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in md
        )
        return cls(
            backend_from_gguf(md),
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=md.get("tokenizer.ggml.padding_token_id"),
            chat_template=md.get("tokenizer.chat_template"),
            extra_eos_ids=extra,
            family=md.get("general.architecture"),
        )

    @classmethod
    def from_gguf(cls, path: str) -> "Tokenizer":
        from kvserve.model.gguf_file import GGUFFile

        return cls.from_gguf_metadata(GGUFFile(path).metadata)

    @classmethod
    def from_pretrained(cls, path: str) -> "Tokenizer":
        """A HF model directory (tokenizer.json, tokenizer_config.json, generation_config.json),
        or a tokenizer.json file (its directory is searched for the rest)."""
        directory = os.path.dirname(path) if path.endswith(".json") else path
        tk = Backend.from_file(
            path if path.endswith(".json") else os.path.join(path, "tokenizer.json")
        )
        cfg = _read_json(os.path.join(directory, "tokenizer_config.json"))
        gen = _read_json(os.path.join(directory, "generation_config.json"))
        model_cfg = _read_json(os.path.join(directory, "config.json"))

        def token_id(key):
            tok = cfg.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            if tok:
                return tk.token_to_id(tok)
            value = model_cfg.get(f"{key}_id")
            return value[0] if isinstance(value, list) else value

        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        gen_eos = gen.get("eos_token_id", model_cfg.get("eos_token_id"))
        gen_eos = (
            tuple(gen_eos)
            if isinstance(gen_eos, list)
            else (gen_eos,)
            if gen_eos is not None
            else ()
        )
        eos = token_id("eos_token")
        if eos is None and gen_eos:
            eos = gen_eos[0]
        return cls(
            tk,
            bos_token_id=token_id("bos_token"),
            eos_token_id=eos,
            pad_token_id=token_id("pad_token"),
            chat_template=template,
            extra_eos_ids=gen_eos,
            family=model_cfg.get("model_type"),
        )

    # ---- the tokenizer interface ----
    # The `tokenizers` library holds the GIL in encode() and decode() but releases it in their
    # batch forms: long inputs go through those, so that tokenizing a 2 MB prompt in a worker
    # thread does not stop the server's event loop (and every other stream) for a second.
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) >= GIL_FREE_CHARS:
            batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            return batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if len(ids) >= GIL_FREE_TOKENS:
            return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.backend.id_to_token(self.eos_token_id)

    @property
    def pad_token(self) -> str | None:
        return None if self.pad_token_id is None else self.backend.id_to_token(self.pad_token_id)

    @cached_property
    def _template(self):
        if not self.chat_template:
            raise ValueError(
                f"this model ships no chat template and kvserve has no built-in one for its family "
                f"({self.family or 'unknown'}; "
                f"built-in: {', '.join(sorted(BUILTIN_CHAT_TEMPLATES))}): "
                "send plain text to the completions API, or load a tokenizer whose "
                "tokenizer_config.json has a chat_template (--tokenizer)"
            )
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """Render the model's chat template (a string; encode it with add_special_tokens=False)."""
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
