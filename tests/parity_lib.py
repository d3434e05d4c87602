"""Shared pieces of the parity tests: data, the LightningModule, and the single-process reference.

The reference is plain PyTorch (no Lightning, no torch.distributed): fp32, the same seed and
initial weights, AdamW, ``torch.nn.utils.clip_grad_norm_``, and the global batches in the
order Lightning's DistributedSampler produces them (one shuffled permutation, seeded, read in
contiguous global batches; dp rank r takes every dp-th sample of each).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
from dataclasses import dataclass, replace

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from cuboid.models import Llama, LlamaConfig

SEED = 1234
CFG = LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
# Cuboid's own MoE: 4 experts per block, top-2, a shared expert, the load-balancing loss at a weight where it matters
MOE_CFG = replace(CFG, n_experts=4, top_k=2, moe_ffn_dim=64, shared_expert=True, aux_loss_coef=0.1)
SEQ = 32
GLOBAL_BATCH = 8
N_SAMPLES = 96  # 12 optimizer steps per epoch without accumulation
LR = 1e-3
# Llama's published AdamW settings (Touvron et al. 2023): betas (0.9, 0.95), eps 1e-5, weight decay 0.1.
ADAMW = {"lr": LR, "betas": (0.9, 0.95), "eps": 1e-5, "weight_decay": 0.1}
# Max grad norm per accumulate_grad_batches: chosen so the reference clips on some steps and not
# on others (test_parity asserts both happen).
CLIP = {1: 1.4, 2: 1.08, 4: 0.72}


class TokenDataset(Dataset):
    """Deterministic token sequences with learnable structure (a noisy repeating pattern)."""

    def __init__(self, n: int = N_SAMPLES, seq: int = SEQ, vocab: int = 256) -> None:
        g = torch.Generator().manual_seed(7)
        base = torch.randint(0, vocab, (n, 8), generator=g)
        self.tokens = base.repeat(1, (seq + 1) // 8 + 1)[:, : seq + 1].clone()
        noise = torch.rand(self.tokens.shape, generator=g) < 0.2
        self.tokens[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"idx": torch.tensor(i), "tokens": self.tokens[i]}


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def initial_model(cfg: LlamaConfig = CFG) -> Llama:
    torch.manual_seed(SEED)
    return Llama(cfg)


def step_loss(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, plus the weighted load-balancing loss of an MoE model's blocks."""
    loss = lm_loss(model(tokens[:, :-1]), tokens)
    balance = model.aux_loss()
    return loss if balance is None else loss + model.cfg.aux_loss_coef * balance


class LlamaModule(L.LightningModule):
    """A plain LightningModule around the reference Llama: no parallel code in it."""

    def __init__(self, meta_init: bool = False, cfg: LlamaConfig = CFG) -> None:
        super().__init__()
        self.meta_init, self.cfg = meta_init, cfg
        self.model: Llama | None = None if meta_init else initial_model(cfg)

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(SEED)  # the weights Cuboid materializes come from this RNG state
            with torch.device("meta"):
                self.model = Llama(self.cfg)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = step_loss(self.model, batch["tokens"])
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), **ADAMW)


def each_spec(specs_json: str):
    """A worker's specs, one at a time; rank 0 prints the marks by which ``tests/harness.py`` names the spec a
    crashed launch was running (``Launch.running_spec``) and times each spec (the session's slowest specs table)."""
    import json
    import os
    import time

    first = os.environ.get("RANK", "0") == "0"
    for spec in json.loads(specs_json):
        if first:
            print(f"cuboid-test: spec {spec['name']} starts", flush=True)
        start = time.monotonic()
        yield spec
        if first:
            print(f"cuboid-test: spec {spec['name']} done in {time.monotonic() - start:.1f} s", flush=True)


def content_key(value: object) -> str:
    """A digest of ``value``'s content: tensors by dtype, shape and bytes, containers by their items, anything else
    by its ``repr`` (configs are dataclasses)."""
    digest = hashlib.sha256()

    def feed(x: object) -> None:
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().contiguous()
            digest.update(f"T{x.dtype}{tuple(x.shape)}".encode())
            digest.update(x.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            digest.update(b"{")
            for k in sorted(x, key=repr):
                feed(k)
                feed(x[k])
            digest.update(b"}")
        elif isinstance(x, (list, tuple)):
            digest.update(b"[")
            for v in x:
                feed(v)
            digest.update(b"]")
        else:
            digest.update(repr(x).encode())

    feed(value)
    return digest.hexdigest()


def computed_once(fn):
    """Run a deterministic single-process reference once per test session per content of its arguments (defaults
    filled in, so ``f(1)`` and ``f(accumulate=1)`` are one run); every caller gets its own deep copy, and the global
    torch RNG is left as the caller had it."""
    signature = inspect.signature(fn)
    done: dict[str, object] = {}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        key = content_key((fn.__module__, fn.__qualname__, dict(bound.arguments)))
        if key not in done:
            with torch.random.fork_rng(devices=[]):  # no caller sees the RNG state it leaves, cached or not
                done[key] = fn(*args, **kwargs)
        return copy.deepcopy(done[key])

    wrapper.uncached = fn
    return wrapper


@dataclass
class Reference:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]
    loads: list[torch.Tensor] | None = None  # mixture of experts: tokens per expert per step, (layers, experts)
    biases: dict[str, torch.Tensor] | None = None  # expert_bias_rate: each router's bias after the last step


