"""Declarative plans: which modules are the repeated blocks, and how tensor parallel splits them.

A tensor-parallel plan is plain data, a mapping of module-name glob to style string, e.g.
``{"model.layers.*.attention.wq": "colwise"}``. Names are as seen from the LightningModule.
This module resolves the plan (user's, else the model's own ``tp_plan``, else a Hugging Face
style ``_tp_plan`` / ``base_model_tp_plan``), checks it against the model and the tp size
before any work starts, and turns styles into DTensor ``ParallelStyle`` objects.
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from cuboid.adapters import is_lora_layer
from cuboid.experts import experts_modules
from cuboid.parallel.derived import HEAD_COUNTS, derive_plan
from cuboid.parallel.styles import PlanError, canonical_style, sharded_size, to_parallel_style

__all__ = [
    "PlanError",
    "canonical_style",
    "check_tp_divisibility",
    "find_blocks",
    "find_model_plan",
    "language_models",
    "match_plan",
    "parallel_plan",
    "resolve_plan",
    "to_parallel_style",
]


# Plans for transformers base models that carry none, relative to the base model, as a ``base_model_tp_plan`` is.
# GPT-2: its MLP's transposed-weight layers (Conv1D) split as a Llama's are; its attention stays whole on every tp
# rank (its one fused q/k/v layer is split by its forward at the whole width), so its gradients are equal there.
FAMILY_PLANS: dict[str, dict[str, str]] = {
    "GPT2Model": {"h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
}


def find_model_plan(root: nn.Module) -> dict[str, str]:
    """The plan a model carries, with keys prefixed by where the model sits inside ``root``.

    Looks, outermost first, for a ``tp_plan`` attribute (Cuboid's reference models), a Hugging
    Face ``_tp_plan`` attribute, or ``config.base_model_tp_plan``, else Cuboid's plan for a transformers base model
    that has none (:data:`FAMILY_PLANS`). Hugging Face base-model plans
    are relative to the base model (``model.model`` inside a ``*ForCausalLM``). Only a module's own attributes
    count: a wrapper that forwards unknown attributes to what it wraps (PEFT's ``PeftModel`` and ``LoraModel``)
    does not carry the wrapped model's plan under its own names.
    """
    plan: dict[str, str] = {}
    for name, module in root.named_modules():
        prefix = f"{name}." if name else ""
        own = _own_attr(module, "tp_plan") or _own_attr(module, "_tp_plan")
        if not own:
            config = _own_attr(module, "config")
            own = getattr(config, "base_model_tp_plan", None) if config is not None else None
            if own and not _looks_like_base_model(module):
                own = None
            if not own and config is not None:
                own = FAMILY_PLANS.get(type(module).__name__)
        if isinstance(own, Mapping):
            for key, style in own.items():
                plan.setdefault(prefix + key, style)
    return plan


def _own_attr(module: nn.Module, name: str) -> object:
    """``getattr`` without ``__getattr__``: the module's instance attribute or its class's, else ``None``."""
    if name in vars(module) or any(name in vars(cls) for cls in type(module).__mro__):
        return getattr(module, name, None)
    return None


def _looks_like_base_model(module: nn.Module) -> bool:
    return hasattr(module, "layers") or hasattr(module, "h")


def match_plan(root: nn.Module, plan: Mapping[str, str]) -> dict[str, tuple[nn.Module, str]]:
    """Expand globs to concrete module names: ``{name: (module, style)}``.

    Raises :class:`PlanError` for an unknown style or a pattern that matches no module.
    """
    modules = dict(root.named_modules())
    matched: dict[str, tuple[nn.Module, str]] = {}
    for pattern, style in plan.items():
        name = canonical_style(style, pattern)
        hits = [m for m in modules if m and fnmatch.fnmatchcase(m, pattern)]
        if not hits:
            params = [n for n, _ in root.named_parameters() if fnmatch.fnmatchcase(n, pattern)]
            if params:
                raise PlanError(
                    f"Tensor-parallel plan pattern {pattern!r} ({style!r}) names parameters ({params[:2]}), not modules; "
                    "Cuboid applies styles to modules only. Leave the entry out (the parameter stays replicated over "
                    "tp and sharded by FSDP) or give the plan its owning module."
                )
            close = [m for m in modules if m and m.split(".")[-1] == pattern.split(".")[-1]][:3]
            hint = f" Modules with that last name: {close}." if close else ""
            raise PlanError(
                f"Tensor-parallel plan pattern {pattern!r} matches no module of {type(root).__name__}. "
                f"Keys are module names as seen from the LightningModule (e.g. 'model.layers.*.attention.wq' "
                f"when the network is self.model).{hint}"
            )
        for hit in hits:
            matched[hit] = (modules[hit], name)
    return matched


_ADAPTER_PART = re.compile(r"\.(base_layer|lora_[AB]\.[^.]+)$")


def check_tp_divisibility(root: nn.Module, matched: Mapping[str, tuple[nn.Module, str]], tp: int) -> None:
    """Fail early when ``tp`` does not divide a sharded dimension or a head count."""
    if tp == 1:
        return
    problems: list[str] = []
    for name, (module, style) in matched.items():
        split = sharded_size(module, style)
        if split is not None and split[0] % tp != 0:
            problems.append(
                f"{name} ({type(module).__name__}, {style}): {split[1]} {split[0]} is not divisible by tp={tp}"
            )
    owners = {_ADAPTER_PART.sub("", n) for n in matched}  # a LoRA layer's parts: the layer's own parent
    parents = {n.rsplit(".", 1)[0] for n in owners if "." in n}
    modules = dict(root.named_modules())
    for parent in sorted(parents):
        owner = modules.get(parent)
        config = getattr(owner, "config", None)  # Hugging Face attention modules keep head counts there
        for source, where in ((owner, parent), (config, f"{parent}.config")):
            for attr in HEAD_COUNTS:
                heads = getattr(source, attr, None)
                if isinstance(heads, int) and heads % tp != 0:
                    problems.append(f"{where}.{attr} = {heads} is not divisible by tp={tp}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise PlanError(
            f"tensor_parallel={tp} does not fit the model: {shown}. Choose a tensor_parallel size that divides "
            f"these sizes, or leave those modules out of the plan."
        )


def usable_model_plan(root: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """A model's own plan as it applies to this model (a user's plan is taken as written):

    * an MoE model's entries that would split its packed experts over tp (transformers' ``moe_tp_experts``,
      ``packed_colwise``, and the ``rowwise`` it gives ``experts.down_proj``) are left out: Cuboid keeps each MoE
      layer's experts whole on every tp rank (split over ``expert_parallel`` ranks instead, if asked) and runs
      them on the whole batch there, the router (replicated) choosing alike on every tp rank;
    * and so are entries for module kinds the model does not have, as transformers leaves them: a family's plan
      covers every module its configs can build (Qwen3-MoE's also covers dense layers, ``mlp.gate_proj``, that a
      config without ``mlp_only_layers`` never builds; Doge's covers ``mlp.router_gate``, built only with
      ``is_moe``).
    """
    from lightning.pytorch.utilities import rank_zero_info

    experts = [name for name, _ in experts_modules(root)]
    names = [n for n, _ in root.named_modules() if n]
    absent = [
        p for p in plan if not any(fnmatch.fnmatchcase(n, p) for n in names) and not (experts and ".experts" in p)
    ]
    if absent:
        rank_zero_info(f"Cuboid: the model's tensor-parallel plan names modules this model does not build: {absent}")
    plan = {p: style for p, style in plan.items() if p not in absent}
    if not experts:
        return plan
    inside = [*experts, *(f"{e}.{n}" for e in experts for n, _ in root.get_submodule(e).named_parameters())]

    def splits_experts(pattern: str, style: str) -> bool:
        if style.startswith(("moe_", "ep_", "grouped_", "packed_")):
            return True
        return any(fnmatch.fnmatchcase(name, pattern) for name in inside)

    dropped = [p for p, style in plan.items() if splits_experts(p, style)]
    if dropped:
        rank_zero_info(f"Cuboid: the experts stay whole on every tp rank (left out of the tp plan: {dropped})")
    return {p: style for p, style in plan.items() if p not in dropped}


def resolve_plan(root: nn.Module, plan: Mapping[str, str] | None, tp: int) -> dict[str, tuple[nn.Module, str]]:
    """The tensor-parallel plan that applies to ``root`` (a LightningModule) at this ``tp``, checked.

    ``plan``: the user's, else the model's own (:func:`find_model_plan`). Refuses, before any work, a plan that
    does not fit ``tp``, and ``tp > 1`` without any plan.
    """
    if tp == 1:
        return {}
    if plan is None:
        plan = usable_model_plan(root, find_model_plan(root)) or _derived_plan(root)
    matched = _split_adapters(match_plan(root, plan))
    check_tp_divisibility(root, matched, tp)
    if not matched:
        raise PlanError(
            f"tensor_parallel={tp} but {type(root).__name__} carries no tensor-parallel plan. Pass "
            "tensor_parallel_plan={'model.layers.*.attn.q_proj': 'colwise', ...} or use tensor_parallel=1."
        )
    return matched


def _derived_plan(root: nn.Module) -> dict[str, str]:
    """For a model that carries no plan: the one its blocks' structure gives (:mod:`cuboid.parallel.derived`), said."""
    from lightning.pytorch.utilities import rank_zero_info

    plan = derive_plan(find_blocks(root))
    if plan:
        rank_zero_info(
            f"Cuboid: {type(root).__name__} carries no tensor-parallel plan; this one is read from its blocks' "
            f"structure (pass tensor_parallel_plan= to change it): {plan}"
        )
    return plan


