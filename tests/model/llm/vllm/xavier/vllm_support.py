"""Real vLLM engines and real Xavier replicas for the connector tests and benchmarks.

- ``tiny_model_path``: the tiny random Qwen2 model, built offline once per machine.
- ``EngineProcess``: one ``vllm.LLM`` in its own spawned process (vLLM then starts its
  engine-core and worker processes below it), driven through a pipe with token-id
  prompts and greedy sampling. The child imports this module by name, so it must
  stay importable (``tests`` is a package) and free of work at import time.
- ``XavierCluster``: the replicas' side of the deployment without the serving layer:
  a real xoscar pool whose main process is the caller and whose sub-pools are
  ``nixl://`` processes, one block tracker in the main pool and one transfer actor
  per replica in its own sub-pool (so peer reads are real NIXL transfers).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xoscar as xo

from xinference.model.llm.vllm.xavier.stats import XavierStats

REPO_ROOT = Path(__file__).resolve().parents[5]
INSTRUMENTED_MODULE = "tests.model.llm.vllm.xavier.connector.instrumented_connector"
BLOCK_SIZE = 32  # vLLM's CPU backend needs a multiple of 32
ENGINE_START_TIMEOUT_S = 240.0


def ensure_importable() -> None:
    """Let spawned processes (xoscar sub-pools, vLLM's) import ``xinference``/tests.

    An editable install makes this a no-op; a plain checkout needs PYTHONPATH.
    """
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(REPO_ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *filter(None, paths)]
        )
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


def tiny_model_path() -> Path:
    """The test model, built on first use into the temp dir and reused afterwards."""
    from xinference.model.llm.tiny_model import build_tiny_qwen2

    return build_tiny_qwen2(Path(tempfile.gettempdir()) / "xavier-tiny-qwen2")


@dataclass(frozen=True, slots=True)
class Completion:
    token_ids: tuple[int, ...]
    num_cached_tokens: int  # local prefix-cache hits plus external (Xavier) tokens
    kv_transfer_params: dict[str, Any] | None  # what the connector reported
    # from its first scheduling to its last token, in the engine core; only
    # where the engine keeps request stats (``disable_log_stats=False``)
    engine_seconds: float | None = None


def xavier_external_tokens(completion: Completion) -> int:
    params = completion.kv_transfer_params or {}
    return int(params.get("xavier_external_tokens", 0))


def engine_kwargs(
    model_path: Path | str,
    xavier: dict[str, Any] | None = None,
    *,
    kv_cache_bytes: int = 64 << 20,
    max_model_len: int = 2048,
    test_dir: Path | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for a CPU test engine (plain data, picklable).

    ``xavier`` is ``XavierReplicaSettings.to_dict()``; None serves without Xavier.
    With ``test_dir`` the engine loads ``InstrumentedXavierConnector`` (its control
    files live there) instead of the production connector.
    """
    kwargs: dict[str, Any] = dict(
        model=str(model_path),
        dtype="bfloat16",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_bytes,
        enable_prefix_caching=True,
        disable_log_stats=True,
        seed=0,
    )
    if xavier is not None:
        extra: dict[str, Any] = {"xavier": xavier}
        connector = (
            "XavierConnector",
            "xinference.model.llm.vllm.xavier.connector.vllm_facade",
        )
        if test_dir is not None:
            from .connector.instrumented_connector import TEST_DIR_KEY

            extra[TEST_DIR_KEY] = str(test_dir)
            connector = ("InstrumentedXavierConnector", INSTRUMENTED_MODULE)
        kwargs["kv_transfer"] = dict(
            kv_connector=connector[0],
            kv_connector_module_path=connector[1],
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
        kwargs["disable_hybrid_kv_cache_manager"] = True
    kwargs.update(overrides)
    return kwargs


class EngineFailed(RuntimeError):
    """The engine process reported an error; ``log`` is the tail of its stderr."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(f"{message}\n--- engine log tail ---\n{log}")
        self.log = log


class EngineProcess:
    """One vLLM engine in a spawned process; start it with ``start()``."""

    def __init__(
        self, name: str, kwargs: dict[str, Any], env: dict[str, str] | None = None
    ) -> None:
        ensure_importable()
        self.name = name
        self._kwargs = kwargs
        self._env = dict(env or {})
        self._log_path = Path(tempfile.mkdtemp(prefix=f"xavier-{name}-")) / "engine.log"
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_engine_main,
            args=(child_conn, kwargs, self._env, str(self._log_path)),
            name=f"xavier-engine-{name}",
            daemon=False,
        )
        self._child_conn = child_conn

    @property
    def pid(self) -> int | None:
        """The engine process (vLLM's engine core and workers are its children)."""
        return self._process.pid

    def start(self) -> EngineProcess:
        self._process.start()
        self._child_conn.close()
        return self

    def wait_ready(self, timeout: float = ENGINE_START_TIMEOUT_S) -> EngineProcess:
        self._expect("ready", timeout)
        return self

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def send_generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int = 8,
        ignore_eos: bool = True,
    ) -> None:
        self._conn.send(
            ("generate", [list(p) for p in prompts], max_tokens, ignore_eos)
        )

    def receive_generate(
        self, timeout: float = 300.0
    ) -> tuple[list[Completion], float]:
        """(completions, seconds the engine spent in ``generate``)."""
        completions, seconds = self._expect("generated", timeout)
        return [Completion(*c) for c in completions], seconds

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int = 8,
        ignore_eos: bool = True,
        timeout: float = 300.0,
    ) -> list[Completion]:
        self.send_generate(prompts, max_tokens, ignore_eos)
        return self.receive_generate(timeout)[0]

    def timed_generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 1
    ) -> tuple[list[Completion], float]:
        self.send_generate(prompts, max_tokens)
        return self.receive_generate()

    def stop(self, timeout: float = 60.0) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(("stop",))
                self._process.join(timeout)
            except (OSError, EOFError):
                pass
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()

    def _expect(self, kind: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if not self._process.is_alive():
                raise EngineFailed(
                    f"engine {self.name} exited with {self._process.exitcode}",
                    self.log_tail(),
                )
            if time.monotonic() > deadline:
                raise EngineFailed(
                    f"engine {self.name} gave no {kind!r} in {timeout:.0f} s",
                    self.log_tail(),
                )
        message = self._conn.recv()
        if message[0] == "error":
            raise EngineFailed(
                f"engine {self.name} failed: {message[1]}", self.log_tail()
            )
        if message[0] != kind:
            raise EngineFailed(f"engine {self.name} sent {message[0]!r}", "")
        return message[1]


def _engine_seconds(metrics: Any) -> float | None:
    """A request's time in the engine core, from its first scheduling to its last
    token (vLLM's ``RequestStateStats``; None without request stats)."""
    scheduled = getattr(metrics, "scheduled_ts", 0.0)
    last = getattr(metrics, "last_token_ts", 0.0)
    return last - scheduled if scheduled and last else None


def _engine_main(
    conn: multiprocessing.connection.Connection,
    kwargs: dict[str, Any],
    env: dict[str, str],
    log_path: str,
) -> None:
    """Body of the engine process: build ``vllm.LLM``, then serve pipe commands."""
    # Everything vLLM's own processes print lands in one file the test can show.
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    # The KV cache size comes from kv_cache_memory_bytes; the legacy variable
    # would override it.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ.update(env)
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.inputs import TokensPrompt

        kwargs = dict(kwargs)
        transfer = kwargs.pop("kv_transfer", None)
        if transfer is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(**transfer)
        llm = LLM(**kwargs)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            command = conn.recv()
        except EOFError:
            break
        if command[0] == "stop":
            break
        try:
            _, prompts, max_tokens, ignore_eos = command
            params = SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos
            )
            started = time.perf_counter()
            outputs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts],
                params,
                use_tqdm=False,
            )
            seconds = time.perf_counter() - started
            completions = [
                (
                    tuple(o.outputs[0].token_ids),
                    int(o.num_cached_tokens or 0),
                    o.kv_transfer_params,
                    _engine_seconds(o.metrics),
                )
                for o in outputs
            ]
            conn.send(("generated", (completions, seconds)))
        except BaseException as exc:
            conn.send(
                ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            )
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # the process ends right after; vLLM's atexit cleans up too
        pass


