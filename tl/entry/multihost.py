"""The multi-host step channel: process 0 (the leader) sends each step's host inputs to the other
processes of the job (the followers), which run the same compiled step over the global mesh.

Owns: the channel's frames (a step, as tl/runtime/frame.py's StepFrame encodes it; hello,
ready, heartbeat, stop, a follower's own failure), the leader's listening socket and its one
connection per follower, a follower's connection, liveness and the failure bounds, and what a
failure does: `on_failure(reason)` once (the leader fails its requests with 503 there, naming the
lost process: one that closed without reporting a failure of its own is the cause, see
REPORTED_WAIT_S), the sockets closed (so every peer notices at once), then the process exits
with status 3 (`EXIT_GROUP_FAILED`): the leader after `FAILURE_GRACE_S` (its 503s reach their
clients), a follower at once (it serves no request, and once the leader's process is gone JAX's
own coordination client aborts the others).
Bounds, all `peer_timeout_s`: a peer silent that long (each side sends a heartbeat every
`peer_timeout_s / 5`, from its own thread, whatever its step is doing) is lost; a step whose
collectives have not returned that long, counted from the last moment any process of the
group was compiling (a compile slows the steps beside it by seconds on a small CPU; the
heartbeats say who compiles), is stuck.
Start-up: the leader accepts, beats and reads each follower from its hello on, and a follower
connects before it joins jax.distributed, so the leader knows by process id who is missing
(`not_connected`, `not_ready`); the waits themselves are bounded by tl/entry/group_start.py.
Must not import jax or touch device arrays: the runner packs frames and runs them
(tl/runtime/runner.py, reaching the Leader through tl/runtime/frame.py's StepPeers protocol);
tl/entry/build.py wires both ends. Tested by tests/entry/test_multihost.py.

Why a socket and not JAX's own broadcast (`multihost_utils.broadcast_one_to_all`): measured on
two CPU processes on one 2-core AMD EPYC (Zen 3), a 4 KB step frame took 1.87 ms p50 that way
against 0.05 ms over TCP, 400 KB 2.29 ms against 0.16 ms (docs/multihost-broadcast.txt; the
README, "Backends and scaling out").
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from tl.core.config import Group
from tl.entry.group_start import processes
from tl.runtime.frame import StepFrame

log = logging.getLogger("tl.entry.multihost")

EXIT_GROUP_FAILED = 3
FAILURE_GRACE_S = 1.0  # after on_failure: time for the 503s to reach their clients

HELLO, READY, BEAT, STEP, STOP, FAILED = 1, 2, 3, 4, 5, 6
REPORTED_WAIT_S = 1.0
"""How long the leader waits, after a follower reported its own failure and closed, for a peer
lost without a word: when one follower is killed, the others' collectives break too and they
report and exit at once, so the reporters are the consequence and the silent one the cause."""
_HEAD = struct.Struct("<BI")  # kind, payload bytes


class GroupFailed(RuntimeError):
    """The multi-host group lost a process or a step got stuck; the message says which."""


def is_follower(group: Group | None) -> bool:
    """This process is a follower of a multi-host job: its process id (config, then
    JAX_PROCESS_ID) is known and not 0. Serving decides this before jax starts."""
    return group is not None and group.process_id > 0


def step_address(coordinator_address: str, step_port: int) -> tuple[str, int]:
    """(host, port) of the leader's step channel: the coordinator's host (process 0 runs the
    coordinator) on step_port, 0 meaning the coordinator's port + 1."""
    host, sep, port = coordinator_address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"coordinator_address must be host:port, got {coordinator_address!r}")
    return host.strip("[]"), step_port or int(port) + 1


