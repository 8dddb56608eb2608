"""`megatron rollout`: serve vLLM over HTTP for `megatron rlhf --vllm_mode server`."""
from swift_megatron.arguments.commands import RolloutCommandArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.errors import UserError

DESCRIPTION = "Serve vLLM rollouts (generate, weight updates) for server-mode GRPO training."


def main(argv) -> int:
    parse_command(RolloutCommandArguments, argv, prog="megatron rollout", description=DESCRIPTION)
    raise UserError("megatron rollout is not supported yet: it lands with the vLLM issue")
