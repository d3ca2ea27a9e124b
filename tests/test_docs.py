"""The README and docs/ stay true to the repository: every relative link and every
file path they name exists (a link's #section too), every CLI option they show is
one the command's ``--help`` lists (or, for ``launch``, a free ``--key value`` pair
the launch accepts), every Xavier series ``/metrics`` exports is in the metrics
reference with the stats it sums, and CI runs the README's test command. The docs
agree with each other and with the runs: every decimal figure the README's opening
and the performance summary quote is in the recorded results (the table's, in the
results file its row links), the GPUs the README says were tested are every GPU the
runs used, and no doc says the fast path waits for a GPU run once one is recorded.
The checkers are tested on wrong input first, so that a check that cannot fail does
not pass for one that holds."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from xinference.core.metrics import XAVIER_METRICS, XAVIER_RANK_METRICS
from xinference.core.options import LaunchSpec
from xinference.deploy import cmdline

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Paths in docs/internals.md are often relative to the xavier package.
PATH_ROOTS = [ROOT, ROOT / "xinference", ROOT / "xinference/model/llm/vllm/xavier"]
# A code span that names one of the repository's top-level folders must exist.
TOP_LEVEL = ("xinference/", "tests/", "benchmark/", "docs/", "scripts/", ".ci/")
FILE_SUFFIXES = (".py", ".md", ".sh", ".json", ".toml", ".txt", ".png", ".svg")
# The console scripts (pyproject.toml) and the click command each runs.
PROGRAMS: dict[str, click.Command] = {
    "xinference": cmdline.cli,
    "xinference-local": cmdline.local,
    "xinference-supervisor": cmdline.supervisor,
    "xinference-worker": cmdline.worker,
}

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_SPAN = re.compile(r"`([^`]+)`")
_HELP_OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


# ---- reading markdown --------------------------------------------------------------


def _prose_and_code(text: str) -> tuple[list[str], list[str]]:
    """The prose lines and the code lines: fenced, or indented by 4 after a blank
    line or another code line (a list item's wrapped line is prose)."""
    prose, code = [], []
    fenced = False
    previous = ""
    in_code = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            in_code = False
        elif fenced:
            code.append(line)
        else:
            in_code = line.startswith("    ") and (in_code or not previous.strip())
            (code if in_code else prose).append(line)
        previous = line
    return prose, code


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    prose, _ = _prose_and_code(text)
    for line in prose:
        match = re.match(r"^#{1,6}\s+(.*)$", line)
        if match:
            slug = _slug(match.group(1))
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def _spans(text: str) -> Iterator[str]:
    prose, _ = _prose_and_code(text)
    # A span may wrap onto the next line.
    for match in _SPAN.finditer("\n".join(prose)):
        yield " ".join(match.group(1).split())


# ---- links and paths ---------------------------------------------------------------


def broken_links(doc: Path, text: str) -> list[str]:
    errors = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if not path.exists():
            errors.append(f"{target}: no such file")
        elif (
            anchor and path.suffix == ".md" and anchor not in anchors(path.read_text())
        ):
            errors.append(f"{target}: no section #{anchor} in {path.name}")
    return errors


def _expand(path: str) -> list[str]:
    """``a/{b,c}.json`` -> ``a/b.json``, ``a/c.json``."""
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    return [
        expanded
        for part in match.group(1).split(",")
        for expanded in _expand(path[: match.start()] + part + path[match.end() :])
    ]


def _named_path(span: str) -> str | None:
    """The repository path a code span names, if it names one."""
    word = span.split()[0] if span.split() else ""
    if word in ("python", ".venv/bin/python") and len(span.split()) > 1:
        word = span.split()[1]  # `python benchmark/x.py --flag`
    if word.startswith(("$", "~", "/")) or "<" in word or "*" in word:
        return None  # a placeholder, a user's path or a pattern
    if word.startswith(TOP_LEVEL):
        return word
    if "/" in word and word.split("::")[0].endswith(FILE_SUFFIXES):
        return word
    return None


def missing_paths(text: str) -> list[str]:
    errors = []
    for span in _spans(text):
        named = _named_path(span)
        if named is None:
            continue
        for path in _expand(named):
            file_part, _, test_name = path.partition("::")
            found = [r / file_part for r in PATH_ROOTS if (r / file_part).exists()]
            if not found:
                errors.append(f"{path}: no such file or folder")
            elif test_name and not re.search(
                rf"^(async )?def {re.escape(test_name)}\(",
                found[0].read_text(),
                re.MULTILINE,
            ):
                errors.append(f"{path}: no test {test_name} in {file_part}")
    return errors


# ---- CLI options ---------------------------------------------------------------------


@functools.cache
def help_options(command: click.Command, *path: str) -> frozenset[str]:
    """The options ``<program> [path] --help`` lists."""
    result = CliRunner().invoke(command, [*path, "--help"])
    assert result.exit_code == 0, result.output
    options = result.output.split("Options:", 1)[1]
    return frozenset(_HELP_OPTION.findall(options))


def _takes_value(command: click.Command, option: str) -> bool:
    for param in command.params:
        if (
            isinstance(param, click.Option)
            and option in param.opts + param.secondary_opts
        ):
            return not param.is_flag
    return False


@functools.cache
def _vllm_engine_arguments() -> frozenset[str]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


def _free_launch_argument(option: str) -> bool:
    """A ``--key value`` pair ``xinference launch`` passes on: a launch option in
    upstream's spelling or a vLLM engine argument."""
    name = option.lstrip("-").replace("-", "_")
    launch_options = set(inspect.signature(LaunchSpec.from_options).parameters)
    return name in launch_options - {"engine_args"} or (
        name in _vllm_engine_arguments()
    )


def command_errors(words: list[str]) -> list[str]:
    """What ``<program> args`` would refuse: unknown subcommands and options."""
    program = PROGRAMS[Path(words[0]).name]
    errors = []
    path: list[str] = []
    command = program
    index = 1
    while index < len(words):
        word = words[index]
        index += 1
        if not word.startswith("-"):
            if isinstance(command, click.Group) and not path:
                sub = command.commands.get(word)
                if sub is None:
                    errors.append(f"{words[0]} has no command {word!r}")
                    return errors
                path, command = [word], sub
            else:
                errors.append(f"{' '.join(words)}: unexpected argument {word!r}")
            continue
        option = word.split("=", 1)[0]
        launch = path == ["launch"]
        if option in help_options(program, *path):
            if _takes_value(command, option) and "=" not in word:
                index += 1
        elif launch and option.startswith("--") and _free_launch_argument(option):
            if index < len(words) and not words[index].startswith("--"):
                index += 1
        else:
            where = " ".join([words[0], *path])
            errors.append(f"{where} --help lists no {option}")
            if index < len(words) and not words[index].startswith("-"):
                index += 1  # its value, most likely
    return errors


def _commands(text: str) -> Iterator[list[str]]:
    """The command lines that run one of PROGRAMS, as words."""
    _, code = _prose_and_code(text)
    lines = "\n".join(code).replace("\\\n", " ").splitlines()
    lines += [span for span in _spans(text)]
    for line in lines:
        for segment in re.split(r"&&|;|\|", line):
            try:
                words = shlex.split(segment, comments=True)
            except ValueError:  # a quote cut by the split: a curl line's JSON
                continue
            while words and re.match(r"^[A-Z_]+=", words[0]):
                words = words[1:]  # VAR=value before the program
            words = [w for w in words if w != "&"]
            if words and Path(words[0]).name in PROGRAMS:
                yield words


def all_options() -> frozenset[str]:
    options: set[str] = set()
    for program in PROGRAMS.values():
        options |= help_options(program)
        if isinstance(program, click.Group):
            for name in program.commands:
                options |= help_options(program, name)
    return frozenset(options)


def option_errors(text: str) -> list[str]:
    errors = [e for words in _commands(text) for e in command_errors(words)]
    # An option shown on its own (`--replica N`, `-e/--endpoint`): one of ours.
    for span in _spans(text):
        if not span.startswith("-"):
            continue
        words = span.split()
        shown = words if all(w.startswith("-") for w in words) else words[:1]
        for option in (o for word in shown for o in word.split("/")):
            if option.startswith("-") and option.split("=")[0] not in all_options():
                if not (option.startswith("--") and _free_launch_argument(option)):
                    errors.append(f"`{span}`: no command lists {option}")
    return errors


# ---- docs against each other, the code and the runs ----------------------------------

RESULTS = ROOT / "benchmark/results"
_DECIMAL = re.compile(r"(?<![\w.])\d[\d,]*\.\d+")
_GPU = re.compile(r"\b[HAB]\d{2,3}\b")  # H100, H200, A100, B200


def _figures(text: str) -> list[str]:
    """The decimal figures quoted in ``text``, thousands separators dropped."""
    return [figure.replace(",", "") for figure in _DECIMAL.findall(text)]


def figures_not_in_results(text: str, results: str) -> list[str]:
    """Decimal figures of ``text`` that ``results`` (a results file, or all of
    them) never states: typed by hand, or from a run since replaced."""
    recorded = results.replace(",", "")
    return [figure for figure in _figures(text) if figure not in recorded]


def summary_rows(performance: str) -> Iterator[tuple[str, str, str, list[str]]]:
    """(what, figure, machine and date, linked files) of each row of
    performance.md's summary table (four columns, the header left out)."""
    for line in performance.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) != 4 or set(cells[0]) <= {"-", " "} or cells[0] == "what":
            continue
        links = re.findall(r"\]\(([^)#\s]+)", cells[3])
        yield cells[0], cells[1], cells[2], links


