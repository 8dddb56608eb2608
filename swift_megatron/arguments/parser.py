"""Turn argument dataclasses into one flat argparse command line (plus an optional config file).

A command is a dataclass whose fields are group dataclasses (model, data, training, ...); every
field of every group becomes one `--snake_case` flag. A YAML/JSON config file (keys are flag
names) can be given as the first argument, as ms-swift takes it (`megatron rlhf run.yaml`), or
with `--config run.yaml`; flags on the command line override it. Its `ENV:` section sets
environment variables that are not already set (before anything reads them, e.g. NPROC_PER_NODE).
Parsing imports nothing heavy, so `--help` is instant.

Mistakes become UserError (exit code 2, no traceback): every unknown flag is reported in one
error, each with what to use instead (arguments/ms_swift.py, else the closest known flag when one
is really close); a bad value names its flag; a flag whose feature does not exist yet says so.
`no_effect_flags(command)` lists the accepted ms-swift flags that have no effect here.
"""
import argparse
import contextlib
import dataclasses
import difflib
import json
import math
import os
import typing
from typing import Any, Dict, List, Optional, Sequence, Tuple

from swift_megatron.arguments import ms_swift
from swift_megatron.errors import UserError

_NONE_WORDS = ("none", "null")


def parse_bool(text) -> bool:
    """'true'/'false' (and 1/0, yes/no) -> bool, as ms-swift's flags accept them."""
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("true", "1", "yes", "y", "on"):
        return True
    if lowered in ("false", "0", "no", "n", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """How one dataclass field is parsed: its base type and whether it is a list or optional."""

    field: dataclasses.Field
    base: Any
    is_list: bool
    optional: bool

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def meta(self) -> dict:
        return self.field.metadata

    @property
    def default(self) -> Any:
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return self.field.default

    def type_name(self) -> str:
        base = getattr(self.base, "__name__", str(self.base))
        if self.meta.get("choices"):
            base = "|".join(str(c) for c in self.meta["choices"])
        base = f"list[{base}]" if self.is_list else base
        return f"{base} or none" if self.optional and not self.is_list else base

    def convert_one(self, text: Any) -> Any:
        """Convert one command-line or config-file value to the field's base type."""
        if self.optional and isinstance(text, str) and text.lower() in _NONE_WORDS:
            return None
        if self.base is bool:
            return parse_bool(text)
        if self.base is dict:
            return text if isinstance(text, dict) else json.loads(text)
        if self.base is float:
            number = float(text)
            if not math.isfinite(number):  # nan / inf never make sense as a setting
                raise ValueError(f"expected a finite number, got {text}")
            return number
        if self.base is int and isinstance(text, float) and text != int(text):
            raise ValueError(f"expected an integer, got {text}")
        return self.base(text)

    def convert(self, value: Any) -> Any:
        """Convert a whole value (a list for list fields); errors name the flag."""
        try:
            if self.is_list:
                items = value if isinstance(value, (list, tuple)) else [value]
                result = [self.convert_one(v) for v in items]
                bad = [v for v in result if not self._allowed(v)]
            else:
                result = self.convert_one(value)
                bad = [] if self._allowed(result) else [result]
        except (TypeError, ValueError) as exc:
            raise UserError(f"--{self.name}: invalid value {value!r} ({exc}); "
                            f"expected {self.type_name()}") from None
        if bad:
            raise UserError(f"--{self.name}: invalid choice {bad[0]!r}; choose from "
                            f"{', '.join(str(c) for c in self.meta['choices'])}")
        return result

    def _allowed(self, value: Any) -> bool:
        choices = self.meta.get("choices")
        return value is None or not choices or value in choices


def flag_spec(field: dataclasses.Field, hints: Dict[str, Any]) -> FlagSpec:
    tp = hints[field.name]
    optional = False
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional, tp = True, args[0]
        origin = typing.get_origin(tp)
    if origin in (list, List, tuple):
        return FlagSpec(field, typing.get_args(tp)[0], True, optional)
    if origin in (dict, Dict):
        return FlagSpec(field, dict, False, optional)
    return FlagSpec(field, tp, False, optional)


def group_specs(group_cls) -> List[FlagSpec]:
    hints = typing.get_type_hints(group_cls)
    return [flag_spec(f, hints) for f in dataclasses.fields(group_cls)]


def command_groups(command_cls) -> List[Tuple[str, type]]:
    """(attribute name, group dataclass) for each group of a command dataclass."""
    hints = typing.get_type_hints(command_cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(command_cls) if f.init]


class _Parser(argparse.ArgumentParser):
    """argparse that raises UserError instead of printing the (very long) usage and exiting."""

    def error(self, message):
        raise UserError(f"{self.prog}: {message}")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=40, width=min(120, _terminal_width()))


