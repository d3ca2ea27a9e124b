"""The command line against a real server: validation errors, list, unknown models.

Launching real engines through the CLI is in ``tests/api/test_serving_e2e.py``.
"""

import pytest
from click.testing import CliRunner

from xinference.deploy.cmdline import cli


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "some-model"
    path.mkdir()
    return str(path)


def run_cli(server, *args):
    return CliRunner().invoke(cli, ["--endpoint", server.endpoint, *args])


@pytest.mark.parametrize(
    "options, message",
    [
        (["--replica", "1", "--enable-xavier"], "it needs replica >= 2, got 1"),
        (
            ["--replica", "2", "--enable-xavier", "--model-engine", "sglang"],
            "Xavier works with the vLLM engine only, got model_engine 'sglang'",
        ),
        (
            ["--replica", "2", "--enable-xavier", "--xavier-gpu-cache-bytes", "-1"],
            "malformed size '-1'",
        ),
        (
            [
                "--replica",
                "2",
                "--enable-xavier",
                "--xavier-gpu-cache-bytes",
                "12 parsecs",
            ],
            "malformed size '12 parsecs'",
        ),
        (
            # no host or GPU holds 1 PiB: refused before any engine loads
            [
                "--replica",
                "2",
                "--enable-xavier",
                "--xavier-gpu-cache-bytes",
                "1024TiB",
            ],
            "xavier_gpu_cache_bytes 1024.0 TiB per replica does not fit",
        ),
        (
            ["--replica", "2", "--enable-xavier", "--pipeline-parallel-size", "4"],
            "pipeline_parallel_size must be 1, got 4",
        ),
        (["--generation-config", "greedy"], "generation_config must be one of auto"),
        (
            ["--replica", "2", "--no-xavier-remote-loads"],
            "xavier_remote_loads=false (routing only) needs enable_xavier",
        ),
        (
            ["--replica", "2", "--xavier-fast-path"],
            "xavier_fast_path is set but enable_xavier is not",
        ),
    ],
)
def test_launch_validation_errors(server, model_dir, options, message):
    result = run_cli(server, "launch", "--model-path", model_dir, *options)
    assert result.exit_code == 1, result.output
    assert "Error:" in result.output and message in result.output
    # nothing was started: the model is not listed
    assert "no models" in run_cli(server, "list").output


@pytest.mark.parametrize(
    "options, sent",
    [
        ([], None),  # neither flag: the engine's $XAVIER_FAST_PATH decides
        (["--xavier-fast-path"], True),
        (["--no-xavier-fast-path"], False),
        (["--xavier_fast_path", "false"], False),  # upstream's --key value form
    ],
)
def test_the_fast_path_switch_is_sent_as_given(monkeypatch, model_dir, options, sent):
    """Tri-state: only an explicit flag overrides the engine's environment."""
    from xinference.client.restful_client import Client

    launched: dict = {}

    def launch(self, **body):
        launched.update(body)
        return {"model_uid": "m", "xavier": "Xavier: on", "replicas": []}

    monkeypatch.setattr(Client, "launch_model_detailed", launch)
    result = CliRunner().invoke(
        cli,
        ["launch", "-e", "http://127.0.0.1:9", "--model-path", model_dir]
        + ["-u", "m", "-r", "2", "--enable-xavier", *options],
    )
    assert result.exit_code == 0, result.output
    assert launched["xavier_fast_path"] is sent


def test_unknown_model_name(server):
    for name_option in ("--model-name", "-n"):
        result = run_cli(server, "launch", name_option, "no-such-model")
        assert result.exit_code == 1
        assert "unknown model_name 'no-such-model'; known:" in result.output
        assert "tiny-qwen2" in result.output


def test_terminate_an_unknown_model(server):
    result = run_cli(server, "terminate", "--model-uid", "ghost")
    assert result.exit_code == 1
    assert "model 'ghost' is not launched" in result.output


def test_an_unreachable_endpoint_is_reported():
    result = CliRunner().invoke(cli, ["--endpoint", "http://127.0.0.1:1", "list"])
    assert result.exit_code == 1
    assert "cannot reach http://127.0.0.1:1" in result.output


