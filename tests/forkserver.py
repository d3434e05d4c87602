"""The suite's launcher of multi-process runs: one process that has imported torch, Lightning, transformers and
Cuboid once, and forks a run's ranks from that state.

A rank of a fresh ``torchrun`` spends about 5 CPU-seconds importing before its first line of work (torch 1.3,
Lightning 3.5 with torchmetrics, which imports transformers and scipy); on 2 cores, 8 such ranks take 18 s of wall
time before any spec starts. A rank forked from here starts at its script's first line with those modules loaded.

Each rank is an ordinary process: its own interpreter state from the fork on, its own gloo process group over
TCP, the environment torchrun gives a worker (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``ROLE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ...), so Lightning
and Cuboid see a TorchElastic launch; its script runs as ``__main__`` (``sys.argv``, ``sys.path[0]`` and the
working directory as ``python SCRIPT ARGS`` sets them) and the process ends through the interpreter's normal exit
(atexit handlers, thread joins). The server is forked before any thread exists (checked at start: fork copies
only the calling thread).

Protocol (one Unix socket, one JSON line per request). Ranks: the client sends ``{"script", "args", "nprocs",
"env", "cwd", "log", "master_port"}``; the server forks an *agent* in a session of its own, which forks the ranks
(their stdout and stderr appended to ``log``), answers ``{"agent": pid}``, waits for them and answers
``{"codes": [...]}``. A plain ``python ARGV`` run (``{"kind": "run", "argv", "env", "cwd"}``, the caller's stdin,
stdout and stderr passed along as file descriptors): the agent forks one process with them and answers
``{"agent", "pid"}``, then ``{"code"}``; that process's ``sys.executable`` is a shim that sends the same request,
so what it launches (Lightning's launcher runs ``sys.executable SCRIPT ARGS`` for the other local ranks) is forked
from here as well. A request this server cannot honour (interpreter options, or a changed start-up variable such as
``PYTHONWARNINGS``, read once by a fresh interpreter) is answered ``{"fallback": why}``: the caller then runs a
fresh interpreter. When a rank fails, the agent gives
the others ``GRACE`` seconds to end on their own (Cuboid's watchdogs stop the survivors of a dead rank), then sends
SIGABRT (faulthandler prints each one's Python stacks to the log) and SIGKILL. The client kills the agent's whole
session on a timeout, so no rank outlives its test.

Usage: python forkserver.py SOCKET_PATH  (tests/harness.py starts it once per pytest session, stops it at the end)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

SHIM = ""  # the shim interpreter's path (written next to the socket by serve)
GRACE = 20.0  # seconds the other ranks get to end after one fails (a dead peer's watchdog timeout is 6-10 s)
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.run",
    "lightning",
    "lightning.pytorch",
    "lightning.pytorch.loggers",
    # (not pytorch_lightning: importing it points lightning_utilities' rank-zero logger, shared by both packages, at
    # its own; the workers of tests/parallel/test_pytorch_lightning.py import it themselves)
    "torchmetrics",
    "cuboid",
    "cuboid.models",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.gpt_oss.modeling_gpt_oss",
    "peft",
    "omegaconf",
    "hydra",
)


def preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional extra that is not installed: its ranks import it themselves
            pass
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # fork copies only the calling thread: a pool started at import would be broken in the ranks
        raise RuntimeError(f"the fork server holds {threads} threads after its imports; it can only fork from one")
    # Every object the imports made moves to the permanent generation: a rank's garbage collections (automatic
    # ones, close_process_groups' gc.collect, finish's scan) then never walk them, so they neither cost the walk
    # (about 470,000 objects) nor write to the pages the ranks share with the server (copy-on-write). An empty
    # 8-rank launch (init gloo, all-reduce, close): 2.5 s -> 0.55 s.
    import gc

    gc.collect()
    gc.freeze()


def rank_env(request: dict, rank: int, run_id: str) -> dict[str, str]:
    """The environment torchrun's agent gives worker ``rank`` of a one-node launch."""
    n = request["nprocs"]
    env = dict(request["env"])
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(n),
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(n),
            "ROLE_NAME": "default",
            "MASTER_ADDR": request.get("master_addr", "127.0.0.1"),
            "MASTER_PORT": str(request["master_port"]),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        }
    )
    return env


def become_rank(request: dict, rank: int, run_id: str, log_fd: int) -> None:
    """In a forked child: take the rank's environment, working directory, output and ``sys.argv``."""
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    reset_process_state(rank_env(request, rank, run_id))
    os.chdir(request["cwd"])
    script = os.path.abspath(request["script"])
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)


