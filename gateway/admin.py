"""Operator routes: change an endpoint group's traffic weight live.

``PUT /admin/groups/{group}/weight`` with ``{"weight": 0.5}`` sets the weight the ``predicted_ttft``
policy divides a group's predicted time to first token by when it spills (0 takes the group out of
rotation), as a traffic orchestrator shifts load between regions; ``GET /admin/groups`` lists them.
Behind the operators' own key (``GATEWAY_ADMIN_API_KEY``, ``gateway.guard``), never the callers'; with
none set the routes answer 403. A weight is finite and at most ``MAX_GROUP_WEIGHT`` (``Infinity`` or
``1e309`` would make a group admissible however slow it is). The new weights show on ``/metrics``
(``gateway_group_weight``). A policy without groups answers 404.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import orjson
from aiohttp import web
from pydantic import BaseModel, Field, ValidationError

from llm_client.client import LLMClient
from llm_client.routing.predicted_ttft import MAX_GROUP_WEIGHT
from prompt_assembly.errors import ConfigurationError


@runtime_checkable
class GroupWeighted(Protocol):
    """A routing policy with endpoint groups (``llm_client.routing.predicted_ttft``)."""

    def group_weights(self) -> dict[str, float]: ...

    def set_group_weight(self, group: str, weight: float) -> None: ...


class WeightUpdate(BaseModel):
    weight: float = Field(ge=0, le=MAX_GROUP_WEIGHT, allow_inf_nan=False)


def add_admin_routes(app: web.Application, client: LLMClient) -> None:
    async def groups(request: web.Request) -> web.Response:
        policy = client.policy
        if not isinstance(policy, GroupWeighted):
            return _json({"error": f"policy {policy.name!r} has no endpoint groups"}, 404)
        return _json({"groups": policy.group_weights()})

    async def set_weight(request: web.Request) -> web.Response:
        policy = client.policy
        if not isinstance(policy, GroupWeighted):
            return _json({"error": f"policy {policy.name!r} has no endpoint groups"}, 404)
        try:
            update = WeightUpdate.model_validate_json(await request.read())
            policy.set_group_weight(request.match_info["group"], update.weight)
        except (ValidationError, ConfigurationError) as exc:
            return _json({"error": str(exc).splitlines()[0]}, 400)
        return _json({"groups": policy.group_weights()})

    app.router.add_get("/admin/groups", groups)
    app.router.add_put("/admin/groups/{group}/weight", set_weight)


def _json(body: dict[str, object], status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")
