"""Code nobody here wrote: Hugging Face models in LightningModules written the way users write them.

Each family gives a tiny config built locally (no downloads), a dataset with an ``"idx"`` per sample
(the parity worker records which samples each rank saw), a LightningModule with torchmetrics and no
parallel code, and a single-process plain-PyTorch reference on the same global batches (the order
Lightning's DistributedSampler gives them, as in :mod:`parity_lib`).
"""

from __future__ import annotations

import lightning as L
import torch
from parity_lib import ADAMW, GLOBAL_BATCH, SEED, SEQ, Reference, ReferenceBias, TokenDataset, computed_once
from torch import nn
from torch.utils.data import Dataset
from torchmetrics import MeanMetric

FAMILIES = ("hf_llama", "hf_qwen3", "hf_vit", "hf_mistral", "hf_llama_tied", "hf_qwen3_moe", "hf_mixtral",
            "hf_minicpm5_moe", "hf_phi3", "hf_gemma3", "hf_deepseek_v3")  # fmt: skip
# Mixture-of-experts families: their loss adds the router's load-balancing loss (output_router_logits), which is
# not linear in the batch, so data-parallel training's loss is the mean of the ranks' own (see reference_run).
MOE = ("hf_qwen3_moe", "hf_mixtral", "hf_qwen3_moe_noaux", "hf_gpt_oss")
# Max grad norm per family: the reference clips on some steps and not on others (test_third_party and
# test_pipeline_hf assert both).
CLIP = {"hf_llama": 1.75, "hf_qwen3": 1.7, "hf_vit": 4.0, "hf_mistral": 1.75, "hf_llama_tied": 1.75,
        "hf_qwen3_moe": 1.85, "hf_mixtral": 1.7, "hf_qwen3_moe_noaux": 1.85, "hf_llama_lora": 0.4,
        "hf_minicpm5_moe": 1.25, "hf_phi3": 1.65, "hf_gemma3": 1.9, "hf_deepseek_v3": 1.3, "hf_gpt_oss": 1.6,
        "hf_apertus": 1.75, "hf_llava": 1.4, "hf_gemma3_vl": 1.6, "hf_mllama": 1.3, "hf_granite": 0.13, "hf_gpt2": 1.5, "hf_cohere2": 0.095, "hf_olmo3": 2.0, "hf_qwen2_window": 1.6, "hf_gemma2": 2.0}  # fmt: skip
CLIP_PADDED = {"hf_llama": 1.75, "hf_qwen3": 1.7, "hf_mistral": 1.75, "hf_qwen3_moe": 2.0}

