"""Rollout flags: the vLLM engine (shared by the trainer and `megatron rollout`) and how the
trainer reaches it (colocate or server mode, weight sync, memory hand-over). docs/rollout.md
explains how they fit together."""
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional
from urllib.parse import urlparse

from swift_megatron.arguments.data import MAX_PIXELS_HELP, check_agent_template, check_max_pixels
from swift_megatron.arguments.fields import arg
from swift_megatron.errors import UserError

API_KEY_ENV = "SWIFT_MEGATRON_ROLLOUT_API_KEY"  # the rollout server's key, for both sides



def api_key(flag: str, value: Optional[str], from_env: bool = True) -> Optional[str]:
    """The key the flag (or else, with `from_env`, API_KEY_ENV) gives; None for none. An empty
    or blank flag, or API_KEY_ENV set but blank, would silently turn authentication off:
    refused."""
    if value is None:
        value = os.environ.get(API_KEY_ENV) if from_env else None
        if value is not None and not value.strip():
            raise UserError(f"${API_KEY_ENV} is set but empty: that would turn authentication "
                            f"off. Set it to the key, or unset it (`unset {API_KEY_ENV}`) for a "
                            f"server without authentication")
        return value
    if not value.strip():
        raise UserError(f"{flag} is empty: that would turn authentication off. Give the key, or "
                        f"leave {flag} out for a server without authentication")
    return value

@dataclass
class VllmEngineArguments:
    """vLLM engine"""

    vllm_gpu_memory_utilization: float = arg(0.9, "Fraction of GPU memory vLLM may use "
                                             "(weights + KV cache). Colocate mode shares the GPU "
                                             "with training: lower it (e.g. 0.3-0.5).")
    vllm_tensor_parallel_size: int = arg(1, "vLLM tensor-parallel degree, independent of the "
                                         "Megatron layout. Colocate: consecutive training ranks "
                                         "form one vLLM TP group.")
    vllm_max_model_len: Optional[int] = arg(None, "vLLM context length. Default: max_length "
                                            "(prompt + completion), else the model's "
                                            "max_position_embeddings.")
    vllm_enforce_eager: bool = arg(False, "Disable CUDA graphs in vLLM (saves memory and start "
                                   "time).")
    vllm_enable_prefix_caching: bool = arg(True, "vLLM automatic prefix caching (reset after "
                                           "every weight update).")
    vllm_disable_cascade_attn: bool = arg(False, "Turn off vLLM's cascade attention (its "
                                          "shared-prefix kernel), as ms-swift's flag does.")
    vllm_max_num_seqs: Optional[int] = arg(None, "vLLM's max_num_seqs: sequences in one engine "
                                           "step. Default: vLLM's.")
    vllm_engine_kwargs: Optional[Dict[str, Any]] = arg(None, "Extra keyword arguments for vLLM's "
                                                       "engine, as JSON: '{\"max_num_batched_tokens\""
                                                       ": 8192}'. Flags above win over them.")

    def __post_init__(self):
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise UserError("--vllm_gpu_memory_utilization must be in (0, 1]")
        if self.vllm_tensor_parallel_size < 1:
            raise UserError("--vllm_tensor_parallel_size must be >= 1")
        if self.vllm_max_model_len is not None and self.vllm_max_model_len < 2:
            raise UserError("--vllm_max_model_len must be at least 2")
        if self.vllm_max_num_seqs is not None and self.vllm_max_num_seqs < 1:
            raise UserError("--vllm_max_num_seqs must be >= 1")
        if self.vllm_engine_kwargs is not None and not isinstance(self.vllm_engine_kwargs, dict):
            raise UserError("--vllm_engine_kwargs must be a JSON object")


