"""Loading ms-swift plugin files: a stand-in `swift` package that exists only while one is imported.

`plugin_api(path)` wraps the import of one --external_plugins file (rewards/plugins.py, which
reaches it through the hook compat/ms_swift/__init__.py registers):

- Without ms-swift, it puts a small `swift.*` module tree into sys.modules (the names listed in
  `_tree`: reward and rollout base classes, registry dicts, protocol data classes, stand-ins that
  need ms-swift, get_logger/to_device) and, once the import is over, restores sys.modules
  exactly; the plugin keeps the references it took.
- With ms-swift installed (a `swift` package with a `rewards` subpackage that is not ours), it
  shadows nothing: the plugin imports the real ms-swift.

Either way, what the import added to the `orms`, `rm_plugins`, `envs` and `multi_turns` dicts is
then registered with swift-megatron: rewards with the reward registry (so --reward_funcs finds
them), the rest with swift_megatron/rollout/plugin_registry.py.
"""
import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Dict, Iterator, Optional

from swift_megatron.compat.ms_swift import protocol, rewards, rollout, runtime, utils
from swift_megatron.errors import UserError
from swift_megatron.logging import get_logger
from swift_megatron.rewards.registry import add_reward
from swift_megatron.rollout.plugin_registry import GYM_ENVS, RM_PLUGINS, SCHEDULERS

logger = get_logger(__name__)

ORIGIN = "swift-megatron's stand-in for ms-swift's plugin API"
# Where ms-swift keeps each registry a plugin fills.
REGISTRY_HOMES = {"orms": "swift.rewards", "rm_plugins": "swift.rewards",
                  "envs": "swift.rollout.gym_env", "multi_turns": "swift.rollout.multi_turn"}
Registries = Dict[str, Dict[str, Any]]


def _tree(reg: Registries) -> Dict[str, Dict[str, Any]]:
    """Module name -> attributes of the stand-in `swift` package around the registries `reg`."""
    p = protocol
    reward_api = dict(ORM=rewards.ORM, AsyncORM=rewards.AsyncORM, orms=reg["orms"])
    env_api = dict(Env=rollout.Env, envs=reg["envs"])
    scheduler_api = dict(RolloutScheduler=rollout.RolloutScheduler,
                         MultiTurnScheduler=rollout.MultiTurnScheduler,
                         multi_turns=reg["multi_turns"])
    data = {name: getattr(p, name) for name in (
        "InferRequest", "RolloutInferRequest", "RequestConfig", "UsageInfo", "ChatMessage",
        "ChatCompletionResponseChoice", "ChatCompletionResponse", "RolloutOutput", "Messages")}
    engines = dict(TransformersEngine=runtime.TransformersEngine, VllmEngine=runtime.VllmEngine,
                   InferClient=runtime.InferClient)
    return {
        "swift": {},
        "swift.rewards": dict(reward_api, rm_plugins=reg["rm_plugins"]),
        "swift.rewards.orm": reward_api,
        "swift.rewards.rm_plugin": dict(DefaultRMPlugin=runtime.DefaultRMPlugin,
                                        rm_plugins=reg["rm_plugins"]),
        "swift.rollout": dict(env_api, **scheduler_api),
        "swift.rollout.gym_env": env_api,
        "swift.rollout.multi_turn": scheduler_api,
        "swift.infer_engine": dict(engines, InferRequest=p.InferRequest,
                                   RequestConfig=p.RequestConfig,
                                   ChatCompletionResponse=p.ChatCompletionResponse),
        "swift.infer_engine.protocol": data,
        "swift.template": dict(Template=runtime.Template, Messages=p.Messages),
        "swift.utils": dict(get_logger=utils.get_logger, to_device=utils.to_device),
    }


def stand_in_modules(reg: Registries) -> Dict[str, ModuleType]:
    """The stand-in `swift` package as modules, each submodule also an attribute of its parent."""
    modules = {}
    for name, attributes in _tree(reg).items():
        module = ModuleType(name, f"{ORIGIN} ({name})")
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin=ORIGIN, is_package=True)
        module.__path__ = []  # a package: `import swift.unknown` fails with a plain "No module"
        vars(module).update(attributes)
        modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules


