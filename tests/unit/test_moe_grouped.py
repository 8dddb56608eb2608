"""Grouped-GEMM experts and the device-side token dispatch of the MoE layers
(model/grouped_experts.py, model/moe_dispatch.py) on CPU, float32, against megatron-core's
SequentialMLP and its own all-to-all dispatcher, with the same weights (the tiny qwen3_moe and
qwen3_5_moe, loaded through the bridge):

- logits and every parameter's gradient (the grouped weights' read per expert) match the
  sequential experts', with the shared expert too, with --recompute_modules moe_act, and on the
  per-expert path used where torch's grouped kernel is missing;
- the dispatch matches megatron's dispatcher (sequential experts on both sides), and with the
  shared expert overlapped with it (megatron's moe_shared_expert_overlap) computes the same;
- the grouped GEMM matches a per-expert loop on uneven groups with empty ones, float32 and
  bfloat16, outputs and gradients (a broadcast upstream gradient included);
- a MoE layer's forward and backward at EP = ETP = 1 make no call that would make the host wait
  for a GPU, where megatron's dispatcher with SequentialMLP makes several;
- the bridge exports the grouped model's HF per-expert tensors bit for bit, a distributed
  checkpoint saved with one form of experts loads into the other, LoRA on the experts'
  projections turns grouped experts into per-expert MLPs with the same weights (and leaves them
  grouped otherwise), and the two flags parse as ms-swift's.
The layouts with expert and expert-tensor parallelism: tests/distributed/test_moe_layouts.py.
"""
import pytest
import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.bridge import Bridge
from swift_megatron.errors import UserError
from swift_megatron.model.build import build_model
from swift_megatron.model.config import load_hf_config
from swift_megatron.model.grouped_experts import GroupedExperts, GroupedMM, per_expert_mm
from swift_megatron.parallel.state import ParallelState
from swift_megatron.platform.host_syncs import HostSyncCounter
from tests.helpers import per_expert_grads, safetensors_of

BATCH, SEQ = 2, 24


@pytest.fixture(scope="module")
def world():
    yield ParallelState.initialize(device="cpu", seed=0)
    ParallelState.destroy()


def load(model_dir: str, grouped: bool, **overrides):
    hf = load_hf_config(model_dir)
    model, config, shape = build_model(hf, torch.float32, torch.device("cpu"),
                                       moe_grouped_gemm=grouped, **overrides)
    bridge = Bridge(hf, shape, config)
    bridge.load(model, model_dir)
    return model, bridge


def tokens():
    ids = torch.randint(0, 500, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)


def step(model):
    """Logits of the fixed batch and every gradient of a loss on them."""
    ids, positions = tokens()
    logits = model(input_ids=ids, position_ids=positions, attention_mask=None)
    (logits.float() ** 2).mean().backward()
    return logits.detach(), per_expert_grads(model)


def assert_same_step(ours, reference, atol=1e-6):
    (logits, grads), (ref_logits, ref_grads) = ours, reference
    assert (logits - ref_logits).abs().max().item() < 1e-5
    assert sorted(grads) == sorted(ref_grads)
    worst = max(((grads[n] - ref_grads[n]).abs().max().item(), n) for n in grads)
    assert worst[0] < atol, worst


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_grouped_experts_match_sequential_mlp(world, tiny_model_dir, family):
    grouped, _ = load(tiny_model_dir(family), True)
    sequential, _ = load(tiny_model_dir(family), False)
    assert any(isinstance(m, GroupedExperts) for m in grouped.modules())
    assert not any(isinstance(m, GroupedExperts) for m in sequential.modules())
    assert_same_step(step(grouped), step(sequential))


def test_moe_act_recompute_and_the_per_expert_path_match(world, tiny_model_dir):
    reference = step(load(tiny_model_dir("qwen3_moe"), True)[0])
    recomputed, _ = load(tiny_model_dir("qwen3_moe"), True, recompute_granularity="selective",
                         recompute_modules=["moe_act"])
    assert all(m.activation_recompute for m in recomputed.modules()
               if isinstance(m, GroupedExperts))
    assert_same_step(step(recomputed), reference)
    looped, _ = load(tiny_model_dir("qwen3_moe"), True)
    for module in looped.modules():
        if isinstance(module, GroupedExperts):
            module.grouped_kernel = False
    assert_same_step(step(looped), reference)


def test_device_dispatch_matches_megatrons_dispatcher(world, tiny_model_dir):
    ours, _ = load(tiny_model_dir("qwen3_5_moe"), False)
    megatrons, _ = load(tiny_model_dir("qwen3_5_moe"), False)
    for layer in megatrons.decoder.layers:
        layer.mlp.token_dispatcher.__class__ = MoEAlltoAllTokenDispatcher
    assert_same_step(step(ours), step(megatrons))


