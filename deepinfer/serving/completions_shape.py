"""Legacy /v1/completions objects (OpenAI's `text_completion`) from the engine's stream outputs.

Choice i of a request is sample i % n of prompt i // n (the order lm-eval and the OpenAI SDK read). `logprobs`
follows OpenAI's legacy shape: tokens, token_logprobs, top_logprobs (token -> logprob, the chosen token and the
`logprobs` most likely ones) and text_offset (characters into the choice's text). With `echo` the prompt opens
the text, and with logprobs its tokens open the lists (the first prompt token has no logprob: null). A final stop
token (EOS, a stop_token_id) is neither text nor a logprob entry; usage counts it. max_tokens=0 shows no generated
token (the engine still computes one: it is how the prompt's logprobs are produced).
"""

from __future__ import annotations


def _mean_logprob(choice: "Choice") -> float:
    lps = [lp for lp in choice.gen_logprobs if lp is not None]
    return sum(lps) / len(lps) if lps else float("-inf")


class Choice:
    """One returned (or best_of candidate) choice: one engine request."""

    def __init__(self, shaper: "CompletionShaper", run, job):
        self.s, self.run, self.job = shaper, run, job
        self.index = 0
        self.text: list[str] = []
        self.offset = 0  # text_offset of the next listed token
        self.finish_reason: str | None = None
        self.lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.gen_logprobs: list[float | None] = []
        self.echoed = not shaper.p.echo

    def feed(self, upd) -> dict | None:
        """Folds one stream output in; the streamed choice object for it (None when it carries nothing)."""
        p, s = self.s.p, self.s
        text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if not self.echoed:
            self.echoed = True
            prompt_text = self.job.prompt_text
            if prompt_text is None:
                prompt_text = s.decode(self.job.prompt_ids)
            if p.logprobs is not None:
                entries = upd.prompt_logprobs or []
                for i, tok in enumerate(self.job.prompt_ids):
                    e = entries[i] if i < len(entries) else None
                    piece = s.decode([tok])
                    top = None if e is None else s.top(tok, e.logprob, e.top_logprobs)
                    self._entry(lp, piece, None if e is None else e.logprob, top, self.offset)
                    self.offset += len(piece)
            text += prompt_text
            self.offset = len(prompt_text)
        ids, lps = list(upd.token_ids), list(upd.logprobs or [None] * len(upd.token_ids))
        done = upd.finish_reason is not None
        if done and upd.finish_reason == "stop" and ids and self.run.is_stop_token(ids[-1]):
            ids, lps = ids[:-1], lps[:-1]
        new_text = upd.text
        if p.zero_tokens:
            ids, lps, new_text = [], [], ""
        for tok, e in zip(ids, lps):
            chosen = None if e is None else e[0]
            self.gen_logprobs.append(chosen)
            if p.logprobs is not None:
                piece = s.decode([tok])
                self._entry(lp, piece, chosen, s.top(tok, chosen, None if e is None else e[1]), self.offset)
                self.offset += len(piece)
        text += new_text
        if done:
            self.finish_reason = "length" if p.zero_tokens else _FINISH.get(upd.finish_reason, "stop")
        self.text.append(text)
        for key in self.lp:
            self.lp[key] += lp[key]
        if not text and not done and not lp["tokens"]:
            return None
        return self._object(text, lp if p.logprobs is not None else None, self.finish_reason)

    @staticmethod
    def _entry(lp, piece, logprob, top, offset) -> None:
        lp["tokens"].append(piece)
        lp["token_logprobs"].append(logprob)
        lp["top_logprobs"].append(top)
        lp["text_offset"].append(offset)

    def _object(self, text: str, logprobs, finish) -> dict:
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def final(self) -> dict:
        return self._object("".join(self.text), self.lp if self.s.p.logprobs is not None else None,
                            self.finish_reason or "stop")


_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


class CompletionShaper:
    """choices: one per engine request, in request order (prompt-major, then sample)."""

    def __init__(self, prepared, runs, tokenizer):
        self.p = prepared
        self.tokenizer = tokenizer
        self._pieces: dict[int, str] = {}
        self.choices: list[Choice] = []
        for run, job in runs:
            self.choices.append(Choice(self, run, job))
        for i, c in enumerate(self.choices):
            c.index = i  # streaming (best_of == n): the final indices

    def decode(self, ids: list[int]) -> str:
        if len(ids) == 1:
            tok = ids[0]
            piece = self._pieces.get(tok)
            if piece is None:
                piece = self._pieces[tok] = self.tokenizer.decode([tok], skip_special_tokens=False)
            return piece
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def top(self, token_id: int, logprob, alternatives) -> dict | None:
        """token -> logprob: the chosen token and the alternatives (OpenAI's legacy top_logprobs entry)."""
        if logprob is None and not alternatives:
            return None
        out = {}
        for tid, lp in alternatives or []:
            out.setdefault(self.decode([tid]), lp)
        if logprob is not None:
            out.setdefault(self.decode([token_id]), logprob)
        return out

    def usage(self) -> dict:
        n = sum(len(j.prompt_ids) for j in self.p.jobs)
        k = 0 if self.p.zero_tokens else sum(c.run.num_tokens for c in self.choices)
        cached = {}  # per prompt: its n samples each looked it up; report one lookup (the best)
        for c in self.choices:
            cached[id(c.job)] = max(cached.get(id(c.job), 0), c.run.num_cached_tokens)
        return {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}

    def envelope(self, choices: list[dict]) -> dict:
        return {"id": self.p.id, "object": "text_completion", "created": self.p.created, "model": self.p.model,
                "choices": choices, "usage": None}

    def chunk(self, i: int, upd) -> dict | None:
        """A streamed `text_completion` chunk for choice i's stream output (None when it carries nothing). OpenAI's
        include_usage: every chunk has `"usage": null` and usage_chunk() follows the last; without it, no usage."""
        choice = self.choices[i].feed(upd)
        if choice is None:
            return None
        out = self.envelope([choice])
        if not self.p.include_usage:
            del out["usage"]
        return out

    def usage_chunk(self) -> dict:
        """The chunk after the last (stream_options.include_usage): empty choices, the request's usage."""
        out = self.envelope([])
        out["usage"] = self.usage()
        return out

    def final(self) -> dict:
        """The whole response; with best_of > n, each prompt's n choices of highest mean token logprob."""
        n, best_of = self.p.n, self.p.best_of
        picked = []
        for start in range(0, len(self.choices), best_of):
            group = self.choices[start:start + best_of]
            if best_of > n:
                group = sorted(group, key=_mean_logprob, reverse=True)[:n]
            picked += group
        choices = []
        for i, c in enumerate(picked):
            c.index = i
            choices.append(c.final())
        out = self.envelope(choices)
        out["usage"] = self.usage()
        return out
