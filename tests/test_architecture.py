"""The package's shape, checked: layers import only downwards, SQL only in queue/, no cycles, small classes.

Layers, lowest first (docs/design.md): the base modules (config, errors,
tracking, faults); smtp/ and queue/ (queue may use smtp's pure helpers, never
the reverse); redundancy/; node/; devtools/ (sink, local cluster, chaos: never
imported by what a production node runs); cli/. analytics/ stands apart on the
base modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "transportd"

BASE = {"transportd", "transportd.config", "transportd.errors", "transportd.tracking", "transportd.faults"}
# What each part may import from transportd, besides itself and the base modules.
ALLOWED = {
    "smtp": set(),
    "queue": {"smtp"},
    "redundancy": {"smtp", "queue"},
    "node": {"smtp", "queue", "redundancy"},
    "devtools": {"smtp", "queue", "redundancy", "node"},
    "cli": {"smtp", "queue", "redundancy", "node", "devtools", "analytics"},
    "analytics": set(),
    "base": set(),
    "__main__": {"cli"},
}
MAX_CLASS_LINES = 250


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _part(module: str) -> str:
    if module in BASE:
        return "base"
    return module.split(".")[1]


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """Every transportd module ``module`` imports (at any depth of the file), with its line."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name == "transportd" or name.startswith("transportd."):
                while name not in MODULES and "." in name:
                    name = name.rpartition(".")[0]
                if name in MODULES and name != module:
                    found.append((name, node.lineno))
    return found


def test_layers_import_only_downwards() -> None:
    wrong = []
    for module, path in MODULES.items():
        part = _part(module)
        for target, line in _imports(module, path):
            tpart = _part(target)
            if tpart in ("base", part) or target == "transportd":
                continue
            if tpart not in ALLOWED[part]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {part} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_base_modules_import_no_layer() -> None:
    wrong = [f"{m} imports {t}" for m in BASE if m in MODULES and m != "transportd"
             for t, _ in _imports(m, MODULES[m]) if t not in BASE]
    assert not wrong, wrong


def test_no_sql_outside_the_queue_layer() -> None:
    wrong = []
    for module, path in MODULES.items():
        if _part(module) == "queue":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "sqlalchemy" or n.startswith("sqlalchemy.") for n in names):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not wrong, "sqlalchemy imported outside transportd/queue/: " + ", ".join(wrong)


def test_no_import_cycle() -> None:
    graph = {m: {t for t, _ in _imports(m, p)} for m, p in MODULES.items()}
    # A package's __init__ importing its own submodules is not a cycle of the design.
    for m in graph:
        graph[m] = {t for t in graph[m] if not (t.startswith(m + ".") and MODULES[m].name == "__init__.py")}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]) if t in stack else f"{m} -> {t}")
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_says_what_it_owns(module: str) -> None:
    tree = ast.parse(MODULES[module].read_text())
    doc = ast.get_docstring(tree)
    if MODULES[module].name == "__init__.py" and not tree.body:
        return  # an empty package marker
    assert doc and len(doc.split()) >= 8, f"{module} has no module docstring saying what it owns"


def test_no_class_over_250_lines() -> None:
    big = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    big.append(f"{module}.{node.name}: {n} lines")
    assert not big, big


def test_comments_carry_no_history() -> None:
    """History (which issue, which run found it) belongs in git log and docs/, not in the code."""
    import re
    pattern = re.compile(r"(\bissue \d+\b|\(issue|found by `?transportd chaos|found by the chaos)", re.IGNORECASE)
    found = [f"{path.relative_to(PACKAGE.parent)}:{i}" for path in MODULES.values()
             for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found
