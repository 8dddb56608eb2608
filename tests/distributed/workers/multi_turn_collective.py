"""Worker: multi-turn rollouts over 2 ranks (DP 2) with a collective engine (every generate call
all-gathers, as colocate vLLM with TP > 1 and the server client do). Rank r's episodes stop
after 1 + 2r turns, so rank 0 must keep joining the engine's calls with no requests until rank
1 is done; writes the calls and the samples' turns to {out_dir}/rank{R}.json."""
import argparse
import json
import os

import torch
import torch.distributed as dist

from swift_megatron.data import Prompt
from swift_megatron.fixtures.tokenizer import load_tokenizer
from swift_megatron.rlhf.grpo.collect import CollectSettings, RolloutCollector
from swift_megatron.rollout.engine import Completion, SamplingConfig
from swift_megatron.rollout.multi_turn import MultiTurnScheduler, MultiTurnSettings, Turn


class CollectiveEngine:
    weight_version = 0

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def generate(self, prompts, sampling, seeds=None):
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, len(prompts))   # hangs if the ranks' calls differ
        self.calls.append(counts)
        ids = self.tok("ok", add_special_tokens=False)["input_ids"] + \
            [self.tok.convert_tokens_to_ids("<|im_end|>")]
        return [Completion(list(ids), [-1.0] * len(ids), "stop") for _ in prompts]


class RankTurns(MultiTurnScheduler):
    def step(self, episode, completion, turn):
        if turn >= 1 + 2 * dist.get_rank():
            return Turn(done=True, reward=1.0)
        return Turn(message={"role": "user", "content": "again"})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir")
    out_dir = parser.parse_args().out_dir
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    own = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    tok = load_tokenizer()
    messages = [{"role": "user", "content": f"question {rank}"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = Prompt(rank, text, tok(text, add_special_tokens=False)["input_ids"], messages)
    sampling = SamplingConfig(max_tokens=8)
    settings = CollectSettings(
        num_generations=2, sampling=sampling, reward_names=["one"], reward_weights=[1.0],
        scale_rewards="group", dynamic_sample=False, max_resample_times=0,
        multi_turn=MultiTurnSettings(max_completion_length=8, max_length=256))
    engine = CollectiveEngine(tok)
    collector = RolloutCollector(engine, [("one", lambda completions, **kw: [1.0] * len(completions))],
                                 tok, settings, own, dist.group.WORLD, lambda n: [],
                                 torch.device("cpu"), scheduler=RankTurns())
    samples, metrics = collector.collect([prompt], [rank], seed=0)
    result = {"calls": engine.calls, "turns": [s.rollout_infos["num_turns"] for s in samples],
              "masks": [s.loss_mask for s in samples], "metrics": metrics}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