# A LoRA layer's styles by which of its adapter's two matrices shares the base layer's split: the one whose output
# features (lora_B) are the base's output features, or whose input features (lora_A) are the base's input features.
_SPLIT_OUTPUT = ("colwise", "output", "loss_parallel")
_SPLIT_INPUT = ("rowwise", "rowwise_split_input", "rowwise_sequence")


def _split_adapters(matched: Mapping[str, tuple[nn.Module, str]]) -> dict[str, tuple[nn.Module, str]]:
    """A plan entry on a PEFT LoRA layer (``q_proj`` after ``get_peft_model``), as the layer's parts:

    * output features split (``colwise``, ``output``, ``loss_parallel``): the base layer and ``lora_B`` split the
      same way, ``lora_A`` (rank x input features) whole on every tp rank, given the input as a local tensor
      (``local_input``: a DTensor input, gathered inside Cuboid's Llama, made whole first); ``B(A x)`` arrives
      split like the base's output and is added to it;
    * input features split (``rowwise`` and its kinds): the base layer and ``lora_A`` split over input features,
      each output summed over tp, ``lora_B`` whole on every tp rank (under ``rowwise_sequence`` its input, and
      the output, split along the sequence, its gradient summed over tp: ``sequence_local``).

    This is PEFT's own rule for transformers' tensor parallel. Other styles on a LoRA layer, LoRA on embeddings and
    DoRA (its magnitude needs the whole base weight's norms) are refused by name.
    """
    out: dict[str, tuple[nn.Module, str]] = {}
    for name, (module, style) in matched.items():
        if not is_lora_layer(module):
            out[name] = (module, style)
            continue
        base = module.base_layer
        adapters = list(module.lora_A.keys())
        problem = None
        if style not in _SPLIT_OUTPUT + _SPLIT_INPUT:
            problem = f"style {style!r} has no LoRA counterpart (Cuboid splits LoRA layers colwise or rowwise)"
        elif not isinstance(base, nn.Linear) or is_lora_layer(base) or not adapters:
            problem = f"its base layer is a {type(base).__name__}, not an nn.Linear (LoRA on embeddings, nested LoRA)"
        elif any(module.use_dora.get(a) for a in adapters):
            problem = "it uses DoRA, whose magnitude needs the norms of the whole (unsplit) base weight"
        if problem is not None:
            raise PlanError(
                f"tensor_parallel cannot split the LoRA layer {name!r}: {problem}. Leave it out of LoraConfig's "
                "target_modules, or out of the tensor-parallel plan (pass tensor_parallel_plan= without it)."
            )
        out[f"{name}.base_layer"] = (base, style)
        part = "lora_B" if style in _SPLIT_OUTPUT else "lora_A"
        for adapter in adapters:
            out[f"{name}.{part}.{adapter}"] = (getattr(module, part)[adapter], style)
            if style in _SPLIT_OUTPUT:  # A sees the base layer's input: a local tensor, even where it is a DTensor
                out[f"{name}.lora_A.{adapter}"] = (module.lora_A[adapter], "local_input")
            elif style == "rowwise_sequence":  # B sees A's output split along the sequence: its gradient summed
                out[f"{name}.lora_B.{adapter}"] = (module.lora_B[adapter], "sequence_local")
    return out


