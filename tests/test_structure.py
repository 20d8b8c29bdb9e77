"""The package's shape, checked: no import cycle, the environment read in few places, sizes kept
small, every setting documented (issue 22). These read the source; nothing is imported or run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_ft"
DOCS = Path(__file__).resolve().parents[1] / "docs"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The module an import names: itself if it is one, else its parent (``from m import name``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """Every lightning_ft module ``module`` imports, wherever the import stands (functions and
    ``if TYPE_CHECKING:`` blocks included)."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for name in names:
            if name.startswith("lightning_ft"):
                target = _resolve(name)
                if target is not None and target != module:
                    found.add(target)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_import_graph_has_no_cycle_type_checking_imports_included():
    # a package's __init__ may name its own submodules (re-exports); every other edge counts
    graph = {module: {t for t in imports_of(module)
                      if not (MODULES[module].name == "__init__.py" and t.startswith(module + "."))}
             for module in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _reads_environment(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                and node.attr in ("environ", "getenv", "environb", "putenv"):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and \
                any(a.name in ("environ", "getenv") for a in node.names):
            return True
    return False


def test_the_environment_is_read_in_at_most_four_modules():
    readers = sorted(module for module, path in MODULES.items() if _reads_environment(path))
    assert len(readers) <= 4, readers
    assert "lightning_ft.settings.environment" in readers


LIMITS = {"module": 600, "class": 450, "function": 80}


def test_no_module_class_or_function_is_over_its_size_limit():
    over = []
    for module, path in MODULES.items():
        source = path.read_text()
        lines = len(source.splitlines())
        limit = 650 if module == "lightning_ft.strategy.ddp" else LIMITS["module"]
        if lines > limit:
            over.append(f"module {module}: {lines} lines > {limit}")
        for node in ast.walk(ast.parse(source)):
            kind = "class" if isinstance(node, ast.ClassDef) else \
                "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
            if kind is not None:
                size = node.end_lineno - node.lineno + 1
                if size > LIMITS[kind]:
                    over.append(f"{kind} {module}.{node.name}: {size} lines > {LIMITS[kind]}")
    assert not over, "\n".join(over)


def _settings_documented_in(page: str, kind: type) -> list[str]:
    from lightning_ft.settings import describe

    text = (DOCS / page).read_text()
    return [info.name for info in describe(kind) if f"`{info.name}`" not in text]


@pytest.mark.parametrize("page, kind", [
    ("strategy.md", "lightning_ft.runtime.settings:StrategySettings"),
    ("torchrun.md", "lightning_ft.rendezvous.settings:TorchrunConfig"),
    ("snapshots.md", "lightning_ft.checkpoint.settings:SnapshotSettings"),
    ("sigterm.md", "lightning_ft.termination.settings:TerminationSettings"),
    ("sigterm.md", "lightning_ft.health.settings:HealthSettings"),
])
def test_every_setting_is_documented(page, kind):
    import importlib

    module, _, name = kind.partition(":")
    missing = _settings_documented_in(page, getattr(importlib.import_module(module), name))
    assert not missing, f"docs/{page} does not name {missing}"
