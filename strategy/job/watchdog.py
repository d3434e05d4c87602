"""A dead rank is named, and the others stop within seconds instead of waiting in a collective for the timeout.

Every rank runs a daemon thread that, once a second, bumps its own counter in the rendezvous store (the
``TCPStore`` every rank already talks to) and reads the counter of the next rank in a ring. A counter that has
not moved for ``timeout`` seconds (measured on the watcher's own clock) marks that rank dead in the store; every
rank reads the mark at its next beat, prints which rank stopped responding, and exits with code 3
(``os._exit``: a process group with a dead member can hang in teardown). A store that no longer answers means
rank 0's process (which hosts it) or its node is gone. Cost: one store write and two reads per rank per second.

When a collective fails first (gloo reports a closed connection at once, without saying whose), the strategy's
``on_exception`` asks :meth:`PeerWatchdog.verdict` to wait up to ``timeout`` seconds for the same answer, so the
error the user reads names the rank.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

EXIT_CODE = 3
_BEAT, _DEAD, _STOPPED = "cuboid/heartbeat/", "cuboid/dead", b"stopped"


def mark_job(store: Any, what: str) -> None:
    """Mark the job as failing with ``what`` unless it is marked already: every rank's watchdog reads it at its
    next beat and stops its rank (the hang report's mark, cuboid.job.hangs). The store may be gone: then nothing."""
    try:
        if not store.check([_DEAD]):
            store.set(_DEAD, what)
    except Exception:  # noqa: BLE001
        pass


class PeerWatchdog:
    def __init__(self, store: Any, rank: int, world_size: int, timeout: float = 6.0, interval: float = 1.0) -> None:
        self.store, self.rank, self.world = store, rank, world_size
        self.timeout, self.interval = timeout, interval
        self.watched = (rank + 1) % world_size
        self.dead: str | None = None  # what was found: "rank N ..." (None while everyone answers)
        # Called (on the watchdog's thread) with another rank's mark before this rank exits on it: the hang report
        # has every live rank post what it was doing (cuboid.job.hangs).
        self.on_mark: Callable[[str], None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats = 0

    def start(self) -> None:
        if self.world < 2 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="cuboid-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching, and tell this rank's watcher that its silence from now on is not a death."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval)
            self._thread = None
            try:
                self.store.set(f"{_BEAT}{self.rank}", _STOPPED)
            except Exception:  # noqa: BLE001  (the store may be gone with rank 0 at exit)
                pass

    def _run(self) -> None:
        last_seen, last_change = None, time.monotonic()
        while not self._stop.wait(self.interval):
            try:
                self._beats += 1
                self.store.set(f"{_BEAT}{self.rank}", str(self._beats))
                if self.store.check([_DEAD]):
                    what = self.store.get(_DEAD).decode()
                    if self.on_mark is not None:
                        self.on_mark(what)
                    self._found(what)
                    return
                seen = self.store.get(f"{_BEAT}{self.watched}") if self.store.check([f"{_BEAT}{self.watched}"]) else b""
            except Exception:  # noqa: BLE001  (any store failure means the same thing)
                if self._stop.is_set():
                    return
                self._found("rank 0 (it hosts the rendezvous store) stopped responding: its process or node is gone")
                return
            now = time.monotonic()
            if seen == _STOPPED:  # it finished its run (teardown): silence is expected
                last_seen, last_change = seen, now
                continue
            if seen != last_seen:
                last_seen, last_change = seen, now
            elif now - last_change > self.timeout:
                what = f"rank {self.watched} stopped responding for {now - last_change:.0f} s (killed, or its node is gone)"
                try:
                    self.store.set(_DEAD, what)
                except Exception:  # noqa: BLE001
                    pass
                self._found(what)
                return

    def _found(self, what: str) -> None:
        self.dead = what
        if self._stop.is_set():
            return
        print(
            f"Cuboid (rank {self.rank}): {what}. Stopping this rank now (exit code {EXIT_CODE}) instead of waiting "
            "in a collective until the timeout; resume from the last checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_CODE)

    def verdict(self, wait: float | None = None) -> str | None:
        """What the watchdog finds within ``wait`` seconds (default: its timeout and two beats), or None."""
        deadline = time.monotonic() + (self.timeout + 2 * self.interval if wait is None else wait)
        while self.dead is None and self._thread is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.dead