def agent(request: dict, conn: socket.socket) -> dict | None:
    """Fork the ranks and wait for them; in a rank, return its request (the caller runs the script)."""
    log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    run_id = f"forkserver-{os.getpid()}"
    pids: dict[int, int] = {}
    for rank in range(request["nprocs"]):
        pid = os.fork()
        if pid == 0:
            conn.close()
            become_rank(request, rank, run_id, log_fd)
            return request
        pids[pid] = rank
    os.close(log_fd)
    conn.sendall((json.dumps({"agent": os.getpid()}) + "\n").encode())
    codes: dict[int, int] = {}
    failed_at: float | None = None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if failed_at is not None and time.monotonic() - failed_at > GRACE:
                stop([p for p in pids if pids[p] not in codes])
                failed_at = float("inf")
            time.sleep(0.05)
            continue
        if pid in pids:
            codes[pids[pid]] = os.waitstatus_to_exitcode(status)
            if codes[pids[pid]] != 0 and failed_at is None:
                failed_at = time.monotonic()
    conn.sendall((json.dumps({"codes": [codes[r] for r in range(len(pids))]}) + "\n").encode())
    return None


def stop(pids: list[int]) -> None:
    """SIGABRT (faulthandler prints the Python stacks), then SIGKILL for any rank that is still there."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGABRT)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return
        time.sleep(0.1)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    """Running and not yet a zombie (read from /proc, so the agent's own wait still reaps it and reads its code)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def serve(path: str) -> dict | None:
    """Answer requests until told to stop; in a forked rank or process, return its request."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # agents are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    global SHIM
    SHIM = os.path.join(os.path.dirname(path), "python")
    write_shim(SHIM, path)
    print("ready", flush=True)
    parent, agents = os.getppid(), []
    server.settimeout(1.0)
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the suite is gone (killed): so is everything it started here
                for pid in agents:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                import shutil

                shutil.rmtree(os.path.dirname(path), ignore_errors=True)  # its socket, shim and logs
                os._exit(0)
            agents = [pid for pid in agents if _alive(pid)]
            continue
        conn.settimeout(None)
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while data and not data.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                break
            data += more
        request = json.loads(data) if data.strip() else {"stop": True}
        if request.get("stop"):
            conn.close()
            server.close()
            return None
        why = fallback_reason(request) if request.get("kind") == "run" else None
        if why:  # the caller runs a fresh interpreter instead
            conn.sendall((json.dumps({"fallback": why}) + "\n").encode())
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            server.close()
            os.setsid()  # the agent's session holds its processes: the client kills it whole on a timeout
            nice = int(request.get("env", {}).get("CUBOID_TEST_NICE") or 0)
            if nice:  # a launch that runs ahead of its module (tests/ahead.py): only the CPU nothing else wants
                lower_priority(nice)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            mine = run_agent(request, conn, fds) if request.get("kind") == "run" else agent(request, conn)
            if mine is None:
                os._exit(0)
            return mine
        agents.append(pid)
        conn.close()
        for fd in fds:
            os.close(fd)


def lower_priority(nice: int) -> None:
    """This process's niceness, and its session's: with the kernel's autogroups (``sched_autogroup_enabled``, on by
    default) the scheduler shares the CPU between sessions first, and niceness counts only inside one, so a session
    of nice processes would still get as much as any other."""
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroups: the processes' niceness is all there is
        pass


# What a fresh interpreter reads once at start-up (or its imports read), so a process forked from here would not
# honour a changed value: a request that changes one runs a fresh interpreter instead.
STARTUP_PREFIXES = ("PYTHON", "TORCH", "OMP_", "MKL_", "LD_", "CUDA_", "TRANSFORMERS_", "HF_")
START_ENV = {k: v for k, v in os.environ.items() if k.startswith(STARTUP_PREFIXES)}


def fallback_reason(request: dict) -> str | None:
    """Why ``request`` (a ``python ARGV`` run) cannot be forked from here, or None."""
    argv = request["argv"]
    if (
        not argv
        or (argv[0].startswith("-") and argv[0] not in ("-m", "-c"))
        or (argv[0] in ("-m", "-c") and len(argv) < 2)
    ):
        return f"interpreter options {argv[:1]}"
    env = {k: v for k, v in request["env"].items() if k.startswith(STARTUP_PREFIXES)}
    changed = sorted(k for k in set(env) | set(START_ENV) if env.get(k) != START_ENV.get(k))
    return f"start-up variables changed: {changed}" if changed else None


def write_shim(shim: str, socket_path: str) -> None:
    """The ``python`` that processes forked from here see as ``sys.executable``: the processes they launch
    (Lightning's launcher starts ``sys.executable SCRIPT``) are forked from here too, with the launcher's standard
    streams, environment and working directory; the shim forwards the signals it gets and exits as its process
    did. Anything this server cannot run goes to the real interpreter."""
    real = sys.executable
    code = f"""#!{real} -S
import json, os, signal, socket, sys
argv = sys.argv[1:]
try:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect({socket_path!r})
    request = {{"kind": "run", "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}}
    socket.send_fds(conn, [(json.dumps(request) + "\\n").encode()], [0, 1, 2])
    replies = conn.makefile("r")
    first = json.loads(replies.readline())
except (OSError, ValueError):
    first = {{"fallback": "no fork server"}}
if "fallback" in first:
    os.execv({real!r}, [{real!r}, *argv])
pid = first["pid"]
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, lambda n, _f: os.kill(pid, n))
code = json.loads(replies.readline())["code"]
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""
    with open(shim, "w") as f:
        f.write(code)
    os.chmod(shim, 0o755)


def run_agent(request: dict, conn: socket.socket, fds: list[int]) -> dict | None:
    """Fork one process for a ``python ARGV`` request and wait for it, answering for it: its pid, then its exit
    code. The client's end closing (a killed shim) kills the process's whole session."""
    import select

    pid = os.fork()
    if pid == 0:
        conn.close()
        become_process(request, fds)
        return request
    for fd in fds:
        os.close(fd)
    conn.sendall((json.dumps({"agent": os.getpid(), "pid": pid}) + "\n").encode())
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            conn.sendall((json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n").encode())
            return None
        readable, _, _ = select.select([conn], [], [], 0.05)
        if readable and not conn.recv(4096):  # the caller is gone: so is what it ran
            os.killpg(0, signal.SIGKILL)


def become_process(request: dict, fds: list[int]) -> None:
    """In a forked child: the caller's standard streams, environment and working directory; ``sys.argv`` and
    ``sys.path[0]`` as ``python ARGV`` sets them; the shim as ``sys.executable``."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    reset_process_state(request["env"])
    os.chdir(request["cwd"])
    sys.executable = SHIM


def reset_process_state(env: dict[str, str]) -> None:
    """What a fresh interpreter would have: default signal handlers, the given environment, and Lightning's
    rank-zero flag read again from it (Lightning reads it once, at import)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    if rank_zero is not None:
        rank = rank_zero._get_rank() or 0
        rank_zero.rank_zero_only.rank = rank
        utils = sys.modules.get("lightning_utilities.core.rank_zero")
        if utils is not None:
            utils.rank_zero_only.rank = rank


def run_as_python(argv: list[str]) -> int:
    """:func:`run_main`, with the exit status ``python ARGV`` would have: a ``SystemExit``'s code, 1 and the
    traceback for an uncaught exception, 130 for Ctrl-C."""
    import traceback

    try:
        run_main(argv)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def finish(code: int) -> None:
    """End as the interpreter ends a program (non-daemon threads joined, atexit handlers run, every open file
    flushed), without the interpreter's teardown of every module and object: forked from a process holding torch,
    Lightning and transformers, that teardown costs about 3 s a process (its frees copy the shared pages), where
    ``os._exit`` costs 0.1 s. ``CUBOID_TEST_FINALIZE=1`` keeps the full teardown."""
    import atexit
    import gc
    import io
    import threading

    threading._shutdown()  # what Py_FinalizeEx does first: wait for non-daemon threads
    atexit._run_exitfuncs()
    if os.environ.get("CUBOID_TEST_FINALIZE") == "1":
        sys.exit(code)
    writers = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    for obj in gc.get_objects():  # a file left open in a global is flushed at teardown: flush it now
        if type(obj) in writers:
            try:
                obj.flush()
            except (OSError, ValueError):
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def run_main(argv: list[str]) -> None:
    """Run ``python ARGV`` in this process: a script, ``-m MODULE`` or ``-c CODE``, as ``__main__`` (its classes
    pickle as ``__main__.X``); then the interpreter exits as usual."""
    import builtins
    import runpy
    import types

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        code = compile(argv[1], "<string>", "exec")
    else:
        path = os.path.abspath(argv[0])
        sys.argv = [argv[0], *argv[1:]]
        sys.path[0] = os.path.dirname(path)
        main.__file__ = path
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec")
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) == 2 else 2)
    preload()
    request = serve(sys.argv[1])
    if request is not None:
        code = run_as_python(request["argv"] if request.get("kind") == "run" else [sys.argv[0], *sys.argv[1:]])
        finish(code)
