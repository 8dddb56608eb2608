"""A FrozenLake-style environment written against ms-swift's plugin API (`swift.rollout.gym_env`),
registered as `frozen_lake` like the plugin file of ms-swift's frozen_lake.sh examples, for the
test that runs those scripts' commands (test_frozen_lake_scripts.py). The agent moves on a
grid (L/R/U/D in <action>...</action>) from S to G; a hole or a bad action ends the episode."""
import re

from swift.rollout.gym_env import Env, envs

MOVES = {"L": (0, -1), "R": (0, 1), "U": (-1, 0), "D": (1, 0)}


class FrozenLake(Env):
    def __init__(self, env_config):
        super().__init__(env_config)
        self.grid = ["SF", "HG"]
        self.position = (0, 0)

    def _board(self) -> str:
        return "\n".join(self.grid)

    async def reset(self, config):
        self.position = (0, 0)
        system = "You are walking on a frozen lake. Answer with <action>L|R|U|D</action>."
        return f"Current board:\n{self._board()}", {"status": "start"}, system

    async def step(self, action):
        found = re.search(r"<action>\s*([LRUD])\s*</action>", action[-1]["content"] or "")
        if found is None:
            return "Invalid action.", 0.0, True, {"status": "invalid"}
        row, col = (a + b for a, b in zip(self.position, MOVES[found.group(1)]))
        if not (0 <= row < 2 and 0 <= col < 2):
            return f"You hit the edge.\n{self._board()}", 0.0, False, {"status": "edge"}
        self.position = (row, col)
        cell = self.grid[row][col]
        if cell == "G":
            return "You reached the goal.", 1.0, True, {"status": "goal"}
        if cell == "H":
            return "You fell into a hole.", 0.0, True, {"status": "hole"}
        return f"Current board:\n{self._board()}", 0.0, False, {"status": "moved"}

    async def close(self):
        return None


envs["frozen_lake"] = FrozenLake
