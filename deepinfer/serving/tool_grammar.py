"""EBNF (xgrammar) for DeepSeek-V4.1's DSML tool-call block, for strict tools.

deepseek_recipe's system prompt teaches the model this markup, and its stream parser turns it back into OpenAI /
Anthropic tool calls:

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

The grammar covers what follows the opening `<｜DSML｜ calls>\\n` (the prompt holds it for a required tool call; for
`auto` the engine's trigger waits for it). A string parameter is raw text without `<` (an enum: one of its values);
any other parameter is JSON following its schema (xgrammar's JSON-schema grammar, its rules renamed per
parameter). Inside a grammar special tokens are never allowed, so the markup is spelled in plain bytes; the parser
reads the text, which is the same either way.
"""

from __future__ import annotations

import json
import re

DSML = "｜DSML｜"
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= ", re.M)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def lit(text: str) -> str:
    """An EBNF string literal."""
    return json.dumps(text, ensure_ascii=False)


def tool_calls_grammar(tools: list[dict]) -> str:
    """tools: the OutputConstraint's schema, a list of Chat Completions function tools."""
    rules, invokes = [], []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        name = f"t{i}"
        invokes.append(name)
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        parts = []
        for j, (pname, pschema) in enumerate(props.items()):
            value, extra = _value_rule(f"t{i}p{j}", pschema if isinstance(pschema, dict) else {})
            rules += extra
            is_string = _is_string(pschema)
            head = f'<{DSML} parameter name="{pname}" string="{"true" if is_string else "false"}">'
            part = f"({lit(head)} {value} {lit(f'</{DSML} parameter>' + chr(10))})"
            parts.append(part if pname in required else f"{part}?")
        body = " ".join(parts) if parts else '""'
        rules.append(
            f"{name} ::= {lit(f'<{DSML} invoke name=' + json.dumps(fn['name']) + '>' + chr(10))} {body} "
            f"{lit(f'</{DSML} invoke>' + chr(10))}"
        )
    rules.insert(0, f"root ::= ({' | '.join(invokes)})+ {lit(f'</{DSML} calls>')}")
    return "\n".join(rules) + "\n"


def _is_string(schema) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string"


def _value_rule(prefix: str, schema: dict) -> tuple[str, list[str]]:
    """(expression for the parameter's value, extra rules)."""
    if _is_string(schema):
        if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
            return "(" + " | ".join(lit(v) for v in schema["enum"]) + ")", []
        return "[^<]*", []
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    return f"{prefix}_root", _prefixed(text, prefix)


def _prefixed(ebnf: str, prefix: str) -> list[str]:
    """The rules of a grammar with every rule name prefixed (string literals and character classes untouched)."""
    names = set(_RULE.findall(ebnf))
    out = []
    for line in ebnf.splitlines():
        if line.strip():
            out.append(_rename(line, names, prefix))
    return out


def _rename(line: str, names: set[str], prefix: str) -> str:
    result, i = [], 0
    while i < len(line):
        c = line[i]
        if c in "\"[":  # a literal or a class: copy to its unescaped end
            end = "\"" if c == "\"" else "]"
            j = i + 1
            while j < len(line) and line[j] != end:
                j += 2 if line[j] == "\\" else 1
            result.append(line[i : j + 1])
            i = j + 1
            continue
        m = _IDENT.match(line, i)
        if m:
            word = m.group()
            result.append(f"{prefix}_{word}" if word in names else word)
            i = m.end()
            continue
        result.append(c)
        i += 1
    return "".join(result)
