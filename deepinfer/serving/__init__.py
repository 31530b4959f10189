"""The online server: OpenAI- and Anthropic-compatible HTTP endpoints over the engine (`serve=openai`), through the
frontend's asyncio loop (deepinfer.frontend.AsyncEngine: validation, seeds, detokenization).

    app.py               FastAPI routes, admission (429/503), SSE and non-streaming responses
    server.py            binds the port, builds the engine and serves with uvicorn until SIGTERM / Ctrl-C
    lifecycle.py         the port bound before the model loads; the drain on SIGTERM (503, error events, [DONE])
    auth.py              serve.api_key / DEEPINFER_API_KEY: Bearer or x-api-key, 401 in the protocol's shape
    token_routes.py      /tokenize, /detokenize, /version (vLLM's), /v1/messages/count_tokens (Anthropic's)
    convert.py           request bodies -> prompt ids + SamplingParams + a deepseek_recipe stream processor
    constraints.py       deepseek_recipe OutputConstraint -> SamplingParams.so_args (json, regex, strict tools)
    tool_grammar.py      EBNF of the DSML tool-call block for strict tools
    request_run.py       one request: its stream's text (deepinfer.frontend.AsyncEngine) -> protocol chunks
    completions_shape.py legacy /v1/completions objects
    metrics.py           Prometheus metrics (/metrics)
    errors.py            one-line HTTP errors in the protocol's shape
"""


def serve(settings) -> None:
    from deepinfer.serving.server import serve as _serve

    _serve(settings)
