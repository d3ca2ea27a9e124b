"""Worker liveness: the rules with a fake clock, then the two loops for real."""

import asyncio

import pytest

from xinference.core.heartbeat import (
    HeartbeatSettings,
    WorkerLiveness,
    beat_forever,
    watch_workers,
)


def test_settings_come_from_flags_then_environment_then_defaults():
    assert HeartbeatSettings.from_env({}) == HeartbeatSettings(1.0, 5.0)
    env = {
        "XINFERENCE_HEARTBEAT_INTERVAL_S": "0.5",
        "XINFERENCE_HEARTBEAT_TIMEOUT_S": "3",
    }
    assert HeartbeatSettings.from_env(env) == HeartbeatSettings(0.5, 3.0)
    assert HeartbeatSettings.from_env(env, timeout_s=9.0).timeout_s == 9.0
    with pytest.raises(ValueError, match="must exceed"):
        HeartbeatSettings(2.0, 2.0)


def test_a_worker_is_gone_only_after_the_timeout_without_a_beat():
    liveness = WorkerLiveness(HeartbeatSettings(1.0, 5.0))
    liveness.register("a:1", now=0.0)
    liveness.register("b:1", now=0.0)
    assert liveness.beat("a:1", now=4.0)
    assert liveness.expire(now=5.0) == []  # b: exactly the timeout, not past it
    assert liveness.expire(now=5.5) == ["b:1"]
    assert not liveness.knows("b:1")
    # a gone worker's beat is refused: it must register again
    assert liveness.beat("b:1", now=6.0) is False
    assert liveness.expire(now=9.5) == ["a:1"]
    liveness.register("b:1", now=10.0)
    assert liveness.beat("b:1", now=11.0)


async def test_watch_declares_a_silent_worker_gone_within_the_bound():
    settings = HeartbeatSettings(0.05, 0.3)
    liveness = WorkerLiveness(settings)
    loop = asyncio.get_running_loop()
    liveness.register("quiet:1", loop.time())
    liveness.register("chatty:1", loop.time())
    gone: list[tuple[str, float]] = []

    async def on_gone(address, reason):
        assert "no heartbeat for more than 0.3 s" in reason
        gone.append((address, loop.time()))

    started = loop.time()
    watch = asyncio.create_task(watch_workers(liveness, on_gone, clock=loop.time))
    try:
        for _ in range(20):  # 1 s of beats from one worker only
            liveness.beat("chatty:1", loop.time())
            await asyncio.sleep(0.05)
    finally:
        watch.cancel()
    assert [address for address, _ in gone] == ["quiet:1"]
    # declared after the timeout, at most one check interval (plus slack) later
    assert 0.3 <= gone[0][1] - started <= 0.3 + 0.05 + 0.2


async def test_a_stalled_supervisor_loop_does_not_declare_workers_gone():
    settings = HeartbeatSettings(0.05, 0.2)
    liveness = WorkerLiveness(settings)
    now = [0.0]
    liveness.register("w:1", 0.0)
    gone = []

    async def on_gone(address, reason):
        gone.append(address)

    watch = asyncio.create_task(watch_workers(liveness, on_gone, clock=lambda: now[0]))
    await asyncio.sleep(0.01)
    now[0] = 5.0  # the next check runs 5 s late: the loop stalled, not the worker
    await asyncio.sleep(0.08)
    watch.cancel()
    assert gone == [] and liveness.knows("w:1")


@pytest.mark.parametrize(
    "late_by, declared_gone",
    [(0.49, True), (0.51, False)],
    ids=["just-below-half-the-timeout", "just-above-half-the-timeout"],
)
async def test_the_stall_threshold_is_half_the_timeout(late_by, declared_gone):
    """A check that runs late by more than half the timeout is the supervisor's own
    stall (the workers' clocks restart); one late by less is not, and a worker
    silent past the timeout is declared gone by it. Tested on both sides of the
    threshold: a threshold off by a factor of two or more either way fails one."""
    settings = HeartbeatSettings(0.05, 1.0)
    liveness = WorkerLiveness(settings)
    liveness.register("w:1", -10.0)  # silent for far longer than the timeout
    # the watch reads the clock when it starts, then once per check
    times = [0.0, settings.interval_s + late_by * settings.timeout_s]
    gone = []

    async def on_gone(address, reason):
        gone.append(address)

    watch = asyncio.create_task(
        watch_workers(liveness, on_gone, clock=lambda: times.pop(0) if times else 0.0)
    )
    try:
        while times:  # the first check has read its time and run to its end
            await asyncio.sleep(0.005)
        await asyncio.sleep(0)
    finally:
        watch.cancel()
    assert gone == (["w:1"] if declared_gone else [])
    assert liveness.knows("w:1") is not declared_gone


async def test_the_worker_registers_again_when_the_supervisor_forgot_it():
    answers = [True, False, True, True]
    calls = []

    async def beat():
        calls.append("beat")
        return answers.pop(0) if answers else True

    async def register():
        calls.append("register")

    task = asyncio.create_task(
        beat_forever(beat, register, HeartbeatSettings(0.02, 0.1), "worker w")
    )
    await asyncio.sleep(0.1)
    task.cancel()
    assert calls[:4] == ["beat", "beat", "register", "beat"]


async def test_heartbeat_failures_do_not_stop_the_worker_beating():
    outcomes = [ConnectionError("cut"), ConnectionError("cut"), True]
    beats = []

    async def beat():
        beats.append(1)
        outcome = outcomes.pop(0) if outcomes else True
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def register():
        raise AssertionError("not needed")

    task = asyncio.create_task(
        beat_forever(beat, register, HeartbeatSettings(0.02, 0.1), "worker w")
    )
    await asyncio.sleep(0.12)
    task.cancel()
    assert len(beats) >= 4  # it went on after the failures
