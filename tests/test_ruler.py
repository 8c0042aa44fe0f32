"""tdutils.ruler: RULER's synthetic tasks at exact token lengths, prompt split, templates, scoring."""

import itertools
import random
import re
from pathlib import Path

import pytest

from tdutils import ruler
from tdutils.chat import uses_chat_template
from tdutils.ruler import (
    NEEDLE,
    NOISE,
    RULER_CPU_MAX_TOKENS,
    RULER_MAX_TOKENS,
    RULER_TEMPLATE_TASKS,
    make_ruler_dataset,
    make_ruler_example,
    score_ruler,
)

NIAH = [t for t in RULER_TEMPLATE_TASKS if t.startswith("niah")]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M-Instruct's tokenizer (chat template, byte-level BPE), or skip."""
    try:
        from tdutils.models import load_tokenizer

        return load_tokenizer("smollm2-135m")
    except (ImportError, OSError, ValueError, KeyError):
        pass  # not packaged in this checkout: try the development copy
    if Path("/tmp/wh/smol_st/tokenizer.json").exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained("/tmp/wh/smol_st")
    pytest.skip("SmolLM2 tokenizer not available (load_tokenizer('smollm2-135m') failed, no /tmp/wh/smol_st)")


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE trained here on the bundled essay, adding a BOS by default, with a chat template
    that writes the BOS itself (checks that it is not doubled)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    text = (Path(ruler.__file__).parent / "assets" / "ruler" / "alice_ch1-6.txt").read_text()
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator([text, NOISE, NEEDLE], trainer)
    bos = tk.token_to_id("<bos>")
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>")
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|user|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    return tok


@pytest.fixture(scope="module")
def tiny_tok():
    from tdutils.models import load_tokenizer

    return load_tokenizer("tiny-qwen3")


def _ex(task, n, tok, seed=0, chat="auto"):
    return make_ruler_example(task, n, tokenizer=tok, rng=random.Random(seed), chat_template=chat)


def _parts(tok, ex):
    ids, s = ex["prompt_ids"], ex["split"]
    return tok.decode(ids[:s]), tok.decode(ids[s:])


# --- constants ---------------------------------------------------------------------------------------


def test_task_names_and_decode_budgets():
    assert RULER_TEMPLATE_TASKS == (
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
        "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
    )  # fmt: skip
    assert RULER_MAX_TOKENS["niah_single_1"] == 128 and RULER_MAX_TOKENS["vt"] == 30
    assert RULER_MAX_TOKENS["cwe"] == 120 and RULER_MAX_TOKENS["fwe"] == 50
    assert set(RULER_CPU_MAX_TOKENS) == set(RULER_MAX_TOKENS) == set(RULER_TEMPLATE_TASKS)
    assert all(0 < RULER_CPU_MAX_TOKENS[t] <= RULER_MAX_TOKENS[t] for t in RULER_TEMPLATE_TASKS)


def test_cpu_budget_covers_twice_the_gold_answer(smol):
    for task in RULER_TEMPLATE_TASKS:
        ex = _ex(task, 4200 if task == "cwe" else 1024, smol, chat=False)
        v = ex["values"]
        if task == "cwe":
            answer = " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(v)) + "."
        else:
            answer = " " + (" " if task == "vt" else ", ").join(v) + "."
        need = 2 * len(smol.encode(answer, add_special_tokens=False))
        assert RULER_CPU_MAX_TOKENS[task] >= min(need, RULER_MAX_TOKENS[task])


def test_assets_small_and_noticed():
    d = Path(ruler.__file__).parent / "assets" / "ruler"
    assert sum(p.stat().st_size for p in d.iterdir()) < 300_000
    notice = (d / "NOTICE").read_text()
    assert "public domain" in notice and "brotli" in notice and "MIT" in notice


# --- exact lengths -------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", RULER_TEMPLATE_TASKS)
def test_exact_length_smollm2(smol, task):
    for n, chat in ((1024, "auto"), (2500, False), (4096, "auto")):
        ex = _ex(task, n, smol, seed=n, chat=chat)
        assert len(ex["prompt_ids"]) == n == ex["context_tokens"]
        assert 0 < ex["split"] < n
        assert ex["chat_template"] is (chat == "auto")


@pytest.mark.parametrize("task", RULER_TEMPLATE_TASKS)
def test_exact_length_trained_bpe(bpe, task):
    # 1300: above every task's floor for this 600-word BPE (cwe's is 1289; at 1200, 17 of 40 cwe draws fail)
    for n, chat in ((1300, True), (1633, False)):
        ex = _ex(task, n, bpe, seed=3, chat=chat)
        assert len(ex["prompt_ids"]) == n


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_1", "vt", "cwe", "fwe"])
def test_exact_length_word_level_tokenizer(tiny_tok, task):
    for n in (800, 1777):
        ex = _ex(task, n, tiny_tok, seed=1)
        assert len(ex["prompt_ids"]) == n and ex["chat_template"] is False


