"""Module fixtures whose launches may run ahead of their module, on the cores the suite's waiting tests leave idle.

About a third of the suite's core-seconds were idle on the 2-core machine (767 tests at fda05e8: 581 idle
core-seconds in 1007 s): the SLURM jobs, the replica groups' heartbeats and quorums, the wheel's install, the dead
ranks' timeouts and the main jobs' W&B start-ups wait more than they compute. A module fixture whose work is only
multi-process launches (workers that write their results to files) can run in a background thread meanwhile:

    @pytest.fixture(scope="module")
    @ahead
    def results(tmp_path_factory: pytest.TempPathFactory) -> SpecRuns:
        ...  # launches only: no in-process torch work (the global RNG and torch's state are not per thread)

``tests/conftest.py`` runs the waiting modules first (``WAITING``). From the session's last ``alone`` test on (those
are timed: nothing runs ahead during one, and they lead) a background thread runs the ``@ahead`` fixtures the
selected tests need, one at a time, those of the run's last modules first: the foreground comes from the front,
so it seldom reaches a fixture that is still running (it then waits for it, and the fixture has the CPU to
itself). Their processes run at nice 19 in a session whose autogroup is nice 19 too, so they get the CPU the
foreground leaves: the waiting tests' idle cores, then the single-process phases (references) of the modules
after them. A module whose fixture ran ahead reads its result (or gets its exception: a failed spec still fails
only the tests that read it, as ``harness.SpecRuns`` says); one that has not started runs in the foreground as
before. Nothing is shared but the result: a fixture that ran ahead ran exactly the launches it runs in the
foreground, with the environment the session started with. Under ``pytest -n N`` (several workers), with
``CUBOID_TEST_AHEAD=0`` and without the conftest's plan, nothing runs ahead.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from pathlib import Path

NICE = 19  # the background launches' niceness: they get the CPU the foreground does not want
PEER_TIMEOUT = 300  # seconds without a heartbeat before a rank of a launch that runs ahead is taken for dead
# Seconds a fixture may run ahead before it is taken for stuck: its tests fail with every thread's stack, and nothing
# more runs ahead. Each launch has its own limit (harness.launch_limit: three times its 600 s while it runs ahead,
# starved by the foreground); the longest fixture, parity's, takes 4-5 minutes with the CPU to itself.
STUCK = 2700


class Ahead:
    """The fixtures that may run ahead, the queue of those this session will need, and the background thread."""

    def __init__(self) -> None:
        # "MODULE::FIXTURE" (the test module's path from the repository's root) -> the fixture's body
        self.offered: dict[str, Callable] = {}
        self.queue: list[str] = []
        self.state: dict[str, str] = {}  # key -> "running" | "done"
        self.outcome: dict[str, tuple[bool, object]] = {}  # key -> (ok, result or exception)
        self.seconds: dict[str, float] = {}
        self.cond = threading.Condition()
        self.open = False
        self.factory = None
        self.environ: dict[str, str] | None = None
        self.thread: threading.Thread | None = None
        self.started = 0.0  # when the fixture running ahead started (time.monotonic)

    def _wait(self, running: Callable[[], bool]) -> bool:
        """Wait (holding ``self.cond``) while ``running()``, until the fixture running ahead has run :data:`STUCK`
        seconds at most: True if it has (it is stuck)."""
        while running():
            left = STUCK - (time.monotonic() - self.started)
            if left <= 0:
                return True
            self.cond.wait(timeout=left)
        return False

    def offer(self, key: str, body: Callable) -> None:
        self.offered[key] = body

    def plan(self, keys: list[str], environ: dict[str, str]) -> None:
        """The fixtures that may run ahead (``MODULE::FIXTURE``), in the order they start; ``environ``: the
        environment their launches get (the session's, before any test changed it)."""
        with self.cond:
            self.queue = [key for key in keys if key in self.offered]
            self.environ = dict(environ)

    def provide(self, factory) -> None:
        """The session's tmp_path_factory (a session fixture of tests/conftest.py hands it over)."""
        # pytest makes its base directory at the first call, unguarded: made here, before any thread can call it (two
        # first calls at once, this thread's and the background's, made two and mktemp refused its own directory)
        factory.getbasetemp()
        with self.cond:
            self.factory = factory
            self.cond.notify_all()

    def start(self) -> None:
        """Let queued fixtures start (the thread is made on the first call)."""
        with self.cond:
            if not self.queue and self.thread is None:
                return
            self.open = True
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="cuboid-ahead", daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def close(self) -> None:
        """No further fixture starts ahead (the one running goes on)."""
        with self.cond:
            self.open = False

    def quiet(self) -> None:
        """Close, and wait until no fixture runs ahead (an ``alone`` test: nothing else may run meanwhile)."""
        with self.cond:
            self.open = False
            self._wait(lambda: "running" in self.state.values())  # a stuck one fails the tests that read it

    def take(self, key: str, body: Callable, *args):
        """The fixture's result: from the background (waiting for it if it runs), or computed here and now. One that
        has run ahead for :data:`STUCK` seconds fails its tests with every thread's stack."""
        import pytest

        with self.cond:
            if key in self.queue:
                self.queue.remove(key)
            if self._wait(lambda: self.state.get(key) == "running"):
                self.open, stacks = False, _stacks()
                pytest.fail(f"{key} has run ahead for {time.monotonic() - self.started:.0f} s (the limit: {STUCK} s); "
                            f"nothing more runs ahead. Every thread of the suite's process:\n{stacks}")  # fmt: skip
            ran = self.outcome.pop(key, None)
        if ran is None:
            return body(*args)
        ok, value = ran
        if not ok:
            raise value
        return value

    def _run(self) -> None:
        import harness

        # A rank at nice 19 can wait seconds for a core on a loaded machine: its peers' watchdogs (6 s by default)
        # took it for dead once (rank 0 of a 4-rank launch, "stopped responding for 13 s", the machine 3x slower
        # than usual). Launches that run ahead give a rank 300 s; the tests of that watchdog run in the foreground.
        harness.LOCAL.environ = {
            **self.environ,
            "CUBOID_TEST_NICE": str(NICE),
            "CUBOID_PEER_TIMEOUT": str(PEER_TIMEOUT),
        }
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.open and self.queue and self.factory is not None)
                key = self.queue.pop(0)
                self.state[key], self.started = "running", time.monotonic()
            start = self.started
            try:
                outcome = (True, self.offered[key](self.factory))
            except BaseException as e:  # noqa: BLE001  (pytest.fail's Failed too: re-raised in the module's fixture)
                outcome = (False, e)
            with self.cond:
                self.seconds[key] = time.monotonic() - start
                self.outcome[key], self.state[key] = outcome, "done"
                self.cond.notify_all()


def _stacks() -> str:
    """Every thread's Python stack (faulthandler's format)."""
    import faulthandler
    import tempfile

    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        return f.read()


AHEAD = Ahead()


def ahead(body: Callable) -> Callable:
    """Mark a module fixture's body (its one argument: ``tmp_path_factory``) as one that may run ahead."""
    module = Path(body.__code__.co_filename).resolve().relative_to(Path(__file__).resolve().parents[1])
    key = f"{module.as_posix()}::{body.__name__}"
    AHEAD.offer(key, body)

    @functools.wraps(body)
    def fixture(tmp_path_factory):
        return AHEAD.take(key, body, tmp_path_factory)

    return fixture
