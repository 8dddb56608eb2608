"""Reward registry: naming reward functions, turning --reward_funcs into callables, calling them.

- `register_reward(name)`: decorator for a function, or a class whose instances are callable.
- `RewardConfig`: the knobs the built-ins read (--cosine_*, --repetition_*, --soft_*).
- `resolve_reward_funcs(names, plugin_modules, config)`: each name is looked up as a built-in,
  then as a name registered by a plugin, then as a top-level callable of a plugin module.
- `compute_rewards(funcs, completions, **columns)`: calls each function once on the whole batch
  (awaiting asynchronous ones together) and checks what it returned; `score_rewards` is the
  same with --reward_error_policy (skip: a completion the function raises on scores None).

A reward function is `f(completions: list[str], **kwargs) -> list[float | None]` (None: "not
applicable", NaN for the trainer), or an `async def` one. kwargs are the other dataset columns
(one list per column, aligned with completions) plus `prompts`, `completion_ids` and `truncated`,
and the names ms-swift passes (`messages`, `trainer_state`, ...: docs/rewards.md).
"""
import asyncio
import difflib
import inspect
import math
import numbers
import os
import traceback
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from swift_megatron.arguments.grpo import REWARD_ERROR_POLICIES
from swift_megatron.errors import UserError
from swift_megatron.logging import get_logger
from swift_megatron.rewards.plugins import explain_late_import, module_callables

logger = get_logger(__name__)

# Filled by swift_megatron.rewards.builtin, which the package's __init__ imports (Python runs it
# before this module can be used from outside the package).
_BUILTINS: Dict[str, Any] = {}
_REGISTERED: Dict[str, Any] = {}  # filled by @register_reward in plugin files


@dataclass
class RewardConfig:
    """Settings of the built-in rewards; defaults match ms-swift. Classes registered as rewards
    are instantiated with it (see `instantiate_reward`)."""

    cosine_min_len_value_wrong: float = -0.5
    cosine_max_len_value_wrong: float = 0.0
    cosine_min_len_value_correct: float = 1.0
    cosine_max_len_value_correct: float = 0.5
    cosine_max_len: Optional[int] = None  # None: max_completion_length
    repetition_n_grams: int = 3
    repetition_max_penalty: float = -1.0
    soft_max_length: Optional[int] = None  # None: max_completion_length
    soft_cache_length: Optional[int] = None  # required by soft_overlong
    max_completion_length: int = 512

    @classmethod
    def from_args(cls, args: Any) -> "RewardConfig":
        """Read the fields of the same names from `args` (the GRPO arguments); absent attributes
        keep their defaults. Raises UserError when `args.reward_funcs` names soft_overlong but
        --soft_cache_length is not set."""
        config = cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
        if "soft_overlong" in (getattr(args, "reward_funcs", None) or []):
            config.check_soft_overlong()
        return config

    @property
    def effective_cosine_max_len(self) -> int:
        return self.cosine_max_len if self.cosine_max_len is not None else self.max_completion_length

    @property
    def effective_soft_max_length(self) -> int:
        return self.soft_max_length if self.soft_max_length is not None else self.max_completion_length

    def check_soft_overlong(self) -> None:
        """UserError unless soft_overlong can run: a cache length in (0, soft_max_length)."""
        if self.soft_cache_length is None:
            raise UserError("the soft_overlong reward needs --soft_cache_length (the number of "
                            "tokens before --soft_max_length over which the penalty ramps to -1), "
                            "e.g. --soft_cache_length 128")
        max_length = self.effective_soft_max_length
        if not 0 < self.soft_cache_length < max_length:
            raise UserError(f"--soft_cache_length must be in (0, soft_max_length={max_length}) for "
                            f"the soft_overlong reward, got {self.soft_cache_length}")


# ---------------------------------------------------------------------------------------------
# Registration