# Apertus's own plan (transformers 5.25) and what it leaves out: its xIELU activation's parameters see only this rank's
# share of up_proj's features, so their gradients must be summed over tp (a user's plan replaces the model's own).
APERTUS_PLAN = {
    "model.lm_head": "colwise_gather_output",
    "model.model.embed_tokens": "embedding_rowwise",
    **{f"model.model.layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
    "model.model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "model.model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    "model.model.layers.*.self_attn.o_proj": "rowwise",
    "model.model.layers.*.mlp.up_proj": "colwise",
    "model.model.layers.*.mlp.down_proj": "rowwise",
    "model.model.layers.*.mlp.act_fn": "replicated_with_grad_allreduce",
}

# Tensor-parallel plan for transformers' ViT, given as data (ViT carries none), names as seen from the module.
VIT_PLAN = {
    "model.vit.layers.*.attention.q_proj": "colwise",
    "model.vit.layers.*.attention.k_proj": "colwise",
    "model.vit.layers.*.attention.v_proj": "colwise",
    "model.vit.layers.*.attention.o_proj": "rowwise",
    "model.vit.layers.*.mlp.fc1": "colwise",
    "model.vit.layers.*.mlp.fc2": "rowwise",
}


def hf_config(family: str):
    import transformers

    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4}
    if family == "hf_granite":  # embeddings scaled inside the base model's forward, residual and logit multipliers
        return transformers.GraniteConfig(vocab_size=256, num_key_value_heads=2, max_position_embeddings=64,
                                          embedding_multiplier=12.0, residual_multiplier=0.22,
                                          attention_multiplier=0.0625, logits_scaling=8.0, **small)  # fmt: skip
    if family == "hf_gpt2":  # learned positions added inside the base model's forward, a reshape after its blocks,
        # transposed-weight projections (Conv1D) and a fused q/k/v one, a tied head, no plan of its own in transformers
        return transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=64, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)  # fmt: skip
    if family == "hf_mllama":  # Llama 3.2 Vision: a tiled vision encoder (a local and a global transformer) whose
        # states the language model's cross-attention layers (1 and 3) read; self-attention layers between them
        vision = {"hidden_size": 32, "num_hidden_layers": 2, "num_global_layers": 1, "attention_heads": 4,
                  "intermediate_size": 64, "vision_output_dim": 96, "image_size": 28, "patch_size": 14,
                  "max_num_tiles": 2, "intermediate_layers_indices": [0, 1],
                  "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]]}  # fmt: skip
        text = {
            "vocab_size": 256,
            "num_key_value_heads": 2,
            "cross_attention_layers": [1, 3],
            "max_position_embeddings": 64,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            **small,
        }
        return transformers.MllamaConfig(vision_config=vision, text_config=text, image_token_index=MLLAMA_IMAGE)
    if family == "hf_llava":  # a CLIP vision tower and a projector feeding a Llama: a composite model
        vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, image_size=16, patch_size=4)  # fmt: skip
        text = transformers.LlamaConfig(
            vocab_size=VLM_VOCAB, num_key_value_heads=2, max_position_embeddings=64, **small
        )
        return transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                                        projector_hidden_act="gelu", vision_feature_select_strategy="default")  # fmt: skip
    if family == "hf_gemma3_vl":  # Gemma 3's multimodal model: a SigLIP tower pooled to 4 tokens, image tokens
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, image_size=16, patch_size=4)  # fmt: skip
        text = transformers.Gemma3TextConfig(vocab_size=VLM_VOCAB, num_key_value_heads=2, head_dim=16,
                                             max_position_embeddings=64, sliding_window=8, **small)  # fmt: skip
        return transformers.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4,
                                         image_token_index=IMAGE_TOKEN, boi_token_index=269, eoi_token_index=270)  # fmt: skip
    if family in ("hf_llama", "hf_llama_tied"):
        tied = family == "hf_llama_tied"
        return transformers.LlamaConfig(
            vocab_size=256, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied, **small
        )
    if family == "hf_mistral":  # a sliding window shorter than the sequences: the mask differs from causal
        return transformers.MistralConfig(
            vocab_size=256, num_key_value_heads=2, max_position_embeddings=64, sliding_window=8, **small
        )
    if family == "hf_qwen3":
        return transformers.Qwen3Config(
            vocab_size=256, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, **small
        )
    # 4 experts, top-2, every layer sparse, the load-balancing loss in .loss at a weight where it matters
    moe = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.1}
    if family in ("hf_qwen3_moe", "hf_qwen3_moe_noaux"):  # _noaux: without the load-balancing loss (as under pp)
        moe["output_router_logits"] = family == "hf_qwen3_moe"
        return transformers.Qwen3MoeConfig(
            vocab_size=256, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=4,
            moe_intermediate_size=32, norm_topk_prob=True, **moe, **small,
        )  # fmt: skip
    if family == "hf_minicpm5_moe":  # transformers 5.25: gated attention (q_gate_proj), unit_colwise k/v in its
        # plan, one dense layer then MoE layers with a shared expert, sigmoid routing with a score-correction bias
        # and no load-balancing loss (its balancing moves that bias, outside the loss)
        return transformers.MiniCPM5MoeConfig(
            vocab_size=256, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, moe_intermediate_size=32,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.0, pad_token_id=0,
            bos_token_id=0, eos_token_id=1, **small,
        )  # fmt: skip
    if family == "hf_mixtral":
        return transformers.MixtralConfig(
            vocab_size=256, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, **moe, **small
        )
    ids = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 1}  # inside the tiny vocabulary
    if family == "hf_phi3":  # fused projections: qkv_proj and gate_up_proj
        return transformers.Phi3Config(
            vocab_size=256, num_key_value_heads=2, max_position_embeddings=64, **ids, **small
        )
    if family == "hf_deepseek_v3":  # multi-head latent attention (its plan's mla_kv_a_proj; a value head dim of 8
        # beside the query's 16, as the full model's 128 / 192), a dense first layer, routed experts beside a shared
        # one, sigmoid routing with a score-correction bias
        return transformers.DeepseekV3Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64, **ids,
        )  # fmt: skip
    if family == "hf_gemma3":  # sliding and global layers, scaled embeddings, per-head q/k norms, a tied head
        return transformers.Gemma3TextConfig(
            vocab_size=256, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=8,
            **ids, **small,
        )  # fmt: skip
    if family == "hf_gpt_oss":  # attention sinks (s_aux), sliding and full layers, biased experts stored transposed
        return transformers.GptOssConfig(
            vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **ids,
        )  # fmt: skip
    # Run by hand under cp (docs/context.md): sliding-window layers beside full ones, windows of 8 tokens
    if family == "hf_cohere2":  # parallel attention and MLP, rotary only on its sliding layers, a logit scale
        return transformers.Cohere2Config(
            vocab_size=256, num_key_value_heads=2, max_position_embeddings=64, sliding_window=8, **ids, **small
        )
    if family == "hf_olmo3":
        return transformers.Olmo3Config(
            vocab_size=256, num_key_value_heads=2, max_position_embeddings=64, sliding_window=8, **ids, **small
        )
    if family == "hf_gemma2":  # soft-capped attention scores (a cap that bites on small scores: unscaled, 0.1) and
        # logits, alternating sliding and global layers
        return transformers.Gemma2Config(
            vocab_size=256, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=8,
            attn_logit_softcapping=0.1, query_pre_attn_scalar=1, final_logit_softcapping=30.0, attn_implementation="eager",
            **ids, **small,
        )  # fmt: skip
    if family == "hf_qwen2_window":  # use_sliding_window: the layers from max_window_layers on slide
        return transformers.Qwen2Config(
            vocab_size=256, num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=True,
            sliding_window=8, max_window_layers=2, **ids, **small,
        )  # fmt: skip
    if family == "hf_apertus":  # a learned activation (xIELU: act_fn.alpha_p, alpha_n) between up_proj and down_proj
        return transformers.ApertusConfig(
            vocab_size=256, num_key_value_heads=2, max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **ids, **small,
        )  # fmt: skip
    if family == "hf_vit":
        return transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, num_labels=10, **small)
    raise ValueError(family)


