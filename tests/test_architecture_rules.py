"""The lower wings are handed what they use (issue 61): no module in a wing folder (``strategy/<wing>/...``) reads
``trainer.strategy`` or sets an attribute of an object it did not make.

"An object it did not make", in practice: ``X.attr = ...`` (or ``setattr(X, ...)``, or ``X.__dict__[...] = ...``)
is fine where ``X`` is ``self``/``cls``, a name the same function (or one around it, or the module) bound to a call
or a ``def``/``class``, or ``self.<name>`` where the class binds ``self.<name>`` to a call. Anything else (a
parameter, an object reached through another, ``trainer.*``, ``strategy.*``) is an offence, named by file, line and
expression. The few that are genuinely needed are listed in ``ALLOWED``, each with its reason; an entry that no
longer matches anything fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

STRATEGY = Path(__file__).resolve().parents[1] / "strategy"

# Folders whose every module is exempt, with the reason.
EXEMPT_FOLDERS = {
    "compat": "the one door to Lightning's, torch's and torchmetrics' internals: setting their private state (the "
    "module's device mesh, the signal connector's handlers, a metric's counters) is what it is for",
}

# (module under strategy/, expression) -> why it is needed. Keyed by expression, not line, so edits elsewhere in a
# module keep the entry; what it allows is only that expression in that module.
ALLOWED = {
    # torch's and Lightning's own APIs, which work by setting an attribute of what they hand over
    ("pipeline/pipelining.py", "p.grad"): "a parameter's gradient is set through its .grad (torch's API): the "
    "gradients kept across Lightning's zero-grad under pp are put back",
    ("dropin/units.py", "module.__class__"): "fully_shard's own way: a module's class swapped for a subclass that "
    "adds the step methods FSDP must see (torch's FSDPModule works the same way)",
    ("parallel/parallelize.py", "block.forward"): "a block's forward wrapped in place (compile, checkpointing), as "
    "torch's parallelize_module and checkpoint_wrapper do",
    ("experts/hf.py", "module.forward"): "a transformers experts module's forward replaced by the expert-parallel "
    "one, in the model being parallelized",
    ("experts/bias.py", "module.forward"): "a router's forward wrapped in place so that its top-k choice adds the "
    "experts' bias (expert_bias_rate), in the model being parallelized",
    ("experts/balance.py", "block.aux_loss"): "a transformers MoE block's auxiliary loss, read by the model's own "
    "forward, replaced by the one summed over the step's ranks",
    ("experts/balance.py", "output.aux_loss"): "a transformers model output's auxiliary loss replaced by the global "
    "one (the output is the model's, handed back to the user)",
    ("experts/balance.py", "output.loss"): "the same output's loss, which includes the auxiliary loss",
    ("step/loss_parallel.py", "F.cross_entropy"): "for one step under loss parallel: torch's cross_entropy, looked "
    "up at call time by F's users, nn.CrossEntropyLoss and transformers, returns a plain tensor; restored after",
    ("step/loss_parallel.py", "lm.__dict__['log']"): "for one step under loss parallel: the LightningModule's log "
    "takes plain tensors (Lightning's log refuses DTensors); removed after",
    ("step/loss_parallel.py", "lm.__dict__['log_dict']"): "the same, for log_dict",
    ("dropin/replicated.py", "precision.autocast_device"): "the strategy's own precision plugin (this mixin is part "
    "of the strategy class): under DDP, bf16-mixed runs under autocast",
    ("parallel/build.py", "weights.kept"): "the weights record made by prepare_weights, filled by the build it hands "
    "it to",
    # the model being parallelized, changed in place by name: nn.Module's own way to put a submodule or parameter
    ("experts/hf.py", "setattr(module, GROUP_ATTR)"): "the experts module being split over ep keeps its group",
    ("experts/hf.py", "setattr(module, name)"): "the experts module's packed parameters replaced by this rank's "
    "block of experts",
    ("dropin/averaging.py", "setattr(copy.get_submodule(owner), leaf)"): "the weight-averaging callback's whole "
    "copy of the model being parallelized: each parameter placed as the live one (and whole again after the run)",
    ("dropin/averaging.py", "setattr(root.get_submodule(owner), attribute)"): "the module's own tuple of copies of "
    "its parameters, placed as its parameters",
    ("dropin/averaging.py", "setattr(owner, attribute)"): "the same tuple whole again after the run",
    ("dropin/kept.py", "object.__setattr__(module, name)"): "a library method of the model kept sharded after the "
    "run, wrapped on the instance to gather what it reads, as torch's register_fsdp_forward_method does; taken "
    "away at the next setup",
    ("parallel/derived.py", "setattr(module, attr)"): "a ParallelStyle's _apply changes the module parallelize_module "
    "hands it (torch's API): an attention module's head counts this rank's",
    ("parallel/batchnorm.py", "setattr(module, name)"): "a BatchNorm child replaced by its synchronized twin, as "
    "torch's SyncBatchNorm.convert_sync_batchnorm does",
    ("parallel/parallelize.py", "setattr(root.get_submodule(owner), attr)"): "tied weights tied again after "
    "sharding: each name points at the one parameter",
    ("pipeline/decoder.py", "setattr(root.get_submodule(parent) if parent else root, name)"): "a stage's decoder "
    "keeps its own pieces: the others are put out of it by path",
    ("pipeline/decoder_probe.py", "parent.__dict__[name]"): "a piece a later stage does not run stands in by shape "
    "(ShapeOnly), holding no parameters",
    ("pipeline/stages.py", "setattr(owner, name)"): "the pieces before the first block and after the last are "
    "dropped from the stages that do not run them",
    ("pipeline/runner.py", "setattr(lm, self.owner_name)"): "for one microbatch the user's model attribute is the "
    "stage (the user's training_step calls self.model once); put back after",
    ("pipeline/runner.py", "lm.__dict__['log']"): "for one microbatch the LightningModule's log is recorded, sent "
    "to every rank after the step; removed after",
    ("pipeline/runner.py", "lm.__dict__['log_dict']"): "the same, for log_dict",
    ("pipeline/results.py", "setattr(metric, name)"): "a torchmetrics list state received from the last stage (the "
    "metric's own state, set as torchmetrics' sync does)",
    ("experts/dispatch.py", "replay[0].taken"): "the module's own RoutingReplay record (made by it, reached through "
    "its ContextVar): how many recorded routings a recompute has taken",
    # the main job (floor 6, above strategy.py): it builds the strategy and the Trainer and uses them as a user does
    ("train/job.py", "strategy.checkpointer.fall_back_when_damaged"): "the main job's ckpt_path=auto: a damaged "
    "checkpoint makes way for an earlier one, on the strategy it built",
}


def _targets(node: ast.AST) -> list[tuple[ast.expr, ast.expr]]:
    """(what is assigned, the object whose attribute it is) for each attribute ``node`` sets."""
    found: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    flat: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            flat.append(target)
    out = []
    for target in flat:
        if isinstance(target, ast.Attribute):
            out.append((target, target.value))
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute):
            if target.value.attr == "__dict__":  # X.__dict__[name] = ...: an attribute of X
                out.append((target, target.value.value))
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        if isinstance(func, ast.Name) and func.id == "setattr":
            out.append((node, node.args[0]))
        elif isinstance(func, ast.Attribute) and func.attr == "__setattr__" and isinstance(func.value, ast.Name):
            out.append((node, node.args[0]))  # object.__setattr__(self, ...) in a frozen dataclass
    return out


def _bound_here(scope: ast.AST) -> set[str]:
    """The names ``scope`` binds to a call, a ``def`` or a ``class`` (its nested functions' own bindings left
    out), and ``self``/``cls``."""
    names = {"self", "cls"}
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, ast.Lambda):
            continue
        value = getattr(node, "value", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(value, ast.Call):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        if isinstance(node, ast.withitem) and isinstance(node.context_expr, ast.Call):
            if isinstance(node.optional_vars, ast.Name):
                names.add(node.optional_vars.id)
        todo.extend(ast.iter_child_nodes(node))
    return names


def _made_self_attributes(cls: ast.ClassDef) -> set[str]:
    """The names ``self.<name>`` a class binds to a call in any of its methods."""
    made = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    if target.value.id == "self":
                        made.add(target.attr)
    return made


def _is_autograd_ctx(name: str, scopes: list[ast.AST]) -> bool:
    """``ctx`` in a ``torch.autograd.Function``'s static forward, backward or setup_context: torch makes it for
    the call and hands it over to carry what backward needs (torch's API)."""
    fn = next((s for s in reversed(scopes) if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    return name == "ctx" and fn is not None and fn.name in ("forward", "backward", "setup_context")


def _reads_trainer_strategy(node: ast.AST) -> bool:
    def trainer_like(expr: ast.expr) -> bool:
        name = expr.id if isinstance(expr, ast.Name) else expr.attr if isinstance(expr, ast.Attribute) else ""
        return name.endswith("trainer")

    if isinstance(node, ast.Attribute) and node.attr == "strategy":
        return trainer_like(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
        args = node.args
        is_strategy = len(args) >= 2 and isinstance(args[1], ast.Constant) and args[1].value == "strategy"
        return is_strategy and trainer_like(args[0])
    return False


def offences(source: str, where: str) -> list[str]:
    """Each read of ``trainer.strategy`` and each attribute set on an object the module did not make, as
    ``where:line: expression (what)``."""
    found: list[str] = []

    def visit(node: ast.AST, scopes: list[ast.AST], bound: list[set[str]], made_self: set[str]) -> None:
        if _reads_trainer_strategy(node):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)} (reads trainer.strategy)")
        for target, owner in _targets(node):
            if isinstance(owner, ast.Name) and (any(owner.id in names for names in bound)):
                continue
            if isinstance(owner, ast.Name) and _is_autograd_ctx(owner.id, scopes):
                continue
            if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name):
                if owner.value.id == "self" and owner.attr in made_self:
                    continue
            shown = ast.unparse(target)
            if isinstance(target, ast.Call):  # setattr(X, name, value): shown without the value
                shown = f"{ast.unparse(target.func)}({', '.join(ast.unparse(a) for a in target.args[:2])})"
            found.append(f"{where}:{target.lineno}: {shown} (sets an attribute of an object it did not make)")
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, [*scopes, child], bound, _made_self_attributes(child))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, [*scopes, child], [*bound, _bound_here(child)], made_self)
            else:
                visit(child, scopes, bound, made_self)

    tree = ast.parse(source)
    visit(tree, [tree], [_bound_here(tree)], set())
    return found


