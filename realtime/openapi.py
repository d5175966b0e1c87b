"""The OpenAPI 3.1 description of the real-time API, generated from the wire models.

``realtime/openapi.json`` is the checked-in copy (a test keeps it equal to what this module makes);
regenerate it with ``shopper realtime openapi --write``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from pydantic.json_schema import models_json_schema

from realtime.models import ErrorResponse, HealthResponse, MatchRequest, MatchResponse

SPEC_PATH = Path(__file__).resolve().parent / "openapi.json"
_REF = "#/components/schemas/{model}"


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}},
    }


@cache
def openapi_spec() -> dict[str, Any]:
    _, schemas = models_json_schema(
        [
            (MatchRequest, "validation"),
            (MatchResponse, "serialization"),
            (ErrorResponse, "serialization"),
            (HealthResponse, "serialization"),
        ],
        ref_template=_REF,
    )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Shopper-product matching (real time)",
            "version": "1.0.0",
            "description": (
                "Ranks an ad server's candidate products for one shopper with reasons, from the shopper's "
                "and the products' signals and an LLM, within a deadline. When the model cannot answer in "
                "time the answer is a signal-based ranking marked degraded."
            ),
        },
        "paths": {
            "/v1/match": {
                "post": {
                    "operationId": "match",
                    "summary": "Rank candidates for a shopper, with a reason each",
                    "parameters": [
                        {
                            "name": "X-Request-Start",
                            "in": "header",
                            "required": False,
                            "description": (
                                "when the caller sent the request, as a Unix time in seconds, ms or µs, "
                                "optionally 't='-prefixed (nginx: t=${msec}); the deadline then counts "
                                "from it, not from arrival. Ignored when not a number or more than an "
                                "hour off the service's clock"
                            ),
                            "schema": {"type": "string"},
                        }
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {"schema": {"$ref": _REF.format(model="MatchRequest")}}
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "the ranking (degraded: true when it is the fallback)",
                            "content": {
                                "application/json": {"schema": {"$ref": _REF.format(model="MatchResponse")}}
                            },
                        },
                        "400": _error("the body is not JSON"),
                        "401": _error("API keys are configured and the request has no valid one"),
                        "413": _error("the body is larger than max_body_bytes (256 KiB by default)"),
                        "415": _error("the body is not application/json"),
                        "422": _error("a field is missing or invalid; details name each one"),
                        "429": {
                            **_error(
                                "rate_limited: this client (API key, else address) is over its rate "
                                "limit; or overloaded: the request cannot be answered within its "
                                "deadline (it is too old, or the service too far behind), so it is "
                                "refused before any work"
                            ),
                            "headers": {
                                "Retry-After": {
                                    "description": "seconds until a request will be accepted, or to send "
                                    "less for",
                                    "schema": {"type": "integer", "minimum": 1},
                                }
                            },
                        },
                    },
                    "security": [{"ApiKeyHeader": []}, {"BearerKey": []}, {}],
                }
            },
            "/health": {
                "get": {
                    "operationId": "health",
                    "summary": "Liveness, and the state of the pool and Redis",
                    "responses": {
                        "200": {
                            "description": "the service answers (degraded if its dependencies do not)",
                            "content": {
                                "application/json": {"schema": {"$ref": _REF.format(model="HealthResponse")}}
                            },
                        }
                    },
                }
            },
            "/metrics": {
                "get": {
                    "operationId": "metrics",
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {"description": "Prometheus text format", "content": {"text/plain": {}}}
                    },
                }
            },
        },
        "components": {
            "schemas": schemas["$defs"],
            "securitySchemes": {
                "ApiKeyHeader": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "X-API-Key",
                    "description": "required only when the service is given keys (REALTIME_API_KEYS)",
                },
                "BearerKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the same API key as 'Authorization: Bearer <key>'",
                },
            },
        },
    }


def write_spec(path: Path = SPEC_PATH) -> Path:
    import json

    path.write_text(json.dumps(openapi_spec(), indent=2, sort_keys=True) + "\n")
    return path