def _terminal_width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 100


def _help_text(spec: FlagSpec) -> str:
    default = spec.default
    if default is None or isinstance(default, (bool, list, dict)):
        shown = json.dumps(default).replace("null", "none")
    else:
        shown = default
    text = spec.meta.get("help", "")
    if spec.meta.get("no_effect"):
        text += f" Accepted for ms-swift compatibility, no effect here: {spec.meta['no_effect']}."
    text = f"{text} [type: {spec.type_name()}; default: {shown}]"
    return text.replace("%", "%%")


def _metavar(spec: FlagSpec) -> str:
    if spec.meta.get("choices"):
        return "{" + ",".join(str(c) for c in spec.meta["choices"]) + "}"
    return getattr(spec.base, "__name__", "value").upper()


def build_parser(prog: str, description: str, command_cls) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, usage=f"{prog} [CONFIG_FILE] [flags]   (flags below; a YAML/JSON "
                                      f"file of flag values first, or --config FILE)",
                     description=description, formatter_class=_HelpFormatter,
                     allow_abbrev=False, argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="FILE",
                        help="YAML or JSON file of flag values (keys are flag names); "
                             "flags given on the command line override it")
    for _, group_cls in command_groups(command_cls):
        title = (group_cls.__doc__ or group_cls.__name__).strip().splitlines()[0]
        group = parser.add_argument_group(title)
        for spec in group_specs(group_cls):
            names = [f"--{spec.name}"] + [f"--{a}" for a in spec.meta.get("aliases", ())]
            kwargs = dict(dest=spec.name, help=_help_text(spec), metavar=_metavar(spec))
            if spec.is_list:
                kwargs["nargs"] = "*"
            elif spec.base is bool:
                kwargs.update(nargs="?", const="true")
            group.add_argument(*names, **kwargs)
    return parser


def _all_specs(command_cls) -> Dict[str, FlagSpec]:
    specs = {}
    for _, group_cls in command_groups(command_cls):
        for spec in group_specs(group_cls):
            specs[spec.name] = spec
    return specs


def _aliases(specs: Dict[str, FlagSpec]) -> Dict[str, str]:
    names = {name: name for name in specs}
    for name, spec in specs.items():
        for alias in spec.meta.get("aliases", ()):
            names[alias] = name
    return names


# ---- unknown flags -------------------------------------------------------------------------

def _closest(word: str, known: Sequence[str]) -> Optional[str]:
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.8)
    return close[0] if close else None


def unknown_flag_message(name: str, known: Sequence[str]) -> str:
    """One line for an unknown flag: what to use instead, or the closest known flag."""
    answer = ms_swift.explain(name)
    if answer is None:
        close = _closest(name, known)
        answer = f"did you mean --{close}?" if close else "no such flag (see --help)"
    return f"--{name}: {answer}"


def _unknown_error(prog: str, names: Sequence[str], known: Sequence[str], where: str) -> UserError:
    unique = list(dict.fromkeys(names))
    lines = [unknown_flag_message(name, known) for name in unique]
    head = f"{prog}: {len(unique)} unknown {where}{'s' if len(unique) > 1 else ''}"
    return UserError(head + ":\n  " + "\n  ".join(lines))


def _flag_names(tokens: Sequence[str]) -> List[str]:
    """The flag names among argparse's leftover tokens (their values are skipped)."""
    names = []
    for token in tokens:
        if token.startswith("-") and not _is_number(token):
            names.append(token.lstrip("-").split("=")[0])
    return names


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


