"""RULER's own synthetic tasks, built for a real tokenizer at an exact prompt length.

Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?",
arXiv:2404.06654; written anew from NVIDIA/RULER (Apache-2.0): its task parameters, templates, answer
prefixes, needles, haystacks and scoring (essays: "Alice's Adventures in Wonderland", not Paul Graham's).

- `RULER_TEMPLATE_TASKS`: `niah_single_1..3`, `niah_multikey_1..3`, `niah_multivalue`, `niah_multiquery`,
  `vt`, `cwe`, `fwe`; `RULER_MAX_TOKENS` (RULER's `tokens_to_generate`), `RULER_CPU_MAX_TOKENS` (smaller).
- `make_ruler_example(task, context_tokens, tokenizer=, rng=, chat_template="auto")`: a dict whose
  `prompt_ids` are exactly `context_tokens` ids, `split` where its question part starts, `values` the gold
  references (its docstring lists every key); `make_ruler_dataset(task, n, context_tokens, ..., seed=)`.
- `score_ruler(task, values, response)`: `(exact, partial)`, RULER's `string_match_all`.
Errors: `ValueError` (unknown task, `context_tokens` not a positive int or too short for the task, cwe beyond
the bundled words, a bad `chat_template`, empty `values`). Task table, prompt layout, sources and the
differences from RULER: docs/models.md, section "RULER's own templates (`tdutils.ruler`)".
"""

from __future__ import annotations

import math
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

from .chat import uses_chat_template
from .models import ModelRef, resolve_model

_ASSETS = Path(__file__).parent / "assets" / "ruler"

# Ordered as in RULER's scripts/synthetic.yaml (qa_1 / qa_2 need SQuAD / HotpotQA and are left out).
RULER_TEMPLATE_TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)

# synthetic.yaml: (haystack, key kind, value kind, num_needle_k, num_needle_v, num_needle_q)
_NIAH_ARGS: dict[str, tuple[str, str, str, int, int, int]] = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4),
}
_VT_CHAINS, _VT_HOPS = 1, 4
_CWE_FREQ_CW, _CWE_FREQ_UCW, _CWE_NUM_CW = 30, 3, 10
_FWE_ALPHA, _FWE_WORDLEN = 2.0, 6

# RULER's tokens_to_generate (scripts/data/synthetic/constants.py).
RULER_MAX_TOKENS: dict[str, int] = {
    **{t: 128 for t in _NIAH_ARGS},
    "vt": 30,
    "cwe": 120,
    "fwe": 50,
}
# Smaller decode budgets for CPU runs: 2x the gold answer's token length after the answer prefix, plus 8,
# rounded up to a multiple of 8, never above RULER's value. Answer lengths measured with the SmolLM2
# tokenizer (one token a digit): " 1234567." 9 tokens, a uuid 36, four numbers 36, five vt names 20
# (so vt keeps RULER's 30), cwe's "1. word 2. word ... 10. word." up to 47, three fwe words 17.
# Tokenizers that split text more finely may need RULER_MAX_TOKENS.
RULER_CPU_MAX_TOKENS: dict[str, int] = {
    "niah_single_1": 32,
    "niah_single_2": 32,
    "niah_single_3": 80,
    "niah_multikey_1": 32,
    "niah_multikey_2": 32,
    "niah_multikey_3": 80,
    "niah_multivalue": 80,
    "niah_multiquery": 80,
    "vt": 30,
    "cwe": 104,
    "fwe": 48,
}

# --- RULER's texts (scripts/data/synthetic/constants.py, niah.py, variable_tracking.py) ---------------
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
_NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
_VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
_VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are: "
)
_CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
    "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
_CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
_FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
    "the dots '....'. What are the three most frequently appeared words in the above coded text?"
)
_FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

# RULER: np.round(np.linspace(0, 100, num=40)).astype(int); no value sits at .5, so round() agrees.
DEPTHS: tuple[int, ...] = tuple(round(100 * i / 39) for i in range(40))

_VT_ICL_TOKENS = 500  # RULER builds its in-context vt example with max_seq_length=500


# --- assets ------------------------------------------------------------------------------------------


@cache
def _wordlist(name: str) -> tuple[str, ...]:
    # wonderwords' _get_words_from_text_file: one word per line, trailing whitespace stripped
    text = (_ASSETS / f"{name}list.txt").read_text(encoding="utf-8")
    return tuple(w.rstrip() for w in text.splitlines() if w.strip())


