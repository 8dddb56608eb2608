"""Data flags: the prompt datasets and how prompts are prepared."""
from dataclasses import dataclass
from typing import Dict, List, Optional

from swift_megatron.arguments.fields import arg, check_seed
from swift_megatron.errors import UserError


AGENT_TEMPLATE_HELP = (
    "How tools reach the prompt and tool results the model (ms-swift's agent templates). hermes: "
    "a row's `tools` column (function schemas) is appended to the system prompt in hermes' words "
    "and a multi-turn scheduler's tool messages become one user turn of <tool_response> blocks. "
    "Default: the tools column is not rendered and tool messages use the chat template's tool "
    "role. ms-swift's react_en / react_zh / react_grpo need generation stop strings: refused.")
MAX_PIXELS_HELP = ("Largest image, in pixels, after the image processor's resize (a "
                   "vision-language model): replaces the model's preprocessor max_pixels. "
                   "Default: the MAX_PIXELS environment variable (ms-swift's), else the model's "
                   "own.")


_NO_DATALOADER = "prompts are in memory and handed out by a sampler, not a dataloader"
AGENT_TEMPLATES = ("hermes",)          # data/agent.py
_REACT = ("ms-swift's ReAct templates continue the assistant's turn after the stop word "
          "'Observation:' (--stop_words), and generation stop strings are not supported here")
REFUSED_AGENT_TEMPLATES = {"react_en": _REACT, "react_zh": _REACT, "react_grpo": _REACT}


def check_agent_template(name: Optional[str]) -> None:
    """--agent_template (megatron rlhf and megatron rollout): none or one of AGENT_TEMPLATES;
    another name fails with its reason and the supported ones."""
    if name is None or name in AGENT_TEMPLATES:
        return
    reason = REFUSED_AGENT_TEMPLATES.get(name, "not supported")
    raise UserError(f"--agent_template {name}: {reason}; supported: "
                    f"{', '.join(AGENT_TEMPLATES)} (or none: the chat template's own tool role)")


def check_max_pixels(value: Optional[int]) -> None:
    """--max_pixels (megatron rlhf and megatron rollout): none or >= 1."""
    if value is not None and value < 1:
        raise UserError(f"--max_pixels must be >= 1, got {value}")


@dataclass
class DataArguments:
    """Data"""

    dataset: List[str] = arg([], "One or more datasets: local jsonl/json/csv/parquet files, "
                             "Hugging Face `datasets` names or ModelScope ids. Append '#N' to use "
                             "N rows of it, as ms-swift: a random sample seeded by --data_seed "
                             "(the first N without --dataset_shuffle), repeated when N exceeds "
                             "the rows (e.g. data.jsonl#500).")
    val_dataset: List[str] = arg([], "Validation datasets, same forms as --dataset.")
    split_dataset_ratio: float = arg(0.0, "Fraction of --dataset held out for validation when "
                                     "--val_dataset is not given.")
    data_seed: int = arg(42, "Seed of the '#N' row samples.")
    max_length: Optional[int] = arg(None, "Longest prompt + completion in tokens. Longer prompts "
                                    "(over max_length - max_completion_length) are handled by "
                                    "--truncation_strategy. Default: the model's "
                                    "max_position_embeddings.")
    truncation_strategy: str = arg("left", "Prompts longer than max_length - "
                                   "max_completion_length: left keeps their last tokens, delete "
                                   "drops them (with a warning counting them).",
                                   choices=["left", "delete"])
    system: Optional[str] = arg(None, "System prompt for rows that have none: the text, or the "
                                "path of a .txt file holding it.")
    enable_thinking: Optional[bool] = arg(None, "Passed to the chat template as "
                                          "`enable_thinking` (Qwen3-style thinking switch). "
                                          "Default: the template's own default.")
    dataset_num_proc: int = arg(1, "Processes used to tokenize the dataset.")
    columns: Optional[Dict[str, str]] = arg(None, "Rename dataset columns, as JSON: "
                                            "'{\"question\": \"query\"}'.")
    max_pixels: Optional[int] = arg(None, MAX_PIXELS_HELP)
    agent_template: Optional[str] = arg(None, AGENT_TEMPLATE_HELP)
    dataset_shuffle: bool = arg(True, "Shuffle prompts each epoch (seeded by --seed). "
                                "--train_dataloader_shuffle (ms-swift's dataloader flag) sets "
                                "the same.", aliases=["train_dataloader_shuffle"])
    load_from_cache_file: bool = arg(False, "ms-swift's datasets cache of preprocessed rows.",
                                     no_effect="prompts are tokenized in memory at every start")
    dataloader_num_workers: int = arg(4, "ms-swift's dataloader worker processes.",
                                      no_effect=_NO_DATALOADER)
    dataloader_pin_memory: bool = arg(True, "ms-swift's dataloader pinned memory.",
                                      no_effect=_NO_DATALOADER)
    dataloader_persistent_workers: bool = arg(False, "ms-swift's dataloader keeps its workers.",
                                              no_effect=_NO_DATALOADER)
    dataloader_prefetch_factor: int = arg(2, "ms-swift's dataloader batches prefetched per "
                                          "worker.", no_effect=_NO_DATALOADER)

    def __post_init__(self):
        if not 0.0 <= self.split_dataset_ratio < 1.0:
            raise UserError(f"--split_dataset_ratio must be in [0, 1), got {self.split_dataset_ratio}")
        if self.max_length is not None and self.max_length < 2:
            raise UserError(f"--max_length must be at least 2, got {self.max_length}")
        check_max_pixels(self.max_pixels)
        check_seed("data_seed", self.data_seed)
        check_agent_template(self.agent_template)
        if self.dataset_num_proc < 1:
            raise UserError(f"--dataset_num_proc must be >= 1, got {self.dataset_num_proc}")
