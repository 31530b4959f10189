"""What the trained model is measured by: held-out loss vs a unigram baseline, greedy completions by the inference
engine on the exported checkpoint, and the syntactic plausibility of completed function headers.

Plausibility (issue 15's target measure), for one held-out function header completed greedily by the engine:
  1. text = header + "\\n" + completion (the engine stops at EOS); if it stopped at max_tokens, the last
     (unfinished) line is dropped — a cut is the budget's fault, not the model's;
  2. the completion must leave at least one non-blank line after the header (an empty body is not plausible);
  3. open blocks are closed: an unterminated triple-quoted string (an odd count of triple double or single
     quotes) gets its closing quotes, brackets still open at the end are closed in reverse order (found with Python's own
     tokenizer), and a last line that opens a block (ends with ":") gets an indented `pass`;
  4. plausible iff `ast.parse` accepts the result. No other line is dropped to make it parse.
"""

from __future__ import annotations

import ast
import io
import math
import textwrap
import tokenize

import torch

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]
_CLOSE = {"(": ")", "[": "]", "{": "}"}


@torch.no_grad()
def heldout_loss(model, inputs: torch.Tensor, targets: torch.Tensor, batch: int, device) -> float:
    """Mean cross-entropy (nats per token) of the training forward over the held-out windows."""
    total, count = 0.0, 0
    for a in range(0, len(inputs), batch):
        logits = model(inputs[a: a + batch].to(device)).logits
        y = targets[a: a + batch].to(device)
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return total / count


def unigram_loss(train_stream: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy of the training stream's token frequencies (add-one smoothed) on the same held-out targets."""
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[targets.flatten()].mean())


def function_headers(files: list[tuple[str, str]], n: int) -> list[str]:
    """n one-line `def ...:` headers from the held-out files (dedented), evenly spaced over all of them in
    (path, line) order: deterministic and spread over many files."""
    found = []
    for _, text in files:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                line = lines[node.lineno - 1].strip()
                if line.startswith(("def ", "async def ")) and line.endswith(":") and node.body[0].lineno > node.lineno:
                    found.append((node.lineno, line))
    if not found or n <= 0:
        return []
    step = len(found) / min(n, len(found))
    return [found[int(i * step)][1] for i in range(min(n, len(found)))]


def plausible(header: str, completion: str, stopped_by_length: bool) -> bool:
    text = header + "\n" + completion
    if stopped_by_length and "\n" in completion:
        text = text[: text.rfind("\n")]
    elif stopped_by_length:
        return False  # not one complete line of body
    body = text.split("\n")[1:]
    if not any(line.strip() for line in body):
        return False
    return _parses(_close_blocks(text))


def _close_blocks(text: str) -> str:
    for quotes in ('"""', "'''"):
        if text.count(quotes) % 2:
            text += quotes
    stack = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text + "\n").readline):
            if tok.type == tokenize.OP and tok.string in _CLOSE:
                stack.append(tok.string)
            elif tok.type == tokenize.OP and tok.string in _CLOSE.values() and stack:
                stack.pop()
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    out = text.rstrip() + "".join(_CLOSE[b] for b in reversed(stack))
    last = out.split("\n")[-1]
    if last.rstrip().endswith(":"):
        indent = len(last) - len(last.lstrip())
        out += "\n" + " " * (indent + 4) + "pass"
    return out + "\n"


def _parses(text: str) -> bool:
    try:
        ast.parse(textwrap.dedent(text))
        return True
    except (SyntaxError, ValueError):
        return False


def generate(model_dir, prompts: list[str], max_tokens: int) -> list[tuple[str, str]]:
    """Greedy completions by the inference engine on the exported checkpoint: (text, finish_reason) per prompt."""
    from deepinfer import LLM, SamplingParams

    with LLM(model=str(model_dir), hardware="cpu", process="inproc") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [(o.text, o.finish_reason) for o in outs]


def plausibility(model_dir, headers: list[str], max_tokens: int = 64) -> tuple[float, list[tuple[str, str]]]:
    """Fraction of held-out function headers whose greedy completion is plausible Python (module docstring)."""
    if not headers:
        return math.nan, []
    outs = generate(model_dir, [h + "\n" for h in headers], max_tokens)
    ok = [plausible(h, text, reason == "length") for h, (text, reason) in zip(headers, outs)]
    return sum(ok) / len(ok), [(h, t) for h, (t, _) in zip(headers, outs)]