@cache
def _key_parts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    # RULER's keys: sorted(set(f"{adj}-{noun}")); drawing adjective and noun independently from the
    # de-duplicated lists is the same uniform draw without building the 6-million-entry product.
    return tuple(sorted(set(_wordlist("adjective")))), tuple(sorted(set(_wordlist("noun"))))


@cache
def _cwe_words() -> tuple[str, ...]:
    return tuple(sorted(set(_wordlist("noun") + _wordlist("adjective") + _wordlist("verb"))))


@cache
def _essay_words() -> tuple[str, ...]:
    # RULER: re.sub(r'\s+', " ", essay).split(" ")
    text = (_ASSETS / "alice_ch1-6.txt").read_text(encoding="utf-8")
    return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


_SENT_BREAK = re.compile(r"[.!?]+['\")\]]*\s+")


def _split_sentences(text: str) -> list[str]:
    """Sentences of `text` (a stand-in for NLTK's sent_tokenize: break after . ! ? and closing quotes
    when the next word starts with a capital, a digit or an opening quote before one)."""
    out, start = [], 0
    for m in _SENT_BREAK.finditer(text):
        nxt = text[m.end() : m.end() + 2]
        if nxt[:1].isupper() or nxt[:1].isdigit() or (nxt[:1] in "'\"(" and nxt[1:2].isupper()):
            out.append(text[start : m.end()].strip())
            start = m.end()
    if text[start:].strip():
        out.append(text[start:].strip())
    return out


def _zeta(a: float) -> float:
    """Riemann zeta for a > 1 (scipy.special.zeta, used by RULER's fwe, without scipy)."""
    m = 1000
    head = math.fsum(k**-a for k in range(1, m))
    # Euler-Maclaurin tail from m on
    return head + m ** (1 - a) / (a - 1) + 0.5 * m**-a + a * m ** (-a - 1) / 12


# --- random values (niah.py) -------------------------------------------------------------------------


def _random_value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        adjs, nouns = _key_parts()
        return f"{rng.choice(adjs)}-{rng.choice(nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle kind {kind!r}")


