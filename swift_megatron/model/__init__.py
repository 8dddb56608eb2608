"""The Megatron-core model: HF config -> TransformerConfig (config.py), whether a parallel layout
divides the model (layout.py, pure), our layer spec (spec.py), GPTModel per pipeline stage
(build.py) and the model inside megatron's wrappers (wrappers.py), the last stage's final hidden
states for the loss (head.py) and the output layer's vocab-parallel logprobs and entropy from
them (logprobs.py)."""
