"""A small synchronous Python client over the REST API.

client = Client("http://127.0.0.1:9997")
uid = client.launch_model(model_path="/models/qwen", replica=2,
                          enable_xavier=True, xavier_gpu_cache_bytes="256MiB")
model = client.get_model(uid)
model.completions("The quick", max_tokens=8, temperature=0)
model.generate("The quick", generate_config={"max_tokens": 8})   # upstream's form
for chunk in model.chat([{"role": "user", "content": "hi"}], stream=True): ...
model.chat(messages, generate_config={"max_tokens": 64, "stream": False})
client.terminate_model(uid)

With authentication on, give ``api_key=`` (an API key or an access token) or call
``client.login(username, password)``; both are sent as ``Authorization: Bearer``.

The calls upstream Xinference's client has keep its signatures and return shapes
(``list_models`` is a dict by uid, ``generate``/``chat`` take ``generate_config``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import quote

import httpx

# Launching loads engines; on a CPU machine that takes minutes.
LAUNCH_TIMEOUT_S = 1800.0
DEFAULT_TIMEOUT_S = 600.0


class XinferenceError(RuntimeError):
    """The server refused or failed a call; ``status_code`` and ``detail`` say why."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(f"{status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


class Client:
    def __init__(
        self,
        endpoint: str,
        timeout: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self._http = httpx.Client(base_url=self.endpoint, timeout=timeout)
        if api_key:
            self._http.headers["Authorization"] = f"Bearer {api_key}"

    def login(self, username: str, password: str) -> str:
        """Log in; later calls carry the access token, which is also returned."""
        token = str(
            self._call(
                "POST", "/token", json={"username": username, "password": password}
            )["access_token"]
        )
        self._http.headers["Authorization"] = f"Bearer {token}"
        return token

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ---- management ---------------------------------------------------------------

    def launch_model(self, wait_ready: bool = True, **options: Any) -> str:
        """Launch a model (options as ``xinference launch``; keys that are not
        options here are vLLM engine arguments); its uid once ready, or at once
        without ``wait_ready``."""
        return str(self.launch_model_detailed(wait_ready, **options)["model_uid"])

    def launch_model_detailed(
        self, wait_ready: bool = True, **options: Any
    ) -> dict[str, Any]:
        """Launch and return the deployment description (replicas, Xavier line);
        without ``wait_ready`` only ``model_uid`` is known yet."""
        body = {key: value for key, value in options.items() if value is not None}
        return self._call(
            "POST",
            "/v1/models",
            json=body,
            params={"wait_ready": "true" if wait_ready else "false"},
            timeout=LAUNCH_TIMEOUT_S,
        )

    def list_models(self) -> dict[str, dict[str, Any]]:
        """Launched models by uid (launching ones too: see ``status``)."""
        return {item["id"]: item for item in self._call("GET", "/v1/models")["data"]}

    def describe_model(self, model_uid: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/models/{_segment(model_uid)}")

    def progress(self, model_uid: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/models/{model_uid}/progress")

    def get_launch_model_progress(self, model_uid: str) -> dict[str, Any]:
        """Upstream's name: ``progress`` is a fraction, 1.0 once ready."""
        return self.progress(model_uid)

    def cancel_launch_model(self, model_uid: str) -> None:
        """Stop a launch in progress; returns once what it started is gone."""
        self._call("POST", f"/v1/models/{model_uid}/cancel")

    def replica_reports(self, model_uid: str) -> list[dict[str, Any]]:
        """What each replica process reports having received."""
        return list(self._call("GET", f"/v1/models/{model_uid}/replicas"))

    def prefix_holder(
        self,
        model_uid: str,
        prompt: str | Sequence[int] | None = None,
        messages: Sequence[dict[str, str]] | None = None,
    ) -> dict[str, Any]:
        """Which replica holds the longest cached prefix of a prompt (Xavier)."""
        body: dict[str, Any] = {}
        if prompt is not None:
            body["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
        if messages is not None:
            body["messages"] = list(messages)
        return self._call("POST", f"/v1/models/{model_uid}/prefix", json=body)

    def terminate_model(self, model_uid: str) -> dict[str, Any]:
        """Terminate; the final Xavier counters per replica rank."""
        return self._call("DELETE", f"/v1/models/{model_uid}")

    def metrics(self) -> str:
        response = self._http.get("/metrics")
        _raise_for(response)
        return response.text

    def get_model(self, model_uid: str) -> Model:
        """A handle on a launched, serving model; a uid the server does not serve
        raises here (``XinferenceError``, 404, naming the launched models), not at
        the first call on the handle."""
        self.describe_model(model_uid)
        return Model(self, model_uid)

    # ---- plumbing -----------------------------------------------------------------

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        _raise_for(response)
        return response.json()

    def _stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self._http.stream("POST", path, json=body) as response:
            if response.status_code >= 400:
                response.read()
                _raise_for(response)
            yield from iter_sse(response.iter_lines())


def _segment(model_uid: str) -> str:
    """``model_uid`` as one path segment: a uid with ``/`` or ``?`` in it asks for
    that model (and is refused as unknown), never another route."""
    return quote(model_uid, safe="")


class Model:
    """OpenAI-style calls on one launched model."""

    def __init__(self, client: Client, model_uid: str) -> None:
        self._client = client
        self.model_uid = model_uid

    def completions(
        self, prompt: str | Sequence[int], *, stream: bool = False, **params: Any
    ) -> Any:
        body = {"model": self.model_uid, "prompt": prompt, "stream": stream, **params}
        if isinstance(prompt, Sequence) and not isinstance(prompt, str):
            body["prompt"] = list(prompt)
        if stream:
            return self._client._stream("/v1/completions", body)
        return self._client._call("POST", "/v1/completions", json=body)

    def generate(
        self, prompt: str, generate_config: dict[str, Any] | None = None
    ) -> Any:
        """Upstream's form of ``completions``: parameters in ``generate_config``
        (``stream`` among them)."""
        params = dict(generate_config or {})
        return self.completions(
            prompt, stream=bool(params.pop("stream", False)), **params
        )

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        stream: bool = False,
        generate_config: dict[str, Any] | None = None,
        **params: Any,
    ) -> Any:
        """Chat completions; parameters as keywords or, as upstream's client takes
        them, in ``generate_config`` (its ``stream`` too)."""
        config = dict(generate_config or {})
        stream = bool(config.pop("stream", stream))
        clash = sorted(config.keys() & params.keys())
        if clash:
            raise ValueError(f"{clash} given both as keywords and in generate_config")
        body = {
            "model": self.model_uid,
            "messages": list(messages),
            "stream": stream,
            **config,
            **params,
        }
        if stream:
            return self._client._stream("/v1/chat/completions", body)
        return self._client._call("POST", "/v1/chat/completions", json=body)


def iter_sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """JSON payloads of a server-sent event stream, up to ``data: [DONE]``.

    An in-band error event (the stream failed after it started) raises.
    """
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        payload = json.loads(data)
        if "error" in payload:
            raise XinferenceError(500, payload["error"].get("message", "stream failed"))
        yield payload


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        detail = response.text
    if not isinstance(detail, str):
        detail = json.dumps(detail)
    raise XinferenceError(response.status_code, detail)
