"""--auto_parallel (swift_megatron/planning/): the cost model's arithmetic against hand-computed
numbers and the GPU measurements it is calibrated on, the choice for each family (dense, MoE,
Qwen3.5 hybrid, VL), LoRA and full, colocate and server mode, the rules every chosen layout
passes, the pasted flags giving the same plan, the no-fit error and planning without weights."""
import dataclasses
import json
import os
import shutil

import pytest

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.cli.main import run
from swift_megatron.errors import UserError
from swift_megatron.fixtures.shapes import REAL_SHAPES
from swift_megatron.model.memory import GIB, RunShape, rank_parameters, vision_parameters
from swift_megatron.planning import cost
from swift_megatron.planning.candidates import Layout
from swift_megatron.planning.command import make_setting, plan_flags, plan_lines
from swift_megatron.planning.plan import choose, run_shape

HF = dict(model_type="qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, intermediate_size=128, num_hidden_layers=4, vocab_size=1000,
          tie_word_embeddings=False)
# attention 64*16*(4+4) + 4*16*64 = 12288; mlp 3*64*128 = 24576 per layer; head 1000*64
ACTIVE = 4 * (12288 + 24576) + 64000
PEAK = cost.PEAK_BF16_FLOPS
LLAMA_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=128256, tie_word_embeddings=False)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     intermediate_size=6144, vocab_size=151936, tie_word_embeddings=False)
BATCH = ["--global_batch_size", "64", "--num_generations", "8", "--max_completion_length",
         "2048", "--vllm_gpu_memory_utilization", "0.4"]


# ---- the cost model --------------------------------------------------------------------------

