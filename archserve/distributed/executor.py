"""What an executor is: N worker processes, one per rank, each holding a ``RankWorker``
built by a factory the engine names, and a way to send them all one message and collect
their replies.

The executor knows nothing of models or requests: a message is any picklable object, a
reply whatever the worker's ``handle`` returns. Any failure of a worker (an exception,
an exit, a lost actor) is a ``WorkerFailure``: the executor stops every worker, and the
engine that used it is finished (a new engine starts fresh ones).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from archserve.distributed.process_group import RankPlace


class WorkerFailure(RuntimeError):
    """A worker died or failed; the engine cannot go on. ``fatal`` tells the server loop
    not to keep serving (its /health turns unhealthy)."""

    fatal = True


class RankWorker(Protocol):
    def startup_reply(self) -> Any: ...
    def handle(self, message: Any) -> Any: ...


# (place) -> RankWorker; must be importable by name (a module-level function) so a
# spawned process or a Ray actor can call it.
WorkerFactory = Callable[..., RankWorker]


class Executor(ABC):
    size: int

    @abstractmethod
    def start(self, factory: WorkerFactory, *args: Any) -> list[Any]:
        """Start one worker per rank (``factory(place, *args)``); each rank's start-up reply."""

    @abstractmethod
    def call(self, message: Any) -> list[Any]:
        """Send ``message`` to every rank; every rank's reply, in rank order."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker; no process of this executor is left when it returns."""


def run_rank(place: RankPlace, factory: WorkerFactory, args: tuple) -> RankWorker:
    """In the worker process: join the group, then build the rank's worker."""
    from archserve.distributed.process_group import join_group
    join_group(place)
    return factory(place, *args)