@dataclass
class RolloutArguments:
    """Rollout (trainer side)"""

    use_vllm: Optional[bool] = arg(None, "Generate with vLLM. Default: true in server mode, and "
                                   "in colocate mode when vLLM is installed and training runs on "
                                   "CUDA; otherwise the embedded transformers engine.")
    vllm_mode: str = arg("colocate", "colocate: a vLLM engine inside every training process; "
                         "server: remote `megatron rollout` servers.",
                         choices=["colocate", "server"])
    sleep_level: int = arg(0, "Colocate: while training, vLLM releases its KV cache and offloads "
                           "its weights to host memory (1) or discards them (2; they are "
                           "reloaded by the next weight sync, which sends every weight). At 1, "
                           "when every sync sends every weight anyway (always, except with a "
                           "frozen vision tower), the weights are discarded as at 2: the host "
                           "copy would be overwritten unread.", choices=[0, 1, 2])
    vllm_request_seeds: bool = arg(True, "Colocate: sample every completion with its own seed "
                                   "(derived from --seed and its prompt's slot), so that it does "
                                   "not depend on the batch or the process that generated it "
                                   "(the same completions under any DP or TP layout). false: one "
                                   "seed per generate call and vLLM's batched draw (as ms-swift "
                                   "and TRL sample; a rerun of the same command still samples the "
                                   "same), which skips vLLM's per-request draw, one GPU kernel per "
                                   "seeded request and decode step (measured 2-4% of the "
                                   "generation at 128 requests: docs/gpu.md). Server mode always "
                                   "sends per-request seeds.")
    offload_model: bool = arg(False, "Colocate: move the training weights to host memory while "
                              "vLLM generates (the grads are freed then in any case).")
    offload_optimizer: bool = arg(False, "Colocate: move the optimizer state and main params to "
                                  "host memory while vLLM generates.")
    tail_logprobs: bool = arg(
        False, "Colocate: while vLLM decodes the last completions of a rollout batch, compute the "
        "reference and old-policy logprobs of those already finished, between engine steps, so "
        "that only the last ones' passes remain after the generation (the same values as the "
        "passes after it). Needs one process per model replica (TP, PP, CP and EP 1), "
        "single-turn text prompts and the models on the GPU (no --offload_model). At sleep "
        "levels 1 and 2 the passes' memory comes on top of the awake engine's; with "
        "--offload_ref_model the reference stays on the GPU from its first pass in the tail to "
        "the last after it. Off by default until its GPU measurement (docs/gpu.md).")
    vllm_server_host: List[str] = arg([], "Server mode: host of each `megatron rollout` server "
                                      "(none given: 127.0.0.1).")
    vllm_server_port: List[int] = arg([8000], "Server mode: port of each server (one value for "
                                      "all hosts, or one per host).")
    vllm_server_base_url: List[str] = arg([], "Server mode: base URL of each server "
                                          "(http://host:port), instead of --vllm_server_host and "
                                          "--vllm_server_port.")
    vllm_server_api_key: Optional[str] = arg(None, "Server mode: the key the servers were "
                                             "started with (`megatron rollout --api_key`). "
                                             f"Default: ${API_KEY_ENV} when set.")
    vllm_server_timeout: float = arg(240.0, "Server mode: seconds to wait for the servers at "
                                     "start (health poll) and for each request.")
    weight_sync_timeout: Optional[float] = arg(
        None, "Seconds a weight sync may take before the run ends with an error naming the step, "
        "the bucket and the rollout server (a dead or frozen peer would hang it); 0: no limit. "
        "Default 600, plus --vllm_server_timeout in server mode (a sync may wait that long for "
        "another trainer's communicator).")
    weight_sync_bucket_mb: int = arg(512, "Weight sync: bucket size in MiB (tensors are loaded, "
                                     "or broadcast to servers, one bucket at a time).")
    check_weight_sync: bool = arg(False, "After each weight sync, sample a few completions of "
                                  "fixed prompts with the engine and compare its logprobs of "
                                  "those tokens with the trainer's; stop past "
                                  "--check_weight_sync_atol.")
    check_weight_sync_atol: float = arg(0.05, "Largest accepted mean |engine - trainer| logprob "
                                        "of --check_weight_sync (bf16 kernels differ by ~0.01; "
                                        "a broken sync by O(1)).")
    numerics_check: bool = arg(True, "Before the first optimizer step, compare the trainer's "
                               "logprobs of the first rollout batch with the engine's (numbers "
                               "the step already has) and stop past the model's tolerance: "
                               "dense 0.05, Gated DeltaNet 0.1, MoE 0.5 mean |engine - trainer| "
                               "per token (docs/rlhf.md#the-first-step-numerics-gate). Skipped "
                               "when the engine returns no logprobs or samples with --top_p, "
                               "--top_k or --repetition_penalty.")
    numerics_check_atol: Optional[float] = arg(None, "The numerics check's tolerance instead of "
                                               "the model's (mean |engine - trainer| logprob "
                                               "per completion token).")

    offload_bridge: bool = arg(False, "ms-swift: keep the HF-format weights exported for vLLM in "
                               "host memory.",
                               no_effect="weights are exported in buckets of "
                                         "--weight_sync_bucket_mb and never held whole")

    def __post_init__(self):
        if self.vllm_server_base_url:
            self._hosts_from_base_urls()
        if self.vllm_mode == "server" and self.use_vllm is False:
            raise UserError("--vllm_mode server needs vLLM; drop --use_vllm false")
        if self.check_weight_sync_atol <= 0:
            raise UserError("--check_weight_sync_atol must be > 0")
        if self.numerics_check_atol is not None and not self.numerics_check_atol > 0:
            raise UserError("--numerics_check_atol must be > 0")
        if self.weight_sync_bucket_mb < 1:
            raise UserError("--weight_sync_bucket_mb must be >= 1")
        if self.vllm_server_timeout <= 0:
            raise UserError("--vllm_server_timeout must be > 0")
        self._resolve_sync_timeout()
        self.vllm_server_api_key = api_key("--vllm_server_api_key", self.vllm_server_api_key,
                                           from_env=self.vllm_mode == "server")
        if self.vllm_mode == "server" and not self.vllm_server_host:
            self.vllm_server_host = ["127.0.0.1"]
        ports, hosts = self.vllm_server_port, self.vllm_server_host
        if self.vllm_mode == "server" and len(ports) not in (1, len(hosts)):
            raise UserError(f"--vllm_server_port: give one port for all hosts or one per host "
                            f"({len(hosts)} hosts, {len(ports)} ports)")
        if any(not 0 < p < 65536 for p in ports):
            raise UserError(f"--vllm_server_port: ports must be in 1..65535, got {ports}")

    def _resolve_sync_timeout(self) -> None:
        """--weight_sync_timeout's default, and a limit shorter than a sync may wait refused."""
        server = self.vllm_mode == "server"
        if self.weight_sync_timeout is None:
            self.weight_sync_timeout = 600.0 + (self.vllm_server_timeout if server else 0.0)
        if self.weight_sync_timeout < 0:
            raise UserError("--weight_sync_timeout must be >= 0 (0: no limit)")
        if server and 0 < self.weight_sync_timeout <= self.vllm_server_timeout:
            raise UserError(f"--weight_sync_timeout {self.weight_sync_timeout:g} must exceed "
                            f"--vllm_server_timeout {self.vllm_server_timeout:g} in server mode "
                            "(a sync may wait that long for another trainer's communicator), "
                            "or be 0 (no limit)")

    def _hosts_from_base_urls(self) -> None:
        if self.vllm_server_host:
            raise UserError("pass --vllm_server_base_url or --vllm_server_host/--vllm_server_port, "
                            "not both")
        hosts, ports = [], []
        for url in self.vllm_server_base_url:
            parsed = urlparse(url if "://" in url else f"http://{url}")
            try:
                port = parsed.port or 80
            except ValueError:
                port = None
            if not parsed.hostname or parsed.path.strip("/") or port is None:
                raise UserError(f"--vllm_server_base_url {url}: expected http://host:port")
            hosts.append(parsed.hostname)
            ports.append(port)
        self.vllm_server_host, self.vllm_server_port = hosts, ports

    def vllm_enabled(self, vllm_installed: bool, on_cuda: bool) -> bool:
        """Whether rollouts use vLLM: --use_vllm, or its default (see the flag's help)."""
        if self.use_vllm is not None:
            return self.use_vllm
        return self.vllm_mode == "server" or (vllm_installed and on_cuda)

    def server_addresses(self) -> List[str]:
        """host:port of every rollout server (server mode)."""
        ports = self.vllm_server_port * len(self.vllm_server_host) \
            if len(self.vllm_server_port) == 1 else self.vllm_server_port
        return [f"{h}:{p}" for h, p in zip(self.vllm_server_host, ports)]


