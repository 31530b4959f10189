"""Legacy /v1/completions objects from the Chat Completions chunks deepseek_recipe's processor emits for them
(convert.py: the processor only matches stop sequences there, so each chunk's delta content is plain text)."""

from __future__ import annotations

import json


class CompletionShaper:
    def __init__(self, prepared, num_generated):
        self.p = prepared
        self.num_generated = num_generated  # () -> tokens generated so far (the detokenizer's count)
        self.text: list[str] = []
        self.finish_reason: str | None = None

    def feed(self, chunk) -> dict | None:
        """A `text_completion` chunk for one processor chunk (None when it carries nothing)."""
        data = json.loads(chunk.to_json())
        choice = (data.get("choices") or [{}])[0]
        text = (choice.get("delta") or {}).get("content") or ""
        finish = choice.get("finish_reason")
        if finish:
            self.finish_reason = finish
        if not text and not finish:
            return None
        self.text.append(text)
        out = self._object(text, finish)
        if finish and self.p.include_usage:
            out["usage"] = self.usage()
        return out

    def usage(self) -> dict:
        n, k = len(self.p.prompt_ids), self.num_generated()
        return {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k}

    def final(self) -> dict:
        out = self._object("".join(self.text), self.finish_reason or "stop")
        out["usage"] = self.usage()
        return out

    def _object(self, text: str, finish: str | None) -> dict:
        return {"id": self.p.id, "object": "text_completion", "created": self.p.created, "model": self.p.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": None}
