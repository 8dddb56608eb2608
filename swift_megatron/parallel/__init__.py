"""Parallelism: layout checks (layout.py, pure) and the process groups of a run (state.py).

Only this package and bridge/ touch megatron's parallel_state directly.
"""
