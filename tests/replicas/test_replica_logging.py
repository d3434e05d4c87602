"""The main job's logger under fault-tolerant replica groups: one W&B run for the whole training, logged by group 0;
a restarted group 0 goes on logging to the same run."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from cuboid import CuboidStrategy
from cuboid.train import WANDB_ID_FILE, make_logger

pytest.importorskip("torchft")
pytest.importorskip("wandb")


def _cfg(tmp: Path):
    return OmegaConf.create({"logger": {"_target_": "lightning.pytorch.loggers.WandbLogger", "project": "cuboid",
                                        "offline": True, "save_dir": str(tmp)}})  # fmt: skip


def _strategy(group: int) -> CuboidStrategy:
    return CuboidStrategy(fault_tolerance={"lighthouse": "http://127.0.0.1:1", "replica_group": group, "groups": 2})


def test_only_replica_group_0_has_a_logger(tmp_path: Path, capsys) -> None:
    assert make_logger(_cfg(tmp_path), tmp_path, resuming=False, strategy=_strategy(1)) is False
    assert "replica group 1 logs nothing" in capsys.readouterr().out
    logger = make_logger(_cfg(tmp_path), tmp_path, resuming=False, strategy=_strategy(0))
    assert type(logger).__name__ == "WandbLogger"


def test_a_restarted_group_0_logs_to_the_run_it_logged_before_also_without_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / WANDB_ID_FILE).write_text("abc123\n")
    logger = make_logger(_cfg(tmp_path), tmp_path, resuming=False, strategy=_strategy(0))
    assert logger._wandb_init["id"] == "abc123" and logger._wandb_init["resume"] == "allow"
    # without replica groups a fresh start (no checkpoint) begins a new run, as before
    assert make_logger(_cfg(tmp_path), tmp_path, resuming=False, strategy=CuboidStrategy())._wandb_init.get("id") != (
        "abc123"
    )