def register_reward(name):
    """Decorator: `@register_reward("my_reward")` makes a function (or a class whose instances
    are callable) available to --reward_funcs under `name`. Bare `@register_reward` uses the
    function's own name. Built-in names cannot be taken."""
    if callable(name) and not isinstance(name, str):
        return register_reward(name.__name__)(name)
    _check_name(name, "register_reward")

    def decorator(obj):
        add_reward(name, obj, f"@register_reward({name!r})")
        return obj

    return decorator


def add_reward(name: str, obj: Any, how: str) -> None:
    """Register `obj` (a function, or a class whose instances are callable) under `name`; `how`
    says how the plugin asked (e.g. "@register_reward('x')" or "orms['x']") in errors. Built-in
    names cannot be taken; registering a name again replaces it, with a warning."""
    _check_name(name, how)
    if not callable(obj):
        raise UserError(f"{how}: expected a function or a class, got {type(obj).__name__}")
    if name in _BUILTINS:
        raise UserError(f"{how}: {name!r} is a built-in reward; register yours under another name")
    old = _REGISTERED.get(name)
    if old is not None and old is not obj and _source(old) != _source(obj):
        logger.warning(f"reward {name!r} registered again (by {_source(obj)}); it replaces "
                       f"the one from {_source(old)}")
    _REGISTERED[name] = obj


def _check_name(name: Any, how: str) -> None:
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"{how} needs a non-empty name, got {name!r}")


def _register_builtin(name: str):
    """Decorator used by swift_megatron.rewards.builtin only."""

    def decorator(obj):
        _BUILTINS[name] = obj
        return obj

    return decorator


def _source(obj) -> str:
    code = getattr(obj, "__code__", None)
    if code is not None:
        return code.co_filename
    return getattr(inspect.getmodule(obj), "__file__", None) or getattr(obj, "__module__", "?")


def builtin_names() -> List[str]:
    return sorted(_BUILTINS)


def registered_names() -> List[str]:
    """Names registered with @register_reward by plugins (not the built-ins)."""
    return sorted(_REGISTERED)


# ---------------------------------------------------------------------------------------------
# Resolution


# Lengths defaulting to max_completion_length reach a class's __init__ already resolved.
_EFFECTIVE = {"cosine_max_len": "effective_cosine_max_len",
              "soft_max_length": "effective_soft_max_length"}


def instantiate_reward(name: str, obj: Any, config: RewardConfig,
                       init_kwargs: Optional[Dict[str, Any]] = None) -> Callable:
    """A function is returned as is. A class is instantiated: an `__init__` parameter named
    `config` gets the RewardConfig, one named like a RewardConfig field (ms-swift style, e.g.
    `repetition_n_grams`) gets that value (cosine_max_len and soft_max_length with None already
    replaced by max_completion_length), one named in `init_kwargs` (e.g. `tokenizer`, when the
    trainer supplies it) gets that; other parameters must have defaults."""
    if not inspect.isclass(obj):
        return obj
    init_kwargs = init_kwargs or {}
    kwargs = {}
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name == "config" or p.annotation is RewardConfig:
            kwargs[p.name] = config
        elif p.name in _EFFECTIVE:
            kwargs[p.name] = getattr(config, _EFFECTIVE[p.name])
        elif p.name in {f.name for f in fields(RewardConfig)}:
            kwargs[p.name] = getattr(config, p.name)
        elif p.name in init_kwargs:
            kwargs[p.name] = init_kwargs[p.name]
        elif p.default is p.empty:
            raise UserError(f"reward {name!r}: cannot instantiate {obj.__name__}: its __init__ "
                            f"parameter {p.name!r} is not one swift-megatron provides (config, "
                            f"{', '.join(f.name for f in fields(RewardConfig))}"
                            f"{''.join(', ' + k for k in init_kwargs)}) and has no default")
    try:
        instance = obj(**kwargs)
    except ImportError as error:
        explained = explain_late_import(error, f"reward {name!r}: creating {obj.__name__}")
        if explained is None:
            raise
        raise explained from error
    if not callable(instance):
        raise UserError(f"reward {name!r}: instances of {obj.__name__} are not callable; define "
                        f"__call__(self, completions, **kwargs)")
    return instance