class _Conn:
    """One TCP connection carrying frames: sends under a lock, reads on the caller's thread."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._send_lock = threading.Lock()
        self.last_sent = time.monotonic()
        self.last_seen = time.monotonic()

    def send(self, kind: int, payload: bytes = b"") -> None:
        with self._send_lock:
            self.sock.sendall(_HEAD.pack(kind, len(payload)) + payload)
            self.last_sent = time.monotonic()

    def recv(self) -> tuple[int, bytes]:
        """The next frame; raises ConnectionError at the end of the stream."""
        kind, n = _HEAD.unpack(self._exactly(_HEAD.size))
        payload = self._exactly(n) if n else b""
        self.last_seen = time.monotonic()
        return kind, payload

    def _exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if not k:
                raise ConnectionError("connection closed")
            got += k
        return bytes(buf)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


class _Peer:
    """What both ends share: the bound, the heartbeat interval, the step watchdog, failing once."""

    grace_s = 0.0  # from the failure to the exit

    def __init__(
        self,
        timeout_s: float,
        on_failure: Callable[[str], None] | None,
        exit_on_failure: bool,
        busy: Callable[[], bool] | None,
    ) -> None:
        self.timeout_s = timeout_s
        self.beat_s = timeout_s / 5
        self.on_failure = on_failure
        self.exit_on_failure = exit_on_failure
        self.failure: str | None = None
        self.stopping = False
        self._fail_lock = threading.Lock()
        self._step_since: float | None = None  # monotonic start of the step in flight
        self.busy = busy or _idle  # this process is compiling (tl/entry/build.py passes the compiler's)
        self._closed = threading.Event()

    def step_began(self) -> None:
        self._step_since = time.monotonic()

    def step_ended(self) -> None:
        self._step_since = None

    def _step_stuck(self, compiling: bool) -> bool:
        since = self._step_since
        if since is None:
            return False
        if compiling:  # a process compiling a variant holds the collective up legitimately
            self._step_since = time.monotonic()
            return False
        return time.monotonic() - since > self.timeout_s

    def fail(self, reason: str) -> None:
        """The group is broken: on_failure once, every connection closed, then exit status 3."""
        with self._fail_lock:
            if self.failure is not None or self.stopping:
                return
            self.failure = reason
        log.error("multi-host group failed: %s; exiting with status %d", reason, EXIT_GROUP_FAILED)
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:
                log.exception("on_failure raised")
        self._close_all()
        self._closed.set()
        if self.exit_on_failure:
            threading.Thread(target=_exit_later, args=(self.grace_s,), name="tl-group-exit", daemon=True).start()

    def _close_all(self) -> None:
        raise NotImplementedError


def _idle() -> bool:
    return False


def _exit_later(grace_s: float) -> None:
    time.sleep(grace_s)
    logging.shutdown()
    os._exit(EXIT_GROUP_FAILED)


class Leader(_Peer):
    """Process 0's end: one connection per follower; `send_step` from the engine thread."""

    grace_s = FAILURE_GRACE_S

    def __init__(
        self,
        num_followers: int,
        timeout_s: float,
        on_failure: Callable[[str], None] | None = None,
        exit_on_failure: bool = True,
        busy: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(timeout_s, on_failure, exit_on_failure, busy)
        self.num_followers = num_followers
        self.conns: dict[int, _Conn] = {}
        self.ready: set[int] = set()
        self.compiling: dict[int, bool] = {}
        self.reported: dict[int, str] = {}
        """Each follower's own failure, as it reported it before closing (FAILED)."""
        self._reported_closed: dict[int, float] = {}  # such a follower's channel closed, since when
        self.steps_sent = 0
        self.send_seconds = 0.0  # encoding and sending every step frame (the channel's cost per step)
        self._cv = threading.Condition()  # a follower connected or ready
        self._server: socket.socket | None = None

    def listen(self, host: str, port: int) -> int:
        """Bind the step channel (all interfaces when host is empty) and accept the followers from
        now on, each beaten and read from its hello (a follower connects before it joins
        jax.distributed, so that a missing one can be named); the port bound."""
        srv = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, port))
        srv.listen(self.num_followers + 4)
        self._server = srv
        threading.Thread(target=self._accept, args=(srv,), name="tl-group-accept", daemon=True).start()
        threading.Thread(target=self._monitor, name="tl-group-monitor", daemon=True).start()
        return int(srv.getsockname()[1])

    def _accept(self, srv: socket.socket) -> None:
        """Every follower's hello (its process id), until all have connected or the channel closed."""
        while len(self.conns) < self.num_followers:
            try:
                sock, addr = srv.accept()
                sock.settimeout(self.timeout_s)  # a peer that connects but never says hello
            except OSError:
                return  # closed: the group failed or stopped
            conn = _Conn(sock)
            try:
                kind, payload = conn.recv()
            except (OSError, ConnectionError):
                conn.close()
                continue
            (pid,) = struct.unpack("<I", payload) if kind == HELLO and len(payload) == 4 else (0,)
            if not 1 <= pid <= self.num_followers or pid in self.conns:
                log.warning("step channel: refused a connection from %s (hello %r)", addr, payload[:8])
                conn.close()
                continue
            sock.settimeout(None)
            with self._cv:
                self.compiling[pid] = False
                self.conns[pid] = conn
                self._cv.notify_all()
            log.info("step channel: process %d connected from %s", pid, addr[0])
            threading.Thread(target=self._read, args=(pid, conn), name=f"tl-group-read-{pid}", daemon=True).start()
        with contextlib.suppress(OSError):
            srv.close()

    def _wait(self, done: Callable[[], bool], timeout_s: float | None) -> bool:
        deadline = time.monotonic() + (math.inf if timeout_s is None else timeout_s)
        with self._cv:
            while not done() and self.failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(0.5, left))  # (a failure does not notify: polled)
        if self.failure is not None:
            raise GroupFailed(self.failure)
        return True

    def wait_connected(self, timeout_s: float | None = None) -> bool:
        """Block until every follower has said hello (False: timeout_s passed first; a failed
        group raises GroupFailed). tl/entry/build.py bounds it with tl/entry/group_start.py's deadline."""
        return self._wait(lambda: len(self.conns) == self.num_followers, timeout_s)

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until every follower has compiled its start-up variants; as wait_connected."""
        return self._wait(lambda: len(self.ready) == self.num_followers, timeout_s)

    def not_connected(self) -> str:
        """What the connecting stage still waits for, for the start-up bound's log line."""
        ids = [p for p in range(1, self.num_followers + 1) if p not in self.conns]
        if ids:
            return f"{processes(ids, self.num_followers + 1)} did not connect"
        return "jax.distributed did not form (every follower connected to the step channel)"

    def not_ready(self) -> str:
        ids = [p for p in range(1, self.num_followers + 1) if p not in self.ready]
        return f"{processes(ids, self.num_followers + 1)} did not report ready"

    @property
    def all_ready(self) -> bool:
        return self.failure is None and len(self.ready) == self.num_followers

    def send_step(self, frame: StepFrame) -> None:
        """Send the step to every follower (engine thread); the step watchdog starts."""
        if self.failure is not None:
            raise GroupFailed(self.failure)
        t0 = time.perf_counter()
        data = frame.encode()
        for pid, conn in self.conns.items():
            try:
                conn.send(STEP, data)
            except OSError as e:
                self.fail(f"process {pid}: the step channel broke ({e})")
                raise GroupFailed(self.failure or "") from None
        self.steps_sent += 1
        self.send_seconds += time.perf_counter() - t0
        self.step_began()

    def broken(self, error: BaseException) -> GroupFailed:
        """A step raised on this process after its frame went out: the group's failure, not a
        crash of one request (the followers are inside the same collectives). A collective broken
        by a lost peer can raise before this channel has noticed the loss, so its own diagnosis
        (which names the process) is waited for: a killed peer's socket closes at once, a silent
        one is lost within timeout_s. Without one by then, the step's error is the reason."""
        deadline = time.monotonic() + self.timeout_s
        while self.failure is None and not self.stopping and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.failure is None:
            self.fail(f"a step failed on process 0: {type(error).__name__}: {error}")
        else:  # another thread's fail(): its on_failure may still be running (flaked in CI)
            self._closed.wait(max(0.0, deadline - time.monotonic()) + 1.0)
        return GroupFailed(self.failure or f"{type(error).__name__}: {error}")

    def stop(self) -> None:
        """Tell every follower to exit (status 0) and close: the end of a drain."""
        if self.stopping or self.failure is not None:
            return
        self.stopping = True
        if self.steps_sent:
            log.info(
                "step channel: %d steps sent to %d followers, %.3f ms a step (encoding and sending)",
                self.steps_sent,
                self.num_followers,
                1e3 * self.send_seconds / self.steps_sent,
            )
        for conn in self.conns.values():
            with contextlib.suppress(OSError):
                conn.send(STOP)
        self._close_all()
        self._closed.set()

    def _close_all(self) -> None:
        for conn in list(self.conns.values()):
            conn.close()
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
            with contextlib.suppress(OSError):
                self._server.close()

    def _read(self, pid: int, conn: _Conn) -> None:
        while True:
            try:
                kind, payload = conn.recv()
            except (OSError, ConnectionError, struct.error):
                if pid in self.reported:  # a consequence, most likely: the monitor waits for the cause
                    self._reported_closed.setdefault(pid, time.monotonic())
                    return
                self.fail(f"process {pid} closed the step channel (it exited or its host went away)")
                return
            if kind == FAILED:
                self.reported[pid] = payload.decode(errors="replace")
            elif kind == BEAT:
                self.compiling[pid] = payload == b"\x01"
            elif kind == READY:
                with self._cv:
                    self.ready.add(pid)
                    self._cv.notify_all()
                log.info("step channel: process %d ready (%d of %d)", pid, len(self.ready), self.num_followers)

    def _monitor(self) -> None:
        while not self._closed.wait(self.beat_s):
            now = time.monotonic()
            for pid, since in list(self._reported_closed.items()):
                if now - since >= REPORTED_WAIT_S:
                    self.fail(f"process {pid} failed: {self.reported[pid]}")
                    return
            for pid, conn in list(self.conns.items()):  # (followers still connecting)
                if pid in self._reported_closed:
                    continue
                if now - conn.last_seen > self.timeout_s:
                    self.fail(f"process {pid} has been silent for {now - conn.last_seen:.1f} s")
                    return
                if now - conn.last_sent >= self.beat_s:
                    try:
                        conn.send(BEAT)
                    except OSError as e:
                        self.fail(f"process {pid}: the step channel broke ({e})")
                        return
            if self._step_stuck(self.busy() or any(list(self.compiling.values()))):
                self.fail(f"a step's collectives have not returned in {self.timeout_s:.1f} s")
                return


