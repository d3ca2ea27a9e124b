"""The command line, in Xinference's style.

    xinference-local [--host H] [--port P] [--auth/--no-auth] [--max-request-bytes N]
                                                               supervisor + worker + HTTP
    xinference-supervisor -H H -p P [--supervisor-port SP]     supervisor + HTTP server
    xinference-worker -e http://H:P -H WORKER_HOST [--worker-port WP]   one per host
    xinference launch --model-engine vllm --model-path PATH --replica 2 \\
        --enable-xavier --xavier-gpu-cache-bytes 256MiB [--xavier-fast-path]
    xinference launch --model-name tiny-qwen2 --replica 2 --enable-xavier
    xinference launch -n tiny-qwen2 -en vllm -r 2 --enable_xavier true \\
        --max_num_batched_tokens 1024 -e http://127.0.0.1:9997
    xinference list -e URL
    xinference terminate --model-uid UID
    xinference login -u admin [-p PASSWORD]      keeps a token for the other commands

Upstream Xinference's option names and short flags work; further ``--key value``
pairs set an option of that name or a vLLM engine argument. The client commands
talk to ``-e/--endpoint``, given before or after the subcommand (default
``$XINFERENCE_ENDPOINT`` or http://127.0.0.1:9997). ``python -m xinference.deploy.cmdline`` is ``xinference``
(``local``, ``supervisor`` and ``worker`` are also subcommands there).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
from typing import Any

import click
import httpx

from ..client.restful_client import Client, XinferenceError
from ..core.engine_args import parse_cli_value
from ..core.logs import configure as configure_logging
from ..core.options import default_model_uid
from .cli_auth import (
    auth_option,
    cluster_secret_option,
    credential,
    explain,
    login,
    server_auth,
)
from .launch_options import xavier_launch_options
from .server_cli import server_options, server_options_from
from .summary import summarize_xavier

DEFAULT_ENDPOINT = "http://127.0.0.1:9997"
PROGRESS_POLL_S = 1.0


# ---- xinference-local -------------------------------------------------------------


@click.command("local")
@click.option("--host", "-H", default="127.0.0.1", show_default=True)
@click.option(
    "--port", "-p", default=9997, show_default=True, type=int, help="0: any free port"
)
@auth_option
@server_options
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
def local(
    host: str, port: int, auth: bool | None, log_level: str, **server: Any
) -> None:
    """Run a supervisor, a worker and the HTTP API in this process."""
    configure_logging(log_level)
    service = server_auth(host, auth, None)
    options = server_options_from(service, server)
    asyncio.run(_serve_local(host, port, service, options))


async def _serve_local(host: str, port: int, auth: Any, options: Any) -> None:
    from .local import start_local_cluster

    cluster = await start_local_cluster(host, port, auth=auth, options=options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    # One parseable line: scripts and tests read the endpoint from it.
    click.echo(f"Xinference serving at {cluster.endpoint}", err=False)
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        click.echo("Shutting down: terminating models")
        await cluster.stop()


# ---- xinference-supervisor and xinference-worker ---------------------------------

log_level_option = click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)


@click.command("supervisor")
@click.option("--host", "-H", default="127.0.0.1", show_default=True)
@click.option(
    "--port", "-p", default=9997, show_default=True, type=int, help="the REST API's"
)
@click.option(
    "--supervisor-port",
    default=0,
    show_default=True,
    type=int,
    help="the supervisor's xoscar pool (0: any free port; workers ask the REST API)",
)
@click.option(
    "--heartbeat-timeout",
    default=None,
    type=float,
    help="seconds without a heartbeat before a worker is gone (default "
    "$XINFERENCE_HEARTBEAT_TIMEOUT_S or 5)",
)
@auth_option
@cluster_secret_option
@server_options
@log_level_option
def supervisor(
    host: str,
    port: int,
    supervisor_port: int,
    heartbeat_timeout: float | None,
    auth: bool | None,
    cluster_secret: str | None,
    log_level: str,
    **server: Any,
) -> None:
    """Run the supervisor and the HTTP API; workers join with `xinference-worker`."""
    configure_logging(log_level)
    service = server_auth(host, auth, cluster_secret)
    options = server_options_from(service, server)
    asyncio.run(
        _serve_supervisor(
            host, port, supervisor_port, heartbeat_timeout, service, options
        )
    )


async def _serve_supervisor(
    host: str,
    port: int,
    supervisor_port: int,
    heartbeat_timeout: float | None,
    auth: Any,
    options: Any,
) -> None:
    from ..core.heartbeat import HeartbeatSettings
    from .cluster import start_supervisor

    heartbeat = HeartbeatSettings.from_env(timeout_s=heartbeat_timeout)
    node = await start_supervisor(
        host, port, supervisor_port, heartbeat=heartbeat, auth=auth, options=options
    )
    stop = _stop_event()
    click.echo(
        f"Xinference serving at {node.endpoint} "
        f"(supervisor {node.supervisor_address}; {heartbeat.describe()})"
    )
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        click.echo("Shutting down: terminating models")
        await node.stop()


@click.command("worker")
@click.option(
    "--endpoint",
    "-e",
    default=None,
    help="the supervisor's REST API, e.g. http://10.0.0.1:9997",
)
@click.option(
    "--supervisor-address",
    default=None,
    help="the supervisor's xoscar address HOST:PORT (instead of asking -e)",
)
@click.option(
    "--host", "-H", default="127.0.0.1", show_default=True, help="this host's address"
)
@click.option(
    "--worker-port",
    default=0,
    show_default=True,
    type=int,
    help="this worker's xoscar pool (0: any free port)",
)
@click.option(
    "--heartbeat-interval",
    default=None,
    type=float,
    help="seconds between heartbeats (default $XINFERENCE_HEARTBEAT_INTERVAL_S or 1)",
)
@cluster_secret_option
@log_level_option
def worker(
    endpoint: str | None,
    supervisor_address: str | None,
    host: str,
    worker_port: int,
    heartbeat_interval: float | None,
    cluster_secret: str | None,
    log_level: str,
) -> None:
    """Run a worker on this host: it registers with the supervisor and hosts the
    replicas placed on it."""
    if endpoint is None and supervisor_address is None:
        endpoint = os.environ.get("XINFERENCE_ENDPOINT")
        if endpoint is None:
            raise click.UsageError("give -e/--endpoint or --supervisor-address")
    configure_logging(log_level)
    asyncio.run(
        _serve_worker(
            endpoint,
            supervisor_address,
            host,
            worker_port,
            heartbeat_interval,
            cluster_secret,
        )
    )


async def _serve_worker(
    endpoint: str | None,
    supervisor_address: str | None,
    host: str,
    worker_port: int,
    heartbeat_interval: float | None,
    cluster_secret: str | None,
) -> None:
    from ..core.cluster_secret import WorkerRefused
    from ..core.heartbeat import HeartbeatSettings
    from .cluster import start_worker

    heartbeat = HeartbeatSettings.from_env(interval_s=heartbeat_interval)
    try:
        node = await start_worker(
            host,
            endpoint=endpoint,
            supervisor_address=supervisor_address,
            worker_port=worker_port,
            heartbeat=heartbeat,
            cluster_secret=cluster_secret,
        )
    except httpx.HTTPStatusError as error:
        if error.response.status_code in (401, 403):
            raise click.ClickException(
                f"{endpoint} refused to tell the supervisor's address "
                f"({error.response.status_code}): give the cluster's secret "
                "(--cluster-secret or $XINFERENCE_CLUSTER_SECRET)"
            ) from None
        raise click.ClickException(
            f"cannot ask {endpoint} for the supervisor's address: "
            f"{error.response.status_code}"
        ) from None
    except httpx.HTTPError as error:
        raise click.ClickException(
            f"cannot ask {endpoint} for the supervisor's address: {error!r}"
        ) from None
    except WorkerRefused as error:
        raise click.ClickException(str(error)) from None
    stop = _stop_event()
    click.echo(
        f"Xinference worker at {node.address} (supervisor {node.supervisor_address})"
    )
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        click.echo("Shutting down: leaving the cluster")
        killed = await node.stop()
        if killed:
            click.echo(f"killed processes that outlived their pool: {killed}")


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    return stop


# ---- xinference -------------------------------------------------------------------

# Upstream puts -e on each subcommand; the group's -e (before the subcommand) also
# works. The subcommand's wins.
endpoint_option = click.option(
    "--endpoint",
    "-e",
    default=None,
    help="server URL (default: the group's --endpoint, $XINFERENCE_ENDPOINT or "
    + DEFAULT_ENDPOINT
    + ")",
)
api_key_option = click.option(
    "--api-key",
    "-ak",
    default=None,
    help="an API key (or access token) sent as the bearer; default: the token "
    "`xinference login` kept for the endpoint",
)


@click.group()
@click.option(
    "--endpoint",
    "-e",
    default=lambda: os.environ.get("XINFERENCE_ENDPOINT", DEFAULT_ENDPOINT),
    show_default="$XINFERENCE_ENDPOINT or " + DEFAULT_ENDPOINT,
)
@click.pass_context
def cli(ctx: click.Context, endpoint: str) -> None:
    """Manage models on an Xinference server."""
    ctx.obj = endpoint


cli.add_command(local)
cli.add_command(supervisor)
cli.add_command(worker)
cli.add_command(login)


def _endpoint(
    ctx: click.Context, endpoint: str | None, api_key: str | None
) -> tuple[str, str | None]:
    """The endpoint to call and the credential to send it."""
    endpoint = endpoint or ctx.obj or DEFAULT_ENDPOINT
    return endpoint, credential(endpoint, api_key)


@cli.command(context_settings=dict(ignore_unknown_options=True, allow_extra_args=True))
@endpoint_option
@api_key_option
@click.option("--model-name", "-n", default=None, help="a name from the local registry")
@click.option(
    "--model-path",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="a local model directory",
)
@click.option("--model-uid", "-u", default=None, help="default: the name or dir name")
@click.option("--model-type", "-t", default="LLM", show_default=True)
@click.option("--model-engine", "-en", default="vllm", show_default=True)
@click.option("--size-in-billions", "-s", default=None, help="noted, not used")
@click.option("--model-format", "-f", default=None, help="pytorch, gptq, awq, ...")
@click.option("--quantization", "-q", default=None, help="passed to vLLM")
@click.option("--replica", "-r", default=1, show_default=True, type=int)
@click.option(
    "--n-gpu",
    default="auto",
    show_default=True,
    help="GPUs per replica (its tensor-parallel size)",
)
@click.option("--worker-ip", default=None, help="the worker to run on")
@click.option(
    "--gpu-idx", default=None, help="GPU indexes the replicas spread over, e.g. 0,1"
)
@click.option(
    "--trust-remote-code",
    default=None,
    type=bool,
    help="vLLM's trust_remote_code (default: vLLM's)",
)
@click.option(
    "--lora-modules",
    "-lm",
    multiple=True,
    type=(str, str),
    help="NAME PATH of a LoRA adapter (not supported here: refused)",
)
@xavier_launch_options
@click.option("--tensor-parallel-size", default=1, show_default=True, type=int)
@click.option("--pipeline-parallel-size", default=1, show_default=True, type=int)
@click.option("--block-size", default=None, type=int)
@click.option("--max-model-len", default=None, type=int)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--enforce-eager", is_flag=True)
@click.option("--gpu-memory-utilization", default=None, type=float)
@click.option("--max-num-seqs", default=None, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--generation-config",
    default="auto",
    show_default=True,
    help="auto: the model's generation_config.json sets default sampling "
    "parameters (temperature, top_p, top_k, min_p, repetition_penalty); "
    "vllm: neutral defaults",
)
@click.pass_context
def launch(
    ctx: click.Context,
    endpoint: str | None,
    api_key: str | None,
    size_in_billions: str | None,
    n_gpu: str,
    gpu_idx: str | None,
    trust_remote_code: bool | None,
    lora_modules: tuple[tuple[str, str], ...],
    **options: Any,
) -> None:
    """Launch a model and wait until every replica serves.

    Further `--key value` pairs (upstream's form, e.g. `--enable_xavier true` or
    `--max_num_batched_tokens 1024`) set the option of that name, or else the vLLM
    engine argument, checked by vLLM's own parser before anything starts.
    """
    endpoint, key = _endpoint(ctx, endpoint, api_key)
    options.update(
        model_size_in_billions=size_in_billions,
        n_gpu=n_gpu,
        gpu_idx=_gpu_indexes(gpu_idx),
        trust_remote_code=trust_remote_code,
        peft_model_config=(
            {"lora_list": [{"lora_name": n, "local_path": p} for n, p in lora_modules]}
            if lora_modules
            else None
        ),
    )
    for name, value in _free_arguments(ctx.args).items():
        source = ctx.get_parameter_source(name)
        if source == click.core.ParameterSource.COMMANDLINE:
            raise click.UsageError(f"{name} is given twice")
        options[name] = value
    uid = options["model_uid"]
    if uid is None and (options["model_name"] or options["model_path"]):
        uid = default_model_uid(options["model_name"], options["model_path"])
        options["model_uid"] = uid
    client = Client(endpoint, api_key=key)
    done = threading.Event()
    watcher = threading.Thread(
        target=_show_progress, args=(endpoint, key, uid, done), daemon=True
    )
    if uid is not None:
        watcher.start()
    try:
        deployment = client.launch_model_detailed(**options)
    except XinferenceError as error:
        raise click.ClickException(explain(error, endpoint)) from None
    except httpx.TransportError as error:
        raise click.ClickException(f"cannot reach {endpoint}: {error}") from None
    finally:
        done.set()
        if watcher.is_alive():
            watcher.join(PROGRESS_POLL_S * 5)
        client.close()
    click.echo(f"Model uid: {deployment['model_uid']}")
    click.echo(deployment["xavier"])
    for replica in deployment["replicas"]:
        click.echo(
            f"  replica {replica['rank']}: {replica['address']} pid {replica['pid']}"
            + (f" on worker {replica['worker']}" if replica.get("worker") else "")
            + f", loaded in {replica['load_seconds']:.1f} s"
        )


def _gpu_indexes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: give comma-separated GPU indexes", param_hint="--gpu-idx"
        ) from None


def _free_arguments(args: list[str]) -> dict[str, Any]:
    """``--key value`` pairs after the known options (a ``--key`` followed by
    another option or by nothing is a switch: true)."""
    free: dict[str, Any] = {}
    index = 0
    while index < len(args):
        token = args[index]
        if not token.startswith("--") or len(token) == 2:
            raise click.UsageError(
                f"unexpected argument {token!r}: further options are `--key value`"
            )
        name = token[2:].replace("-", "_")
        if index + 1 < len(args) and not args[index + 1].startswith("--"):
            free[name] = parse_cli_value(args[index + 1])
            index += 2
        else:
            free[name] = True
            index += 1
    return free


def _show_progress(
    endpoint: str, key: str | None, uid: str, done: threading.Event
) -> None:
    """Print the launch's progress whenever it changes (polls its own client)."""
    last = None
    with Client(endpoint, timeout=10.0, api_key=key) as client:
        while not done.wait(PROGRESS_POLL_S):
            try:
                progress = client.progress(uid)
            except (XinferenceError, httpx.HTTPError):
                continue  # not registered yet, already gone, or a slow answer
            line = (
                f"{progress['detail']} "
                f"({progress['replicas_ready']}/{progress['replicas_total']} replicas ready)"
            )
            if line != last:
                click.echo(f"[{progress['elapsed_s']:5.0f} s] {line}", err=True)
                last = line


