"""Datasets: the bundled passkey sample, synthetic passkey prompts, hub ids and local files.

A *passkey* prompt (docs/design.md §8) is filler text with one needle `pass key = d d d d d .` at a random depth
and the question `pass key =` at the very end; the answer is the five digits. The filler is the bundled
English text `assets/sample/filler.txt`, whose words never include the markers `pass`, `key`, `=`.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .models import ASSETS
from .textio import NotUTF8Error, iter_lines, not_utf8_error, read_text

SAMPLE_DIR = ASSETS / "sample"
FILLER_PATH = SAMPLE_DIR / "filler.txt"
SAMPLE_NAME = "sample"
SAMPLE_PATH = SAMPLE_DIR / "passkey_1k.jsonl"
PASSKEY_DIGITS = 5

# Bundled English multiple-choice sample in the demo schema (written by tools/make_mc_sample.py).
MC_SAMPLE_NAME = "mc-sample"
MC_SAMPLE_PATH = SAMPLE_DIR / "mc_sample.jsonl"
# Hub demo datasets (docs/design.md §7): 30 LongBench-v2 rows of 10k-17k Qwen3 tokens, and 10 rows of ~1k tokens.
DEMO_DATASET = "raniayu/token-dropping-demo"
DEMO_DATASET_SHORT = "raniayu/token-dropping-demo-short"
DEMO_COLUMNS = ("prompt", "answer")


@dataclass
class PromptRow:
    """One prompt of a dataset: text, optional gold answer and whatever else the row carried."""

    prompt: str
    answer: str | None = None
    meta: dict = field(default_factory=dict)


def filler_sentences() -> list[str]:
    """Sentences of the bundled filler text (one per line of `filler.txt`)."""
    return [s.strip() for s in read_text(FILLER_PATH).splitlines() if s.strip()]


def filler_words() -> list[str]:
    """Distinct lower-case words and punctuation of the filler, in order of first appearance."""
    seen: dict[str, None] = {}
    for tok in re.findall(r"\w+|[^\w\s]", read_text(FILLER_PATH).lower()):
        seen.setdefault(tok, None)
    return list(seen)


def make_passkey_example(context_tokens: int, *, tokenizer, rng: random.Random, depth: float | None = None) -> dict:
    """One passkey prompt of about `context_tokens` tokens (never more).

    Returns a dict with `prompt`, `answer` (digits separated by spaces, as the tokenizer splits them),
    `depth` (needle position as a fraction of the filler) and `context_tokens` (exact token count).
    """
    digits = [str(rng.randrange(10)) for _ in range(PASSKEY_DIGITS)]
    needle = "pass key = " + " ".join(digits) + " ."
    question = "pass key ="
    # Budget the filler in tokens: the needle and question cost a fixed number of tokens.
    n_fixed = len(tokenizer(needle + " " + question, add_special_tokens=False)["input_ids"])
    budget = context_tokens - n_fixed
    if budget < 1:
        raise ValueError(f"context_tokens={context_tokens} is too short for a passkey prompt (needs > {n_fixed})")
    sentences = filler_sentences()
    start = rng.randrange(len(sentences))
    words: list[str] = []
    i = start
    while len(words) < budget:
        # Sentence tokens: words and punctuation, as the tokenizer splits them.
        words.extend(re.findall(r"\w+|[^\w\s]", sentences[i % len(sentences)]))
        i += 1
    words = words[:budget]
    depth = rng.random() if depth is None else depth
    at = round(depth * len(words))
    text = " ".join(words[:at] + [needle] + words[at:] + [question])
    n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return {"prompt": text, "answer": " ".join(digits), "depth": at / max(1, len(words)), "context_tokens": n}


def make_passkey_dataset(n: int, context_tokens: int, *, tokenizer, seed: int) -> list[dict]:
    """`n` passkey prompts of about `context_tokens` tokens each, reproducible from `seed`.

    Use seeds disjoint from those a model was trained on when evaluating it.
    """
    rng = random.Random(seed)
    return [make_passkey_example(context_tokens, tokenizer=tokenizer, rng=rng) for _ in range(n)]


def load_prompts(dataset: str = SAMPLE_NAME, *, num_requests: int | None = None, split: str = "train",
                 prompt_column: str = "prompt", answer_column: str = "answer") -> list[PromptRow]:
    """Read prompts from the bundled samples, a local file or a Hugging Face hub dataset.

    Generated datasets (a registered task such as `"ruler_niah_single_1"`, made for a model's tokenizer) are
    `tdutils.eval.tasks.load_rows`'s, which reads everything else through this function.

    Args:
        dataset: `"sample"` (bundled: 16 passkey prompts of ~1k tokens), `"mc-sample"` (bundled English
            multiple-choice prompts, see `load_mc_sample`), a local `.jsonl`/`.json`/`.csv`/`.parquet` file, or a
            hub id such as `raniayu/token-dropping-demo-short`.
        num_requests: keep the first `num_requests` rows (None: all). Fewer rows than asked is an error.
        split: the hub split (ignored for local files).
        prompt_column / answer_column: columns holding the prompt text and the gold answer.

    Values arrive exactly as the file holds them (docs/design.md §7): text files are read as UTF-8 (a byte-order mark
    tolerated); a CSV cell is text as written, never type-guessed (`04819` stays `"04819"`, `NA` stays
    `"NA"`), an empty cell is missing (None); JSON/JSONL and Parquet values keep their own types (a null is
    None, an integer never becomes a float); a hub dataset made of CSV files is read like a local CSV. The
    answer is the value as text (`str`), None when missing.

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: the dataset has no rows (an empty file, a CSV header alone), the rows lack `prompt_column`, or
            the dataset has fewer rows than `num_requests`; a file that does not parse (the message names it and
            the line where one is known); a registered task's name (read with `tdutils.eval.tasks.load_rows`).
        NotUTF8Error (a ValueError): a text file that is not UTF-8 (the message names the line and byte offset).
        ConnectionError: a hub dataset that cannot be downloaded (offline); says how to pass a local file.
    """
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rows = _read_rows(dataset, split)
    if not rows:  # an empty file, blank lines only, a CSV header alone, `[]`: nothing to run is not a dataset
        where = f"dataset file {str(Path(dataset).expanduser())!r}" if Path(dataset).expanduser().is_file() \
            else f"dataset {dataset!r}"
        raise ValueError(f"{where} has no rows; give a dataset with at least one row that has a {prompt_column!r} "
                         f"(a CSV needs rows below its header)")
    if isinstance(rows[0], dict) and prompt_column not in rows[0]:
        raise ValueError(f"dataset {dataset!r} has no column {prompt_column!r}; columns: {sorted(rows[0])}. "
                         f"From Python pass load_prompts(..., prompt_column=NAME); the command line reads a column named 'prompt'.")
    if num_requests is not None:
        if len(rows) < num_requests:
            raise ValueError(f"dataset {dataset!r} has {len(rows)} rows, fewer than num_requests={num_requests}")
        rows = rows[:num_requests]
    out = []
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or prompt_column not in r:
            got = f"its columns: {sorted(r)}" if isinstance(r, dict) else f"it is {type(r).__name__} {_short(r)}"
            raise ValueError(f"dataset {dataset!r}: row {i} (counting from 0) has no {prompt_column!r} column ({got}); "
                             f"every row needs a text {prompt_column!r}")
        prompt = r[prompt_column]
        if not isinstance(prompt, str):
            raise ValueError(  # noqa: TRY004 (bad data in a file, as the other row errors: ValueError)
                f"dataset {dataset!r}: row {i} (counting from 0) has a {prompt_column!r} that is not text "
                f"({type(prompt).__name__} {_short(prompt)}); every row needs the prompt as a string")
        if not prompt:  # caught here, with the file and row, rather than as "prompt 0 is empty" at tokenization
            raise ValueError(f"dataset {dataset!r}: row {i} (counting from 0) has an empty {prompt_column!r}; give "
                             f"every row a prompt text, or remove that row")
        meta = {k: v for k, v in r.items() if k not in (prompt_column, answer_column)}
        ans = r.get(answer_column)
        out.append(PromptRow(prompt=prompt, answer=None if ans is None else str(ans), meta=meta))
    return out


RULER_PREFIX = "ruler_"  # task names of RULER's templates: "ruler_" + RULER's own task name (two of which,
# niah_multivalue and niah_multiquery, are also names of word-level tasks)


def locate_text(tokenizer, ids: Sequence[int], text: str) -> tuple[int, int] | None:
    """`(start, length)` of the first run of `ids` that encodes `text` (e.g. a needle or its value), or None.

    A tokenizer may encode a piece differently inside a prompt than alone (a leading space, a merge with the
    neighbour), so the text is tried as is and with a leading space, and, failing both, the shortest run of ids
    whose decoded text contains `text` is returned (found by growing a window from each position; slow on long
    prompts, but only reached when the text straddles token boundaries).
    """
    ids = list(ids)
    for variant in (text, " " + text):
        piece = tokenizer(variant, add_special_tokens=False)["input_ids"]
        for i in range(len(ids) - len(piece) + 1):
            if piece and ids[i:i + len(piece)] == piece:
                return i, len(piece)
    full = tokenizer.decode(ids)
    if text not in full:
        return None
    # the shortest window that decodes to something containing the text (a token holds at least one character)
    for length in range(1, min(len(ids), len(text) + 2) + 1):
        for i in range(len(ids) - length + 1):
            if text in tokenizer.decode(ids[i:i + length]):
                return i, length
    return None


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _close_bundled_name(dataset: str) -> str | None:
    """The bundled dataset name `dataset` looks like a typo of (`"samples"` -> `"sample"`), or None."""
    import difflib

    key = dataset.strip().lower().replace("_", "-")
    names = (SAMPLE_NAME, MC_SAMPLE_NAME)
    if key in names:
        return key
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    return close[0] if close else None


def _read_rows(dataset: str, split: str) -> list[dict]:
    if dataset == SAMPLE_NAME:
        return _read_local(SAMPLE_PATH)
    if dataset == MC_SAMPLE_NAME:
        return _read_local(MC_SAMPLE_PATH)
    path = Path(dataset).expanduser()
    looks_local = path.suffix in (".jsonl", ".json", ".csv", ".parquet") or dataset.startswith((".", "/", "~"))
    if path.exists():
        return _read_local(path)
    if looks_local:
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist; pass an existing .jsonl/.json/.csv/"
                                f".parquet file, a hub id, or {SAMPLE_NAME!r} for the bundled sample")
    # Not a file: a hub id, which has the form owner/name. Fail at once on a typo of a bundled name or a
    # name without a slash, instead of after the hub's retries.
    guess = _close_bundled_name(dataset)
    if guess is not None or "/" not in dataset.strip("/"):
        what = f"dataset {dataset!r} is not a bundled dataset, an existing file or a hub id (owner/name)"
        if guess is not None:
            raise ValueError(f"{what}: did you mean {guess!r}?")
        raise ValueError(f"{what}; pass {SAMPLE_NAME!r} or {MC_SAMPLE_NAME!r} (bundled), a .jsonl/.json/.csv/.parquet "
                         f"file, or a hub id such as {DEMO_DATASET_SHORT!r}")
    return _read_hub(dataset, split)


_FILE_KINDS = {".jsonl": "JSONL", ".json": "JSON", ".csv": "CSV", ".parquet": "Parquet"}


def _read_local(path: Path) -> list[dict]:
    if path.is_dir():
        raise ValueError(f"dataset {str(path)!r} is a folder; pass a .jsonl/.json/.csv/.parquet file")
    if path.suffix not in _FILE_KINDS:
        raise ValueError(f"unsupported dataset file type {path.suffix!r} ({str(path)!r}): use .jsonl, .json, .csv "
                         f"or .parquet")
    try:
        return _parse_local(path)
    except (OSError, NotUTF8Error):  # their messages name the file (and the line) already
        raise
    except Exception as exc:  # json, pandas and pyarrow each raise their own types for a malformed file
        reason = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise ValueError(f"dataset file {str(path)!r} could not be read as {_FILE_KINDS[path.suffix]}: {reason}") from exc


def _parse_local(path: Path) -> list[dict]:
    """Rows of a local file, every value exactly as the file holds it (see `load_prompts`)."""
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(iter_lines(path), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"line {n}: {exc.msg} (column {exc.colno})") from None
        return rows
    if path.suffix == ".json":
        data = json.loads(read_text(path))
        if isinstance(data, dict) and isinstance(data.get("data"), list):  # {"data": [rows]}
            return data["data"]
        if not isinstance(data, list):
            raise ValueError(f"expected a list of rows ([{{\"prompt\": ...}}, ...]) or {{\"data\": [rows]}}, "
                             f"got a JSON {type(data).__name__}; one prompt per line works as .jsonl")
        return data
    if path.suffix == ".csv":
        return _read_csv(path)
    import pyarrow.parquet as pq

    # pyarrow gives each cell its Python value (int stays int, null is None); pandas would turn an integer
    # column with one null into floats (48192 -> 48192.0).
    return pq.read_table(path).to_pylist()


# CSV has no types: every cell is text, read as written ("04819" stays "04819"); an empty cell is missing
# (None). pandas' defaults would guess numbers (04819 -> 4819, a column with an empty cell -> floats) and
# turn "NA", "null", "None", "nan", ... into missing values.
_CSV_TEXT = {"dtype": str, "keep_default_na": False, "na_values": [""], "encoding": "utf-8-sig"}


def _read_csv(path: Path) -> list[dict]:
    import pandas as pd

    try:
        return _missing_as_none(pd.read_csv(path, **_CSV_TEXT).to_dict("records"))
    except UnicodeDecodeError as exc:  # pandas' message has no line; NotUTF8Error finds it
        raise not_utf8_error(path, exc) from None


def _missing_as_none(rows: list[dict]) -> list[dict]:
    """pandas' NaN (an empty CSV cell) -> None, so a missing value reads as missing, never as the float nan."""
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]


