"""``scripts/mutate.py``'s machinery, on a tiny tree: a tool run by hand must not
rot silently (a table whose fragments no longer match, a bug left behind)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mutate", ROOT / "scripts/mutate.py")
assert _spec is not None and _spec.loader is not None
mutate = importlib.util.module_from_spec(_spec)
sys.modules["mutate"] = mutate  # dataclasses look their module up by name
_spec.loader.exec_module(mutate)

MODULE = "def deadline(timeout):\n    return min(timeout, 5)\n"
TEST = (
    "from m import deadline\n\n\n"
    "def test_the_deadline_is_capped():\n    assert deadline(60) == 5\n"
)


def tiny_tree(path: Path) -> Path:
    (path / "m.py").write_text(MODULE)
    (path / "test_m.py").write_text(TEST)
    return path


def mutation(old: str, new: str, name: str = "m") -> object:
    return mutate.Mutation(name, "m.py", old, new, ("test_m.py",))


def test_a_mutation_is_planted_then_the_file_restored_byte_for_byte(tmp_path):
    tree = tiny_tree(tmp_path)
    with mutate.planted(tree, mutation("min(timeout, 5)", "timeout")):
        assert (tree / "m.py").read_text() == (
            "def deadline(timeout):\n    return timeout\n"
        )
    assert (tree / "m.py").read_text() == MODULE
    with pytest.raises(KeyboardInterrupt):  # an interrupted run restores it too
        with mutate.planted(tree, mutation("min(timeout, 5)", "timeout")):
            raise KeyboardInterrupt
    assert (tree / "m.py").read_text() == MODULE


def test_a_fragment_that_is_not_there_exactly_once_is_refused(tmp_path):
    tree = tiny_tree(tmp_path)
    for old in ("min(timeout, 10)", "timeout"):  # absent; twice
        with pytest.raises(ValueError, match="occurs [02] times"):
            with mutate.planted(tree, mutation(old, "x")):
                pass
        assert (tree / "m.py").read_text() == MODULE


def test_caught_and_survived_are_told_apart_by_running_the_tests(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # a plain test: fast
    tree = tiny_tree(tmp_path)
    mutations = [
        mutation("min(timeout, 5)", "timeout", "cap_removed"),
        mutation("def deadline(timeout):", "def deadline(timeout):  # noop", "noop"),
    ]
    outcomes = mutate.check(tree, mutations, 120, sys.executable)
    assert [(o.result, o.caught_by) for o in outcomes] == [
        ("caught", "test_the_deadline_is_capped"),
        ("survived", ""),
    ]
    assert (tree / "m.py").read_text() == MODULE
    assert "1 of 2 caught" in mutate.table(outcomes)


def test_every_mutation_in_the_table_still_applies_to_the_tree():
    """Each fragment occurs exactly once in its file, and each test file named
    exists: code that moved must move its mutation with it."""
    for m in mutate.MUTATIONS:
        text = (ROOT / m.file).read_text()
        assert text.count(m.old) == 1, f"{m.name}: fragment not found once"
        for selection in m.tests:
            assert (ROOT / selection.split("::")[0]).is_file(), m.name
