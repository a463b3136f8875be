"""The layering of docs/architecture.md (*Layering*) is true of the code: no import cycle between the package's
modules, no import from a layer into a higher one or into a sibling of its own layer, a training framework imported
only by the front-ends, and the pure logic free of Lightning and ``torch.distributed``.

Every module is parsed with ``ast``; nothing is imported. An import anywhere in a module counts: at module level, inside
a function, under ``if TYPE_CHECKING``. (What a module pulls in when it is imported is checked at run time as well:
``test_contract.py``, ``test_iface.py``, ``test_elastic_engine.py``.)
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

PACKAGE = "lightning_elan"
MIRROR = f"{PACKAGE}.pytorch_lightning."  # the classic tree: the package's own modules under a second name

# Bottom first. A unit (a sub-package or a top-level module) imports its own modules and those of lower layers, never
# a unit of its own layer: the AM and the engine, say, share what lies below them and know nothing of each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kept_attributes",),  # a user's lists, counters and small tensors put back where redone work began (pure)
    # lazy exports, the classic tree's hook, Lightning's privates, torch's privates, etcd, counts and lists in words,
    # a sharded checkpoint directory (torch only), Lightning FSDPStrategy's options read (pure)
    ("_lazy", "_classic", "compat", "torch_compat", "etcd", "words", "sharded_checkpoint", "fsdp_options"),
    # the wire contract; the batch and LR at a resize, the size a job should have, the data position, the simulator
    ("protocol", "scaling", "sizing", "data", "sim"),
    ("replication",),  # the state of a worker copied to a joiner: planning, packing, transports
    ("master", "elastic"),  # the application master; the worker's engine
    ("strategy", "accelerate", "callbacks", "launcher"),  # the front-ends inside a worker; the launcher around them
    ("cli",),  # the `elan` command line
    ("__init__", "pytorch_lightning"),  # the package's faces: `import lightning_elan` registers the strategy
)
# top-level modules that belong to a unit of another name
UNIT_OF = {"cli_client": "cli", "cli_logging": "cli", "cli_sizing": "cli", "cli_status": "cli", "cli_types": "cli"}

FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate")
FRAMEWORK_UNITS = frozenset({"strategy", "accelerate", "callbacks", "compat", "pytorch_lightning"})

# the pure logic and everything it imports of the package: scaling math, the simulator, the planner, the data position
# and the sampler's arithmetic, the wire contract, the AM's state machine (JobState and its transitions)
PURE = (
    "scaling", "sizing", "sim", "data.positions", "data.sampler", "replication.planner", "replication.shard_layout",
    "replication.sources",
    "replication.topology", "protocol.contract", "protocol.messages", "master.state", "master.sizing",
    "master.sizing_state", "master.measure", "master.enrolment", "master.standby", "master.recovery",
    "master.narration", "master.transitions", "master.heartbeats", "fsdp_options", "kept_attributes",
)
NOT_IN_PURE = (*FRAMEWORKS, "torch.distributed")


# ---- reading the package ---------------------------------------------------------------------------------------------


def package_dir() -> Path:
    """The directory of the package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


@cache
def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name; a package is named by its ``__init__.py``'s name."""
    root = package_dir()
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