def _read_hub(dataset: str, split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(dataset, split=split, **_hub_csv_as_text(dataset, split))
    except Exception as exc:  # datasets raises several types for "offline" / "not found"
        raise ConnectionError(
            f"could not load hub dataset {dataset!r} ({exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
            f"Offline? Download it on a connected machine and pass the local file instead "
            f"(e.g. datasets.load_dataset({dataset!r}, split={split!r}).to_json('demo.jsonl'), then dataset='demo.jsonl'), "
            f"or use {SAMPLE_NAME!r} for the bundled sample."
        ) from exc
    return [dict(r) for r in ds]


def _hub_csv_as_text(dataset: str, split: str) -> dict:
    """`load_dataset` arguments that read a hub dataset made of CSV files as text, as `_read_csv` reads one.

    The `datasets` CSV builder parses with pandas' type guessing unless it is given `features`; those need
    the column names, read from the first row of a streamed copy. Other formats carry their own types
    (JSON, Parquet): no arguments.
    """
    import datasets

    if datasets.load_dataset_builder(dataset).name != "csv":
        return {}
    kw = {k: v for k, v in _CSV_TEXT.items() if k != "dtype"}
    first = next(iter(datasets.load_dataset(dataset, split=split, streaming=True, **kw)), None)
    if first is None:
        return {}
    return {**kw, "features": datasets.Features({c: datasets.Value("string") for c in first})}


def load_demo_dataset(source: str = DEMO_DATASET, split: str = "train") -> list[dict]:
    """Rows of a demo dataset in the demo schema: at least `prompt` (full prompt text) and `answer`.

    Args:
        source: a hub id read through `datasets` (`raniayu/token-dropping-demo`, 30 LongBench-v2 rows of
            10k-17k Qwen3 tokens; `raniayu/token-dropping-demo-short`, 10 rows of ~1k tokens), a local
            `.json`/`.jsonl`/`.parquet` (or `.csv`) file, or `"mc-sample"` for the bundled English
            multiple-choice sample (works offline).
        split: the hub split (ignored for local files).

    Returns:
        One dict per row with every column of the source (e.g. `difficulty`, `length` for scoring).

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: no rows, or rows lacking `prompt` / `answer` (the message names the missing columns).
        ConnectionError: the hub dataset cannot be loaded (offline, unknown id); the message names the
            dataset and how to pass a local file instead.
    """
    try:
        rows = _read_rows(source, split)
    except ConnectionError as exc:
        # _read_hub's message already names the dataset and the local-file route; point to the bundled
        # multiple-choice sample too, since its passkey "sample" hint does not fit a multiple-choice demo.
        raise ConnectionError(f"{exc} For English multiple-choice prompts without network, "
                              f"use {MC_SAMPLE_NAME!r} (bundled).") from exc.__cause__
    if not rows:
        raise ValueError(f"dataset {source!r} has no rows")
    missing = [c for c in DEMO_COLUMNS if any(c not in r for r in rows)]
    if missing:
        lacking = sum(any(c not in r for c in missing) for r in rows)
        hint = ""
        if "prompt" in missing and all(k in rows[0] for k in ("context", "question", "choice_A")):
            hint = " These look like raw LongBench-v2 rows: build prompts with tdutils.answers.build_prompt."
        raise ValueError(f"dataset {source!r} lacks column(s) {missing} ({lacking} of {len(rows)} rows); "
                         f"columns of the first row: {sorted(rows[0])}.{hint}")
    return rows


def load_mc_sample() -> list[dict]:
    """The bundled English multiple-choice sample (`assets/sample/mc_sample.jsonl`), in the demo schema.

    20 rows written by `tools/make_mc_sample.py`: LongBench-v2 0-shot prompts over documents of about
    1,000-2,600 words of public-domain English text from Python's standard library, with one planted fact
    (and, for `hard` rows, a similar decoy fact) at a recorded depth; the question asks for that fact. The
    gold letters are balanced over A-D. Columns: `id`, `prompt`, `answer`, `difficulty` (`easy`/`hard`),
    `length` (`short`/`medium`/`long`), `question`, `choice_A`..`choice_D`, `needle`, `needle_depth`,
    `decoy`, `decoy_depth`, `context_words`, `context_chars`, `source`. See the script for provenance.
    """
    return load_demo_dataset(MC_SAMPLE_NAME)


# --- RULER-style synthetic tasks ----------------------------------------------------------------------------
#
# RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?",
# arXiv:2404.06654) hides several needles in a haystack and asks for one, several or all of their values, or
# follows a chain of variable assignments. These are word-level versions that fit the bundled tokenizer:
# every needle is `pass key W V .` with a key word W taken from `TASK_KEY_WORDS` and a value V of
# `PASSKEY_DIGITS` digits (variable tracking binds a name to another name instead). The key sits right before
# its value, so a lookup is one induction step (Olsson et al., arXiv:2209.11895): find the earlier `W`, copy
# what follows it. (With `pass key W = V .` the bundled 4-layer model copied some needle's value without
# matching its key: every value followed the same `=`.) Each example is a *context* (filler with the needles
# at uniformly random depths) and a *question* appended after it:
#
# | task               | needles                                  | question                 | answer                      |
# |--------------------|------------------------------------------|--------------------------|-----------------------------|
# | `niah_single`      | 1: `pass key W V .`                      | `pass key W`             | `V .`                       |
# | `niah_multikey`    | 4, distinct keys (3 distractors)         | `pass key W` (one key)   | `V .`                       |
# | `niah_multivalue`  | 4, one key, 4 values                     | `pass key every W`       | `V1 , V2 , V3 , V4 .` (document order) |
# | `niah_multiquery`  | 4, distinct keys                         | `pass key W1 W2 W3 W4 ?` (all keys, shuffled) | `W1 V1 , W2 V2 , ... .` |
# | `variable_tracking`| chain `pass key X1 V .`, `pass key X2 X1 .`, ... (4 hops) | `pass key ? V :` | `X1 X2 X3 X4 X5 .` |
#
# The answer is what greedy decoding must produce; `tdutils.answers.score_task` scores it (exact match of all
# gold values, and partial credit). `mode="aware"` prompts are `context + " " + question` (the question is in
# the observation window when the cache is edited); `mode="agnostic"` (kvpress' query-agnostic setting) edits
# the cache of `context` alone and prefills `question` on top of the edited cache (`HFEngine.extend`).

RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking")
TASK_MODES = ("aware", "agnostic")
TASK_NEEDLES = 4  # needles of the multi-needle tasks (RULER's defaults: 4 keys / 4 values / 4 queries)
TASK_HOPS = 4  # variable tracking: assignments after the first (RULER's default num_hops=4)
# Key words and variable names: content words of the filler. They also occur in the filler, as RULER's keys
# may; only `key W =` marks a needle, and the filler never holds `pass`, `key`, `=`, `?` or `:`.
TASK_KEY_WORDS = (
    "town", "river", "baker", "shop", "sun", "hills", "stone", "road", "bread", "weather", "boats", "sea",
    "spring", "fields", "farmers", "corn", "beans", "children", "grass", "water", "school", "church",
    "teacher", "market", "square", "carts", "apples", "fish", "cheese", "wood", "smoke", "miller", "wheel",
    "house", "summer", "families", "baskets", "trees", "lunch", "pond", "evening", "lamps", "workers",
    "streets", "autumn", "wind", "rain", "leaves", "branches", "roofs", "blacksmith", "tools", "farm",
    "weaver", "cloth", "shepherd", "sheep", "winter", "fire", "stories", "songs", "travelers", "inn",
    "meal", "city", "birds", "bridge", "snow", "ice", "woman", "books", "paper", "visitors", "room",
    "doctor", "bag", "cards", "gardens", "animals", "friends",
)


def _words(text: str) -> list[str]:
    """Words and punctuation of `text`, as the bundled word-level tokenizer splits them."""
    return re.findall(r"\w+|[^\w\s]", text)


def _value(rng: random.Random) -> str:
    return " ".join(str(rng.randrange(10)) for _ in range(PASSKEY_DIGITS))


def _haystack(n_words: int, rng: random.Random) -> list[str]:
    """`n_words` consecutive words of the filler, starting at a random sentence."""
    sentences = filler_sentences()
    i = rng.randrange(len(sentences))
    words: list[str] = []
    while len(words) < n_words:
        words.extend(_words(sentences[i % len(sentences)]))
        i += 1
    return words[:n_words]


def _task_parts(task: str, rng: random.Random) -> tuple[list[str], str, str, list[str]]:
    """`(needles in document order, question, answer text, gold values)` of one example of `task`."""
    if task in ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"):
        n = 1 if task == "niah_single" else TASK_NEEDLES
        keys = rng.sample(TASK_KEY_WORDS, 1 if task == "niah_multivalue" else n) * (n if task == "niah_multivalue" else 1)
        values = [_value(rng) for _ in range(n)]
        needles = [f"pass key {k} {v} ." for k, v in zip(keys, values)]
        if task == "niah_multivalue":  # RULER asks "what are all the ... numbers": `every` marks the question
            return needles, f"pass key every {keys[0]}", " , ".join(values) + " .", values
        if task == "niah_multiquery":
            order = rng.sample(range(n), n)
            question = "pass key " + " ".join(keys[i] for i in order) + " ?"
            gold = [f"{keys[i]} {values[i]}" for i in order]
            return needles, question, " , ".join(gold) + " .", gold
        asked = rng.randrange(n)
        return needles, f"pass key {keys[asked]}", values[asked] + " .", [values[asked]]
    if task == "variable_tracking":
        names = rng.sample(TASK_KEY_WORDS, TASK_HOPS + 1)
        value = _value(rng)
        needles = [f"pass key {names[0]} {value} ."] + [f"pass key {b} {a} ." for a, b in itertools.pairwise(names)]
        return needles, f"pass key ? {value} :", " ".join(names) + " .", names
    raise ValueError(f"unknown task {task!r}; choose one of {', '.join(RULER_TASKS)}")


def make_task_example(task: str, context_tokens: int, *, tokenizer, rng: random.Random) -> dict:
    """One RULER-style example (see the table above) of exactly `context_tokens` prompt tokens.

    Needles sit at uniformly random word positions of the filler, in the order the task lists them (a
    variable-tracking chain reads forwards, as in RULER). The prompt (`context + " " + question`) has exactly
    `context_tokens` tokens with the bundled word-level tokenizer (never more with another one).

    Args:
        task: one of `RULER_TASKS`.
        context_tokens: prompt length in tokens, context and question together.
        tokenizer: a Hugging Face tokenizer (counts tokens; the bundled one splits words, punctuation and
            single digits).
        rng: the random stream (the example is a function of its state).

    Returns:
        dict with `task`, `prompt`, `context`, `question`, `answer` (the tokens greedy decoding should produce, words
        separated by spaces; decoded text may join punctuation, e.g. `1 2 3 4 5.`, so score a response with
        `tdutils.answers.score_task(task, values, text)`, not by comparing strings),
        `values` (gold items: values, `key value` pairs or variable names, as `score_task` reads them),
        `depths` (needle starts as fractions of the filler) and `context_tokens` (the prompt's token count).

    Raises:
        ValueError: an unknown task, or `context_tokens` too short to hold the needles and the question.
    """
    needles, question, answer, values = _task_parts(task, rng)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    budget = context_tokens - count(" ".join(needles + [question]))
    if budget < len(needles):
        raise ValueError(f"context_tokens={context_tokens} is too short for a {task} prompt "
                         f"(needs more than {context_tokens - budget + len(needles)} tokens)")
    words = _haystack(budget, rng)
    cuts = sorted(rng.randrange(budget + 1) for _ in needles)
    pieces: list[str] = []
    prev = 0
    for cut, needle in zip(cuts, needles):
        pieces += words[prev:cut] + [needle]
        prev = cut
    context = " ".join(pieces + words[prev:])
    prompt = context + " " + question
    return {"task": task, "prompt": prompt, "context": context, "question": question, "answer": answer,
            "values": values, "depths": [c / max(1, budget) for c in cuts], "context_tokens": count(prompt)}


def make_task_dataset(task: str, n: int, context_tokens: int, *, tokenizer, seed: int) -> list[dict]:
    """`n` examples of `task` (`make_task_example`) of `context_tokens` tokens each, reproducible from `seed`.

    Each (task, seed) pair is its own stream: `random.Random(f"{task}:{seed}")`. Use seeds disjoint from those
    a model was trained on when evaluating it (`tdutils.eval.common`, "Seeds").

    Raises:
        ValueError: an unknown task, `n < 1`, or a context too short for the task.
    """
    if task not in RULER_TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(RULER_TASKS)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(f"{task}:{seed}")
    return [make_task_example(task, context_tokens, tokenizer=tokenizer, rng=rng) for _ in range(n)]