# ---- config files --------------------------------------------------------------------------

CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def split_config_argument(argv: Sequence[str]) -> Tuple[Optional[str], List[str]]:
    """(config file given as the first argument, the remaining argv), as ms-swift's
    `megatron rlhf run.yaml --flag value`; (None, argv) when the first argument is a flag."""
    argv = list(argv)
    if argv and not argv[0].startswith("-") and argv[0].lower().endswith(CONFIG_SUFFIXES):
        return argv[0], argv[1:]
    return None, argv


def read_config_file(path: str) -> Dict[str, Any]:
    """The mapping in a YAML/JSON config file; UserError naming the file when it is unusable."""
    if not os.path.isfile(path):
        raise UserError(f"config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = _load_yaml(f.read(), path) or {}
    except UserError:
        raise
    except Exception as exc:  # yaml.YAMLError, UnicodeDecodeError and friends
        raise UserError(f"config file {path}: not valid YAML/JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path}: expected a mapping of flag names to values")
    return data


def _load_yaml(text: str, path: str) -> Any:
    """yaml.safe_load, except that a key given twice in one mapping is a UserError naming the
    key, its line and the file (YAML and JSON loaders keep the last value silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise UserError(f"config file {path}: key {key!r} is given twice (again on "
                                    f"line {key_node.start_mark.line + 1}); keep one")
                seen.add(key)
            return super().construct_mapping(node, deep)

    return yaml.load(text, Loader=UniqueKeyLoader)


def apply_config_env(path: str, env: Any, environ=os.environ) -> None:
    """Set the variables of a config file's `ENV:` section that are not set already (a variable
    set in the shell wins, with a warning when the values differ), as ms-swift does."""
    if env is None:
        return
    if not isinstance(env, dict):
        raise UserError(f"config file {path}: ENV must be a mapping of variable names to values")
    for key, value in env.items():
        key, value = str(key), str(value)
        if key not in environ:
            environ[key] = value
        elif environ[key] != value:
            from swift_megatron.logging.logger import get_logger
            get_logger(__name__).warning(f"{key} is set in the environment ({environ[key]}); "
                                         f"the value {value!r} of {path}'s ENV is not used")


def load_config_file(path: str, specs: Dict[str, FlagSpec], prog: str = "config") -> Dict[str, Any]:
    """Read a YAML/JSON config file into {field name: converted value}; apply its ENV section.
    Every unknown key is reported in one UserError."""
    data = read_config_file(path)
    apply_config_env(path, data.pop("ENV", None))
    names = _aliases(specs)
    unknown = [str(key).lstrip("-") for key in data if str(key).lstrip("-") not in names]
    if unknown:
        raise _unknown_error(f"{prog}: {path}", unknown, list(names), "key")
    _refuse_one_flag_twice(path, [str(key).lstrip("-") for key in data], names)
    values = {}
    for key, value in data.items():
        spec = specs[names[str(key).lstrip("-")]]
        values[spec.name] = None if value is None else spec.convert(value)
    return values


def _refuse_one_flag_twice(path: str, keys: Sequence[str], names: Dict[str, str]) -> None:
    """Two keys of a config file that name one flag (a flag and its alias: save_steps and
    save_interval) are a UserError, as a key given twice is."""
    by_flag: Dict[str, List[str]] = {}
    for key in keys:
        by_flag.setdefault(names[key], []).append(key)
    for flag, given in by_flag.items():
        if len(given) > 1:
            raise UserError(f"config file {path}: keys {' and '.join(given)} both set "
                            f"--{flag}; keep one")


# ---- the command line ----------------------------------------------------------------------

def raw_value(argv: Sequence[str], name: str) -> Optional[str]:
    """The value `argv` gives flag `name` (`--name v`, `--name=v`, or a key of the leading or
    --config file), as text, before any parsing: for checks that must come first. None when
    unset; the command line wins over the file."""
    config_path, rest = split_config_argument(argv)
    found = None
    for i, token in enumerate(rest):
        if token == f"--{name}" and i + 1 < len(rest):
            found = rest[i + 1]
        elif token.startswith(f"--{name}="):
            found = token.split("=", 1)[1]
        elif token == "--config" and i + 1 < len(rest):
            config_path = rest[i + 1]
    if found is None and config_path and os.path.isfile(config_path):
        with contextlib.suppress(UserError):
            value = read_config_file(config_path).get(name)
            found = None if value is None else str(value)
    return found


def parse_command(command_cls, argv: Sequence[str], prog: str, description: str = ""):
    """Parse argv (a leading config file, --config, flags) into an instance of command_cls;
    raise UserError on mistakes. `instance.explicit` holds the field names the user set (on the
    command line or in the config file)."""
    specs = _all_specs(command_cls)
    config_path, argv = split_config_argument(argv)
    parser = build_parser(prog, description, command_cls)
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = _flag_names(unknown)
        if not flags:
            raise UserError(f"{prog}: unexpected value {unknown[0]!r}")
        raise _unknown_error(prog, flags, list(_aliases(specs)), "flag")
    given = vars(namespace)
    if config_path and given.get("config"):
        raise UserError(f"{prog}: two config files, {config_path} (the first argument) and "
                        f"--config {given['config']}: give one")
    config_path = given.pop("config", None) or config_path
    values = load_config_file(config_path, specs, prog) if config_path else {}
    for name, raw in given.items():
        values[name] = specs[name].convert(raw)
    _reject_not_yet(values, specs)
    groups = {}
    for attr, group_cls in command_groups(command_cls):
        kwargs = {s.name: values[s.name] for s in group_specs(group_cls) if s.name in values}
        groups[attr] = group_cls(**kwargs)
    command = command_cls(**groups)
    command.explicit = frozenset(values)
    return command


def _reject_not_yet(values: Dict[str, Any], specs: Dict[str, FlagSpec]) -> None:
    for name, value in values.items():
        spec = specs[name]
        not_yet = spec.meta.get("not_yet")
        if not not_yet or value == spec.default:
            continue
        if isinstance(not_yet, dict):
            reason = not_yet.get(value)
            if reason:
                raise UserError(f"--{name} {value} is not supported yet: {reason}")
        else:
            raise UserError(f"--{name} is not supported yet: {not_yet}")


def notices(command, no_effect: bool = True) -> List[str]:
    """What the user should be told once about the parsed flags: values adjusted as ms-swift
    adjusts them (a group's `adjustments`) and, with `no_effect`, the flags accepted without
    effect (the dry run names them; a real run stays quiet about them: ms-swift's examples pass
    several of them every time, and docs/migrating-from-ms-swift.md lists them)."""
    lines = [note for _, group in vars(command).items() if dataclasses.is_dataclass(group)
             for note in getattr(group, "adjustments", [])]
    ignored = no_effect_flags(command) if no_effect else []
    if ignored:
        lines.append("accepted without effect here: " + "; ".join(
            f"--{name} ({reason})" for name, reason in ignored))
    return lines


def warn_notices(command, no_effect: bool = False) -> None:
    """Log `notices(command, no_effect)` once: from the process that runs the command, on
    global rank 0."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    from swift_megatron.logging.logger import get_logger

    for line in notices(command, no_effect):
        get_logger(__name__).warning(line)


def flat_values(command) -> Dict[str, Any]:
    """{flag name: value} over every group of a parsed command (one entry per flag; the flag
    names are unique across groups, which build_parser's argparse enforces)."""
    values: Dict[str, Any] = {}
    for attr, group_cls in command_groups(type(command)):
        group = getattr(command, attr)
        values.update({spec.name: getattr(group, spec.name) for spec in group_specs(group_cls)})
    return values


def no_effect_flags(command) -> List[Tuple[str, str]]:
    """(flag, reason) for each flag the user set that is accepted without effect here."""
    explicit = getattr(command, "explicit", frozenset())
    found = []
    for _, group_cls in command_groups(type(command)):
        for spec in group_specs(group_cls):
            reason = spec.meta.get("no_effect")
            if reason and spec.name in explicit:
                found.append((spec.name, reason))
    return found
