"""Each rank runs ``trainer.fit`` in a thread of its own, as Ray Train, a notebook's background thread or a service
do (Python lets only the main thread install signal handlers). Each rank writes OUT/rank<r>.json.

    python -m torch.distributed.run --nproc-per-node=2 thread_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel

from cuboid import CuboidStrategy


def main() -> None:
    out, facts = Path(sys.argv[1]), {}

    def fit() -> None:
        try:
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy=CuboidStrategy(), max_steps=4, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
            trainer.fit(BoringModel())
            facts.update(rank=trainer.global_rank, steps=trainer.global_step, thread=threading.current_thread().name)
        except BaseException as error:  # noqa: BLE001  (reported, not raised in a thread nobody joins for it)
            facts["error"] = repr(error)

    thread = threading.Thread(target=fit, name="train-loop")
    thread.start()
    thread.join()
    rank = facts.get("rank", "unknown")
    (out / f"rank{rank}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
