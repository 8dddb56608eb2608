"""The batch plan: a table of valid and invalid configurations, the worked examples of the docs,
and the error messages (flags named, nearest valid values suggested)."""
import pytest

from swift_megatron.arguments.batch_plan import (BatchInputs, BatchPlanError, is_valid,
                                                 make_batch_plan)


def inputs(world=1, mbs=1, gbs=16, G=8, gen=None, spg=None, tp=1, pp=1, cp=1, colocate=False,
           vtp=1, experts=None, ep=1, vpp=1):
    return BatchInputs(world_size=world, micro_batch_size=mbs, global_batch_size=gbs,
                       num_generations=G, generation_batch_size=gen, steps_per_generation=spg,
                       tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                       context_parallel_size=cp, colocate_vllm=colocate,
                       vllm_tensor_parallel_size=vtp, num_experts=experts,
                       expert_model_parallel_size=ep, virtual_pipeline_model_parallel_size=vpp)


# (inputs, expected (dp, grad_accum, spg, gen, rollout_prompts, prompts_per_dp, per_rank))
VALID = [
    # ms-swift's 8-GPU example: gbs 128, mbs 4, spg 4, G 8 (rule e holds on the rollout batch)
    (inputs(world=8, mbs=4, gbs=128, G=8, spg=4), (8, 4, 4, 512, 64, 8, 64)),
    (inputs(world=8, mbs=4, gbs=128, G=8, gen=512), (8, 4, 4, 512, 64, 8, 64)),
    (inputs(world=8, mbs=4, gbs=128, G=8, gen=512, spg=4), (8, 4, 4, 512, 64, 8, 64)),
    # the single-process defaults
    (inputs(), (1, 16, 1, 16, 2, 2, 16)),
    (inputs(world=1, mbs=2, gbs=16, G=4), (1, 8, 1, 16, 4, 4, 16)),
    # TP/PP shrink dp
    (inputs(world=8, tp=2, mbs=2, gbs=32, G=4), (4, 4, 1, 32, 8, 2, 4)),
    (inputs(world=8, tp=2, pp=2, mbs=1, gbs=16, G=8), (2, 8, 1, 16, 2, 1, 2)),
    (inputs(world=4, tp=4, mbs=1, gbs=8, G=8), (1, 8, 1, 8, 1, 1, 2)),
    (inputs(world=16, tp=2, pp=2, mbs=2, gbs=64, G=8, spg=2), (4, 8, 2, 128, 16, 4, 8)),
    (inputs(world=2, pp=2, mbs=1, gbs=4, G=4, spg=3), (1, 4, 3, 12, 3, 3, 6)),
    (inputs(world=8, cp=2, mbs=1, gbs=32, G=8), (4, 8, 1, 32, 4, 1, 4)),
    (inputs(world=4, pp=2, vpp=2, mbs=1, gbs=8, G=4), (2, 4, 1, 8, 2, 1, 2)),
    (inputs(world=2, mbs=1, gbs=4, G=2), (2, 2, 1, 4, 2, 1, 2)),
    (inputs(world=4, mbs=2, gbs=16, G=2), (4, 2, 1, 16, 8, 2, 4)),
    (inputs(world=8, mbs=1, gbs=64, G=8, gen=128), (8, 8, 2, 128, 16, 2, 16)),
    (inputs(world=8, colocate=True, vtp=4, mbs=1, gbs=64, G=8), (8, 8, 1, 64, 8, 1, 8)),
    (inputs(world=4, experts=8, ep=4, mbs=1, gbs=32, G=8), (4, 8, 1, 32, 4, 1, 8)),
    (inputs(world=1, mbs=4, gbs=32, G=8, spg=4), (1, 8, 4, 128, 16, 16, 128)),
    (inputs(world=64, tp=8, mbs=1, gbs=256, G=16, spg=2), (8, 32, 2, 512, 32, 4, 8)),
]

