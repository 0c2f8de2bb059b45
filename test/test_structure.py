"""The package's shape: which part may import which, no import cycles, files within their
size limits, and no module reaching into another's private names."""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sgl_jax"
# Lowest first: a part may import the parts before it (and itself), never one after it.
# Leaf modules of sgl_jax/ first; sgl_jax.testing (test support) may import anything.
LAYERS = (
    ("version", "import_noise", "cache", "process_maps", "sampling_fields", "json_bounds",
     "grammar", "sampling_params", "datasets", "demo"),
    ("layers",), ("parallel",), ("models",), ("tokenizer",), ("mem_cache",),
    ("model_executor",), ("scheduler",), ("speculative",), ("server_args",),
    ("training",), ("runtime",), ("entrypoints",),
    ("launch_server", "train_eagle3", "__init__"),
)
LEVEL = {part: level for level, parts in enumerate(LAYERS) for part in parts}
MAX_LINES = 600
MAX_LINES_SPECULATIVE = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The part a module belongs to: its sub-package, or its own name at the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py") if "testing" not in p.parts}


def imported(path: Path, modules: set[str]) -> set[str]:
    """The sgl_jax modules a file imports (anywhere in it: function-level imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sgl_jax"):
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = product_modules()
    return {name: imported(path, set(modules)) - {name} for name, path in modules.items()}


def test_every_part_has_a_layer():
    assert {part_of(m) for m in product_modules()} == set(LEVEL)


def test_no_part_imports_a_part_above_it():
    upward = sorted(f"{m} imports {t}" for m, targets in import_graph().items()
                    for t in targets if LEVEL[part_of(t)] > LEVEL[part_of(m)])
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    graph = import_graph()
    state: dict[str, int] = defaultdict(int)  # 0 unseen, 1 on the path, 2 done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state[target] == 1:
                cycles.append(path[path.index(target):] + [target])
            elif state[target] == 0:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if state[module] == 0:
            visit(module, [module])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("folder", ["sgl_jax", "test", "benchmark", "python"])
def test_no_private_name_is_imported_from_another_module(folder):
    private = []
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sgl_jax"):
                private += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}"
                            for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert not private, "\n".join(private)


def test_files_stay_within_their_size_limits():
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        limit = MAX_LINES_SPECULATIVE if "speculative" in path.parts else MAX_LINES
        lines = len(path.read_text().splitlines())
        if lines > limit:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines (limit {limit})")
    assert not too_long, "\n".join(too_long)


def test_speculative_file_names_are_its_own():
    """A file name in speculative/ says what it holds there: none repeats another of its own
    or one of the packages it works with (scheduler/, runtime/)."""
    def names(folder: str) -> list[str]:
        return [p.name for p in (PACKAGE / folder).rglob("*.py") if p.name != "__init__.py"]

    speculative = names("speculative")
    repeated = {name for name in speculative if speculative.count(name) > 1}
    shared = set(speculative) & set(names("scheduler") + names("runtime"))
    assert not repeated | shared, sorted(repeated | shared)