# --- split, needles, templates -----------------------------------------------------------------------


@pytest.mark.parametrize("task", NIAH)
def test_niah_split_and_needles(smol, task):
    hay, _, v_kind, num_k, num_v, num_q = ruler._NIAH_ARGS[task]
    for chat in (True, False):
        ex = _ex(task, 1500, smol, seed=7, chat=chat)
        ctx, question = _parts(smol, ex)
        assert len(ex["values"]) == num_v * num_q
        # the asked keys, from the answer prefix
        keys = re.fullmatch(
            r" The special magic \w+ for (.+) mentioned in the provided text (?:is|are)", ex["answer_prefix"]
        ).group(1)
        keys = re.split(r", and |, ", keys)
        assert len(keys) == num_q
        for v in ex["values"]:
            assert v in ctx and v not in question
            assert any(NEEDLE.format(type_needle_v=v_kind, key=k, value=v) in ctx for k in keys)
        # every needle of the real kind is RULER's sentence, whole
        needles = re.findall(rf"One of the special magic {v_kind} for \S+ is: \S+?\.(?=\s|$)", ctx)
        assert len(needles) >= max(num_k, num_q) * num_v
        assert "What is" not in ctx and "What are" not in ctx and "mentioned in the" not in ctx
        assert question.endswith(ex["answer_prefix"])
        assert ("What are all the special magic" in question) == (num_q * num_v > 1)
        assert len(ex["depths"]) == max(num_k, num_q) * num_v and all(0 <= d <= 1 for d in ex["depths"])
        if hay == "noise":
            assert NOISE in ctx
        if chat:
            assert ctx.startswith("<|im_start|>system") and "<|im_start|>user\n" in ctx
            assert "<|im_end|>\n<|im_start|>assistant\n" + ex["answer_prefix"] in question
        else:
            assert "<|im_start|>" not in ex["prompt"]
            assert question.startswith("\nWhat")


def test_niah_template_text_singular_and_plural(smol):
    ex = _ex("niah_single_2", 800, smol, chat=False)
    assert ex["prompt"].startswith(
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\n"
    )
    assert "\nWhat is the special magic number for " in ex["prompt"]
    ex = _ex("niah_multivalue", 800, smol, chat=False)
    assert ex["prompt"].startswith(
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n"
    )
    assert ex["answer_prefix"].endswith(" mentioned in the provided text are")
    ex = _ex("niah_single_3", 800, smol, chat=False)
    assert re.fullmatch(
        r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", ex["values"][0]
    )
    assert "magic uuid for" in ex["answer_prefix"]
    ex = _ex("niah_single_1", 800, smol, chat=False)
    assert re.fullmatch(r"[1-9]\d{6}", ex["values"][0])


def test_noise_needle_lines(smol):
    ex = _ex("niah_single_1", 1200, smol, seed=2, chat=False)
    ctx, _ = _parts(smol, ex)
    lines = ctx.split("\n")[1:]  # after the instruction line
    needle = [ln for ln in lines if ln.startswith("One of")]
    assert len(needle) == 1 and needle[0].endswith(f" is: {ex['values'][0]}.")
    assert all(ln == NOISE for ln in lines[:-1] if not ln.startswith("One of"))


def test_vt_chain_and_split(smol):
    ex = _ex("vt", 1800, smol, seed=4, chat=False)
    ctx, question = _parts(smol, ex)
    names = ex["values"]
    assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", v) for v in names)
    value = re.search(r"assigned the value (\d{5}) in the text above", question).group(1)
    assert f"\nVAR {names[0]} = {value}\n" in ctx
    for a, b in itertools.pairwise(names):
        assert f"\nVAR {b} = VAR {a} \n" in ctx  # RULER's trailing space
    # chain in order through the haystack
    pos = [ctx.index(f"VAR {v} =") for v in names]
    assert pos == sorted(pos)
    assert f"assigned the value {value} in the text above" not in ctx
    # one in-context example with 3-letter names and its answer
    assert ctx.startswith("Memorize and track the chain(s) of variable assignment")
    assert len(re.findall(r"they are:  [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3}\n", ctx)) == 1
    assert question.endswith(ex["answer_prefix"]) and ex["answer_prefix"].startswith(" Answer: According")
    assert "5 variables are assigned the value " + value in ex["answer_prefix"]


def test_cwe_counts(smol):
    ex = _ex("cwe", 4200, smol, seed=5, chat=False)
    ctx, question = _parts(smol, ex)
    body = ctx.split("\n")[-1]  # the task's list (the example and instruction come first)
    words = re.findall(r"\d+\. ([^0-9]+?) (?=\d+\.|$)", body + " ")
    common = ex["values"]
    assert len(common) == 10
    counts = {w: words.count(w) for w in set(words)}
    assert min(counts[w] for w in common) >= 29  # 30 each, the cut may take one
    assert max(c for w, c in counts.items() if w not in common) <= 3
    assert question.startswith("\nQuestion: What are the 10 most common words in the above list?")
    assert "Answer: The top 10 words that appear most often in the list are: 1. " in ctx  # the example


