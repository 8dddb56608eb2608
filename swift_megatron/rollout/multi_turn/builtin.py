"""Built-in multi-turn schedulers and gym environments, registered at import:

- `calculator` (scheduler): a tool-use loop. When the model's turn holds
  `<calculator>EXPRESSION</calculator>`, the tool's result comes back as a `tool` message
  (`<result>VALUE</result>`, or `<error>...</error>`); a turn without a call ends the episode.
  Expressions are arithmetic only (numbers, + - * / // % **, parentheses; results up to
  1e100), evaluated without `eval`; rewards come from --reward_funcs (e.g. accuracy on the final answer).
- `gym_scheduler` (scheduler): drives --gym_env environments (gym.py).
- `grid_world` (gym env): a FrozenLake-like text grid. The agent `P` starts on `S` and must
  reach `G` without stepping into a hole `H`; each turn it answers
  `<action>up|down|left|right</action>`. Reward 1 on reaching the goal (done), 0 otherwise;
  falling into a hole ends the episode. env_config: `size` (4), `holes` (fraction of cells,
  0.2), `seed` (the map; default the row's prompt id). Maps are solvable (breadth-first check).
"""
import ast
import operator
import random
import re
from collections import deque
from typing import Any, Dict, List, Optional, Tuple

from swift_megatron.rollout.multi_turn.gym import GymScheduler
from swift_megatron.rollout.multi_turn.protocol import Env, Episode, MultiTurnScheduler, Turn
from swift_megatron.rollout.plugin_registry import GYM_ENVS, SCHEDULERS

BUILTIN = "swift-megatron (built in)"

# ---- calculator tool --------------------------------------------------------------------

_CALL = re.compile(r"<calculator>(.*?)</calculator>", re.DOTALL)
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
              ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e100   # larger intermediate values are refused (no runaway big integers)


def calculate(expression: str) -> float:
    """The value of an arithmetic expression; ValueError for anything else (names, calls,
    exponents above MAX_EXPONENT, values above MAX_MAGNITUDE, division by zero)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an expression: {expression!r}") from error
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large")
        try:
            return _bounded(_OPERATORS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
    raise ValueError(f"unsupported: {ast.dump(node)[:40]}")


def _bounded(value):
    if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
        raise ValueError("the result is too large" if not isinstance(value, complex)
                         else "the result is not a real number")
    return value


def format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class CalculatorScheduler(MultiTurnScheduler):
    """The `calculator` tool loop (module docstring)."""

    def step(self, episode: Episode, completion: str, turn: int) -> Turn:
        calls = _CALL.findall(completion)
        if not calls:
            return Turn(done=True)
        try:
            content = f"<result>{format_number(calculate(calls[-1]))}</result>"
            ok = True
        except ValueError as error:
            content, ok = f"<error>{error}</error>", False
        episode.info["tool_calls"] = episode.info.get("tool_calls", 0) + 1
        return Turn(message={"role": "tool", "content": content}, info={"tool_ok": ok})


# ---- grid world -------------------------------------------------------------------------

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_ACTION = re.compile(r"<action>\s*(up|down|left|right)\s*</action>", re.IGNORECASE)
GRID_SYSTEM = ("You are walking on a frozen lake. S is the start, G the goal, H a hole, F safe "
               "ice and P your position. Reply with one move as <action>up</action>, "
               "<action>down</action>, <action>left</action> or <action>right</action>.")


def make_grid(size: int, holes: float, seed: int) -> List[str]:
    """A size x size map with S top-left, G bottom-right and about `holes` of the other cells
    holes, redrawn until G is reachable from S."""
    rng = random.Random(seed)
    while True:
        cells = [["H" if rng.random() < holes else "F" for _ in range(size)] for _ in range(size)]
        cells[0][0], cells[-1][-1] = "S", "G"
        grid = ["".join(row) for row in cells]
        if _reachable(grid):
            return grid


def _reachable(grid: List[str]) -> bool:
    size, seen, queue = len(grid), {(0, 0)}, deque([(0, 0)])
    while queue:
        r, c = queue.popleft()
        if grid[r][c] == "G":
            return True
        for dr, dc in MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < size and 0 <= nc < size and (nr, nc) not in seen and grid[nr][nc] != "H":
                seen.add((nr, nc))
                queue.append((nr, nc))
    return False


def parse_action(text: str) -> Optional[str]:
    """The last `<action>...</action>` move in `text`, lower case; None when there is none."""
    found = _ACTION.findall(text)
    return found[-1].lower() if found else None


class GridWorld(Env):
    """The `grid_world` environment (module docstring)."""

    def __init__(self, env_config: Dict[str, Any]):
        super().__init__(env_config)
        self.size = int(env_config.get("size", 4))
        self.holes = float(env_config.get("holes", 0.2))
        if self.size < 2 or not 0 <= self.holes < 1:
            raise ValueError(f"grid_world: env_config needs size >= 2 and 0 <= holes < 1, got "
                             f"{env_config}")
        self.grid: List[str] = []
        self.position = (0, 0)

    def reset(self, config: Episode) -> Tuple[str, Dict[str, Any], str]:
        seed = int(self.env_config.get("seed", config.prompt_id))
        self.grid, self.position = make_grid(self.size, self.holes, seed), (0, 0)
        return self.render(), {"seed": seed}, GRID_SYSTEM

    def render(self) -> str:
        rows = [list(row) for row in self.grid]
        r, c = self.position
        rows[r][c] = "P"
        return "\n".join("".join(row) for row in rows)

    def step(self, action: List[Dict[str, Any]]) -> Tuple[str, float, bool, Dict[str, Any]]:
        move = parse_action(action[-1]["content"])
        if move is None:
            return (f"No valid action found. Current map:\n{self.render()}", 0.0, False,
                    {"status": "invalid"})
        dr, dc = MOVES[move]
        r = min(max(self.position[0] + dr, 0), self.size - 1)
        c = min(max(self.position[1] + dc, 0), self.size - 1)
        self.position = (r, c)
        cell = self.grid[r][c]
        if cell == "G":
            return f"You reached the goal.\n{self.render()}", 1.0, True, {"status": "goal"}
        if cell == "H":
            return f"You fell into a hole.\n{self.render()}", 0.0, True, {"status": "hole"}
        return f"You moved {move}.\n{self.render()}", 0.0, False, {"status": "moved"}


SCHEDULERS.register("calculator", CalculatorScheduler, BUILTIN)
SCHEDULERS.register("gym_scheduler", GymScheduler, BUILTIN)
GYM_ENVS.register("grid_world", GridWorld, BUILTIN)
