"""`megatron rlhf --rlhf_type grpo ...`: parse and check the flags (--auto_parallel: choose the
layout and append its flags), print the plan and what was checked (--dry_run), relaunch under
torchrun when NPROC_PER_NODE or NNODES is set, then run the trainer."""
import signal

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.grpo import check_rlhf_type
from swift_megatron.arguments.parser import parse_command, raw_value, warn_notices
from swift_megatron.errors import UserError
from swift_megatron.launch import exit_on_sigterm, planned_world_size, relaunch, torchrun_argv
from swift_megatron.preflight import dry_run_checks, preflight_rlhf, print_dry_run

DESCRIPTION = ("GRPO training of a Hugging Face causal LM on Megatron-core. Batch sizes count "
               "completions. Launch several processes with NPROC_PER_NODE=N (and NNODES, "
               "NODE_RANK, MASTER_ADDR, MASTER_PORT for several nodes). A YAML/JSON file of "
               "flags may come first: megatron rlhf run.yaml [flags].")


def main(argv) -> int:
    if not argv:
        raise UserError("megatron rlhf needs flags (at least --model, --dataset and "
                        "--reward_funcs): `megatron rlhf --help` lists them all, and "
                        "`megatron demo` runs a whole job on a tiny embedded model first")
    check_rlhf_type(raw_value(argv, "rlhf_type"))
    args = parse_command(RlhfArguments, argv, prog="megatron rlhf", description=DESCRIPTION)
    if args.planning.auto_parallel:
        from swift_megatron.planning.command import auto_parallel, printing_rank

        argv, args = auto_parallel(args, argv, planned_world_size(), printing_rank())
        argv = [*argv, "--auto_parallel", "false"]   # torchrun's workers: the plan as flags
    plan, hf_config = preflight_rlhf(args, planned_world_size())
    if args.training.dry_run:
        warn_notices(args, no_effect=True)
        print_dry_run(plan, dry_run_checks(args, hf_config, plan))
        return 0
    cmd = torchrun_argv("rlhf", argv)
    if cmd:
        return relaunch(cmd)
    warn_notices(args)
    from swift_megatron.rlhf.grpo.trainer import run_grpo

    signal.signal(signal.SIGTERM, exit_on_sigterm)
    run_grpo(args, plan)
    return 0