def _expression(offence: str) -> str:
    return offence.split(": ", 1)[1].rsplit(" (", 1)[0]


def _wing_modules() -> list[Path]:
    return [
        path
        for path in sorted(STRATEGY.rglob("*.py"))
        if len(path.relative_to(STRATEGY).parts) > 1 and path.relative_to(STRATEGY).parts[0] not in EXEMPT_FOLDERS
    ]


def test_no_wing_reads_trainer_strategy_or_sets_what_it_did_not_make() -> None:
    found, used = [], set()
    for path in _wing_modules():
        where = path.relative_to(STRATEGY).as_posix()
        for offence in offences(path.read_text(), where):
            key = (where, _expression(offence))
            if key in ALLOWED:
                used.add(key)
            else:
                found.append(offence)
    assert not found, "lower wings must be handed what they use (issue 61):\n" + "\n".join(found)
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"allowed entries that match nothing any more (remove them): {stale}"


def test_the_detector_names_each_kind_of_offence() -> None:
    planted = """
def setup(trainer, strategy, plugin):
    mesh = trainer.strategy.device_mesh
    wait = getattr(trainer, "strategy")
    strategy.precision_plugin.commit = None
    plugin.nonfinite, other = None, 1
    setattr(plugin, "deferred", None)
    plugin.__dict__["log"] = print

class Holder:
    def __init__(self, given):
        self.given = given
        self.own = Own()
        self.own.ready = True        # fine: the class made it
        self.given.ready = True      # not: handed in

def fine(cfg):
    box = Box()
    box.size = 3
    self_made = type("T", (), {})
    self_made.x = 1
    def inner():
        box.size = 4               # a name the enclosing function made
    return inner
"""
    found = offences(planted, "wing/planted.py")
    assert found == [
        "wing/planted.py:3: trainer.strategy (reads trainer.strategy)",
        "wing/planted.py:4: getattr(trainer, 'strategy') (reads trainer.strategy)",
        "wing/planted.py:5: strategy.precision_plugin.commit (sets an attribute of an object it did not make)",
        "wing/planted.py:6: plugin.nonfinite (sets an attribute of an object it did not make)",
        "wing/planted.py:7: setattr(plugin, 'deferred') (sets an attribute of an object it did not make)",
        "wing/planted.py:8: plugin.__dict__['log'] (sets an attribute of an object it did not make)",
        "wing/planted.py:15: self.given.ready (sets an attribute of an object it did not make)",
    ], found


