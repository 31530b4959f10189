"""An HTTP request body -> what the engine runs and how its output is shaped.

Chat Completions, Responses and Anthropic Messages go through deepseek_recipe end to end: it parses and checks the
request, renders the DeepSeek-V4.1 prompt (encoded with the served tokenizer), picks the sampling settings and the
output constraint, and its StreamProcessor later turns generated text into the protocol's chunks (reasoning
content, tool calls, stop sequences). Legacy Completions (a raw prompt) have no conversation to render: the prompt is
encoded as it is and the text streams through a Chat Completions processor that only matches stop sequences; the
chunks are reshaped into `text_completion` objects (completions_shape.py).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import deepseek_recipe as dr

from deepinfer.sampling.params import SamplingParams
from deepinfer.serving.constraints import ConstraintError, SpecialIds, so_args_for
from deepinfer.serving.errors import HTTPError, bad_request, from_conversion

# endpoint -> (request class, response class, id prefix)
PROTOCOLS = {
    "chat": (dr.ChatCompletionRequest, dr.ChatCompletionResponse, "chatcmpl-"),
    "responses": (dr.ResponsesRequest, dr.ResponsesResponse, "resp_"),
    "messages": (dr.MessagesRequest, dr.MessagesResponse, "msg_"),
}
# OpenAI sampling fields deepseek_recipe leaves to the backend; mapped onto SamplingParams, range-checked there
PENALTIES = ("frequency_penalty", "presence_penalty")
COMPLETIONS_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "stream",
                      "stream_options", "n", "user", *PENALTIES}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Prepared:
    """One request, converted: run `prompt_ids` with `params`; feed the text to `processor`; shape the result with
    `response` (non-streaming) or as SSE events."""

    endpoint: str
    id: str
    model: str
    created: int
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    processor: Any  # deepseek_recipe.StreamProcessor
    response: Any  # ChatCompletionResponse | ResponsesResponse | MessagesResponse (accumulates chunks)
    response_cls: Any
    include_usage: bool = True  # completions only: usage in the last streamed chunk


class Converter:
    """tokenizer: the served `tokenizers.Tokenizer`; tokenizer_json: its JSON (for deepseek_recipe's encoder);
    max_model_len: the engine's context limit; served_name: the model name requests may use besides
    DeepSeek-V4.1-Flash."""

    def __init__(self, tokenizer, tokenizer_json: str, max_model_len: int, served_name: str, default_thinking: bool):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.served_name = served_name
        self.options = (dr.ConversionOptions(default_thinking_mode=default_thinking)
                        .with_model_alias(served_name, dr.ModelVersion.DeepseekV41Flash))
        self.accepted_models = set(self.options.model_versions_by_name)
        self.encoding = dr.DeepseekV41Encoding().with_tokenizer(dr.Tokenizer.from_str(tokenizer_json))
        self.ids = SpecialIds(tokenizer)

    # ---- Chat Completions, Responses, Messages --------------------------------------------------------------
    def convert(self, endpoint: str, body: dict) -> Prepared:
        req_cls, resp_cls, prefix = PROTOCOLS[endpoint]
        try:
            req = req_cls(body)
            model = req.model
            conv = req.convert(self.options)
        except dr.ConversionError as exc:
            raise from_conversion(exc) from None
        except (ValueError, TypeError) as exc:  # the body does not deserialize into the protocol's request
            raise bad_request(_first_line(exc)) from None
        if any(m.image_sources for m in conv.conversation.messages):
            raise bad_request("image inputs are not supported by this server (the text model has no vision tower)")
        io = conv.inference_options
        if io.logprobs:
            raise bad_request("logprobs are not supported by this server yet; allowed: logprobs false", "logprobs")
        try:
            prompt_ids = list(self.encoding.encode(conv.conversation))
        except RuntimeError as exc:
            raise bad_request(f"the prompt could not be encoded: {_first_line(exc)}") from None
        try:
            max_tokens = conv.resolve_max_tokens(len(prompt_ids), self.max_model_len)
        except dr.ConversionError as exc:
            raise from_conversion(exc) from None
        try:
            so_args = so_args_for(io.output_constraint, conv.conversation.thinking_mode, self.ids)
        except ConstraintError as exc:
            raise bad_request(str(exc), "response_format") from None
        params = _params(
            temperature=io.temperature, top_p=io.top_p, max_tokens=max_tokens, seq_seed=io.seed, so_args=so_args,
            **{k: body[k] for k in PENALTIES if endpoint == "chat" and body.get(k) is not None},
        )
        rid = f"{prefix}{uuid.uuid4().hex}"
        created = int(time.time())
        processor = dr.StreamProcessor(req_cls.chunk_generator(conv, rid, model), conv.parsing_options)
        response = resp_cls(rid, model, created, len(prompt_ids), 0)
        return Prepared(endpoint, rid, model, created, prompt_ids, params, bool(conv.stream), processor, response,
                        resp_cls)

    # ---- legacy Completions ---------------------------------------------------------------------------------
    def convert_completion(self, body: dict) -> Prepared:
        unknown = sorted(set(body) - COMPLETIONS_FIELDS)
        if unknown:
            raise bad_request(f"unsupported field {unknown[0]!r}; allowed: {', '.join(sorted(COMPLETIONS_FIELDS))}",
                              unknown[0])
        model = body.get("model")
        if model not in self.accepted_models:
            raise HTTPError(404, f"model {model!r} is not served here; allowed: {', '.join(sorted(self.accepted_models))}",
                            "model_not_found", "model")
        if body.get("n", 1) != 1:
            raise bad_request(f"n={body.get('n')!r} is not supported; allowed: 1", "n")
        prompt_ids = self._completion_prompt(body.get("prompt"))
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise bad_request(f"stop={stop!r} is invalid; allowed: a string or a list of non-empty strings", "stop")
        temperature = body.get("temperature", 1.0)
        if isinstance(temperature, (int, float)) and not 0 <= temperature <= 2:  # OpenAI's range for this API
            raise bad_request(f"temperature={temperature!r} is out of range; allowed: [0, 2]", "temperature")
        seed = body.get("seed")
        if seed is not None and (type(seed) is not int or seed < 0):
            raise bad_request(f"seed={seed!r} is invalid; allowed: an integer >= 0", "seed")
        params = _params(
            temperature=temperature, top_p=body.get("top_p", 1.0),
            max_tokens=body.get("max_tokens") or COMPLETIONS_DEFAULT_MAX_TOKENS, seq_seed=seed,
            **{k: body[k] for k in PENALTIES if body.get(k) is not None},
        )
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        # a bare conversation request only carries the model version; stop matching comes from the parsing options
        conv = dr.ConversationRequest(dr.Conversation([]), dr.ModelVersion.DeepseekV41Flash)
        parsing = dr.ParsingOptions(parse_tool_calls=False, stop_sequences=stop or [],
                                    thinking_initial_stage=dr.ThinkingInitialStage.ContentContinuation)
        processor = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(conv, rid, model), parsing)
        stream_options = body.get("stream_options") or {}
        return Prepared("completions", rid, model, created, prompt_ids, params, bool(body.get("stream", False)),
                        processor, None, None, include_usage=bool(stream_options.get("include_usage", True)))

    def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # the SDK's one-prompt batch
        if isinstance(prompt, str) and prompt:
            return self.tokenizer.encode(prompt).ids
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        raise bad_request(f"prompt={str(prompt)[:60]!r} is invalid; allowed: a non-empty string or a list of token "
                          "ids (one prompt per request)", "prompt")


def _params(**fields) -> SamplingParams:
    """SamplingParams' own checks decide (one-line message naming the field and its range)."""
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as exc:
        raise bad_request(_first_line(exc)) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
