"""Math answers: pull the final answer out of a completion and decide whether it equals a solution.

Used by the `accuracy` and `cosine` rewards. Extraction (`extract_answer`) takes the last
`\\boxed{...}` (balanced braces, nesting allowed), else the last `<answer>...</answer>`, else the
last number in the text. Comparison (`answers_equal`) first uses our own normaliser (below), then,
when the optional `math_verify` package is importable, also asks `math_verify.parse`/`verify`;
either one saying "equal" is enough.

Our normaliser strips whitespace, `$`, `\\(`/`\\)`, `\\left`/`\\right`, LaTeX spacing (`\\!`, `\\,`,
...), a trailing `.`, degree and percent signs, `\\text{...}`-style wrappers and a leading
`x =`; it reads `\\frac{a}{b}` (and `\\dfrac`, `\\tfrac`), `a/b`, integers, decimals and
thousands separators ("1,000") as exact fractions compared within 1e-6; anything else is compared
as a case-insensitive string. Standard library only.
"""
import re
import threading
from fractions import Fraction
from typing import Optional

_TOLERANCE = Fraction(1, 10 ** 6)

# ---------------------------------------------------------------------------------------------
# Extraction


def _braced(text: str, start: int) -> Optional[str]:
    """The content of the brace group opening at text[start] == '{' (nesting allowed), or None
    when the braces never close."""
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":  # an escaped character such as \{ or \} does not count
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return None


def last_boxed(text: str) -> Optional[str]:
    """The content of the last complete `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces
    balanced; `\\boxed 5` (no braces) gives "5". None when there is none."""
    for match in reversed(list(re.finditer(r"\\(?:boxed|fbox)(?![a-zA-Z])", text))):
        rest = match.end()
        while rest < len(text) and text[rest] == " ":
            rest += 1
        if rest < len(text) and text[rest] == "{":
            content = _braced(text, rest)
            if content is not None:
                return content.strip()
        elif rest > match.end():  # "\boxed 5": the next run of non-space characters
            token = re.match(r"[^\s$]+", text[rest:])
            if token:
                return token.group(0)
    return None


def answer_tag(text: str) -> Optional[str]:
    """The stripped content of the last `<answer>...</answer>` in `text`, or None."""
    matches = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?\s*/\s*\d+(?:\.\d+)?(?![\d.,])"  # 3/4
                     r"|-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)"  # 1,000 and 12,345.5
                     r"|-?\d+(?:\.\d+)?"  # 42, 3.14
                     r"|-?\.\d+")  # .5


def last_number(text: str) -> Optional[str]:
    """The last number in `text` (integer, decimal, "1,000" or "3/4"), as written; None if none."""
    matches = _NUMBER.findall(text)
    return matches[-1] if matches else None


def extract_answer(text: str) -> Optional[str]:
    """A completion's final answer: the last `\\boxed{}`, else the last `<answer>` block, else the
    last number. None when the completion has none of these."""
    if text is None:
        return None
    for extractor in (last_boxed, answer_tag, last_number):
        found = extractor(text)
        if found is not None and found.strip():
            return found
    return None


def extract_solution(solution) -> Optional[str]:
    """The reference answer of a dataset `solution` value: its last `\\boxed{}` if it has one,
    else the text after a GSM8K-style `####`, else the whole value; None when empty."""
    if solution is None:
        return None
    text = str(solution)
    boxed = last_boxed(text)
    if boxed is not None:
        text = boxed
    elif "####" in text:
        text = text.rsplit("####", 1)[1]
    text = text.strip()
    return text or None


# ---------------------------------------------------------------------------------------------
# Normalisation

_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)"
                       r"\s*\{([^{}]*)\}")
_SPACING = ("\\!", "\\,", "\\;", "\\:", "\\ ", "\\quad", "\\qquad", "~")


def _strip_outer_braces(s: str) -> str:
    while s.startswith("{") and s.endswith("}") and _braced(s, 0) == s[1:-1]:
        s = s[1:-1].strip()
    return s


