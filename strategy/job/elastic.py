"""A restart under torchrun (``--max-restarts N``): every worker starts afresh in a store of its round's own.

Why today's agents lost the job instead of restarting it (read from torch 2.13's sources and torchrun's logs):
torchrun's elastic agent hosts one TCPStore for the whole job (``elastic/rendezvous/dynamic_rendezvous.py``: the
``_shared_tcp_store_server`` is made at the first rendezvous and kept for every later round) and hands every
worker its address with ``TORCHELASTIC_USE_AGENT_STORE=True``. ``torch/distributed/rendezvous.py``
``_create_c10d_store`` then connects each worker to it with no per-attempt prefix ("We create a new TCPStore for
every retry so no need to add prefix for each attempt", which stopped holding when the store became shared). The
keys the dead round wrote stay, so at the restart the default group's rendezvous reads a dead peer's address and
every worker fails with ``Gloo connectFullMesh failed ... Connection refused`` (NCCL would read a dead round's
unique id); each agent spends its restarts on that and exits 1. ``TORCHELASTIC_RESTART_COUNT`` cannot name the
round either: an agent that restarts its healthy workers because another node rejoined keeps its count (measured:
0 on one node, 1 on the other, in the same round).

A round may also hold fewer nodes than the Trainer was given (``--nnodes 1:2``, one node lost), or more: the
Trainer then trains at the nodes of the round (:func:`nodes_this_round`, said in one line with the layout it
resumes at), and the checkpoint reshards to it.

So when torchrun may restart (:func:`restarting`), the default group's rendezvous goes through a store of the
round's own (:func:`round_store`): rank 0's process hosts a fresh TCPStore and publishes its address, with a token,
in the agent's store; every other rank reads that address, which may still be a previous round's (its process is
gone), connects, and retries until it reaches a live store holding the same token. Setting
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun does the same from outside (each round's rank 0 worker hosts
the store on a new port), and then nothing here is needed.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

ADDRESS_KEY = "cuboid/elastic/round_store"  # in the agent's store: "<port>:<token>" of this round's store
OWNER_KEY = "cuboid/elastic/owner"  # in the round's store: its token
PROBE = timedelta(seconds=2)  # how long one try to reach a published store waits


def _listening(host: str, port: int) -> bool:
    """Whether something accepts connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=PROBE.total_seconds()):
            return True
    except OSError:
        return False


def restarting(env: Any = os.environ) -> bool:
    """Whether torchrun may restart this job's workers inside the store its agent shares with them."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0


def nodes_this_round(num_nodes: int, devices: int, env: Any = os.environ) -> int:
    """The nodes torchrun formed this round with, where it may restart with another count (``--nnodes MIN:MAX``
    with ``--max-restarts``: a lost node's survivors re-form without it, a returning node joins at the next
    restart), else ``num_nodes``. Only a round of ``devices`` processes per node is taken: any other count is
    left to the launch check, which refuses it by name."""
    if not restarting(env) or "GROUP_WORLD_SIZE" not in env:
        return num_nodes
    nodes, per_node = int(env["GROUP_WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", devices))
    return nodes if per_node == devices and nodes != num_nodes else num_nodes


def round_store(rank: int, world_size: int, timeout: timedelta, env: Any = os.environ) -> Any:
    """A TCPStore of this round alone (see the module docstring), for ``init_process_group(store=...)``. Rank 0's
    process hosts it; the others find it through the agent's store at ``MASTER_ADDR:MASTER_PORT``."""
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    agent = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if rank == 0:
        store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        token = f"{os.getpid()}-{time.time_ns()}"
        store.set(OWNER_KEY, token)
        agent.set(ADDRESS_KEY, f"{store.port}:{token}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        published = agent.get(ADDRESS_KEY).decode()  # waits (up to the timeout) for the first round's
        round_port, _, token = published.partition(":")
        try:
            if _listening(host, int(round_port)):  # (a TCPStore client would log a C++ trace per failed try)
                store = dist.TCPStore(host, int(round_port), world_size, is_master=False, timeout=PROBE)
                if store.get(OWNER_KEY).decode() == token:
                    store.set_timeout(timeout)
                    return store
        except (RuntimeError, ValueError):  # not this round's store: a previous round's, its host process gone
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"torchrun restart: rank {rank} found no live store of this round at {host} (the last address "
                f"published, {published}, belongs to a round whose rank 0 is gone) within "
                f"{timeout.total_seconds():.0f} s. Rank 0's process did not start; its log says why."
            )
        time.sleep(0.2)
