"""Causal language modelling as a LightningModule: the training task around :class:`Llama`.

No parallel code: the same module trains on one CPU or on a pp x dp x tp cuboid. Validation
loss and perplexity come from torchmetrics metrics; under a multi-process strategy they sync
over ``strategy.dp_group`` when the strategy has one (Cuboid does), so tensor-parallel peers,
which see the same batch, are not counted twice. Perplexity is ``exp`` of the mean token loss.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric

from cuboid.models.llama import CONFIGS, Llama, LlamaConfig


class CausalLM(L.LightningModule):
    """Next-token prediction with AdamW and a linear-warmup cosine schedule.

    Args:
        model: A named size (``"debug"``, ``"150m"``, ``"1b"``, ``"8b"``, ``"70b"``) or a
            :class:`LlamaConfig` / dict of its fields.
        meta_init: Build the model on the meta device in ``configure_model`` (the strategy
            materializes it shard by shard); needed for models larger than one device. ``None`` (the default):
            on meta when the strategy materializes meta-built models (Cuboid's, either door: a process then never
            builds the whole model), for real otherwise (a plain Trainer, DDP).
        lr, weight_decay, betas, eps: AdamW settings (defaults: Llama's).
        warmup_steps, max_steps: Linear warm-up, then cosine decay to 10% of ``lr`` at ``max_steps``.
        init_seed: Seed for the initial weights, so every layout starts from the same model.
        lora: Fine-tune a LoRA adapter instead of every weight: ``peft.LoraConfig`` fields (``r``, ``lora_alpha``,
            ``target_modules`` among ``wq wk wv wo w1 w2 w3``, ...); the model is wrapped with
            ``peft.get_peft_model`` (needs ``cuboid[peft]``), its base frozen, the optimizer given the adapter only.
    """

    def __init__(
        self,
        model: str | LlamaConfig | dict[str, Any] = "debug",
        meta_init: bool | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-5,
        warmup_steps: int = 20,
        max_steps: int = 1000,
        init_seed: int = 1234,
        lora: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if isinstance(model, str):
            if model not in CONFIGS:
                raise ValueError(f"model={model!r} is not a named size; choose one of {', '.join(CONFIGS)}.")
            cfg = CONFIGS[model]
        elif isinstance(model, LlamaConfig):
            cfg = model
        else:
            cfg = LlamaConfig(**dict(model))
        self.cfg = cfg
        betas = tuple(float(b) for b in betas)  # plain floats: a Hydra ListConfig would need unsafe unpickling
        if lora is not None:  # plain values too (a Hydra DictConfig / ListConfig)
            lora = {str(k): (v if isinstance(v, (str, int, float, bool)) or v is None else list(v))
                    for k, v in dict(lora).items()}  # fmt: skip
        self.save_hyperparameters(ignore=["model"])
        self.meta_init = meta_init
        self.opt = {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps}
        self.warmup_steps, self.max_steps, self.init_seed = warmup_steps, max_steps, init_seed
        self.lora = lora
        self.model: Llama | None = None
        self.val_loss = MeanMetric()

    def configure_model(self) -> None:
        if self.model is not None:
            return
        torch.manual_seed(self.init_seed)
        if self._on_meta():
            with torch.device("meta"):
                self.model = self._with_adapter(Llama(self.cfg))
        else:
            self.model = self._with_adapter(Llama(self.cfg))

    def _on_meta(self) -> bool:
        if self.meta_init is not None:
            return bool(self.meta_init)
        runner = self._trainer if self._trainer is not None else getattr(self, "_fabric", None)
        return bool(getattr(getattr(runner, "strategy", None), "materializes_meta", False))

    def _with_adapter(self, model: Llama) -> Any:
        if self.lora is None:
            return model
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as err:
            raise ImportError("task.lora needs peft: pip install 'cuboid[peft]'") from err
        return get_peft_model(model, LoraConfig(**self.lora))

    def setup(self, stage: str) -> None:
        group = getattr(self.trainer.strategy, "dp_group", None)
        if group is not None:
            self.val_loss.process_group = group

    def tokens_in_batch(self, batch: torch.Tensor) -> int:
        """Tokens the model predicts in one local batch (used for tokens/s)."""
        return batch.shape[0] * (batch.shape[1] - 1)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x the parameters used in matmuls (the embedding lookup is not one; a tied
        output head is) + 12 x layers x dim x seq (attention scores and values), as torchtitan counts them."""
        c = self.cfg
        return 6 * c.matmul_params() + 12 * c.n_layers * c.dim * seq_len

    def loss(self, batch: torch.Tensor, aux: bool = True) -> torch.Tensor:
        """Next-token cross-entropy; with ``aux`` (training) plus ``cfg.aux_loss_coef`` x the MoE blocks'
        load-balancing loss, when the model has any (validation and perplexity use the language-model loss alone)."""
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        balance = self.model.aux_loss() if aux else None
        return loss if balance is None else loss + self.cfg.aux_loss_coef * balance

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        if self.logs_this_step():
            # The data-parallel mean, synced only on steps the Trainer logs: every sync is a barrier, an
            # all-reduce and a device-to-host read, which on a GPU stall the launch queue. Not on the progress
            # bar: Lightning reads progress-bar values on the host at every step, logged or not.
            self.log("train/loss", loss, sync_dist=True)
        return loss

    def logs_this_step(self) -> bool:
        """Whether the Trainer sends this training step's metrics to its loggers (``log_every_n_steps``), as
        Lightning decides it: the step count after this step is a multiple of ``log_every_n_steps``."""
        trainer = self.trainer
        every = trainer.log_every_n_steps
        return bool(every) and ((trainer.global_step + 1) % every == 0 or trainer.should_stop)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.val_loss.update(self.loss(batch, aux=False), weight=batch.shape[0])

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # already the data-parallel mean (the metric's process group)
        # sync_dist: the same value on every rank, so the mean changes nothing; it tells Lightning the epoch-level
        # value is the whole group's (once per validation, not a per-step cost).
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", torch.exp(loss), sync_dist=True)
        self.val_loss.reset()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], **self.opt)

        def schedule(step: int) -> float:
            if step < self.warmup_steps:
                return (step + 1) / self.warmup_steps
            progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
