"""A user's first run shows no warning that Cuboid or its reference model causes: the main job, as the README starts
it (``python scripts/train.py``) and as an installed Cuboid starts it (``python -m cuboid.train``), with every rank's
warnings shown (``PYTHONWARNINGS=always``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from harness import ROOT, run_checked, worker_env

import cuboid

PACKAGE_DIRS = {str(ROOT / "strategy"), str(ROOT / "models"), str(Path(cuboid.__file__).parent)}
# Warnings torch or Lightning raise from their own files that Cuboid's code or its reference model caused.
# ("exists and is not empty": ModelCheckpoint's, when the job wrote into the checkpoint directory before its start)
# ("returned a view tensor": FSDP2's, when a unit's forward (the LightningModule's step) returns a view; the loss
# parallel's loss was to_local()'s view under tp)
CAUSED_BY_CUBOID = ("Slicing a flattened dim", "sync_dist=True", "will be deprecated", "exists and is not empty",
                    "returned a view tensor")  # fmt: skip
WARNING_LINE = re.compile(r"^(?:\[rank\d+\]:)?(/\S+\.py):\d+: (.*)$")


def cuboid_warnings(output: str) -> list[str]:
    found = []
    for line in output.splitlines():
        match = WARNING_LINE.match(line.strip())
        if match and any(match[1].startswith(d) for d in PACKAGE_DIRS):
            found.append(line)
        elif any(text in line for text in CAUSED_BY_CUBOID):
            found.append(line)
    return found


def test_the_filter_sees_a_warning_from_cuboids_own_files() -> None:
    path = ROOT / "strategy" / "parallel" / "mesh.py"
    assert cuboid_warnings(f"{path}:12: UserWarning: something") and not cuboid_warnings("/x/y.py:3: UserWarning: z")
    assert cuboid_warnings("/site/torch/distributed/device_mesh.py:760: UserWarning: Slicing a flattened dim ...")


@pytest.mark.slow
@pytest.mark.parametrize(
    "door, layout",
    [(["scripts/train.py"], []), (["-m", "cuboid.train"], ["strategy=fsdp_tp", "strategy.tensor_parallel=2"])],
)
def test_the_main_job_prints_no_warning_of_cuboids(tmp_path: Path, door: list[str], layout: list[str]) -> None:
    """Each door once: the default layout, and tp2 (loss parallel's loss, the FSDP unit's output under tp)."""
    command = [sys.executable, *(str(ROOT / d) if d.endswith(".py") else d for d in door)]
    # The default job, shortened: 20 steps with a validation at step 10 (the default runs 300, validating every 100).
    overrides = ["trainer.max_steps=20", "trainer.val_check_interval=10", f"data.cache_dir={tmp_path / 'cache'}",
                 *layout]  # fmt: skip
    env = worker_env(PYTHONWARNINGS="always")
    env.pop("WANDB_SILENT", None)
    # a fresh interpreter (not one forked from the suite's fork server): warnings at import count too
    out = run_checked([*command, *overrides], timeout=300, env=env, cwd=tmp_path, fresh=True)
    assert "Cuboid: 20 steps" in out, out[-3000:]
    assert cuboid_warnings(out) == [], "\n".join(cuboid_warnings(out))
