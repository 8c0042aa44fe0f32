"""Chat templates: whether a prompt is wrapped in the tokenizer's own template, and the token ids it then has.

An instruction-tuned model (SmolLM2-135M-Instruct, Gemma 3 270M-it) answers a raw prompt poorly or not at all
(often EOS at once); wrapped as a user turn followed by the assistant header it answers. The engines apply it
to text prompts when opened with `chat_template="auto"` (when the tokenizer has one) or `"on"`; token-id
prompts are never changed (RULER's template rows arrive as ids, already wrapped or not).
"""

from __future__ import annotations

CHAT_TEMPLATES = ("auto", "on", "none")


def uses_chat_template(tokenizer, chat_template: str | bool = "auto") -> bool:
    """Whether prompts for `tokenizer` are wrapped in its chat template.

    "auto": when the tokenizer has a ``chat_template``; True / "on": always (ValueError if it has none);
    False / "none" / "off": never. Any other value raises ValueError."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(chat_template, bool):
        if chat_template and not has:
            raise ValueError("chat_template=True but the tokenizer has no chat template")
        return chat_template
    if chat_template == "auto":
        return has
    if chat_template == "on":
        if not has:
            raise ValueError("chat_template='on' but the tokenizer has no chat template")
        return True
    if chat_template in ("none", "off"):
        return False
    raise ValueError(f"chat_template must be 'auto', 'on', 'none', True or False, got {chat_template!r}")


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as one user turn in the tokenizer's chat template, with the assistant header after
    it (`add_generation_prompt=True`, what `model.generate` users pass). The rendered text carries its own
    special tokens (BOS, turn markers), so it is encoded without adding more."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
