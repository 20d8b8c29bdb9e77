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


LIMITS = {"module": 550, "class": 400, "function": 60}


def test_no_module_class_or_function_is_over_its_size_limit():
    over = []
    for module, path in MODULES.items():
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > LIMITS["module"]:
            over.append(f"module {module}: {lines} lines > {LIMITS['module']}")
        for node in ast.walk(ast.parse(source)):
            kind = "class" if isinstance(node, ast.ClassDef) else \
                "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
            if kind is not None:
                size = node.end_lineno - node.lineno + 1
                if size > LIMITS[kind]:
                    over.append(f"{kind} {module}.{node.name}: {size} lines > {LIMITS[kind]}")
    assert not over, "\n".join(over)


def test_at_most_three_type_ignores():
    ignores = [f"{module}:{number}" for module, path in MODULES.items()
               for number, line in enumerate(path.read_text().splitlines(), 1) if "# type: ignore" in line]
    assert len(ignores) <= 3, ignores


#: the package's layers, bottom first (ARCHITECTURE.md): a package imports only packages of its
#: own layer or below, and, within a layer, only those listed before it
LAYERS = (
    ("foundation", ("_clock", "_text", "_validation", "_lazy", "exit_codes", "sockets", "private_dirs", "_torch",
                    "deadlines", "settings", "_logging", "_lightning", "process")),
    ("records", ("schema", "events", "health", "store")),
    ("protocol and state", ("rendezvous", "checkpoint")),
    ("paths", ("termination", "stragglers", "failover")),
    ("entry points", ("launch", "report", "cli")),
    ("runtime", ("runtime",)),
    ("surfaces", ("strategy", "data", "")),
)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_has_a_layer():
    placed = {name for _, names in LAYERS for name in names}
    assert {_package(module) for module in MODULES} <= placed, sorted({_package(m) for m in MODULES} - placed)


def test_packages_import_only_their_own_layer_or_below():
    order = {name: index for index, name in enumerate(name for _, names in LAYERS for name in names)}
    upward = sorted(f"{module} -> {target}" for module in MODULES for target in imports_of(module)
                    if _package(target) != _package(module) and order[_package(target)] > order[_package(module)])
    assert not upward, "\n".join(upward)


def test_the_rendezvous_protocol_knows_neither_lightning_nor_sockets():
    """rendezvous/ is protocol over a store it is handed: no Lightning, no socket of its own (TCP
    stores are store/'s, the fail-over's listeners failover/'s)."""
    for module, path in MODULES.items():
        if _package(module) != "rendezvous":
            continue
        tree = ast.parse(path.read_text())
        names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] in ("lightning", "socketserver")], (module, names)
        opened = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                  and isinstance(node.value, ast.Name) and node.value.id == "socket"
                  and node.attr in ("socket", "create_server", "create_connection")]
        assert not opened, (module, opened)


#: the only modules that may name private Lightning or torch API
PRIVATE_API_MODULES = ("lightning_ft._lightning", "lightning_ft._torch")


def private_api_uses(path: Path) -> list[str]:
    """Private names of torch or Lightning a module uses: imported (``from torch.x import _y``,
    ``from torch import _y``, a ``_module`` in the path) or read off an imported torch/Lightning
    module (``dist.distributed_c10d._world``, ``torch._tensor_classes``)."""
    tree = ast.parse(path.read_text())
    external = ("torch", "lightning", "lightning_utilities")
    aliases: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in external:
                    aliases.add((alias.asname or alias.name).split(".")[0])
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in external:
            if any(part.startswith("_") and not part.startswith("__") for part in node.module.split(".")):
                found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            aliases |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append(ast.unparse(node))
    return found


def test_private_torch_and_lightning_names_only_in_their_two_places():
    uses = {module: found for module, path in MODULES.items()
            if not module.startswith(PRIVATE_API_MODULES) and (found := private_api_uses(path))}
    assert not uses, uses


def test_the_private_name_finder_finds_them(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch.distributed as dist\nfrom torch import _weights_only_unpickler\n"
                      "from lightning.pytorch.trainer.setup import _log_device_info\n"
                      "x = dist.distributed_c10d._world\ny = dist.get_rank()\n")
    assert sorted(private_api_uses(sample)) == sorted([
        "torch._weights_only_unpickler", "lightning.pytorch.trainer.setup._log_device_info",
        "dist.distributed_c10d._world"])


def _settings_documented_in(page: str, kind: type, tier: str) -> list[str]:
    from lightning_ft.settings import describe

    text = (DOCS / page).read_text()
    return [info.name for info in describe(kind) if info.tier == tier and f"`{info.name}`" not in text]


SETTINGS_PAGES = [
    ("strategy.md", "lightning_ft.runtime.settings:StrategySettings"),
    ("torchrun.md", "lightning_ft.rendezvous.settings:TorchrunConfig"),
    ("snapshots.md", "lightning_ft.checkpoint.settings:SnapshotSettings"),
    ("sigterm.md", "lightning_ft.termination.settings:TerminationSettings"),
    ("sigterm.md", "lightning_ft.health.settings:HealthSettings"),
]


@pytest.mark.parametrize("page, kind", SETTINGS_PAGES)
def test_every_setting_is_documented(page, kind):
    """Public settings on their component's page, advanced ones on docs/advanced-settings.md."""
    import importlib

    module, _, name = kind.partition(":")
    settings = getattr(importlib.import_module(module), name)
    missing = _settings_documented_in(page, settings, "public")
    assert not missing, f"docs/{page} does not name {missing}"
    missing = _settings_documented_in("advanced-settings.md", settings, "advanced")
    assert not missing, f"docs/advanced-settings.md does not name {missing}"


def test_the_internal_constants_are_documented():
    from lightning_ft.runtime.settings import HangSettings
    from lightning_ft.settings import Timeouts
    from lightning_ft.settings.fields import internal_constants

    text = (DOCS / "advanced-settings.md").read_text()
    missing = [info.name for kind in (Timeouts, HangSettings) for info in internal_constants(kind)
               if f"`{info.name}`" not in text]
    assert not missing, missing
