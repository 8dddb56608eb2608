"""Helpers shared by the LoRA workers (lora_checks.py, lora_train.py)."""
import hashlib

import torch


def seeded_normal(shape, seed: int, key: str, std: float = 0.1) -> torch.Tensor:
    """A normal tensor that depends only on (seed, key): the same in every parallel layout."""
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randn(shape, generator=gen) * std


def randomize_b(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Give every lora_B a nonzero seeded value (keyed by its HF name, so layout independent).
    Collective over each module's TP group."""
    from swift_megatron.lora import lora_modules

    for module in lora_modules(model):
        full = module.adapter_tensors()
        module.load_adapter_tensors({key: seeded_normal(t.shape, seed, key, std)
                                     if ".lora_B." in key else t for key, t in full.items()})


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()