def bypassing_imports(source: str, where: str, wings: set[str]) -> list[str]:
    """Each import in ``source`` (the module ``where`` under strategy/) of a module inside another wing
    (``cuboid.<wing>.<module>``) rather than through that wing's face (``cuboid.<wing>``)."""
    parts = where.split("/")
    own = parts[0] if len(parts) > 1 else None
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            dotted = name.split(".")
            if dotted[0] == "cuboid" and len(dotted) > 2 and dotted[1] in wings and dotted[1] != own:
                found.append(
                    f"{where}:{node.lineno}: {name} (inside the wing {dotted[1]}: import from cuboid.{dotted[1]})"
                )
    return found


def test_wings_are_reached_through_their_faces() -> None:
    """A module imports another wing's names from that wing's ``__init__`` (its face), never from a module inside
    it (issue 67, item 12: ``cuboid.data`` read ``cuboid.train.data``, ``checkpoint/pretrained.py``
    ``cuboid.compat.hf``), so a wing can move its insides without its users knowing."""
    wings = {path.name for path in STRATEGY.iterdir() if (path / "__init__.py").is_file()}
    found = [hit for path in sorted(STRATEGY.rglob("*.py"))
             for hit in bypassing_imports(path.read_text(), path.relative_to(STRATEGY).as_posix(), wings)]  # fmt: skip
    assert not found, "\n".join(found)
    planted = "from cuboid.compat.hf import saved_names\nimport cuboid.train.data\nfrom cuboid.compat import hf\n"
    assert bypassing_imports(planted, "checkpoint/pretrained.py", wings) == [
        "checkpoint/pretrained.py:1: cuboid.compat.hf (inside the wing compat: import from cuboid.compat)",
        "checkpoint/pretrained.py:2: cuboid.train.data (inside the wing train: import from cuboid.train)",
    ]
    assert bypassing_imports("from cuboid.train.data import TokenDataModule\n", "train/job.py", wings) == []


