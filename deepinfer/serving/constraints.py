"""deepseek_recipe's OutputConstraint -> the engine's structured output (SamplingParams.so_args).

  json                  response_format json_schema (the schema) or json_object (schema "": any JSON value)
  regex                 response_format regex
  tool_call             strict tools, tool_choice auto: free text until the model opens a DSML tool-call block,
                        then the block is held to the tools' schemas (trigger `｜DSML｜ calls>\\n`, bound on DSML)
  tool_call_required    strict tools, tool_choice required: the prompt opened the block; the grammar starts at once
In thinking mode an answer constraint (json, regex) starts after `</think>`: its token is both the trigger and the
bound, so the reasoning is free and, once `</think>` is sampled, the grammar takes over.
"""

from __future__ import annotations

import json

from deepinfer.serving.tool_grammar import DSML, tool_calls_grammar

THINK_END = "</think>"


class SpecialIds:
    """Token ids the constraints need, read from the served tokenizer (None where it lacks the token)."""

    def __init__(self, tokenizer):
        self.think_end = tokenizer.token_to_id(THINK_END)
        self.dsml = tokenizer.token_to_id(DSML)
        # what follows the DSML token when the model opens a call block (plain text, encoded without specials)
        self.calls_tail = tokenizer.encode(" calls>\n", add_special_tokens=False).ids
        # how the prompt opens the block for a required tool call (deepseek_recipe's rendering of it)
        self.calls_opener = tokenizer.encode(f"\n\n<{DSML} calls>\n", add_special_tokens=False).ids


class ConstraintError(ValueError):
    """The request asks for a constraint this model's tokenizer cannot support (a 400)."""


def so_args_for(constraint, thinking: bool, ids: SpecialIds) -> dict | None:
    if constraint is None:
        return None
    kind, schema = constraint.kind, constraint.schema
    if kind == "json":
        if schema:
            so = {"schema_type": "json", "schema": schema}
        else:  # json_object: any JSON value
            import xgrammar as xgr

            so = {"schema_type": "ebnf", "schema": str(xgr.Grammar.builtin_json_grammar())}
        return after_thinking(so, thinking, ids)
    if kind == "regex":
        return after_thinking({"schema_type": "regex", "schema": schema}, thinking, ids)
    if kind in ("tool_call", "tool_call_required"):
        so = {"schema_type": "ebnf", "schema": tool_calls_grammar(json.loads(schema))}
        if kind == "tool_call":
            if ids.dsml is None:
                raise ConstraintError(f"strict tools need the tokenizer's {DSML!r} token; this model has none")
            so["trigger_token_ids"] = [ids.dsml, *ids.calls_tail]
            so["bound_token_id"] = ids.dsml
        return so
    raise ConstraintError(f"output constraint kind {kind!r} is not supported; allowed: json, regex, tool_call, "
                          "tool_call_required")


def after_thinking(so: dict, thinking: bool, ids: SpecialIds) -> dict:
    if not thinking:
        return so
    if ids.think_end is None:
        raise ConstraintError(f"a response_format in thinking mode needs the tokenizer's {THINK_END!r} token")
    return {**so, "trigger_token_ids": [ids.think_end], "bound_token_id": ids.think_end}