def resolve_reward_funcs(names: Sequence[str], plugin_modules: Optional[Sequence[Any]],
                         config: Optional[RewardConfig] = None, *,
                         init_kwargs: Optional[Dict[str, Any]] = None) -> List[Tuple[str, Callable]]:
    """[(name, callable)] for --reward_funcs, in order. Each name is a built-in; else a name a
    plugin registered with @register_reward; else a top-level callable of that name in one of
    `plugin_modules` (from load_plugins). Classes are instantiated (see instantiate_reward).
    Unknown names raise UserError listing what is available and the closest match."""
    config = config if config is not None else RewardConfig()
    plugin_modules = list(plugin_modules or [])
    resolved = []
    for name in names:
        if name in _BUILTINS:
            obj = _BUILTINS[name]
        elif name in _REGISTERED:
            obj = _REGISTERED[name]
        else:
            obj = _find_top_level(name, plugin_modules)
            if obj is None:
                available = sorted(set(_BUILTINS) | set(_REGISTERED)
                                   | {n for m in plugin_modules for n in module_callables(m)})
                close = difflib.get_close_matches(name, available, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                where = "" if plugin_modules else (" (no --external_plugins were loaded; "
                                                   "pass the file that defines it)")
                raise UserError(f"unknown reward function {name!r}{where}.{hint} Available: "
                                f"{', '.join(available)}")
        resolved.append((name, instantiate_reward(name, obj, config, init_kwargs)))
    return resolved


def _find_top_level(name: str, modules: Sequence[Any]):
    found = []
    for module in modules:
        obj = getattr(module, name, None)
        if obj is not None and callable(obj) and not inspect.ismodule(obj) \
                and all(obj is not other for _, other in found):
            found.append((module, obj))
    if len(found) > 1:
        files = ", ".join(getattr(m, "__file__", None) or m.__name__ for m, _ in found)
        raise UserError(f"reward function {name!r} is defined in several plugin files ({files}); "
                        f"rename one, or register one with @register_reward")
    return found[0][1] if found else None


# ---------------------------------------------------------------------------------------------
# Calling


def _call_plan(fn: Callable) -> Tuple[Optional[set], List[str]]:
    """(the keyword names fn accepts, or None when it takes **kwargs; its required keyword
    names besides the first positional one, which receives the completions)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None, []
    accepted, required = set(), []
    var_keyword = any(p.kind == p.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    first = positional[0].name if positional else None
    for p in params:
        if p.name == first or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            continue
        accepted.add(p.name)
        if p.default is p.empty:
            required.append(p.name)
    return (None if var_keyword else accepted), required


def _check_values(name: str, values: Any, n: int) -> List[Optional[float]]:
    if not isinstance(values, (list, tuple)) and hasattr(values, "tolist"):
        values = values.tolist()  # a numpy array or a torch tensor
    if not isinstance(values, (list, tuple)):
        raise UserError(f"reward function {name!r} must return a list of {n} floats (or None), one "
                        f"per completion; it returned {type(values).__name__}: {repr(values)[:200]}")
    if len(values) != n:
        raise UserError(f"reward function {name!r} returned {len(values)} values for {n} "
                        f"completions; it must return one per completion")
    out = []
    for i, value in enumerate(values):
        if value is None:
            out.append(None)
        elif isinstance(value, numbers.Real) and math.isfinite(value):
            out.append(float(value))
        elif isinstance(value, numbers.Real):
            raise UserError(f"reward function {name!r} returned {value} for completion {i}: "
                            f"rewards must be finite (return None for 'not applicable')")
        else:
            raise UserError(f"reward function {name!r} returned a non-number at index {i}: "
                            f"{value!r} ({type(value).__name__}); return floats, or None for "
                            f"'not applicable'")
    return out


def compute_rewards(funcs: Sequence[Any], completions: List[str],
                    **columns: Any) -> List[List[Optional[float]]]:
    """Call each reward function once on the whole batch: `fn(completions, **columns)`.

    `funcs`: [(name, callable)] from resolve_reward_funcs (bare callables are accepted too).
    `columns`: the other dataset columns plus prompts, completion_ids, truncated (and the names
    ms-swift passes, see docs/rewards.md), each a list aligned with `completions`, except
    `trainer_state`, one object for the batch. A function without **kwargs gets only the columns
    it names. Asynchronous functions (`async def`, or an async `__call__` as ms-swift's AsyncORM)
    run concurrently in one event loop after the synchronous ones.
    Returns one list per function of floats or None (None: not applicable). Raises UserError when
    a function needs a column the batch lacks, returns something other than len(completions)
    numbers/None, or raises (naming the function, the plugin line and the first failing
    completion)."""
    return score_rewards(funcs, completions, columns)[0]


def score_rewards(funcs: Sequence[Any], completions: List[str], columns: Dict[str, Any],
                  on_error: str = "raise") -> Tuple[List[List[Optional[float]]], List[List[int]]]:
    """compute_rewards with a policy for a function that raises (--reward_error_policy):
    "raise" stops with a UserError; "skip" calls that function again one completion at a time
    and scores the completions it raises on as missing (None, as "not applicable": 0 in the
    weighted sum), with a warning naming the function, the completions and the exception.
    Returns (one list of values per function, one list per function of the indices of the
    completions scored missing because it raised)."""
    if on_error not in REWARD_ERROR_POLICIES:
        raise ValueError(f"on_error must be one of {REWARD_ERROR_POLICIES}, got {on_error!r}")
    n = len(completions)
    for key, value in columns.items():
        if isinstance(value, (list, tuple)) and len(value) != n:
            raise ValueError(f"column {key!r} has {len(value)} values for {n} completions")
    named = [item if isinstance(item, (tuple, list))
             else (getattr(item, "__name__", repr(item)), item) for item in funcs]
    calls = [(name, fn, _accepted_columns(name, fn, columns)) for name, fn in named]
    outputs: Dict[int, Any] = {}
    for index, (name, fn, kwargs) in enumerate(calls):
        try:
            outputs[index] = fn(completions, **kwargs)
        except Exception as error:  # noqa: BLE001  (a plugin's error, handled per policy)
            outputs[index] = error
            if on_error == "raise" or isinstance(error, UserError):
                _close(o for o in outputs.values() if inspect.isawaitable(o))
                raise _blame(name, error, fn, completions, kwargs) from error
    pending = {index: output for index, output in outputs.items() if inspect.isawaitable(output)}
    if pending:
        outputs.update(_await_all(pending))
    values, failed = [], []
    for index, (name, fn, kwargs) in enumerate(calls):
        output = outputs[index]
        if not isinstance(output, Exception):
            values.append(_check_values(name, output, n))
            failed.append([])
        elif on_error == "raise" or isinstance(output, UserError):
            raise _blame(name, output, fn, completions, kwargs) from output
        else:
            scores, errors = _one_at_a_time(name, fn, completions, kwargs)
            _warn_skipped(name, output, errors, completions)
            values.append(scores)
            failed.append(sorted(errors))
    return values, failed


def _accepted_columns(name: str, fn: Callable, columns: Dict[str, Any]) -> Dict[str, Any]:
    """The columns fn takes (all of them with **kwargs); UserError when it requires one the
    batch lacks."""
    accepted, required = _call_plan(fn)
    missing = [k for k in required if k not in columns]
    if missing:
        raise UserError(f"reward function {name!r} needs the column(s) {', '.join(missing)}, "
                        f"which the batch does not have; available: "
                        f"{', '.join(sorted(columns)) or '(none)'}")
    return columns if accepted is None else {k: v for k, v in columns.items() if k in accepted}


def _blame(name: str, error: Exception, fn: Callable, completions: List[str],
           kwargs: Dict[str, Any]) -> UserError:
    """A UserError raised by the function as is; any other exception as a UserError (exit 2,
    no traceback) naming the function, where in its file it raised and the first completion it
    fails on alone (when one does)."""
    if isinstance(error, UserError):
        return error
    first = next((i for i in range(len(completions)) if _fails(fn, completions, kwargs, i)), None)
    sample = "" if first is None else \
        f"; first failing completion #{first}: {completions[first][:120]!r}"
    return UserError(f"reward function {name!r} raised {_describe(error)}{sample}")


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error} ({_where(error)})"


def _where(error: BaseException) -> str:
    """file:line of the innermost frame outside this package (the plugin's own code)."""
    frames = traceback.extract_tb(error.__traceback__)
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outside = [f for f in frames if not os.path.abspath(f.filename).startswith(own)] or frames
    if not frames:
        return "no traceback"
    frame = outside[-1]
    return f"at {frame.filename}:{frame.lineno}, in {frame.name}"


def _call_one(fn: Callable, completions: List[str], kwargs: Dict[str, Any], i: int) -> Any:
    """fn on completion i alone (its entry of every per-completion column), awaited when
    asynchronous."""
    n = len(completions)
    one = {k: [v[i]] if isinstance(v, (list, tuple)) and len(v) == n else v
           for k, v in kwargs.items()}
    output = fn([completions[i]], **one)
    return asyncio.run(_awaited(output)) if inspect.isawaitable(output) else output


async def _awaited(awaitable):
    return await awaitable


def _fails(fn: Callable, completions: List[str], kwargs: Dict[str, Any], i: int) -> bool:
    try:
        _call_one(fn, completions, kwargs, i)
    except Exception:  # noqa: BLE001  (only looking for the failing completion)
        return True
    return False


def _one_at_a_time(name: str, fn: Callable, completions: List[str], kwargs: Dict[str, Any]
                   ) -> Tuple[List[Optional[float]], Dict[int, Exception]]:
    """fn's value for each completion alone; None and the exception where it raises (a
    UserError it raises, or a bad value it returns, still stops the run)."""
    scores, errors = [], {}
    for i in range(len(completions)):
        try:
            output = _call_one(fn, completions, kwargs, i)
        except UserError:
            raise
        except Exception as error:  # noqa: BLE001  (--reward_error_policy skip)
            scores.append(None)
            errors[i] = error
            continue
        scores.extend(_check_values(name, output, 1))
    return scores, errors


def _warn_skipped(name: str, batch_error: Exception, errors: Dict[int, Exception],
                  completions: List[str]) -> None:
    """One warning per function and batch: how many completions were scored missing, and the
    first few with their exceptions."""
    if not errors:
        logger.warning(f"reward function {name!r} raised {_describe(batch_error)} on the batch of "
                       f"{len(completions)} but on no completion alone; scored them one at a time")
        return
    shown = "; ".join(f"#{i} {completions[i][:80]!r}: {_describe(errors[i])}"
                      for i in sorted(errors)[:3])
    more = f"; and {len(errors) - 3} more" if len(errors) > 3 else ""
    logger.warning(f"reward function {name!r} raised on {len(errors)} of {len(completions)} "
                   f"completion(s), scored as missing (--reward_error_policy skip): {shown}{more}")


def _await_all(pending: Dict[int, Any]) -> Dict[int, Any]:
    """Await every awaitable together (asyncio.gather in a new event loop); an exception one
    raises takes its place in the result."""

    async def gather():
        return await asyncio.gather(*pending.values(), return_exceptions=True)

    results = dict(zip(pending, asyncio.run(gather())))
    for result in results.values():
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result
    return results


def _close(awaitables) -> None:
    """Close coroutines that will not be awaited (no "never awaited" warnings)."""
    for awaitable in awaitables:
        close = getattr(awaitable, "close", None)
        if close is not None:
            close()