# A LoRA fine-tune (peft) of the tiny Llama: rank 4 on every attention and MLP projection, no dropout.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config():
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS)


# The composite family's vocabulary: the text's 256 tokens and an image token, padded to a size tp divides.
VLM_VOCAB, IMAGE_TOKEN, PATCHES = 272, 271, 16
# Mllama's image token: past its language model's 256 (its embedding holds 8 more rows for such tokens).
MLLAMA_IMAGE = 256


def build_model(family: str) -> nn.Module:
    import transformers

    if family == "hf_llama_lora":  # what a LoRA user writes: the model, then peft.get_peft_model
        from peft import get_peft_model

        return get_peft_model(build_model("hf_llama"), lora_config())
    config = hf_config(family)
    if family == "hf_vit":
        return transformers.ViTForImageClassification(config)
    if family == "hf_llava":
        return transformers.LlavaForConditionalGeneration(config)
    if family == "hf_mllama":
        model = transformers.MllamaForConditionalGeneration(config)
        with torch.no_grad():  # transformers starts its tanh gates at zero (a checkpoint fills them): the image
            # states would reach no loss, the tiles' position embeddings no gradient
            for name, param in model.named_parameters():
                if name.endswith("gate") and param.numel() == 1:
                    param.fill_(0.5)
        return model
    if family == "hf_gemma3_vl":
        model = transformers.Gemma3ForConditionalGeneration(config)
        with torch.no_grad():  # transformers starts the projection at zero (a checkpoint fills it): zero image
            # features through the language model's RMSNorms gave a first gradient norm of 5e18
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02)
        return model
    return transformers.AutoModelForCausalLM.from_config(config)


