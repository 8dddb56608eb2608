"""Automatic planning (--auto_parallel): candidates.py, cost.py, plan.py, command.py."""
