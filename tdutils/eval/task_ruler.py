"""RULER's own templates for real tokenizers (`tdutils.ruler`, Hsieh et al., arXiv:2404.06654), registered as
`ruler_` + RULER's task name (`--tasks ruler`, `run --dataset ruler_niah_single_1`): prompts of exactly the asked
length for the model's tokenizer (token ids, split after the context), scored by RULER's `string_match_all`
(`tdutils.ruler.score_ruler`)."""

from __future__ import annotations

from .. import ruler
from ..data import RULER_PREFIX
from .tasks import RULER, RULER_DEFAULTS, Task, register_task


def ruler_task(name: str) -> Task:
    """The registration of RULER template `name` (one of `tdutils.ruler.RULER_TEMPLATE_TASKS`)."""

    def make(n, length, tokenizer, seed, chat_template="auto"):
        return ruler.make_ruler_dataset(name, n, length, tokenizer=tokenizer, seed=seed, chat_template=chat_template)

    def split(tokenizer, example):
        ids, cut = list(example["prompt_ids"]), int(example["split"])
        return ids[:cut], ids[cut:]

    def max_tokens(examples, tokenizer):
        # RULER's own tokens_to_generate is 30-128; on CPU about twice the longest gold answer is enough
        return ruler.RULER_CPU_MAX_TOKENS[name]

    return Task(RULER_PREFIX + name, RULER, make, split, lambda values, text: ruler.score_ruler(name, values, text),
                max_tokens, about="RULER's own template (NVIDIA/RULER), for real tokenizers", defaults=RULER_DEFAULTS,
                check_model=ruler.check_ruler_model)


for _name in ruler.RULER_TEMPLATE_TASKS:
    register_task(ruler_task(_name))
