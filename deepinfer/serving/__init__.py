"""The online server: OpenAI- and Anthropic-compatible HTTP endpoints over the engine (`serve=openai`).

    app.py               FastAPI routes, admission (429/503), SSE and non-streaming responses
    server.py            builds the engine and serves with uvicorn until SIGTERM / Ctrl-C
    async_engine.py      the engine client behind asyncio: one pump thread, a queue per request
    convert.py           request bodies -> prompt ids + SamplingParams + a deepseek_recipe stream processor
    constraints.py       deepseek_recipe OutputConstraint -> SamplingParams.so_args (json, regex, strict tools)
    tool_grammar.py      EBNF of the DSML tool-call block for strict tools
    request_run.py       one request: engine updates -> text -> protocol chunks
    detokenize.py        incremental text with tokenizers' DecodeStream
    completions_shape.py legacy /v1/completions objects
    metrics.py           Prometheus metrics (/metrics)
    errors.py            one-line HTTP errors in the protocol's shape
"""


def serve(settings) -> None:
    from deepinfer.serving.server import serve as _serve

    _serve(settings)