def parallel_plan(
    matched: Mapping[str, tuple[nn.Module, str]], root: nn.Module | None = None
) -> dict[str, ParallelStyle]:
    """Concrete module names (of ``root``) -> DTensor styles, for ``parallelize_module``."""
    styles = {
        name: to_parallel_style(style, _rope_dim(root, name) if style == "mla_kv_a_proj" else None)
        for name, (_, style) in matched.items()
    }
    return {name: style for name, style in styles.items() if style is not None}


def _rope_dim(root: nn.Module | None, name: str) -> int:
    """The rotary features of an MLA K/V down-projection's output: ``qk_rope_head_dim`` of the attention module
    that owns it (or of its ``config``), as transformers' DeepSeek attention keeps it."""
    owner = root.get_submodule(name.rpartition(".")[0]) if root is not None and "." in name else None
    for source in (owner, getattr(owner, "config", None)):
        dim = getattr(source, "qk_rope_head_dim", None)
        if isinstance(dim, int):
            return dim
    raise PlanError(
        f"{name}: 'mla_kv_a_proj' splits the projection's output into its compressed K/V and its rotary key, whose "
        "width it reads from the owning attention module's qk_rope_head_dim (or its config's); "
        f"{type(owner).__name__ if owner is not None else 'the owner'} has none. Give the attention module that "
        "attribute, or use tensor_parallel=1 for this model (without the entry the rotary key's gradient would be this "
        "rank's heads' share only)."
    )


