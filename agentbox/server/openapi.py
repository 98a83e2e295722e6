"""The OpenAPI document the server publishes at /openapi.json: request and response schemas for the three
APIs (OpenAI chat and completions, Anthropic messages, OpenAI responses) and the status codes the server
really answers (400, never FastAPI's default 422; 413, 415, 421, 503 from the guard and the engine), so a
tool such as Schemathesis can check the server against it.

The models here describe; they do not validate. The routes validate with their own (looser) models, since
clients send many fields this document leaves out.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from agentbox.chat import schema_check
from agentbox.config import ServerConfig
from agentbox.server import grammar_gate, guard
from agentbox.server.anthropic_routes import CreateBody, MessagesBody
from agentbox.server.protocol import ChatCompletionRequest, CompletionRequest
from agentbox.server.responses_routes import ResponsesRequest
from agentbox.server.session_key import MAX_SESSION_ID_CHARS


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


SCHEMA_LIMITS = (f"a JSON schema object of at most {schema_check.MAX_SCHEMA_BYTES:,} bytes: at most "
                 f"{schema_check.MAX_ENUM_MEMBERS:,} members an enum, {schema_check.MAX_PROPERTIES:,} properties an "
                 f"object, every part able to end within {schema_check.MAX_SHORTEST_CHARS:,} characters (no "
                 f"recursion it cannot leave), compiled within {grammar_gate.COMPILE_S:g} s; all of a request's "
                 f"schemas together at most {grammar_gate.MAX_GRAMMAR_BYTES:,} bytes")


class FunctionDef(_Doc):
    name: str = Field(..., min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description=SCHEMA_LIMITS)


class Tool(_Doc):
    type: Literal["function"]
    function: FunctionDef


class ChatMessage(_Doc):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class AnthropicTool(_Doc):
    name: str = Field(..., min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(..., description=SCHEMA_LIMITS)


class AnthropicMessage(_Doc):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class OpenAIError(BaseModel):
    class Detail(BaseModel):
        message: str
        type: str
        param: str | None = None
        code: str | None = None

    error: Detail


class AnthropicError(BaseModel):
    class Detail(BaseModel):
        type: str
        message: str

    type: Literal["error"]
    error: Detail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]
    # speculative decoding: draft tokens the model kept / refused (OpenAI's predicted-output fields)
    completion_tokens_details: dict[str, int] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "error"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AnthropicMessageResponse(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: dict[str, int]


class TokenCount(BaseModel):
    input_tokens: int


class ResponseObject(_Doc):
    id: str
    object: Literal["response"]
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


# Request bodies as documented: the routes' own models (pydantic's schema: FastAPI's document turns integer
# bounds into floats, and 2**63 - 1 became 2**63, a seed the server refuses), with messages and tools typed.
REQUESTS: dict[str, tuple[type[BaseModel], dict[str, Any]]] = {
    "/v1/chat/completions": (ChatCompletionRequest, {"messages": ChatMessage, "tools": Tool}),
    "/v1/completions": (CompletionRequest, {}),
    "/v1/responses": (ResponsesRequest, {"tools": Tool}),
    "/v1/messages": (CreateBody, {"messages": AnthropicMessage, "tools": AnthropicTool}),
    "/v1/messages/count_tokens": (MessagesBody, {"messages": AnthropicMessage, "tools": AnthropicTool}),
}
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
RESPONSES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletion, "/v1/completions": Completion, "/v1/responses": ResponseObject,
    "/v1/messages": AnthropicMessageResponse, "/v1/messages/count_tokens": TokenCount,
}
STREAMING = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
POST_ERRORS = {400: "invalid input (the message names the field)", 413: "body too large",
               415: "the body is not sent as JSON", 421: "foreign Host on a loopback server"}
GET_ERRORS = {421: "foreign Host on a loopback server"}
OPEN = ("/", "/health", "/version")  # answered without a key
NO_ENGINE = ("/", "/version", "/v1/models", "/v1/messages/count_tokens")  # never wait on the engine


def _schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, str]:
    """Adds `model` (and the models it uses) to the components; returns its $ref."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def limits(config: ServerConfig, default_max_tokens: int) -> dict[str, Any]:
    """Every limit a request meets before it is served, as `x-limits` of the document (the fields' own bounds are
    in their schemas)."""
    return {
        "max_body_bytes": int(config.max_body_mb * 2**20), "max_header_bytes": guard.MAX_HEADER_BYTES,
        "max_json_depth": guard.MAX_JSON_DEPTH, "max_session_id_chars": MAX_SESSION_ID_CHARS,
        "default_max_tokens": default_max_tokens,
        "schema": {"max_bytes": schema_check.MAX_SCHEMA_BYTES, "max_enum_members": schema_check.MAX_ENUM_MEMBERS,
                   "max_properties": schema_check.MAX_PROPERTIES,
                   "max_shortest_value_chars": schema_check.MAX_SHORTEST_CHARS,
                   "max_request_bytes": grammar_gate.MAX_GRAMMAR_BYTES, "compile_s": grammar_gate.COMPILE_S,
                   "compile_memory_bytes": grammar_gate.COMPILE_MEMORY_BYTES},
    }


