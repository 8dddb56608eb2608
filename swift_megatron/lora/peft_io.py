"""LoRA adapters in PEFT's file format, so that `peft.PeftModel.from_pretrained(hf_model, dir)`
loads what we train and we load what peft trains.

    adapter_config.json        peft LoraConfig fields (peft_type LORA, task_type CAUSAL_LM, r,
                               lora_alpha, lora_dropout, target_modules as HF names (with a
                               target_regex: the full names of the modules it selected),
                               modules_to_save as HF module names, use_rslora, bias none,
                               base_model_name_or_path)
    adapter_model.safetensors  base_model.model.<HF module>.lora_A.weight [r, in] and
                               .lora_B.weight [out, r], full (unsharded) tensors; the modules
                               trained in full under their HF names
                               (base_model.model.model.embed_tokens.weight, lora/saved.py)

MoE experts are written per expert (`...mlp.experts.<E>.gate_proj.lora_A.weight`), the hub
layout peft converts on load for transformers 5's fused experts. Adapters peft itself creates on
transformers 5 fused experts (`target_parameters`) are not readable here (UserError).

peft's target_modules given as a regular expression, or as full module names, read as a
target_regex (matched against the HF module names, with peft's suffix rule for names).

`save_adapter` and `load_adapter` are collective: every rank of every parallel group calls them;
they take the model's bridge (bridge/) when the adapter has modules trained in full.
"""
import json
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from swift_megatron.arguments.lora import saved_module
from swift_megatron.errors import UserError
from swift_megatron.lora.layers import apply_lora, lora_modules
from swift_megatron.lora.saved import load_saved, modules_on_stage, saved_modules, saved_tensors
from swift_megatron.lora.targets import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_[AB]\.weight$")
# peft options we do not implement: each must be absent or empty/false in a config we read
_UNSUPPORTED = ("use_dora", "target_parameters", "rank_pattern", "alpha_pattern",
                "layers_to_transform", "layer_replication", "fan_in_fan_out",
                "lora_bias", "exclude_modules", "trainable_token_indices", "use_qalora")


# ---- config ---------------------------------------------------------------------------------

def peft_config_dict(config: LoraConfig, target_modules: List[str],
                     base_model_name_or_path: str, modules_to_save: Sequence[str] = (),
                     tied: bool = False) -> dict:
    """adapter_config.json for `config`, targeting the given HF module names, with the HF
    modules trained in full (`tied`: the embedding and lm_head, one matrix)."""
    alpha = config.lora_alpha
    data = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.r,
            "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
            "lora_dropout": config.lora_dropout, "target_modules": sorted(target_modules),
            "use_rslora": config.use_rslora, "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": sorted(modules_to_save) or None,
            "base_model_name_or_path": base_model_name_or_path}
    if tied and modules_to_save:
        data["ensure_weight_tying"] = True
    return data


def _target_fields(targets) -> dict:
    """LoraConfig's target fields from peft's target_modules: projection names as they are; a
    regular expression (peft's string form) or full module names (what a target_regex run
    writes) as a target_regex, with peft's rule for names (the name, or a suffix after a dot)."""
    if isinstance(targets, str):
        return {"target_regex": targets}
    targets = list(targets or [])
    if targets and all("." in t for t in targets):
        return {"target_regex": r"(?:.*\.)?(?:" + "|".join(map(re.escape, targets)) + ")"}
    return {"target_modules": tuple(targets)}


def config_from_peft(data: dict, path: str) -> LoraConfig:
    """Our LoraConfig from a peft adapter_config.json; UserError for what we do not support."""
    if data.get("peft_type") != "LORA":
        raise UserError(f"{path}: peft_type {data.get('peft_type')!r} is not LORA")
    used = [key for key in _UNSUPPORTED if data.get(key)]
    if data.get("bias", "none") != "none":
        used.append(f"bias={data['bias']}")
    if used:
        raise UserError(f"{path}: peft options not supported: {', '.join(used)}")
    try:
        return LoraConfig(r=data["r"], lora_alpha=data["lora_alpha"],
                          lora_dropout=data.get("lora_dropout", 0.0),
                          use_rslora=bool(data.get("use_rslora", False)),
                          modules_to_save=tuple(data.get("modules_to_save") or ()),
                          **_target_fields(data.get("target_modules")))
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


