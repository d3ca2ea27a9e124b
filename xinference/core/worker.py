"""The worker actor: owns a host's replica sub-pools and the processes under them.

A replica is started in two steps because Xavier needs the replica's own address
before its engine starts (the connector is told where its transfer actor will
live): ``start_replica_pool`` spawns the sub-pool and returns its address, then
``load_replica`` creates the model actor there and loads the engine.
``remove_replica`` takes the sub-pool down and makes sure nothing it spawned (vLLM's
engine-core and worker processes) outlives it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

import psutil
import xoscar as xo

from ..model.llm.vllm.xavier.tracker_relay import TrackerRelayActor, relay_uid
from .heartbeat import HeartbeatSettings, beat_forever
from .logs import log_level_env, sub_pool_logging
from .messages import ReplicaInfo, ReplicaSpec
from .model import ReplicaModelActor, model_actor_uid
from .options import LaunchOptionError
from .placement import ReplicaPlacement, device_budget_refusal, plan_replicas

logger = logging.getLogger(__name__)

SUB_POOL_STOP_TIMEOUT_S = 20.0
CHILD_EXIT_TIMEOUT_S = 10.0


class WorkerActor(xo.StatelessActor):
    """One per host, in the host's main actor pool.

    ``main_pool`` is the pool object itself (the actor is created in the same
    process): sub-pools are appended to it and removed from it.
    """

    def __init__(
        self,
        main_pool: Any,
        supervisor_address: str | None = None,
        gpus: Sequence[str] | None = None,
        heartbeat: HeartbeatSettings | None = None,
        cluster_secret: str | None = None,
    ) -> None:
        super().__init__()
        self._pool = main_pool
        self._supervisor_address = supervisor_address
        self._cluster_secret = cluster_secret  # shown to the supervisor to join
        self._gpus: tuple[str, ...] | None = None if gpus is None else tuple(gpus)
        # sub-pool address -> the pid of its process (for the leftover check)
        self._sub_pools: dict[str, int] = {}
        # sub-pool address -> the processes it spawned, as last seen: a sub-pool
        # that dies leaves its children (vLLM's engine core) to init, where
        # ``remove_replica`` could no longer find them
        self._spawned: dict[str, list[psutil.Process]] = {}
        self._heartbeat_settings = heartbeat or HeartbeatSettings.from_env()
        self._heartbeat: asyncio.Task[None] | None = None
        self._supervisor: Any = None
        self._cleanup: asyncio.Task[None] | None = None

    @classmethod
    def default_uid(cls) -> str:
        return "worker"

    async def __post_create__(self) -> None:
        if self._gpus is None:
            self._gpus = tuple(await asyncio.to_thread(detect_gpus))
        if self._supervisor_address is not None:
            from .supervisor import SupervisorActor

            self._supervisor = await xo.actor_ref(
                address=self._supervisor_address, uid=SupervisorActor.default_uid()
            )
            await self._register()
            if self._supervisor_address != self.address:
                # A supervisor elsewhere learns that this worker lives by hearing
                # from it (one in this process needs no telling).
                self._heartbeat = asyncio.create_task(
                    beat_forever(
                        lambda: self._supervisor.worker_heartbeat(self.address),
                        self._register,
                        self._heartbeat_settings,
                        f"worker {self.address}",
                    )
                )

    async def _register(self) -> None:
        live = set(
            await self._supervisor.register_worker(
                self.address, self.uid, self._cluster_secret
            )
        )
        # Registering again (the supervisor restarted, or declared this worker gone
        # during a network cut): replicas it does not count as serving are gone
        # for good, so their sub-pools and engines go too.
        stale = [address for address in self._sub_pools if address not in live]
        if stale:
            # in the background: a registration must not wait on pools stopping
            self._cleanup = asyncio.create_task(self._remove_stale(stale))

    async def _remove_stale(self, addresses: list[str]) -> None:
        for address in addresses:
            logger.warning(
                "replica sub-pool %s is not served any more; removing it", address
            )
            try:
                await self.remove_replica(address)
            except Exception:
                logger.exception("removing sub-pool %s failed", address)

    async def __pre_destroy__(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()

    async def leave(self) -> list[int]:
        """Stop beating, tell the supervisor (its replicas here are gone), remove
        every sub-pool; the pids that had to be killed."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        if self._supervisor is not None and self._supervisor_address != self.address:
            try:
                await asyncio.wait_for(
                    self._supervisor.unregister_worker(self.address),
                    self._heartbeat_settings.timeout_s,
                )
            except Exception as error:  # it will notice the silence instead
                logger.warning("could not tell the supervisor: %r", error)
        killed: list[int] = []
        for address in list(self._sub_pools):
            killed += await self.remove_replica(address)
        return killed

    async def gpus(self) -> tuple[str, ...]:
        return self._gpus or ()

    async def plan(
        self,
        num_replicas: int,
        xavier: bool,
        gpu_idx: Sequence[int] | None = None,
        device_budget_bytes: int | None = None,
        devices_per_replica: int = 1,
    ) -> list[ReplicaPlacement]:
        """Placements of a model's replicas on this host, environment included;
        ``gpu_idx`` picks which of this worker's GPUs they spread over, each
        replica taking ``devices_per_replica`` (its tensor-parallel size). A Xavier
        device tier of ``device_budget_bytes`` per replica that this host's memory
        cannot hold is refused here, before anything starts."""
        gpus = self._gpus or ()
        if gpu_idx is not None:
            missing = [index for index in gpu_idx if index >= len(gpus)]
            if missing:
                raise LaunchOptionError(
                    f"gpu_idx {missing} not on worker {self.address}: it has "
                    f"{len(gpus)} GPU(s)"
                )
            gpus = tuple(gpus[index] for index in gpu_idx)
        try:
            placements = plan_replicas(
                num_replicas,
                gpus=gpus,
                xavier=xavier,
                user_env=os.environ,
                devices_per_replica=devices_per_replica,
                host_cpus=os.cpu_count() or 1,
            )
        except ValueError as error:  # too few GPUs for one replica
            raise LaunchOptionError(f"worker {self.address}: {error}") from None
        if device_budget_bytes:
            refusal = device_budget_refusal(
                placements,
                device_budget_bytes,
                gpu_memory=await asyncio.to_thread(gpu_total_memory, self._gpus or ()),
                host_available_bytes=psutil.virtual_memory().available,
                worker=self.address,
                ranks_per_replica=devices_per_replica,
            )
            if refusal is not None:
                raise LaunchOptionError(refusal)
        return placements

    async def start_tracker_relay(
        self, model_uid: str, tracker_address: str, tracker_uid: str
    ) -> str:
        """This host's relay to the model's block tracker (``tracker_relay.py``),
        in this pool; its address."""
        await xo.create_actor(
            TrackerRelayActor,
            tracker_address,
            tracker_uid,
            address=self.address,
            uid=relay_uid(model_uid),
        )
        return self.address

    async def stop_tracker_relay(self, model_uid: str) -> None:
        await xo.destroy_actor(
            await xo.actor_ref(address=self.address, uid=relay_uid(model_uid))
        )

    async def start_replica_pool(self, placement: ReplicaPlacement) -> str:
        """Spawn one sub-pool for one replica; its external address."""
        host = _host_of(self._pool.external_address)
        scheme = f"{placement.address_scheme}://" if placement.address_scheme else ""
        address = await self._pool.append_sub_pool(
            external_address=f"{scheme}{host}:0",
            env={**placement.env_dict(), **log_level_env()} or None,
            logging_conf=sub_pool_logging(),
        )
        self._sub_pools[address] = self._pool.sub_processes[address].pid
        logger.info(
            "replica %d: sub-pool %s started (pid %d)",
            placement.rank,
            address,
            self._sub_pools[address],
        )
        return address

    async def load_replica(self, address: str, spec: ReplicaSpec) -> ReplicaInfo:
        """Create the model actor in ``address``'s sub-pool and load its engine."""
        if address not in self._sub_pools:
            raise KeyError(f"no replica sub-pool at {address}")
        actor = await xo.create_actor(
            ReplicaModelActor,
            spec,
            address=address,
            uid=model_actor_uid(spec.model_uid, spec.rank),
        )
        info = await actor.load()
        await self.replica_health([address])  # remember what the engine spawned
        return info

    async def replica_health(self, addresses: Sequence[str]) -> dict[str, str | None]:
        """For each sub-pool address: why its process is gone, or None while it
        runs. Also refreshes the record of what each sub-pool spawned."""
        health: dict[str, str | None] = {}
        for address in addresses:
            pid = self._sub_pools.get(address)
            if pid is None:
                health[address] = "its sub-pool was removed"
                continue
            process = self._pool.sub_processes.get(address)
            code = None if process is None else process.returncode
            if code is None:
                seen = await asyncio.to_thread(_descendants_if_alive, pid)
                if seen is not None:
                    self._spawned[address] = _merge(self._spawned.get(address), seen)
                    health[address] = None
                    continue
            health[address] = f"its sub-pool process {pid} exited" + (
                "" if code is None else f" (code {code})"
            )
        return health

    async def remove_replica(self, address: str) -> list[int]:
        """Stop a replica's sub-pool; the pids that had to be killed (ideally none).

        Whatever the sub-pool spawned is collected first, so processes that survive
        the pool (an engine that did not shut down) are found and killed.
        """
        pid = self._sub_pools.pop(address, None)
        if pid is None:
            return []
        descendants = _merge(
            self._spawned.pop(address, None),
            await asyncio.to_thread(_descendants, pid),
        )
        process = self._pool.sub_processes.get(address)
        # A sub-pool that died cannot be asked to stop: only cleaned up.
        exited = process is None or process.returncode is not None
        try:
            await asyncio.wait_for(
                self._pool.remove_sub_pool(address, force=exited),
                SUB_POOL_STOP_TIMEOUT_S,
            )
        except TimeoutError:
            logger.warning("sub-pool %s did not stop in time; killing it", address)
            # ``remove_sub_pool`` forgot the pool before it timed out: kill by pid.
            await asyncio.to_thread(_kill_pid, pid)
        killed = await asyncio.to_thread(
            _reap, descendants, CHILD_EXIT_TIMEOUT_S, address
        )
        logger.info("replica sub-pool %s removed", address)
        return killed

    async def sub_pools(self) -> dict[str, int]:
        return dict(self._sub_pools)


