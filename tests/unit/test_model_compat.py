"""model/compat.py's work-arounds that need no model run: a run without Transformer Engine (every
run here) prints no advice meant for Transformer Engine runs (issue 40)."""
import subprocess
import sys

SCRIPT = """
import swift_megatron.model.build  # what the trainer imports before it builds a model
from swift_megatron.model.config import transformer_config
import torch
hf = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
          rms_norm_eps=1e-6, max_position_embeddings=64)
transformer_config(hf, dtype=torch.float32, use_cpu_initialization=True,
                   recompute_granularity="selective", recompute_modules=["core_attn"])
print("built")
"""


def test_no_transformer_engine_advice_with_ms_swifts_recompute_default():
    """--recompute_modules core_attn (ms-swift's default) made megatron-core warn about
    Transformer Engine's fused attention on every run; the same config is built, quietly."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "built" in proc.stdout, proc.stderr[-2000:]
    assert "using transformer_engine" not in proc.stderr, proc.stderr[-2000:]
