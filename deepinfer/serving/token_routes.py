"""Routes that read the tokenizer and the prompt renderer without running the model, in the shapes their
reference servers use:

    POST /tokenize                   vLLM's: {"prompt": ...} or {"messages": [...]} ->
                                     {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize                 vLLM's: {"tokens": [...]} -> {"prompt": text}
    GET  /version                    vLLM's: {"version": ...}
    POST /v1/messages/count_tokens   Anthropic's: a Messages body without max_tokens -> {"input_tokens": N}

Chat messages are rendered exactly as /v1/chat/completions renders them (the same deepseek_recipe conversion), so a
count here is the prompt_tokens a chat request with the same messages reports.
"""

from __future__ import annotations

import importlib.metadata

from fastapi import Request
from fastapi.responses import JSONResponse

from deepinfer.serving.body import json_body
from deepinfer.serving.errors import HTTPError, bad_request, log_refusal, unconvertible

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "return_token_strs", "tools", "tool_choice", "thinking", "reasoning_effort"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def version() -> str:
    try:
        return importlib.metadata.version("deepinfer")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def add_token_routes(app, state) -> None:
    converter = state.converter

    async def answer(request: Request, endpoint: str, work):
        try:
            body = await json_body(request)
            try:
                return JSONResponse(work(body))
            except HTTPError:
                raise
            except Exception as exc:  # the client's bytes, whatever the conversion raised: never a 500
                raise unconvertible(exc, endpoint) from None
        except HTTPError as exc:
            log_refusal(request.method, request.url.path, exc)
            return JSONResponse(exc.body(endpoint), status_code=exc.status)

    def tokenize(body: dict) -> dict:
        converter.check_model(body)
        converter.ignored_fields("tokenize", body, TOKENIZE_FIELDS)
        return_strs = _flag(body, "return_token_strs", False)
        if ("prompt" in body) == ("messages" in body):
            raise bad_request("give exactly one of prompt (a string) and messages (a chat)", "prompt")
        if "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise bad_request(f"prompt={str(prompt)[:60]!r} is invalid; allowed: a string", "prompt")
            converter.check_prompt_size(body)
            ids = converter.tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True)).ids
        else:
            if _flag(body, "add_generation_prompt", True) is False:
                raise bad_request("add_generation_prompt=false is not supported: the DeepSeek prompt format always "
                                  "ends a chat with the assistant's turn; allowed: true", "add_generation_prompt")
            chat = {k: body[k] for k in ("model", "messages", "tools", "tool_choice", "thinking", "reasoning_effort")
                    if k in body}
            ids = converter.prompt_ids("chat", chat)
        strs = [converter.tokenizer.id_to_token(t) for t in ids] if return_strs else None
        return {"count": len(ids), "max_model_len": converter.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(body: dict) -> dict:
        converter.check_model(body)
        converter.ignored_fields("detokenize", body, DETOKENIZE_FIELDS)
        tokens = body.get("tokens")
        vocab = converter.tokenizer.get_vocab_size(with_added_tokens=True)
        if not (isinstance(tokens, list) and all(type(t) is int and 0 <= t < vocab for t in tokens)):
            raise bad_request(f"tokens={str(tokens)[:60]!r} is invalid; allowed: a list of token ids in "
                              f"[0, {vocab})", "tokens")
        return {"prompt": converter.tokenizer.decode(tokens, skip_special_tokens=False)}

    def count_tokens(body: dict) -> dict:
        return {"input_tokens": len(converter.prompt_ids("messages", body))}

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await answer(request, "tokenize", tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await answer(request, "detokenize", detokenize)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens_route(request: Request):
        return await answer(request, "messages", count_tokens)

    @app.get("/version")
    async def version_route():
        return {"version": version()}


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad_request(f"{name}={value!r} is invalid; allowed: true or false", name)
    return value
