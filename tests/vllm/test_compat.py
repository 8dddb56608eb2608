"""vllm_compat.create_llm without an engine: vLLM's start-up memory check becomes a UserError
naming --vllm_gpu_memory_utilization; other errors pass through unchanged. The model-specific
engine keywords (`model_defaults`: Qwen3.5 starts its language model only)."""
import pytest

vllm = pytest.importorskip("vllm")

from swift_megatron.errors import UserError  # noqa: E402
from swift_megatron.rollout import vllm_compat  # noqa: E402

# the message of vLLM 0.26's request_memory (v1/worker/utils.py)
MEMORY = ("Free memory on device cuda:0 (30.1/79.2 GiB) on startup is less than desired GPU "
          "memory utilization (0.9, 71.3 GiB). Decrease GPU memory utilization or reduce GPU "
          "memory used by other processes.")


@pytest.fixture
def failing_llm(monkeypatch):
    def fail_with(message):
        def llm(**kwargs):
            raise ValueError(message)
        monkeypatch.setattr(vllm, "LLM", llm)
        monkeypatch.setattr(vllm_compat, "check_model_supported", lambda model, dtype=None: None)
        monkeypatch.setattr(vllm_compat, "model_defaults", lambda model: {})
    return fail_with


def test_memory_error_names_the_flag(failing_llm):
    failing_llm(MEMORY)
    settings = vllm_compat.EngineSettings(model="m", dtype="bfloat16", gpu_memory_utilization=0.9)
    with pytest.raises(UserError, match=r"--vllm_gpu_memory_utilization 0.9 .*lower it"):
        vllm_compat.create_llm(settings)


def test_other_errors_pass_through(failing_llm):
    failing_llm("unsupported architecture")
    with pytest.raises(ValueError, match="unsupported architecture"):
        vllm_compat.create_llm(vllm_compat.EngineSettings(model="m", dtype="bfloat16"))


def test_qwen3_5_engines_start_their_language_model_only(tiny_model_dir):
    """Qwen3.5 checkpoints carry a vision tower that their vLLM rollouts do not use."""
    for family in ("qwen3_5", "qwen3_5_moe"):
        assert vllm_compat.model_defaults(tiny_model_dir(family)) == {"language_model_only": True}
    assert vllm_compat.model_defaults(tiny_model_dir("qwen3")) == {}
