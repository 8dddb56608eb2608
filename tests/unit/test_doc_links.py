"""Every relative link of README.md and docs/*.md resolves: the file exists (relative to the linking
file) and an anchor names a heading of the target markdown file, by GitHub's heading slugs."""
import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_HTML_ANCHOR = re.compile(r"""<a\s[^>]*(?:name|id)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
# [text](target) or [text](target "title"), text may hold one level of brackets (badges, images)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")   # http:, https:, mailto:, ...


def _doc_files():
    return [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def _blank_fences(text: str) -> str:
    """The text with every fenced code block's lines emptied (line numbers kept)."""
    lines, fence = text.split("\n"), None
    for i, line in enumerate(lines):
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence, lines[i] = match.group(1), ""
        else:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                    and not line.strip()[len(match.group(1)):].strip():
                fence = None
            lines[i] = ""
    return "\n".join(lines)


def _blank_code_spans(text: str) -> str:
    return _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (github-slugger): the rendered text lowercased, every
    character but letters, digits, spaces, hyphens and underscores dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link's text stays
    text = re.sub(r"<[^>]+>", "", text)                          # inline HTML tags go
    text = text.lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: str) -> set:
    """The anchors of a markdown file: its headings' slugs (a repeated slug gets -1, -2, ...)
    and explicit <a name=...>/<a id=...> anchors. Headings inside fenced code do not count."""
    with open(path, encoding="utf-8") as f:
        text = _blank_fences(f.read())
    found, seen = set(), {}
    for line in text.split("\n"):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(1).strip())
        name, n = base, seen.get(base, 0)
        while name in found:                 # github-slugger: first free base-N, N from 1
            n += 1
            name = f"{base}-{n}"
        seen[base] = n
        found.add(name)
    found.update(_HTML_ANCHOR.findall(text))
    return found


def links(path: str):
    """(line, target) for each link of a markdown file outside code blocks and code spans."""
    with open(path, encoding="utf-8") as f:
        text = _blank_code_spans(_blank_fences(f.read()))
    for match in _LINK.finditer(text):
        yield text.count("\n", 0, match.start()) + 1, match.group(1)


def dead_links(path: str) -> list:
    """'file:line: target (why)' for each relative link of `path` that does not resolve."""
    dead, cache = [], {}
    where = os.path.relpath(path, REPO)
    for line, target in links(path):
        if not target or _EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part \
            else path
        if not os.path.exists(resolved):
            dead.append(f"{where}:{line}: {target} (no such file)")
            continue
        if not anchor:
            continue
        if not resolved.endswith(".md") or os.path.isdir(resolved):
            dead.append(f"{where}:{line}: {target} (an anchor into a file that is not markdown)")
            continue
        if resolved not in cache:
            cache[resolved] = anchors(resolved)
        if anchor not in cache[resolved]:
            dead.append(f"{where}:{line}: {target} (no heading with that anchor)")
    return dead


@pytest.mark.parametrize("doc", [os.path.relpath(p, REPO) for p in _doc_files()])
def test_relative_links_resolve(doc):
    dead = dead_links(os.path.join(REPO, doc))
    assert not dead, "dead links:\n" + "\n".join(dead)


def test_slugs_follow_github():
    assert slug("Speed: micro-batches by a token budget") == "speed-micro-batches-by-a-token-budget"
    assert slug("Asynchronous generation (`--async_generate`)") == \
        "asynchronous-generation---async_generate"
    assert slug("Qwen3.5 (hybrid Gated DeltaNet)") == "qwen35-hybrid-gated-deltanet"
    assert slug("Output directory, checkpoints and resume") == \
        "output-directory-checkpoints-and-resume"
    assert slug("[HTTP API](rollout.md) v2") == "http-api-v2"


def test_checker_catches_dead_links(tmp_path):
    """The checker itself: a missing file, a missing anchor, a repeated heading's suffix, and
    links in fenced code or code spans left alone."""
    (tmp_path / "other.md").write_text("# Title\n\n## Usage\n\n## Usage\n\n```\n# Not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md#usage) [ok](other.md#usage-1) [ok](#page) [ok](https://example.com/x#y)\n"
        "[bad](other.md#usage-2) [bad](missing.md) [bad](#nope) [bad](other.md#not-a-heading)\n"
        "`[code](missing.md)`\n\n```\n[code](missing.md)\n```\n")
    dead = dead_links(str(page))
    assert [d.split(": ", 1)[1].split(" (")[0] for d in dead] == \
        ["other.md#usage-2", "missing.md", "#nope", "other.md#not-a-heading"], dead
