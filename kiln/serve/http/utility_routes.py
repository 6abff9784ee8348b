"""The routes vLLM's and SGLang's servers have beside the OpenAI API, which tools such as guidellm call:
`GET /health` (200 when ready, 503 otherwise), `GET /version`, `GET /metrics` (the metrics port's exposition,
also on the HTTP port), `POST /tokenize` and `POST /detokenize`. Bad fields are 400s naming them."""

from __future__ import annotations

import json

from aiohttp import web

import kiln
from kiln.serve.client_json import check_values, shown
from kiln.serve.engine_service import EngineService
from kiln.serve.errors import InvalidRequest
from kiln.serve.http.common import CONFIG, SERVICE, read_json
from kiln.serve.limits import RequestLimits
from kiln.serve.openai.chat import chat_messages, chat_prompt, chat_template_variables, check_messages_size
from kiln.serve.openai.request import check_model
from kiln.serve.openai.tool_specs import check_tools

_TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "tools",
                    "chat_template_kwargs", "reasoning_effort"}
_DETOKENIZE_FIELDS = {"model", "tokens"}


def _check_fields(body: dict, supported: set[str]) -> None:
    for name, value in body.items():
        if name not in supported and value is not None:
            raise InvalidRequest(f"'{name}' is not supported here (got {shown(value)}); the fields are "
                                 f"{', '.join(sorted(supported))}", name)


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name}={shown(value)} is invalid: must be true or false", name)
    return value


def _tokenizer(service: EngineService, field: str):
    if service.tokenizer is None:
        raise InvalidRequest("this engine has no tokenizer (none was in the checkpoint)", field)
    return service.tokenizer


async def tokenize(service: EngineService, body: dict, chat_template: str | None, limits: RequestLimits) -> dict:
    """vLLM's /tokenize: `{"prompt": text}` or `{"messages": [...]}` (rendered with the chat template) ->
    `{"tokens", "count", "max_model_len"}`. The text is checked against --max-prompt-chars, then rendered and
    tokenized on the service's prompt worker."""
    check_values(body)
    _check_fields(body, _TOKENIZE_FIELDS)
    check_model(body, service)
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise InvalidRequest("send either 'prompt' (a string) or 'messages' (a list of chat messages)", "prompt")
    if body.get("messages") is not None:
        if body.get("add_special_tokens") is not None:
            raise InvalidRequest("add_special_tokens applies to 'prompt'; with 'messages' the chat template "
                                 "decides", "add_special_tokens")
        messages = chat_messages(body["messages"])
        tools = [tool.spec for tool in check_tools(body.get("tools"))]  # rendered as /v1/chat/completions does
        add_generation_prompt = _flag(body, "add_generation_prompt", True)
        size = check_messages_size(service, limits, messages)
        kwargs = chat_template_variables(body)
        token_ids = await service.run_prompt_work(chat_prompt, service, chat_template, messages,
                                                  add_generation_prompt, tools, kwargs, size=size)
        field = "messages"
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise InvalidRequest(f"prompt={shown(prompt)} is invalid: must be a string", "prompt")
        for name in ("add_generation_prompt", "tools", "chat_template_kwargs", "reasoning_effort"):
            if body.get(name) is not None:
                raise InvalidRequest(f"{name} applies to 'messages'", name)
        limits.check_prompt_chars("prompt", len(prompt), "prompt", service.max_seq_len)
        tokenizer, special = _tokenizer(service, "prompt"), _flag(body, "add_special_tokens", True)
        token_ids = await service.run_prompt_work(lambda: list(tokenizer.encode(prompt, add_special_tokens=special)),
                                                  size=len(prompt))
        field = "prompt"
    if len(token_ids) > limits.max_prompt_tokens:
        raise InvalidRequest(f"{field} has {len(token_ids)} tokens; this server takes at most "
                             f"{limits.max_prompt_tokens} per request (--max-prompt-tokens-per-request)", field)
    return {"tokens": token_ids, "count": len(token_ids), "max_model_len": service.max_seq_len}


async def detokenize(service: EngineService, body: dict) -> dict:
    """vLLM's /detokenize: `{"tokens": [ids]}` -> `{"prompt": text}`; the ids (a body may hold a million) are
    checked and decoded on the service's prompt worker."""
    check_values(body)
    _check_fields(body, _DETOKENIZE_FIELDS)
    check_model(body, service)
    tokens = body.get("tokens")
    vocab = service.llm.vocab_size
    if not isinstance(tokens, list):
        raise InvalidRequest(f"tokens={shown(tokens)} is invalid: must be a list of token ids", "tokens")
    tokenizer = _tokenizer(service, "tokens")

    def decode() -> dict:
        for i, t in enumerate(tokens):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequest(f"tokens[{i}]={shown(t)} is invalid: must be a token id in [0, {vocab})",
                                     "tokens")
        return {"prompt": tokenizer.decode(tokens)}

    return await service.run_prompt_work(decode, size=len(tokens))


async def _json_response(service: EngineService, body: dict) -> web.Response:
    """JSON written on the prompt worker: a million token ids take a while to write."""
    return web.json_response(text=await service.run_prompt_work(json.dumps, body))


def add_routes(app: web.Application) -> None:
    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if request.app[SERVICE].ready else 503)

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": kiln.__version__})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=request.app[SERVICE].metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    async def tokenize_route(request: web.Request) -> web.Response:
        config = request.app[CONFIG]
        body = await read_json(request)
        service = request.app[SERVICE]
        return await _json_response(service, await tokenize(service, body, config.chat_template,
                                                            RequestLimits.from_config(config)))

    async def detokenize_route(request: web.Request) -> web.Response:
        service = request.app[SERVICE]
        return await _json_response(service, await detokenize(service, await read_json(request)))

    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize_route)
    app.router.add_post("/detokenize", detokenize_route)
