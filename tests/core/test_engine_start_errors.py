"""A launch that vLLM will refuse fails early and in vLLM's words.

``--block-size 16`` on CPU passed every check, the engines loaded for about a
minute, then the CLI printed "Engine core initialization failed. See root cause
above. Failed core proc(s): {}" with the cause ("No common block size for 16 ...
MultipleOf(32)") only in the server's log. Now the block size is checked against
the attention backend vLLM selects before its engine core starts (a 400), and an
engine core that fails to start anyway is reported with the last error it printed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from xinference.core.child_errors import root_cause

TRACEBACK = """\
INFO 12-08 00:22:42 [core.py:90] Initializing a V1 LLM engine
ERROR 12-08 00:23:36 [core.py:1510] EngineCore failed to start.
Process EngineCore_DP0:
Traceback (most recent call last):
  File "/x/vllm/v1/worker/utils.py", line 555, in select_common_block_size
    raise ValueError(
ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)]).
INFO 12-08 00:23:37 [shm.py:40] cleaning up
"""


def test_the_root_cause_is_the_last_exception_printed() -> None:
    assert root_cause(TRACEBACK) == (
        "ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)])."
    )
    assert root_cause("torch.OutOfMemoryError: CUDA out of memory\n") == (
        "torch.OutOfMemoryError: CUDA out of memory"
    )
    assert root_cause("INFO all is well\nWARNING: low disk\n") is None


# A process that starts a child while ChildStderr is in place: the child fails
# the way vLLM's engine core does (a traceback on stderr, exit code 1).
SCRIPT = textwrap.dedent("""
    import multiprocessing, sys
    from xinference.core.child_errors import ChildStderr, root_cause

    def engine_core():
        raise ValueError("No common block size for 16 (CPU_ATTN: [MultipleOf(32)]).")

    if __name__ == "__main__":
        with ChildStderr() as children:
            child = multiprocessing.get_context("spawn").Process(target=engine_core)
            child.start()
            child.join()
            print("cause:", root_cause(children.text()))
        print("after", file=sys.stderr)
""")


def test_a_failed_childs_error_is_read_and_still_reaches_the_log(tmp_path) -> None:
    script = tmp_path / "start.py"
    script.write_text(SCRIPT)
    ran = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [
        "cause: ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)])."
    ]
    # the log (the real stderr) has the child's traceback as before, and this
    # process writes there directly again afterwards
    assert "Traceback (most recent call last)" in ran.stderr
    assert ran.stderr.rstrip().endswith("after")


def test_a_refusal_from_a_replica_process_reads_as_written() -> None:
    """The block size is refused in the replica's process; xoscar hands the
    error on with "[address=..., pid=...]" in its str(): the 400 has the
    message alone."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from xoscar.backends.message import ErrorMessage

    from xinference.api.errors import install_error_handlers
    from xinference.core.options import LaunchOptionError

    message = "block_size 16 is refused by vLLM: No common block size for 16"
    relayed = ErrorMessage(
        b"1", "nixl://127.0.0.1:1", 7, LaunchOptionError, LaunchOptionError(message)
    ).as_instanceof_cause()
    assert str(relayed).startswith("[address=")  # what the 400 used to say
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/models")
    async def launch() -> None:
        raise relayed

    response = TestClient(app).post("/v1/models")
    assert response.status_code == 400
    assert response.json()["detail"] == message


@pytest.mark.slow
def test_a_block_size_the_cpu_backend_cannot_run_is_refused_before_start() -> None:
    """vLLM's CPU attention backend runs multiples of 32 only."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the CPU build of vLLM selects the CPU attention backend")
    from xinference.core.messages import ReplicaSpec
    from xinference.core.options import EngineOptions, LaunchOptionError
    from xinference.core.registry import resolve_model
    from xinference.core.vllm_engine import build_engine_args, engine_config

    def args(**engine: int):  # type: ignore[no-untyped-def]
        return build_engine_args(
            ReplicaSpec(
                model_uid="m",
                model_path=str(resolve_model("tiny-qwen2")),
                rank=0,
                num_replicas=1,
                engine=EngineOptions(dtype="float32", **engine),
                xavier=None,
            )
        )

    with pytest.raises(LaunchOptionError) as refused:
        engine_config(args(block_size=16))
    assert str(refused.value) == (
        "block_size 16 is refused by vLLM: No common block size for 16 "
        "(CPU_ATTN: [MultipleOf(32)])."
    )
    assert engine_config(args(block_size=64)).cache_config.block_size == 64
    # vLLM's own validation of its arguments, in its words, as a launch error
    with pytest.raises(LaunchOptionError) as refused:
        engine_config(args(max_model_len=10**7))
    assert str(refused.value).startswith("vLLM refused the engine settings: ")
    assert "max_model_len" in str(refused.value)