# ---- upstream Xinference's command line ----------------------------------------


def run_upstream(*args):
    """Options after the subcommand, -e included, as upstream's docs write them."""
    return CliRunner().invoke(cli, list(args))


def test_endpoint_after_the_subcommand(server):
    # The group's endpoint is unreachable: the subcommand's must win.
    for command in (["list"], ["terminate", "-u", "ghost"]):
        result = CliRunner().invoke(
            cli, ["-e", "http://127.0.0.1:1", *command, "-e", server.endpoint]
        )
        assert "cannot reach" not in result.output, result.output
    assert "no models" in run_upstream("list", "-e", server.endpoint).output


@pytest.mark.parametrize(
    "options, message",
    [
        # short flags and --key value pairs reach the server's validation
        (["-r", "1", "--enable_xavier", "true"], "it needs replica >= 2, got 1"),
        (["-r", "2", "--enable_xavier", "true", "--n-gpu", "0"], "n_gpu must be >= 1"),
        (["-t", "embedding"], "model_type 'embedding' is not served here"),
        (
            ["-r", "2", "--enable_xavier", "true", "-en", "sglang", "-u", "x"],
            "Xavier works with the vLLM engine only, got model_engine 'sglang'",
        ),
        (["-f", "ggufv2"], "model_format 'ggufv2' is not supported"),
        (["--n-gpu", "none"], "n_gpu=None (CPU only) cannot be chosen"),
        (["--worker-ip", "10.255.0.9"], "no worker at worker_ip '10.255.0.9'"),
        (["--gpu-idx", "97,98"], "gpu_idx [97, 98] not on worker"),
        (["-lm", "a", "/tmp/a"], "peft_model_config (LoRA adapters) is not supported"),
        (["--max_num_batched_tokens", "many"], "invalid engine argument"),
        (["--swap_spice", "4"], "unknown launch option 'swap_spice'"),
    ],
)
def test_upstream_launch_options(server, model_dir, options, message):
    result = run_upstream(
        "launch", "-e", server.endpoint, "--model-path", model_dir, *options
    )
    assert result.exit_code == 1, result.output
    assert "Error:" in result.output and message in result.output
    assert "no models" in run_upstream("list", "-e", server.endpoint).output


@pytest.mark.parametrize(
    "options, message",
    [
        (["stray"], "unexpected argument 'stray'"),
        (
            ["--enable-xavier", "--enable_xavier", "true"],
            "enable_xavier is given twice",
        ),
        (["--gpu-idx", "0,x"], "give comma-separated GPU indexes"),
    ],
)
def test_malformed_command_lines_are_usage_errors(server, model_dir, options, message):
    result = run_upstream(
        "launch", "-e", server.endpoint, "--model-path", model_dir, *options
    )
    assert result.exit_code == 2, result.output
    assert message in result.output


# ---- xinference-supervisor and xinference-worker -----------------------------------


def test_a_worker_needs_to_know_where_the_supervisor_is(monkeypatch):
    monkeypatch.delenv("XINFERENCE_ENDPOINT", raising=False)
    result = CliRunner().invoke(cli, ["worker", "-H", "127.0.0.2"])
    assert result.exit_code == 2
    assert "give -e/--endpoint or --supervisor-address" in result.output


def test_a_worker_reports_an_endpoint_it_cannot_ask():
    result = CliRunner().invoke(
        cli, ["worker", "-e", "http://127.0.0.1:1", "-H", "127.0.0.2"]
    )
    assert result.exit_code == 1
    assert "cannot ask http://127.0.0.1:1 for the supervisor's address" in (
        result.output
    )


def test_the_cluster_commands_take_upstreams_flags():
    supervisor = CliRunner().invoke(cli, ["supervisor", "--help"]).output
    for flag in ("--host", "-H", "--port", "-p", "--supervisor-port"):
        assert flag in supervisor
    worker = CliRunner().invoke(cli, ["worker", "--help"]).output
    for flag in ("--endpoint", "-e", "--host", "-H", "--worker-port"):
        assert flag in worker
