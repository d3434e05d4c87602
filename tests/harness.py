"""The test harness: launching real multi-process runs (gloo on CPU) from pytest.

Each distributed test runs a worker script as a subprocess: Lightning's own launcher re-runs
``sys.argv``, which under pytest would be pytest itself. Startup costs several seconds per
process, so workers run several layouts per launch.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Per thread: ``environ``, the environment a thread's launches start from instead of os.environ (tests/ahead.py's
# background thread: the session's, whatever a foreground test sets meanwhile).
LOCAL = threading.local()

# A launch that runs ahead (tests/ahead.py, at nice 19) gets only the cores the foreground tests leave it, so its
# wall-clock limit is this many times the one it asks for: CI's 4-rank parity launch, starved by the foreground, ran
# past its 600 s at nice 19 (stop 77, killed in pp2xtp2-Interleaved1F1B-meta_init, a spec of 35 s by itself). A rank
# that hangs is still stopped: by its peers' watchdogs (ahead.PEER_TIMEOUT) or at this limit.
AHEAD_LIMIT_SCALE = 3


def launch_limit(timeout: float) -> float:
    """The wall-clock limit of a launch that asks for ``timeout`` seconds from this thread."""
    environ = getattr(LOCAL, "environ", None) or {}
    return timeout * AHEAD_LIMIT_SCALE if environ.get("CUBOID_TEST_NICE") else timeout


def worker_env(**extra: str) -> dict[str, str]:
    environ = getattr(LOCAL, "environ", None) or os.environ
    env = {k: v for k, v in environ.items() if not k.startswith(("SLURM_", "LOCAL_RANK", "NODE_RANK"))}
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "PYTHONFAULTHANDLER": "1",  # a worker that dies of a signal prints every thread's Python stack
            # torch.compile's kernels built in the rank itself: a pool of compile workers costs more than it
            # saves on 2 cores shared by several ranks (the compiled parity run: 41 s instead of 48 s)
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
        }
    )
    env.update(extra)
    return env


def torchrun_cmd(nprocs: int, script: Path, *args: str) -> list[str]:
    """``python -m torch.distributed.run`` of ``script`` on ``nprocs`` local processes, on a free port."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", str(script), *args]  # fmt: skip


def faulthandler_report(out: str, width: int, tail: int = 6000) -> str:
    """The first faulthandler report in ``out`` (``width`` characters of it, after the four lines before it, where
    C++ prints why it aborted: ``terminate called after throwing ...``, ``what(): ...``) when it lies before the last
    ``tail`` characters a failure message shows anyway; else an empty string. A report made by a signal from outside
    (the harness stopping a rank) says so: its lines before are another process's."""
    crash = out.find("Fatal Python error")  # a worker's native crash (PYTHONFAULTHANDLER)
    if not 0 <= crash < len(out) - tail:
        return ""
    before = out[:crash].splitlines()[-4:]
    return "\n...\n" + "\n".join(before) + f"\n{out[crash : crash + width]}\n...\n"


def run_checked(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path = ROOT, fresh: bool = False
) -> str:
    """Run ``cmd``; on failure, fail the test with the tail of its output (and the first faulthandler report).

    ``python ...`` (the suite's interpreter) runs forked from the fork server, with every process it launches
    through ``sys.executable`` (Lightning's launcher); ``fresh=True``, an interpreter option, a changed start-up
    variable or ``CUBOID_TEST_LAUNCH=torchrun`` run a fresh interpreter instead (a test of what a fresh process
    prints at import needs one)."""
    env = env or worker_env()
    proc = python(cmd, timeout=timeout, env=env, cwd=cwd, fresh=fresh)
    code, out = proc.returncode, proc.stdout + proc.stderr
    if code != 0:
        pytest.fail(f"{' '.join(cmd[:6])} ... exited {code}:{faulthandler_report(out, 4000)}\n{out[-6000:]}")
    return out