def test_active_parameters_and_attention_flops():
    assert cost.active_parameters(HF) == ACTIVE
    assert cost.attention_flops_per_token(HF, 100) == 6 * 64 * 100 * 4
    moe = dict(HF, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    # top-2 of 8 experts (3 x 64 x 32 each) and the router (8 x 64) in place of the MLP
    assert cost.active_parameters(moe) == 4 * (12288 + 2 * 3 * 64 * 32 + 8 * 64) + 64000
    hybrid = dict(REAL_SHAPES["qwen3.5-9b-4l"], model_type="qwen3_5", layer_types=[
        "linear_attention"] * 3 + ["full_attention"])   # 1 of its 4 layers: full attention
    assert cost.attention_flops_per_token(hybrid, 10) == 6 * 16 * 256 * 10 * 1


WORK = cost.Work(sequences=16, sequence_tokens=100, completion_tokens=50, optimizer_steps=2,
                 logprob_passes=1.5, world=4, gpus_per_node=4)


def test_compute_seconds():
    times = cost.compute_seconds(HF, Layout(), WORK)
    per_token = 6 * ACTIVE + 6 * 64 * 100 * 4
    assert times["train"] == pytest.approx(1600 * per_token / 4 / (PEAK * 0.30))
    assert times["logprobs"] == pytest.approx(
        1.5 * 1600 * (2 * ACTIVE + 2 * 64 * 100 * 4) / 4 / (PEAK * 0.30))
    assert times["rollout"] == pytest.approx(2 * ACTIVE * 16 * 50 / 4 / (PEAK * 0.093))
    full = cost.compute_seconds(HF, Layout(full_recompute=True), WORK)["train"]
    assert full == pytest.approx(1600 * (8 * ACTIVE + 8 * 64 * 100 * 4) / 4 / (PEAK * 0.30))
    lora = cost.compute_seconds(HF, Layout(), dataclasses.replace(WORK, lora=True))["train"]
    assert lora == pytest.approx(times["train"] * 1.29)
    assert cost.compute_seconds(HF, Layout(), dataclasses.replace(
        WORK, colocate=False))["rollout"] == 0


def test_communication_seconds():
    # TP 2 on 4 GPUs: DP 2, 800 tokens per rank of a TP group; 4 + 2 x 1.5 collectives/layer
    comm = cost.communication_seconds(HF, Layout(tp=2, sequence_parallel=True), WORK)
    assert comm["tp"] == pytest.approx(4 * 7 * 800 * 64 * 2 * 2 * (1 / 2) / 100e9)
    assert comm["cp"] == comm["ep"] == comm["pp"] == 0
    # CP 2: 400 tokens per rank; K and V (2 x 32 x 2 bytes) to the other rank, 3 + 1.5 times
    assert cost.communication_seconds(HF, Layout(cp=2), WORK)["cp"] == \
        pytest.approx(4 * 4.5 * 800 / 2 * 2 * 32 * 2 * 1 / 100e9)
    # PP 2: the stage boundary's activations, forward + backward + 1.5 logprob passes
    assert cost.communication_seconds(HF, Layout(pp=2), WORK)["pp"] == \
        pytest.approx(3.5 * 800 * 64 * 2 / 100e9)
    moe = dict(HF, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    # EP 4 (DP 4): 400 tokens x top-2 routed, 7 all-to-alls per layer, 3/4 of it leaves the GPU
    assert cost.communication_seconds(moe, Layout(ep=4), WORK)["ep"] == \
        pytest.approx(4 * 7 * 400 * 2 * 64 * 2 * 3 / 4 / 100e9)
    # a group wider than the node crosses the network
    two_nodes = dataclasses.replace(WORK, gpus_per_node=2)
    assert cost.communication_seconds(HF, Layout(cp=4), two_nodes)["cp"] == \
        pytest.approx(4 * 4.5 * 400 * 2 * 32 * 2 * 3 / 25e9)    # 400 tokens, 3 other ranks


def test_micro_batches_gradients_offloads_and_the_total():
    assert cost.micro_batches(Layout(max_tokens_per_micro_batch=300), WORK, dp=2) == 2
    assert cost.micro_batches(Layout(), WORK, dp=2) == 4        # --micro_batch_size 1
    parts = dict(gradients=4 * 1000 / GIB, optimizer=12 * 1000 / GIB, reference_bytes=1e9,
                 weight_bytes=2e9)
    # DP 4: 2 steps x (4 + 2) bytes x 1000 parameters x 3/4 at 30 GB/s
    assert cost.gradient_seconds(parts, Layout(), WORK) == pytest.approx(2 * 6 * 1000 * 0.75 / 30e9)
    assert cost.offload_seconds(parts, Layout(offload_ref_model=True), WORK) == \
        pytest.approx(2e9 / 25e9)
    assert cost.offload_seconds(parts, Layout(offload_optimizer=True), WORK) == \
        pytest.approx(2 * 12000 / 25e9)
    assert cost.offload_seconds(parts, Layout(optimizer_cpu_offload=True), WORK) == \
        pytest.approx(2 * 250 * (6 / 25e9 + 1 / 1e9))
    times = cost.step_seconds(HF, Layout(pp=2, max_tokens_per_micro_batch=200), WORK, parts)
    inside = sum(times[n] for n in ("train", "logprobs", "tp", "cp", "ep", "micro_batches"))
    # DP 2: 4 sequences per step and rank, 2 per micro-batch: m = 2, bubble (2 - 1) / 2
    assert times["bubble"] == pytest.approx(inside / 2)
    assert times["micro_batches"] == pytest.approx(2 * 2 * 2 * 1.1e-3)
    assert times["sync"] == pytest.approx(2e9 / 23e9)
    assert times["total"] == pytest.approx(sum(v for k, v in times.items() if k != "total"))


def test_the_constants_reproduce_the_measurements_they_come_from():
    """docs/gpu.md, Qwen2.5-1.5B: one H200's train phase 1.30 s for 128 sequences of ~278
    tokens at an 8k budget, rollout 1.09 s for 128 x 256 tokens; TP=2 on 2 GPUs 1.67 s for 256
    sequences; the DP=2 gradient reduction of 2 optimizer steps 0.31 s; 16k budget 0.06 s less."""
    hf = REAL_SHAPES["qwen2.5-1.5b"]
    one = cost.Work(sequences=128, sequence_tokens=278, completion_tokens=256, optimizer_steps=2,
                    logprob_passes=0, world=1, gpus_per_node=1)
    budget = Layout(max_tokens_per_micro_batch=8192)

    def train(layout, work):
        times = cost.step_seconds(hf, layout, work, dict(gradients=0, weight_bytes=0,
                                                         reference_bytes=0, optimizer=0))
        return times["train"] + times["micro_batches"] + times["tp"]

    assert train(budget, one) == pytest.approx(1.30, rel=0.05)
    assert cost.compute_seconds(hf, budget, one)["rollout"] == pytest.approx(1.09, rel=0.05)
    assert train(budget, one) - train(Layout(max_tokens_per_micro_batch=16384), one) == \
        pytest.approx(0.06, rel=0.1)
    tp2 = dataclasses.replace(one, sequences=256, world=2, gpus_per_node=2)
    assert train(dataclasses.replace(budget, tp=2), tp2) == pytest.approx(1.67, rel=0.05)
    parts = dict(gradients=4 * rank_parameters(hf, RunShape()) / GIB)
    assert cost.gradient_seconds(parts, Layout(), tp2) == \
        pytest.approx(0.31, rel=0.05)


# ---- the choice ------------------------------------------------------------------------------

@pytest.fixture
def nodes(monkeypatch):
    for name in ("NNODES", "NODE_RANK", "WORLD_SIZE", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)

    def set_gpus(count: int) -> None:
        monkeypatch.setenv("NPROC_PER_NODE", str(count))
    return set_gpus


def planned(hf, gpus, gib, *flags):
    """(setting, plan, the parsed arguments) of `megatron rlhf ... --auto_parallel true`."""
    args = parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", *BATCH, *flags],
                         "megatron rlhf")
    setting = make_setting(args, hf, gpus, int(gib * GIB))
    return setting, choose(setting), args


def assert_passes_every_rule(hf, setting, plan, flags, tmp_path, gpus):
    """The chosen flags pass the preflight's every rule (batch plan, layout, family, expert
    groups) on a model directory with this config.json, and give the memory shape planned."""
    from swift_megatron.preflight import preflight_rlhf, run_shape as preflight_shape

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(hf))
    argv = ["--model", str(model), "--dataset", "d", *BATCH, *flags,
            *plan_flags(plan.chosen.layout, setting)]
    args = parse_command(RlhfArguments, argv, "megatron rlhf")
    batch, _ = preflight_rlhf(args, gpus)
    assert preflight_shape(args, batch, hf) == run_shape(setting, plan.chosen.layout)


