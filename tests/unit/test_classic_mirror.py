"""The classic ``pytorch_lightning`` tree (``lightning_elan.pytorch_lightning``): the import rewrite, the mirrored
classes' bases and shared modules, source and pickling, the list of mirrored modules, and the registration of "elan"
with both Lightning packages in either import order."""

from __future__ import annotations

import ast
import inspect
import os
import pickle
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import lightning.pytorch as lp
import pytest
import pytorch_lightning as pl

import lightning_elan
import lightning_elan.pytorch_lightning as classic
import lightning_elan.strategy.strategy as original_strategy
from lightning_elan import _classic
from lightning_elan._classic import MIRROR_ROOT, MIRRORED, ImportRewriter, MirrorError
from lightning_elan.elastic.worker import ElasticWorker
from lightning_elan.scaling.batch import ScalingDecision

PACKAGE_DIR = Path(lightning_elan.__file__).resolve().parent
MIRROR = f"{MIRROR_ROOT}.strategy.strategy"


def rewrite(source: str, module: str = "lightning_elan.callbacks.hybrid", is_package: bool = False) -> str:
    tree = ImportRewriter(module, is_package).visit(ast.parse(textwrap.dedent(source)))
    return ast.unparse(ast.fix_missing_locations(tree))


# ---------------------------------------------------------------------- the rewrite


@pytest.mark.parametrize(("source", "expected"), [
    ("from lightning.pytorch.callbacks import Callback", "from pytorch_lightning.callbacks import Callback"),
    ("import lightning.pytorch as pl", "import pytorch_lightning as pl"),
    ("from lightning.fabric.utilities.seed import reset_seed",
     "from lightning_fabric.utilities.seed import reset_seed"),
    ("from lightning.pytorch import Trainer", "from pytorch_lightning import Trainer"),
    ("from lightning_elan.callbacks.lr_ramp import ProgressiveLinearLR",
     f"from {MIRROR_ROOT}.callbacks.lr_ramp import ProgressiveLinearLR"),
    ("from .lr_ramp import ProgressiveLinearLR", f"from {MIRROR_ROOT}.callbacks.lr_ramp import ProgressiveLinearLR"),
    ("from ..scaling.lr import lr_scale", "from lightning_elan.scaling.lr import lr_scale"),
    ("from lightning_elan.scaling.lr import LRRamp", "from lightning_elan.scaling.lr import LRRamp"),
    ("import lightning_elan.compat as compat", f"import {MIRROR_ROOT}.compat as compat"),
    ("from lightning_elan import compat", f"from {MIRROR_ROOT} import compat"),
    ("from lightning_elan import compat, __version__ as v",
     f"from {MIRROR_ROOT} import compat\nfrom lightning_elan import __version__ as v"),
    ("import torch, pytorch_lightning as pl", "import torch, pytorch_lightning as pl"),
])
def test_imports_map_to_the_classic_tree(source, expected):
    assert rewrite(source) == expected


def test_imports_inside_functions_and_type_checking_blocks_are_mapped():
    source = """
        if TYPE_CHECKING:
            import lightning.pytorch as pl
        def register():
            from lightning.pytorch.strategies import StrategyRegistry
    """
    assert "lightning.pytorch" not in rewrite(source) and rewrite(source).count("pytorch_lightning") == 2


def test_relative_imports_of_a_package_resolve_from_the_package_itself():
    source = "from .strategy import ElanStrategy"
    assert rewrite(source, "lightning_elan.strategy", is_package=True) == (
        f"from {MIRROR_ROOT}.strategy.strategy import ElanStrategy"
    )


@pytest.mark.parametrize("source", [
    "import lightning.pytorch",  # binds `lightning`: the code's `lightning.pytorch.X` would stay unified
    "import lightning_elan.compat",
    "from lightning import Trainer",
    "import lightning as L",
])
def test_forms_the_rewrite_cannot_map_fail_loudly(source):
    with pytest.raises(MirrorError, match="line 1"):
        rewrite(source)