def untested_gpus(readme: str, performance: str) -> list[str]:
    """GPUs performance.md lists as machines of its runs that the README's
    "tested:" does not name."""
    machines = re.findall(r"^- \*\*([^*]+)\*\*", performance, re.MULTILINE)
    used = {gpu for machine in machines for gpu in _GPU.findall(machine)}
    tested = re.search(r"tested: ([^)]*)\)", readme)
    named = set(_GPU.findall(tested.group(1))) if tested else set()
    return sorted(used - named)


_WAITS_FOR_A_GPU = re.compile(r"until it (?:has )?(?:been )?run on a GPU", re.I)


def stale_gpu_waits(text: str, performance: str) -> list[str]:
    """Lines of ``text`` that put the fast path off until a GPU run, where
    performance.md records one (a summary row about the fast path on a GPU)."""
    ran_on_gpu = any(
        "fast path" in what.lower() and _GPU.search(machine)
        for what, _, machine, _ in summary_rows(performance)
    )
    if not ran_on_gpu:
        return []
    return [
        " ".join(line.split())
        for line in text.splitlines()
        if _WAITS_FOR_A_GPU.search(line)
    ]


def metric_stat_errors(reference: str) -> list[str]:
    """Rows of the metrics reference whose "stat" column is not exactly the
    stats the exporter sums into that series."""
    exported: dict[str, set[str]] = {}
    for metric in (*XAVIER_METRICS, *XAVIER_RANK_METRICS):
        name = metric.name + ("_total" if metric.kind == "counter" else "")
        exported.setdefault(name, set()).add(metric.stat)
    errors = []
    for line in reference.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) != 4:
            continue
        name = cells[0].strip("`")
        if name not in exported:
            continue
        documented = set(_SPAN.findall(cells[3]))
        if documented != exported[name]:
            errors.append(
                f"{name}: documented {sorted(documented)}, "
                f"exported {sorted(exported[name])}"
            )
    return errors