def test_fwe_counts(smol):
    ex = _ex("fwe", 2000, smol, seed=6, chat=False)
    ctx, question = _parts(smol, ex)
    words = ctx.split("coded words. ", 1)[1].split()[:-1]  # the last word may be cut
    top = sorted(set(words), key=words.count, reverse=True)
    assert top[0] == "..." and top[1:4] == ex["values"]
    assert question.startswith("\nQuestion: Do not provide any explanation.")


def test_bos_not_doubled(bpe):
    bos = bpe.bos_token_id
    for chat in (True, False):
        ex = _ex("niah_single_2", 700, bpe, chat=chat)
        assert ex["prompt_ids"][0] == bos and ex["prompt_ids"].count(bos) == 1
    ex = _ex("niah_single_2", 700, bpe, chat=True)
    ctx, question = _parts(bpe, ex)
    assert ctx.startswith("<bos><|user|>\n") and "<|end|>\n<|assistant|>\n The special" in question


def test_chat_template_switch(smol, tiny_tok):
    assert uses_chat_template(smol) and uses_chat_template(smol, "on") and uses_chat_template(smol, True)
    assert not uses_chat_template(smol, "none") and not uses_chat_template(smol, False)
    assert not uses_chat_template(tiny_tok)
    with pytest.raises(ValueError, match="no chat template"):
        uses_chat_template(tiny_tok, True)
    with pytest.raises(ValueError, match="chat_template must be"):
        uses_chat_template(smol, "maybe")


# --- determinism ----------------------------------------------------------------------------------------


def test_dataset_determinism(smol):
    a = make_ruler_dataset("niah_multikey_1", 2, 900, tokenizer=smol, seed=11)
    b = make_ruler_dataset("niah_multikey_1", 2, 900, tokenizer=smol, seed=11)
    c = make_ruler_dataset("niah_multikey_1", 2, 900, tokenizer=smol, seed=12)
    assert a == b and a != c and a[0] != a[1]
    # each (task, seed) its own stream
    first = make_ruler_example(
        "niah_multikey_1", 900, tokenizer=smol, rng=random.Random("ruler:niah_multikey_1:11")
    )
    assert first == a[0]


# --- scoring -------------------------------------------------------------------------------------------


def test_score_ruler():
    assert score_ruler("niah_multivalue", ["123", "456"], "They are 123 and 456.") == (True, 1.0)
    assert score_ruler("niah_multivalue", ["123", "456", "789", "000"], "123, 789") == (False, 0.5)
    assert score_ruler("cwe", ["Apple", "pear"], "1. apple 2. PEAR") == (True, 1.0)
    assert score_ruler("vt", ["ABCDE"], "none here") == (False, 0.0)
    assert score_ruler("fwe", ["abc"], None) == (False, 0.0)
    with pytest.raises(ValueError, match="non-empty"):
        score_ruler("vt", [], "x")
    with pytest.raises(ValueError, match="unknown RULER task"):
        score_ruler("qa_1", ["x"], "x")


# --- errors ----------------------------------------------------------------------------------------------


def test_errors(smol):
    with pytest.raises(ValueError, match="unknown RULER task"):
        _ex("niah_single_4", 1000, smol)
    with pytest.raises(ValueError, match="too short"):
        _ex("niah_multivalue", 100, smol)
    with pytest.raises(ValueError, match="too short"):
        _ex("vt", 400, smol)  # the in-context example alone is about 500 tokens
    with pytest.raises(ValueError, match="positive int"):
        _ex("niah_single_1", 0, smol)
    with pytest.raises(ValueError, match="positive int"):
        _ex("niah_single_1", 1000.0, smol)
    with pytest.raises(ValueError, match="fwe needs"):
        _ex("fwe", 200, smol)
    with pytest.raises(ValueError, match="chat_template must be"):
        _ex("niah_single_1", 1000, smol, chat="yes")
    with pytest.raises(ValueError, match="n must be"):
        make_ruler_dataset("vt", -1, 1000, tokenizer=smol, seed=0)


def test_essay_prompts_wrap_around_the_essay():
    class Tok:  # one token per word, no leading special token
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [len(w) for w in text.split(" ")] if text else []}

    prompts = ruler.essay_prompts(Tok(), 8, 5000)  # 8 x 5000 words > the essay's ~12800: passages wrap around
    assert len(prompts) == 8 and all(len(p) == 5000 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 8


def test_essay_prompts_without_wrap_have_exactly_the_asked_length():
    from tdutils.models import load_tokenizer

    tok = load_tokenizer("tiny-qwen3")
    prompts = ruler.essay_prompts(tok, 5, 40, wrap=False)
    assert [len(p) for p in prompts] == [40] * 5
    assert len({tuple(p) for p in prompts}) == 5  # different passages
    with pytest.raises(ValueError, match="cannot give"):
        ruler.essay_prompts(tok, 10_000, 64, wrap=False)