CASES = {
    "dense-1.5b": (REAL_SHAPES["qwen2.5-1.5b"], 8, 80, (), (1, 1, 1, 1, False)),
    "dense-8b": (LLAMA_8B, 8, 80, (), (1, 8, 1, 1, False)),
    # TP 1 fits since a colocated generation frees the gradients (TP 2 with SP before)
    "moe-30b": (QWEN3_30B_A3B, 8, 80, (), (1, 4, 1, 2, False)),
    "hybrid": (REAL_SHAPES["qwen3.5-9b-4l"], 8, 80, (), (2, 4, 1, 1, False)),
    "vl": (REAL_SHAPES["qwen2.5-vl-3b"], 8, 80, ("--max_pixels", str(1024 * 28 * 28)),
           (1, 1, 1, 1, False)),
    "lora-8b": (LLAMA_8B, 8, 80, ("--train_type", "lora"), (1, 1, 1, 1, False)),
    "server-8b": (LLAMA_8B, 8, 80, ("--vllm_mode", "server"), (1, 8, 1, 1, False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_choice_per_family_and_mode(case, nodes, tmp_path):
    hf, gpus, gib, flags, structure = CASES[case]
    nodes(gpus)
    setting, plan, _ = planned(hf, gpus, gib, *flags)
    assert plan.chosen.layout.structure == structure
    assert plan.chosen.memory["peak"] <= 0.9 * gib
    assert len(plan.runners_up) == 2
    assert all(other.times["total"] >= plan.chosen.times["total"] for other in plan.runners_up)
    assert_passes_every_rule(hf, setting, plan, flags, tmp_path, gpus)


def test_moe_chooses_expert_parallelism_and_sequence_parallel_with_tp(nodes):
    nodes(8)
    _, plan, _ = planned(QWEN3_30B_A3B, 8, 80)
    layout = plan.chosen.layout
    assert layout.ep > 1 and layout.sequence_parallel == (layout.tp > 1)
    # at EP 1 the 128 experts do not fit: every EP-1 candidate is over the limit
    _, fixed, _ = planned(QWEN3_30B_A3B, 8, 141, "--expert_model_parallel_size", "1")
    assert fixed.chosen.layout.ep == 1 and fixed.chosen.memory["peak"] > plan.chosen.memory["peak"]


def test_hybrid_gets_no_context_parallelism_nor_packed_sequence_parallel(nodes):
    nodes(8)
    setting, plan, _ = planned(REAL_SHAPES["qwen3.5-9b-4l"], 8, 80)
    from swift_megatron.planning.plan import scored

    for candidate in scored(setting):
        assert candidate.layout.cp == 1
        assert not candidate.layout.sequence_parallel      # --padding_free true (default)


def test_vl_counts_its_tower(nodes):
    nodes(8)
    vl = REAL_SHAPES["qwen2.5-vl-3b"]
    text = {k: v for k, v in vl.items() if k != "vision_config"}
    flags = ("--max_pixels", str(1024 * 28 * 28))
    _, with_tower, _ = planned(vl, 8, 80, *flags)
    setting, _, _ = planned(text, 8, 80, *flags)
    from swift_megatron.planning.plan import score

    without = score(setting, with_tower.chosen.layout)
    assert (with_tower.chosen.memory["weights"] - without.memory["weights"]) * GIB == \
        pytest.approx(2 * vision_parameters(vl))
    assert with_tower.chosen.times["logprobs"] > without.times["logprobs"]   # the tower's forward
    # trained in full, the tower keeps its blocks' activations for the micro-batch's patches
    trained_setting, trained, _ = planned(vl, 8, 80, *flags, "--freeze_vit", "false")
    shape = run_shape(trained_setting, trained.chosen.layout)
    # 1024 x 28 x 28 pixels in 14 x 14 patches: 4096 patches (1024 image tokens once merged)
    assert shape.image_patches == 4096 * (shape.micro_batch_tokens // 2560)


def test_lora_and_full(nodes):
    nodes(8)
    _, full, _ = planned(LLAMA_8B, 8, 80)
    setting, lora, _ = planned(LLAMA_8B, 8, 80, "--train_type", "lora")
    assert lora.chosen.memory["reference"] == 0 and full.chosen.memory["reference"] > 0
    assert lora.chosen.memory["gradients"] < full.chosen.memory["gradients"] / 50   # 8 stages
    assert "--offload_ref_model" not in plan_flags(lora.chosen.layout, setting)


def test_colocate_and_server(nodes):
    nodes(8)
    _, colocate, _ = planned(LLAMA_8B, 8, 80)
    setting, server, _ = planned(LLAMA_8B, 8, 80, "--vllm_mode", "server")
    assert colocate.chosen.memory["vllm"] == pytest.approx(0.4 * 80)
    assert server.chosen.memory["vllm"] == 0 and server.chosen.times["rollout"] == 0
    assert colocate.chosen.times["rollout"] > 0
    assert "--offload_optimizer" not in plan_flags(server.chosen.layout, setting)


def test_flags_the_user_set_are_kept(nodes):
    nodes(8)
    _, plan, _ = planned(LLAMA_8B, 8, 80, "--tensor_model_parallel_size", "4",
                         "--recompute_granularity", "full")
    assert plan.chosen.layout.tp == 4 and plan.chosen.layout.full_recompute
    assert all(o.layout.tp == 4 for o in plan.runners_up)


def test_an_uneven_pipeline_split_is_planned_by_its_fullest_stage(nodes):
    """30 layers with --decoder_first_pipeline_num_layers 6 on 8 GPUs: of the PP sizes 8 allows,
    the ones that split the other 24 evenly over the other stages are candidates (2: 6 + 24,
    4: 6 + 8 + 8 + 8; not 1 nor 8), each estimated by its fullest stage."""
    from swift_megatron.model.layout import PipelineSplit
    from swift_megatron.planning.plan import scored

    nodes(8)
    hf = dict(LLAMA_8B, num_hidden_layers=30)
    setting, plan, _ = planned(hf, 8, 80, "--decoder_first_pipeline_num_layers", "6",
                               "--auto_parallel", "true")
    candidates = scored(setting)
    assert {c.layout.pp for c in candidates} == {2, 4}
    for candidate in candidates:
        shape = run_shape(setting, candidate.layout)
        assert shape.stage_layers == PipelineSplit(30, candidate.layout.pp, first=6).fullest()
    four = next(c for c in candidates if c.layout.pp == 4)     # 6 + 8 + 8 + 8
    even = dataclasses.replace(run_shape(setting, four.layout), stage_layers=None)
    assert run_shape(setting, four.layout).stage_layers == 8 and even.stage_layers is None
    assert plan.chosen.layout.pp in (2, 4)


@pytest.mark.parametrize("case", ["dense-8b", "moe-30b", "lora-8b"])
def test_the_pasted_flags_give_the_same_plan(case, nodes):
    hf, gpus, gib, flags, _ = CASES[case]
    nodes(gpus)
    setting, plan, _ = planned(hf, gpus, gib, *flags)
    pasted = plan_flags(plan.chosen.layout, setting)
    again_setting, again, _ = planned(hf, gpus, gib, *flags, *pasted)
    assert again.chosen.layout == plan.chosen.layout
    assert again.chosen.memory == plan.chosen.memory and again.chosen.times == plan.chosen.times
    assert plan_lines(again, again_setting)[-1] == plan_lines(plan, setting)[-1]


def test_nothing_fits_says_what_would(nodes):
    nodes(1)
    with pytest.raises(UserError) as error:
        planned(LLAMA_8B, 1, 24)
    message = str(error.value)
    assert error.value.exit_code == 2
    assert "no layout fits 1 GPU(s) of 24.0 GiB with a 10% margin" in message
    assert "What would fit: 4 GPUs" in message
    with pytest.raises(UserError, match="--train_type lora"):
        planned(LLAMA_8B, 1, 40, "--vllm_gpu_memory_utilization", "0.3")


# ---- the command -----------------------------------------------------------------------------

@pytest.fixture
def weightless_model(tiny_model_dir, tmp_path):
    """A model directory holding config.json and the tokenizer only."""
    model = tmp_path / "config-only"
    shutil.copytree(tiny_model_dir("qwen3"), model,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    return str(model)


def dry_run(model, dataset, *flags):
    return ["rlhf", "--dry_run", "true", "--model", model, "--dataset", dataset,
            "--reward_funcs", "accuracy", "--global_batch_size", "8", *flags]


def test_planning_needs_no_weights(weightless_model, math_dataset_path, nodes, capsys):
    nodes(2)
    argv = dry_run(weightless_model, math_dataset_path, "--auto_parallel", "true",
                   "--gpu_memory_gib", "16", "--device", "cpu")
    assert run(argv) == 0
    out = capsys.readouterr().out
    flags = [line for line in out.splitlines() if line.startswith("auto_parallel flags: ")]
    assert len(flags) == 1 and "world_size" in out and "checked model:" in out
    # the flags pasted without --auto_parallel: the same batch plan and memory estimate
    pasted = flags[0][len("auto_parallel flags: "):].split()
    memory = [line for line in out.splitlines() if line.startswith("memory per GPU")]
    with pytest.raises(UserError, match="no model.safetensors"):
        run(dry_run(weightless_model, math_dataset_path, "--device", "cpu", *pasted))
    assert run(dry_run(weightless_model, math_dataset_path, "--device", "cpu",
                       "--check_model", "false", "--gpu_memory_gib", "16", *pasted)) == 0
    again = capsys.readouterr().out
    assert [line for line in again.splitlines() if line.startswith("memory per GPU")] == memory


def test_without_a_gpu_it_asks_for_gpu_memory_gib(weightless_model, math_dataset_path, nodes):
    nodes(1)
    with pytest.raises(UserError, match="pass --gpu_memory_gib"):
        run(dry_run(weightless_model, math_dataset_path, "--auto_parallel", "true",
                    "--device", "cpu"))


def test_the_cli_exits_2_when_nothing_fits(weightless_model, math_dataset_path, tmp_path):
    """`megatron rlhf` as a subprocess: exit 2 and the message, no traceback."""
    import subprocess
    import sys

    model = tmp_path / "big"
    shutil.copytree(weightless_model, model)
    (model / "config.json").write_text(json.dumps(dict(LLAMA_8B, torch_dtype="bfloat16")))
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC_PER_NODE", "NNODES")}
    result = subprocess.run([sys.executable, "-m", "swift_megatron.cli.main", *dry_run(
        str(model), math_dataset_path, "--auto_parallel", "true", "--gpu_memory_gib", "24",
        "--use_vllm", "true")],
        capture_output=True, text=True, env=env)
    assert result.returncode == 2, result.stderr
    assert "What would fit: --vllm_gpu_memory_utilization below 0.9" in result.stderr
    assert "Traceback" not in result.stderr