# ---- the checks on the repository ------------------------------------------------------


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file_and_section(doc: Path) -> None:
    assert broken_links(doc, doc.read_text()) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_path_named_exists(doc: Path) -> None:
    assert missing_paths(doc.read_text()) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_cli_option_shown_is_accepted(doc: Path) -> None:
    assert option_errors(doc.read_text()) == []


def test_the_docs_show_commands_at_all() -> None:
    shown = [words for doc in DOCS for words in _commands(doc.read_text())]
    assert any(w[:2] == ["xinference", "launch"] for w in shown)
    assert any(Path(w[0]).name == "xinference-worker" for w in shown)


def test_every_exported_xavier_series_is_in_the_metrics_reference() -> None:
    reference = (ROOT / "docs/metrics.md").read_text()
    for metric in (*XAVIER_METRICS, *XAVIER_RANK_METRICS):
        name = metric.name + ("_total" if metric.kind == "counter" else "")
        assert f"`{name}`" in reference, name


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text().split("\n## ", 1)[0].splitlines()
    shown = [line for line in readme if "-m pytest tests" in line]
    assert len(shown) == 1, shown  # the opening shows it once, before any section
    command = shown[0].split("#")[0].strip()
    assert command.endswith("-m pytest tests"), shown[0]
    assert command in (ROOT / ".ci/run").read_text().splitlines()