class ReferenceBias:
    """Balancing without an auxiliary loss, written out for the single-process reference from DeepSeek-V3's rule
    (arXiv:2412.19437 section 2.1.2; torchtitan's update) and independent of ``cuboid.experts.bias``: each router
    chooses its top k by ``probabilities + bias`` and weights the chosen experts by the unbiased probabilities,
    normalised as its family does; after each optimizer step, from the tokens each expert got in the step's
    forwards, ``delta = rate * sign(mean - tokens)``, ``bias += delta - mean(delta)``. DeepSeek-V3's router keeps
    its own bias (``e_score_correction_bias``) and its own forward; only the update is added."""

    def __init__(self, model: torch.nn.Module, rate: float, prefix: str = "model.") -> None:
        from types import MethodType

        self.rate = rate
        self.routers: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (buffer name, bias, counts)
        for name, module in model.named_modules():
            kind = type(module).__name__
            if kind not in ("Router", "Qwen3MoeTopKRouter", "MixtralTopKRouter", "DeepseekV3TopkRouter"):
                continue
            n = module.weight.shape[0]
            own = kind == "DeepseekV3TopkRouter"
            bias = module.e_score_correction_bias if own else torch.zeros(n)
            counts = torch.zeros(n)
            self.routers.append((f"{prefix}{name}.{'e_score_correction_bias' if own else 'expert_bias'}", bias, counts))
            if own:
                module.register_forward_hook(lambda _m, _a, out, counts=counts: self._count(counts, out[2]))
            else:
                module.forward = MethodType(self._forward(kind, bias, counts), module)

    def _count(self, counts: torch.Tensor, index: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            counts += torch.bincount(index.reshape(-1), minlength=counts.numel()).float()

    def _forward(self, kind: str, bias: torch.Tensor, counts: torch.Tensor):
        def forward(router: torch.nn.Module, x: torch.Tensor):
            flat = x.reshape(-1, router.weight.shape[1])
            logits = F.linear(flat, router.weight)
            probs = F.softmax(logits, dim=-1, dtype=torch.float32)
            index = torch.topk(probs + bias, router.top_k, dim=-1).indices
            self._count(counts, index)
            chosen = probs.gather(-1, index)
            if kind == "Router":  # cuboid.models.moe.Router: (probabilities, weights in x's dtype, ids)
                return probs, (chosen / chosen.sum(dim=-1, keepdim=True)).to(x.dtype), index
            if kind == "MixtralTopKRouter" or router.norm_topk_prob:
                chosen = chosen / chosen.sum(dim=-1, keepdim=True)
            return logits, chosen.to(logits.dtype) if kind == "Qwen3MoeTopKRouter" else chosen, index

        return forward

    @torch.no_grad()
    def step(self) -> None:
        for _, bias, counts in self.routers:
            delta = self.rate * torch.sign(counts.mean() - counts)
            bias += delta - delta.mean()
            counts.zero_()

    def biases(self) -> dict[str, torch.Tensor]:
        return {name: bias.detach().clone() for name, bias, _ in self.routers}


@computed_once
def reference_run(
    accumulate: int = 1,
    epochs: int = 1,
    clip: float | None = -1.0,
    initial: dict[str, torch.Tensor] | None = None,
    seq: int = SEQ,
    steps: int | None = None,
    cfg: LlamaConfig = CFG,
    microbatches: int = 1,
    expert_bias: float | None = None,
) -> Reference:
    """Single-process fp32 training on the same global batches, clipped at ``CLIP[accumulate]`` (``clip=None``:
    not clipped), from :func:`initial_model` or the weights ``initial``; sequences of ``seq`` tokens; the first
    ``steps`` batches only (default: every batch of every epoch). ``cfg``: the model (an MoE adds its
    load-balancing loss, over the global batch); ``microbatches``: a pipeline's, each with its own load-balancing
    loss (the step's loss: their mean); ``expert_bias``: the routers' bias moved by this rate (:class:`ReferenceBias`)."""
    max_norm = CLIP[accumulate] if clip == -1.0 else (clip if clip is not None else float("inf"))
    model = initial_model(cfg)
    if initial is not None:
        model.load_state_dict(initial)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    balance = ReferenceBias(model, expert_bias) if expert_bias is not None else None
    data = TokenDataset(seq=seq)
    losses, norms = [], []
    for epoch in range(epochs):
        perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        for k in range(len(data) // GLOBAL_BATCH if steps is None else steps):
            tokens = torch.stack([data[i]["tokens"] for i in perm[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]])
            loss = sum(step_loss(model, piece) for piece in tokens.tensor_split(microbatches)) / microbatches
            (loss / accumulate).backward()
            losses.append(loss.item())
            if (k + 1) % accumulate == 0:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
                opt.step()
                opt.zero_grad()
                if balance is not None:
                    balance.step()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return Reference(losses, norms, params, biases=balance.biases() if balance is not None else None)


# The one parity bound, for every layout and model: never loosened.
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-5


def parity_errors(got: dict, ref: Reference, steps: slice = slice(None)) -> tuple[float, float]:
    """A run's (max relative loss error over ``steps`` of the reference, max absolute error over every element of
    every parameter). The run must have trained exactly those steps."""
    losses = ref.losses[steps]
    assert len(got["losses"]) == len(losses) > 0, (len(got["losses"]), len(losses))
    rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], losses, strict=True))
    params = got["params"]
    err = max((params[k if k in params else f"model.{k}"] - v).abs().max().item() for k, v in ref.params.items())
    return rel, err