class XavierCluster:
    """Tracker plus one transfer actor per replica, in a real ``nixl://`` pool.

    The pool's main process is the caller; its event loop runs in a background
    thread (``BackgroundLoop``), so tests stay synchronous.
    """

    def __init__(
        self,
        model_uid: str,
        num_replicas: int = 2,
        rpc_timeout_s: float = 5.0,
        envs: Sequence[dict[str, str]] | None = None,
    ) -> None:
        """``envs``: extra environment of each sub-pool (sub-pool ``i + 1`` gets
        ``envs[i]``), e.g. to make one holder's UCX TCP-only."""
        ensure_importable()
        from xinference.model.llm.vllm.xavier.aio import BackgroundLoop
        from xinference.model.llm.vllm.xavier.tracker import (
            BlockTrackerActor,
            tracker_uid,
        )

        self.model_uid = model_uid
        self.num_replicas = num_replicas
        self.rpc_timeout_s = rpc_timeout_s
        self.loop = BackgroundLoop("xavier-test-cluster")
        self.pool = self.loop.run(
            xo.create_actor_pool(
                "127.0.0.1",
                n_process=num_replicas + 1,  # one sub-pool spare for test peers
                external_address_schemes=["nixl"] * (num_replicas + 2),
                envs=list(envs) if envs is not None else None,
            ),
            120,
        )
        self.address = self.pool.external_address
        self.tracker_uid = tracker_uid(model_uid)
        self.tracker = self.loop.run(
            xo.create_actor(
                BlockTrackerActor, address=self.address, uid=self.tracker_uid
            ),
            60,
        )
        self.transfer_refs: dict[int, Any] = {}
        self.gpu_cache_bytes: dict[int, int | None] = {}
        self.transfer_addresses: dict[int, str] = {}

    def start_peer(self, actor_cls: type, rank: int, *args: Any) -> str:
        """Create a test peer posing as replica ``rank``'s transfer actor in the spare
        sub-pool and register it with the tracker; returns its address."""
        from xinference.model.llm.vllm.xavier.config import transfer_actor_uid

        ref = self.loop.run(
            xo.create_actor(
                actor_cls,
                *args,
                address=self.address,
                uid=transfer_actor_uid(self.model_uid, rank),
                allocate_strategy=xo.allocate_strategy.ProcessIndex(
                    self.num_replicas + 1
                ),
            ),
            60,
        )
        self.call(self.tracker.register_replica(rank, ref.address))
        return ref.address

    def start_transfer_actor(
        self,
        rank: int,
        gpu_cache_bytes: int | None = None,
        sub_pool: int | None = None,
        cpu_capacity_blocks: int | None = None,
        actor_cls: type | None = None,
    ) -> str:
        """Create replica ``rank``'s transfer actor, by default in sub-pool
        ``rank + 1`` (ranks beyond the replicas wrap around). ``gpu_cache_bytes``:
        see ``XavierConfig`` (not None selects GPU-first, i.e. asynchronous loads).
        ``actor_cls``: a test subclass of ``XavierTransferActor``."""
        if sub_pool is None:
            sub_pool = rank % self.num_replicas + 1
        from xinference.model.llm.vllm.xavier.actor.transfer_actor import (
            TransferActorConfig,
            XavierTransferActor,
        )
        from xinference.model.llm.vllm.xavier.config import transfer_actor_uid

        config = TransferActorConfig(
            model_uid=self.model_uid,
            rank=rank,
            tracker_address=self.address,
            tracker_uid=self.tracker_uid,
            gpu_cache_bytes=gpu_cache_bytes,
            cpu_capacity_blocks=cpu_capacity_blocks,
            rpc_timeout_s=self.rpc_timeout_s,
        )
        ref = self.loop.run(
            xo.create_actor(
                actor_cls or XavierTransferActor,
                config,
                address=self.address,
                uid=transfer_actor_uid(self.model_uid, rank),
                allocate_strategy=xo.allocate_strategy.ProcessIndex(sub_pool),
            ),
            120,
        )
        self.transfer_refs[rank] = ref
        self.transfer_addresses[rank] = ref.address
        self.gpu_cache_bytes[rank] = gpu_cache_bytes
        return ref.address

    def replica_settings(
        self, rank: int, transfer_address: str | None = None
    ) -> dict[str, Any]:
        """``XavierReplicaSettings.to_dict()`` for replica ``rank``."""
        from xinference.model.llm.vllm.xavier.config import (
            XavierConfig,
            XavierReplicaSettings,
            transfer_actor_uid,
        )

        return XavierReplicaSettings(
            config=XavierConfig(
                enabled=True, gpu_cache_bytes=self.gpu_cache_bytes.get(rank)
            ),
            model_uid=self.model_uid,
            rank=rank,
            tracker_address=self.address,
            tracker_uid=self.tracker_uid,
            transfer_address=transfer_address or self.transfer_addresses[rank],
            transfer_uid=transfer_actor_uid(self.model_uid, rank),
            rpc_timeout_s=self.rpc_timeout_s,
        ).to_dict()

    def call(self, awaitable: Any, timeout: float = 30.0) -> Any:
        return self.loop.run(awaitable, timeout)

    def stats(self, rank: int) -> XavierStats:
        return self.call(self.transfer_refs[rank].stats())

    def wait_mapped(self, rank: int, timeout: float = 120.0) -> None:
        """Block until replica ``rank``'s engine has mapped its KV caches into its
        transfer actor (the actor then has a store)."""
        deadline = time.monotonic() + timeout
        while not self.stats(rank).mapped:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {rank} did not map its KV caches")
            time.sleep(0.1)

    def wait_published(
        self, keys: Sequence[bytes], for_rank: int, timeout: float = 30.0
    ) -> None:
        """Block until the tracker tells replica ``for_rank`` that a peer holds every
        one of ``keys``: replicas publish what a request computed in the background,
        after the request has returned."""
        deadline = time.monotonic() + timeout
        while True:
            hit = self.call(self.tracker.query_prefix(for_rank, list(keys)))
            if hit is not None and hit.num_blocks == len(keys):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(keys)} blocks were not published for replica {for_rank} "
                    f"within {timeout} s (found {0 if hit is None else hit.num_blocks})"
                )
            time.sleep(0.02)

    def close(self) -> None:
        for ref in self.transfer_refs.values():
            try:
                self.call(ref.close(), 60)
            except Exception:  # the pool is stopped next anyway
                pass
        try:
            self.loop.run(self.pool.stop(), 60)
        finally:
            self.loop.close()


class RefusingHolder(xo.StatelessActor):
    """A holder that answers every reservation with an empty grant (a refusal)."""

    def reserve(self, keys: list[bytes], lease_id: str, requester: Any) -> Any:
        from xinference.model.llm.vllm.xavier.wire import LeaseGrant

        self.refused = getattr(self, "refused", 0) + 1
        return LeaseGrant(lease_id, -1, (), (), ())

    def release(self, lease_id: str) -> None:
        return None

    def refusals(self) -> int:
        return getattr(self, "refused", 0)