@functools.cache
def _headline() -> Any:
    """``benchmark/headline.py``, which renders the headline table from JSON."""
    spec = importlib.util.spec_from_file_location(
        "headline", ROOT / "benchmark/headline.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("doc", ["README.md", "docs/performance.md"])
def test_the_headline_table_is_the_one_the_results_give(doc: str) -> None:
    """Regenerate with ``python benchmark/headline.py --write``."""
    headline = _headline()
    assert headline.shown((ROOT / doc).read_text()) == headline.render()


def test_a_headline_figure_typed_by_hand_is_reported() -> None:
    headline = _headline()
    table = headline.render()
    typed = table.replace("| 85.0 ms |", "| 80.0 ms |")
    assert typed != table
    text = headline.replaced(
        "# Doc\n\n" + headline.START + "\nold\n" + headline.END, typed
    )
    assert headline.shown(text) != headline.render()
    assert headline.shown(headline.replaced(text, table)) == table


def test_the_metrics_reference_names_the_stats_each_series_sums() -> None:
    assert metric_stat_errors((ROOT / "docs/metrics.md").read_text()) == []


def test_the_performance_summary_quotes_its_results() -> None:
    performance = (ROOT / "docs/performance.md").read_text()
    rows = list(summary_rows(performance))
    assert len(rows) >= 10
    for what, figure, _, links in rows:
        linked = [(ROOT / "docs" / link).resolve() for link in links]
        results = "".join(p.read_text() for p in linked if p.is_file())
        assert results, f"{what}: links no results file"
        assert figures_not_in_results(figure, results) == [], what


def test_the_opening_claims_quote_recorded_runs() -> None:
    """The README's opening (before its first section) and performance.md's
    "What the figures say" quote figures some results file records."""
    results = "".join(p.read_text() for p in sorted(RESULTS.rglob("*.md")))
    readme = (ROOT / "README.md").read_text().split("\n## ", 1)[0]
    performance = (ROOT / "docs/performance.md").read_text()
    said = performance.split("## What the figures say", 1)[1]
    assert _figures(readme), "the README's opening quotes no figure"
    assert figures_not_in_results(readme, results) == []
    assert figures_not_in_results(said, results) == []


def test_the_gpus_said_tested_are_those_the_runs_used() -> None:
    readme = (ROOT / "README.md").read_text()
    performance = (ROOT / "docs/performance.md").read_text()
    assert untested_gpus(readme, performance) == []


def test_no_doc_waits_for_a_gpu_run_of_the_fast_path_that_is_recorded() -> None:
    performance = (ROOT / "docs/performance.md").read_text()
    for doc in DOCS:
        assert stale_gpu_waits(doc.read_text(), performance) == [], doc.name


def test_the_readme_says_how_to_stop_the_server_and_reach_another_port() -> None:
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "stops the server" in quick_start
    # a command of ours shown with -e/--endpoint, on a port other than the default
    shown = [words for words in _commands(quick_start)]
    assert any(
        {"-e", "--endpoint"} & set(words)
        and not any(word.endswith(":9997") for word in words)
        for words in shown
    ), shown


# ---- the checkers find what is wrong -------------------------------------------------


def test_a_figure_no_run_recorded_is_reported() -> None:
    results = "| 8,192 | 106.6 | 303.3 | 85.0 |"
    assert figures_not_in_results("85.0 against 106.6 ms, 303.3 before", results) == []
    assert figures_not_in_results("a miss took 1,303.3 ms", results) == ["1303.3"]
    assert figures_not_in_results("2.75x faster", results) == ["2.75"]


def test_a_gpu_run_but_not_said_tested_is_reported() -> None:
    performance = "Machines:\n\n- **H200**: one\n- **H100**: one\n- **CPU**: the\n"
    assert untested_gpus("| devices | GPUs (tested: H200), and CPU |", performance) == [
        "H100"
    ]
    assert untested_gpus("(tested: H100, H200)", performance) == []


def test_a_doc_waiting_for_a_gpu_run_that_is_recorded_is_reported() -> None:
    recorded = (
        "| A remote hit on the fast path, 8B | 3.2 ms | H100, 2026-12-06 | [x](y) |"
    )
    cpu_only = (
        "| A remote hit on the fast path, tiny | 3.2 ms | CPU, 2026-12-06 | [x](y) |"
    )
    doc = "it is off\n(the default until it has run on a GPU); a flag wins\n"
    assert stale_gpu_waits(doc, recorded) == [
        "(the default until it has run on a GPU); a flag wins"
    ]
    assert stale_gpu_waits(doc, cpu_only) == []


def test_a_series_documented_with_other_stats_is_reported() -> None:
    device_only = (
        "| `xavier_received_wire_bytes_total` | counter | Bytes peers copied "
        "(device-tier transport) | `transport.received_wire_bytes` |"
    )
    (error,) = metric_stat_errors(device_only)
    assert error.startswith("xavier_received_wire_bytes_total: documented")
    assert "cpu_tier_transport.received_wire_bytes" in error


def test_a_wrong_link_or_section_is_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# A title\n\n## Some section: here (1)\n")
    doc = tmp_path / "doc.md"
    good = "[a](other.md) [b](other.md#some-section-here-1) [c](https://x.y/z)"
    assert broken_links(doc, good) == []
    bad = "[a](missing.md) and [b](other.md#no-such-section)"
    assert broken_links(doc, bad) == [
        "missing.md: no such file",
        "other.md#no-such-section: no section #no-such-section in other.md",
    ]


def test_a_wrong_path_or_test_name_is_reported() -> None:
    good = (
        "`xinference/core/workers.py` and `benchmark/results/h200-vllm/{on,off}.json`"
    )
    assert missing_paths(good) == []
    assert missing_paths("see `tests/test_docs.py::test_no_such_test`") == [
        "tests/test_docs.py::test_no_such_test: no test test_no_such_test in "
        "tests/test_docs.py"
    ]
    assert missing_paths("`xinference/core/no_such_module.py`") == [
        "xinference/core/no_such_module.py: no such file or folder"
    ]
    assert missing_paths("`$XINFERENCE_HOME/models.json`, `cma/memory`") == []


def test_a_wrong_option_or_command_is_reported() -> None:
    good = (
        "    xinference launch --model-name tiny-qwen2 --replica 2 --enable-xavier \\\n"
        "        --max_num_batched_tokens 2048 -e http://h:1\n"
        "    xinference-worker -e http://10.0.0.1:9997 -H 10.0.0.2\n"
    )
    assert option_errors(good) == []
    assert option_errors("    xinference launch --enable-xaiver --replica 2\n") == [
        "xinference launch --help lists no --enable-xaiver"
    ]
    assert option_errors("`xinference lunch -n x`") == [
        "xinference has no command 'lunch'"
    ]
    assert option_errors("`xinference-local --replica 2`") == [
        "xinference-local --help lists no --replica"
    ]
    assert option_errors("set `--xavier-gpu-cache 1GB`") == [
        "`--xavier-gpu-cache 1GB`: no command lists --xavier-gpu-cache"
    ]
