"""report/completions.html: a static page (one file, no server) for reading what the model wrote:
per step, each sampled prompt and its completions with their reward, per-function rewards,
advantage, length and truncation, from `{output_dir}/completions.jsonl` (--log_completions).

The data is embedded as JSON (every `<`, `>` and `&` escaped, so a completion holding
`</script>` stays text) and drawn with textContent by a little vanilla JS: a step filter, a text
search and pages of PAGE_SIZE completions, so the DOM stays small whatever the run's size.

Large runs are sampled so the page stays readable: at most MAX_COMPLETIONS completions (or one
per step when there are more steps than that), spread evenly over the steps (every step keeps
at least one), whole prompt groups first (reading a group shows what the advantage compared);
when one group alone exceeds a step's share, its completions are taken evenly over its reward
order (best and worst kept). Prompts and completions longer than MAX_TEXT_CHARS are cut, with a
note saying how much is left in completions.jsonl.
"""
import html
import json
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from swift_megatron.logging.completions import COMPLETIONS_FILE
from swift_megatron.report.completions_page import PAGE
from swift_megatron.report.records import json_lines

MAX_COMPLETIONS = 2000
MAX_TEXT_CHARS = 8000
PAGE_SIZE = 20


@dataclass(frozen=True)
class Entry:
    """What sampling needs of one completions.jsonl line."""

    line: int
    step: int
    group: str
    reward: Optional[float]


def _reward(value) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def scan(path: str) -> List[Entry]:
    """One Entry per readable line (a half-written or foreign line is skipped)."""
    entries = []
    for number, row in json_lines(path):
        if row is None or not isinstance(row.get("step"), int) or "completion" not in row:
            continue
        group = str(row.get("prompt_id", row.get("prompt", "")))
        entries.append(Entry(number, row["step"], group, _reward(row.get("reward"))))
    return entries


def spread(count: int, take: int) -> List[int]:
    """`take` positions out of range(count), evenly spaced, first and last included."""
    if take >= count:
        return list(range(count))
    if take == 1:
        return [0]
    return sorted({round(i * (count - 1) / (take - 1)) for i in range(take)})


def pick_from_step(groups: Sequence[List[Entry]], quota: int) -> List[Entry]:
    """Whole groups in logged order while they fit in quota; a first group larger than quota
    gives `quota` of its completions evenly over its reward order."""
    picked: List[Entry] = []
    for group in groups:
        if len(picked) + len(group) <= quota:
            picked += group
        elif not picked:
            ranked = sorted(group, key=lambda e: (e.reward is None, -(e.reward or 0.0)))
            picked = [ranked[i] for i in spread(len(ranked), quota)]
        else:
            break
    return picked


def sample(entries: Sequence[Entry], limit: int = MAX_COMPLETIONS) -> List[Entry]:
    """The entries shown (see the module docstring), in file order."""
    if len(entries) <= limit:
        return list(entries)
    steps: Dict[int, Dict[str, List[Entry]]] = {}
    for entry in entries:
        steps.setdefault(entry.step, {}).setdefault(entry.group, []).append(entry)
    quota = max(1, limit // len(steps))
    chosen = [e for groups in steps.values() for e in pick_from_step(list(groups.values()), quota)]
    return sorted(chosen, key=lambda e: e.line)


def clip(text) -> str:
    text = text if isinstance(text, str) else json.dumps(text)
    if len(text) <= MAX_TEXT_CHARS:
        return text
    return f"{text[:MAX_TEXT_CHARS]}\n[... {len(text) - MAX_TEXT_CHARS} more characters in " \
           f"{COMPLETIONS_FILE}]"


def load_rows(path: str, lines: set) -> List[dict]:
    return [row for number, row in json_lines(path) if number in lines]


def page_data(title: str, rows: List[dict], total: int) -> dict:
    """The JSON the page embeds: prompts deduplicated, per-function rewards as a list."""
    funcs: Dict[str, None] = {}
    for row in rows:
        funcs.update((name, None) for name in (row.get("rewards") or {}))
    prompts: Dict[str, int] = {}
    items = []
    for row in rows:
        prompt = clip(row.get("prompt", ""))
        rewards = row.get("rewards") or {}
        items.append({"step": row["step"], "prompt_id": row.get("prompt_id"),
                      "p": prompts.setdefault(prompt, len(prompts)),
                      "completion": clip(row["completion"]), "reward": _reward(row.get("reward")),
                      "rewards": [_reward(rewards.get(name)) for name in funcs],
                      "advantage": _reward(row.get("advantage")), "length": row.get("length"),
                      "truncated": row.get("truncated")})
    return {"title": title, "total": total, "funcs": list(funcs), "prompts": list(prompts),
            "rows": items, "page_size": PAGE_SIZE}


def embed_json(data: dict) -> str:
    """JSON safe inside <script type="application/json">: no `<`, `>` or `&` left raw."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    for raw, escaped in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"),
                         ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(raw, escaped)
    return text


def render_page(data: dict) -> str:
    fill = {"@TITLE@": html.escape(data["title"]), "@DATA@": embed_json(data)}
    return re.sub("@TITLE@|@DATA@", lambda match: fill[match.group(0)], PAGE)


def write_completions_view(output_dir: str, html_path: str,
                           title: str) -> Optional[Tuple[int, int]]:
    """Write the page from output_dir's completions.jsonl; (shown, total), or None when the run
    logged no completions."""
    path = os.path.join(output_dir, COMPLETIONS_FILE)
    if not os.path.isfile(path):
        return None
    entries = scan(path)
    shown = sample(entries)
    rows = load_rows(path, {e.line for e in shown})
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(render_page(page_data(title, rows, len(entries))))
    return len(rows), len(entries)
