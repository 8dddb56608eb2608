"""Checkpoints: megatron distributed checkpoints of model weights (dist.py, layout-independent:
save with one TP/PP/EP layout, load with another) and full training state for resume."""
