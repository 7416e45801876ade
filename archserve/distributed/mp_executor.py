"""The multiprocessing executor: one spawned process per rank on this machine, each
talking to the engine over its own pipe.

Every message goes to every rank and every rank replies, so the engine sees any rank's
failure at the step it happens: an exception (its traceback comes back), an exit (the
process sentinel fires) or a hang of a peer (the others' collectives then fail). Workers
die with the engine process (PR_SET_PDEATHSIG), so a killed engine leaves none behind.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import sys
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

from archserve.distributed.executor import Executor, WorkerFactory, WorkerFailure, run_rank
from archserve.distributed.process_group import RankPlace, free_port, leave_group

log = logging.getLogger("archserve")

_STOP_WAIT_S = 10.0


class MultiprocessExecutor(Executor):
    def __init__(self, size: int, device_type: str) -> None:
        self.size = size
        self.device_type = device_type
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        self._failed: str | None = None
        self._finalizer: weakref.finalize | None = None

    def start(self, factory: WorkerFactory, *args: Any) -> list[Any]:
        ctx = _worker_context(factory)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        for rank in range(self.size):
            device = f"cuda:{rank}" if self.device_type == "cuda" else "cpu"
            place = RankPlace(rank, self.size, device, init_method)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(place, factory, args, child),
                               name=f"archserve-tp-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop, list(self._procs), list(self._conns))
        return self._collect("start-up")

    def call(self, message: Any) -> list[Any]:
        if self._failed is not None:
            raise WorkerFailure(f"the tensor-parallel workers have stopped: {self._failed}")
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass   # _collect names the rank that is gone
        return self._collect("a step")

    def _collect(self, what: str) -> list[Any]:
        replies: list[Any] = [None] * self.size
        pending = set(range(self.size))
        while pending:
            waiting = [self._conns[r] for r in pending] + [p.sentinel for p in self._procs]
            ready = wait(waiting)
            # One rank's failure makes its peers' collectives fail too, and their errors
            # may be read first: read every rank that is ready, then blame the cause.
            errors: list[tuple[float, int, str]] = []
            for rank in sorted(pending):
                conn = self._conns[rank]
                if conn not in ready and not conn.poll():
                    continue
                try:
                    kind, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    # Killed without a word: it died before any peer noticed.
                    self._fail(f"rank {rank} closed its pipe during {what} "
                               f"(exit code {self._procs[rank].exitcode})")
                if kind == "error":
                    failed_at, trace = value
                    errors.append((failed_at, rank, trace))
                    continue
                replies[rank] = value
                pending.discard(rank)
            if errors:
                _, rank, trace = min(errors)         # the first to fail
                # The exception's own line first (what a user reads: "cannot split this
                # layer ..."), then where it came from.
                cause = trace.strip().splitlines()[-1]
                self._fail(f"rank {rank} failed during {what}: {cause}\n{trace}")
            for rank, proc in enumerate(self._procs):
                if proc.sentinel in ready and not self._conns[rank].poll():
                    proc.join(0)
                    self._fail(f"rank {rank} (pid {proc.pid}) exited during {what} with "
                               f"exit code {proc.exitcode}")
        return replies

    def _fail(self, reason: str) -> None:
        self._failed = reason.splitlines()[0]
        log.error("tensor-parallel worker failure: %s", reason)
        self.shutdown()
        raise WorkerFailure(reason)

    def shutdown(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        if self._failed is None:
            self._failed = "shut down"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]


def _worker_context(factory: WorkerFactory):
    """Workers fork from a fork server (never from the engine process, which may hold a
    CUDA context) that has already imported what every rank needs: the factory's module,
    and the modules it lists in ``WORKER_PRELOAD``. A rank's first seconds are imports
    (about 8 s on a 2-core machine, paid by every rank at once); the fork server pays them
    once per engine process."""
    module = sys.modules[factory.__module__]
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([factory.__module__, *getattr(module, "WORKER_PRELOAD", ())])
    return ctx


def _stop(procs: list[mp.Process], conns: list[Connection]) -> None:
    """Ask every worker to leave, then end whichever has not within the wait."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(None))
        except OSError:
            pass
    for proc in procs:
        proc.join(_STOP_WAIT_S if proc.exitcode is None else 0)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(_STOP_WAIT_S)
    for conn in conns:
        conn.close()


def _die_with_parent() -> None:
    """SIGKILL this process when the engine process dies, however it dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
    except OSError:
        pass


def _reply(conn: Connection, kind: str, value: Any) -> None:
    # Plain pickle: a tensor travels as bytes, not as a shared-memory handle.
    conn.send_bytes(pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL))


def _worker_main(place: RankPlace, factory: WorkerFactory, args: tuple,
                 conn: Connection) -> None:
    _die_with_parent()
    try:
        worker = run_rank(place, factory, args)
        _reply(conn, "ok", worker.startup_reply())
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except EOFError:
                break
            if message is None:
                break
            _reply(conn, "ok", worker.handle(message))
    except BaseException:
        try:
            # When it failed (one clock for every process of the machine): the engine
            # blames the first rank to fail, not a peer whose collective it broke.
            _reply(conn, "error", (time.monotonic(), traceback.format_exc()))
        except OSError:
            pass
        # A peer may be stuck in a collective: leave without a graceful group teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        import os
        os._exit(1)
    leave_group()
