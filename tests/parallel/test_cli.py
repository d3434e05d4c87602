"""``LightningCLI`` projects choose Cuboid as they choose any strategy: ``class_path: cuboid.CuboidStrategy`` with
``init_args`` in the config, or ``--trainer.strategy=cuboid`` on the command line (tests/workers/cli_project.py,
launched as its users launch it; Lightning's launcher starts the second process)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from harness import WORKERS, run_checked, worker_env


@pytest.mark.slow
def test_lightning_cli_takes_cuboid_by_class_path_with_its_arguments(tmp_path) -> None:
    shutil.copy(WORKERS / "cli_config.yaml", tmp_path)
    command = [sys.executable, str(WORKERS / "cli_project.py"), "fit", "--config", "cli_config.yaml"]
    run_checked(command, timeout=300, env=worker_env(), cwd=tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["strategy"] == "cuboid.strategy.CuboidStrategy" and result["world_size"] == 2
    assert result["sharded"] and result["format"] == "full" and result["hidden"] == 16  # init_args and model args
    assert result["whole_after_fit"]
    assert len(result["losses"]) == 4 and result["losses"][-1] < result["losses"][0]
    saved = (tmp_path / "config.yaml").read_text()  # LightningCLI's own record of the run names the strategy
    assert "class_path: cuboid.CuboidStrategy" in saved and "data_parallel_shard: auto" in saved


def test_lightning_cli_takes_strategy_cuboid_by_name() -> None:
    """``--trainer.strategy=cuboid`` resolves through Lightning's registry (the Trainer built, nothing launched)."""
    from lightning.pytorch.cli import LightningCLI

    sys.path.insert(0, str(WORKERS))
    try:
        from cli_project import Data, Regressor
    finally:
        sys.path.remove(str(WORKERS))
    from cuboid import CuboidStrategy

    args = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=cuboid", "--trainer.logger=false"]
    cli = LightningCLI(Regressor, Data, run=False, args=args)
    assert isinstance(cli.trainer.strategy, CuboidStrategy)
    assert cli.trainer.strategy.settings.replicate_if_it_fits  # the default layout: chosen by the model's size at setup
