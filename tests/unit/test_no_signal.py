"""The no-learning-signal warning (rlhf/grpo/no_signal.py): after FIRST_WARNING rollout batches
in a row where every group's rewards were equal, once, again at 10x and 100x as many, reset by
a batch with signal; a short run without any signal is told at its end (issue 57). The wiring
into a real run: tests/e2e/test_rlhf_e2e.py."""
from swift_megatron.rlhf.grpo.no_signal import FIRST_WARNING, REPEAT_FACTOR, NoSignalWatch

FLAT = {"reward/frac_zero_std": 1.0, "reward/mean": 0.0, "reward/std": 0.0,
        "reward/format/mean": 0.0, "reward/format/std": 0.0,
        "reward/accuracy/mean": 0.25, "reward/accuracy/std": 0.43}
SIGNAL = dict(FLAT, **{"reward/frac_zero_std": 0.5})


def warnings_at(watch, flags, steps_per_rollout=1):
    """The steps (last of each rollout batch) at which `watch` warned, for a run whose batches
    have signal where `flags` is True."""
    found = []
    for index, signal in enumerate(flags, start=1):
        if watch.update(index * steps_per_rollout, SIGNAL if signal else FLAT):
            found.append(index * steps_per_rollout)
    return found


def test_warned_once_then_at_10x_and_100x():
    watch = NoSignalWatch(num_generations=4, temperature=0.7)
    flat = [False] * (FIRST_WARNING * REPEAT_FACTOR ** 2 + 3)
    assert warnings_at(watch, [True] + flat) == [1 + 5, 1 + 50, 1 + 500]


def test_a_batch_with_signal_resets_the_count():
    watch = NoSignalWatch(num_generations=4, temperature=1.0)
    assert warnings_at(watch, [False] * 4 + [True] + [False] * 4) == []
    assert watch.update(10, FLAT) is not None   # the 5th in a row


def test_the_message_names_the_steps_and_the_likely_causes():
    watch = NoSignalWatch(num_generations=2, temperature=0.3, steps_per_rollout=2)
    messages = [watch.update(step, FLAT) for step in (2, 4, 6, 8, 10)]
    assert messages[:4] == [None] * 4
    assert messages[4] == (
        "no learning signal in the last 5 rollout batch(es) (steps 1-10): in every group the 2 "
        "completions of a prompt got the same reward, so every advantage is 0 and the policy "
        "does not change. Likely causes: a reward function that returns a constant, or a task "
        "too hard or too easy for the model (format: the same value for every completion of "
        "the batch); too few completions per prompt to differ (--num_generations 2); sampling "
        "too greedy for the completions to differ (--temperature 0.3)")
    assert watch.finish(10, FLAT) is None   # warned already


def test_a_short_run_without_signal_is_told_at_its_end():
    watch = NoSignalWatch(num_generations=4, temperature=1.0)
    assert warnings_at(watch, [False, False]) == []
    assert watch.finish(2, FLAT).startswith("no learning signal in the last 2 rollout batch(es) "
                                            "(steps 1-2)")
    mixed = NoSignalWatch(num_generations=4, temperature=1.0)
    warnings_at(mixed, [True, False])
    assert mixed.finish(2, FLAT) is None    # it had signal once: not a run without any
