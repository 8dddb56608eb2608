"""Metric sinks for the trainer: one `MetricsLogger.log(step, metrics)` call per logged step
writes a console line, a line of `{output_dir}/logging.jsonl` and the scalars of each sink
chosen by --report_to (tensorboard, wandb, swanlab).

Where and under which names the sinks record the run (`SinkSettings`, from --tensorboard_dir,
--wandb_project, --wandb_exp_name, --swanlab_project, --swanlab_exp_name): tensorboard events go
to --tensorboard_dir (default <output_dir>/runs); wandb and swanlab get the project and run name
as `init` arguments (default project "megatron-swift", default name the absolute output
directory), as ms-swift passes them. Arguments given to `wandb.init` override wandb's
environment variables (WANDB_PROJECT, WANDB_NAME), so those no longer choose the project, in
ms-swift as here: use the flags.

Only the logging rank (global rank 0; the trainer decides) passes `enabled=True`; on the other
ranks every method is a no-op. The sink names and their packages are checked on every rank,
so a missing package fails all ranks alike instead of leaving the others waiting in a collective.

Non-finite values (NaN, +-inf): the console prints them (`nan`, `inf`), logging.jsonl keeps the
key with `null` (strict JSON has no NaN), and the external sinks (tensorboard, wandb, swanlab)
skip them, with one warning per key, so a single inf does not wreck a chart's scale.

Pure helpers: `reduce_metrics` averages the metrics of a step's micro-batches and
`format_metrics` builds the console line's body.
"""
import importlib
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from swift_megatron.errors import UserError
from swift_megatron.logging.logger import get_logger

logger = get_logger(__name__)

SINKS = ("tensorboard", "wandb", "swanlab")
_SINK_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab"}
METRICS_FILE = "logging.jsonl"
TENSORBOARD_DIR = "runs"
SWANLAB_DIR = "swanlog"
DEFAULT_PROJECT = "megatron-swift"   # ms-swift's default wandb / swanlab project
# Console order: keys matching these names come first, in this order (a key matches a name when
# it equals it, starts with `name/` or ends with `/name`); every other key follows, sorted.
CONSOLE_PRIORITY = ("loss", "reward/mean", "kl", "grad_norm", "lr")
# The trainer's console line shows only these (same matching rule); logging.jsonl and the sinks
# get every metric.
CONSOLE_KEYS = CONSOLE_PRIORITY + ("reward/std", "entropy", "rollout/completion_length_mean",
                                   "time/rollout_s", "time/train_s")
_RESERVED_KEYS = ("step", "time")


# ---------------------------------------------------------------------------------------------
# Pure helpers


def to_scalar(value: Any, key: str = "") -> float:
    """A metric value as a Python int or float: tensors and numpy scalars through `.item()`."""
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        try:
            value = value.item()
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"metric {key!r} must be a scalar, got shape "
                             f"{tuple(getattr(value, 'shape', ()))}") from exc
    if isinstance(value, bool):
        return int(value)
    if not isinstance(value, (int, float)):
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")
    return value


def is_finite(value: float) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def reduce_metrics(per_micro_batch: Sequence[Mapping[str, Any]]) -> Dict[str, float]:
    """Mean of each key over the micro-batches that report it (a key missing from some
    micro-batches is averaged over the others). Tensors are converted with `.item()`."""
    sums: Dict[str, float] = {}
    counts: Dict[str, int] = {}
    for metrics in per_micro_batch:
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(to_scalar(value, key))
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}


def format_value(value: float) -> str:
    """Compact: ints as they are, floats to 4 significant digits, but large floats (1e4 up to
    1e9, e.g. tokens per second) as rounded integers rather than in exponent form."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isfinite(value) and 1e4 <= abs(value) < 1e9:
        return f"{value:.0f}"
    return f"{value:.4g}"


def _console_rank(key: str) -> int:
    for rank, name in enumerate(CONSOLE_PRIORITY):
        if _matches(key, name):
            return rank
    return len(CONSOLE_PRIORITY)


def _matches(key: str, name: str) -> bool:
    return key == name or key.startswith(name + "/") or key.endswith("/" + name)


def console_subset(metrics: Mapping[str, Any]) -> Dict[str, Any]:
    """The metrics shown on the console line: those matching CONSOLE_KEYS."""
    return {k: v for k, v in metrics.items() if any(_matches(k, n) for n in CONSOLE_KEYS)}


def console_order(keys: Iterable[str]) -> List[str]:
    """Keys in console order: CONSOLE_PRIORITY groups first, then the rest; sorted within each."""
    return sorted(keys, key=lambda key: (_console_rank(key), key))


def format_metrics(metrics: Mapping[str, Any]) -> str:
    """`key=value` pairs in console order, separated by spaces."""
    return " ".join(f"{key}={format_value(to_scalar(metrics[key], key))}"
                    for key in console_order(metrics))


def to_jsonable(value: Any) -> Any:
    """A value strict JSON can encode: non-finite floats become None, tensors and numpy values
    their Python equivalents, containers are converted recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, Mapping):
        return {str(key): to_jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(item) for item in value]
    if hasattr(value, "tolist"):  # tensors, numpy arrays and scalars
        return to_jsonable(value.tolist())
    return str(value)


def dumps(record: Mapping[str, Any]) -> str:
    return json.dumps(to_jsonable(record), ensure_ascii=False, allow_nan=False)


# ---------------------------------------------------------------------------------------------
# Sinks


