"""Structural limits on a structured-output schema, checked before anything parses, pickles or compiles it.

Why: a schema nested a few thousand levels deep makes every recursive walker (json.loads, pickle, json.dumps, the
JSON-schema shim) raise RecursionError, which used to escape `generate()` and lose the whole call. The depth is
therefore measured iteratively (no recursion) and, for schema text, by scanning brackets outside JSON strings,
so the check itself can never recurse. The size limit (bytes of schema text) is the engine's
(`GrammarCompilerPool.max_schema_bytes`): compile time and memory grow with it, and only the engine knows its budget.
"""

from __future__ import annotations

MAX_SCHEMA_DEPTH = 128  # nested containers; a JSON object level is two (the schema dict and its "properties")


def schema_depth(schema, stop_after: int = MAX_SCHEMA_DEPTH) -> int:
    """Nesting depth of dicts/lists (a str is scanned as JSON text); stops counting past `stop_after`."""
    if isinstance(schema, str):
        return _text_depth(schema, stop_after)
    deepest, stack = 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if deepest > stop_after:
            return deepest
        stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _text_depth(text: str, stop_after: int) -> int:
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > stop_after:
                    return deepest
        elif ch in "}]":
            depth -= 1
    return deepest


def depth_error(schema) -> str | None:
    """Why this schema is too deep to take, or None."""
    depth = schema_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        return f"nested more than {MAX_SCHEMA_DEPTH} levels deep; allowed: at most {MAX_SCHEMA_DEPTH}"
    return None


def schema_size(schema) -> int:
    """Bytes of the schema's text (a dict is measured as compact JSON; call only after depth_error is None)."""
    import json

    text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
    return len(text.encode("utf-8", "surrogatepass"))