class Follower(_Peer):
    """A follower's end: connects to the leader, beats from its own thread, yields the steps."""

    def __init__(
        self,
        process_id: int,
        timeout_s: float,
        on_failure: Callable[[str], None] | None = None,
        exit_on_failure: bool = True,
        busy: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(timeout_s, on_failure, exit_on_failure, busy)
        self.process_id = process_id
        self.conn: _Conn | None = None
        self._inbox: queue.SimpleQueue[StepFrame | None] = queue.SimpleQueue()  # None: stop or lost

    def connect(self, host: str, port: int, timeout_s: float = math.inf) -> None:
        """Connect (retrying while the leader starts; tl/entry/build.py bounds it with tl/entry/group_start.py's
        deadline), say hello, start the heartbeat."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=5.0)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise GroupFailed(f"could not reach the leader's step channel at {host}:{port}: {e}") from None
                time.sleep(0.2)
        sock.settimeout(None)
        self.conn = _Conn(sock)
        self.conn.send(HELLO, struct.pack("<I", self.process_id))
        threading.Thread(target=self._read, name="tl-group-read", daemon=True).start()
        threading.Thread(target=self._beat, name="tl-group-beat", daemon=True).start()

    @property
    def reachable(self) -> bool:
        """Connected, and the leader heard from within the bound."""
        c = self.conn
        return c is not None and self.failure is None and time.monotonic() - c.last_seen <= self.timeout_s

    def announce_ready(self) -> None:
        assert self.conn is not None
        self.conn.send(READY)

    def frames(self) -> Iterator[StepFrame]:
        """The leader's steps in order, until it says stop (then returns); a lost leader raises
        GroupFailed (the exit is on its way)."""
        assert self.conn is not None, "connect() first"
        while True:
            # no bound here: the beat watchdog is it (a leader silent past timeout_s fails the group,
            # and the reader then puts None), as is the leader's stop (None too)
            frame = self._inbox.get()
            if frame is None:
                if self.failure is not None:
                    raise GroupFailed(self.failure)
                return
            yield frame

    def _read(self) -> None:
        """The reader, from the connection on (start-up included): the leader's beats keep it
        reachable, its steps queue for `frames`."""
        conn = self.conn
        assert conn is not None
        while True:
            try:
                kind, payload = conn.recv()
            except (OSError, ConnectionError, struct.error):
                self.fail("the leader (process 0) closed the step channel (it exited or its host went away)")
                self._inbox.put(None)
                return
            if kind == STEP:
                self._inbox.put(StepFrame.decode(payload))
            elif kind == STOP:
                self.stopping = True
                log.info("step channel: the leader stopped the group")
                self._inbox.put(None)
                return

    def _beat(self) -> None:
        conn = self.conn
        assert conn is not None
        while not self._closed.wait(self.beat_s):
            now = time.monotonic()
            if now - conn.last_seen > self.timeout_s:
                self.fail(f"the leader (process 0) has been silent for {now - conn.last_seen:.1f} s")
                return
            compiling = self.busy()
            if self._step_stuck(compiling):
                self.fail(f"a step's collectives have not returned in {self.timeout_s:.1f} s")
                return
            try:
                conn.send(BEAT, b"\x01" if compiling else b"\x00")
            except OSError:
                if not self.stopping:
                    self.fail("the step channel to the leader broke")
                return

    def close(self) -> None:
        self.stopping = True
        self._close_all()
        self._closed.set()

    def _close_all(self) -> None:
        if self.conn is not None:
            if self.failure is not None:  # the leader learns it was this process's own failure
                with contextlib.suppress(OSError):
                    self.conn.send(FAILED, self.failure.encode())
            self.conn.close()


class FrameRunner(Protocol):
    """What the follow loop needs of tl/runtime/runner.py's ModelRunner."""

    def run_frame(self, frame: StepFrame) -> None: ...


def follow(chan: Follower, runner: FrameRunner) -> None:
    """A follower's life after start-up: run each of the leader's steps, in order, until it says
    stop. A variant this process has not compiled yet is compiled by run_frame first; `busy`
    says so in the heartbeats (the leader's watchdog then waits: its collective is held up
    legitimately)."""
    for frame in chan.frames():
        chan.step_began()
        try:
            runner.run_frame(frame)
        except Exception as e:  # a collective broken by a lost peer: the group's failure, not a crash
            chan.fail(f"a step failed on process {chan.process_id}: {type(e).__name__}: {e}")
            raise GroupFailed(chan.failure or str(e)) from None
        chan.step_ended()