def detect_gpus() -> list[str]:
    """The CUDA devices this process may use, as ``CUDA_VISIBLE_DEVICES`` entries
    (the user's own list when set, so a replica pinned to "0" gets the user's first
    device, not the machine's); none without CUDA."""
    try:
        import torch
    except ImportError:
        return []
    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [entry.strip() for entry in visible.split(",") if entry.strip()][:count]
    return [str(index) for index in range(count)]


def gpu_total_memory(gpus: Sequence[str]) -> dict[str, int]:
    """Each of this process's CUDA devices (as ``detect_gpus`` names them) -> its
    total memory in bytes; empty without CUDA. torch initialises CUDA in this
    worker process to read them; its sub-pools are new processes, not forks, so
    they are unaffected. (Not run yet on a GPU: the CPU machine has none.)"""
    if not gpus:
        return {}
    import torch

    return {
        gpu: torch.cuda.get_device_properties(index).total_memory
        for index, gpu in enumerate(gpus)
    }


def _host_of(address: str) -> str:
    hostport = address.split("://", 1)[-1]
    return hostport.rsplit(":", 1)[0]


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _descendants_if_alive(pid: int) -> list[psutil.Process] | None:
    """``pid``'s descendants, or None when ``pid`` is dead (a zombie included)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return None


def _merge(
    known: list[psutil.Process] | None, seen: list[psutil.Process]
) -> list[psutil.Process]:
    """``known`` processes still running (psutil checks the pid was not reused)
    plus the newly ``seen`` ones, each once."""
    merged = {process.pid: process for process in (known or ()) if process.is_running()}
    for process in seen:
        merged.setdefault(process.pid, process)
    return list(merged.values())


def _kill_pid(pid: int) -> None:
    try:
        psutil.Process(pid).kill()
    except psutil.NoSuchProcess:
        pass


def _reap(processes: list[psutil.Process], timeout: float, owner: str) -> list[int]:
    """Wait for ``processes`` to exit; kill and report those that do not."""
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    # A zombie has exited; one whose parent died waits for init to reap it (on
    # some hosts init never does), and no signal changes that: not a leftover.
    alive = [process for process in alive if not _is_zombie(process)]
    for process in alive:
        logger.warning(
            "process %d (%s) outlived sub-pool %s; killing it",
            process.pid,
            _name(process),
            owner,
        )
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
    return [process.pid for process in alive]


def _is_zombie(process: psutil.Process) -> bool:
    try:
        return bool(process.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return "?"
