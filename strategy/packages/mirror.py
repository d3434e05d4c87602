"""``cuboid.pytorch_lightning``: Cuboid built for the standalone packages at import time, as Lightning builds them.

Lightning keeps one source, ``lightning/pytorch`` and ``lightning/fabric``, and makes ``pytorch_lightning`` and
``lightning_fabric`` from it by rewriting module names in the text (``.actions/assistant.py``,
``create_mirror_package``). The two packages have their own classes: a ``pytorch_lightning.Trainer`` takes only a
``pytorch_lightning`` strategy. Cuboid does the same rewrite, when a module is imported rather than when a wheel is
built: :class:`MirrorFinder` serves ``cuboid.pytorch_lightning.X`` from the source of ``cuboid.X`` with
``lightning.pytorch`` read as ``pytorch_lightning``, ``lightning.fabric`` as ``lightning_fabric`` and ``cuboid.`` as
``cuboid.pytorch_lightning.`` (:func:`rewrite`). Line numbers and file names stay the source's, so tracebacks and
``inspect`` point at the real files. ``cuboid.packages`` itself is never mirrored: one finder, one registration.

Where ``lightning`` is not installed at all, the finder also serves ``cuboid.X`` as the very module
``cuboid.pytorch_lightning.X`` (``alias=True``), so ``from cuboid import CuboidStrategy`` works in either install.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from types import ModuleType
from typing import Any

ROOT = "cuboid"
MIRROR = "cuboid.pytorch_lightning"
_NEVER = ("cuboid.packages",)  # names every copy shares: the finder and the registration run once

# Lightning's own rule (``_replace_imports``): a module name not inside a longer name or a path.
_NAMES = (
    (re.compile(r"(?<![\w./@])lightning\.pytorch(?![\w/])"), "pytorch_lightning"),
    (re.compile(r"(?<![\w./@])lightning\.fabric(?![\w/])"), "lightning_fabric"),
    (re.compile(r"^(\s*)import lightning as (\w+)", re.M), r"\1import pytorch_lightning as \2"),
    # Cuboid's own names: in imports and at the start of a string (``import_module("cuboid.train.job")``) only,
    # for ``cuboid`` is also a name the code gives its variables (``cuboid.get("dp")``, a checkpoint's entry).
    (re.compile(r"^(\s*)from cuboid import ", re.M), rf"\1from {MIRROR} import "),
    (re.compile(r"^(\s*)from cuboid\.(?!packages\b|pytorch_lightning\b)", re.M), rf"\1from {MIRROR}."),
    (re.compile(r"""(["'])cuboid\.(?!packages\b|pytorch_lightning\b)(?=[A-Za-z_])"""), rf"\1{MIRROR}."),
)
_LEFT = re.compile(r"^\s*(import lightning\b(?!\.(pytorch|fabric)\b)|from lightning import |import cuboid\b)", re.M)


def rewrite(source: str, origin: str = "<source>") -> str:
    """``source`` as the standalone packages read it: ``lightning.pytorch`` -> ``pytorch_lightning``,
    ``lightning.fabric`` -> ``lightning_fabric``, ``import lightning as L`` -> ``import pytorch_lightning as L``,
    and ``from cuboid.X import`` or a string ``"cuboid.X..."`` -> ``cuboid.pytorch_lightning.X`` (``cuboid.packages``
    excepted). Raises ``ImportError`` on an import this cannot carry over (``import lightning`` bare, ``from
    lightning import ...``, ``import cuboid...``), naming ``origin``: Cuboid's source writes none of them."""
    for pattern, replacement in _NAMES:
        source = pattern.sub(replacement, source)
    left = _LEFT.search(source)
    if left is not None:
        line = source.count("\n", 0, left.start()) + 1
        raise ImportError(
            f"{origin}:{line} has an import the standalone build cannot carry over ({left.group(0).strip()!r}): "
            "write `import lightning as L`, `from lightning.pytorch import ...` or `from cuboid.X import ...`"
        )
    return source


class RewritingLoader(importlib.machinery.SourceFileLoader):
    """A source file loaded under another name, its text through :func:`rewrite` (no bytecode cache: the cached
    file would be the source's, under the source's name)."""

    def get_code(self, fullname: str) -> Any:
        text = importlib.util.decode_source(self.get_data(self.path))
        return compile(rewrite(text, self.path), self.path, "exec", dont_inherit=True)

    def get_source(self, fullname: str) -> str:
        return rewrite(importlib.util.decode_source(self.get_data(self.path)), self.path)


class _Alias(importlib.abc.Loader):
    """``cuboid.X`` as the module ``cuboid.pytorch_lightning.X`` (the import system returns what ``sys.modules``
    holds under the name once the loader has run)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.target)


def source_spec(name: str, skip: object) -> importlib.machinery.ModuleSpec | None:
    """Where ``name`` (``cuboid`` or a module below it) is, found as the import system would, without running it or
    any package above it but ``cuboid`` itself (``skip``: the finder asking, left out)."""
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__spec__", None) is not None and not name.startswith(MIRROR):
        loader = module.__spec__.loader
        if not isinstance(loader, _Alias):
            return module.__spec__
    parent, _, _ = name.rpartition(".")
    path = None
    if parent:
        above = source_spec(parent, skip)
        if above is None or above.submodule_search_locations is None:
            return None
        path = list(above.submodule_search_locations)
    for finder in sys.meta_path:
        if finder is skip or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, path)
        if spec is not None:
            return spec
    return None


class MirrorFinder(importlib.abc.MetaPathFinder):
    """Serves ``cuboid.pytorch_lightning`` and everything below it from Cuboid's own source files, rewritten; with
    ``alias``, ``cuboid.X`` too, as the same modules (an install without the unified ``lightning`` package)."""

    def __init__(self, alias: bool = False) -> None:
        self.alias = alias

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == MIRROR or fullname.startswith(MIRROR + "."):
            source = ROOT + fullname[len(MIRROR) :]
            if source.startswith(_NEVER) or source.startswith(MIRROR):
                return None  # the shared names are imported by their own name; no mirror of the mirror
            found = source_spec(source, self)
            if found is None or not isinstance(found.origin, str) or not found.origin.endswith(".py"):
                return None
            loader = RewritingLoader(fullname, found.origin)
            locations = found.submodule_search_locations
            return importlib.util.spec_from_file_location(
                fullname,
                found.origin,
                loader=loader,
                submodule_search_locations=None if locations is None else list(locations),
            )
        if self.alias and fullname.startswith(ROOT + ".") and not fullname.startswith(_NEVER):
            found = source_spec(fullname, self)
            if found is None:
                return None
            spec = importlib.machinery.ModuleSpec(fullname, _Alias(MIRROR + fullname[len(ROOT) :]))
            if found.submodule_search_locations is not None:
                spec.submodule_search_locations = list(found.submodule_search_locations)
            return spec
        return None
