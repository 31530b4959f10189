"""Structural limits on a structured-output schema, checked before anything parses, pickles or compiles it.

Why: a schema nested a few thousand levels deep makes every recursive walker (json.loads, pickle, json.dumps, the
JSON-schema shim) raise RecursionError, which used to escape `generate()` and lose the whole call. The depth is
therefore measured iteratively (no recursion) and, for schema text, by scanning brackets outside JSON strings,
so the check itself can never recurse. The size limits are the engine's (`GrammarCompilerPool.max_schema_bytes`
and `max_schema_values`): compile time and memory grow with the schema's bytes and, faster, with its number of
values (a 100,000-value enum of short strings fits in 1 MiB), and only the engine knows its budget; the server
checks the same limits first, to name the request's field.
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


def schema_values(schema) -> int:
    """JSON values in a JSON schema (dict, or its text): every object, array, string, number, bool and null
    counts one, keys do not; so an enum of n values counts n + 1. Text that is not JSON counts 0 (the compiler
    reports it). Call only after depth_error is None (the parse then cannot recurse too deep)."""
    if isinstance(schema, str):
        import json

        try:
            schema = json.loads(schema)
        except ValueError:
            return 0
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        count += 1
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count


def limits_error(so_args: dict, max_bytes: int, max_values: int) -> tuple[int, str | None]:
    """(the schema's bytes, why it is too large to compile or None) for checked so_args: its bytes against
    max_bytes, then (JSON schemas) its values against max_values."""
    schema = so_args["schema"]
    size = schema_size(schema)
    if size > max_bytes:
        return size, f"is {size} bytes; allowed: at most {max_bytes} bytes"
    if so_args["schema_type"] == "json":
        values = schema_values(schema)
        if values > max_values:
            return size, (f"has {values} values (each enum value, property schema and keyword value counts one); "
                          f"allowed: at most {max_values}")
    return size, None
