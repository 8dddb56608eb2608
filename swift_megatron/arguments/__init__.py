"""Command-line arguments: one dataclass per concern, flat ms-swift/Megatron-named flags.

Nothing here imports torch, megatron or vllm, so `megatron rlhf --help` is instant.
- fields.py: `arg()` declares a flag with its help text at the field.
- parser.py: dataclasses -> argparse (+ --config file), UserError on mistakes.
- model/data/training/parallel/grpo/rollout/lora/export.py: the groups.
- commands.py: the groups each command accepts.
- batch_plan.py: the completion-level batch arithmetic and its rules.
"""
