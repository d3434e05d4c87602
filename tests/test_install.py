"""Cuboid installed as users install it: a wheel built from the sdist, in a fresh virtual environment, used from a
directory outside the clone (the clone not on ``sys.path``).

The package list in ``pyproject.toml`` is explicit (setuptools' ``package-dir`` maps three folders into one
namespace); :func:`test_pyproject_lists_every_package` keeps it complete against the tree.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PROJECT = Path(__file__).parent / "install_project"
# Folders -> the package each one is (pyproject's package-dir).
MAPPING = {"strategy": "cuboid", "models": "cuboid.models", "conf": "cuboid.conf"}


def _tree_packages() -> set[str]:
    found = set()
    for folder, package in MAPPING.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    return found


def test_pyproject_lists_every_package() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {v: k for k, v in MAPPING.items()}
    listed = set(config["packages"])
    assert listed == _tree_packages(), f"missing {_tree_packages() - listed}, stale {listed - _tree_packages()}"


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)} (rc {out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}"
    return out.stdout


def _last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def _site_dirs() -> list[str]:
    """The directories this interpreter imports installed packages from (its venv's, a conda env's or the system's,
    and the user's), whichever it runs in, without the clone: ``venv --system-site-packages`` would give the base
    interpreter's instead when this one runs in a virtual environment."""
    sites = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    dirs = {str(Path(d).resolve()) for d in sites}
    return [p for p in sys.path if p and str(Path(p).resolve()) in dirs and Path(p).is_dir()]


def _see_these_packages(python: Path, cwd: Path, env: dict[str, str]) -> None:
    """The new venv sees this interpreter's packages as plain path entries (a ``.pth`` of directory lines: the ``.pth``
    files inside them, the clone's editable install among them, are not run), behind its own."""
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd, env).strip()
    (Path(purelib) / "_suite_packages.pth").write_text("\n".join(_site_dirs()) + "\n")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    """(the venv's python, a working directory outside the clone, the environment): the wheel that ``python -m
    build`` makes from the sdist, installed without dependencies into a venv that sees this one's packages."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "src"  # a copy of the tracked files: the build leaves nothing in the clone
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    dist = tmp / "dist"
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(source)], tmp, env, timeout=600)
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp, env)
    python = venv / "bin" / "python"
    _see_these_packages(python, tmp, env)
    (wheel,) = dist.glob("cuboid-*.whl")
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], tmp, env)
    work = tmp / "work"
    shutil.copytree(PROJECT, work)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return python, work, env


@pytest.mark.slow  # the module's fixture builds and installs the wheel (about a minute)
def test_wheel_and_sdist_hold_every_package(installed: tuple[Path, Path, dict[str, str]]) -> None:
    dist = installed[1].parent / "dist"
    (wheel,) = dist.glob("cuboid-*.whl")
    (sdist,) = dist.glob("cuboid-*.tar.gz")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for package in _tree_packages():
        assert package.replace(".", "/") + "/__init__.py" in in_wheel, package
    for folder in MAPPING:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".yaml") and "__pycache__" not in path.parts:
                assert str(path.relative_to(ROOT)) in in_sdist, path
    assert "cuboid/conf/strategy/fsdp_tp.yaml" in in_wheel and "cuboid/conf/train.yaml" in in_wheel


@pytest.mark.slow  # the module's fixture builds and installs the wheel (about a minute)
def test_installed_package_imports_every_name(installed: tuple[Path, Path, dict[str, str]]) -> None:
    python, work, env = installed
    sys.path.insert(0, str(Path(__file__).parent))
    from test_public_api import PUBLIC, WINGS

    script = (
        "import importlib, json, sys, cuboid\n"
        f"names = {PUBLIC!r}\n"
        "for dotted in names:\n"
        "    module, _, name = dotted.rpartition('.')\n"
        "    assert getattr(importlib.import_module(module), name) is not None, dotted\n"
        f"for wing in {list(WINGS)!r} + ['train', 'layout', 'dryrun', 'export', 'data', 'models', 'conf']:\n"
        "    importlib.import_module('cuboid.' + wing)\n"
        "import pytorch_lightning as pl\n"  # the standalone twins, built from the wheel's files
        "import cuboid.pytorch_lightning as twin\n"
        "assert issubclass(twin.CuboidStrategy, pl.strategies.Strategy) and twin.models.CausalLM\n"
        "twin_file = twin.__file__\n"
        "print(json.dumps({'file': cuboid.__file__, 'version': cuboid.__version__, 'path': sys.path,\n"
        "                  'twin': twin_file}))\n"
    )
    seen = _last_json(_run([str(python), "-c", script], work, env))
    assert Path(seen["file"]).is_relative_to(python.parent.parent), seen["file"]  # the wheel's, not the clone's
    assert seen["twin"] == seen["file"], seen
    assert not any(Path(p).resolve() == ROOT for p in seen["path"] if p)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert seen["version"] == version


@pytest.mark.slow  # the module's fixture builds and installs the wheel (about a minute)
@pytest.mark.parametrize("module", ["cuboid.train", "cuboid.layout", "cuboid.dryrun", "cuboid.export"])
def test_installed_command_lines_answer_help(installed: tuple[Path, Path, dict[str, str]], module: str) -> None:
    python, work, env = installed
    out = _run([str(python), "-m", module, "--help"], work, env, timeout=120)
    assert ("powered by Hydra" in out and "strategy: " in out) if module == "cuboid.train" else "usage:" in out


@pytest.mark.slow
def test_a_module_outside_the_clone_trains_saves_and_resumes(installed: tuple[Path, Path, dict[str, str]]) -> None:
    python, work, env = installed
    first = _last_json(_run([str(python), "user_module.py", str(work / "run"), "4"], work, env))
    assert (
        first["steps"] == 4 and first["one_file"] and first["saved"] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    )
    assert Path(first["cuboid"]).is_relative_to(python.parent.parent) and first["strategy"] == "cuboid.strategy"
    second = _last_json(_run([str(python), "user_module.py", str(work / "run"), "6", "resume"], work, env))
    assert second["resumed_from"].endswith("epoch=0-step=4.ckpt") and second["steps"] == 6
    assert "epoch=0-step=6.ckpt" in second["saved"]


@pytest.mark.slow
def test_a_hydra_project_uses_the_installed_presets(installed: tuple[Path, Path, dict[str, str]]) -> None:
    python, work, env = installed
    seen = _last_json(_run([str(python), "hydra_project/main.py"], work, env))
    assert seen == {"steps": 3, "tp": 2, "dp_shard": 1, "strategy": "CuboidStrategy"}
