"""Small helpers shared by several test modules."""
import os

from safetensors.torch import load_file


def safetensors_of(model_dir) -> dict:
    """Every tensor of an HF checkpoint directory (single file or shards), by name."""
    tensors = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_dir, name)))
    return tensors


def build_tiny_reward_model(out_dir: str, seed: int = 2) -> str:
    """A tiny Qwen3 sequence-classification reward model (one label) with the fixtures'
    tokenizer, random init, float32."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from swift_megatron.fixtures import tiny_hf_config
    from swift_megatron.fixtures.tokenizer import build_tokenizer

    config = tiny_hf_config("qwen3", num_labels=1, num_hidden_layers=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return out_dir


def build_peft_adapter(model_dir: str, out_dir: str, seed: int = 3) -> str:
    """A PEFT LoRA adapter (r 4 on q_proj and v_proj) for the HF checkpoint in model_dir, with
    random A and B so that it changes the model's outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir


def per_expert_grads(model) -> dict:
    """Every gradient by parameter name, a grouped weight's per expert under SequentialMLP's
    names (weight1 [E, hidden, 2 ffn] -> local_experts.e.linear_fc1 [2 ffn, hidden], ...)."""
    from swift_megatron.model.grouped_experts import GroupedExperts

    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:      # a vision tower without images
            continue
        prefix, _, leaf = name.rpartition(".")
        module = model.get_submodule(prefix)
        if not isinstance(module, GroupedExperts):
            grads[name] = param.grad
            continue
        hidden, experts = module.config.hidden_size, module.num_local_experts
        linear = "linear_fc1" if leaf == "weight1" else "linear_fc2"
        per_expert = param.grad.view(experts, hidden, -1) if leaf == "weight1" else \
            param.grad.view(experts, -1, hidden)
        for e in range(experts):
            grads[f"{prefix}.local_experts.{e}.{linear}.weight"] = per_expert[e].t()
    return grads