def normalize(answer: str) -> str:
    """A canonical string for `answer`: LaTeX decoration, spacing and trailing punctuation removed,
    `\\dfrac`/`\\tfrac` -> `\\frac`, all whitespace removed. Case is kept (compare with .lower())."""
    s = str(answer).strip()
    s = s.replace("\\$", "").replace("$", "")
    for delim in ("\\(", "\\)", "\\[", "\\]"):
        s = s.replace(delim, "")
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])", "", s)
    s = re.sub(r"\\displaystyle(?![a-zA-Z])", "", s)
    for space in _SPACING:
        s = s.replace(space, " ")
    s = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", s)
    previous = None
    while previous != s:  # unwrap nested \text{\textbf{...}}
        previous = s
        s = _WRAPPERS.sub(r"\1", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s).replace("°", "")
    s = s.replace("\\%", "").replace("%", "")
    s = s.strip()
    while s.endswith(".") and not s.endswith(".."):  # "42." -> "42" (keeps "\ldots"-like "...")
        s = s[:-1].rstrip()
    # "x = 5" -> "5": a short variable name on the left of the only "="
    lhs = re.match(r"^\s*[a-zA-Z](?:_\{?\w+\}?|\w)?\s*=(?!=)(.*)$", s, flags=re.DOTALL)
    if lhs and "=" not in lhs.group(1):
        s = lhs.group(1).strip()
    s = _strip_outer_braces(s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    s = re.sub(r"\\frac\s*\{([^{}]*)\}\s*(\d)", r"\\frac{\1}{\2}", s)  # \frac{1}2
    s = re.sub(r"\\sqrt\s*(\d+)", r"\\sqrt{\1}", s)
    s = re.sub(r"\s+", "", s)
    return s


_PLAIN = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _plain_number(s: str) -> Optional[Fraction]:
    s = _strip_outer_braces(s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if _PLAIN.fullmatch(s):
        return Fraction(s)
    return None


def to_number(answer: str) -> Optional[Fraction]:
    """The exact value of a normalised answer that is a plain number, `\\frac{a}{b}` or `a/b`
    (a, b plain numbers; a leading sign allowed); None for anything else."""
    s = normalize(answer)
    sign = 1
    if s[:1] in "+-" and s[1:].startswith("\\frac"):
        sign, s = (-1 if s[0] == "-" else 1), s[1:]
    frac = re.fullmatch(r"\\frac\{([^{}]+)\}\{([^{}]+)\}", s)
    parts = frac.groups() if frac else (s.split("/") if s.count("/") == 1 else None)
    if parts is not None:
        num, den = _plain_number(parts[0]), _plain_number(parts[1])
        if num is None or den is None or den == 0:
            return None
        return sign * num / den
    return _plain_number(s)


# ---------------------------------------------------------------------------------------------
# Comparison

_math_verify = None  # the math_verify module once imported; False when it is not installed


def _load_math_verify():
    global _math_verify
    if _math_verify is None:
        try:
            import math_verify  # optional; never a dependency of swift-megatron
            _math_verify = math_verify
        except Exception:  # ImportError, or a broken install
            _math_verify = False
    return _math_verify or None


def math_verify_available() -> bool:
    """Whether the optional `math_verify` package can be imported."""
    return _load_math_verify() is not None


def normalized_equal(pred: str, gold: str) -> bool:
    """Our own comparison: numeric within 1e-6 when both sides read as numbers (see `to_number`),
    else case-insensitive equality of the normalised strings."""
    p, g = normalize(pred), normalize(gold)
    if not p or not g:
        return False
    p_num, g_num = to_number(p), to_number(g)
    if p_num is not None and g_num is not None:
        return abs(p_num - g_num) <= _TOLERANCE
    return p.lower() == g.lower()


def math_verify_equal(pred: str, gold: str) -> Optional[bool]:
    """math_verify's verdict on two extracted answers; None when it is not installed or cannot
    parse either side (or raises, e.g. its timeout outside the main thread)."""
    mv = _load_math_verify()
    if mv is None:
        return None
    # math_verify's timeouts use SIGALRM, which only works in the main thread: elsewhere turn
    # them off (math_verify >= 0.7 accepts None), else it would fail on every call.
    main = threading.current_thread() is threading.main_thread()
    parse_kw, verify_kw = ({}, {}) if main else ({"parsing_timeout": None}, {"timeout_seconds": None})
    try:
        gold_parsed = mv.parse(f"${gold}$", **parse_kw)
        pred_parsed = mv.parse(f"${pred}$", **parse_kw)
        if not gold_parsed or not pred_parsed:
            return None
        return bool(mv.verify(gold_parsed, pred_parsed, **verify_kw))
    except Exception:
        return None


def answers_equal(pred: Optional[str], gold: Optional[str],
                  use_math_verify: Optional[bool] = None) -> bool:
    """Whether the extracted answer `pred` equals the reference `gold`.

    `use_math_verify`: None (default) asks math_verify too when it is installed; False uses our
    normaliser only; True requires math_verify (ImportError if missing). Either one saying
    "equal" is enough (math_verify knows more algebra, e.g. 10\\% = 0.1, (x+1)^2 = x^2+2x+1)."""
    if pred is None or gold is None:
        return False
    if normalized_equal(pred, gold):
        return True
    if use_math_verify is False:
        return False
    if use_math_verify and not math_verify_available():
        raise ImportError("use_math_verify=True but the math_verify package is not installed")
    return bool(math_verify_equal(pred, gold))
