"""LoRARequest: the adapter an offline request runs with, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` names the adapter; `lora_path` (a PEFT directory) loads it on first use when
    no adapter of that name is loaded. `lora_int_id` is vLLM's id, kept for the same call shape."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
