"""Works around an xgrammar 0.2.9 JSON-schema bug before compiling.

For a string with maxLength / minLength, xgrammar 0.2.9 emits the character class [^"\\\r\n] counted {min,max}:
it lets raw control characters (U+0000-U+001F other than CR/LF) into the string, which RFC 8259 forbids, so
json.loads rejects the output (newer xgrammar fixed it). Its regex path handles the same constraint correctly,
so such strings are rewritten as the equivalent pattern over the characters the buggy class meant to allow.
Escapes stay unavailable inside length-capped strings, exactly as in the original xgrammar rule.
"""

from __future__ import annotations

from typing import Any

_NOT_SCHEMAS = {"enum", "const", "default", "examples"}  # values there are data, never subschemas


def rewrite_length_capped_strings(schema: Any) -> Any:
    """A copy of the schema where every pattern-free, format-free string with a length cap uses a pattern."""
    if isinstance(schema, list):
        return [rewrite_length_capped_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _NOT_SCHEMAS else rewrite_length_capped_strings(v)) for k, v in schema.items()}
    capped = "maxLength" in out or "minLength" in out
    if out.get("type") == "string" and capped and "pattern" not in out and "format" not in out:
        low = int(out.pop("minLength", 0))
        high = out.pop("maxLength", None)
        count = f"{{{low},{'' if high is None else int(high)}}}"
        out["pattern"] = f'^[^\\x00-\\x1f"\\\\]{count}$'
    return out
