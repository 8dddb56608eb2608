"""Reward functions for GRPO: the built-ins, user plugin files, and how --reward_funcs resolves.

    from swift_megatron.rewards import (RewardConfig, load_plugins, resolve_reward_funcs,
                                        compute_rewards)
    modules = load_plugins(args.external_plugins)
    funcs = resolve_reward_funcs(args.reward_funcs, modules, RewardConfig.from_args(args))
    per_func = compute_rewards(funcs, completions, prompts=..., completion_ids=...,
                               truncated=..., **dataset_columns)

Torch-free (cheap to import). User-facing documentation: docs/rewards.md.
"""
from swift_megatron.rewards.registry import (REWARD_ERROR_POLICIES, RewardConfig, builtin_names,
                                             compute_rewards, instantiate_reward,
                                             register_reward, registered_names,
                                             resolve_reward_funcs, score_rewards)
from swift_megatron.rewards.plugins import load_plugins, module_callables
# Registers the built-ins; registry.py relies on it: Python runs this file before any module of
# the package can be used.
from swift_megatron.rewards import builtin  # noqa: F401

BUILTIN_REWARDS = tuple(builtin_names())

__all__ = ["BUILTIN_REWARDS", "REWARD_ERROR_POLICIES", "RewardConfig", "builtin_names",
           "compute_rewards", "instantiate_reward", "load_plugins", "module_callables",
           "register_reward", "registered_names", "resolve_reward_funcs", "score_rewards"]
