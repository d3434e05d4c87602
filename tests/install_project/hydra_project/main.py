"""A user's Hydra main: Cuboid's ``fsdp_tp`` strategy preset and ``debug`` model from ``pkg://cuboid.conf``."""

import json

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from cuboid.models import CausalLM


@hydra.main(version_base="1.3", config_path=".", config_name="config")
def main(cfg: DictConfig) -> None:
    strategy = instantiate(cfg.strategy)
    trainer = instantiate(cfg.trainer, strategy=strategy)
    tokens = torch.randint(0, 256, (16, 33), generator=torch.Generator().manual_seed(0))
    data = DataLoader(tokens, batch_size=4)  # rows of 33 tokens: CausalLM predicts each next one
    trainer.fit(CausalLM(model=instantiate(cfg.model), max_steps=cfg.trainer.max_steps), data)
    if trainer.is_global_zero:
        layout = strategy.layout.resolve(trainer.world_size)
        print(
            json.dumps(
                {
                    "steps": trainer.global_step,
                    "tp": layout.tp,
                    "dp_shard": layout.dp_shard,
                    "strategy": type(strategy).__name__,
                }
            )
        )


if __name__ == "__main__":
    main()
