"""Loading user reward files (--external_plugins).

`load_plugins(paths)` imports each .py file by path under a unique module name
(`swift_megatron_plugin_<n>_<stem>`), so two files may share a name and a file may be loaded
twice. While a file is imported its `@register_reward` decorators run; its top-level functions
stay reachable through the returned module. The file's folder is appended to sys.path so it can
import helper modules that sit next to it. Any failure (missing file, syntax error, an exception
at import) becomes a UserError naming the file.

A foreign plugin API reaches the loader through one hook, `use_plugin_api(PluginApi(...))`:
importing swift_megatron.compat.ms_swift registers ms-swift's, so that files written for ms-swift
(`from swift.rewards import ORM, orms`, gym envs, multi-turn schedulers) import against a stand-in
`swift` package that exists only during the import, or against ms-swift itself when it is
installed, and what they put into ms-swift's registries is registered with ours. The rewards
package never imports compat/ms_swift (which imports the reward registry): the callers that load
plugins import it first.
"""
import contextlib
import importlib.machinery
import importlib.util
import inspect
import itertools
import os
import re
import sys
from types import ModuleType
from typing import Callable, ContextManager, List, NamedTuple, Optional, Sequence

from swift_megatron.errors import UserError

_counter = itertools.count()


class PluginApi(NamedTuple):
    """A plugin API that is not ours, made importable for plugin files (compat/ms_swift)."""

    importing: Callable[[str], ContextManager[None]]  # wraps the import of the file at a path
    # (error, what failed) -> the error to raise instead, or None when it is not this API's
    explain_late_import: Callable[[ImportError, str], Optional[Exception]]


_api: Optional[PluginApi] = None  # set by use_plugin_api


def use_plugin_api(api: PluginApi) -> None:
    """Make `api` importable while each plugin file is imported (the last one given counts)."""
    global _api
    _api = api


def explain_late_import(error: ImportError, what: str) -> Optional[Exception]:
    """The registered API's explanation of `error`, raised by `what` (e.g. "reward 'x': creating
    X") after the plugin file was imported; None when there is none."""
    return _api.explain_late_import(error, what) if _api is not None else None


def _module_name(path: str) -> str:
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0]) or "plugin"
    return f"swift_megatron_plugin_{next(_counter)}_{stem}"


def load_plugin(path: str) -> ModuleType:
    """Import one plugin file and return its module; UserError naming the file on failure."""
    full = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(full):
        what = "is a directory, not a .py file" if os.path.isdir(full) else "does not exist"
        raise UserError(f"--external_plugins: {path} {what}")
    name = _module_name(full)
    loader = importlib.machinery.SourceFileLoader(name, full)  # any extension, not only .py
    spec = importlib.util.spec_from_file_location(name, full, loader=loader)
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(full)
    if folder not in sys.path:
        sys.path.append(folder)
    sys.modules[name] = module  # dataclasses, pickling and relative lookups need it registered
    try:
        with _api.importing(full) if _api is not None else contextlib.nullcontext():
            spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:
        sys.modules.pop(name, None)
        raise UserError(f"--external_plugins: importing {path} failed: "
                        f"{type(error).__name__}: {error}") from error
    return module


def load_plugins(paths: Sequence[str]) -> List[ModuleType]:
    """Import each file in `paths`, in order; returns the modules (for resolve_reward_funcs)."""
    return [load_plugin(path) for path in paths or []]


def module_callables(module: ModuleType) -> List[str]:
    """Public top-level callables defined in `module` itself (imported names left out): the names
    --reward_funcs can use beyond the built-ins and registered ones."""
    names = []
    for attr, obj in vars(module).items():
        if attr.startswith("_") or inspect.ismodule(obj) or not callable(obj):
            continue
        origin = getattr(obj, "__module__", None) if (inspect.isfunction(obj) or inspect.isclass(obj)) \
            else getattr(type(obj), "__module__", None)
        if origin == module.__name__:
            names.append(attr)
    return sorted(names)
