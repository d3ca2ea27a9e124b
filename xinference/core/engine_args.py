"""Free vLLM engine arguments (``--key value`` on the CLI, extra launch keys in REST).

Upstream Xinference hands any launch option it does not know to the engine. Here
such options are checked before anything starts: the name must be one of vLLM's own
engine arguments, the value must pass vLLM's own command-line parser (the same
types and choices ``vllm serve`` enforces), and arguments that the deployment
itself decides (the model, the KV connector, data parallelism) are refused with
the option that does the job instead.

vLLM is imported only when a launch carries free arguments: the import takes
seconds and plain launches need none of it.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Collection, Iterable, Mapping
from typing import Any

# Engine arguments the deployment sets itself; the value says what to use instead.
_MANAGED = {
    "model": "give model_path or model_name",
    "kv_transfer_config": "the KV connector is set by enable_xavier",
    "data_parallel_size": "use replica: each replica is its own engine",
    "disable_hybrid_kv_cache_manager": "it is set by enable_xavier",
}
# Engine arguments Xavier needs at one value (name -> the value it needs, why).
_XAVIER_NEEDS = {
    "enable_prefix_caching": (True, "Xavier shares prefix-cached blocks"),
}


class EngineArgumentError(ValueError):
    """A free engine argument is unknown, malformed or conflicts with the launch."""


class _RaisingParser:
    """vLLM's CLI parser with errors raised instead of printed and exited on."""

    def __init__(self) -> None:
        import dataclasses

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        class Parser(FlexibleArgumentParser):
            def error(self, message: str) -> Any:  # argparse would exit
                raise EngineArgumentError(message)

        self.parser = AsyncEngineArgs.add_cli_args(Parser())
        self.names = frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))

    def parse(self, name: str, value: Any) -> Any:
        """``value`` for ``name`` as vLLM's CLI reads it; raises on a bad value."""
        option = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            # A switch (--x / --no-x) or an option that takes true/false.
            flag = option if value else "--no-" + option[2:]
            attempts = [[flag], [option, _text(value)]]
        elif isinstance(value, list | tuple):
            attempts = [[option, *(_text(item) for item in value)]]
            attempts.append([option, _text(value)])
        else:
            attempts = [[option, _text(value)]]
        first_error: EngineArgumentError | None = None
        for argv in attempts:
            try:
                return getattr(self.parser.parse_args(argv), name)
            except EngineArgumentError as error:
                first_error = first_error or error
        assert first_error is not None
        raise first_error


_PARSER: list[_RaisingParser] = []


def _parser() -> _RaisingParser:
    if not _PARSER:
        _PARSER.append(_RaisingParser())
    return _PARSER[0]


def check_names(names: Iterable[str], launch_options: Collection[str]) -> None:
    """Refuse a name that is neither one of ``launch_options`` nor a vLLM engine
    argument, naming the closest of either (a misspelt ``replicas`` must not
    reach the checks of the options it was meant for, which would see their
    defaults). Names may use ``-`` or ``_``; vLLM is imported only for a name
    that is not a launch option."""
    free = sorted({name.replace("-", "_") for name in names} - set(launch_options))
    if not free:
        return
    engine = _parser().names
    for name in free:
        if name in engine:
            continue
        close = difflib.get_close_matches(name, launch_options, n=1, cutoff=0.75)
        close = close or difflib.get_close_matches(name, engine, n=1, cutoff=0.75)
        hint = (
            f"; did you mean {close[0]!r} (--{close[0].replace('_', '-')})?"
            if close
            else ""
        )
        raise EngineArgumentError(
            f"unknown launch option {name!r}: neither an Xinference option nor "
            f"a vLLM engine argument{hint}"
        )


def validate_engine_args(
    args: Mapping[str, Any], *, xavier: bool
) -> tuple[tuple[str, Any], ...]:
    """Each argument checked by vLLM's parser; (name, parsed value) pairs, sorted.

    Names may use ``-`` or ``_``. A value of None leaves vLLM's default.
    """
    wanted = {
        name.replace("-", "_"): value
        for name, value in args.items()
        if value is not None
    }
    for name, value in wanted.items():
        if name in _MANAGED:
            raise EngineArgumentError(
                f"engine argument {name!r} cannot be set here: {_MANAGED[name]}"
            )
        if xavier and name in _XAVIER_NEEDS and value != _XAVIER_NEEDS[name][0]:
            needed, why = _XAVIER_NEEDS[name]
            raise EngineArgumentError(
                f"{name}={value!r} conflicts with enable_xavier: {why} "
                f"(it needs {name}={needed!r})"
            )
    if not wanted:
        return ()
    parser = _parser()
    parsed: dict[str, Any] = {}
    for name, value in sorted(wanted.items()):
        if name not in parser.names:
            raise EngineArgumentError(
                f"unknown launch option {name!r}: neither an Xinference option nor "
                "a vLLM engine argument"
            )
        try:
            parsed[name] = parser.parse(name, value)
        except EngineArgumentError as error:
            raise EngineArgumentError(
                f"invalid engine argument {name}={value!r}: {error}"
            ) from None
    return tuple(sorted(parsed.items()))


def _text(value: Any) -> str:
    if isinstance(value, dict | list | tuple):
        return json.dumps(value)  # vLLM's config arguments take JSON
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_cli_value(text: str) -> Any:
    """A ``--key value`` value as upstream's CLI reads it: true/false/none, numbers,
    JSON objects and lists, else the string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    if text[:1] in "[{":
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text
