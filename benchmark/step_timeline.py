"""A step timeline of vLLM engines: how long each request spends in which phase.

Wraps a handful of vLLM methods (the engine core's step, the scheduler's
``schedule`` and ``update_from_output``, the worker's ``execute_model`` and
``sample_tokens``, ``LLM.generate``) and every method of Xavier's connector, in
every process of an engine (the front, the engine core, its workers), and records
each call's start and end on CLOCK_MONOTONIC, which all processes of one host
share. A benchmark that knows when it sent a request and got its answer then
splits that window into phases that add up to the whole (``split``).

How it gets into vLLM's processes: vLLM spawns its engine core and workers as
fresh interpreters, so the hooks are installed from a ``sitecustomize`` module in a
directory on ``PYTHONPATH`` (``hook_dir``), which every spawned Python imports at
start. A process records only once ``XAVIER_STEP_TIMELINE`` names a directory in
its environment (read at each call, so an engine process that sets it before it
imports vLLM records, and its children inherit it); each process appends to
``<dir>/<pid>.tsv``, one ``os.write`` per call (a few microseconds).

Used by ``ttft_remote_hit.py --timeline``; not part of the product.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "XAVIER_STEP_TIMELINE"
CONNECTOR = "xinference.model.llm.vllm.xavier.connector.vllm_facade"

# module -> {class: methods}; a name missing in a vLLM version is skipped.
# Step: the engine core's one pass (``step_with_batch_queue`` where vLLM keeps
# a batch in flight). ``None`` as the methods: every public method the class
# itself defines (the connector's).
HOOKS: dict[str, dict[str, tuple[str, ...] | None]] = {
    "vllm.entrypoints.llm": {"LLM": ("generate",)},
    "vllm.v1.engine.core": {"EngineCore": ("step", "step_with_batch_queue")},
    "vllm.v1.core.sched.scheduler": {"Scheduler": ("schedule", "update_from_output")},
    "vllm.v1.worker.gpu_worker": {"Worker": ("execute_model", "sample_tokens")},
    "vllm.v1.worker.cpu_worker": {"CPUWorker": ("execute_model", "sample_tokens")},
    CONNECTOR: {"XavierConnector": None},
}

STEP = ("EngineCore.step", "EngineCore.step_with_batch_queue")
GENERATE = "LLM.generate"
SCHEDULER_SIDE = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)

_fd: int | None = None


def _record(name: str, start_ns: int, end_ns: int) -> None:
    global _fd
    if _fd is None:
        directory = os.environ.get(ENV)
        if not directory:
            return
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{os.getpid()}.tsv")
        _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(_fd, f"{name}\t{start_ns}\t{end_ns}\n".encode())


def _timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.monotonic_ns()
        try:
            return method(*args, **kwargs)
        finally:
            _record(name, start, time.monotonic_ns())

    wrapper.__step_timeline__ = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_module(module: Any) -> None:
    for class_name, methods in HOOKS[module.__name__].items():
        cls = getattr(module, class_name, None)
        if cls is None:
            continue
        names = methods or tuple(
            n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")
        )
        for name in names:
            method = vars(cls).get(name)
            if method is None or getattr(method, "__step_timeline__", False):
                continue
            label = name if methods is None else f"{class_name}.{name}"
            setattr(cls, name, _timed(label, method))


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        _wrap_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in HOOKS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Wrap the hooked methods of every hooked module imported from now on."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name in HOOKS:
        if name in sys.modules:
            _wrap_module(sys.modules[name])


def hook_dir(parent: Path) -> Path:
    """A directory with a ``sitecustomize`` that installs the hooks; put it first
    on ``PYTHONPATH`` of the processes to time."""
    directory = parent / "step-timeline-hook"
    directory.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve().parent
    (directory / "sitecustomize.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(here)!r})\n"
        "import step_timeline\n"
        "step_timeline.install()\n"
    )
    return directory


@dataclass(frozen=True)
class Event:
    name: str
    pid: int
    start_ns: int
    end_ns: int

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def load_events(directory: Path) -> list[Event]:
    events = []
    for path in directory.glob("*.tsv"):
        pid = int(path.stem)
        for line in path.read_text().splitlines():
            name, start, end = line.split("\t")
            events.append(Event(name, pid, int(start), int(end)))
    return sorted(events, key=lambda e: e.start_ns)


# The phases of one request; an indented one is part of the one above it:
#   whole         = front + between steps + engine steps
#   engine steps  = schedule + execute + sample + update + step rest
#   execute       = start_load_kv + wait_for_save + forward rest (likewise sample)
# A connector call counts in the worker method whose call contains it (vLLM's
# runners call wait_for_save from execute_model or from sample_tokens). On a
# GPU the forward runs asynchronously: what execute_model queued is waited for
# in sample_tokens or in the engine core's step, so "forward rest" is the time
# spent queueing it. The connector's scheduler side runs inside schedule and
# update_from_output and is shown on its own.
PHASES = (
    "whole (LLM.generate)",
    "front: generate to first step, last step to return",
    "between steps",
    "engine steps",
    "  Scheduler.schedule",
    "  execute_model",
    "    start_load_kv (the load)",
    "    wait_for_save in execute_model",
    "    forward rest",
    "  sample_tokens",
    "    wait_for_save in sample_tokens",
    "    sampling rest (and waiting for the forward)",
    "  update_from_output",
    "  step rest (hops to workers, waits for the batch)",
    "connector, scheduler side (in schedule, update)",
    "engine steps (count)",
)
EXECUTE = ("Worker.execute_model", "CPUWorker.execute_model")
SAMPLE = ("Worker.sample_tokens", "CPUWorker.sample_tokens")


def _total(events: Iterable[Event], *names: str) -> float:
    return sum(e.ms for e in events if e.name in names)


def _within(events: Sequence[Event], name: str, outer_names: Sequence[str]) -> float:
    """ms of the ``name`` calls made inside a call of one of ``outer_names`` (of
    the same process)."""
    outers = [e for e in events if e.name in outer_names]
    return sum(
        e.ms
        for e in events
        if e.name == name
        and any(
            o.pid == e.pid and o.start_ns <= e.start_ns and e.end_ns <= o.end_ns
            for o in outers
        )
    )


def _answer_step_end(events: Sequence[Event]) -> int | None:
    """The end of the step that ran the first ``request_finished`` among
    ``events``, None where none ran in a step (no connector)."""
    for finished in (e for e in events if e.name == "request_finished"):
        for step in (e for e in events if e.name in STEP):
            if (
                step.pid == finished.pid
                and step.start_ns <= finished.start_ns
                and finished.end_ns <= step.end_ns
            ):
                return step.end_ns
    return None


def split(events: Sequence[Event], start_ns: int, end_ns: int) -> dict[str, float]:
    """The phases of the one request served in ``[start_ns, end_ns]`` (the
    engine served nothing else then), in ms; empty where no ``LLM.generate``
    ended in the window."""
    generates = [
        e
        for e in events
        if e.name == GENERATE and e.start_ns >= start_ns and e.end_ns <= end_ns
    ]
    if not generates:
        return {}
    whole = generates[-1]
    # what ran while the caller waited
    inside = [
        e for e in events if e.start_ns >= whole.start_ns and e.end_ns <= whole.end_ns
    ]
    # The answer leaves the engine core at the end of the step in which the
    # scheduler finished the request (the connector's request_finished runs in
    # it). vLLM steps once more right after, to tell the workers which requests
    # finished, while the front turns the answer into the return value: whether
    # that step ends before the return is a race, so it is never this request's
    # engine time; the front's share includes it.
    answer_end = _answer_step_end(inside)
    if answer_end is not None:
        inside = [e for e in inside if e.end_ns <= answer_end]
    steps = [e for e in inside if e.name in STEP]
    span = (steps[-1].end_ns - steps[0].start_ns) / 1e6 if steps else 0.0
    steps_ms = sum(e.ms for e in steps)
    execute = _total(inside, *EXECUTE)
    load = _within(inside, "start_load_kv", EXECUTE)
    save_in_execute = _within(inside, "wait_for_save", EXECUTE)
    sample = _total(inside, *SAMPLE)
    save_in_sample = _within(inside, "wait_for_save", SAMPLE)
    schedule = _total(inside, "Scheduler.schedule")
    update = _total(inside, "Scheduler.update_from_output")
    values = (
        whole.ms,
        whole.ms - span,
        span - steps_ms,
        steps_ms,
        schedule,
        execute,
        load,
        save_in_execute,
        execute - load - save_in_execute,
        sample,
        save_in_sample,
        sample - save_in_sample,
        update,
        steps_ms - schedule - execute - sample - update,
        _total(inside, *SCHEDULER_SIDE),
        float(len(steps)),
    )
    return dict(zip(PHASES, values, strict=True))


def median_split(splits: Sequence[dict[str, float]]) -> dict[str, float]:
    values: dict[str, list[float]] = defaultdict(list)
    for one in splits:
        for phase, ms in one.items():
            values[phase].append(ms)
    return {phase: statistics.median(v) for phase, v in values.items()}


def table(columns: dict[str, dict[str, float]], difference: tuple[str, str]) -> str:
    """A markdown table of phases (rows) by column, p50s in ms, with the
    difference of two columns last."""
    plus, minus = difference
    head = " | ".join(columns) + f" | {plus} − {minus}"
    lines = [f"| phase | {head} |", "| --- |" + " ---: |" * (len(columns) + 1)]
    for phase in PHASES:
        cells = [columns[c].get(phase, float("nan")) for c in columns]
        delta = columns[plus].get(phase, float("nan")) - columns[minus].get(
            phase, float("nan")
        )
        body = " | ".join(f"{v:.2f}" for v in cells)
        lines.append(f"| {phase} | {body} | {delta:+.2f} |")
    return "\n".join(lines)
