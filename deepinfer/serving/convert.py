"""An HTTP request body -> what the engine runs and how its output is shaped.

Chat Completions, Responses and Anthropic Messages go through deepseek_recipe end to end: it parses and checks the
request, renders the DeepSeek-V4.1 prompt (encoded with the served tokenizer), picks the sampling settings and the
output constraint, and its StreamProcessor later turns generated text (or, when logprobs are asked, token ids with
their logprobs) into the protocol's chunks (reasoning content, tool calls, stop sequences, logprobs). Legacy
Completions (raw prompts) have no conversation to render: each prompt is encoded as it is, stop strings are the
engine's own (SamplingParams.stop), and completions_shape.py builds the `text_completion` objects (logprobs, echo).

One rule for fields a protocol does not define (vLLM's): they are ignored, logged as a warning and named in the
response header `x-deepinfer-ignored-fields`. The fields listed here are honoured; a value out of range is a 400.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import deepseek_recipe as dr

from deepinfer.engine.prefix_cache import cache_salt_error
from deepinfer.frontend.images import ImagePrompts
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.schema_limits import limits_error
from deepinfer.serving.body import check_prompt_chars
from deepinfer.serving.constraints import ConstraintError, SpecialIds, after_thinking, so_args_for
from deepinfer.serving.errors import HTTPError, bad_request, from_conversion
from deepinfer.serving.images import expand_images

log = logging.getLogger("deepinfer.serving")

# endpoint -> (request class, response class, id prefix)
PROTOCOLS = {
    "chat": (dr.ChatCompletionRequest, dr.ChatCompletionResponse, "chatcmpl-"),
    "responses": (dr.ResponsesRequest, dr.ResponsesResponse, "resp_"),
    "messages": (dr.MessagesRequest, dr.MessagesResponse, "msg_"),
}
# OpenAI sampling fields deepseek_recipe leaves to the backend; mapped onto SamplingParams, range-checked there
PENALTIES = ("frequency_penalty", "presence_penalty")
# vLLM's extra sampling fields, honoured alike by /v1/chat/completions and /v1/completions
VLLM_SAMPLING = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids")
VLLM_GUIDED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
VLLM_FIELDS = {*VLLM_SAMPLING, *VLLM_GUIDED, "logit_bias", "guided_decoding_backend", "guided_whitespace_pattern"}
# vLLM's per-request prefix-cache salt, taken by every generating endpoint (Anthropic's has no such field: the same
# extension there; its metadata.user_id is not mapped onto it, which would split the cache per user unasked)
CACHE_SALT = "cache_salt"
# what each protocol defines (anything else is ignored with a warning); metadata-like fields change no output
KNOWN_FIELDS = {
    "chat": {"model", "messages", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs",
             "max_tokens", "max_completion_tokens", "n", "reasoning_effort", "thinking", "response_format", "seed",
             "stop", "stream", "stream_options", "temperature", "top_p", "tools", "tool_choice",
             "parallel_tool_calls", "user", "metadata", "store", "service_tier", "prompt_cache_key",
             "safety_identifier", CACHE_SALT, *VLLM_FIELDS},
    "completions": {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "stream",
                    "stream_options", "n", "best_of", "echo", "logprobs", "user", CACHE_SALT, *PENALTIES,
                    *VLLM_FIELDS},
    "responses": {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "top_logprobs",
                  "include", "reasoning", "text", "tools", "tool_choice", "parallel_tool_calls", "stream", "user",
                  "metadata", "store", "service_tier", "previous_response_id", "truncation", "prompt_cache_key",
                  "safety_identifier", "background", "stream_options", CACHE_SALT},
    "messages": {"model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences",
                 "stream", "thinking", "tools", "tool_choice", "metadata", "output_config", "service_tier",
                 CACHE_SALT},
}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 128  # choices per request (n, best_of)
MAX_COMPLETION_LOGPROBS = 20  # OpenAI's bound for the legacy `logprobs` (vLLM's default max_logprobs)


@dataclass
class Job:
    """One prompt of a request: run `prompt_ids` with `params` (params.n samples). prompt_text: for echo."""

    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None
    images: list = field(default_factory=list)  # messages.ImageInput per image span in prompt_ids
    cache_salt: str | None = None  # only requests with the same salt (or none) share cached prefixes


@dataclass
class Prepared:
    """One request, converted: the engine runs each job's samples; a chat-like request feeds each sample's output
    to a processor made by `new_sample` (deepseek_recipe) and shapes it with the response it also returns; a
    completions request is shaped by completions_shape.py."""

    endpoint: str
    id: str
    model: str
    created: int
    jobs: list[Job]
    stream: bool
    new_sample: Callable | None = None  # () -> (StreamProcessor, response accumulator) per sample (not completions)
    response_cls: Any = None
    token_logprobs: bool = False  # feed the processor token ids with logprobs (the recipe writes OpenAI's shapes)
    include_usage: bool = False  # chat, completions: stream_options.include_usage (usage in a chunk of its own)
    n: int = 1  # choices returned per prompt
    best_of: int = 1  # samples run per prompt (completions; the n of highest mean logprob are returned)
    echo: bool = False  # completions: the prompt is part of each choice's text (and logprobs)
    logprobs: int | None = None  # completions: None, or alternatives per token in `logprobs`
    zero_tokens: bool = False  # completions max_tokens=0: the generated token is not shown
    ignored: list[str] = field(default_factory=list)  # fields ignored (the one rule for unknown fields)

    @property
    def prompt_ids(self) -> list[int]:
        return self.jobs[0].prompt_ids

    @property
    def params(self) -> SamplingParams:
        return self.jobs[0].params


class Converter:
    """tokenizer: the served `tokenizers.Tokenizer`; tokenizer_json: its JSON (for deepseek_recipe's encoder);
    max_model_len: the engine's context limit; served_names: the model names requests may use (the first is the
    one /v1/models lists first and responses echo by default); default_thinking: thinking mode of requests that do
    not say; model_version: the deepseek_recipe version whose prompt format the loaded model reads."""

    def __init__(self, tokenizer, tokenizer_json: str, max_model_len: int, served_names, default_thinking: bool,
                 model_version=dr.ModelVersion.DeepseekV41Flash, vision=None, schema_limits=None):
        """vision: the served model's VisionConfig (ModelCard.vision): image content parts become image spans;
        None: they are refused with a 400. schema_limits: (max bytes, max JSON values) of a structured-output
        schema (sampling.xgrammar_max_schema_bytes / _values; None: the schema's defaults), checked here to name
        the request's field; the engine checks them again."""
        if schema_limits is None:
            from deepinfer.config.schema import SamplingDefaults

            d = SamplingDefaults()
            schema_limits = (d.xgrammar_max_schema_bytes, d.xgrammar_max_schema_values)
        self.max_schema_bytes, self.max_schema_values = schema_limits
        self.tokenizer = tokenizer
        self.images = ImagePrompts(vision)
        self.max_model_len = max_model_len
        self.served_names = [served_names] if isinstance(served_names, str) else list(served_names)
        self.served_name = self.served_names[0]
        self.default_thinking = default_thinking
        table = {name: model_version for name in self.served_names}
        self.options = (dr.ConversionOptions(default_thinking_mode=default_thinking)
                        .with_model_versions_by_name(table))
        self.accepted_models = set(self.served_names)
        self.dr_tokenizer = dr.Tokenizer.from_str(tokenizer_json)
        encoding = dr.DeepseekV4Encoding() if model_version == dr.ModelVersion.DeepseekV4Pro else dr.DeepseekV41Encoding()
        self.encoding = encoding.with_tokenizer(self.dr_tokenizer)
        self.ids = SpecialIds(tokenizer)
        # the longest token in characters: with max_model_len, the most characters a prompt that fits can have
        self.longest_token = max(len(t) for t in tokenizer.get_vocab(with_added_tokens=True))

    # ---- shared -------------------------------------------------------------------------------------------
    def check_prompt_size(self, body: dict) -> None:
        """A 400 before tokenizing when the prompt has more characters than a prompt that fits can have."""
        check_prompt_chars(body, self.max_model_len, self.longest_token)

    def check_schema(self, field: str, so_args: dict) -> None:
        """A 400 naming `field` when its schema is over the engine's size limits (bytes, or JSON values: a
        100,000-value enum of short strings fits in 1 MiB but would hold a compiler for minutes)."""
        _, why = limits_error(so_args, self.max_schema_bytes, self.max_schema_values)
        if why is not None:
            raise bad_request(f"{field} {why}", field)

    def _check_output_schemas(self, body: dict) -> None:
        """The schemas a grammar would be compiled from, checked before the recipe renders them into the prompt:
        response_format (chat), text.format (responses), output_config.format (messages), strict tools. Shapes
        that are wrong are left to the protocol's own checks."""
        for name, path in (("response_format", ("response_format", "json_schema", "schema")),
                           ("text.format", ("text", "format", "schema")),
                           ("output_config.format", ("output_config", "format", "schema"))):
            node = body
            for key in path:
                node = node.get(key) if isinstance(node, dict) else None
            if isinstance(node, dict):
                self.check_schema(name, {"schema_type": "json", "schema": node})
        tools = body.get("tools")
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            if isinstance(fn, dict) and fn.get("strict"):
                schema = fn.get("parameters", fn.get("input_schema"))
                if isinstance(schema, dict):
                    self.check_schema(f"tools[{i}]", {"schema_type": "json", "schema": schema})

    def check_model(self, body: dict) -> str:
        """The request's model (the served name when it names none); 404 model_not_found for any other name."""
        model = body.get("model")
        if model is None:
            return self.served_name
        if not isinstance(model, str) or model not in self.accepted_models:
            raise HTTPError(404, f"the model {str(model)[:100]!r} does not exist here; served: "
                                 f"{', '.join(self.served_names)}", "invalid_request_error", "model",
                            code="model_not_found")
        return model

    def _ignored(self, endpoint: str, body: dict) -> list[str]:
        return self.ignored_fields(endpoint, body, KNOWN_FIELDS[endpoint])

    @staticmethod
    def ignored_fields(endpoint: str, body: dict, known) -> list[str]:
        """The one rule for fields an endpoint does not define: ignored, with a logged warning naming them."""
        unknown = sorted(k for k in body if k not in known)
        if unknown:
            log.warning("%s: ignoring field(s) this server does not define: %s", endpoint, ", ".join(unknown))
        return unknown

    def prompt_ids(self, endpoint: str, body: dict) -> list[int]:
        """The prompt a chat-like request renders to (the conversion and encoding `convert` uses; no sampling
        settings, no context check): /tokenize and /v1/messages/count_tokens."""
        body = {**body, "model": self.check_model(body)}
        self.check_prompt_size(body)
        self._ignored(endpoint, body)
        if endpoint == "messages":
            body.setdefault("max_tokens", 1)  # count_tokens takes no max_tokens; the conversion wants one
        for key in (*VLLM_FIELDS, CACHE_SALT):
            body.pop(key, None)
        conv, _ = self._recipe_convert(PROTOCOLS[endpoint][0], body)
        return self._encode(conv, body)[0]

    def _encode(self, conv, body: dict) -> tuple[list[int], list]:
        """The prompt's token ids with every image placeholder expanded into its span, and the images."""
        try:
            prompt_ids = list(self.encoding.encode(conv.conversation))
        except RuntimeError as exc:
            raise bad_request(f"the prompt could not be encoded: {_first_line(exc)}") from None
        return expand_images(self.images, prompt_ids, conv.conversation, body)

    def _vllm_sampling(self, body: dict) -> dict:
        """vLLM's extra sampling fields -> SamplingParams fields (range-checked there)."""
        out = {k: body[k] for k in VLLM_SAMPLING if body.get(k) is not None}
        if out.get("top_k") == 0:  # vLLM: 0 also means off
            out["top_k"] = -1
        if "stop_token_ids" in out and isinstance(out["stop_token_ids"], list) and not out["stop_token_ids"]:
            del out["stop_token_ids"]
        bias = body.get("logit_bias")
        if bias:
            out["logit_bias"] = self._logit_bias(bias)
        return out

    def _logit_bias(self, bias) -> dict[int, float]:
        """OpenAI's {"token id": bias} (string keys in JSON) -> {int: float}; the range is SamplingParams'."""
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        allowed = f"an object of token ids in [0, {vocab}) to biases in [-100, 100]"
        if not isinstance(bias, dict):
            raise bad_request(f"logit_bias={str(bias)[:60]!r} is invalid; allowed: {allowed}", "logit_bias")
        out = {}
        for key, value in bias.items():
            try:
                tok = int(key)
            except (TypeError, ValueError):
                tok = -1
            if not 0 <= tok < vocab or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad_request(f"logit_bias[{str(key)[:20]!r}]={str(value)[:20]} is invalid; allowed: {allowed}",
                                  "logit_bias")
            out[tok] = float(value)
        return out

    def _guided(self, body: dict) -> tuple[str, dict] | None:
        """vLLM's structured outputs (`structured_outputs` or the older `guided_*` fields) -> (field, so_args)."""
        found = []
        so = body.get("structured_outputs")
        if so is not None:
            if not isinstance(so, dict):
                raise bad_request("structured_outputs must be an object with one of json, regex, choice, grammar, "
                                  "json_object", "structured_outputs")
            for key in ("json", "regex", "choice", "grammar", "json_object"):
                if so.get(key) not in (None, False):
                    found.append((f"structured_outputs.{key}", key, so[key]))
            for key in ("structural_tag",):
                if so.get(key) is not None:
                    raise bad_request(f"structured_outputs.{key} is not supported; allowed: json, regex, choice, "
                                      "grammar, json_object", "structured_outputs")
        for key in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if body.get(key) is not None:
                found.append((key, key[len("guided_"):], body[key]))
        if not found:
            return None
        if len(found) > 1:
            raise bad_request(f"only one structured output may be given; got {', '.join(f[0] for f in found)}",
                              found[1][0])
        name, kind, value = found[0]
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise bad_request(f"{name} is not a JSON schema ({exc.msg})", name) from None
            if not isinstance(value, (dict, bool)):
                raise bad_request(f"{name} must be a JSON schema (an object)", name)
            so = {"schema_type": "json", "schema": json.dumps(value)}
            self.check_schema(name, so)
            return name, so
        if kind == "json_object":
            import xgrammar as xgr

            return name, {"schema_type": "ebnf", "schema": str(xgr.Grammar.builtin_json_grammar())}
        if kind == "regex":
            if not isinstance(value, str):
                raise bad_request(f"{name} must be a string (a regular expression)", name)
            self.check_schema(name, {"schema_type": "regex", "schema": value})
            return name, {"schema_type": "regex", "schema": value}
        if kind == "grammar":
            if not isinstance(value, str):
                raise bad_request(f"{name} must be a string (an EBNF grammar)", name)
            self.check_schema(name, {"schema_type": "ebnf", "schema": value})
            return name, {"schema_type": "ebnf", "schema": value}
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise bad_request(f"{name} must be a non-empty list of strings", name)
        self.check_schema(name, {"schema_type": "json", "schema": value})  # the choices count as an enum's values
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        return name, {"schema_type": "ebnf", "schema": f"root ::= {alternatives}"}

    # ---- Chat Completions, Responses, Messages --------------------------------------------------------------
    def convert(self, endpoint: str, body: dict) -> Prepared:
        req_cls, resp_cls, prefix = PROTOCOLS[endpoint]
        body = dict(body)
        model = self.check_model(body)
        body["model"] = model
        self.check_prompt_size(body)
        self._check_output_schemas(body)
        ignored = self._ignored(endpoint, body)
        salt = _cache_salt(body.pop(CACHE_SALT, None))
        n, extras, guided = 1, {}, None
        if endpoint == "chat":
            n = _count(body.pop("n", None), "n")
            if body.get("max_completion_tokens") is not None:  # OpenAI's current name wins (vLLM's rule)
                body["max_tokens"] = body["max_completion_tokens"]
            body.pop("max_completion_tokens", None)
            extras = self._vllm_sampling(body)
            guided = self._guided(body)
            if guided is not None and body.get("response_format") not in (None, {"type": "text"}):
                raise bad_request(f"{guided[0]} and response_format cannot both be given", guided[0])
        elif endpoint == "messages":
            if body.get("max_tokens") is None:  # required by Anthropic's API (it never runs to the context)
                raise bad_request("max_tokens is required on /v1/messages; allowed: an integer >= 1", "max_tokens")
            if body.get("top_k") is not None:  # Anthropic's own field
                extras = {"top_k": body["top_k"]}
        for key in VLLM_FIELDS:
            body.pop(key, None)  # read above; the recipe never sees them (it ignores what it does not define)
        conv, relaxed_tools = self._recipe_convert(req_cls, body)
        io = conv.inference_options
        prompt_ids, images = self._encode(conv, body)
        thinking = conv.conversation.thinking_mode
        constraint = io.output_constraint
        parsing = conv.parsing_options  # a copy: changing it changes this request's parser only
        if relaxed_tools and constraint is None and body.get("tool_choice") != "none":
            # strict tools the recipe's strict check refused: their grammar, as the recipe would have asked for it
            kind = "tool_call_required" if parsing.starts_in_tool_calls else "tool_call"
            constraint = _Constraint(kind, json.dumps(relaxed_tools))
        if endpoint == "messages" and _tool_choice_any(body) and constraint is not None:
            constraint = self._force_tool_call(constraint, thinking, prompt_ids, parsing)
        try:
            max_tokens = conv.resolve_max_tokens(len(prompt_ids), self.max_model_len)
        except dr.ConversionError as exc:
            raise from_conversion(exc) from None
        if constraint is not None and constraint.schema:  # before a strict tools' grammar is built from it
            output_field = {"chat": "response_format", "responses": "text.format"}.get(endpoint, "output_config")
            named = output_field if constraint.kind in ("json", "regex") else "tools"
            self.check_schema(named, {"schema_type": "regex" if constraint.kind == "regex" else "json",
                                      "schema": constraint.schema})
        try:
            so_args = so_args_for(constraint, thinking, self.ids)
            if guided is not None:
                so_args = after_thinking(guided[1], thinking, self.ids)
        except ConstraintError as exc:
            raise bad_request(str(exc), "response_format") from None
        params = _params(
            temperature=io.temperature, top_p=io.top_p, max_tokens=max_tokens, seq_seed=io.seed, so_args=so_args,
            n=n, top_logprobs=(io.top_logprobs or 0) if io.logprobs else 0,
            **{k: body[k] for k in PENALTIES if endpoint == "chat" and body.get(k) is not None}, **extras,
        )
        rid = f"{prefix}{uuid.uuid4().hex}"
        created = int(time.time())
        token_logprobs = bool(io.logprobs)

        def new_sample():
            tokenizer = self.dr_tokenizer if token_logprobs else None
            processor = dr.StreamProcessor(req_cls.chunk_generator(conv, rid, model), parsing,
                                           tokenizer)
            return processor, resp_cls(rid, model, created, len(prompt_ids), 0)

        return Prepared(endpoint, rid, model, created, [Job(prompt_ids, params, images=images, cache_salt=salt)],
                        bool(conv.stream),
                        new_sample, resp_cls, token_logprobs=token_logprobs, include_usage=_include_usage(body), n=n,
                        ignored=ignored)

    def _force_tool_call(self, constraint, thinking: bool, prompt_ids: list[int], parsing):
        """Anthropic's tool_choice {"type": "any"}: one of the tools must be called. deepseek_recipe renders it as
        `auto`; here it becomes what its {"type": "tool"} is for one tool, over all of them: the prompt opens the
        tool-call block (appended to prompt_ids), the grammar starts at once, the parser starts inside the block."""
        if thinking:  # Anthropic's own rule: with extended thinking only auto and none
            raise bad_request("tool_choice {'type': 'any'} cannot be used with thinking enabled; allowed: thinking "
                              "disabled, or tool_choice auto or none", "tool_choice")
        prompt_ids += self.ids.calls_opener
        parsing.starts_in_tool_calls = True
        return _Constraint("tool_call_required", constraint.schema)

    def _recipe_convert(self, req_cls, body: dict):
        """(the recipe's conversion, the function tools when strict tools were relaxed, else None). A strict
        json_schema or strict tool whose schema the recipe's strict-mode check refuses (a valid schema without a
        `type` such as enum or const, a top-level array, optional properties) is converted again with strict off,
        and the schema goes to the engine as given: the grammar compiler is the one judge of a schema."""
        try:
            return req_cls(body).convert(self.options), None
        except dr.ConversionError as exc:
            relaxed = _without_strict(body)
            if relaxed is None:
                raise from_conversion(exc) from None
            try:
                return req_cls(relaxed[0]).convert(self.options), relaxed[1]
            except (dr.ConversionError, ValueError, TypeError, OverflowError, RecursionError):
                raise from_conversion(exc) from None
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # the body does not deserialize
            # into the request (OverflowError: an integer past the JSON number range; RecursionError: nested
            # beyond the recipe's depth, which serving/body.py refuses first)
            raise bad_request(_first_line(exc)) from None

    # ---- legacy Completions ---------------------------------------------------------------------------------
    def convert_completion(self, body: dict) -> Prepared:
        model = self.check_model(body)
        self.check_prompt_size(body)
        ignored = self._ignored("completions", body)
        salt = _cache_salt(body.get(CACHE_SALT))
        n = _count(body.get("n"), "n")
        best_of = _count(body.get("best_of"), "best_of") if body.get("best_of") is not None else n
        if best_of < n:
            raise bad_request(f"best_of={best_of} must be >= n={n}", "best_of")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad_request(f"stream={stream!r} is invalid; allowed: true or false", "stream")
        if stream and best_of > n:
            raise bad_request("best_of > n cannot stream (the best samples are known only at the end)", "best_of")
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise bad_request(f"echo={echo!r} is invalid; allowed: true or false", "echo")
        logprobs = body.get("logprobs")
        if logprobs is True:  # a common client spelling of logprobs=0
            logprobs = 0
        if logprobs is not None and (type(logprobs) is not int or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS):
            raise bad_request(f"logprobs={logprobs!r} is invalid; allowed: null or an integer in "
                              f"[0, {MAX_COMPLETION_LOGPROBS}]", "logprobs")
        prompts = self._completion_prompts(body.get("prompt"))
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise bad_request(f"stop={stop!r} is invalid; allowed: a string or a list of non-empty strings", "stop")
        temperature = body.get("temperature", 1.0)
        if temperature is None:
            temperature = 1.0
        if isinstance(temperature, (int, float)) and not 0 <= temperature <= 2:  # OpenAI's range for this API
            raise bad_request(f"temperature={temperature!r} is out of range; allowed: [0, 2]", "temperature")
        seed = body.get("seed")
        if seed is not None and (type(seed) is not int or seed < 0):
            raise bad_request(f"seed={seed!r} is invalid; allowed: an integer >= 0", "seed")
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        zero = max_tokens == 0 and type(max_tokens) is int
        guided = self._guided(body)
        top_p = body.get("top_p")
        fields = dict(
            temperature=temperature, top_p=1.0 if top_p is None else top_p, max_tokens=1 if zero else max_tokens,
            seq_seed=seed, stop=stop or None, n=best_of, top_logprobs=logprobs or 0,
            prompt_logprobs=bool(echo and logprobs is not None), so_args=guided[1] if guided else None,
            **{k: body[k] for k in PENALTIES if body.get(k) is not None}, **self._vllm_sampling(body),
        )
        _params(**fields)  # the values' own checks first (one-line 400 naming the field)
        jobs = []
        for text, ids in prompts:
            if len(ids) + fields["max_tokens"] > self.max_model_len:
                raise bad_request(f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) is past the "
                                  f"context (max_model_len={self.max_model_len})", "max_tokens")
            jobs.append(Job(ids, _params(**fields), text, cache_salt=salt))
        return Prepared("completions", f"cmpl-{uuid.uuid4().hex}", model, int(time.time()), jobs, stream,
                        include_usage=_include_usage(body), n=n, best_of=best_of,
                        echo=echo, logprobs=logprobs, zero_tokens=zero, ignored=ignored)

    def _completion_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) per prompt: a string, a list of token ids, or a list of either (one choice set each)."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise bad_request(f"prompt={str(prompt)[:60]!r} is invalid; allowed: a non-empty string, a list of token "
                              "ids, or a list of either", "prompt")
        out = []
        for i, p in enumerate(prompt):
            if isinstance(p, str) and p:
                out.append((p, self.tokenizer.encode(p).ids))
            elif isinstance(p, list) and p and all(type(t) is int and t >= 0 for t in p):
                out.append((None, list(p)))
            else:
                raise bad_request(f"prompt[{i}]={str(p)[:60]!r} is invalid; allowed: a non-empty string or a "
                                  "non-empty list of token ids", "prompt")
        return out


