"""Both Lightning packages from one source (:mod:`cuboid.packages`): the rewrite, ``cuboid.pytorch_lightning`` whole
and free of the unified package, ``strategy="cuboid"`` in all four registries whatever the import order, an install
with only the standalone packages, and the error when neither is there. The training runs through
``pytorch_lightning`` and ``lightning_fabric`` are tests/parallel/test_pytorch_lightning.py."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import textwrap
import types

import lightning.fabric as LF
import lightning.pytorch as L
import lightning_fabric
import pytest
import pytorch_lightning as pl
from harness import python

import cuboid
from cuboid.packages import MIRROR, installed, rewrite

REWRITES = [
    ("from lightning.pytorch.strategies import ParallelStrategy", "from pytorch_lightning.strategies import ParallelStrategy"),
    ("import lightning as L", "import pytorch_lightning as L"),
    ("    from lightning.fabric.utilities import rank_zero", "    from lightning_fabric.utilities import rank_zero"),
    ('log = logging.getLogger("lightning.pytorch.core")', 'log = logging.getLogger("pytorch_lightning.core")'),
    ("from cuboid import compat", f"from {MIRROR} import compat"),
    ("    from cuboid.checkpoint.sharded import X", f"    from {MIRROR}.checkpoint.sharded import X"),
    ('importlib.import_module("cuboid.train.job")', f'importlib.import_module("{MIRROR}.train.job")'),
    # left alone: the shared module, a variable called cuboid, paths, longer names, prose
    ("from cuboid.packages import install", "from cuboid.packages import install"),
    ('done = cuboid.get("batches_done_in_epoch", 0)', 'done = cuboid.get("batches_done_in_epoch", 0)'),
    ('skip = os.sep + "lightning" + os.sep', 'skip = os.sep + "lightning" + os.sep'),
    ("src/lightning/pytorch/trainer.py", "src/lightning/pytorch/trainer.py"),
    ("my_lightning.pytorch_thing", "my_lightning.pytorch_thing"),
    ("run python -m cuboid.export", "run python -m cuboid.export"),
]  # fmt: skip


@pytest.mark.parametrize("source, expected", REWRITES)
def test_the_rewrite_maps_module_names_as_lightnings_own_build_does(source: str, expected: str) -> None:
    assert rewrite(source) == expected


@pytest.mark.parametrize("line", ["import lightning", "from lightning import Trainer", "import cuboid.checkpoint"])
def test_an_import_the_rewrite_cannot_carry_over_is_refused_by_file_and_line(line: str) -> None:
    with pytest.raises(ImportError, match=r"where\.py:2 .*standalone build"):
        rewrite(f"x = 1\n{line}\n", "where.py")


def _modules() -> list[str]:
    names = ["cuboid", "cuboid.models", "cuboid.conf"]
    for package in ("cuboid", "cuboid.models"):
        path = importlib.import_module(package).__path__
        names += [
            m.name for m in pkgutil.walk_packages(path, package + ".") if not m.name.startswith("cuboid.packages")
        ]
    return sorted(n for n in set(names) if not n.endswith(".__main__"))  # `python -m` doors run at import


def test_every_module_of_cuboid_has_a_twin_built_on_the_standalone_packages_alone() -> None:
    """Each module imports under ``cuboid.pytorch_lightning``, and nothing in any of them (a class, a function or
    a module it holds) comes from ``lightning.pytorch`` or ``lightning.fabric``: their twins come from
    ``pytorch_lightning`` and ``lightning_fabric`` instead, and ``cuboid``'s own from the mirror."""
    mixed: list[str] = []
    names = _modules()
    assert len(names) > 80 and "cuboid.strategy" in names and "cuboid.models.lm" in names
    for name in names:
        twin = importlib.import_module(MIRROR + name[len("cuboid") :])
        assert twin.__file__ == importlib.import_module(name).__file__  # the same source file, its lines
        for attr, value in vars(twin).items():
            home = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
            if not isinstance(home, str) or not (inspect.isclass(value) or callable(value) or inspect.ismodule(value)):
                continue
            if home.startswith(("lightning.", "cuboid.")) and not home.startswith((MIRROR, "cuboid.packages")):
                mixed.append(f"{twin.__name__}.{attr} from {home}")
    assert not mixed, mixed[:20]


