"""Long alternations of string literals in xgrammar's EBNF (a JSON schema's `enum`), factored into a trie of rules:
the same language with each shared prefix stored once.

Why: xgrammar compiles every alternative of `(("v0") | ("v1") | ...)` as a sequence of its own, one grammar state
per character, each with its token-mask cache. Compiled sizes, flat -> trie (embedded tokenizer, xgrammar 0.2.9):
the soak's grammar flood, 10,000 values "s127.0.0.2k0v<i>", 45.7 -> 0.9 MiB (1.2 s -> 0.06 s; +95 MB -> +15 MB of
RSS at the peak); 10,000 random 4-12-letter words 23.4 -> 10.2 MiB; 10,000 values "kv<i>" 0.83 -> 0.91 MiB. Where
the values share little (5,000 random 16-digit hex strings: the trie keeps 89% of the characters) the extra rules
cost more than they save (13.3 -> 14.5 MiB), so an alternation is replaced only when its trie keeps at most
MOST_KEPT of its characters, and a trie node gets a rule of its own only while it covers MIN_GROUP literals.

The rewrite works on the EBNF text xgrammar prints for the schema, so the literals keep xgrammar's own JSON
serialisation and escapes: a literal is cut only between printed characters or escape sequences (`\\"`, `\\xe9`,
`\\u2028`, `\\U0001f600`), never inside one, and the pieces are written back verbatim. A rule of any other shape,
or a literal with an escape this parser does not know, is left as it was.
"""

from __future__ import annotations

MIN_ALTERNATIVES = 64  # shorter alternations compile cheaply as they are
MIN_GROUP = 64  # literals a trie node must cover to become a rule of its own
MOST_KEPT = 0.85  # the share of an alternation's characters its trie may keep and still replace it
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}  # printed escapes with a code after the letter
_SINGLE = set("\"\\'?abfnrtv0e-]")  # one-letter escapes xgrammar's EBNF parser reads
_HEX = set("0123456789abcdefABCDEF")


def _literals(rhs: str) -> list[list[str]] | None:
    """`(("a") | ("b") | ...)` -> each literal as its printed units (a character or a whole escape); None for any
    other shape."""
    if not (rhs.startswith("((") and rhs.endswith("))")):
        return None
    body, i, out = rhs[1:-1], 0, []
    n = len(body)
    while True:
        if not body.startswith('("', i):
            return None
        i += 2
        units = []
        while i < n and body[i] != '"':
            if body[i] == "\\":
                if i + 1 >= n:
                    return None
                width = _HEX_DIGITS.get(body[i + 1], 0)
                unit = body[i:i + 2 + width]
                if len(unit) != 2 + width or not set(unit[2:]) <= _HEX or (width == 0 and unit[1] not in _SINGLE):
                    return None
            else:
                unit = body[i]
            units.append(unit)
            i += len(unit)
        if not body.startswith('")', i):
            return None
        i += 2
        out.append(units)
        if i == n:
            return out
        if not body.startswith(" | ", i):
            return None
        i += 3


def _trie_rules(name: str, literals: list[list[str]], taken: set[str],
                min_group: int = MIN_GROUP) -> tuple[list[tuple[str, str]], int]:
    """(rule name, body) of the trie over `literals`, `name`'s own first, and the units its literals hold. A node
    becomes a rule of its own only while it covers at least `min_group` literals; below, its literals' tails are
    written out as plain alternatives (xgrammar's per-rule cost outweighs the few characters a small group shares).
    Runs of single children become one literal; where a literal ends and others go on, an empty alternative.
    The trie is walked as ranges of the sorted literals (a node: the literals sharing its prefix), never built:
    node objects for 10,000 values of 20 unshared characters took ~45 MB of the core's heap, for a trie then
    discarded (MOST_KEPT). Iterative: a literal may be thousands of units long."""
    lits = sorted(set(map(tuple, literals)))
    rules: list[tuple[str, list[str]]] = []
    pending = [(name, 0, len(lits), 0)]  # (rule, first literal, end, depth): the node of lits[lo:hi]'s prefix
    kept = 0
    while pending:
        rule, lo, hi, depth = pending.pop()
        alternatives = []
        i = lo
        ends = i < hi and len(lits[i]) == depth  # a literal ending here sorts before those that go on
        if ends:
            i += 1
        while i < hi:
            unit = lits[i][depth]
            j = i + 1
            while j < hi and lits[j][depth] == unit:
                j += 1
            # the run: while every literal of lits[i:j] goes on, and with the same unit
            end = depth + 1
            while len(lits[i]) > end and all(len(lits[k]) > end and lits[k][end] == lits[i][end] for k in range(i, j)):
                end += 1
            run = list(lits[i][depth:end])
            goes_on = any(len(lits[k]) > end for k in range(i, j))
            if not goes_on or j - i < min_group:
                for k in range(i, j):
                    kept += len(lits[k]) - depth
                    alternatives.append('("' + "".join(lits[k][depth:]) + '")')
            else:
                kept += len(run)
                child, n = f"{name}_trie_{len(rules) + len(pending)}", 0
                while child in taken:
                    n += 1
                    child = f"{name}_trie_{len(rules) + len(pending)}_{n}"
                taken.add(child)
                alternatives.append('("' + "".join(run) + f'" {child})')
                pending.append((child, i, j, end))
            i = j
        if ends:
            alternatives.append('""')
        rules.append((rule, alternatives))
    return [(rule, "(" + " | ".join(alternatives) + ")") for rule, alternatives in rules], kept


def factor_literal_alternations(ebnf: str, min_alternatives: int = MIN_ALTERNATIVES) -> str | None:
    """`ebnf` (as xgrammar prints a Grammar) with every rule that is an alternation of at least `min_alternatives`
    plain literals, whose trie keeps at most MOST_KEPT of their characters, replaced by that trie; None when no
    rule is."""
    lines = ebnf.splitlines()
    taken = {line.partition(" ::= ")[0] for line in lines}
    out, added = [], []
    for line in lines:
        name, sep, rhs = line.partition(" ::= ")
        literals = _literals(rhs) if sep and rhs.count(") | (") + 1 >= min_alternatives else None
        if literals is None or len(literals) < min_alternatives:
            out.append(line)
            continue
        rules, kept = _trie_rules(name, literals, set(taken))
        if kept > MOST_KEPT * sum(len(units) for units in literals):
            out.append(line)
            continue
        taken.update(rule for rule, _ in rules)
        (_, body), *children = rules
        out.append(f"{name} ::= {body}")
        added += [f"{child} ::= {child_body}" for child, child_body in children]
    if out == lines:
        return None
    return "\n".join(out + added) + "\n"


def literal_units(ebnf: str) -> int:
    """Characters (printed units: a character or a whole escape) of every string literal in `ebnf`: about the grammar
    states xgrammar compiles for them, one a character, each with its token-mask cache, so about what the compiled
    grammar costs in memory (`GrammarCompilerPool.max_grammar_states`). Character classes (`[^"\\\\]`) are one
    element each and are skipped, quotes inside them included."""
    count, i, n = 0, 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c == "[":  # a character class: to its closing bracket, escapes skipped
            i += 1
            while i < n and ebnf[i] != "]":
                i += 2 if ebnf[i] == "\\" else 1
            i += 1
        elif c == '"':
            i += 1
            while i < n and ebnf[i] != '"':
                i += 2 + _HEX_DIGITS.get(ebnf[i + 1], 0) if ebnf[i] == "\\" and i + 1 < n else 1
                count += 1
            i += 1
        else:
            i += 1
    return count
