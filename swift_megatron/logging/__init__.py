"""Logging for every module: `get_logger(__name__)` prints on global rank 0 only (warnings and
errors from every rank), so a multi-process run reads like a single one. Metric sinks (console,
jsonl, tensorboard, wandb) live in logging/metrics.py."""
from swift_megatron.logging.completions import CompletionsLogger
from swift_megatron.logging.logger import get_logger
from swift_megatron.logging.metrics import MetricsLogger, format_metrics, reduce_metrics

__all__ = ["get_logger", "MetricsLogger", "CompletionsLogger", "reduce_metrics", "format_metrics"]