def _package_available(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _missing_package_error(sink: str) -> UserError:
    package = _SINK_PACKAGES[sink]
    return UserError(f"--report_to {sink}: {package} is not installed (pip install {package})")


def check_report_to(report_to: Iterable[str]) -> List[str]:
    """The requested sinks, deduplicated in order ("none" dropped); UserError for an unknown
    sink or one whose package is not installed."""
    sinks: List[str] = []
    for sink in report_to:
        if sink == "none" or sink in sinks:
            continue
        if sink not in SINKS:
            raise UserError(f"--report_to {sink}: unknown sink (choose from "
                            f"{', '.join(SINKS)} or none)")
        if not _package_available(_SINK_PACKAGES[sink]):
            raise _missing_package_error(sink)
        sinks.append(sink)
    return sinks


def _import_sink(sink: str):
    try:
        return importlib.import_module(_SINK_PACKAGES[sink])
    except ImportError as exc:
        raise _missing_package_error(sink) from exc


@dataclass
class SinkSettings:
    """Where and under which names the sinks record the run (see the module docstring)."""

    tensorboard_dir: Optional[str] = None    # None: <output_dir>/runs
    wandb_project: str = DEFAULT_PROJECT
    wandb_exp_name: Optional[str] = None     # None: the absolute output directory
    swanlab_project: str = DEFAULT_PROJECT
    swanlab_exp_name: Optional[str] = None   # None: the absolute output directory


class _TensorboardSink:
    def __init__(self, output_dir: str, run_config: Optional[dict], settings: SinkSettings):
        _import_sink("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        log_dir = settings.tensorboard_dir or os.path.join(output_dir, TENSORBOARD_DIR)
        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandbSink:
    def __init__(self, output_dir: str, run_config: Optional[dict], settings: SinkSettings):
        wandb = _import_sink("wandb")
        self.run = wandb.init(project=settings.wandb_project,
                              name=settings.wandb_exp_name or os.path.abspath(output_dir),
                              dir=output_dir, config=run_config)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _SwanlabSink:
    def __init__(self, output_dir: str, run_config: Optional[dict], settings: SinkSettings):
        self.swanlab = _import_sink("swanlab")
        logdir = os.path.join(output_dir, SWANLAB_DIR)
        os.makedirs(logdir, exist_ok=True)  # swanlab wants an existing directory
        self.swanlab.init(project=settings.swanlab_project,
                          experiment_name=settings.swanlab_exp_name or os.path.abspath(output_dir),
                          logdir=logdir, config=run_config)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        self.swanlab.log(metrics, step=step)

    def close(self) -> None:
        self.swanlab.finish()


_SINK_CLASSES = {"tensorboard": _TensorboardSink, "wandb": _WandbSink, "swanlab": _SwanlabSink}


# ---------------------------------------------------------------------------------------------
# MetricsLogger


def _step_of(line: str) -> Optional[int]:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class MetricsLogger:
    """Console line + `{output_dir}/logging.jsonl` (appended, flushed per step) + the sinks named
    in `report_to`, placed and named by `sinks`. A no-op when `enabled` is False. Usable as a
    context manager."""

    def __init__(self, output_dir: str, report_to: Sequence[str],
                 run_config: Optional[dict] = None, enabled: bool = True,
                 sinks: Optional[SinkSettings] = None):
        self.sinks_requested = check_report_to(report_to)
        self.enabled = enabled
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, METRICS_FILE)
        self._file = None
        self._sinks: Dict[str, Any] = {}
        self._warned_non_finite: set = set()
        self._closed = False
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        try:
            for sink in self.sinks_requested:
                self._sinks[sink] = _SINK_CLASSES[sink](output_dir, run_config,
                                                        sinks or SinkSettings())
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one step's metrics everywhere; values may be numbers or scalar tensors."""
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        values = self._scalars(metrics)
        self._write_jsonl(step, values)
        logger.info(f"step {step} | {format_metrics(console_subset(values))}")
        finite = self._finite_only(values)
        for sink in self._sinks.values():
            sink.log(step, finite)

    def close(self) -> None:
        """Flush and close every writer; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink.close()
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @staticmethod
    def _scalars(metrics: Mapping[str, Any]) -> Dict[str, float]:
        reserved = [key for key in _RESERVED_KEYS if key in metrics]
        if reserved:
            raise ValueError(f"metric names {reserved} are reserved by logging.jsonl")
        return {key: to_scalar(value, key) for key, value in metrics.items()}

    def drop_after(self, step: int) -> int:
        """Resuming at `step` in the same output directory: remove the lines of later steps
        (the killed run's), so logging.jsonl keeps one line per step; returns how many. A line
        that does not parse (a half-written last line) goes too."""
        if not self.enabled:
            return 0
        self._file.close()
        with open(self.path, encoding="utf-8") as f:
            lines = f.readlines()
        kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
        temporary = self.path + ".tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(temporary, self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        return len(lines) - len(kept)

    def _write_jsonl(self, step: int, values: Dict[str, float]) -> None:
        record = {"step": step, "time": round(time.time(), 3), **values}
        self._file.write(dumps(record) + "\n")
        self._file.flush()

    def _finite_only(self, values: Dict[str, float]) -> Dict[str, float]:
        finite = {key: value for key, value in values.items() if is_finite(value)}
        skipped = [key for key in values if key not in finite]
        new = [key for key in skipped if key not in self._warned_non_finite]
        if new and self._sinks:
            self._warned_non_finite.update(new)
            logger.warning(f"non-finite metrics not sent to {', '.join(self._sinks)} "
                           f"(logging.jsonl records null): {', '.join(new)}")
        return finite