@cache
def tree_of(module: str) -> ast.Module:
    """The syntax tree of ``module``."""
    path = module_files()[module]
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imported_names(tree: ast.Module, module: str, package: bool) -> Iterator[str]:
    """Every dotted name an import anywhere in ``tree`` names (``from a import b`` names ``a.b``: a module or a name
    in ``a``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = absolute_base(node, module, package)
            yield from (base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names)


def absolute_base(node: ast.ImportFrom, module: str, package: bool) -> str:
    """The absolute module a ``from … import`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    anchor = module.split(".") if package else module.split(".")[:-1]
    anchor = anchor[: len(anchor) - node.level + 1]
    return ".".join([*anchor, node.module] if node.module else anchor)


def attribute_chains(tree: ast.Module) -> Iterator[str]:
    """Dotted attribute chains the code uses (``torch.distributed.barrier``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = []
            while isinstance(node, ast.Attribute):
                parts.append(node.attr)
                node = node.value
            if isinstance(node, ast.Name):
                yield ".".join([node.id, *reversed(parts)])


def is_package(module: str) -> bool:
    """Whether ``module`` is a package (its ``__init__.py``)."""
    return module_files()[module].name == "__init__.py"


def names_used(module: str) -> set[str]:
    """What ``module`` imports or reaches through attributes, as dotted names."""
    tree = tree_of(module)
    return set(imported_names(tree, module, is_package(module))) | set(attribute_chains(tree))


def resolve(name: str) -> str | None:
    """The package module ``name`` is or lies in (the classic mirror's as the package's own); None outside it."""
    if name.startswith(MIRROR):
        name = PACKAGE + "." + name[len(MIRROR):]
    modules = module_files()
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """``module -> the package modules it imports``."""
    graph = {}
    for module in module_files():
        names = imported_names(tree_of(module), module, is_package(module))
        targets = {resolve(name) for name in names if is_ours(name)}
        graph[module] = frozenset(target for target in targets if target and target != module)
    return graph


def is_ours(name: str) -> bool:
    """Whether ``name`` is the package's or under it."""
    return name == PACKAGE or name.startswith(PACKAGE + ".")


# ---- the rules -------------------------------------------------------------------------------------------------------


def unit_of(module: str) -> str:
    """The layered unit ``module`` belongs to: its sub-package or top-level module (``__init__`` for the package)."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else UNIT_OF.get(parts[1], parts[1])


def layer_of(unit: str) -> int:
    """The index of ``unit``'s layer in :data:`LAYERS`, the bottom one 0."""
    return next(index for index, units in enumerate(LAYERS) if unit in units)


def cycles(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def layer_breaches(graph: dict[str, frozenset[str]]) -> list[str]:
    """Every import into a higher layer or into another unit of the same layer, as a sentence."""
    breaches = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            source_unit, target_unit = unit_of(module), unit_of(target)
            if source_unit != target_unit and layer_of(target_unit) >= layer_of(source_unit):
                breaches.append(f"{module} ({source_unit}, layer {layer_of(source_unit)}) imports {target} "
                                f"({target_unit}, layer {layer_of(target_unit)})")
    return breaches


def reached_from(starts: Iterable[str], graph: dict[str, frozenset[str]]) -> set[str]:
    """``starts`` and every package module they import, directly or not."""
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def uses_of(modules: Iterable[str], forbidden: tuple[str, ...]) -> list[str]:
    """``module: name`` for each forbidden name (or a name under it) the modules import or use."""
    return sorted(f"{module}: {name}" for module in modules for name in names_used(module)
                  if any(name == bad or name.startswith(bad + ".") for bad in forbidden))


def modules_under(entry: str) -> list[str]:
    """The package modules an entry of :data:`PURE` names: one module, or every module of a sub-package."""
    name = f"{PACKAGE}.{entry}"
    return [module for module in module_files() if module == name or module.startswith(name + ".")]


# ---- the tests -------------------------------------------------------------------------------------------------------


def test_every_unit_of_the_package_has_one_layer() -> None:
    placed = [unit for units in LAYERS for unit in units]
    units = {unit_of(module) for module in module_files()}

    assert len(placed) == len(set(placed))
    assert units == set(placed), f"place {sorted(units - set(placed))} in LAYERS; drop {sorted(set(placed) - units)}"


def test_no_import_cycle_between_modules() -> None:
    found = cycles(import_graph())

    assert not found, "modules that import each other: " + "; ".join(", ".join(cycle) for cycle in found)


def test_no_import_into_a_higher_layer_or_a_sibling() -> None:
    breaches = layer_breaches(import_graph())

    assert not breaches, "\n".join(breaches)


def test_only_the_front_ends_import_a_training_framework() -> None:
    others = [module for module in module_files() if unit_of(module) not in FRAMEWORK_UNITS]
    found = uses_of(others, FRAMEWORKS)

    assert not found, "\n".join(found)


def test_pure_logic_imports_neither_lightning_nor_torch_distributed() -> None:
    named = {entry: modules_under(entry) for entry in PURE}
    pure = [module for modules in named.values() for module in modules]
    found = uses_of(sorted(reached_from(pure, import_graph())), NOT_IN_PURE)

    assert [entry for entry, modules in named.items() if not modules] == [], "PURE names a module that is gone"
    assert not found, "\n".join(found)


def diagram_rows() -> dict[int, set[str]]:
    """The names (``cli.py`` as ``cli``, ``master/`` as ``master``) each row of docs/architecture.md's *Layering*
    diagram lists in its first column."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## Layering", 1)[1].split("```", 2)[1]
    rows: dict[int, set[str]] = {}
    row = -1
    for line in block.splitlines():
        if line[:4].strip().isdigit():
            row = int(line[:4])
        name = re.match(r"\s{0,4}(?:\d\s+)?([A-Za-z_]+)(?:\.py|/)\s", line)
        if name and not line.startswith(" " * 8):
            rows.setdefault(row, set()).add(name.group(1))
    return rows


def test_the_diagram_names_every_unit_in_its_layer() -> None:
    rows = diagram_rows()
    units = {module.split(".")[1] if "." in module else "__init__" for module in module_files()}

    assert {row: {UNIT_OF.get(name, name) for name in names} for row, names in rows.items()} == {
        row: set(layer) for row, layer in enumerate(LAYERS)}
    assert set().union(*rows.values()) == units, "the diagram lists every sub-package and top-level module"


# ---- the checks see what they must -----------------------------------------------------------------------------------


def test_imports_are_read_at_every_depth_and_relative_ones_resolved() -> None:
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a.b\n"
              "def f():\n    from .c import d\n    from .. import e\n")

    names = set(imported_names(ast.parse(source), "pkg.sub.mod", package=False))
    chains = set(attribute_chains(ast.parse("import torch\ntorch.distributed.barrier()")))

    assert names == {"typing.TYPE_CHECKING", "a.b", "pkg.sub.c.d", "pkg.e"}
    assert "torch.distributed.barrier" in chains


def test_the_graph_holds_module_and_function_level_imports() -> None:
    graph = import_graph()

    assert f"{PACKAGE}.protocol.contract" in graph[f"{PACKAGE}.master.state"]
    assert f"{PACKAGE}.launcher.run" in graph[f"{PACKAGE}.cli"]  # imported inside `elan run`'s function
    assert f"{PACKAGE}.strategy.strategy" in graph[f"{PACKAGE}.pytorch_lightning"]  # the classic mirror


def test_each_rule_catches_a_breach() -> None:
    upward = {f"{PACKAGE}.protocol.contract": frozenset({f"{PACKAGE}.replication.planner"}),
              f"{PACKAGE}.elastic.worker": frozenset({f"{PACKAGE}.master.store"})}

    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert len(layer_breaches(upward)) == 2
    assert uses_of([f"{PACKAGE}.strategy.strategy"], FRAMEWORKS)
    assert uses_of([f"{PACKAGE}.elastic.worker"], NOT_IN_PURE)
