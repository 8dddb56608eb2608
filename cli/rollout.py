"""`megatron rollout`: serve vLLM over HTTP for `megatron rlhf --vllm_mode server`
(swift_megatron/rollout/server.py; endpoints and protocol in docs/rollout.md)."""
from swift_megatron.arguments.commands import RolloutCommandArguments
from swift_megatron.arguments.parser import parse_command

DESCRIPTION = ("Serve vLLM rollouts (generate, weight updates) for server-mode GRPO training: "
               "vllm_data_parallel_size engine replicas of vllm_tensor_parallel_size GPUs each, "
               "behind one HTTP endpoint. Stop it with Ctrl-C (SIGINT) or SIGTERM.")


def main(argv) -> int:
    args = parse_command(RolloutCommandArguments, argv, prog="megatron rollout", description=DESCRIPTION)
    from swift_megatron.rollout.server import serve

    serve(args)
    return 0
