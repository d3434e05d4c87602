"""The house keeps its promises: every public name and command users had still works, and the package is laid out
as docs/architecture.md says (no module over 400 lines, no flat folder of more than 10 modules, imports that run
downward between the wings and through each wing's ``__init__``, no import circle, an ``__all__`` in every wing)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from harness import python

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "strategy"

# What users import by name: the face, and the names the README and the guide show.
PUBLIC = [
    "cuboid.CuboidStrategy",
    "cuboid.fabric.CuboidStrategy",
    "cuboid.fabric.FabricPrecision",
    "cuboid.adapters.write_peft_adapters",
    "cuboid.adapters.frozen_base_names",
    "cuboid.CuboidPrecision",
    "cuboid.Layout",
    "cuboid.LayoutError",
    "cuboid.LoaderError",
    "cuboid.PlanError",
    "cuboid.PipelineError",
    "cuboid.ContextParallelError",
    "cuboid.ExpertParallelError",
    "cuboid.experts.distribute_experts",
    "cuboid.context.ContextParallel",
    "cuboid.CheckpointDamaged",
    "cuboid.FaultTolerance",
    "cuboid.replicas.FaultTolerance",
    "cuboid.CheckpointError",
    "cuboid.PretrainedError",
    "cuboid.NonFiniteError",
    "cuboid.RunDirectoryBusy",
    "cuboid.UnevenBatchesError",
    "cuboid.PeerBatchesDiffer",
    "cuboid.CommLedger",
    "cuboid.CuboidMonitor",
    "cuboid.latest_checkpoint",
    "cuboid.read_model_weights",
    "cuboid.whole_state_dict",
    "cuboid.ray.RayCuboidStrategy",
    "cuboid.layout.Layout",
    "cuboid.layout.LayoutError",
    "cuboid.layout.main",
    "cuboid.dryrun.dry_run",
    "cuboid.export.main",
    "cuboid.callbacks.CuboidMonitor",
    "cuboid.callbacks.CommLedger",
    "cuboid.planning.plan",
    "cuboid.planning.expected",
    "cuboid.measure.CommLedger",
    "cuboid.checkpoint.CheckpointFormat",
    "cuboid.data.TokenDataModule",
    "cuboid.train.data.TokenDataModule",
    "cuboid.train.main",
    "cuboid.parallel.DataParallelBatchNorm",
    "cuboid.parallel.BufferBroadcast",
    "cuboid.models.CausalLM",
    "cuboid.models.Llama",
    "cuboid.models.LlamaConfig",
]

# The wings, lowest floor first; a wing may import only wings on a lower floor (and compat, data).
FLOORS = {
    "compat": -1,  # the door to other libraries' internals: below every wing, and imports none
    "packages": 0,  # which Lightning package is served: imported first, by cuboid/__init__ alone
    "storage": 0,  # where checkpoints and run locks lie: local, or fsspec's (s3://)
    "adapters": 0,  # PEFT's LoRA layers: names and init, read by parallel (the tp split) and checkpoint
    "data": 0,
    "dropin": 0,  # what keeps a DDP project's model whole: FSDP units fully_shard can take, DDP where sharding buys nothing
    "checkpoint": 1,
    "step": 1,
    "parallel": 2,
    "context": 2,
    "experts": 1,
    "pipeline": 3,
    "job": 3,
    "measure": 4,  # setup's fit check and the ledger: what a run holds and sends, measured while it runs
    "planning": 5,  # the offline planner; its dry run uses measure's fit count
    "base": 4,  # what both doors share (strategy/base.py, beside strategy.py)
    "fabric": 5,  # Fabric's door, beside strategy.py (the Trainer's): it uses the wings as the Trainer glue does
}
WINGS = (
    "packages",
    "storage",
    "adapters",
    "dropin",
    "parallel",
    "context",
    "experts",
    "pipeline",
    "checkpoint",
    "job",
    "step",
    "measure",
    "planning",
    "fabric",
)


def _resolve(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_imports(name: str) -> None:
    assert _resolve(name) is not None


def test_the_face_exports_what_it_lists() -> None:
    import cuboid

    assert {n for n in cuboid.__all__ if not hasattr(cuboid, n)} == set()
    assert {f"cuboid.{n}" for n in cuboid.__all__} <= set(PUBLIC)


def test_hydra_targets_resolve() -> None:
    """Every ``_target_`` in conf/ names an object that exists (the Hydra twins of the public names)."""
    import yaml

    targets = set()
    for path in (ROOT / "conf").rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            stack = [doc]
            while stack:
                node = stack.pop()
                if isinstance(node, dict):
                    if isinstance(node.get("_target_"), str):
                        targets.add(node["_target_"])
                    stack.extend(node.values())
                elif isinstance(node, list):
                    stack.extend(node)
    assert "cuboid.CuboidStrategy" in targets and "cuboid.train.data.TokenDataModule" in targets
    for target in targets:
        assert _resolve(target) is not None, target


def test_the_data_module_keeps_its_earlier_name() -> None:
    """The main job's data module lives with the main job (``cuboid.train.data``); configs and scripts that name it
    ``cuboid.data`` get the very same objects."""
    import cuboid.data
    import cuboid.train.data

    assert cuboid.data.__all__ and all(
        getattr(cuboid.data, n) is getattr(cuboid.train.data, n) for n in cuboid.data.__all__
    )


def test_the_data_module_imports_no_hydra() -> None:
    """``from cuboid.data import TokenDataModule`` in a project of one's own loads neither Hydra nor the main job
    (:mod:`cuboid.train` hands the job's names on when first asked for them)."""
    code = (
        "import sys; from cuboid.data import TokenDataModule; import cuboid.train; "
        "print(sorted(m for m in ('hydra', 'omegaconf', 'cuboid.train.job') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize(
    "command, usage",
    [
        (["-m", "cuboid.train", "--help"], "train is powered by Hydra"),
        ([str(ROOT / "scripts" / "train.py"), "--help"], "== Configuration groups =="),
        (["-m", "cuboid.layout", "--help"], "usage: python -m cuboid.layout"),
        (["-m", "cuboid.dryrun", "--help"], "usage: python -m cuboid.dryrun"),
        (["-m", "cuboid.export", "--help"], "usage: python -m cuboid.export"),
        ([str(ROOT / "scripts" / "bench.py"), "--help"], "--suite NAME"),
        ([str(ROOT / "scripts" / "bench.py"), "--suite", "pipeline", "--help"], "usage:"),
    ],
)
def test_every_command_line_answers_help(command: list[str], usage: str) -> None:
    out = python([sys.executable, *command], timeout=120)
    assert out.returncode == 0 and usage in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("script, usage", [("bench_gpu.sh", "--tiny"), ("gpu_wheels.sh", "40 MB")])
def test_every_shell_script_answers_help(script: str, usage: str) -> None:
    """The GPU check and its wheels' companion say what they do, and do nothing else, on --help."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and usage in out.stdout, out.stdout + out.stderr


def test_each_part_of_the_gpu_check_ends_within_300_seconds_of_limits() -> None:
    """The GPU check runs as two commands, each inside 300 s however its checks go (a device machine's slot is 15
    minutes, start-up included: a rerun must fit): each part's limits, the install's and the kill margins summed."""
    import re

    text = (ROOT / "scripts" / "bench_gpu.sh").read_text()
    kill = int(re.search(r"^KILL=(\d+)", text, re.M).group(1))
    install = [int(n) for n in re.findall(r"^    check install (\d+) ", text, re.M)]
    parts = text.split('if [ "$PART" = 1 ]; then')[1].split("\nfi\n")[0].split("\nelse\n")
    assert len(install) == 1 and len(parts) == 2
    for part in parts:
        limits = [int(n) for n in re.findall(r'^    check (?:"[^"]*"|\S+) (\d+) ', part, re.M)]
        assert limits and install[0] + kill + sum(limits) + kill * len(limits) <= 300, (limits, install, kill)


def test_unknown_planner_argument_names_the_keys() -> None:
    out = python([sys.executable, "-m", "cuboid.layout", "gpus=8"], timeout=60)
    assert out.returncode != 0 and "unknown argument 'gpus=8'" in out.stderr and "gpus_per_node" in out.stderr


def _modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_is_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules(PACKAGE) + _modules(ROOT / "models")
            if (n := len(p.read_text().splitlines())) > 400}  # fmt: skip
    assert not long, long


def test_no_flat_folder_holds_more_than_ten_modules() -> None:
    folders = {PACKAGE, *(p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")}
    crowded = {str(f): n for f in folders if (n := len([p for p in f.glob("*.py") if p.name != "__init__.py"])) > 10}
    assert not crowded, crowded


def _imported_wings(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cuboid"):
            parts = node.module.split(".")
            if len(parts) > 1:
                found.add(parts[1])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("cuboid."))
    return found


@pytest.mark.parametrize("wing", WINGS)
def test_wings_import_only_downward(wing: str) -> None:
    upward = {}
    for path in _modules(PACKAGE / wing):
        bad = {w for w in _imported_wings(path) if w != wing and w != "models" and FLOORS.get(w, 99) >= FLOORS[wing]}
        if bad:
            upward[str(path.relative_to(ROOT))] = sorted(bad)
    assert not upward, upward


@pytest.mark.parametrize("wing", WINGS)
def test_every_wing_names_its_public_api(wing: str) -> None:
    module = importlib.import_module(f"cuboid.{wing}")
    assert module.__all__ and all(hasattr(module, name) for name in module.__all__)


def _cuboid_modules() -> dict[str, Path]:
    """Every module of the ``cuboid`` namespace by its dotted name (``strategy/`` is ``cuboid``, ``models/`` is
    ``cuboid.models``)."""
    found = {}
    for top, folder in (("cuboid", PACKAGE), ("cuboid.models", ROOT / "models")):
        for path in _modules(folder):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([top, *parts])] = path
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The ``cuboid`` modules ``name`` imports anywhere in its file (at the top, inside functions, under
    ``TYPE_CHECKING``): ``from cuboid.x import y`` counts as ``cuboid.x.y`` where that is a module, else ``cuboid.x``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                         for a in node.names)  # fmt: skip
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in known and m != name}


def test_no_import_circle() -> None:
    """No module reaches itself through its imports (function-level and type-checking imports included)."""
    known = _cuboid_modules()
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    circles = []
    for start in graph:  # a depth-first walk from each module back to itself
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(" -> ".join([*trail, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
    assert not circles, sorted(set(circles))[:10]


def test_imports_between_wings_go_through_the_wings_init() -> None:
    """Another wing is imported by the names its ``__init__`` exports (``from cuboid.parallel import Layout``), never
    from inside it (``from cuboid.parallel.mesh import ...``, or a module of it as a namespace)."""
    around = []
    for path in _modules(PACKAGE):
        rel = path.relative_to(PACKAGE)
        own = rel.parts[0] if len(rel.parts) > 1 else None
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cuboid.")):
                continue
            wing = node.module.split(".")[1]
            if wing not in WINGS or wing == own:
                continue
            inside = node.module.count(".") > 1 or any((PACKAGE / wing / f"{a.name}.py").exists() for a in node.names)
            if inside:
                around.append(f"{rel}:{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
    assert not around, around
