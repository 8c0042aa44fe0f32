"""What a decode returns, shared by the engines and the runs over them: one request's result (`RequestOutput`),
what `Engine.modify` did (`ModifyReport`), and the answer part of a generation (`answer_text`).

A leaf module (standard library only): `tdutils.runs` reads outputs without importing the engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """One request's result.

    Attributes:
        request_id: index of the prompt in the `prefill` call.
        prompt_tokens: prompt length T before modification.
        cached_tokens: KV length after modification (k; equals T for the baseline).
        output_ids: generated token ids (length `max_tokens` with `ignore_eos=True`).
        text: decoded `output_ids` (with `ignore_eos=True`, including what follows an EOS token).
        answer: the text up to (excluding) the first EOS token in `output_ids`; equals `text` when no EOS was
            generated. What scorers read: text a model writes after its EOS is not part of its answer.
        finish_reason: "length" or "stop" (an EOS token was generated).
        ttft_s: time to first token from the start of prefill, seconds.
        tpot_s: mean seconds per output token after the first.
        logits: optional list of fp32 tensors [vocab], one per generated token (`keep_logits=True`).
        compressions: with decode-time compression (`hf` engine, `decode(compression=...)`), one dict per cut:
            `step` (tokens generated when it happened), `before` / `after` (cache entries), `kept` (the kept
            entries' indices in the request's sequence: its cache at decode start, then its generated tokens);
            None without compression.
    """

    request_id: int
    prompt_tokens: int
    cached_tokens: int
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    answer: str | None = None
    finish_reason: str = "length"
    ttft_s: float = float("nan")
    tpot_s: float = float("nan")
    logits: list | None = None
    compressions: list | None = None

    def __post_init__(self):
        if self.answer is None:
            self.answer = self.text


def answer_text(tokenizer, output_ids: list[int], eos_ids, text: str) -> str:
    """The answer part of a generation: `output_ids` decoded up to (excluding) the first id in `eos_ids`;
    `text` itself when none of them was generated (so an engine's own detokenization is kept)."""
    for i, t in enumerate(output_ids):
        if t in eos_ids:
            return tokenizer.decode(output_ids[:i], skip_special_tokens=True)
    return text


@dataclass
class ModifyReport:
    """What `modify` did: per-request failures as `(request_id, message)`; edited count."""

    edited: int = 0
    failures: list[tuple[int, str]] = field(default_factory=list)