# (inputs, flags that must be named, suggestion that must appear)
INVALID = [
    (inputs(world=8, tp=3), ["tensor_model_parallel_size", "pipeline_model_parallel_size"],
     "tensor_model_parallel_size=1 or 2 or 4 or 8"),
    (inputs(world=6, tp=4), ["world_size=6"], "multiple of 4"),
    (inputs(world=4, pp=3), ["pipeline_model_parallel_size"], "launch a multiple of 3"),
    (inputs(world=8, cp=3, tp=1), ["context_parallel_size"], "multiple of 3"),
    # (i) the interleaved schedule: 3 micro-batches per step, not a multiple of PP=2
    (inputs(world=2, pp=2, vpp=2, mbs=1, gbs=3, G=3, spg=2),
     ["virtual_pipeline_model_parallel_size=2", "grad_accum_steps", "= 3"],
     "use global_batch_size="),
    # (b) the docs' example: gbs 12 with mbs x dp = 8
    (inputs(world=8, mbs=1, gbs=12, G=1), ["global_batch_size=12", "micro_batch_size x dp_size"],
     "use global_batch_size=8 or 16"),
    (inputs(world=4, mbs=3, gbs=16, G=4), ["global_batch_size=16", "= 12"], "use global_batch_size="),
    # 4 would fix (b) but leaves 2 prompts for micro_batch_size 4 (rule e): only 8 passes all
    (inputs(world=1, mbs=4, gbs=6, G=2), ["global_batch_size=6"], "use global_batch_size=8"),
    # (c) both given and disagreeing; only generation given and not a multiple
    (inputs(world=8, mbs=4, gbs=128, G=8, gen=500, spg=4),
     ["generation_batch_size=500", "steps_per_generation=4"], "= 512; pass only one"),
    (inputs(gbs=16, gen=40), ["generation_batch_size=40", "global_batch_size=16"],
     "use generation_batch_size=32 or 48"),
    (inputs(gbs=16, gen=8), ["generation_batch_size=8"], "use generation_batch_size=16"),
    # (d) not a multiple of num_generations
    (inputs(mbs=1, gbs=12, G=8), ["num_generations=8"], "use global_batch_size=8 or 16"),
    (inputs(mbs=2, gbs=16, G=5, gen=32), ["generation_batch_size=32", "num_generations=5"],
     "use generation_batch_size="),
    (inputs(mbs=1, gbs=6, G=4, spg=1), ["num_generations=4"], "global_batch_size=4 or 8"),
    # (e) rollout prompts per DP group: ms-swift's example with the rule applied to gbs fails,
    # here it is the rollout batch: gen 128, G 8, dp 8 -> 2 prompts per dp, mbs 4
    (inputs(world=8, mbs=4, gbs=128, G=8, spg=1), ["rollout prompts per DP group",
                                                    "micro_batch_size=4"], "use global_batch_size="),
    (inputs(world=8, mbs=1, gbs=8, G=8), ["8 / 8 / 8"],
     "use global_batch_size=64"),
    (inputs(world=4, mbs=2, gbs=8, G=4, spg=1), ["rollout prompts per DP group"],
     "use global_batch_size=32"),
    (inputs(world=2, mbs=1, gbs=4, G=4), ["4 / 4 / 2"], "use global_batch_size=8"),
    (inputs(world=8, mbs=2, gbs=64, G=8, gen=192), ["192 / 8 / 8", "micro_batch_size=2"],
     "generation_batch_size=128 or 256"),
    # (f) equal generation share per rank: dp 2 x tp 2, gen 12, world 4 -> 12 % 4 = 0 ok,
    # use G=2, gen 6 on world 4 with tp 2
    (inputs(world=4, tp=2, mbs=1, gbs=6, G=3, gen=6), ["world_size=4"], "use generation_batch_size=12"),
    (inputs(world=8, tp=4, mbs=1, gbs=2, G=2, gen=4), ["not divisible by world_size=8"],
     "use generation_batch_size=8"),
    # (g) colocate vLLM TP must divide the world
    (inputs(world=8, colocate=True, vtp=3, mbs=1, gbs=64, G=8), ["vllm_tensor_parallel_size=3"],
     "1 or 2 or 4 or 8"),
    (inputs(world=2, colocate=True, vtp=4, mbs=1, gbs=8, G=4), ["vllm_tensor_parallel_size=4"],
     "1 or 2"),
    # (h) experts vs EP
    (inputs(world=4, experts=6, ep=4, mbs=1, gbs=32, G=8), ["num_experts=6",
                                                           "expert_model_parallel_size=4"],
     "1 or 2 or 3 or 6"),
    (inputs(world=8, experts=60, ep=8, mbs=1, gbs=64, G=8), ["num_experts=60"], "or 4 or"),
]


