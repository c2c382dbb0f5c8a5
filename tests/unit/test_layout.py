"""The package's layout: every module listed in docs/design.md, none over 450 lines, no import
circle between modules (imports at module level; a package counts as its ``__init__``)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "applier"
MODULES = sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    package = _name(path).split(".") if path.name == "__init__.py" else _name(path).split(".")[:-1]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found |= {t for t in [target] + [f"{target}.{a.name}" for a in node.names] if t in known}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
    return found - {_name(path)}


def test_every_module_is_listed_in_the_design_notes() -> None:
    design = (REPO / "docs" / "design.md").read_text()
    missing = [str(m.relative_to(REPO)) for m in MODULES
               if f"| `{m.relative_to(REPO)}` |" not in design]
    assert not missing, f"add to docs/design.md's module list: {missing}"


def test_no_module_is_over_450_lines() -> None:
    long = {str(m.relative_to(REPO)): n for m in MODULES
            if (n := len(m.read_text().splitlines())) > 450}
    assert not long, long


def test_no_import_circle() -> None:
    known = {_name(m) for m in MODULES}
    graph = {_name(m): _imports(m, known) for m in MODULES}

    def reaches(start: str, goal: str) -> list[str] | None:
        seen, stack = set(), [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == goal:
                    return path + [goal]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    circles = [c for name in sorted(graph) if (c := reaches(name, name)) is not None]
    assert not circles, circles[0]
    # The check sees relative imports, or it would pass on anything.
    assert "applier.apply.plan" in graph["applier.apply.dispatch"]