def find_blocks(root: nn.Module, container: str | None = None) -> list[tuple[str, nn.Module]]:
    """The repeated unit of the model: the children of a ModuleList/ModuleDict that its forward runs one after another.

    These are the units of FSDP sharding, activation checkpointing and pipeline splitting. With
    ``container`` (e.g. ``"model.layers"``) the choice is explicit; otherwise, of the containers whose children
    are blocks (:func:`_is_stack`), the one with the most children wins (ties: the outermost), looked for inside
    a composite model's language model first (:func:`language_models`): a vision-language model's decoder layers,
    not its vision tower's. Returns ``[(name, module), ...]``.
    """
    modules = dict(root.named_modules())
    if container is not None:
        found = modules.get(container)
        if not isinstance(found, (nn.ModuleList, nn.ModuleDict)):
            candidates = [n for n, m in modules.items() if isinstance(m, (nn.ModuleList, nn.ModuleDict))]
            raise PlanError(
                f"block container {container!r} is not a ModuleList/ModuleDict of {type(root).__name__}. "
                f"Candidates: {candidates[:8]}."
            )
        return [(f"{container}.{k}", m) for k, m in found.named_children()]
    stacks = [(name, module) for name, module in modules.items() if _is_stack(module)]
    texts = tuple(f"{name}." for name in language_models(root))
    inside = [(name, module) for name, module in stacks if name.startswith(texts)]
    best: list[tuple[str, nn.Module]] = []
    for name, module in inside or stacks:
        if len(module) > len(best):
            best = [(f"{name}.{k}" if name else k, c) for k, c in module.named_children()]
    return best


def _is_stack(module: nn.Module) -> bool:
    """A ModuleList/ModuleDict of blocks: two or more children with parameters, of one class, or of several
    classes that are each made of modules and take their input under one name (a decoder whose self-attention
    layers and cross-attention layers alternate: Mllama's; a hybrid's attention and state-space layers)."""
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return False
    children = [c for _, c in module.named_children()]
    if len(children) < 2 or not all(any(True for _ in c.parameters()) for c in children):
        return False
    kinds = {type(c) for c in children}
    if len(kinds) == 1:
        return True
    firsts = {_first_input(kind) for kind in kinds}
    return all(any(True for _ in c.children()) for c in children) and len(firsts) == 1 and None not in firsts


def _first_input(kind: type) -> str | None:
    """The name of a module class's first forward argument (``hidden_states``), None when it has none."""
    try:
        params = list(inspect.signature(kind.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return params[0].name if params and params[0].kind in positional else None


def language_models(root: nn.Module) -> list[str]:
    """The names of a composite model's language models in ``root``: the modules whose ``config`` is the text
    config of a model above them (transformers' ``config.get_text_config()``, e.g. a vision-language model's
    ``model.language_model``). Empty for a model that is not a composite."""
    found: list[str] = []
    texts: list[object] = []
    for name, module in root.named_modules():
        config = _own_attr(module, "config")
        if config is None:
            continue
        if any(config is text for text in texts) and not any(name.startswith(f"{f}.") for f in found):
            found.append(name)
            continue
        text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else None
        if text is not None and text is not config:
            texts.append(text)
    return found


def with_loss_parallel(
    matched: dict[str, tuple[Any, str]], pp: int, cp: int = 1
) -> tuple[dict[str, tuple[Any, str]], bool]:
    """The plan to apply and whether loss parallel is on: whenever the plan asks for it. Under pp > 1 the
    schedule (the last stage's loss function and backward) runs inside the strategy's loss-parallel context. Under
    cp > 1 context parallel's loss takes each token's loss from the vocabulary-sharded logits (``reduction="none"``
    under ``loss_parallel()``), then gathers the tokens' losses over the sequence shards."""
    uses = any(style == "loss_parallel" for _, style in matched.values())
    return matched, uses


def without_loss_parallel(matched: dict[str, tuple[Any, str]]) -> dict[str, tuple[Any, str]]:
    """The plan with every ``"loss_parallel"`` entry applied as ``"output"`` (logits gathered, plain): for a loss
    computed where no strategy context runs (a pipeline's last stage, a Fabric loop)."""
    return {name: (module, "output" if s == "loss_parallel" else s) for name, (module, s) in matched.items()}