@pytest.mark.parametrize("case,expected", VALID)
def test_valid_configurations(case, expected):
    plan = make_batch_plan(case)
    got = (plan.dp_size, plan.grad_accum_steps, plan.steps_per_generation,
           plan.generation_batch_size, plan.rollout_prompts, plan.rollout_prompts_per_dp,
           plan.completions_per_rank)
    assert got == expected
    assert plan.global_batch_size == case.micro_batch_size * plan.dp_size * plan.grad_accum_steps
    assert plan.generation_batch_size == plan.global_batch_size * plan.steps_per_generation
    assert plan.rollout_prompts_per_dp % case.micro_batch_size == 0


@pytest.mark.parametrize("case,flags,suggestion", INVALID)
def test_invalid_configurations(case, flags, suggestion):
    with pytest.raises(BatchPlanError) as err:
        make_batch_plan(case)
    message = str(err.value)
    for flag in flags:
        assert flag in message, message
    assert suggestion in message, message
    assert err.value.exit_code == 2


def test_table_has_enough_cases():
    assert len(VALID) + len(INVALID) >= 30


@pytest.mark.parametrize("case,flags,suggestion", INVALID)
def test_suggested_values_pass_every_rule(case, flags, suggestion):
    """Every 'use flag=X or Y' suggestion, applied alone, gives a valid plan."""
    import dataclasses
    import re

    message = str(pytest.raises(BatchPlanError, make_batch_plan, case).value)
    match = re.search(r"use (\w+)=([\d or]+)", message)
    if not match or match.group(1) in ("tensor_model_parallel_size", "vllm_tensor_parallel_size",
                                        "expert_model_parallel_size"):
        return  # layout suggestions list divisors; the batch sizes may still need adjusting
    flag, values = match.group(1), [int(v) for v in match.group(2).split(" or ")]
    for value in values:
        assert is_valid(dataclasses.replace(case, **{flag: value})), (flag, value)


def test_plan_table_lists_every_quantity():
    table = make_batch_plan(inputs(world=8, mbs=4, gbs=128, G=8, spg=4)).table()
    for name in ("dp_size", "grad_accum_steps", "generation_batch_size", "rollout_prompts_per_dp",
                 "completions_per_rank"):
        assert name in table
    assert "512" in table and "64" in table


def test_whole_groups_rule_for_group_losses():
    from swift_megatron.arguments.batch_plan import check_whole_groups

    # ms-swift's real.sh: 2 GPUs, mbs 8, gbs 128, G 8 -> every micro-batch is one whole group
    check_whole_groups(make_batch_plan(inputs(world=2, mbs=8, gbs=128, G=8)), "real")
    plan = make_batch_plan(inputs(world=2, mbs=4, gbs=128, G=8))  # 16 prompts / 2 ranks
    with pytest.raises(BatchPlanError) as error:
        check_whole_groups(plan, "--loss_type real compares the completions of a group")
    # multiples of 8 that pass every rule: 8 (8 prompts per DP rank are a multiple of 8); 16 is not
    assert str(error.value) == (
        "--loss_type real compares the completions of a group: micro_batch_size=4 must be a "
        "multiple of num_generations=8 (each micro-batch holds whole groups): use "
        "micro_batch_size=8")
    tight = make_batch_plan(inputs(world=1, mbs=1, gbs=4, G=4))  # 1 prompt: mbs 4 fails rule e
    with pytest.raises(BatchPlanError, match="raise global_batch_size"):
        check_whole_groups(tight, "real")
