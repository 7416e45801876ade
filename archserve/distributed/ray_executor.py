"""The Ray executor: one actor per rank, placed by a Ray placement group with one bundle
per device (a GPU, or a CPU core for gloo ranks), on whatever machines of the Ray
cluster have them.

``ray.init()`` joins the cluster this machine belongs to (``ray start --head`` here, or
``RAY_ADDRESS``), or starts a local one. Rank 0's actor picks the rendezvous address on
its own machine; the others connect to it. A lost actor or an exception in one ends
every actor and is a ``WorkerFailure``, like a lost process of the mp executor.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from archserve.distributed.executor import Executor, WorkerFactory, WorkerFailure, run_rank
from archserve.distributed.process_group import RankPlace, free_port, leave_group, node_ip

log = logging.getLogger("archserve")

PLACEMENT_TIMEOUT_S = 120.0


class _RankActor:
    """Runs in a Ray worker process: one rank's RankWorker."""

    def __init__(self) -> None:
        self.worker = None

    def rendezvous(self) -> str:
        return f"tcp://{node_ip()}:{free_port()}"

    def start(self, place: RankPlace, factory: WorkerFactory, args: tuple) -> Any:
        self.worker = run_rank(place, factory, args)
        return self.worker.startup_reply()

    def handle(self, message: Any) -> Any:
        return self.worker.handle(message)

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        leave_group()


class RayExecutor(Executor):
    def __init__(self, size: int, device_type: str) -> None:
        try:
            import ray
        except ImportError as exc:
            raise ValueError("distributed_executor_backend='ray' needs Ray: pip install "
                             "ray (or use the default, mp, on one machine)") from exc
        self.size = size
        self.device_type = device_type
        self._ray = ray
        self._actors: list = []
        self._group = None
        self._failed: str | None = None
        if not ray.is_initialized():
            ray.init(log_to_driver=False, runtime_env=_runtime_env())

    def start(self, factory: WorkerFactory, *args: Any) -> list[Any]:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = self.device_type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self._group = placement_group([dict(bundle) for _ in range(self.size)], strategy="PACK")
        ready, _ = ray.wait([self._group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            self.shutdown()
            raise ValueError(f"the Ray cluster cannot place {self.size} ranks of {bundle} "
                             f"within {PLACEMENT_TIMEOUT_S:.0f} s (cluster resources: "
                             f"{ray.cluster_resources()})")
        actor_class = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(_RankActor)
        for rank in range(self.size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self._group,
                                                        placement_group_bundle_index=rank)
            self._actors.append(actor_class.options(scheduling_strategy=strategy).remote())
        init_method = self._get([self._actors[0].rendezvous.remote()], "start-up")[0]
        # Ray shows each actor only its own GPU: it is cuda:0 there.
        device = "cuda:0" if gpu else "cpu"
        return self._get([actor.start.remote(RankPlace(rank, self.size, device, init_method),
                                             factory, args)
                          for rank, actor in enumerate(self._actors)], "start-up")

    def call(self, message: Any) -> list[Any]:
        if self._failed is not None:
            raise WorkerFailure(f"the tensor-parallel workers have stopped: {self._failed}")
        ref = self._ray.put(message)
        return self._get([actor.handle.remote(ref) for actor in self._actors], "a step")

    def _get(self, refs: list, what: str) -> list[Any]:
        """Every result, failing at the first rank that fails (not after the others hang)."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as exc:   # noqa: BLE001 - RayActorError, RayTaskError, ...
                reason = f"rank {rank_of[done[0]]} failed during {what}: {exc}"
                self._failed = reason.splitlines()[0]
                log.error("tensor-parallel worker failure: %s", reason)
                self.shutdown()
                raise WorkerFailure(reason) from None
        return ray.get(refs)

    def pids(self) -> list[int]:
        return self._get([actor.pid.remote() for actor in self._actors], "a query")

    def kill_rank(self, rank: int) -> None:
        """End one rank's actor at once (what a lost machine does; for tests)."""
        self._ray.kill(self._actors[rank], no_restart=True)

    def shutdown(self) -> None:
        ray = self._ray
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:   # noqa: BLE001 - already gone
                pass
        self._actors = []
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group
            try:
                remove_placement_group(self._group)
            except Exception:   # noqa: BLE001 - the cluster may be gone
                pass
            self._group = None
        if self._failed is None:
            self._failed = "shut down"


def _runtime_env() -> dict:
    """Actors import the archserve this engine runs (a source checkout included)."""
    # <root>/archserve/distributed/ray_executor.py: the directory that holds the package.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return {"env_vars": {"PYTHONPATH": path}}
