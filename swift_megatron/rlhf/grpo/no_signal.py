"""A warning when the rewards carry no learning signal: in every group (the --num_generations
completions of one prompt) all rewards were equal (`reward/frac_zero_std` 1), so every advantage
is 0 and the policy does not move (a LoRA adapter stays all zero, the grad norm is 0 without a
KL term), for rollout batch after rollout batch, while the run goes on and exits 0.

`NoSignalWatch.update` says so once the streak reaches FIRST_WARNING rollout batches, and again
at 10 and 100 times that; `finish` says so at the end of a run that had no signal at all but
ended before the first warning. Pure: metrics in, message or None out.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional

FIRST_WARNING = 5    # rollout batches in a row without signal before the first warning
REPEAT_FACTOR = 10   # then again at 10x and 100x as many


@dataclass
class NoSignalWatch:
    num_generations: int
    temperature: float
    steps_per_rollout: int = 1
    streak: int = 0           # rollout batches in a row without signal
    batches: int = 0          # rollout batches seen
    first_step: int = 0       # the streak's first optimizer step
    warned: bool = False

    def update(self, step: int, metrics: Dict[str, float]) -> Optional[str]:
        """After a rollout batch whose last optimizer step is `step`: the warning, or None."""
        self.batches += 1
        if metrics.get("reward/frac_zero_std", 0.0) < 1.0:
            self.streak = 0
            return None
        if self.streak == 0:
            self.first_step = step - self.steps_per_rollout + 1
        self.streak += 1
        if self.streak not in (FIRST_WARNING * REPEAT_FACTOR ** k for k in range(3)):
            return None
        self.warned = True
        return self.message(step, metrics)

    def finish(self, step: int, metrics: Dict[str, float]) -> Optional[str]:
        """At the end of the run: the warning for a run without any signal that ended before
        the first one came (a short run), else None."""
        if self.warned or not self.batches or self.streak != self.batches:
            return None
        return self.message(step, metrics)

    def message(self, step: int, metrics: Dict[str, float]) -> str:
        steps = f"step {step}" if self.first_step >= step else f"steps {self.first_step}-{step}"
        return (f"no learning signal in the last {self.streak} rollout batch(es) ({steps}): in "
                f"every group the {self.num_generations} completions of a prompt got the same "
                f"reward, so every advantage is 0 and the policy does not change. Likely "
                f"causes: {'; '.join(self.causes(metrics))}")

    def causes(self, metrics: Dict[str, float]) -> List[str]:
        constant = [key.split("/")[1] for key, value in metrics.items()
                    if key.startswith("reward/") and key.endswith("/std") and key.count("/") == 2
                    and value == 0.0]
        causes = [f"a reward function that returns a constant, or a task too hard or too easy "
                  f"for the model ({', '.join(constant)}: the same value for every completion "
                  f"of the batch)" if constant else "reward functions that cannot tell these "
                  "completions apart (too coarse, or a task too hard or too easy for the model)",
                  f"too few completions per prompt to differ (--num_generations "
                  f"{self.num_generations})",
                  f"sampling too greedy for the completions to differ (--temperature "
                  f"{self.temperature:g})"]
        return causes
