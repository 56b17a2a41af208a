"""The offline API: `LLM(...).generate(prompts, params)` drives EngineCore directly."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence

from tqdm import tqdm

from kvserve.config import EngineConfig, make_engine_config
from kvserve.engine.engine_core import EngineCore
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

PromptLike = str | list[int] | dict


class LLM:
    """Load a model once, then generate for batches of prompts.

    `model=None` loads the default model (SmolLM2-135M-Instruct). Keyword arguments are the
    engine's knobs, the fields of kvserve.config's sections (kvserve.config.engine_keywords();
    make_engine_config checks them): dtype, kv_cache_memory, max_num_batched_tokens,
    max_num_seqs, enable_prefix_caching, num_blocks, seed, ... An unknown keyword is a
    ValueError naming the closest known one.
    """

    def __init__(
        self, model: str | None = None, *, config: EngineConfig | None = None, **engine_kwargs
    ):
        self.config = config if config is not None else make_engine_config(model, **engine_kwargs)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    # ---- prompts ----
    def _token_ids(self, prompt: PromptLike) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            return self.tokenizer.encode(prompt["prompt"], add_special_tokens=True), prompt[
                "prompt"
            ]
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt), None
        raise ValueError(
            "a prompt is a string, a list of token ids, or {'prompt_token_ids': [...]}"
        )

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- generation ----
    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. `lora_request`: the LoRA
        adapter (kvserve.lora.LoRARequest) every prompt runs with, or one per prompt (None: the
        base model); the engine needs enable_lora=True."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        loras = (
            list(lora_request)
            if isinstance(lora_request, (list, tuple))
            else [lora_request] * len(prompts)
        )
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        order: list[str] = []
        texts: dict[str, str | None] = {}
        try:
            for i, (p, sp) in enumerate(zip(prompts, params_list)):
                ids, text = self._token_ids(p)
                rid = str(next(self._ids))
                self.engine.add_request(
                    rid,
                    ids,
                    sp,
                    priority=priority[i] if priority else 0,
                    lora_request=loras[i],
                )
                order.append(rid)
                texts[rid] = text
        except Exception:
            for rid in order:
                self.engine.abort_request(rid)
            self.engine.step()  # drain the abort outputs
            raise
        final = self._run(order, use_tqdm)
        for rid, out in final.items():
            out.prompt = texts[rid]
        return [final[rid] for rid in order]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate(
            [{"prompt_token_ids": self.chat_prompt(m)} for m in convs],
            sampling_params,
            use_tqdm=use_tqdm,
        )

    def stream(
        self, prompt: PromptLike, sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yield text deltas of one request as they are generated (n must be 1); the generator's
        return value (StopIteration.value) is the finish reason. Closing it early aborts the
        request."""
        ids, _ = self._token_ids(prompt)
        rid = str(next(self._ids))
        self.engine.add_request(rid, ids, sampling_params or SamplingParams())
        done, reason = False, None
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    for o in out.outputs:
                        if o.delta_text:
                            yield o.delta_text
                        reason = o.finish_reason or reason
                    done = out.finished
            return reason
        finally:
            if not done:
                self.engine.abort_request(rid)
                self.engine.step()

    def _run(self, order: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        pending = set(order)
        samples: dict[str, dict[int, CompletionOutput]] = {rid: {} for rid in order}
        final: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(order), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True
        )
        start, generated = time.perf_counter(), 0
        # Only deltas and final outputs are read here: unfinished outputs need not copy the
        # whole token and logprob lists every step (O(length) each, O(length^2) a request).
        proc = self.engine.processor
        before, proc.delta_snapshots = proc.delta_snapshots, True
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id not in pending:
                        continue
                    for o in out.outputs:
                        generated += len(o.delta_token_ids)
                        samples[out.request_id][o.index] = o
                    if out.finished:
                        pending.discard(out.request_id)
                        out.outputs = [
                            samples[out.request_id][i] for i in sorted(samples[out.request_id])
                        ]
                        final[out.request_id] = out
                        bar.update(1)
                if use_tqdm:
                    bar.set_postfix(
                        tok_s=f"{generated / max(time.perf_counter() - start, 1e-9):.1f}",
                        refresh=False,
                    )
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
            self.engine.step()
            raise
        finally:
            proc.delta_snapshots = before
            bar.close()
        return final
