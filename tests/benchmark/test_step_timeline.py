"""The step timeline's split of one request into phases (benchmark/step_timeline.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import step_timeline  # noqa: E402
from step_timeline import Event  # noqa: E402

MS = 1_000_000  # ns
FRONT, CORE = 100, 200  # pids


EXECUTE, SAMPLE = "Worker.execute_model", "Worker.sample_tokens"


def request(wait_for_save_in: str) -> list[Event]:
    """One request: generate 0-20 ms; two engine steps (2-9, 10-18 ms); the load
    in the first step's execute_model; wait_for_save where vLLM calls it."""
    events = [
        Event("LLM.generate", FRONT, 0, 20 * MS),
        Event("EngineCore.step", CORE, 2 * MS, 9 * MS),
        Event("Scheduler.schedule", CORE, 2 * MS, 3 * MS),
        Event("get_num_new_matched_tokens", CORE, 2 * MS, 2 * MS + MS // 2),
        Event("Worker.execute_model", CORE, 3 * MS, 8 * MS),
        Event("start_load_kv", CORE, 3 * MS, 5 * MS),
        Event("Worker.sample_tokens", CORE, 8 * MS, 9 * MS),
        Event("EngineCore.step", CORE, 10 * MS, 18 * MS),
        Event("Worker.execute_model", CORE, 10 * MS, 14 * MS),
        Event("Worker.sample_tokens", CORE, 14 * MS, 17 * MS),
        Event("Scheduler.update_from_output", CORE, 17 * MS, 18 * MS),
        # after the answer: another request's, or freeing blocks; not this one's
        Event("EngineCore.step", CORE, 21 * MS, 22 * MS),
    ]
    host = [e for e in events if e.name == wait_for_save_in][-1]
    events.append(Event("wait_for_save", CORE, host.end_ns - MS, host.end_ns))
    return sorted(events, key=lambda e: e.start_ns)


@pytest.mark.parametrize("where", [EXECUTE, SAMPLE])
def test_the_phases_of_a_request_add_up_to_its_whole_time(where):
    phases = step_timeline.split(request(where), -MS, 30 * MS)
    assert phases["whole (LLM.generate)"] == 20
    assert phases["engine steps (count)"] == 2
    assert phases["engine steps"] == 15
    assert phases["between steps"] == 1
    assert phases["front: generate to first step, last step to return"] == 4
    assert (
        phases["front: generate to first step, last step to return"]
        + phases["between steps"]
        + phases["engine steps"]
        == phases["whole (LLM.generate)"]
    )
    assert phases["    start_load_kv (the load)"] == 2
    assert phases["  execute_model"] == 9
    assert phases["  sample_tokens"] == 4
    assert phases["connector, scheduler side (in schedule, update)"] == 0.5
    steps = (
        phases["  Scheduler.schedule"]
        + phases["  execute_model"]
        + phases["  sample_tokens"]
        + phases["  update_from_output"]
        + phases["  step rest (hops to workers, waits for the batch)"]
    )
    assert steps == phases["engine steps"]


def test_wait_for_save_counts_in_the_call_that_contains_it():
    in_execute = step_timeline.split(request(EXECUTE), -MS, 30 * MS)
    assert in_execute["    wait_for_save in execute_model"] == 1
    assert in_execute["    wait_for_save in sample_tokens"] == 0
    assert in_execute["    forward rest"] == 9 - 2 - 1
    in_sample = step_timeline.split(request(SAMPLE), -MS, 30 * MS)
    assert in_sample["    wait_for_save in sample_tokens"] == 1
    assert in_sample["    forward rest"] == 9 - 2
    assert in_sample["    sampling rest (and waiting for the forward)"] == 3


def test_a_window_without_a_finished_generate_has_no_phases():
    assert step_timeline.split(request(EXECUTE), 0, 10 * MS) == {}


def test_the_step_after_the_answer_is_the_fronts_even_when_it_ends_first():
    """vLLM steps once more after the step that finished the request (to tell
    the workers): that step is left out even when it ends before the return,
    and its time counts in the front's share."""
    events = request(EXECUTE)
    answered = [
        Event("request_finished", CORE, 17 * MS + MS // 2, 17 * MS + MS // 2 + 1),
        Event("EngineCore.step", CORE, 18 * MS + MS // 4, 19 * MS),  # before 20
        Event("Worker.execute_model", CORE, 18 * MS + MS // 2, 19 * MS),
    ]
    events = sorted(events + answered, key=lambda e: e.start_ns)
    phases = step_timeline.split(events, -MS, 30 * MS)
    assert phases["engine steps (count)"] == 2
    assert phases["engine steps"] == 15
    assert phases["  execute_model"] == 9
    assert phases["front: generate to first step, last step to return"] == 4
    # without the connector's mark, a step that ends in the window is counted
    plain = step_timeline.split(
        [e for e in events if e.name != "request_finished"], -MS, 30 * MS
    )
    assert plain["engine steps (count)"] == 3
