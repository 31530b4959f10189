"""The CLI's requests: read from input_path (JSON lines), prompts= or the built-in prompts, and generated in
order, a line whose sampling fields cannot apply getting an error output of its own."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from deepinfer.config.errors import ConfigError

BUILTIN_PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Config:\n    def __init__(self",
    "The quick brown fox",
)


def read_requests(settings) -> list[dict]:
    """[{"prompt": str} | {"prompt_token_ids": [...]}] from input_path, prompts= or the built-in prompts."""
    if settings.input_path is None:
        return [{"prompt": p} for p in (settings.prompts or BUILTIN_PROMPTS)]
    where = f"input_path={settings.input_path!r}"
    raw = Path(settings.input_path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{where} line {line}: not UTF-8 text (byte {exc.start}); allowed: UTF-8 JSON lines") from None
    requests = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            raise ConfigError(f"{where} line {n}: not JSON ({why})") from None
        if isinstance(item, str):
            item = {"prompt": item}
        error = _request_error(item)
        if error is not None:
            raise ConfigError(
                f"{where} line {n}: {error}; allowed: a string, "
                '{"prompt": "..."} or {"prompt_token_ids": [int, ...]}'
            )
        requests.append(item)
    if not requests:
        raise ConfigError(f"{where} has no requests; allowed: at least one line")
    return requests


def _request_error(item) -> str | None:
    if not isinstance(item, dict) or not ({"prompt", "prompt_token_ids"} & set(item)):
        return f"{type(item).__name__ if not isinstance(item, dict) else 'an object without prompt'} is not a request"
    if "prompt_token_ids" in item:
        ids = item["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
            return f"prompt_token_ids={json.dumps(ids)[:60]} is not a non-empty list of token ids >= 0"
    elif not isinstance(item["prompt"], str):
        return f"prompt={json.dumps(item['prompt'])[:60]} is not a string"
    return None


REQUEST_KEYS = ("prompt", "prompt_token_ids")


def request_params(llm, item: dict):
    """(SamplingParams, None) for one input line: the config's sampling section, then the line's own
    SamplingParams fields (any of them, so_args included); or (None, one-line error) for an unknown field or a
    bad value, which ends that line's request only."""
    from deepinfer.sampling.params import params_from_dict

    fields = {k: v for k, v in item.items() if k not in REQUEST_KEYS}
    if not fields:
        return llm.default_sampling_params(), None
    base = llm.default_sampling_params()
    return params_from_dict({**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, **fields})


def generate_requests(llm, requests: list[dict]) -> list:
    """One output per request, in order; a line whose settings cannot apply gets an error output of its own."""
    from deepinfer.outputs import error_output

    outputs: list = [None] * len(requests)
    run, params = [], []
    for i, item in enumerate(requests):
        sp, error = request_params(llm, item)
        if error is not None:
            ids = item.get("prompt_token_ids") or []
            outputs[i] = error_output(i, item.get("prompt"), ids, f"request {i}: {error}")
        else:
            run.append(i)
            params.append(sp)
    if run:
        # a progress bar over the requests on a terminal, none in logs
        done = llm.generate([{k: requests[i][k] for k in REQUEST_KEYS if k in requests[i]} for i in run], params,
                            use_tqdm=sys.stderr.isatty())
        for i, out in zip(run, done):
            outputs[i] = dataclasses.replace(out, request_id=i)  # request ids are input lines, failed ones too
    return outputs