@cli.command("list")
@endpoint_option
@api_key_option
@click.pass_context
def list_models(ctx: click.Context, endpoint: str | None, api_key: str | None) -> None:
    """List launched models."""
    endpoint, key = _endpoint(ctx, endpoint, api_key)
    try:
        with Client(endpoint, api_key=key) as client:
            models = client.list_models()
    except XinferenceError as error:
        raise click.ClickException(explain(error, endpoint)) from None
    except httpx.TransportError as error:
        raise click.ClickException(f"cannot reach {endpoint}: {error}") from None
    if not models:
        click.echo("no models")
        return
    click.echo(f"{'UID':<24} {'STATUS':<10} {'REPLICAS':<9} XAVIER")
    for model in models.values():
        click.echo(
            f"{model['id']:<24} {model['status']:<10} "
            f"{model['replicas_ready']}/{model['replica']:<7} {model.get('xavier', '')}"
        )
        for replica in model.get("replicas", []):
            line = (
                f"  replica {replica['rank']}: {replica['state']} on worker "
                f"{replica['worker'] or '?'} ({replica['address']})"
            )
            if replica.get("reason"):
                line += f": {replica['reason']}"
            click.echo(line)


@cli.command()
@endpoint_option
@api_key_option
@click.option("--model-uid", "-u", required=True)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print every final Xavier counter of each replica as JSON.",
)
@click.pass_context
def terminate(
    ctx: click.Context,
    endpoint: str | None,
    api_key: str | None,
    model_uid: str,
    as_json: bool,
) -> None:
    """Terminate a model (a launch in progress too); prints a summary of each
    replica's final Xavier counters (all of them with --json)."""
    endpoint, key = _endpoint(ctx, endpoint, api_key)
    try:
        with Client(endpoint, api_key=key) as client:
            result = client.terminate_model(model_uid)
    except XinferenceError as error:
        raise click.ClickException(explain(error, endpoint)) from None
    except httpx.TransportError as error:
        raise click.ClickException(f"cannot reach {endpoint}: {error}") from None
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))
        return
    click.echo(f"Terminated {model_uid}")
    for rank, stats in sorted(result["xavier_counters"].items()):
        click.echo(f"  replica {rank} Xavier: {summarize_xavier(stats)}")


if __name__ == "__main__":
    cli()