@dataclass
class _Constraint:  # the shape of deepseek_recipe's OutputConstraint
    kind: str
    schema: str


def _tool_choice_any(body: dict) -> bool:
    choice = body.get("tool_choice")
    return isinstance(choice, dict) and choice.get("type") == "any"


def _include_usage(body: dict) -> bool:
    """OpenAI's stream_options.include_usage (a stream_options that is not an object is ignored)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _cache_salt(value) -> str | None:
    error = cache_salt_error(value)
    if error is not None:
        raise bad_request(error, CACHE_SALT)
    return value


def _count(value, name: str) -> int:
    if value is None:
        return 1
    if type(value) is not int or not 1 <= value <= MAX_N:
        raise bad_request(f"{name}={value!r} is invalid; allowed: an integer in [1, {MAX_N}]", name)
    return value


def _without_strict(body: dict) -> tuple[dict, list[dict] | None] | None:
    """The body with `strict` off in its json_schema response format and its tools, and (when a tool was strict)
    the function tools in Chat Completions form for the tool-call grammar; None when nothing was strict."""
    out, changed, tools_out = dict(body), False, None
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("json_schema"), dict):
        js = fmt["json_schema"]
        if js.get("strict"):
            out["response_format"], changed = {**fmt, "json_schema": {**js, "strict": False}}, True
    text = body.get("text")  # Responses: text.format
    if isinstance(text, dict) and isinstance(text.get("format"), dict) and text["format"].get("strict"):
        out["text"], changed = {**text, "format": {**text["format"], "strict": False}}, True
    tools = body.get("tools")
    if isinstance(tools, list) and any(isinstance(t, dict) and (t.get("function") or t).get("strict")
                                       for t in tools if isinstance(t, dict) and isinstance(t.get("function", t), dict)):
        new_tools, tools_out = [], []
        for t in tools:
            fn = t.get("function", t) if isinstance(t, dict) else None
            if not isinstance(fn, dict) or (t.get("type") not in (None, "function")):
                new_tools.append(t)
                continue
            tools_out.append({"type": "function", "function": {"name": fn.get("name"), "description":
                              fn.get("description"), "parameters": fn.get("parameters") or {}, "strict": True}})
            relaxed = {**fn, "strict": False}
            new_tools.append({**t, "function": relaxed} if "function" in t else relaxed)
        out["tools"], changed = new_tools, True
    return (out, tools_out) if changed else None


def _params(**fields) -> SamplingParams:
    """SamplingParams' own checks decide (one-line message naming the field and its range)."""
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as exc:
        raise bad_request(_first_line(exc)) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