def test_the_rewritten_code_keeps_file_and_line_numbers():
    init = classic.ElanStrategy.__init__.__code__
    assert init.co_filename == original_strategy.ElanStrategy.__init__.__code__.co_filename
    assert init.co_firstlineno == original_strategy.ElanStrategy.__init__.__code__.co_firstlineno
    assert inspect.getsource(classic.ElanStrategy) == inspect.getsource(original_strategy.ElanStrategy)
    with pytest.raises(ValueError) as raised:
        classic.HybridScaling(policy="nope")
    frame = traceback.extract_tb(raised.value.__traceback__)[-1]
    # the validation lives in the shared pure core (not mirrored): the traceback points into its one source
    from lightning_elan.scaling import policy

    assert frame.filename == policy.__file__ and frame.line.startswith("raise ValueError")


# ---------------------------------------------------------------------- the mirrored classes


def test_mirrored_classes_belong_to_pytorch_lightning():
    assert issubclass(classic.ElanStrategy, pl.strategies.DDPStrategy)
    assert not issubclass(classic.ElanStrategy, lp.strategies.DDPStrategy)
    for callback in (classic.HybridScaling, classic.ProgressiveLinearLR):
        assert issubclass(callback, pl.Callback) and not issubclass(callback, lp.Callback)
    import lightning_fabric

    assert issubclass(classic.ElanEnvironment, lightning_fabric.plugins.environments.ClusterEnvironment)
    assert classic.ElanStrategy.__module__ == MIRROR and classic.ElanStrategy is not lightning_elan.ElanStrategy


def test_mirrored_modules_use_each_other_and_share_the_pure_modules():
    strategy_module = sys.modules[MIRROR]
    hybrid_module = sys.modules[f"{MIRROR_ROOT}.callbacks.hybrid"]
    assert strategy_module.ElasticWorker is ElasticWorker is original_strategy.ElasticWorker
    assert hybrid_module.ScalingDecision is ScalingDecision
    assert hybrid_module.ProgressiveLinearLR is classic.ProgressiveLinearLR
    assert strategy_module.compat is sys.modules[f"{MIRROR_ROOT}.compat"]
    assert strategy_module.compat.ModelCheckpoint is pl.callbacks.ModelCheckpoint
    assert issubclass(strategy_module.compat.LeaveFit, pl.utilities.exceptions._TunerExitException)
    assert strategy_module.ElanEnvironment is classic.ElanEnvironment
    shared = [name for name in sys.modules if name.startswith(MIRROR_ROOT + ".")]
    assert {name.replace(MIRROR_ROOT, "lightning_elan", 1) for name in shared} <= MIRRORED


def test_a_mirrored_package_serves_only_mirrored_submodules():
    assert sys.modules[f"{MIRROR_ROOT}.callbacks"].__path__ == []
    with pytest.raises(ModuleNotFoundError):
        __import__(f"{MIRROR_ROOT}.scaling")


def test_mirrored_instances_and_classes_pickle_by_module_path():
    scaling = classic.HybridScaling(policy="weak")
    clone = pickle.loads(pickle.dumps(scaling))
    assert type(clone) is classic.HybridScaling and clone.policy == "weak"
    assert pickle.loads(pickle.dumps(classic.ElanStrategy)) is classic.ElanStrategy
    assert pickle.loads(pickle.dumps(classic.ElanEnvironment(2, 3))).world_size() == 3


# ---------------------------------------------------------------------- the list of mirrored modules


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, module: str) -> set[str]:
    """Absolute names of the modules ``module`` imports at run time (``if TYPE_CHECKING:`` blocks left out)."""
    rewriter = ImportRewriter(module, path.name == "__init__.py")
    names: set[str] = set()
    pending: list[ast.AST] = [ast.parse(path.read_text())]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = rewriter._absolute(node)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        pending.extend(ast.iter_child_nodes(node))
    return names