# ---- save -----------------------------------------------------------------------------------

def adapter_state_dict(model: torch.nn.Module, tensor_of=torch.Tensor.detach
                       ) -> Optional[Dict[str, torch.Tensor]]:
    """Every adapter tensor under its peft name, full size, on global rank 0 (None elsewhere):
    gathered over TP by each module, then from every pipeline stage and expert rank; each tensor
    is sent once, by the lowest rank holding it (data-parallel copies stay home). `tensor_of`
    picks what is gathered from each parameter (its value, or e.g. its gradient). Collective."""
    local = {}
    for module in lora_modules(model):
        tensors = module.adapter_tensors(tensor_of)
        if module.lora_target.shard.rank == 0:
            local.update({PREFIX + key: t.detach().cpu() for key, t in tensors.items()})
    holders: List[Optional[List[str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(holders, sorted(local))
    owner = {}
    for rank, names in enumerate(holders):
        for name in names:
            owner.setdefault(name, rank)
    mine = {name: t for name, t in local.items() if owner[name] == dist.get_rank()}
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if parts is None:
        return None
    return dict(sorted((name, t) for part in parts for name, t in part.items()))


def _module_of(key: str) -> str:
    return _KEY.match(key[len(PREFIX):]).group("module")


def _written_config(model: torch.nn.Module, state: Dict[str, torch.Tensor],
                    saved: Dict[str, torch.Tensor], config: LoraConfig, base: str) -> dict:
    """adapter_config.json of a model's adapter: its projection names (a target_regex: the full
    names of the modules it adapted) and the HF modules it trains in full."""
    modules = {_module_of(key) for key in state}
    targets = modules if config.target_regex is not None else \
        {m.rsplit(".", 1)[-1] for m in modules}
    return peft_config_dict(config, sorted(targets), base,
                            [name[:-len(".weight")] for name in saved],
                            tied=bool(model.share_embeddings_and_output_weights))


def save_adapter(model: torch.nn.Module, out_dir: str, base_model_name_or_path: str,
                 config: LoraConfig, bridge=None) -> None:
    """Write the adapters of a LoRA model, and the modules it trains in full (through `bridge`,
    the model's; needed when it has some), as a PEFT adapter directory (global rank 0 writes;
    each file is written under a temporary name and renamed). Collective."""
    if config.modules_to_save and bridge is None:
        raise ValueError("save_adapter: an adapter with modules_to_save needs the model's bridge")
    state = adapter_state_dict(model)
    saved = saved_tensors(model, config.modules_to_save, bridge)
    if state is not None:
        tensors = {**state, **{PREFIX + name: t for name, t in saved.items()}}
        os.makedirs(out_dir, exist_ok=True)
        tmp = os.path.join(out_dir, f".tmp-{os.getpid()}-")
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp + ADAPTER_WEIGHTS,
                  metadata={"format": "pt"})
        with open(tmp + ADAPTER_CONFIG, "w") as f:
            json.dump(_written_config(model, state, saved, config, base_model_name_or_path), f,
                      indent=2)
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
            os.replace(tmp + name, os.path.join(out_dir, name))
    dist.barrier()


# ---- load -----------------------------------------------------------------------------------

def read_adapter_config(adapter_dir: str) -> LoraConfig:
    """The LoraConfig of a PEFT adapter directory (its tensors are not read); UserError when a
    file is missing or the config is not supported."""
    config_path = os.path.join(adapter_dir, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise UserError(f"{adapter_dir}: no {ADAPTER_CONFIG} (is this a PEFT adapter directory?)")
    if not os.path.isfile(os.path.join(adapter_dir, ADAPTER_WEIGHTS)):
        raise UserError(f"{adapter_dir}: no {ADAPTER_WEIGHTS} (only safetensors adapters are "
                        "supported)")
    with open(config_path) as f:
        return config_from_peft(json.load(f), config_path)


def _is_saved(name: str, config: LoraConfig) -> bool:
    """Whether `name` is the weight of a module an adapter with modules_to_save trains in full
    (the embedding or lm_head: peft's ensure_weight_tying writes both for either)."""
    if not (config.modules_to_save and name.endswith(".weight")):
        return False
    try:
        saved_module(name[:-len(".weight")])
        return True
    except UserError:
        return False


def read_adapter(adapter_dir: str) -> Tuple[LoraConfig, Dict[str, torch.Tensor]]:
    """(config, {"<HF module>.lora_A.weight": tensor, ..., "<HF module>.weight": tensor of a
    module trained in full}) of a PEFT adapter directory."""
    config = read_adapter_config(adapter_dir)
    weights_path = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    tensors = {}
    for key, tensor in load_file(weights_path).items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        if not (_KEY.match(name) or _is_saved(name, config)):
            raise UserError(f"{weights_path}: tensor {key!r} is neither a LoRA A/B weight nor "
                            "the weight of one of its modules_to_save")
        tensors[name] = tensor
    return config, tensors


def _check_modules(model: torch.nn.Module, modules, config: LoraConfig) -> List[str]:
    problems = [f"the model's adapters have rank {m.lora_r} and scale {m.lora_scale:g}, the "
                f"file's rank {config.r} and scale {config.scale:g}" for m in modules[:1]
                if (m.lora_r, m.lora_scale) != (config.r, config.scale)]
    ours = sorted(m.lora_saved_name for m in saved_modules(model))
    theirs = sorted(modules_on_stage(model, config.modules_to_save))
    if ours != theirs:
        problems.append(f"the model trains {ours or 'no module'} in full, the file "
                        f"{theirs or 'none'} (modules_to_save)")
    return problems


def _fill(modules, tensors: Dict[str, torch.Tensor], problems: List[str]) -> None:
    """Copy the file's tensors into the modules, recording what does not fit."""
    for module in modules:
        shapes = module.expected_shapes()
        missing = [key for key in shapes if key not in tensors]
        wrong = [f"{key} {tuple(tensors[key].shape)} (expected {shape})"
                 for key, shape in shapes.items()
                 if key in tensors and tuple(tensors[key].shape) != shape]
        problems += [f"missing tensor {key}" for key in missing] + [f"shape of {w}" for w in wrong]
        if not (missing or wrong):
            module.load_adapter_tensors(tensors)


def _raise_collectively(adapter_dir: str, problems: List[str]) -> None:
    everyone: List[Optional[List[str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    found = sorted({p for part in everyone for p in part})
    if found:
        shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
        raise UserError(f"adapter {adapter_dir} does not fit the model: {shown}")


def load_adapter(model: torch.nn.Module, adapter_dir: str, bridge=None) -> LoraConfig:
    """Load a PEFT adapter into this stage's GPTModel, first adding adapters with the file's
    config when the model has none (before DDP wrapping); `bridge`: the model's (its family
    table; default the shared decoder table), needed for an adapter with modules_to_save.
    UserError, on every rank, when files are missing, a tensor is missing or has the wrong
    shape (e.g. another rank), or the file holds adapters for modules the model does not
    adapt. Collective."""
    config, tensors = read_adapter(adapter_dir)
    if config.modules_to_save and bridge is None:
        raise ValueError("load_adapter: an adapter with modules_to_save needs the model's bridge")
    mappings = bridge.mappings if bridge is not None else None
    modules = lora_modules(model) or apply_lora(model, config, mappings)
    problems = _check_modules(model, modules, config)
    if not problems:
        _fill(modules, tensors, problems)
        problems += load_saved(model, tensors, bridge, adapter_dir) if config.modules_to_save \
            else []
    used = {key for module in modules for key in module.expected_shapes()}
    used |= {name for name in tensors if _is_saved(name, config)}
    everyone: List[Optional[set]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, used)
    unknown = sorted(set(tensors) - set().union(*everyone))
    problems += [f"no adapted module for {key}" for key in unknown]
    _raise_collectively(adapter_dir, problems)
    return config