def initial_model(family: str, meta_init: bool = False) -> nn.Module:
    """The weights every run starts from. ``meta_init``: built on meta, then transformers' own init on the host
    (what Cuboid's rank 0 does), from the RNG state the module's ``configure_model`` leaves."""
    torch.manual_seed(SEED)
    if not meta_init:
        return build_model(family)
    with torch.device("meta"):
        model = build_model(family)
    model.to_empty(device="cpu")
    model.init_weights()
    if family == "hf_llama_lora":  # then PEFT's own init of the adapters (A as nn.Linear, B zero)
        from peft.tuners.lora import LoraLayer

        for layer in model.modules():
            if isinstance(layer, LoraLayer):
                layer.reset_lora_parameters("default", True)
    return model


class ImageDataset(Dataset):
    """16x16 RGB images whose label is a function of their mean colour and brightness pattern."""

    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(11)
        self.images = torch.randn(n, 3, 16, 16, generator=g)
        score = self.images[:, 0, :8].mean((1, 2)) - self.images[:, 1, 8:].mean((1, 2))
        self.labels = torch.bucketize(score, torch.linspace(-0.3, 0.3, 9))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"idx": torch.tensor(i), "pixel_values": self.images[i], "labels": self.labels[i]}


class ImageTextDataset(TokenDataset):
    """An image and its caption: :data:`PATCHES` image tokens (the vision tower's 16 patches of a 16x16 image take
    their places) then the caption's tokens, predicted; the image's brightness pattern sets the caption's first
    token, so the tower's features matter to the loss."""

    def __init__(self, n: int = 96, seq: int = SEQ, patches: int = PATCHES, token_types: bool = False) -> None:
        super().__init__(n, seq - patches)
        self.patches, self.token_types = patches, token_types
        g = torch.Generator().manual_seed(17)
        self.images = torch.randn(n, 3, 16, 16, generator=g)
        self.tokens[:, 0] = (self.images[:, 0, :8].mean((1, 2)) > 0).long() * 7

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.cat([torch.full((self.patches,), IMAGE_TOKEN), self.tokens[i]])
        labels = ids.clone()
        labels[: self.patches] = -100
        item = {"idx": torch.tensor(i), "input_ids": ids, "pixel_values": self.images[i], "labels": labels}
        if self.token_types:  # Gemma 3: 1 marks the image's tokens (they attend to each other both ways)
            item["token_type_ids"] = (ids == IMAGE_TOKEN).long()
        return item


class TiledImageTextDataset(TokenDataset):
    """Mllama's batch, as its processor makes one: a 28x28 image cut into one or two tiles (``aspect_ratio_ids``,
    ``aspect_ratio_mask``), ``input_ids`` with two tokens before the image token (they attend to no image: their rows
    of ``cross_attention_mask`` are zero) and the caption after it, whose first token the image's brightness
    sets. The tokens after the image attend to its real tiles."""

    def __init__(self, n: int = 96, seq: int = SEQ) -> None:
        super().__init__(n, seq)
        g = torch.Generator().manual_seed(19)
        self.images = torch.randn(n, 1, 2, 3, 28, 28, generator=g)
        self.tiles = torch.randint(1, 3, (n,), generator=g)
        self.images[self.tiles == 1, :, 1] = 0.0
        self.tokens[:, 2] = MLLAMA_IMAGE
        self.tokens[:, 3] = (self.images[:, 0, 0, 0, :14].mean((1, 2)) > 0).long() * 7

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[i]
        labels = ids.clone()
        labels[2] = -100
        tiles = int(self.tiles[i])
        ratio = torch.tensor([1 if tiles == 1 else 2])
        tile_mask = (torch.arange(2) < tiles).long().reshape(1, 2)
        cross = torch.zeros(len(ids), 1, 2, dtype=torch.long)
        cross[2:, 0, :tiles] = 1
        return {"idx": torch.tensor(i), "input_ids": ids, "pixel_values": self.images[i], "aspect_ratio_ids": ratio,
                "aspect_ratio_mask": tile_mask, "cross_attention_mask": cross, "labels": labels}  # fmt: skip