@dataclass
class ServeArguments:
    """Rollout server"""

    host: str = arg("127.0.0.1", "Address to listen on (0.0.0.0 for every interface). The "
                    "weight-sync communicator listens on the same address.")
    port: int = arg(8000, "Port to listen on.")
    api_key: Optional[str] = arg(None, "Require `Authorization: Bearer <key>` on every "
                                 f"endpoint (401 otherwise). Default: ${API_KEY_ENV} when set. "
                                 "Trainers send it with --vllm_server_api_key.")
    enable_docs: bool = arg(False, "Serve FastAPI's /docs, /redoc and /openapi.json.")
    communicator_timeout: float = arg(120.0, "Seconds the replicas wait for the trainer to join "
                                      "the weight-sync communicator after /join_communicator "
                                      "(and for each bucket's broadcast); a communicator nobody "
                                      "joins is closed after it and generation goes on.")
    communicator_lease: float = arg(60.0, "Seconds a trainer keeps the weight-sync communicator "
                                    "without a sign of life (it renews the lease every quarter "
                                    "of it while it runs): once it lapses, the server frees the "
                                    "communicator of a trainer that died or was killed, and the "
                                    "next trainer connects.")
    vllm_data_parallel_size: int = arg(1, "vLLM engine replicas, one process each, "
                                       "vllm_tensor_parallel_size GPUs each; generate requests "
                                       "are spread over them.")
    max_pixels: Optional[int] = arg(None, MAX_PIXELS_HELP + " Give the trainer's value (its "
                                    "--max_pixels or MAX_PIXELS).")

    def __post_init__(self):
        check_max_pixels(self.max_pixels)
        self.api_key = api_key("--api_key", self.api_key)
        if self.vllm_data_parallel_size < 1:
            raise UserError("--vllm_data_parallel_size must be >= 1")
        if not 0 < self.communicator_timeout < float("inf"):
            raise UserError(f"--communicator_timeout must be a positive number of seconds, got "
                            f"{self.communicator_timeout}")
        if not 0 < self.communicator_lease < float("inf"):
            raise UserError(f"--communicator_lease must be a positive number of seconds, got "
                            f"{self.communicator_lease}")
        if not 0 < self.port < 65536:
            raise UserError(f"--port must be in 1..65535, got {self.port}")


