"""LoRA adapters served side by side with the base model: PEFT directories read and checked
(adapter.py), the slots of the loaded ones and their batched application in the PyTorch forward
(manager.py), and what an offline request names (LoRARequest)."""

from kvserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
