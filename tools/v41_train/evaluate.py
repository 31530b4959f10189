"""What the trained model is measured by: held-out loss vs a unigram baseline, greedy completions by the inference
engine on the exported checkpoint, and the syntactic plausibility of completed function headers.

Plausibility (issue 15's target measure), for one held-out function header completed greedily by the engine:
  1. the prompt is the header itself (no newline: BPE joins a newline with the indentation after it, so a prompt
     ending in a bare newline is one the model never saw in training); text = header + completion (the engine
     stops at EOS); if it stopped at max_tokens, the last (unfinished) line is dropped — a cut is the budget's
     fault, not the model's;
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


@torch.no_grad()
def draft_heldout(drafter, backbone, inputs: torch.Tensor, batch: int, device, stride: int = 7) -> dict:
    """The draft layers on held-out windows, teacher-forced against the text: per block position the greedy hit
    rate, and the accepted length a greedy chain of k drafts would reach against the text (1 + the leading hits,
    at most k) for k = 1 .. block. With teacher forcing, a chain whose first drafts are right sees exactly the
    Markov inputs real drafting sees, so the leading hits are exact; only the reference differs from the engine's
    (the text, not the target model's own greedy continuation)."""
    cfg = drafter.cfg
    blk, targets = cfg.dspark_block_size, cfg.dspark_target_layer_ids
    w = backbone.weights()
    lead, hits = [], []
    for a in range(0, len(inputs), batch):
        x = inputs[a: a + batch].to(device)
        ids = torch.cat([x, x[:, -1:]], 1)  # anchors stop one block short of the end: the last column is unused
        T = x.shape[1]
        anchors = torch.arange(0, T - 2 - blk, stride, device=device).expand(len(x), -1)
        feats = backbone(x, features_at=targets).features
        out = drafter(ids, [feats[t] for t in targets], anchors, w["embed.weight"], w["head.weight"])
        hit = out.logits.argmax(-1) == out.targets
        hits.append(hit.float().mean(0))
        lead.append(hit.int().cumprod(-1).sum(-1))
    lead_t = torch.cat(lead).float()
    return {"hit_rate_by_position": [round(h, 4) for h in torch.stack(hits).mean(0).tolist()],
            "accepted_length_vs_text": {k: round(1 + float(lead_t.clamp(max=k).mean()), 3) for k in range(1, blk + 1)},
            "blocks": int(lead_t.numel())}


@torch.no_grad()
def draft_logits_vs_engine(drafter, backbone, out_dir, row: torch.Tensor, anchors=(20, 41)) -> dict:
    """The training drafter vs the engine's DSpark on the exported checkpoint (CPU, float32): the engine prefills
    row[: a + 1], then drafts the block after a with every choice forced to the text's token (what the training
    forward assumes); the largest |logit| and |confidence| differences, and the argmax agreement."""
    from deepinfer.models import ForwardBatch, load_model

    cfg = drafter.cfg
    blk, targets = cfg.dspark_block_size, cfg.dspark_target_layer_ids
    engine = load_model(out_dir)
    w = backbone.weights()
    ids = row[None]
    feats = backbone(ids, features_at=targets).features
    out = drafter(torch.cat([ids, ids[:, -1:]], 1), [feats[t] for t in targets], torch.tensor([list(anchors)]),
                  w["embed.weight"], w["head.weight"])
    conf_train = torch.sigmoid(out.confidence_logits)
    diffs, conf_diffs, agree = [], [], 0
    for n, a in enumerate(anchors):
        state = engine.new_state(blk + 1, drafts=True)
        engine.forward(ForwardBatch([row[: a + 1].tolist()], [state]))
        step = engine.drafter.step(torch.tensor([state.slot]), torch.tensor([a]), blk, state.pools)
        seen = []

        def choose(i, logits, a=a):
            seen.append(logits[0])
            return row[a + 2 + i: a + 3 + i]

        drafts = engine.drafter.draft(row[a + 1: a + 2], step, state.pools, choose)
        theirs = torch.stack(seen)
        diffs.append(float((out.logits[n] - theirs).abs().max()))
        conf_diffs.append(float((conf_train[n] - drafts.confidences[0]).abs().max()))
        agree += int((out.logits[n].argmax(-1) == theirs.argmax(-1)).sum())
    return {"max_abs_logit_diff": max(diffs), "max_abs_confidence_diff": max(conf_diffs),
            "argmax_agreement": agree / (len(anchors) * blk)}


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
    text = header + completion
    if stopped_by_length:
        text = text[: text.rfind("\n")]  # the header line itself has no newline: a cut inside it leaves no body
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
    outs = generate(model_dir, headers, max_tokens)
    ok = [plausible(h, text, reason == "length") for h, (text, reason) in zip(headers, outs)]
    return sum(ok) / len(ok), [(h, t) for h, (t, _) in zip(headers, outs)]