def _is_swift(name: str) -> bool:
    return name == "swift" or name.startswith("swift.")


@contextlib.contextmanager
def _installed(modules: Dict[str, ModuleType]) -> Iterator[None]:
    """`modules` in sys.modules in place of any `swift*` entries, which come back afterwards."""
    saved = {name: module for name, module in sys.modules.items() if _is_swift(name)}
    for name in saved:
        del sys.modules[name]
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in [name for name in sys.modules if _is_swift(name)]:
            del sys.modules[name]
        sys.modules.update(saved)


def ms_swift_installed() -> bool:
    """True when `import swift` would find ms-swift (a package with a `rewards` subpackage)
    rather than nothing, our stand-in, or an unrelated package of that name."""
    try:
        spec = importlib.util.find_spec("swift")
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
        return False
    if spec is None or spec.origin == ORIGIN:
        return False
    return any(os.path.isdir(os.path.join(folder, "rewards"))
               for folder in spec.submodule_search_locations or [])


def _real_registries() -> Registries:
    """ms-swift's own registry dicts (those that import)."""
    found = {}
    for key, home in REGISTRY_HOMES.items():
        try:
            found[key] = getattr(importlib.import_module(home), key)
        except (ImportError, AttributeError) as error:
            logger.warning(f"ms-swift's {home}.{key} is not available ({error}); plugin "
                           f"registrations there are not seen")
    return found


def _empty_registries() -> Registries:
    return {key: {} for key in REGISTRY_HOMES}


def _explain_missing(error: ImportError) -> UserError:
    provided = ", ".join(name for name in _tree(_empty_registries()) if name != "swift")
    return UserError(f"{error}: swift-megatron provides only ms-swift's plugin API ({provided}); "
                     f"install ms-swift for the rest")


@contextlib.contextmanager
def plugin_api(source: str) -> Iterator[None]:
    """Make ms-swift's plugin API importable while the plugin file `source` runs, then register
    what it added to ms-swift's registries (see the module docstring). UserError when the file
    imports a part of ms-swift we do not provide, or registers something invalid."""
    real = ms_swift_installed()
    registries = _real_registries() if real else _empty_registries()
    before = {key: dict(registry) for key, registry in registries.items()}
    try:
        with contextlib.nullcontext() if real else _installed(stand_in_modules(registries)):
            yield
    except ImportError as error:
        if real or not _is_swift(error.name or ""):
            raise
        raise _explain_missing(error) from error
    register_additions({key: {name: obj for name, obj in registry.items()
                              if before[key].get(name) is not obj}
                        for key, registry in registries.items()}, source)


def explain_late_import(error: ImportError, what: str) -> Optional[UserError]:
    """A UserError for `what` (e.g. "reward 'x': creating X") failing to import part of ms-swift
    after its plugin was loaded, when the stand-in is gone; None for other import errors."""
    if not _is_swift(error.name or "") or ms_swift_installed():
        return None
    return UserError(f"{what} failed: {error}. Without ms-swift, its plugin API exists only while "
                     f"plugin files are imported: import it at the top of the plugin file, or "
                     f"install ms-swift")


def register_additions(added: Registries, source: str) -> None:
    """Register the entries a plugin added, per ms-swift registry name, with ours."""
    for name, obj in added.get("orms", {}).items():
        add_reward(name, obj, f"orms[{name!r}]")
    for key, registry in (("envs", GYM_ENVS), ("multi_turns", SCHEDULERS),
                          ("rm_plugins", RM_PLUGINS)):
        for name, obj in added.get(key, {}).items():
            registry.register(name, obj, source)
    if added.get("rm_plugins"):
        logger.info(f"{source} registered reward-model plugins ({', '.join(added['rm_plugins'])}) "
                    f"for --reward_model_plugin")
