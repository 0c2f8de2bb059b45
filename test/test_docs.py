"""The documentation holds together: every relative link and heading anchor resolves, every
command-line flag is in the server reference, and docs/structure.md names every module."""

import ast
import re
from pathlib import Path

import pytest

from sgl_jax.server_args import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks, whose brackets are not links."""
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchor_of(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (but '-' and '_'),
    spaces as '-'."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor; a repeated heading's later ones get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(page):
        match = re.match(r"#{1,6}\s+(.*)", line)
        if not match:
            continue
        anchor = anchor_of(match.group(1))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    return [target for line in prose_lines(page) for target in LINK.findall(line)
            if not re.match(r"[a-z]+:", target)]  # http:, https:, mailto: leave the repository


def link_problem(page: Path, target: str) -> str | None:
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    if not linked.exists():
        return f"{target}: no such file"
    if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
        return f"{target}: no heading with anchor #{anchor} in {linked.relative_to(ROOT)}"
    return None


def test_anchor_of_follows_github():
    assert anchor_of("Structured outputs and `logit_bias`") == "structured-outputs-and-logit_bias"
    assert anchor_of("Start-up (CPU, 2026-11-27)") == "start-up-cpu-2026-11-27"
    assert anchor_of("What's next?") == "whats-next"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    problems = [problem for target in relative_links(page)
                if (problem := link_problem(page, target)) is not None]
    assert not problems, "\n".join(problems)


def test_every_flag_is_in_the_server_reference(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")  # no help line wrapped inside a flag's name
    reference = (ROOT / "docs" / "server.md").read_text()
    flags = set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", build_parser().format_help()))
    flags.discard("--help")
    missing = sorted(flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])",
                                                              reference))
    assert not missing, "flags missing from docs/server.md: " + ", ".join(missing)


def has_code(path: Path) -> bool:
    """Whether a module holds more than a docstring and re-exports (an __init__.py that only
    names its package needs no line of its own)."""
    def passive(node: ast.stmt) -> bool:
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        exports = isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets
                                                    ] == ["__all__"]
        return docstring or exports or isinstance(node, ast.Import | ast.ImportFrom)
    return not all(passive(node) for node in ast.parse(path.read_text()).body)


def test_structure_names_every_module():
    structure = (ROOT / "docs" / "structure.md").read_text()
    modules = [path for path in (ROOT / "sgl_jax").rglob("*.py")
               if path.name != "__init__.py" or has_code(path)]
    missing = sorted(str(path.relative_to(ROOT)) for path in modules
                     if f"`{path.relative_to(ROOT)}`" not in structure)
    assert not missing, "modules without a line in docs/structure.md:\n" + "\n".join(missing)