def fit_estimate_error(ranks: list[dict]) -> float:
    """The worst |estimate / measured - 1| over ranks, of cuboid.measure's parameter bytes per rank (counted from the
    unsharded module before sharding) against the rank's measured DTensor local parameter bytes."""
    worst = 0.0
    for facts in ranks:
        assert facts["estimated_params"] is not None, facts["rank"]
        worst = max(worst, abs(facts["estimated_params"] / facts["bytes"]["params"] - 1))
    return worst


# Muon (issue 70, item 2): the blocks' 2-D weights by Muon, the rest (embeddings, norms, the output) by AdamW
MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1}


def muon_names(model: torch.nn.Module) -> list[str]:
    """The parameters Muon steps: the blocks' matrices (as Muon's authors do: not embeddings, norms or the head)."""
    return [n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("layers.")]


class MuonModule(LlamaModule):
    """The parity Llama with two optimizers, as a Muon user writes it: ``cuboid.optim.Muon`` (Newton-Schulz in
    fp32) for the blocks' matrices and AdamW for the rest, stepped by hand (manual optimization)."""

    def __init__(self, meta_init: bool = False, cfg: LlamaConfig = CFG, everything: bool = False) -> None:
        super().__init__(meta_init, cfg)
        self.automatic_optimization = False
        self.everything = everything  # a mistake to refuse: every parameter (norms too) given to Muon

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = step_loss(self.model, batch["tokens"])
        self.log("train_loss", loss, sync_dist=True)
        for opt in self.optimizers():
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()
        return loss

    def configure_optimizers(self):
        from cuboid.optim import Muon

        matrices = {f"model.{n}" for n in muon_names(self.model)}
        named = dict(self.named_parameters())
        if self.everything:
            return torch.optim.Muon(self.parameters(), lr=MUON["lr"])
        muon = Muon([named[n] for n in sorted(matrices)], **MUON, ns_dtype=torch.float32)
        adamw = torch.optim.AdamW([p for n, p in named.items() if n not in matrices], **ADAMW)
        return [muon, adamw]


def reference_newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Newton-Schulz orthogonalization written out from Keller Jordan's Muon (github.com/KellerJordan/Muon, as
    torch.optim._muon follows it), in fp32: scale to norm 1, work on the wide side, 5 quintic steps."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    if g.shape[0] > g.shape[1]:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


@computed_once
def muon_reference_run(steps: int, cfg: LlamaConfig = CFG) -> Reference:
    """Single-process fp32 training with the same two optimizers as :class:`MuonModule`: Muon written out (momentum
    ``lerp``, Nesterov, :func:`reference_newton_schulz`, the learning rate times ``sqrt(max(1, rows / cols))``,
    decoupled weight decay) for the blocks' matrices, torch's AdamW for the rest; no clipping."""
    model = initial_model(cfg)
    matrices = set(muon_names(model))
    named = dict(model.named_parameters())
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in matrices], **ADAMW)
    momentum = {n: torch.zeros_like(named[n]) for n in matrices}
    data = TokenDataset()
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED)).tolist()
    losses = []
    for k in range(steps):
        tokens = torch.stack([data[i]["tokens"] for i in perm[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]])
        loss = step_loss(model, tokens)
        adamw.zero_grad()
        for n in matrices:
            named[n].grad = None
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for n in sorted(matrices):
                p, g, buf = named[n], named[n].grad, momentum[n]
                buf.lerp_(g, 1 - MUON["momentum"])
                update = reference_newton_schulz(g.lerp(buf, MUON["momentum"]))
                p.mul_(1 - MUON["lr"] * MUON["weight_decay"])
                p.add_(update, alpha=-MUON["lr"] * max(1.0, p.shape[0] / p.shape[1]) ** 0.5)
        adamw.step()
    return Reference(losses, [], {k: v.detach().clone() for k, v in model.named_parameters()})
