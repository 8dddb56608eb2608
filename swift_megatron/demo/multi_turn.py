"""A two-turn task a tiny random model can train on in CPU minutes (scripts/grpo/
cpu_multi_turn.sh, tests/e2e/test_multi_turn_e2e.py), and a complete example of a scheduler
plugin (docs/multi_turn.md).

`lookup_tool`: whatever the model says first, a tool answers with the row's `solution`
(`<result>...</result>`); the model's second turn is scored (e.g. contains_answer from
rewards.py). The answer is only in the tool's message, so one turn cannot solve the task. Turns
cut at --max_completion_length still get the tool's answer (stop_when_truncated = False): a
random model rarely ends its turns by itself.
"""
from swift_megatron.rollout.multi_turn import MultiTurnScheduler, Turn, register_scheduler


@register_scheduler("lookup_tool")
class LookupTool(MultiTurnScheduler):
    stop_when_truncated = False

    def step(self, episode, completion, turn):
        if turn >= 2:
            return Turn(done=True)
        solution = episode.columns.get("solution")
        return Turn(message={"role": "tool", "content": f"<result>{solution}</result>"})
