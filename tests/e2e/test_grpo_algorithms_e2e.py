"""The GRPO algorithm options of issue 14 end to end: `megatron rlhf` as a subprocess on the tiny
model, several options per run (their math is unit-tested against hand-computed values in
tests/unit/test_grpo_loss_types.py, test_grpo_advantages.py and test_grpo_diagnostics.py):

- cispo + rloo with the KL in the rewards + num_iterations 2 + entropy mask + sequence_mask IS +
  off-policy sequence mask + sync_ref_model + a reward model + truncation delete +
  num_generations_eval; resumed from its mid-run checkpoint bit-identically (the synced
  reference is part of the checkpoint);
- real (padded micro-batches) + reinforce_plus_plus against an --mcore_ref_model reference;
- sapo on-policy distillation: LoRA, --teacher_model of another size (offloaded), one
  generation per prompt, no reward function, a --ref_adapters reference, token_mask IS;
- fipo + gdpo + delta against a --ref_model of another size.
"""
import json
import os

import pytest

from tests.e2e.test_rlhf_e2e import PLUGIN, logged, rlhf, rlhf_together
from tests.helpers import build_peft_adapter, build_tiny_reward_model

pytestmark = pytest.mark.slow
LONG_ROWS = 8   # prompts longer than max_length - max_completion_length, added to the dataset


@pytest.fixture(scope="module")
def files(tiny_model_dir, math_dataset_path, tmp_path_factory):
    from swift_megatron.fixtures import build_tiny_model

    root = tmp_path_factory.mktemp("algorithms")
    data = root / "math_and_long.jsonl"
    long = {"messages": [{"role": "user", "content": "What is 1 + 1? " * 20}], "solution": "2"}
    data.write_text(open(math_dataset_path).read() + "".join(json.dumps(long) + "\n"
                                                             for _ in range(LONG_ROWS)))
    policy = tiny_model_dir("qwen3")
    return dict(
        policy=policy, data=str(data),
        teacher=build_tiny_model("qwen3", str(root / "teacher"), seed=1, hidden_size=32,
                                 num_hidden_layers=2, intermediate_size=64),
        reward_model=build_tiny_reward_model(str(root / "tiny_rm")),
        adapter=build_peft_adapter(policy, str(root / "ref_adapter")))


def base(files, **overrides):
    flags = {"model": files["policy"], "dataset": files["data"], "external_plugins": PLUGIN,
             "reward_funcs": "digit_ratio", "num_generations": 4, "global_batch_size": 8,
             "micro_batch_size": 2, "steps_per_generation": 2, "max_completion_length": 12,
             "max_length": 36, "beta": 0.1, "lr": "1e-3", "report_to": "none",
             "logging_steps": 1, "add_version": "false", "seed": 3}
    flags.update(overrides)
    argv = []
    for key, value in flags.items():
        if value is not None:
            argv += [f"--{key}"] + (value if isinstance(value, list) else [value])
    return argv


CISPO = dict(loss_type="cispo", epsilon_high=5, advantage_estimator="rloo", num_iterations=2,
             train_iters=8, top_entropy_quantile="0.5", log_entropy="true",
             rollout_importance_sampling_mode="sequence_mask",
             off_policy_sequence_mask_delta="0.0", sync_ref_model="true", ref_model_sync_steps=2,
             ref_model_mixup_alpha="0.5", reward_funcs="digit_ratio",
             reward_model=None, reward_weights=["1", "0.5"], truncation_strategy="delete",
             split_dataset_ratio="0.1", eval_steps=8, num_generations_eval=2, save_steps=4)


def cispo_flags(files):
    return dict(CISPO, reward_model=files["reward_model"])


@pytest.fixture(scope="module")
def first_runs(files, tmp_path_factory):
    """The runs the two tests below start from, at once: cispo's straight run (to be resumed)
    and a trained checkpoint of ours (--mcore_ref_model of the real run)."""
    root = tmp_path_factory.mktemp("first_runs")
    straight, reference = root / "straight", root / "reference"
    proc, _ = rlhf_together([base(files, output_dir=straight, **cispo_flags(files)),
                             base(files, output_dir=reference, train_iters=2)])
    return dict(straight=straight, straight_stdout=proc.stdout, reference=reference)


