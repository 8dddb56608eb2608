"""Turn argument dataclasses into one flat argparse command line (plus an optional config file).

A command is a dataclass whose fields are group dataclasses (model, data, training, ...); every
field of every group becomes one `--snake_case` flag. Flags override values from
`--config run.yaml` (keys are flag names). Parsing imports nothing heavy, so `--help` is instant.

Mistakes become UserError (exit code 2, no traceback): unknown flags get the closest known flag
suggested, a bad value names its flag, and a flag whose feature does not exist yet says so.
"""
import argparse
import dataclasses
import difflib
import json
import os
import typing
from typing import Any, Dict, List, Sequence, Tuple

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
        if self.base is float and isinstance(text, str):
            return float(text)
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
    return [(f.name, hints[f.name]) for f in dataclasses.fields(command_cls)]


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
    text = f"{spec.meta.get('help', '')} [type: {spec.type_name()}; default: {shown}]"
    return text.replace("%", "%%")


def _metavar(spec: FlagSpec) -> str:
    if spec.meta.get("choices"):
        return "{" + ",".join(str(c) for c in spec.meta["choices"]) + "}"
    return getattr(spec.base, "__name__", "value").upper()


def build_parser(prog: str, description: str, command_cls) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, usage=f"{prog} [flags]   (flags below; --config FILE for a file)",
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


def _suggest(word: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f"; did you mean --{close[0]}?" if close else ""


def load_config_file(path: str, specs: Dict[str, FlagSpec]) -> Dict[str, Any]:
    """Read a YAML/JSON config file into {field name: converted value}."""
    if not os.path.isfile(path):
        raise UserError(f"--config: file not found: {path}")
    with open(path) as f:
        text = f.read()
    try:
        import yaml
        data = yaml.safe_load(text) or {}
    except Exception as exc:  # yaml.YAMLError and friends
        raise UserError(f"--config {path}: not valid YAML/JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of flag names to values")
    names = _aliases(specs)
    values = {}
    for key, value in data.items():
        key = str(key).lstrip("-")
        if key not in names:
            raise UserError(f"--config {path}: unknown key '{key}'{_suggest(key, list(names))}")
        spec = specs[names[key]]
        values[spec.name] = None if value is None else spec.convert(value)
    return values


def parse_command(command_cls, argv: Sequence[str], prog: str, description: str = ""):
    """Parse argv (and --config) into an instance of command_cls; raise UserError on mistakes."""
    specs = _all_specs(command_cls)
    parser = build_parser(prog, description, command_cls)
    namespace, unknown = parser.parse_known_args(list(argv))
    if unknown:
        flag = next((u for u in unknown if u.startswith("-")), unknown[0])
        name = flag.lstrip("-").split("=")[0]
        raise UserError(f"{prog}: unknown flag {flag}{_suggest(name, list(_aliases(specs)))}"
                        if flag.startswith("-") else f"{prog}: unexpected value {flag!r}")
    given = vars(namespace)
    values = load_config_file(given.pop("config"), specs) if given.get("config") else {}
    given.pop("config", None)
    for name, raw in given.items():
        values[name] = specs[name].convert(raw)
    _reject_not_yet(values, specs)
    groups = {}
    for attr, group_cls in command_groups(command_cls):
        kwargs = {s.name: values[s.name] for s in group_specs(group_cls) if s.name in values}
        groups[attr] = group_cls(**kwargs)
    return command_cls(**groups)


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
