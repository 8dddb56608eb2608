"""`megatron rlhf --rlhf_type grpo ...`: parse and check the flags, print the plan (--dry_run),
relaunch under torchrun when NPROC_PER_NODE is set, then run the trainer."""
from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.launch import planned_world_size, relaunch, torchrun_argv
from swift_megatron.preflight import preflight_rlhf

DESCRIPTION = ("GRPO training of a Hugging Face causal LM on Megatron-core. Batch sizes count "
               "completions. Launch several processes with NPROC_PER_NODE=N (and NNODES, "
               "NODE_RANK, MASTER_ADDR, MASTER_PORT for several nodes).")


def main(argv) -> int:
    args = parse_command(RlhfArguments, argv, prog="megatron rlhf", description=DESCRIPTION)
    plan, _ = preflight_rlhf(args, planned_world_size())
    if args.training.dry_run:
        print(plan.table())
        return 0
    cmd = torchrun_argv("rlhf", argv)
    if cmd:
        return relaunch(cmd)
    from swift_megatron.rlhf.grpo.trainer import run_grpo

    run_grpo(args, plan)
    return 0