def test_cispo_rloo_sync_ref_reward_model_and_resume(files, first_runs, tmp_path):
    flags = cispo_flags(files)
    out = first_runs["straight"]
    assert f"{LONG_ROWS} of 72 prompts were longer than max_length - max_completion_length " \
           f"= 24 tokens and were dropped" in first_runs["straight_stdout"]
    rows = logged(out)
    assert [r["step"] for r in rows] == [4, 8]  # num_iterations 2 x steps_per_generation 2
    first, second = rows
    assert first["reward/kl"] == 0.0 and second["reward/kl"] != 0.0  # synced ref, moved policy
    assert "kl" not in first  # --kl_in_reward (rloo's default): no KL term in the loss
    assert first["reward/tiny_rm/std"] > 0  # the reward model scored every completion
    assert 0.4 <= first["entropy/kept_fraction"] <= 0.6  # the top half of the entropies
    assert first["entropy/completion_max"] >= first["entropy/completion_mean"] >= \
        first["entropy/completion_min"]
    assert first["rollout_correction/ess"] > 0.99 and first["rollout_correction/clipped_frac"] == 0
    assert "clip_ratio/high" in first and first["grad_norm"] > 0
    assert second["eval/num_completions"] == 7 * 2  # ceil(0.1 x 64 kept prompts) x 2
    assert os.path.isfile(out / "iter_0000004" / "ref_model" / "metadata.json")
    resumed_out = tmp_path / "resumed"   # the reference now in host memory between its uses
    rlhf(*base(files, output_dir=resumed_out, load=out / "iter_0000004", offload_ref_model="true",
               **flags))                        # (its load, logprobs, two syncs and a save)
    [resumed] = logged(resumed_out)
    for key in ("loss/policy", "grad_norm", "reward/mean", "reward/kl", "lr", "entropy"):
        assert resumed[key] == pytest.approx(second[key], rel=1e-6, abs=1e-9), key


def test_real_padded_with_an_mcore_reference(files, first_runs, tmp_path):
    reference = first_runs["reference"]  # a trained checkpoint of ours
    out = tmp_path / "real"
    rlhf(*base(files, output_dir=out, loss_type="real", micro_batch_size=4,
               advantage_estimator="reinforce_plus_plus", mcore_ref_model=reference,
               padding_free="false", train_iters=2, reward_funcs=["digit_ratio", "contains_answer"]))
    [row] = logged(out)
    assert row["reward/kl"] != 0.0  # the reference is the trained checkpoint, not the start
    assert "clip_ratio/low" not in row and row["grad_norm"] > 0


def test_sapo_distillation_with_lora_teacher_and_reference_adapter(files, tmp_path):
    out = tmp_path / "distil"
    rlhf(*base(files, output_dir=out, num_generations=1, global_batch_size=4, train_iters=4,
               reward_funcs=None, external_plugins=None, beta="0.05", train_type="lora",
               ref_adapters=files["adapter"], teacher_model=files["teacher"],
               offload_teacher_model="true", loss_type="sapo",
               rollout_importance_sampling_mode="token_mask"))
    first, second = logged(out)
    assert first["reward/mean"] == 0.0 and first["grad_norm"] > 0  # the teacher's signal alone
    assert first["kl"] > 0  # reference = base + ref adapter, policy = base + fresh (zero) LoRA
    assert first["teacher_kl"] > 0 and second["teacher_kl"] > 0  # another model scored them
    assert "clip_ratio/high" not in first  # sapo has no hard clipping


def test_fipo_gdpo_two_iterations_against_another_reference_model(files, tmp_path):
    """One optimizer step per pass, two passes (--num_iterations 2): the second pass compares
    with the logprobs of the policy that generated the rollout, so its future KL is not 0 (it
    would be exactly 0 on both steps if the old logprobs were the current ones)."""
    out = tmp_path / "fipo"
    rlhf(*base(files, output_dir=out, loss_type="fipo", delta=2, scale_rewards="gdpo",
               reward_funcs=["digit_ratio", "contains_answer"], ref_model=files["teacher"],
               steps_per_generation=1, num_iterations=2, train_iters=2, fipo_decay_rate=4))
    [row] = logged(out)
    assert row["step"] == 2 and row["fipo/future_kl_mean"] != 0.0
    assert row["kl"] > 0  # another model from the first step on
    assert row["fipo/influence_weight_mean"] >= 1.0  # clip_high_only: weights in [1, 1.2]
    assert row["fipo/safety_keep_ratio"] == 1.0 and row["grad_norm"] > 0