def build(app: FastAPI, auth: bool, config: ServerConfig) -> dict[str, Any]:
    state = getattr(app.state, "agentbox", None)  # the document is built on its first request, after the start
    default_max_tokens = state.default_max_tokens if state is not None else config.default_max_tokens
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes,
                       description="agentbox: OpenAI chat / completions / responses and Anthropic messages, "
                       "with every agent session's cache kept resident. A request without max_tokens (or "
                       f"max_output_tokens) may generate up to {default_max_tokens} tokens (also in /v1/models as "
                       "default_max_tokens); `x-limits` lists every other limit.")
    spec["x-limits"] = limits(config, default_max_tokens)
    comps = spec.setdefault("components", {}).setdefault("schemas", {})
    comps.pop("HTTPValidationError", None)
    comps.pop("ValidationError", None)
    errors = {"openai": _schema(OpenAIError, comps), "anthropic": _schema(AnthropicError, comps)}
    for model, typed in REQUESTS.values():
        _schema(model, comps)
        body = comps.get(model.__name__)
        for field in MAX_TOKENS_FIELDS:
            if body is not None and field in body.get("properties", {}):
                body["properties"][field]["description"] = (
                    f"the output budget; without it, {default_max_tokens} tokens (the model's default), capped by "
                    "the room the context leaves")
        for field, item in typed.items():
            props = body.get("properties", {}) if body is not None else {}
            if field in props:
                array: dict[str, Any] = {"type": "array", "items": _schema(item, comps)}
                if field == "messages":
                    array["minItems"] = 1
                nullable = any(a.get("type") == "null" for a in props[field].get("anyOf", []))
                props[field] = {"anyOf": [array, {"type": "null"}]} if nullable else array
    for path, ops in spec["paths"].items():
        shape = errors["anthropic" if path.startswith("/v1/messages") else "openai"]
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if method == "post" and path in REQUESTS:
                ref = f"#/components/schemas/{REQUESTS[path][0].__name__}"
                op["requestBody"] = {"required": True, **_json({"$ref": ref})}
                ok = _json(_schema(RESPONSES[path], comps))
                if path in STREAMING:
                    ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
                responses["200"] = {"description": "the answer (server-sent events when stream is true)", **ok}
            table = dict(POST_ERRORS if method == "post" else GET_ERRORS)
            if auth and path not in OPEN:
                table[401] = "missing or wrong API key"
            if path not in NO_ENGINE:
                table[503] = "the engine restarts, the server stops, or admission is full (see Retry-After)"
            for status, why in table.items():
                responses.setdefault(str(status), {"description": why, **_json(shape)})
            if "{session_id}" in path:
                responses["404"] = {"description": "no such session", **_json(shape)}
            elif path in REQUESTS or path.startswith("/v1/models/"):
                responses["404"] = {"description": "the model named is not served here", **_json(shape)}
    spec["paths"]["/metrics"]["get"]["responses"]["200"] = {
        "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
    return spec


def install(app: FastAPI, auth: bool, config: ServerConfig) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app, auth, config)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
