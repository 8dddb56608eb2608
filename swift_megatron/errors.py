"""Errors a user can cause and fix (a bad flag, file, dataset row or request).

The command-line layer prints a UserError's message without a traceback and exits with
`exit_code` (2, argparse's code for usage errors). Everything else is a bug and keeps its
traceback.
"""


class UserError(Exception):
    """A mistake in the user's input; the message says what to change."""

    exit_code = 2


class WriteFailed(UserError):
    """A write that the disk refused (no space left, the file size limit, a read-only file
    system, no permission): the message names what was being written, the cause, the partial
    output removed and what was kept (paths.py `removed_if_failed`)."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


class WeightSyncError(RuntimeError):
    """The rollout engine does not compute what the trainer computes after a weight sync
    (`--check_weight_sync`): its weights are wrong, stale or mapped to the wrong tensors."""


class NonFiniteError(UserError):
    """Training produced NaN or inf (a gradient norm, or weights about to be saved): usually a
    learning rate or reward scale too large for the model. Nothing non-finite is saved."""


class ServiceFailure(UserError):
    """A long-running command lost a part it cannot serve without (a rollout replica process
    died): printed without a traceback, exit code 1."""

    exit_code = 1


class NumericsError(UserError):
    """The first-step numerics gate (`--numerics_check`): the rollout engine's logprobs of the
    first rollout batch are too far from the trainer's. Printed without a traceback, exit code
    1, before any update (nothing is saved or lost)."""

    exit_code = 1