def _distinct(draw: Callable[[], str], n: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = draw()
        if v not in taken:
            taken.add(v)
            out.append(v)
    return out


# --- task plans ----------------------------------------------------------------------------------------
# A plan holds everything of an example except the haystack size: `before` (instruction, with any
# in-context example), `ctx_lead` (whitespace that starts the context), `after` (question), `prefix`
# (answer prefix), `values`, and `segments(n)` -> (list of (is_needle, text), depths) for a haystack of n
# units, joined by `joiner`. `n_min` is the smallest haystack that can hold the needles.


class _Plan:
    def __init__(self, *, before, after, prefix, values, segments, joiner, n_min, n_max=None, ctx_lead=""):
        self.before, self.after, self.prefix, self.values = before, after, prefix, values
        self.segments, self.joiner, self.ctx_lead = segments, joiner, ctx_lead
        self.n_min, self.n_max = n_min, n_max


def _split_template(template: str) -> tuple[str, str, str]:
    """(before, ctx_lead, after) around {context}; trailing spaces of `before` move to the context, so a
    BPE tokenizer sees them attached to the next word as it would in the whole text."""
    before, after = template.split("{context}")
    stripped = before.rstrip(" ")
    return stripped, before[len(stripped) :], after


def _lines_with_inserts(n: int, filler: Callable[[int], list[str]], groups: list[list[str]], seed: int):
    """RULER's line haystacks: `n` filler lines with groups of needle lines inserted between them.

    Returns (segments, depths): runs of filler lines as one segment each, needle lines as their own."""
    lines: list[tuple[bool, str]] = [(False, s) for s in filler(n)]
    r = random.Random(seed)
    for group in groups:
        # variable_tracking.py: positions sorted, line j goes to positions[j] + j (keeps chain order)
        positions = sorted(r.sample(range(len(lines)), len(group)))
        for j, (pos, line) in enumerate(zip(positions, group)):
            lines.insert(pos + j, (True, line))
    return _runs(lines)


def _runs(lines: list[tuple[bool, str]]):
    segments: list[tuple[bool, str]] = []
    depths: list[float] = []
    run: list[str] = []
    for i, (is_needle, text) in enumerate(lines):
        if is_needle:
            if run:
                segments.append((False, "\n".join(run)))
                run = []
            segments.append((True, text))
            depths.append(i / len(lines))
        else:
            run.append(text)
    if run:
        segments.append((False, "\n".join(run)))
    return segments, depths


def _niah_plan(task: str, rng: random.Random) -> _Plan:
    hay, k_kind, v_kind, num_k, num_v, num_q = _NIAH_ARGS[task]
    num_k = max(num_k, num_q)
    taken: set[str] = set()
    keys = _distinct(lambda: _random_value(k_kind, rng), num_k, taken)
    values = [_distinct(lambda: _random_value(v_kind, rng), num_v, taken) for _ in keys]
    needles = [NEEDLE.format(type_needle_v=v_kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = rng.sample(range(num_k), num_q)
    queries = [keys[i] for i in asked]
    answers = [v for i in asked for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

    template, prefix, type_v = _NIAH_TEMPLATE, _NIAH_PREFIX, v_kind
    if num_q * num_v == 1:
        # niah.py's singular form, the same replacements in the same order
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template, prefix = template.replace(old, new), prefix.replace(old, new)
        type_v = v_kind[:-1]
    template = template.replace("{type_needle_v}", type_v).replace("{query}", query)
    prefix = prefix.replace("{type_needle_v}", type_v).replace("{query}", query)
    before, ctx_lead, after = _split_template(template)

    if hay == "essay":
        depth_pick = sorted(rng.sample(DEPTHS, len(needles)))

        def segments(n: int):
            words = _essay_words()
            reps = -(-n // len(words))
            sents = _split_sentences(" ".join((words * reps)[:n]))
            cuts = [int(len(sents) * d / 100) for d in depth_pick]
            segs: list[tuple[bool, str]] = []
            last = 0
            for cut, needle in zip(cuts, needles):
                if cut > last:
                    segs.append((False, " ".join(sents[last:cut])))
                segs.append((True, needle))
                last = cut
            if last < len(sents):
                segs.append((False, " ".join(sents[last:])))
            return segs, [d / 100 for d in depth_pick]

        return _Plan(
            before=before, after=after, prefix=prefix, values=answers, segments=segments, joiner=" ",
            n_min=1, ctx_lead=ctx_lead,
        )  # fmt: skip

    seed = rng.getrandbits(64)
    if hay == "noise":

        def filler(n: int) -> list[str]:
            return [NOISE] * n

    else:  # "needle": distractor needles with other random keys and values
        dseed = rng.getrandbits(64)
        real = set(taken)

        def filler(n: int) -> list[str]:
            r = random.Random(dseed)  # same stream for every n: the first lines stay the same
            out = []
            for _ in range(n):
                k = _random_value(k_kind, r)
                while k in real:
                    k = _random_value(k_kind, r)
                out.append(NEEDLE.format(type_needle_v=v_kind, key=k, value=_random_value(v_kind, r)))
            return out

    def segments(n: int):
        # niah.py: indexes = sorted(random.sample(range(n), k), reverse=True); insert each needle there
        lines: list[tuple[bool, str]] = [(False, s) for s in filler(n)]
        idx = sorted(random.Random(seed).sample(range(n), len(needles)), reverse=True)
        for i, needle in zip(idx, needles):
            lines.insert(i, (True, needle))
        return _runs(lines)

    return _Plan(
        before=before, after=after, prefix=prefix, values=answers, segments=segments, joiner="\n",
        n_min=len(needles), ctx_lead=ctx_lead,
    )  # fmt: skip


def _vt_chains(rng: random.Random, num_chains: int, num_hops: int, name_len: int):
    """variable_tracking.py's generate_chains: distinct upper-case names, first value 5 digits."""
    names = _distinct(
        lambda: "".join(rng.choices(string.ascii_uppercase, k=name_len)), (num_hops + 1) * num_chains, set()
    )
    chains, var_groups = [], []
    for c in range(num_chains):
        vs = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        # np.random.randint(10000, 99999) excludes 99999
        chain = [f"VAR {vs[0]} = {rng.randint(10000, 99998)}"]
        chain += [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(num_hops)]
        chains.append(chain)
        var_groups.append(vs)
    return var_groups, chains


def _vt_plan(rng: random.Random, enc: Callable[[str], list[int]]) -> _Plan:
    # In-context example: 3-letter names, its own value, noise filling about 500 tokens, then the answer.
    icl_vars, icl_chains = _vt_chains(rng, _VT_CHAINS, _VT_HOPS, 3)
    icl_value = icl_chains[0][0].split("=")[-1].strip()
    icl_seed = rng.getrandbits(64)
    icl_head = (_VT_TEMPLATE + _VT_PREFIX).replace("{query}", icl_value).replace("{num_v}", str(_VT_HOPS + 1))

    def icl_text(n: int) -> str:
        segs, _ = _lines_with_inserts(n, lambda k: [NOISE] * k, icl_chains, icl_seed)
        return icl_head.replace("{context}", "\n".join(t for _, t in segs))

    # variable_tracking.py: the largest noise size whose example fits in 500 tokens (at least 5 lines)
    lo, hi = 5, 5
    while len(enc(icl_text(hi * 2))) <= _VT_ICL_TOKENS:
        hi *= 2
    hi *= 2
    while lo < hi - 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(enc(icl_text(mid))) <= _VT_ICL_TOKENS else (lo, mid)
    icl = icl_text(lo) + " " + " ".join(icl_vars[0]) + "\n"

    var_groups, chains = _vt_chains(rng, _VT_CHAINS, _VT_HOPS, 5)
    value = chains[0][0].split("=")[-1].strip()
    seed = rng.getrandbits(64)
    template = _VT_TEMPLATE.replace("{query}", value)
    prefix = _VT_PREFIX.replace("{query}", value).replace("{num_v}", str(_VT_HOPS + 1))
    before, ctx_lead, after = _split_template(template)

    def segments(n: int):
        # (RULER's context.replace(". \n", ".\n") changes nothing on the noise haystack)
        return _lines_with_inserts(n, lambda k: [NOISE] * k, chains, seed)

    return _Plan(
        before=icl + "\n" + before, after=after, prefix=prefix, values=list(var_groups[0]),
        segments=segments, joiner="\n", n_min=_VT_HOPS + 1, ctx_lead=ctx_lead,
    )  # fmt: skip


def _cwe_plan(rng: random.Random, context_tokens: int) -> _Plan:
    words = _cwe_words()
    # common_words_extraction.py: below 4096 tokens lighter repeats and a smaller example
    if context_tokens < 4096:
        ex_words, ex_cw, ex_ucw, cw, ucw = 20, 3, 1, 6, 1
    else:
        ex_words, ex_cw, ex_ucw, cw, ucw = 40, 10, 3, _CWE_FREQ_CW, _CWE_FREQ_UCW

    def numbered(ws: Sequence[str]) -> str:
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(ws))

    def word_list(chosen: Sequence[str], rc: int, ru: int, r: random.Random) -> list[str]:
        lst = list(chosen[:_CWE_NUM_CW]) * rc + list(chosen[_CWE_NUM_CW:]) * ru
        r.shuffle(lst)
        return lst

    ex = rng.sample(words, ex_words)
    example = (_CWE_TEMPLATE + _CWE_PREFIX).replace("{context}", numbered(word_list(ex, ex_cw, ex_ucw, rng)))
    example += " " + numbered(ex[:_CWE_NUM_CW])
    perm = rng.sample(words, len(words))  # the first n of one permutation: a uniform sample for every n
    seed = rng.getrandbits(64)
    before, ctx_lead, after = _split_template(_CWE_TEMPLATE)

    def segments(n: int):
        return [(False, numbered(word_list(perm[:n], cw, ucw, random.Random(seed))))], []

    return _Plan(
        before=example + "\n" + before, after=after, prefix=_CWE_PREFIX, values=list(perm[:_CWE_NUM_CW]),
        segments=segments, joiner=" ", n_min=_CWE_NUM_CW + 1, n_max=len(words), ctx_lead=ctx_lead,
    )  # fmt: skip


def _fwe_plan(rng: random.Random, context_tokens: int) -> _Plan:
    vocab_size = context_tokens // 50  # freq_words_extraction.py: (max_seq_length - to_generate) // 50
    if vocab_size < 5:
        raise ValueError(
            f"fwe needs context_tokens >= 250 (a vocabulary of 5 coded words), got {context_tokens}"
        )
    taken: set[str] = set()
    vocab = _distinct(lambda: "".join(rng.choices(string.ascii_lowercase, k=_FWE_WORDLEN)), vocab_size, taken)
    vocab.sort()
    rng.shuffle(vocab)
    vocab[0] = "..."  # the top-ranked word is noise
    z = _zeta(_FWE_ALPHA)
    seed = rng.getrandbits(64)
    before, ctx_lead, after = _split_template(_FWE_TEMPLATE)

    def segments(n: int):
        counts = [int(n * (k**-_FWE_ALPHA) / z) for k in range(1, len(vocab) + 1)]
        ws = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(seed).shuffle(ws)
        return [(False, " ".join(ws))], []

    # smallest n where the rank-4 word (the third answer) appears at least once
    n_min = math.ceil(z * 4**_FWE_ALPHA) + 1
    return _Plan(
        before=before, after=after, prefix=_FWE_PREFIX, values=vocab[1:4], segments=segments, joiner=" ",
        n_min=n_min, ctx_lead=ctx_lead,
    )  # fmt: skip


# --- tokenizer plumbing ------------------------------------------------------------------------------

_PLACEHOLDER = "\u27e6RULER-USER-TURN\u27e7"


def _encoder(tokenizer) -> Callable[[str], list[int]]:
    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    return enc


def _leading_specials(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts in front of a text by default (e.g. BOS); trailing ones (an
    EOS some tokenizers append) do not belong in a prompt and are dropped."""
    probe = "Hello world"
    with_sp = list(tokenizer.encode(probe))
    without = list(tokenizer.encode(probe, add_special_tokens=False))
    for i in range(len(with_sp) - len(without) + 1):
        if with_sp[i : i + len(without)] == without:
            return with_sp[:i]
    return []


def _chat_wrapper(tokenizer) -> tuple[str, str]:
    """(text before the user content, text after it up to the assistant turn) from the chat template."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _PLACEHOLDER}], add_generation_prompt=True, tokenize=False
    )
    if not isinstance(text, str) or text.count(_PLACEHOLDER) != 1:
        raise ValueError("the chat template did not render the user message exactly once")
    pre, post = text.split(_PLACEHOLDER)
    return pre, post


def _build(plan: _Plan, task: str, context_tokens: int, tokenizer, chat: bool) -> dict:
    enc = _encoder(tokenizer)
    if chat:
        pre, post = _chat_wrapper(tokenizer)
        head = enc(pre) + enc(plan.before)
        tail = enc(plan.after) + enc(post) + enc(plan.prefix)
    else:
        head = _leading_specials(tokenizer) + enc(plan.before)
        # no template between question and answer prefix: one piece, as the text runs on
        tail = enc(plan.after + plan.prefix)
    fixed = len(head) + len(tail)

    def context_text(n: int) -> str:
        segs, _ = plan.segments(n)
        return plan.ctx_lead + plan.joiner.join(t for _, t in segs)

    def count(n: int) -> int:
        return fixed + len(enc(context_text(n)))

    def too_short(need: int) -> ValueError:
        return ContextTooShort(need,
            f"{task}: context_tokens={context_tokens} is too short for the template and needles; "
            f"this tokenizer needs at least about {need} tokens"
        )

    n = _search(count, plan, context_tokens, task, too_short)
    for _ in range(8):
        built = _exact(plan, n, head, tail, context_tokens, enc)
        if built is not None:
            ids, split, depths = built
            return {
                "task": task,
                "prompt_ids": ids,
                "split": split,
                "prompt": tokenizer.decode(ids),
                "values": list(plan.values),
                "answer_prefix": plan.prefix,
                "chat_template": chat,
                "depths": depths,
                "context_tokens": context_tokens,
            }
        n += 1
        if plan.n_max is not None and n > plan.n_max:
            break
    raise too_short(count(n))


class ContextTooShort(ValueError):
    """One draw's template and needles do not fit in `context_tokens` (`need`: about the tokens they take; the
    floor itself when `make_ruler_example` refuses a length below `min_context_tokens`)."""

    def __init__(self, need: int, message: str):
        super().__init__(message)
        self.need = need


def _search(count: Callable[[int], int], plan: _Plan, target: int, task: str, too_short) -> int:
    """A haystack size n with target <= count(n) <= target + about one unit's tokens.

    Encoding a long context dominates the cost, so the size is found by secant steps inside a bracket
    (count is close to linear in n) rather than by plain bisection; usually 3-5 encodings."""
    memo: dict[int, int] = {}

    def c(n: int) -> int:
        if n not in memo:
            memo[n] = count(n)
        return memo[n]

    lo = plan.n_min
    if c(lo) > target:
        raise too_short(c(lo))
    if c(lo) == target:
        return lo
    hi: int | None = None  # c(lo) < target <= c(hi)
    prev = lo
    probe = lo + 64
    for _ in range(64):
        if plan.n_max is not None and probe > plan.n_max:
            probe = plan.n_max
            if probe <= lo:
                raise ValueError(
                    f"{task}: context_tokens={target} needs more than the {plan.n_max} distinct words "
                    "bundled (RULER then uses a larger word list that is not bundled here)"
                )
        cp = c(probe)
        rate = max((cp - c(prev)) / (probe - prev), 0.05) if probe != prev else 1.0
        if target <= cp <= target + max(3, math.ceil(rate)):
            return probe
        if cp < target:
            lo = probe
        else:
            hi = probe
        if hi is not None and hi - lo <= 1:
            return hi
        nxt = probe + math.ceil((target - cp) / rate)
        if hi is None:
            nxt = max(nxt, lo + 1)
        elif not lo < nxt < hi:
            nxt = (lo + hi) // 2
        prev, probe = probe, nxt
    return hi if hi is not None else probe


def _exact(plan: _Plan, n: int, head: list[int], tail: list[int], target: int, enc):
    """(ids, split, depths) of exactly `target` tokens for haystack size `n`, or None when the surplus
    cannot be cut from a haystack stretch."""
    segs, depths = plan.segments(n)
    hay = [i for i, (is_needle, _) in enumerate(segs) if not is_needle]
    # cut in the stretch after the last needle, else in the longest stretch
    order = ([hay[-1]] if hay and hay[-1] == len(segs) - 1 else []) + sorted(
        hay, key=lambda i: -len(segs[i][1])
    )
    j = plan.joiner
    for t in dict.fromkeys(order):
        first = plan.ctx_lead + j.join(s for _, s in segs[: t + 1])
        rest = (j + j.join(s for _, s in segs[t + 1 :])) if t + 1 < len(segs) else ""
        first_ids, rest_ids = enc(first), enc(rest)
        surplus = len(head) + len(first_ids) + len(rest_ids) + len(tail) - target
        if surplus < 0:
            return None  # two pieces encoded shorter than one: take one more unit
        # the cut must stay inside stretch t (2 tokens of slack for merges where it starts); a stretch of
        # 20 characters a token to cut is long enough without encoding it
        stretch = segs[t][1]
        if len(stretch) < 20 * (surplus + 2) and len(enc(stretch)) < surplus + 2:
            continue
        ctx = first_ids[: len(first_ids) - surplus] + rest_ids
        return head + ctx + tail, len(head) + len(ctx), depths
    return None


# --- public API ----------------------------------------------------------------------------------------


def make_ruler_example(
    task: str,
    context_tokens: int,
    *,
    tokenizer,
    rng: random.Random,
    chat_template: str | bool = "auto",
) -> dict:
    """One RULER example of `task` whose prompt is exactly `context_tokens` tokens of `tokenizer`.

    Draws every random choice from `rng`. Returns a dict: ``task`` (str), ``prompt_ids`` (list[int], exactly
    ``context_tokens`` long), ``split`` (int: ids before it are the context part - wrapper start,
    instruction, in-context example, haystack with needles; ids from it are the question part - question,
    end of user turn and assistant header when a chat template is used, answer prefix), ``prompt`` (str,
    the decoded ids), ``values`` (list[str], gold references), ``answer_prefix`` (str), ``chat_template``
    (bool), ``depths`` (list[float], needle / chain-line positions as fractions of the haystack in order of
    appearance; empty for cwe and fwe), ``context_tokens`` (int). How the prompt is laid out and fitted to
    the length: docs/models.md, section "RULER's own templates (`tdutils.ruler`)".

    Raises:
        ValueError: unknown task; context_tokens not a positive int or below the task's floor for this tokenizer
            (`min_context_tokens`: the template, the in-context example and the needles of any draw); cwe beyond the bundled words; a bad chat_template value or
            ``chat_template=True`` for a tokenizer without one.
    """
    if task not in RULER_TEMPLATE_TASKS:
        raise ValueError(f"unknown RULER task {task!r}; known: {', '.join(RULER_TEMPLATE_TASKS)}")
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens <= 0:
        raise ValueError(f"context_tokens must be a positive int, got {context_tokens!r}")
    if not callable(getattr(tokenizer, "encode", None)):
        raise ValueError(f"tokenizer must be a Hugging Face tokenizer (with encode), got {type(tokenizer).__name__}")
    floor = min_context_tokens(task, tokenizer, chat_template=chat_template, context_tokens=context_tokens)
    if context_tokens < floor:
        raise ContextTooShort(floor, f"{task}: context_tokens={context_tokens} is too short for the template and "
                               f"needles; this tokenizer needs at least {floor} tokens (for every draw)")
    return _make_example(task, context_tokens, tokenizer, rng, uses_chat_template(tokenizer, chat_template))


def _make_example(task: str, context_tokens: int, tokenizer, rng: random.Random, chat: bool,
                  plan_length: int | None = None) -> dict:
    """`make_ruler_example` without its checks; `plan_length` (default `context_tokens`) sizes cwe's and fwe's
    word lists."""
    length = plan_length or context_tokens
    if task in _NIAH_ARGS:
        plan = _niah_plan(task, rng)
    elif task == "vt":
        plan = _vt_plan(rng, _encoder(tokenizer))
    elif task == "cwe":
        plan = _cwe_plan(rng, length)
    else:
        plan = _fwe_plan(rng, length)
    return _build(plan, task, context_tokens, tokenizer, chat)


# Shortest lengths: the most tokens the template, in-context example and fewest needles take over these many fixed
# draws, plus a margin for draws beyond them; above it a draw that does not fit is redrawn (at most _REDRAWS times).
_FLOOR_PROBES = 16
_FLOOR_MARGIN = (0.02, 8)  # the larger of 2% and 8 tokens
_REDRAWS = 8
_floors: dict[tuple, int] = {}
# Words of RULER's templates and haystack; a tokenizer that reads any of them as its unknown token cannot make
# RULER prompts (a random:ARCH model's id tokenizer, the bundled models' word-level one).
_SPELL_PROBE = "One of the special magic numbers for the quiet garden is: 4821. Alice was beginning to get tired."


def check_spells_english(tokenizer, task: str) -> None:
    """Raise ValueError when `tokenizer` reads plain English (`_SPELL_PROBE`) with its unknown token: RULER's text
    would be made of that token, without needles, silently."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return
    ids = _encoder(tokenizer)(_SPELL_PROBE)
    lost = sum(i == unk for i in ids)
    if lost:
        raise ValueError(f"{task}: this tokenizer cannot spell RULER's English text ({lost} of the {len(ids)} tokens "
                         f"of {_SPELL_PROBE!r} are its unknown token {tokenizer.unk_token!r}): RULER's templates need a "
                         f"real model's tokenizer (e.g. smollm2-135m's); random:ARCH models and the bundled models "
                         f"have vocabularies of their own")


def check_ruler_model(model, what: str = "RULER's templates") -> None:
    """Refuse, before any work, a model whose tokenizer cannot spell RULER's text (`ModelRef.tokenizer` other than
    `"checkpoint"`): a bundled model (its word-level vocabulary) or a `random:ARCH` model (an id tokenizer). Other
    names (real models) and objects that are not names (a loaded model, None) pass.

    Args:
        model: a model name or its `tdutils.models.ModelRef`.

    Raises:
        ValueError: one line starting with `what` (e.g. `"--dataset ruler_vt"`), naming the model.
    """
    if not isinstance(model, (str, ModelRef)):
        return
    ref = resolve_model(model, check=False)  # the spelling decides; files are checked where they are read
    if ref.tokenizer == "word-level":
        raise ValueError(f"{what}: RULER's templates need a real model and tokenizer (e.g. smollm2-135m); {ref.name!r} "
                         f"reads only its own word-level vocabulary")
    if ref.tokenizer == "ids":
        raise ValueError(f"{what}: RULER's templates need a real model and tokenizer (e.g. smollm2-135m); {ref.name} "
                         f"has random weights and an id tokenizer that cannot spell RULER's text")


def min_context_tokens(task: str, tokenizer, *, chat_template: str | bool = "auto", context_tokens: int = 0) -> int:
    """The shortest prompt `make_ruler_dataset` builds `task` at for this tokenizer, the same for every seed: the
    most tokens the template, the in-context example (vt) and the fewest needles take over `_FLOOR_PROBES` fixed
    draws (`random.Random(f"ruler-min:{task}:{i}")`), plus the larger of 2% and 8 tokens for draws beyond those.
    `context_tokens` matters to cwe and fwe only (their word lists follow the length). Cached per process.

    Without a floor, a length near a task's minimum succeeds or fails by the draw (vt at 795 SmolLM2 tokens
    fails for most seeds and works for some).
    """
    chat = uses_chat_template(tokenizer, chat_template)
    key = (task, getattr(tokenizer, "name_or_path", ""), len(tokenizer), chat,
           context_tokens if task in ("cwe", "fwe") else 0)
    if key not in _floors:
        need = 0
        for i in range(_FLOOR_PROBES):
            try:
                _make_example(task, 1, tokenizer, random.Random(f"ruler-min:{task}:{i}"), chat,
                              plan_length=context_tokens or None)
            except ContextTooShort as exc:
                need = max(need, exc.need)
        _floors[key] = need + max(math.ceil(_FLOOR_MARGIN[0] * need), _FLOOR_MARGIN[1]) if need else 1
    return _floors[key]


def make_ruler_dataset(
    task: str,
    n: int,
    context_tokens: int,
    *,
    tokenizer,
    seed: int,
    chat_template: str | bool = "auto",
) -> list[dict]:
    """`n` examples of `task` (see make_ruler_example) drawn from one stream,
    ``random.Random(f"ruler:{task}:{seed}")``, so each (task, seed) pair gives the same examples whatever
    else is generated.

    Above the task's floor (`min_context_tokens`) a draw whose needles do not fit is redrawn from the same stream,
    so whether a length works depends on the tokenizer and the length only, never on the seed.

    Raises:
        ValueError: as make_ruler_example; also n negative; a tokenizer that reads English as its unknown token
            (`check_spells_english`: a random:ARCH model's id tokenizer).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if task not in RULER_TEMPLATE_TASKS:
        raise ValueError(f"unknown RULER task {task!r}; known: {', '.join(RULER_TEMPLATE_TASKS)}")
    check_spells_english(tokenizer, task)
    rng = random.Random(f"ruler:{task}:{seed}")
    out = []
    for _ in range(n):
        for attempt in range(_REDRAWS + 1):  # above the floor an unlucky draw is redrawn from the same stream
            try:
                out.append(make_ruler_example(task, context_tokens, tokenizer=tokenizer, rng=rng,
                                              chat_template=chat_template))
                break
            except ContextTooShort:
                if attempt == _REDRAWS:
                    raise
    return out


def essay_prompts(tokenizer, n: int, tokens: int, *, wrap: bool = True) -> list[list[int]]:
    """`n` continuation prompts of exactly `tokens` token ids from the RULER essay haystack (Alice, ch. 1-6), each
    led by the tokenizer's own leading special tokens: passages starting at `n` evenly spaced words; with `wrap`
    they read on from the start of the text past its end, without it they must fit in the text. The benches'
    prompts of a given length (policy_cost, decode_compression).

    Args:
        tokenizer: a Hugging Face tokenizer (called as `tokenizer(text, add_special_tokens=...)`).

    Raises:
        ValueError: the text cannot give `n` passages of that many tokens.
    """
    words = list(_essay_words())
    lead = list(tokenizer("", add_special_tokens=True)["input_ids"])
    body = tokens - len(lead)
    span = 2 * body + 16  # words: more than enough for `body` tokens of English prose
    if not wrap and (body < 1 or n * span > len(words)):
        raise ValueError(f"the essay text ({len(words)} words) cannot give {n} passages of {tokens} tokens")
    ring = words * (1 + span // len(words) + 1) if wrap else words
    step = len(words) // max(n, 1) if wrap else (len(words) - span) // max(n - 1, 1)
    out = []
    for i in range(n):
        ids = tokenizer(" ".join(ring[i * step:i * step + span]), add_special_tokens=False)["input_ids"]
        if len(ids) < body:
            raise ValueError(f"passage {i} has {len(ids)} tokens, fewer than {body}")
        out.append(lead + list(ids[:body]))
    return out

def score_ruler(task: str, values: Sequence[str], response: str | None) -> tuple[bool, float]:
    """RULER's score of one response: ``(exact, partial)``.

    ``partial`` is RULER's ``string_match_all`` for one example: the fraction of `values` that occur in
    `response`, case-insensitively (RULER reports the mean of this over examples, x100, for every task
    here); ``exact`` is True when all of them occur. A missing response (None) scores (False, 0.0).

    Raises:
        ValueError: unknown task, or empty `values`.
    """
    if task not in RULER_TEMPLATE_TASKS:
        raise ValueError(f"unknown RULER task {task!r}; known: {', '.join(RULER_TEMPLATE_TASKS)}")
    if isinstance(values, str) or not values:
        raise ValueError("values must be a non-empty sequence of reference strings")
    if response is None:
        return False, 0.0
    # RULER's postprocess_pred turns control characters into newlines and strips; the references hold
    # none, so substring matching is unaffected by that step and it is skipped.
    low = response.lower()
    hits = sum(1 for v in values if str(v).lower() in low)
    return hits == len(values), hits / len(values)
