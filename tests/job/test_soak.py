"""A short soak (CI size): 300 steps, async checkpoints every 50 steps (top 2 kept, `last` a link), validation
every 100, W&B offline, dp2. Resident memory per rank stays flat after warm-up, and fit leaves no thread or child
process behind."""

from __future__ import annotations

import json

import pytest
from harness import WORKERS, torchrun

STEPS = 300
RSS_GROWTH_MIB = 64  # allowed growth from step 100 to the end, per rank


@pytest.mark.slow
def test_soak_memory_is_flat_and_nothing_is_left_behind(tmp_path) -> None:
    torchrun(2, WORKERS / "soak_worker.py", str(tmp_path), str(STEPS), timeout=600)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for facts in ranks:
        assert facts["steps"] == STEPS
        rss = {int(k): v for k, v in facts["rss"].items()}
        growth = rss[STEPS] - rss[100]
        print(f"soak: RSS at step 100 {rss[100]:.0f} MiB, at {STEPS} {rss[STEPS]:.0f} MiB (+{growth:.1f})")
        assert growth < RSS_GROWTH_MIB, rss
        # W&B keeps its own service threads (and, on rank 0, its service process) until the interpreter exits;
        # everything else that fit started (checkpoint writers, stagers, the watchdog) is gone.
        new_threads = [t for t in facts["after"]["threads"] if t not in facts["before"]["threads"]]
        assert not [t for t in new_threads if not t.startswith("wandb")], new_threads
        new_children = [c for c in facts["after"]["children"] if c not in facts["before"]["children"]]
        assert not [c for c in new_children if not c.startswith("wandb")], new_children
        print(f"soak: left by W&B after fit: threads {new_threads}, processes {new_children}")
    kept = ranks[0]["kept"]
    assert "last.ckpt" in kept and len([k for k in kept if k != "last.ckpt"]) == 2, kept
