"""Parallelism: the process groups of a run (state.py) and context-parallel sharing (context.py).
Whether a layout divides a model is the model's question: model/layout.py.

Only this package and bridge/ touch megatron's parallel_state directly.
"""
