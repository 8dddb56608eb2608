"""Data flags: the prompt datasets and how prompts are prepared."""
from dataclasses import dataclass
from typing import Dict, List, Optional

from swift_megatron.arguments.fields import arg
from swift_megatron.errors import UserError


@dataclass
class DataArguments:
    """Data"""

    dataset: List[str] = arg([], "One or more datasets: local jsonl/json/csv/parquet files, "
                             "Hugging Face `datasets` names or ModelScope ids. Append ':N' to a "
                             "name to use N rows of it (e.g. data.jsonl:500).")
    val_dataset: List[str] = arg([], "Validation datasets, same forms as --dataset.")
    split_dataset_ratio: float = arg(0.0, "Fraction of --dataset held out for validation when "
                                     "--val_dataset is not given.")
    max_length: Optional[int] = arg(None, "Longest prompt + completion in tokens. Prompts longer "
                                    "than max_length - max_completion_length are truncated from the "
                                    "left. Default: the model's max_position_embeddings.")
    dataset_num_proc: int = arg(1, "Processes used to tokenize the dataset.")
    columns: Optional[Dict[str, str]] = arg(None, "Rename dataset columns, as JSON: "
                                            "'{\"question\": \"query\"}'.")
    dataset_shuffle: bool = arg(True, "Shuffle prompts each epoch (seeded by --seed).")

    def __post_init__(self):
        if not 0.0 <= self.split_dataset_ratio < 1.0:
            raise UserError(f"--split_dataset_ratio must be in [0, 1), got {self.split_dataset_ratio}")
        if self.max_length is not None and self.max_length < 2:
            raise UserError(f"--max_length must be at least 2, got {self.max_length}")
        if self.dataset_num_proc < 1:
            raise UserError(f"--dataset_num_proc must be >= 1, got {self.dataset_num_proc}")
