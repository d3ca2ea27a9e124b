"""The README and docs/ stay true to the repository: every relative link and every
file path they name exists (a link's #section too), every CLI option they show is
one the command's ``--help`` lists (or, for ``launch``, a free ``--key value`` pair
the launch accepts), every Xavier series ``/metrics`` exports is in the metrics
reference, and CI runs the README's test command. The checkers are tested on wrong
input first, so that a check that cannot fail does not pass for one that holds."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

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
    readme = (ROOT / "README.md").read_text().splitlines()
    command = readme[3].split("#")[0].strip()
    assert command.endswith("-m pytest tests"), readme[3]
    assert command in (ROOT / ".ci/run").read_text().splitlines()


# ---- the checkers find what is wrong -------------------------------------------------


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
