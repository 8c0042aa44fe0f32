"""Text fidelity: how far an edited cache moves a model's next-token distributions on natural text (`text_fidelity`).

Each example is a window of a public-domain text (`TEXTS`, `tdutils/assets/texts/`, sources in its NOTICE and in
docs/real_models.md): the prompt is its first T tokens (the context length), the continuation the next `CONTINUATION`
(64) tokens. The cache is edited after the prompt, before the continuation is seen (the query-agnostic setting, the
only one that makes sense here), and the continuation is then teacher-forced (`decode(forced_ids=...)`) through
the full cache and through each cell. Per prompt (`tdutils.eval.runner.run_forced_cells`): the mean KL(full ||
edited) per continuation token (nats; `tdutils.compression.kl_per_step`), the change in the continuation's
perplexity (edited minus full), and the fraction of steps whose argmax equals the full cache's. The measure of
StreamingLLM (Xiao et al., arXiv:2309.17453, perplexity on long text) and of KV-compression studies generally;
a model need not solve any task, only model language, so it ranks policies on every model at every length.
"""

from __future__ import annotations

import functools
import lzma
import random
from pathlib import Path

from .tasks import RULER_DEFAULTS, TEXT, Defaults, Task, register_task

TEXTS_DIR = Path(__file__).resolve().parents[1] / "assets" / "texts"
# one file each, `<name>.txt.xz`: a novel, a play, conference proceedings, an epic poem; prompt i from TEXTS[i % 4]
TEXTS = ("alice_in_wonderland", "as_you_like_it", "loc_workshop_electronic_texts", "paradise_lost")
CONTINUATION = 64  # teacher-forced tokens per prompt
TASK_NAME = "text_fidelity"
FIDELITY_DEFAULTS = Defaults(
    RULER_DEFAULTS.model, RULER_DEFAULTS.policies, RULER_DEFAULTS.drop_ratios, RULER_DEFAULTS.context_lengths, 32,
    modes=("agnostic",), real_model=True, title="the text-fidelity task", label="text fidelity",
    metric=(f"teacher-forced continuation of {CONTINUATION} tokens after the prompt: kl = mean KL(full || edited) per "
            "token (nats), delta_ppl = perplexity edited minus full, agreement = fraction of steps whose argmax is "
            "the full cache's; per-prompt scores in each row's `scores`"))


@functools.lru_cache(maxsize=len(TEXTS))
def load_text(name: str) -> str:
    """The text of `name` (one of `TEXTS`), as shipped (line ends normalised to LF).

    Raises:
        ValueError: an unknown name.
    """
    if name not in TEXTS:
        raise ValueError(f"unknown text {name!r}; the bundled texts are {', '.join(TEXTS)}")
    return lzma.decompress((TEXTS_DIR / f"{name}.txt.xz").read_bytes()).decode("utf-8")


def make_fidelity_example(tokenizer, context_tokens: int, rng: random.Random, book: str,
                          continuation: int = CONTINUATION) -> dict:
    """One window of `book`: `prompt_ids` (exactly `context_tokens` ids), `continuation` (the next `continuation`
    ids), `values` (empty: nothing is generated), `source` (the book) and `offset` (the character the window starts
    at, a line start drawn by `rng`).

    Raises:
        ValueError: the book is too short for `context_tokens + continuation` tokens.
    """
    text = load_text(book)
    need = context_tokens + continuation
    chars = 6 * need  # English prose runs ~4-5 characters per BPE token; grown below when it is not enough
    while True:
        if chars >= len(text):
            raise ValueError(f"{book} holds fewer than {need} tokens of this tokenizer; use a shorter context length")
        start = text.find("\n", rng.randrange(0, len(text) - chars)) + 1
        ids = tokenizer(text[start:start + chars])["input_ids"]
        if len(ids) >= need:
            break
        chars *= 2
    return {"prompt_ids": ids[:context_tokens], "continuation": ids[context_tokens:need], "values": [],
            "source": book, "offset": start}


def make_fidelity_dataset(n: int, context_tokens: int, tokenizer, seed: int, chat_template=None, *,
                          continuation: int = CONTINUATION) -> list[dict]:
    """`n` examples (`make_fidelity_example`), prompt `i` from `TEXTS[i % len(TEXTS)]`; one `random.Random(seed)`
    draws every window in turn, so the first `k` examples of a seed are those of any larger `n`. `chat_template` is
    ignored (plain text continues plain text).

    Raises:
        ValueError: `n < 1` or a context length a book cannot hold.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)
    return [make_fidelity_example(tokenizer, context_tokens, rng, TEXTS[i % len(TEXTS)], continuation)
            for i in range(n)]


def _continuation_tokens(examples, tokenizer) -> int:
    return max(len(e["continuation"]) for e in examples)


register_task(Task(TASK_NAME, TEXT, make_fidelity_dataset, None, None, _continuation_tokens,
                   about="KL, perplexity change and argmax agreement on a teacher-forced continuation of a book",
                   defaults=FIDELITY_DEFAULTS, measure="kl", teacher_forced=True))
