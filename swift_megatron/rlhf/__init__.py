"""RLHF algorithms; grpo/ holds GRPO."""