def test_mirrored_is_exactly_the_modules_that_import_lightning():
    """Every module that imports Lightning (or a mirrored module) is mirrored with its parent packages, and none
    other; the shared modules a mirrored one imports live outside the mirrored packages."""
    sources = {_module_name(path): path for path in PACKAGE_DIR.rglob("*.py")}
    sources = {name: path for name, path in sources.items()
               if name not in ("lightning_elan", MIRROR_ROOT) and not name.startswith(MIRROR_ROOT + ".")}
    imports = {name: _runtime_imports(path, name) for name, path in sources.items()}
    needed = {name for name, used in imports.items()
              if any(u == "lightning" or u.startswith("lightning.") for u in used)}
    while True:
        grown = needed | {name for name, used in imports.items() if used & needed}
        grown |= {parent for name in grown for parent in _parents(name)}
        if grown == needed:
            break
        needed = grown
    assert needed == MIRRORED
    for name in MIRRORED:
        for used in imports[name]:
            if used.startswith("lightning_elan.") and used not in MIRRORED and used in sources:
                assert not any(parent in MIRRORED for parent in _parents(used)), f"{name} imports {used}"


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


# ---------------------------------------------------------------------- registration, in a fresh interpreter

REGISTRATION = """
import sys
def unified_loaded():
    return sorted(m for m in sys.modules if m == "lightning" or m.startswith("lightning."))
{first}
{second}
assert not unified_loaded(), unified_loaded()
from pytorch_lightning.strategies import StrategyRegistry
assert StrategyRegistry["elan"]["strategy"].__module__ == "{mirror}", StrategyRegistry["elan"]
import lightning.pytorch as L
assert L.strategies.StrategyRegistry["elan"]["strategy"].__module__ == "lightning_elan.strategy.strategy"
assert "elan" in StrategyRegistry
import pickle
scaling = pickle.loads(bytes.fromhex(sys.argv[1]))
assert type(scaling).__module__ == "{mirror_root}.callbacks.hybrid" and scaling.policy == "hybrid"
print("ok")
"""


@pytest.mark.parametrize("order", [("import lightning_elan", "import pytorch_lightning"),
                                   ("import pytorch_lightning", "import lightning_elan")])
def test_import_lightning_elan_registers_elan_with_pytorch_lightning_in_either_order(order):
    """Registered with the classic tree without importing ``lightning.pytorch``, whichever comes first; the unified
    registry keeps its own class; a mirrored instance unpickles in a process that never imported the mirror."""
    code = REGISTRATION.format(first=order[0], second=order[1], mirror=MIRROR, mirror_root=MIRROR_ROOT)
    pickled = pickle.dumps(classic.HybridScaling(policy="hybrid")).hex()
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_DIR.parent)}
    result = subprocess.run([sys.executable, "-c", code, pickled], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.parametrize("first", ["from lightning_elan.strategy.fsdp import ElanFSDPStrategy",
                                   "from lightning_elan.strategy.strategy import ElanStrategy"])
def test_a_strategy_module_imported_before_lightning_registers_both_strategies(first):
    """A script whose first import is a strategy module (before any Lightning): that module imports Lightning, whose
    import registers the strategies — before, with the FSDP module first, that registration met it half imported and
    raised (``partially initialized module 'lightning_elan.strategy.fsdp' has no attribute
    'register_elan_fsdp_strategy'``, found by the classic probe of test_classic_pytorch_lightning.py)."""
    code = (f"{first}\nfrom lightning.pytorch.strategies import StrategyRegistry\n"
            "assert 'elan' in StrategyRegistry and 'elan_fsdp' in StrategyRegistry\nprint('ok')")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_DIR.parent)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_import_lightning_elan_alone_imports_no_lightning():
    code = "import sys, lightning_elan; print(sorted(m for m in sys.modules if 'lightning' in m.split('.')[0]))"
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_DIR.parent)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    loaded = [name for name in eval(result.stdout) if not name.startswith(("lightning_elan", "__editable__"))]
    assert loaded == [], loaded
    assert not any(name.startswith("lightning_elan._classic") for name in eval(result.stdout))


def test_install_is_idempotent():
    before = len(sys.meta_path)
    _classic.install()
    assert len(sys.meta_path) == before
