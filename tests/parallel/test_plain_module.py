"""A LightningModule not written for Cuboid trains unchanged under ``CuboidStrategy``, sharded.

Lightning's own launcher starts the processes (as with DDP), and each takes the share of the node's cores DDP gives it.
"""

from __future__ import annotations

import json
import sys

import pytest
from harness import WORKERS, run_checked, worker_env


@pytest.mark.slow
def test_plain_module_trains_with_lightning_launcher(tmp_path) -> None:
    env = worker_env()
    del env["OMP_NUM_THREADS"]  # as a user runs it: the strategy sets each rank's threads
    run_checked([sys.executable, str(WORKERS / "plain_module.py"), str(tmp_path)], timeout=300, env=env)
    result = json.loads((tmp_path / "result.json").read_text())
    # Each rank's threads are the node's cores over its processes, as under DDP (two ranks each taking every core
    # add up differently: the template-style project's validation loss was 1.6e-4 off DDP's)
    assert result["threads"] == [result["ddp_threads"]] * 2, result
    assert result["world_size"] == 2
    assert result["launched_by"] == "LightningEnvironment"
    assert result["param_is_dtensor"]  # sharded by FSDP2 without the module asking
    assert result["param_types"] == ["Parameter"]  # and whole again after fit, as DDP leaves it
    first = sum(result["first_losses"]) / 5
    last = sum(result["last_losses"]) / 5
    assert last < 0.5 * first, result
    assert result["val_loss"] < first
    # One sharded (DCP) checkpoint directory under its real name, no temporary left behind.
    assert result["checkpoints"] == ["epoch=3-step=32.ckpt"]
    assert {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"} <= set(result["checkpoint_files"])
    # Precision maps onto FSDP2's MixedPrecisionPolicy; Lightning's autocast plugin is not used.
    mixed, true = result["bf16-mixed"], result["bf16-true"]
    assert mixed == {
        "output": "torch.bfloat16",
        "autocast": "False",
        "plugin": "CuboidPrecision",
        "sharded_param": "torch.float32",
        "finite": True,
    }
    assert true == {
        "output": "torch.bfloat16",
        "autocast": "False",
        "plugin": "CuboidPrecision",
        "sharded_param": "torch.bfloat16",
        "finite": True,
    }