def python(
    cmd: list[str], timeout: float = 300, env: dict[str, str] | None = None, cwd: Path = ROOT, fresh: bool = False
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` for a command of the suite's interpreter (``cmd[0]``
    is ``sys.executable``), forked from the fork server unless ``fresh`` (see :func:`run_checked`); the
    environment defaults to :func:`worker_env`'s (what the fork server started with: any other start-up variable
    costs a fresh interpreter, about 3 times the fork's time and more on a slow machine)."""
    env = worker_env() if env is None else env
    if not fresh and cmd[0] == sys.executable and os.environ.get("CUBOID_TEST_LAUNCH") != "torchrun":
        ran = FORKSERVER.run(cmd[1:], env, cwd, timeout)
        if ran is not None:
            return subprocess.CompletedProcess(cmd, ran[0], ran[1], ran[2])
    return run_fresh(cmd, env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


# The priority a fresh process of a launch that runs ahead takes, as the fork server's agents take it
# (forkserver.lower_priority): its session's autogroup (the caller gives it a session of its own, so the suite's
# keeps its priority; a kernel without autogroups, or a sandbox that refuses the write, leaves only the niceness),
# then its own niceness. A shell does it between fork and exec, not a preexec_fn: Python code in the child of a
# process with threads (the suite's background thread, gloo's) can wait forever on a lock another thread held at
# the fork (it did once in a full run: the child, one thread, waited on a futex before exec, and its parent waited
# for the exec).
_NICED = '{ echo "$0" > /proc/self/autogroup; } 2>/dev/null; exec nice -n "$0" "$@"'


def run_fresh(cmd: list[str], env: dict[str, str], **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, env=env, **kwargs)``; in a launch that runs ahead (``CUBOID_TEST_NICE``, tests/ahead.py)
    at that niceness, in a session of its own whose autogroup takes it too."""
    nice = int(env.get("CUBOID_TEST_NICE") or 0)
    if nice:
        cmd, kwargs = ["/bin/sh", "-c", _NICED, str(nice), *cmd], {**kwargs, "start_new_session": True}
    return subprocess.run(cmd, env=env, **kwargs)


def interpreter() -> str:
    """A ``python`` for tests that start and signal their own processes (``subprocess.Popen([interpreter(), ...])``):
    the fork server's shim, whose process is forked from the server (imports done) with the caller's environment,
    working directory and standard streams; it forwards SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 to that
    process and exits as it did. ``sys.executable`` under ``CUBOID_TEST_LAUNCH=torchrun``."""
    if os.environ.get("CUBOID_TEST_LAUNCH") == "torchrun":
        return sys.executable
    if FORKSERVER.proc is None or FORKSERVER.proc.poll() is not None:
        FORKSERVER.start()
    return str(FORKSERVER.dir / "python")


@dataclass
class Launch:
    """What a multi-process launch left: each rank's exit code (negative: the signal that ended it; None: still
    running at the timeout, then killed) and the ranks' interleaved output."""

    script: Path
    args: list[str]
    nprocs: int
    codes: list[int | None]
    out: str
    timed_out: bool = False
    limit: float = 0.0  # the wall-clock limit it ran under, in seconds

    @property
    def ok(self) -> bool:
        return not self.timed_out and not any(self.codes)

    def running_spec(self) -> str | None:
        """The spec a worker had started and not finished when the launch ended (workers print both marks)."""
        started = [m.group(1) for m in re.finditer(r"cuboid-test: spec (\S+) starts", self.out)]
        done = set(re.findall(r"cuboid-test: spec (\S+) done", self.out))
        open_ = [name for name in started if name not in done]
        return open_[-1] if open_ else None

    def message(self) -> str:
        """Why the launch failed: the exit codes by name, the spec it was running, faulthandler's stacks, the tail."""
        how = (f"did not finish in its time limit of {self.limit:.0f} s (killed; {_codes(self.codes)})" if self.timed_out
               else f"exited with {_codes(self.codes)}")  # fmt: skip
        spec = self.running_spec()
        where = f" while running spec {spec}" if spec else ""
        stacks = faulthandler_report(self.out, 6000)
        return f"{self.script.name} on {self.nprocs} ranks {how}{where}:{stacks}\n{self.out[-6000:]}"


def _codes(codes: list[int | None]) -> str:
    def one(code: int | None) -> str:
        if code is None:
            return "running"
        if code < 0:
            return signal.Signals(-code).name
        return str(code)

    return ", ".join(f"rank {r}: {one(c)}" for r, c in enumerate(codes))


def launch(nprocs: int, script: Path, *args: str, timeout: float = 600) -> Launch:
    """Run ``script`` on ``nprocs`` local processes in a TorchElastic environment (what torchrun gives a worker) and
    return what they left, failed or not.

    The ranks are forked from the suite's fork server (``tests/forkserver.py``: torch, Lightning, transformers and
    Cuboid imported once); ``CUBOID_TEST_LAUNCH=torchrun`` launches them with ``python -m torch.distributed.run``
    instead, each rank a fresh interpreter. A launch that runs ahead gets :func:`launch_limit`'s longer limit."""
    timeout = launch_limit(timeout)
    if os.environ.get("CUBOID_TEST_LAUNCH") == "torchrun":
        cmd = torchrun_cmd(nprocs, script, *args)
        try:
            env = worker_env()
            proc = run_fresh(cmd, env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
            return Launch(script, list(args), nprocs, [None] * nprocs, out, timed_out=True, limit=timeout)
        return Launch(script, list(args), nprocs, [proc.returncode], proc.stdout + proc.stderr, limit=timeout)
    return FORKSERVER.launch(nprocs, script, list(args), timeout)


def torchrun(nprocs: int, script: Path, *args: str, timeout: float = 600) -> str:
    """:func:`launch`, failing the test when any rank failed (the message: :meth:`Launch.message`)."""
    ran = launch(nprocs, script, *args, timeout=timeout)
    if not ran.ok:
        pytest.fail(ran.message())
    return ran.out


class SpecRuns(dict):
    """The results of specs that workers ran, by spec name: ``<out>/<name>.pt`` (torch) or
    ``<out>/<name>.error.json`` (a spec that expected an error).

    :meth:`launch` runs a list of specs and never fails by itself: a spec that left its result is read by its tests
    as usual, and only the tests that read a spec without one fail, each naming that spec, its launch's size and
    what the launch left (exit codes by signal name, the spec running at the crash, faulthandler's stacks)."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.launches: dict[str, Launch] = {}

    def launch(
        self, nprocs: int, script: Path, specs: list[dict], *extra: str, timeout: float = 600, before: tuple = ()
    ) -> Launch:
        """``script [BEFORE ...] OUT SPECS_JSON [EXTRA ...]`` on ``nprocs`` ranks (``before``: a shim's worker)."""
        import json

        ran = launch(nprocs, script, *before, str(self.out), json.dumps(specs), *extra, timeout=timeout)
        for name, seconds in re.findall(r"cuboid-test: spec (\S+) done in ([0-9.]+) s", ran.out):
            SPEC_TIMES.append((float(seconds), nprocs, name, script.name))
        for spec in specs:
            self.launches[spec["name"]] = ran
            self.load(spec["name"])
        return ran

    def load(self, name: str) -> None:
        import json

        import torch

        if (self.out / f"{name}.pt").exists():
            self[name] = torch.load(self.out / f"{name}.pt", weights_only=False)
        elif (self.out / f"{name}.error.json").exists():
            self[name] = json.loads((self.out / f"{name}.error.json").read_text())

    def __missing__(self, name: str):
        ran = self.launches.get(name)
        if ran is None:
            raise KeyError(name)
        if ran.ok:
            pytest.fail(
                f"spec {name} left no result, though its launch on {ran.nprocs} ranks exited 0:\n{ran.out[-6000:]}"
            )
        pytest.fail(f"spec {name} left no result: {ran.message()}")


class ForkServer:
    """The client of ``tests/forkserver.py``: started at the first launch, stopped at the end of the session."""

    def __init__(self) -> None:
        import threading

        self.proc: subprocess.Popen | None = None
        self.dir: Path | None = None
        self._starting = threading.Lock()  # launches from several threads (replica groups) start one server

    def start(self) -> None:
        import tempfile

        self.dir = Path(tempfile.mkdtemp(prefix="cuboid-forkserver-"))
        log = (self.dir / "server.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "forkserver.py"), str(self.dir / "socket")],
            cwd=ROOT, env={k: v for k, v in worker_env().items() if k != "CUBOID_TEST_NICE"}, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 180
        while "ready" not in (self.dir / "server.log").read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                text = (self.dir / "server.log").read_text()
                self.stop()
                pytest.fail(f"the fork server did not start (exit {self.proc.returncode}):\n{text[-6000:]}")
            time.sleep(0.1)

    def launch(self, nprocs: int, script: Path, args: list[str], timeout: float) -> Launch:
        """Run ``script`` on ``nprocs`` forked ranks; on a timeout, every process of the launch is stopped (SIGABRT
        first, so faulthandler prints their stacks, then SIGKILL)."""
        with self._starting:
            if self.proc is None or self.proc.poll() is not None:
                self.start()
        import json
        import tempfile

        fd, log = tempfile.mkstemp(prefix="ranks-", suffix=".log", dir=self.dir)
        os.close(fd)
        request = {"script": str(script), "args": args, "nprocs": nprocs, "env": worker_env(), "cwd": str(ROOT),
                   "log": log, "master_port": free_port()}  # fmt: skip
        agent, codes, timed_out = None, [None] * nprocs, False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(self.dir / "socket"))
            conn.sendall((json.dumps(request) + "\n").encode())
            conn.settimeout(timeout)
            replies = conn.makefile("r")
            try:
                agent = json.loads(replies.readline())["agent"]
                codes = json.loads(replies.readline())["codes"]
            except TimeoutError:
                timed_out = True
                if agent is not None:
                    kill_session(agent)
        out = Path(log).read_text(errors="replace")
        os.unlink(log)
        return Launch(script, args, nprocs, codes, out, timed_out, limit=timeout)

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> tuple[int, str, str] | None:
        """``python ARGV`` forked from the server, in ``cwd`` with ``env``; its exit code, stdout and stderr, or
        None when the server cannot run it (the caller runs a fresh interpreter)."""
        with self._starting:
            if self.proc is None or self.proc.poll() is not None:
                self.start()
        import json
        import tempfile

        logs = [tempfile.mkstemp(prefix=f"run-{name}-", suffix=".log", dir=self.dir) for name in ("out", "err")]
        devnull = os.open(os.devnull, os.O_RDONLY)
        request = {"kind": "run", "argv": argv, "env": env, "cwd": str(cwd)}
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(str(self.dir / "socket"))
                socket.send_fds(conn, [(json.dumps(request) + "\n").encode()], [devnull, logs[0][0], logs[1][0]])
                for fd in (devnull, logs[0][0], logs[1][0]):
                    os.close(fd)
                conn.settimeout(timeout)
                replies = conn.makefile("r")
                first = json.loads(replies.readline())
                if "fallback" in first:
                    FALLBACKS.append((first["fallback"], " ".join(argv)[:160]))
                    return None
                try:
                    code = json.loads(replies.readline())["code"]
                except TimeoutError:
                    kill_session(first["agent"])
                    out = "".join(Path(path).read_text(errors="replace") for _, path in logs)
                    pytest.fail(f"python {' '.join(argv)[:300]} did not finish in {timeout} s:\n{out[-6000:]}")
            out, err = (Path(path).read_text(errors="replace") for _, path in logs)
            return code, out, err
        finally:
            for _, path in logs:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def stop(self) -> None:
        """Stop the server and anything it started; remove its directory."""
        import shutil

        if self.proc is not None:
            kill_session(self.proc.pid, grace=0.0)
            self.proc.wait()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.proc = self.dir = None


def kill_session(leader: int, grace: float = 3.0) -> None:
    """SIGABRT to ``leader`` and every process below it (faulthandler prints their stacks), then, ``grace`` seconds
    later, SIGKILL; ``grace=0`` sends SIGKILL only."""
    members = [leader, *descendants(leader)]
    if grace:
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        time.sleep(grace)
    for pid in [*members, *descendants(leader)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class SuiteLock:
    """What keeps a timed test of faults alone when the suite runs on several workers (``pytest -n 2``).

    Every test holds it for its setup, call and teardown (tests/conftest.py): a test marked ``alone`` (its
    assertions bound how many seconds a fault takes to end a run) exclusively, every other test shared. So an
    ``alone`` test starts once the other workers' current tests have ended, and their next ones wait until it is
    done. A turnstile in front keeps the exclusive request from waiting forever behind a stream of shared ones.
    A request made while this process holds it, in either mode, is part of that hold. Without
    ``CUBOID_SUITE_LOCK`` (one pytest process; tests/conftest.py sets it for the workers) it does nothing."""

    def __init__(self) -> None:
        self.depth = 0

    @contextlib.contextmanager
    def hold(self, exclusive: bool = False):
        import fcntl

        path = os.environ.get("CUBOID_SUITE_LOCK")
        with contextlib.ExitStack() as files:  # closing a file releases its flock
            if path and not self.depth:
                gate, lock = (files.enter_context(open(p, "a")) for p in (f"{path}.turnstile", path))
                if exclusive:  # the turnstile stays held: no new shared hold starts until this one ends
                    fcntl.flock(gate, fcntl.LOCK_EX)
                    fcntl.flock(lock, fcntl.LOCK_EX)
                else:  # waits while an exclusive request is queued or held
                    fcntl.flock(gate, fcntl.LOCK_SH)
                    fcntl.flock(lock, fcntl.LOCK_SH)
                    fcntl.flock(gate, fcntl.LOCK_UN)
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1


FORKSERVER = ForkServer()
SUITE_LOCK = SuiteLock()
# (seconds, ranks, spec, worker script) of every spec SpecRuns launched: the slowest are printed at the end of the
# session (tests/conftest.py), where the suite's time goes inside its module fixtures.
SPEC_TIMES: list[tuple[float, int, str, str]] = []
# (why, command) of each `python ...` run the fork server could not fork, so it ran a fresh interpreter: printed at the
# end of the session (tests/conftest.py), since each costs the imports the server exists to save.
FALLBACKS: list[tuple[str, str]] = []


def torchrun_session(nprocs: int, script: Path, *args: str, timeout: float = 60) -> tuple[int, str]:
    """Like :func:`torchrun`, in a session of its own that is killed whole on timeout (no worker outlives the
    test); returns the exit code and the output instead of failing on a non-zero one."""
    proc = subprocess.Popen(
        torchrun_cmd(nprocs, script, *args), cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid, grace=0.0)  # by descent: torchrun starts each worker in a session of its own
        out, _ = proc.communicate()
        pytest.fail(f"{script.name} {' '.join(args)} did not finish in {timeout} s:\n{out[-6000:]}")
    return proc.returncode, out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def launch_and_watch(cmd: list[str], timeout: float) -> tuple[int, str, float, set[int]]:
    """Run ``cmd`` in a session of its own; return its exit code, output, the time its output closed (every
    process that held it gone) and every pid seen below it."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    seen: set[int] = set()
    done = threading.Event()

    def census() -> None:
        while not done.is_set():
            seen.update(descendants(proc.pid))
            time.sleep(0.2)

    threading.Thread(target=census, daemon=True).start()
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    reader.join(timeout)
    closed = time.time()
    done.set()
    if reader.is_alive():
        for pid in [proc.pid, *seen]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"{cmd[1:]} still running after {timeout} s")
    return proc.wait(), "".join(chunks), closed, seen


def running(pid: int) -> bool:
    """Alive and not a zombie (an exited process whose dead parent has not been reaped for it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