def test_the_twins_are_the_standalone_packages_own_kinds() -> None:
    cpl = importlib.import_module(MIRROR)
    assert issubclass(cpl.CuboidStrategy, pl.strategies.ParallelStrategy)
    assert not issubclass(cpl.CuboidStrategy, L.strategies.Strategy)
    assert issubclass(cpl.CuboidPrecision, pl.plugins.Precision)
    assert issubclass(cpl.fabric.CuboidStrategy, lightning_fabric.strategies.ParallelStrategy)
    assert issubclass(cpl.models.CausalLM, pl.LightningModule)
    assert issubclass(cpl.CuboidMonitor, pl.Callback)
    assert cpl.CuboidStrategy.__qualname__ == cuboid.CuboidStrategy.__qualname__
    # tracebacks and inspect show the real file, at the real lines
    assert inspect.getsourcelines(cpl.CuboidStrategy)[1] == inspect.getsourcelines(cuboid.CuboidStrategy)[1]


def test_strategy_cuboid_builds_each_packages_own_strategy_with_its_arguments() -> None:
    cpl = importlib.import_module(MIRROR)
    kinds = {
        L.Trainer: cuboid.CuboidStrategy,
        pl.Trainer: cpl.CuboidStrategy,
        LF.Fabric: cuboid.fabric.CuboidStrategy,
        lightning_fabric.Fabric: cpl.fabric.CuboidStrategy,
    }
    for door, kind in kinds.items():
        extra = {"logger": False} if door in (L.Trainer, pl.Trainer) else {}
        built = door(strategy="cuboid", accelerator="cpu", devices=1, **extra).strategy
        assert type(built) is kind, (door, type(built))
    given = cpl.CuboidStrategy(tensor_parallel=2, checkpoint_format="full", defer_reductions="all")
    trainer = pl.Trainer(strategy=given, accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy is given and given.checkpointer.format == "full" and given.deferred.mode == "all"


SCRIPT = """
import sys
{block}
{first}
import cuboid
{then}
print("package:", cuboid.packages.install())
{check}
print("lightning imported:", sys.modules.get("lightning") is not None)
"""


def _run(block: str = "", first: str = "", then: str = "", check: str = "") -> str:
    source = textwrap.dedent(SCRIPT).format(block=block, first=first, then=then, check=check)
    ran = python([sys.executable, "-c", source], fresh=True)  # a fresh interpreter: its own import order
    assert ran.returncode == 0, ran.stdout + ran.stderr
    return ran.stdout


@pytest.mark.slow
def test_registered_whichever_package_comes_first_and_with_the_standalone_ones_alone() -> None:
    """``import cuboid`` before ``pytorch_lightning`` and ``lightning_fabric``: they are registered as they come.
    With ``lightning`` absent (set to None in ``sys.modules``, as a missing install reads), ``cuboid`` is the
    standalone build under its own name, and a Trainer with ``strategy="cuboid"`` never imports ``lightning``."""
    check = (
        "from pytorch_lightning.strategies import StrategyRegistry\n"
        "from lightning_fabric.strategies import STRATEGY_REGISTRY\n"
        "assert 'cuboid' in StrategyRegistry and 'cuboid' in STRATEGY_REGISTRY\n"
        "import pytorch_lightning as pl\n"
        "t = pl.Trainer(strategy='cuboid', accelerator='cpu', devices=1, logger=False)\n"
        "print('strategy:', type(t.strategy).__module__)\n"
    )
    check += (
        "try:\n    pl.Trainer(strategy=cuboid.CuboidStrategy(), accelerator='cpu', devices=1)\n"
        "except TypeError as err:\n    print('refused:', 'cuboid.pytorch_lightning.CuboidStrategy' in str(err))\n"
    )  # the other package's twin, refused by the door guarded as pytorch_lightning came
    out = _run(then="import pytorch_lightning, lightning_fabric", check=check)
    assert (
        "package: lightning\nstrategy: cuboid.pytorch_lightning.strategy\nrefused: True\nlightning imported: True"
        in out
    )
    alone = check + "assert cuboid.CuboidStrategy is cuboid.pytorch_lightning.CuboidStrategy\n"
    alone += "from cuboid.checkpoint import read_model_weights\nimport cuboid.pytorch_lightning.checkpoint as c\n"
    alone += "assert read_model_weights is c.read_model_weights\n"
    out = _run(block="sys.modules['lightning'] = None", check=alone)
    assert "package: pytorch_lightning\nstrategy: cuboid.pytorch_lightning.strategy\nlightning imported: False" in out


def test_with_neither_package_the_import_names_both() -> None:
    source = "import sys\nsys.modules['lightning'] = sys.modules['pytorch_lightning'] = None\nimport cuboid\n"
    ran = python([sys.executable, "-c", source], fresh=True)
    assert ran.returncode != 0
    assert "neither of its packages is installed: no `lightning` and no `pytorch_lightning`" in ran.stderr
    assert "pip install lightning" in ran.stderr
    assert installed() == ("lightning", "pytorch_lightning")


def test_a_cuboid_strategy_of_the_other_package_is_refused_with_the_twin_named() -> None:
    """``pl.Trainer(strategy=cuboid.CuboidStrategy())`` as the README's import suggests (issue 66): Cuboid's own
    ``TypeError`` naming ``cuboid.pytorch_lightning.CuboidStrategy`` and ``strategy="cuboid"``, not the package's
    "invalid strategy name"; and the other way round, and for Fabric's two packages. Each package's own twin and
    its strategies of other kinds pass as before."""
    cpl = importlib.import_module(MIRROR)
    importlib.import_module(f"{MIRROR}.fabric")
    importlib.import_module("cuboid.fabric")
    wrong = {
        pl.Trainer: (cuboid.CuboidStrategy, "cuboid.pytorch_lightning.CuboidStrategy(...)"),
        L.Trainer: (cpl.CuboidStrategy, "cuboid.CuboidStrategy(...)"),
        lightning_fabric.Fabric: (cuboid.fabric.CuboidStrategy, "cuboid.pytorch_lightning.fabric.CuboidStrategy(...)"),
        LF.Fabric: (cpl.fabric.CuboidStrategy, "cuboid.fabric.CuboidStrategy(...)"),
    }
    for door, (kind, twin) in wrong.items():
        with pytest.raises(TypeError) as refused:
            door(strategy=kind(), accelerator="cpu", devices=1)
        assert f"Pass {twin} instead" in str(refused.value) and 'strategy="cuboid"' in str(refused.value)
    assert type(pl.Trainer(strategy=cpl.CuboidStrategy(), accelerator="cpu", devices=1, logger=False).strategy) is (
        cpl.CuboidStrategy
    )
    assert (
        type(pl.Trainer(strategy="ddp", accelerator="cpu", devices=1, logger=False).strategy).__name__ == "DDPStrategy"
    )


def test_the_doors_cuboid_guards_are_the_connectors_their_trainers_build_by_keyword() -> None:
    """The private names ``cuboid.packages.doors`` wraps: each package's ``_AcceleratorConnector`` and
    ``_Connector``, built by the Trainer and Fabric with ``strategy=`` by keyword (what the guard reads)."""
    import inspect

    from cuboid.packages.doors import CONNECTORS

    for name, (attribute, _, _) in CONNECTORS.items():
        cls = getattr(importlib.import_module(name), attribute)
        assert getattr(cls.__init__, "__cuboid_door__", False), name
        assert "strategy" in inspect.signature(cls.__init__).parameters
    for module in ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer"):
        source = inspect.getsource(importlib.import_module(module).Trainer.__init__)
        assert "_AcceleratorConnector(" in source and "strategy=strategy," in source
    for module in ("lightning.fabric.fabric", "lightning_fabric.fabric"):
        source = inspect.getsource(importlib.import_module(module).Fabric.__init__)
        assert "_Connector(" in source and "strategy=strategy," in source
