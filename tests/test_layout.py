"""The package layout stays layered: no import cycle between tokenmill's subpackages (function-level
imports count, TYPE_CHECKING-only imports do not), and no module imports another module's private name."""

from __future__ import annotations

import ast
from pathlib import Path

import tokenmill

ROOT = Path(tokenmill.__file__).resolve().parent


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names imported) for every import outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tokenmill"):
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names if a.name.startswith("tokenmill"))
    return out


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (ROOT / parts[1]).is_dir()) else None


def test_no_import_cycle_between_subpackages():
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        src = _package(".".join(rel.parts))
        if src is None:
            continue
        for module, _ in _imports(path):
            dst = _package(module)
            if dst is not None and dst != src:
                graph.setdefault(src, set()).add(dst)

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return path + [start]
                if nxt not in path:
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [c for c in (cycle_from(p) for p in graph) if c]
    assert not cycles, f"import cycles between subpackages: {cycles}"


def test_no_private_name_imported_across_modules():
    offenders = []
    for path in ROOT.rglob("*.py"):
        for module, names in _imports(path):
            bad = [n for n in names if n.startswith("_") and n != "_C"]
            if bad:
                offenders.append(f"{path.relative_to(ROOT)}: {module} {bad}")
    assert not offenders, offenders