@dataclass
class ServeMultiTurnArguments:
    """Rollout server: multi-turn"""

    multi_turn_scheduler: Optional[str] = arg(None, "Run multi-turn rollouts in the server (as "
                                              "ms-swift's rollout server): a scheduler built in "
                                              "(calculator, gym_scheduler) or registered by "
                                              "--external_plugins. Trainers then send whole "
                                              "prompts with their dataset columns to /rollout "
                                              "(docs/multi_turn.md).")
    max_turns: Optional[int] = arg(None, "Most model turns per conversation (none: until the "
                                   "scheduler stops or the length budget is spent).")
    gym_env: Optional[str] = arg(None, "The gym environment of --multi_turn_scheduler "
                                 "gym_scheduler; a row's env_config name overrides it.")
    external_plugins: List[str] = arg([], "Python files to import at start: they register "
                                      "schedulers and gym environments.")
    use_gym_env: Optional[bool] = arg(None, "The server supplies the reward: each episode's "
                                      "total environment reward, which trainers add as their "
                                      "gym_reward column (they read it from /health and then "
                                      "need no --reward_funcs). Default: true with --gym_env.")
    enable_thinking: Optional[bool] = arg(None, "Passed to the chat template as "
                                          "`enable_thinking` when the server renders an "
                                          "episode's later turns (a trainer's --enable_thinking "
                                          "wins).")
    max_length: Optional[int] = arg(None, "Most tokens an episode (prompt and every turn) may "
                                    "reach; a trainer's smaller --max_length wins.")
    agent_template: Optional[str] = arg(None, "How the scheduler's tool results are written "
                                        "between turns: hermes (one user turn of "
                                        "<tool_response> blocks, as ms-swift), or none: the chat "
                                        "template's tool role (megatron rlhf --agent_template).")

    def __post_init__(self):
        if self.max_turns is not None and self.max_turns < 1:
            raise UserError(f"--max_turns must be >= 1 (or none: no limit), got {self.max_turns}")
        if self.max_length is not None and self.max_length < 2:
            raise UserError(f"--max_length must be >= 2, got {self.max_length}")
        check_agent_template(self.agent_template)
        if self.use_gym_env is None:
            self.use_gym_env = self.gym_env is not None
        if self.multi_turn_scheduler is None:
            for name in ("max_turns", "gym_env", "use_gym_env", "enable_thinking", "max_length"):
                if getattr(self, name) not in (None, False):
                    raise UserError(f"--{name} applies to multi-turn rollouts: pass "
                                    f"--multi_turn_scheduler")
