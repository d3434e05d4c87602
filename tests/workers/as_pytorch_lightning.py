"""Runs another worker as a project written against the standalone packages: ``pytorch_lightning`` and
``lightning_fabric`` where the worker says ``lightning.pytorch``, ``lightning.fabric`` or ``import lightning as L``,
and ``cuboid.pytorch_lightning`` where it says ``cuboid``. The worker and the test modules it imports from
``tests/`` are read through :func:`cuboid.packages.rewrite`, as Lightning's CI runs its own tests against its
standalone build. What the worker leaves records the classes it ran (the Trainer's, Fabric's, the strategy's).

Usage: as_pytorch_lightning.py WORKER [ARGS ...]   (under torchrun, or from the suite's fork server)
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytorch_lightning  # noqa: F401  (imported before cuboid: the registries are filled afterwards, on import)

import cuboid  # noqa: F401  (the finders: cuboid.pytorch_lightning)
from cuboid.packages import rewrite
from cuboid.packages.mirror import RewritingLoader

HERE = Path(__file__).resolve().parent
LOCAL = (HERE, HERE.parent)  # tests/workers, tests: where the workers' own modules are


class Local(importlib.abc.MetaPathFinder):
    """The test modules next to the worker, rewritten as it is."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if "." in fullname:
            return None
        for folder in LOCAL:
            source = folder / f"{fullname}.py"
            if source.is_file():
                return importlib.util.spec_from_file_location(
                    fullname, source, loader=RewritingLoader(fullname, str(source))
                )
        return None


def main() -> None:
    worker = Path(sys.argv[1]).resolve()
    for name in [n for n, m in sys.modules.items() if Path(getattr(m, "__file__", None) or "/").parent in LOCAL]:
        del sys.modules[name]  # none should be there; a rewritten copy if one were
    sys.meta_path.insert(0, Local())
    sys.argv = [str(worker), *sys.argv[2:]]
    sys.path[0] = str(worker.parent)
    code = compile(rewrite(worker.read_text(), str(worker)), str(worker), "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__file__, module.__builtins__ = str(worker), builtins
    sys.modules["__main__"] = module
    exec(code, module.__dict__)


if __name__ == "__main__":
    main()
