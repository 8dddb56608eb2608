"""The Megatron-core model: HF config -> TransformerConfig (config.py), our layer spec (spec.py),
GPTModel per pipeline stage (build.py), vocab-parallel logprobs and entropy (logprobs.py)."""