def test_the_top_level_is_left_to_the_glue() -> None:
    """Only wing folders are walked: strategy.py (the glue that makes the collaborators) is not among them."""
    names = {path.relative_to(STRATEGY).as_posix() for path in _wing_modules()}
    assert "strategy.py" not in names and "base.py" not in names
    assert "replicas/groups.py" in names and "job/guard.py" in names and "measure/ledger.py" in names


def test_the_settings_travel_as_one_typed_record() -> None:
    """No module of the package reads its arguments back by name through ``locals()``; each door's settings are one
    frozen BuildSettings whose degrees are typed fields (a checkpoint records them, ``ep`` included)."""
    import dataclasses

    import pytest

    from cuboid import CuboidStrategy
    from cuboid.fabric import CuboidStrategy as FabricStrategy

    calls = [
        f"{path.relative_to(STRATEGY)}:{node.lineno}"
        for path in STRATEGY.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "locals"
    ]
    assert not calls, calls
    for door in (CuboidStrategy, FabricStrategy):
        settings = door(tensor_parallel=2, expert_parallel=2, data_parallel_shard=4).settings
        assert (settings.layout.tp, settings.layout.ep, settings.layout.dp_shard) == (2, 2, 4)
        with pytest.raises(dataclasses.FrozenInstanceError):
            settings.compile = True  # type: ignore[misc]
        assert settings.layout.resolve(8).degrees == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 2,
                                                      "ep": 2}  # fmt: skip
