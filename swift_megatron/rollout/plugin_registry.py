"""Gym environments, multi-turn schedulers and reward-model plugins registered by plugin files.

Plugin files passed with --external_plugins register classes here, directly or through ms-swift's
`envs[...]`, `multi_turns[...]` and `rm_plugins[...]` dicts (swift_megatron/compat/ms_swift).
Multi-turn rollouts look them up by name:

    from swift_megatron.rollout.plugin_registry import GYM_ENVS, SCHEDULERS
    env_cls = GYM_ENVS.lookup(name)          # UserError listing the registered names if unknown

RM_PLUGINS feeds --reward_model_plugin (rewards/reward_model.py).
Torch-free (cheap to import).
"""
import difflib
import inspect
from typing import Dict, List, Optional

from swift_megatron.arguments import ms_swift
from swift_megatron.errors import UserError
from swift_megatron.logging import get_logger

logger = get_logger(__name__)


class PluginRegistry:
    """Named classes of one kind (`what`, e.g. "gym env"), chosen with the flag `flag`."""

    def __init__(self, what: str, flag: str, elsewhere: Optional[Dict[str, str]] = None):
        """`elsewhere`: names ms-swift has built in and we do not, with the reason and the way
        out (what a lookup of such a name says when no plugin registered it)."""
        self.what, self.flag, self.elsewhere = what, flag, elsewhere or {}
        self._classes: Dict[str, type] = {}
        self._sources: Dict[str, str] = {}

    def register(self, name: str, cls: type, source: str = "?") -> None:
        """Make `cls` available under `name`; `source` (a plugin file) is named in messages.
        UserError when `name` is not a non-empty string or `cls` is not a class."""
        if not isinstance(name, str) or not name.strip():
            raise UserError(f"{source}: a {self.what} needs a non-empty name, got {name!r}")
        if not inspect.isclass(cls):
            raise UserError(f"{source}: {self.what} {name!r} must be a class, got "
                            f"{type(cls).__name__}")
        if name in self._classes and self._sources[name] != source:
            logger.warning(f"{self.what} {name!r} registered again (by {source}); it replaces "
                           f"the one from {self._sources[name]}")
        self._classes[name], self._sources[name] = cls, source

    def lookup(self, name: str) -> type:
        """The class registered under `name`; UserError naming the flag, the registered names
        and the closest one when there is none."""
        if name in self._classes:
            return self._classes[name]
        if name in self.elsewhere:
            raise UserError(f"{self.flag} {name}: {self.elsewhere[name]}")
        close = difflib.get_close_matches(name, self._classes, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        available = ", ".join(self.names()) or "(none: register one in a file passed with " \
                                                "--external_plugins)"
        raise UserError(f"{self.flag}: unknown {self.what} {name!r}.{hint} Registered: {available}")

    def names(self) -> List[str]:
        return sorted(self._classes)


GYM_ENVS = PluginRegistry("gym env", "--gym_env")
SCHEDULERS = PluginRegistry("multi-turn scheduler", "--multi_turn_scheduler", ms_swift.SCHEDULERS)
RM_PLUGINS = PluginRegistry("reward-model plugin", "--reward_model_plugin")