def test_the_shared_expert_overlap_computes_the_same(world, tiny_model_dir):
    reference = step(load(tiny_model_dir("qwen3_5_moe"), True)[0])
    overlapped, _ = load(tiny_model_dir("qwen3_5_moe"), True, moe_shared_expert_overlap=True)
    assert overlapped.decoder.layers[0].mlp.token_dispatcher.shared_experts is not None
    assert_same_step(step(overlapped), reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_matches_a_loop_on_uneven_and_empty_groups(dtype):
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 19, 0, 8])
    x = torch.randn(int(counts.sum()), 16, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(5, 16, 24, generator=gen).to(dtype).requires_grad_()
    x_ref, w_ref = (t.detach().clone().requires_grad_() for t in (x, w))
    out = GroupedMM.apply(x, w, counts.cumsum(0).to(torch.int32))
    ref = per_expert_mm(x_ref, w_ref, counts)
    tol = 0.0 if dtype == torch.float32 else 1e-2
    assert (out.float() - ref.float()).abs().max().item() <= tol * ref.abs().max().item()
    out.sum().backward()            # a broadcast (stride 0) upstream gradient
    ref.sum().backward()
    for ours, theirs in ((x.grad, x_ref.grad), (w.grad, w_ref.grad)):
        assert (ours.float() - theirs.float()).abs().max().item() <= \
            max(tol * theirs.abs().max().item(), 1e-5)
    assert w.grad[1].abs().max().item() == 0 and w.grad[3].abs().max().item() == 0


def test_a_moe_layer_never_waits_on_the_device_at_one_rank(world, tiny_model_dir):
    counts = {}
    for case, grouped, megatrons in (("ours", True, False), ("megatron", False, True)):
        model, _ = load(tiny_model_dir("qwen3_moe"), grouped)
        layer = model.decoder.layers[0].mlp
        if megatrons:
            layer.token_dispatcher.__class__ = MoEAlltoAllTokenDispatcher
        x = torch.randn(SEQ, BATCH, model.config.hidden_size, requires_grad=True)
        with HostSyncCounter() as syncs:
            out, _ = layer(x)
            out.backward(torch.randn_like(out))
        counts[case] = dict(syncs.counts)
    print(counts)
    assert counts["ours"] == {}
    assert counts["megatron"]["masked_select"] == 2 and counts["megatron"]["tolist"] >= 1


def test_the_bridge_exports_grouped_experts_per_expert_bit_for_bit(world, tiny_model_dir):
    model, bridge = load(tiny_model_dir("qwen3_moe"), True)
    exported = dict(bridge.export(model))
    original = safetensors_of(tiny_model_dir("qwen3_moe"))
    experts = [name for name in exported if ".mlp.experts." in name]
    assert len(experts) == model.config.num_layers * 8 * 3     # 8 experts: gate, up, down
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[name], original[name]) for name in original)


def test_a_checkpoint_of_either_form_of_experts_loads_into_the_other(world, tiny_model_dir,
                                                                     tmp_path):
    from swift_megatron.checkpoint.dist import load_model, save_model

    hf = load_hf_config(tiny_model_dir("qwen3_moe"))
    ids, positions = tokens()
    for saved, loaded in ((True, False), (False, True)):
        source, _ = load(tiny_model_dir("qwen3_moe"), saved)
        save_model([source], str(tmp_path / f"from_{saved}"))
        target, _, _ = build_model(hf, torch.float32, torch.device("cpu"),
                                   moe_grouped_gemm=loaded, random_init=False)
        load_model([target], str(tmp_path / f"from_{saved}"))
        with torch.no_grad():
            diff = (source(input_ids=ids, position_ids=positions, attention_mask=None) -
                    target(input_ids=ids, position_ids=positions, attention_mask=None))
        assert diff.abs().max().item() < 1e-5


def test_lora_on_the_experts_runs_them_per_expert_with_the_same_weights(world, tiny_model_dir):
    from swift_megatron.lora import LoraConfig, apply_lora

    model, _ = load(tiny_model_dir("qwen3_moe"), True)
    ids, positions = tokens()
    with torch.no_grad():
        before = model(input_ids=ids, position_ids=positions, attention_mask=None)
    apply_lora(model, LoraConfig(target_modules=("q_proj",)))
    assert any(isinstance(m, GroupedExperts) for m in model.modules())   # experts not targeted
    model, _ = load(tiny_model_dir("qwen3_moe"), True)
    adapted = apply_lora(model, LoraConfig(target_modules=("gate_proj", "down_proj")))
    assert not any(isinstance(m, GroupedExperts) for m in model.modules())
    layers = model.config.num_layers
    assert sum(isinstance(m, SequentialMLP) for m in model.modules()) == layers
    assert len(adapted) == layers * 8 * 2     # per layer and expert: linear_fc1, linear_fc2
    with torch.no_grad():                      # B starts at zero: the base model's logits
        after = model(input_ids=ids, position_ids=positions, attention_mask=None)
    assert (after - before).abs().max().item() < 1e-5


def rlhf_flags(*extra):
    return parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", *extra],
                         "megatron rlhf")


def test_moe_flags_parse_as_ms_swifts():
    from swift_megatron.rlhf.grpo.components import _config_overrides

    args = rlhf_flags()
    assert (args.kernels.moe_grouped_gemm, args.kernels.moe_token_dispatcher_type) == \
        (True, "alltoall")
    assert _config_overrides(args, {})["moe_grouped_gemm"] is True
    assert _config_overrides(rlhf_flags("--moe_grouped_gemm", "false"), {})["moe_grouped_gemm"] \
        is False
    rlhf_flags("--moe_token_dispatcher_type", "allgather")     # no expert parallelism
    rlhf_flags("--moe_token_dispatcher_type", "allgather", "--tensor_model_parallel_size", "2")
    with pytest.raises(UserError, match=r"allgather with --expert_model_parallel_size 2: .*"
                                        r"use --moe_token_dispatcher_type alltoall"):
        rlhf_flags("--moe_token_dispatcher_type", "allgather",
                   "--expert_model_parallel_size", "2")
    with pytest.raises(UserError, match=r"--moe_token_dispatcher_type flex is not supported "
                                        r"yet: .*DeepEP"):
        rlhf_flags("--moe_token_dispatcher_type", "flex")
