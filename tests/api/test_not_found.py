"""A request for a model that is not launched is a 404 that names the launched
models (and the likely one meant), to a caller who may list them: a user who
mistyped a uid learns the right one without another call. A caller without
``models:list`` learns nothing more than before. No engine, no pool."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from xinference.api.auth.permissions import MODELS_LIST, MODELS_READ, Principal
from xinference.api.errors import install_error_handlers
from xinference.core.deployment import Deployment
from xinference.core.heartbeat import HeartbeatSettings
from xinference.core.messages import ModelNotLaunched
from xinference.core.supervisor import SupervisorActor


def supervisor_with(*models: tuple[str, str]) -> SupervisorActor:
    supervisor = SupervisorActor(HeartbeatSettings())
    for uid, state in models:
        supervisor._models[uid] = Deployment(
            spec=SimpleNamespace(model_uid=uid), state=state
        )
    return supervisor


async def test_the_supervisor_names_the_launched_models() -> None:
    supervisor = supervisor_with(("qwen-chat", "ready"), ("llama", "launching"))
    with pytest.raises(ModelNotLaunched) as raised:
        await supervisor.progress("qwen-caht")
    error = raised.value
    assert str(error) == "model 'qwen-caht' is not launched"
    assert error.launched == (("qwen-chat", "ready"), ("llama", "launching"))
    # it crosses processes (xoscar pickles it) whole
    again = pickle.loads(pickle.dumps(error))
    assert (again.model_uid, again.launched) == (error.model_uid, error.launched)
    assert again.listing() == (
        "launched: qwen-chat (ready), llama (launching); did you mean 'qwen-chat'?"
    )
    assert ModelNotLaunched("x").listing() == "no model is launched"


def app_as(principal: Principal | None) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.middleware("http")
    async def authenticated(request: Request, call_next):  # type: ignore[no-untyped-def]
        if principal is not None:
            request.state.principal = principal
        return await call_next(request)

    @app.get("/v1/models/{uid}")
    async def describe(uid: str) -> None:
        raise ModelNotLaunched(uid, (("qwen-chat", "ready"),))

    return TestClient(app)


@pytest.mark.parametrize(
    "principal",
    [None, Principal("ann", frozenset({MODELS_LIST, MODELS_READ}), via="token")],
    ids=["auth-off", "may-list"],
)
def test_the_404_lists_the_launched_models(principal: Principal | None) -> None:
    response = app_as(principal).get("/v1/models/qwen-caht")
    assert response.status_code == 404
    body = response.json()
    assert body["detail"] == (
        "model 'qwen-caht' is not launched; launched: qwen-chat (ready); "
        "did you mean 'qwen-chat'?"
    )
    assert body["error"]["type"] == "not_found_error"


def test_a_caller_who_may_not_list_models_is_told_only_the_miss() -> None:
    reader = Principal("bob", frozenset({MODELS_READ}), via="key")
    response = app_as(reader).get("/v1/models/qwen-caht")
    assert response.status_code == 404
    assert response.json()["detail"] == "model 'qwen-caht' is not launched"
