"""Starting the processes of one job: Lightning's script launcher, made safe for Hydra sweeps.

Lightning's launcher re-runs ``sys.argv`` in each child. Under ``hydra -m`` that argv is the
whole sweep, so every child would run every job; and after the first job the parent keeps the
``LOCAL_RANK``/``MASTER_PORT`` it set, so the next job believes its processes were started
externally and spawns none. Cuboid's launcher starts each child on exactly its job (the
composed config Hydra saved in the job's output directory), and clears the variables it set
once the job ends, so the next job of a sweep starts its own process group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from lightning.fabric.plugins import ClusterEnvironment
from typing_extensions import override

from cuboid.compat import (
    SubprocessScriptLauncher,
    basic_subprocess_cmd,
    distributed_is_initialized,
    init_dist_connection,
)
from cuboid.job import elastic
from cuboid.parallel import LayoutError

_SET_BY_LAUNCHER = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
_MARKER = "CUBOID_LAUNCHED"  # "<pid of the launching process>|<hydra job output dir>"


def _current_job() -> str:
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return ""
    return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else ""


def forget_previous_launch() -> None:
    """Start the next Hydra job of a sweep afresh in the process that launched the previous one.

    Drops the rank variables this process set for the earlier job and its process group, so this
    job launches its own processes (possibly a different number) on a new port. A second Trainer
    inside the *same* job keeps them, exactly as with Lightning's own launcher.
    """
    marker = os.environ.get(_MARKER, "")
    pid, _, job = marker.partition("|")
    if pid != str(os.getpid()) or job == _current_job():
        return
    for key in (*_SET_BY_LAUNCHER, _MARKER):
        os.environ.pop(key, None)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


_AT_EXIT_REGISTERED = False


def destroy_process_group_at_exit() -> None:
    """Close the process groups (:func:`close_process_groups`) when the interpreter exits."""
    global _AT_EXIT_REGISTERED
    if _AT_EXIT_REGISTERED:
        return
    _AT_EXIT_REGISTERED = True
    import atexit

    atexit.register(close_process_groups)


def close_process_groups(timeout: float = 5.0) -> None:
    """Destroy every process group and wait, at most ``timeout`` seconds, until no gloo thread is still working.

    Why: a gloo worker thread drops its last reference to a finished collective just after completing it; when
    Python made that collective's tensors, the drop frees Python objects and takes the GIL. If the interpreter has
    begun to finalize by then, the thread is ended inside C++ and the process aborts ("terminate called without an
    active exception", SIGABRT) although all its work was done (pytorch/pytorch#179291, #190489). Destroying the
    groups ends their threads only for groups nothing else still holds (a mesh, a strategy or a closure keeps its
    groups and their threads alive), so after it this waits, with the GIL released, until every gloo thread of the
    process is asleep (none runnable) on two looks 20 ms apart.
    """
    import gc
    import time

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # groups only a reference cycle held are destroyed now (their threads joined without the GIL)
    deadline, quiet = time.monotonic() + timeout, 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
        quiet = quiet + 1 if not _busy_gloo_threads() else 0


def _busy_gloo_threads() -> list[str]:
    """This process's gloo threads (``pt_gloo_*``, ``gloo_*``) that are running or runnable (state R)."""
    import os

    busy = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # not Linux: nothing to look at
        return busy
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if not name.startswith(("pt_gloo", "gloo")):
                continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state == "R":
            busy.append(name)
    return busy


def _hydra_job_command(local_rank: int) -> tuple[Sequence[str], str] | None:
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return None
    if not HydraConfig.initialized():
        return None
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    hydra_cfg = HydraConfig.get()
    job_dir = hydra_cfg.runtime.output_dir
    if hydra_cfg.output_subdir is None:
        raise RuntimeError(
            "CuboidStrategy starts each process on the job's saved config, but hydra.output_subdir is null. "
            "Keep the default (.hydra) so the composed config is written to the job directory."
        )
    config_dir = os.path.join(job_dir, hydra_cfg.output_subdir)
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += [
        f"--config-path={config_dir}",
        "--config-name=config",
        f"hydra.run.dir={job_dir}",
        "hydra.output_subdir=null",
        f"hydra.job.name={hydra_cfg.job.name}_rank{local_rank}",
        "hydra/hydra_logging=disabled",
        "hydra/job_logging=disabled",
    ]
    return command, get_original_cwd()


class CuboidLauncher(SubprocessScriptLauncher):
    """Lightning's subprocess launcher, but each child runs exactly the current Hydra job."""

    @override
    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        self.procs = []
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        os.environ[_MARKER] = f"{os.getpid()}|{_current_job()}"
        for local_rank in range(1, self.num_processes):
            env = os.environ.copy()
            env["LOCAL_RANK"] = str(local_rank)
            env.pop(_MARKER, None)
            hydra_job = _hydra_job_command(local_rank)
            if hydra_job is not None:
                command, cwd = hydra_job
            else:
                command, cwd = basic_subprocess_cmd(), None
            self.procs.append(subprocess.Popen(command, env=env, cwd=cwd))


def check_before_launch(
    cluster_environment: ClusterEnvironment, num_nodes: int, num_processes: int, cpu_offload: bool, device: Any
) -> None:
    """What can be refused in the launching process, before any child process or process group exists."""
    if cpu_offload and device.type == "cpu":
        raise ValueError(
            "cpu_offload=True moves sharded parameters, gradients and optimizer state from accelerator memory to "
            "host memory; with accelerator='cpu' they already are there. Set cpu_offload=False."
        )
    check_slurm_tasks(cluster_environment, num_nodes, num_processes)


_POD = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")  # a PyTorchJob pod's, without torchrun


def pod_environment(current: ClusterEnvironment) -> ClusterEnvironment:
    """Lightning's ``KubeflowEnvironment`` for a Kubeflow PyTorchJob pod that runs the job without a launcher, else
    ``current``. The operator gives each pod MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (every pod has
    KUBERNETES_PORT), but Lightning cannot detect it (``KubeflowEnvironment.detect`` raises) and falls back to its own
    environment, under which every pod takes itself for rank 0: the second to bind the store's port fails with
    EADDRINUSE and the others wait for it. Under torchrun (``PET_*``) Lightning's TorchElasticEnvironment is chosen
    instead, and a process Cuboid's own launcher started (LOCAL_RANK set) keeps Lightning's environment."""
    from lightning.fabric.plugins.environments import KubeflowEnvironment, LightningEnvironment

    if type(current) is not LightningEnvironment or "LOCAL_RANK" in os.environ:
        return current
    if not all(os.environ.get(key) for key in _POD):
        return current
    if os.environ["RANK"] == "0":
        print(
            f"Cuboid: a Kubeflow PyTorchJob's pods ({', '.join(_POD)} set): rank {os.environ['RANK']} of "
            f"{os.environ['WORLD_SIZE']} through Lightning's KubeflowEnvironment, one process per pod",
            file=sys.stderr,
            flush=True,
        )
    return KubeflowEnvironment()


def prepare_launch(
    env: ClusterEnvironment, num_nodes: int, devices: int, layout: Any, cpu_offload: bool, root_device: Any
) -> tuple[ClusterEnvironment, int]:
    """What is decided before any child process or process group exists: a PyTorchJob pod's environment
    (:func:`pod_environment`), the nodes of a torchrun round (:func:`adopt_elastic_round`), then the launch checks,
    and a previous Hydra job's launch forgotten. ``root_device``: a callable (it reads the local rank, which the
    external launch check vouches for first). Returns the cluster environment and the node count to train with."""
    env = pod_environment(env)
    nodes = adopt_elastic_round(num_nodes, devices, layout)
    check_external_launch(env, nodes, devices)
    check_before_launch(env, nodes, devices, cpu_offload, root_device())
    forget_previous_launch()
    return env, nodes


def adopt_elastic_round(num_nodes: int, devices: int, layout: Any) -> int:
    """The Trainer's node count for this torchrun round: ``num_nodes``, or the round's where torchrun may restart
    with another (:func:`cuboid.job.elastic.nodes_this_round`), said on rank 0 with the layout it trains at."""
    nodes = elastic.nodes_this_round(num_nodes, devices)
    if nodes != num_nodes and os.environ.get("RANK", "0") == "0":
        print(
            f"Cuboid: torchrun formed this round with {nodes} node(s) of {devices} process(es) (the Trainer was given "
            f"num_nodes={num_nodes}): training at {nodes * devices} processes, layout {layout.resolve(nodes * devices).describe()}"
            "; a checkpoint resumes resharded to it",
            file=sys.stderr,
            flush=True,
        )
    return nodes


def check_external_launch(env: ClusterEnvironment, num_nodes: int, devices: int) -> None:
    """Processes started by torchrun (or another external launcher) must be what the Trainer expects: its world
    size num_nodes x devices, and this process's local rank one of the devices."""
    if not env.creates_processes_externally:
        return
    check_slurm_tasks(env, num_nodes, devices)  # SLURM's own message first
    world, local = env.world_size(), env.local_rank()
    if world != num_nodes * devices and any(c.__name__ == "RayLightningEnvironment" for c in type(env).__mro__):
        raise LayoutError(
            f"Ray started {world} workers, but the Trainer expects num_nodes ({num_nodes}) x devices ({devices}) = "
            f"{num_nodes * devices}. Under Ray Train use cuboid.ray.RayCuboidStrategy (the cuboid[ray] extra), which "
            "takes the world from Ray's workers as Ray's own strategies do."
        )
    if world != num_nodes * devices or local >= devices:
        raise LayoutError(
            f"The launcher started {world} processes (this one local rank {local}), but the Trainer expects "
            f"num_nodes ({num_nodes}) x devices ({devices}) = {num_nodes * devices}. Set Trainer(devices=...) to the "
            "processes per node (torchrun's --nproc-per-node, SLURM's --ntasks-per-node) and num_nodes to the nodes."
        )


def slurm_job_id() -> str | None:
    """This SLURM job's id as ``scontrol`` takes it (an array task's ``<array job>_<task>``), or None outside SLURM."""
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID") or None


def check_slurm_tasks(env: ClusterEnvironment, num_nodes: int, devices: int) -> None:
    """SLURM's task count must equal nodes x tasks per node (Lightning checks only the latter)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not isinstance(env, SLURMEnvironment):
        return
    ntasks = int(os.environ.get("SLURM_NTASKS", num_nodes * devices))
    if ntasks != num_nodes * devices:
        raise LayoutError(
            f"SLURM runs {ntasks} tasks (SLURM_NTASKS) but the Trainer expects num_nodes ({num_nodes}) x devices "
            f"({devices}) = {num_nodes * devices}. Submit with --nodes={num_nodes} --ntasks-per-node={devices}, "
            f"or set trainer.num_nodes / trainer.devices to match the allocation."
        )


def start_process_group(cluster_environment: ClusterEnvironment, backend: str, device: Any, timeout: Any) -> None:
    """Initialize the default process group (``device_id`` bound on accelerators) and destroy it at exit."""
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    if elastic.restarting() and not distributed_is_initialized():  # torchrun --max-restarts (cuboid.job.elastic)
        env = cluster_environment
        kwargs["store"] = elastic.round_store(env.global_rank(), env.world_size(), timeout)  # this round's own
    init_dist_connection(cluster_environment, backend, **kwargs)
    destroy_process_group_at_exit()
