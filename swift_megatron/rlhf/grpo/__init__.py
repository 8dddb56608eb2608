"""GRPO: group-relative advantages (advantages.py), the clipped policy loss and its token
aggregation (losses.py), and group/completion filtering (filtering.py) are pure torch; the
trainer that wires them to Megatron lives beside them."""