class PaddedTokenDataset(TokenDataset):
    """Token sequences of different lengths, right-padded: ``attention_mask`` masks the padding, and ``labels`` is
    ``-100`` on the padding and on a short prompt, so samples (and microbatches) predict different numbers of
    tokens."""

    def __init__(self, n: int = 96, seq: int = SEQ) -> None:
        super().__init__(n, seq)
        g = torch.Generator().manual_seed(13)
        seq = self.tokens.shape[1]
        self.lengths = torch.randint(seq // 3, seq + 1, (n,), generator=g)
        self.prompts = torch.randint(0, 5, (n,), generator=g)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = self.tokens[i].clone()
        real = torch.arange(len(tokens)) < self.lengths[i]
        tokens[~real] = 0
        labels = torch.where(real, tokens, torch.full_like(tokens, -100))
        labels[: int(self.prompts[i])] = -100
        return {"idx": torch.tensor(i), "tokens": tokens, "attention_mask": real.long(), "labels": labels}


def dataset(family: str, n: int = 96, padded: bool = False, seq: int = SEQ) -> Dataset:
    """Samples of ``family``; token families: sequences of ``seq + 1`` tokens (the model reads them all)."""
    if family == "hf_vit":
        return ImageDataset(n)
    if family == "hf_llava":
        return ImageTextDataset(n, seq)
    if family == "hf_mllama":
        return TiledImageTextDataset(n, seq)
    if family == "hf_gemma3_vl":
        return ImageTextDataset(n, seq, patches=4, token_types=True)
    return PaddedTokenDataset(n, seq) if padded else TokenDataset(n, seq)


def clip(family: str, padded: bool = False) -> float:
    return CLIP_PADDED[family] if padded else CLIP[family]


def hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What a user's step computes: the model's own loss."""
    if "cross_attention_mask" in batch:  # Mllama: the processor's batch as it comes, ``self.model(**batch).loss``
        return model(**{k: v for k, v in batch.items() if k != "idx"}).loss
    if "pixel_values" in batch and "input_ids" in batch:  # images in the text: a vision-language model
        extra = {"token_type_ids": batch["token_type_ids"]} if "token_type_ids" in batch else {}
        return model(
            input_ids=batch["input_ids"], pixel_values=batch["pixel_values"], labels=batch["labels"], **extra
        ).loss
    if "pixel_values" in batch:
        return model(pixel_values=batch["pixel_values"], labels=batch["labels"]).loss
    tokens = batch["tokens"]
    if "attention_mask" in batch:
        return model(input_ids=tokens, attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    return model(input_ids=tokens, labels=tokens).loss


def hf_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What a user's predict step returns: the model's logits (a decoder's, on its padded batch's mask too)."""
    mask = {"attention_mask": batch["attention_mask"]} if "attention_mask" in batch else {}
    return model(input_ids=batch["tokens"], **mask).logits


class HFModule(L.LightningModule):
    """A LightningModule around a transformers model, as users write one: no parallel code in it."""

    def __init__(self, family: str, meta_init: bool = False) -> None:
        super().__init__()
        self.family = family
        self.meta_init = meta_init
        self.model: nn.Module | None = None if meta_init else initial_model(family)
        self.val_loss = MeanMetric()

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(SEED)
            with torch.device("meta"):
                self.model = build_model(self.family)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = hf_loss(self.model, batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_loss.update(hf_loss(self.model, batch))
        self.log("val_loss", self.val_loss)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return hf_logits(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # what LoRA fine-tunes write (PEFT's examples, litgpt): the trainable parameters only
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], **ADAMW)


@computed_once
def reference_run(
    family: str,
    meta_init: bool = False,
    epochs: int = 1,
    initial: dict[str, torch.Tensor] | None = None,
    padded: bool = False,
    dp: int = 1,
    seq: int = SEQ,
    steps: int | None = None,
    max_norm: float | None = None,
    microbatches: int = 1,
    local_balance: bool = False,
    expert_bias: float | None = None,
) -> Reference:
    """Single-process fp32 training of ``family`` on the same global batches, clipped at :func:`clip`, from
    :func:`initial_model` or the weights ``initial``. With ``padded`` and ``dp`` > 1, each step's loss is the mean
    of the ``dp`` ranks' own token means (each rank's share of the global batch, as Lightning's sampler deals it):
    what data-parallel training computes when the ranks predict different numbers of tokens.

    The mixture-of-experts families' load-balancing loss is the whole step's (Cuboid's ``load_balancing="global"``):
    the model run on the global batch. With ``microbatches`` > 1 (a pipeline's) it is each microbatch's: each
    rank's batch is cut as the pipeline cuts it, the ranks' ``m``-th pieces run together, and the step's loss is
    the mean over ``m``. With ``local_balance`` (``"local"``) it is each rank's own batch's (or piece's), and the
    step's loss the mean of theirs. ``expert_bias``: the routers' bias moved by this rate after each step
    (``parity_lib.ReferenceBias``)."""
    moe_global = family in MOE and not local_balance
    assert not (moe_global and padded and dp > 1), "the ranks' token means and a global statistic: not modelled"
    model = initial_model(family, meta_init)
    if initial is not None:
        model.load_state_dict(initial)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    balance = ReferenceBias(model, expert_bias) if expert_bias is not None else None
    data = dataset(family, padded=padded, seq=seq)
    shares = dp if padded or family in MOE else 1
    losses, norms, loads = [], [], []
    routed = _count_routing(model) if family in MOE else None
    for epoch in range(epochs):
        perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        for k in range(len(data) // GLOBAL_BATCH if steps is None else steps):  # steps: the first batches only
            window = perm[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]
            loss = 0.0
            pieces = []  # per rank, per microbatch
            for r in range(shares):
                items = [data[i] for i in window[r::shares]]
                batch = {key: torch.stack([it[key] for it in items]) for key in items[0]}
                pieces.append([{key: t.tensor_split(microbatches)[m] for key, t in batch.items()}
                               for m in range(microbatches)])  # fmt: skip
            for m in range(microbatches):
                if moe_global:  # the ranks' m-th pieces together: one statistic
                    together = {key: torch.cat([p[m][key] for p in pieces]) for key in pieces[0][m]}
                    loss = loss + hf_loss(model, together) / microbatches
                    continue
                for r in range(shares):
                    loss = loss + hf_loss(model, pieces[r][m]) / (shares * microbatches)
            loss.backward()
            if routed is not None:  # this step's tokens per expert, from the routers' own choices
                loads.append(torch.stack([c.clone() for c in routed]))
                for c in routed:
                    c.zero_()
            losses.append(loss.item())
            limit = clip(family, padded) if max_norm is None else max_norm
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), limit)))
            opt.step()
            opt.zero_grad()
            if balance is not None:
                balance.step()
    params = {f"model.{k}": v.detach().clone() for k, v in model.named_parameters()}
    biases = balance.biases() if balance is not None else None
    return Reference(losses, norms, params, loads if routed is not None else None, biases)


def _count_routing(model: nn.Module) -> list[torch.Tensor]:
    """Per MoE layer, a running count of the (token, expert) pairs its router chose (the router's third output,
    the top-k expert ids, in Qwen3-MoE, Mixtral and GPT-OSS): an independent count for CuboidMonitor's load figures."""
    counts = []
    for name, module in model.named_modules():
        if name.endswith(("mlp.gate", "mlp.router")):  # GPT-OSS names its router "router"
            count = torch.zeros(module.weight.shape[0])

            def hook(_module, _args, out, count=count) -> None:
                count += torch.bincount(out[2].reshape(-1), minlength=count.numel()).float()

            module.register_forward_hook(hook)
            counts.append(count)
    return counts
