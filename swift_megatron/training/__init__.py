"""Megatron training machinery shared by every trainer: DDP wrapping and the optimizer with its
learning-rate schedule (optim.py), and one optimizer step through megatron's pipelined
forward_backward_func (step.py)."""
