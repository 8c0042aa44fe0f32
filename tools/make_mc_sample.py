"""Write the bundled English multiple-choice sample `tdutils/assets/sample/mc_sample.jsonl`.

    python tools/make_mc_sample.py                 # rewrites the bundled file (seed 0, 20 rows)
    python tools/make_mc_sample.py --rows 40 --seed 1 --out /tmp/mc.jsonl

Each row is a LongBench-v2 0-shot prompt (`tdutils.answers.build_prompt`) over a document of real English
text with one planted fact (the *needle*) at a recorded depth, and a four-choice question about that fact.
A planted, invented fact (a fictional code, city, name...) cannot be answered from a model's general
knowledge, so a correct answer means the model read it in the context - and a token-dropping policy that
loses the needle loses the answer. `hard` rows also hold a *decoy*: the same kind of fact about a
different object, whose value is one of the wrong choices, so the model must bind the right object to its
value. The gold letter is balanced over A-D; difficulty (`easy`/`hard`) and length (`short`/`medium`/
`long`) labels follow LongBench-v2's names.

Text source and licence: the docstrings of three modules of the running Python's standard library, which
every CPython install has and whose files declare themselves public domain:
`inspect.py` ("This module is in the public domain.  No warranties." - Ka-Ping Yee),
`doctest.py` ("Released to the public domain 16-Jan-2001, by Tim Peters") and
`tabnanny.py` ("Released to the public domain, by Tim Peters, 15 April 1998"). The script checks that each
file still carries its notice and stops otherwise. (Later edits to these files were contributed to
CPython under the PSF contributor agreement; the files keep their public-domain notices.) Only prose
paragraphs are used: doctest examples and indented code are dropped.

Sizes: documents of about 1,000 (short), 1,800 (medium) and 2,600 (long) words. No tokenizer can be
downloaded here, so lengths are set in words; at the usual ~4 characters per token of English BPE
tokenizers (Qwen's included), the documents are roughly 1.6k, 2.9k and 4.1k tokens (the `context_chars`
column gives the exact characters; an estimate, not a count with Qwen's tokenizer). The three modules give
about 4,900 words of prose (Python 3.11), so documents overlap: a long one holds about half of it. The text
depends on the Python version that runs the script; every row records it in `source`, and rerunning with
the same version and seed rewrites the same bytes.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import platform
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run from a checkout without `pip install -e .`: make the repository's tdutils importable.
sys.path.insert(0, str(ROOT))

from tdutils.answers import CHOICES, build_prompt
from tdutils.data import MC_SAMPLE_PATH

# Module -> the notice its source must carry (the licence claim above rests on it).
SOURCES = {
    "inspect": r"This module is in the public domain",
    "doctest": r"Released to the public domain 16-Jan-2001, by Tim Peters",
    "tabnanny": r"Released to the public domain, by Tim Peters",
}
# Target document sizes in words per length label.
LENGTH_WORDS = {"short": 1000, "medium": 1800, "long": 2600}
DIFFICULTIES = ("easy", "hard")

COLOURS = ["red", "blue", "green", "yellow", "orange", "purple", "grey", "white"]
# Needle templates: (key pool, value pool, fact sentence, question). Keys and values are invented so that
# no general knowledge answers the question.
TEMPLATES = [
    {
        "name": "place",
        "keys": [f"{c} notebook" for c in COLOURS],
        "values": ["boathouse", "greenhouse", "attic", "cellar", "chapel", "workshop", "stable", "lighthouse",
                   "bakery", "observatory", "granary", "orchard"],
        "fact": "Note for the archive: the {key} was left in the {value}.",
        "question": "According to the text, where was the {key} left?",
        "choice": "In the {value}",
    },
    {
        "name": "person",
        "keys": ["Bramble", "Lantern", "Pebble", "Juniper", "Kestrel", "Marigold", "Thistle", "Harbour"],
        "values": ["Edith Marlowe", "Tomas Reyes", "Agnes Whitcombe", "Victor Lindqvist", "Priya Natarajan",
                   "Samuel Okafor", "Clara Benedetti", "Hugo Fairbanks"],
        "fact": "The release manager of the {key} project is {value}.",
        "question": "According to the text, who is the release manager of the {key} project?",
        "choice": "{value}",
    },
    {
        "name": "code",
        "keys": [f"{c} cabinet" for c in COLOURS],
        "values": None,  # four-digit codes drawn per row
        "fact": "The access code for the {key} is {value}.",
        "question": "According to the text, what is the access code for the {key}?",
        "choice": "{value}",
    },
    {
        "name": "city",
        "keys": ["translation", "packaging", "benchmark", "archive", "hardware", "outreach"],
        "values": ["Lisbon", "Tallinn", "Valparaiso", "Hobart", "Winnipeg", "Nagoya", "Accra", "Bergen",
                   "Cusco", "Tbilisi"],
        "fact": "The weekly meeting of the {key} team takes place in {value}.",
        "question": "According to the text, in which city does the weekly meeting of the {key} team take place?",
        "choice": "{value}",
    },
    {
        "name": "cargo",
        "keys": ["Albatross", "Northern Star", "Sea Lark", "Good Hope", "Silver Gull", "Morning Tide"],
        "values": ["copper wire", "olive oil", "wool blankets", "rice", "timber", "coffee beans",
                   "glass bottles", "salt"],
        "fact": "The ship {key} left the harbour carrying {value}.",
        "question": "According to the text, what was the ship {key} carrying when it left the harbour?",
        "choice": "{value}",
    },
]


def corpus_paragraphs() -> list[str]:
    """Prose paragraphs of the source modules' docstrings, in module order then source-line order."""
    out: list[str] = []
    seen: set[str] = set()
    for module, notice in SOURCES.items():
        path = Path(importlib.util.find_spec(module).origin)
        source = path.read_text(encoding="utf-8")
        if not re.search(re.escape(notice), source):
            raise SystemExit(f"{path} no longer carries its public-domain notice {notice!r}; "
                             f"check the licence before using it")
        # ast (not the imported module's __doc__) so that `python -OO`, which strips docstrings, changes
        # nothing.
        tree = ast.parse(source)
        nodes = [n for n in ast.walk(tree)
                 if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        nodes.sort(key=lambda n: getattr(n, "lineno", 0))
        for node in nodes:
            doc = ast.get_docstring(node)
            if not doc:
                continue
            for para in re.split(r"\n\s*\n", doc):
                lines = para.splitlines()
                # Doctest examples, their outputs and indented code blocks are not prose.
                if any(ln.lstrip().startswith((">>>", "...")) or ln.startswith("    ") for ln in lines):
                    continue
                text = " ".join(ln.strip() for ln in lines)
                text = re.sub(r"\s+", " ", text).strip()
                words = text.split()
                if len(words) < 8 or not text.endswith((".", "?", "!")):
                    continue
                if sum(w.isalpha() for w in words) < 0.6 * len(words):
                    continue
                if text not in seen:
                    seen.add(text)
                    out.append(text)
    return out


def _absent(phrase: str, corpus_lower: str) -> bool:
    return re.search(r"\b" + re.escape(phrase.lower()) + r"\b", corpus_lower) is None


def _boundary(doc: list[str], target: float) -> int:
    """Index of the paragraph boundary of `doc` nearest to `target` (a fraction of its words)."""
    before = [0]
    for p in doc:
        before.append(before[-1] + len(p.split()))
    return min(range(len(doc) + 1), key=lambda b: abs(before[b] - target * before[-1]))


def _depth(context: str, sentence: str) -> float:
    """Fraction of the document's words that come before `sentence`."""
    return round(len(context[: context.index(sentence)].split()) / len(context.split()), 4)


def make_rows(n_rows: int, seed: int) -> list[dict]:
    """`n_rows` sample rows, reproducible from `seed` (for a given Python version's stdlib text)."""
    rng = random.Random(seed)
    paras = corpus_paragraphs()
    counts = [len(p.split()) for p in paras]
    total_words = sum(counts)
    if max(LENGTH_WORDS.values()) >= total_words:
        raise SystemExit(f"corpus has only {total_words} words; documents would repeat text")
    corpus_lower = " ".join(paras).lower()
    source = (f"Python {platform.python_version()} standard library docstrings of "
              f"{', '.join(m + '.py' for m in SOURCES)} (public domain)")

    # Balanced labels: gold letters, difficulty x length, templates; depths spread evenly over the document.
    golds = [CHOICES[i % 4] for i in range(n_rows)]
    rng.shuffle(golds)
    depths = [(i + 0.5) / n_rows for i in range(n_rows)]
    rng.shuffle(depths)
    rows = []
    for i in range(n_rows):
        difficulty = DIFFICULTIES[i % 2]
        length = list(LENGTH_WORDS)[i % 3]
        tpl = TEMPLATES[i % len(TEMPLATES)]

        # Keys and values that never occur in the corpus, so the planted fact is the only evidence.
        keys = [k for k in tpl["keys"] if _absent(k, corpus_lower)]
        if tpl["values"] is None:
            values = [str(v) for v in rng.sample(range(1000, 10000), 4)]
        else:
            values = rng.sample([v for v in tpl["values"] if _absent(v, corpus_lower)], 4)
        key, decoy_key = rng.sample(keys, 2)
        answer_value = values[0]
        needle = tpl["fact"].format(key=key, value=answer_value)
        decoy = tpl["fact"].format(key=decoy_key, value=values[1]) if difficulty == "hard" else None

        # The document: contiguous paragraphs from a random start (wrapping around) up to the target size.
        start = rng.randrange(len(paras))
        doc: list[str] = []
        words = 0
        j = start
        while words < LENGTH_WORDS[length]:
            doc.append(paras[j % len(paras)])
            words += counts[j % len(paras)]
            j += 1

        # Plant the needle (and decoy) as paragraphs of their own, at the paragraph boundary nearest to
        # the target depth, so no corpus sentence is split.
        plants = [(_boundary(doc, depths[i]), needle)]
        if decoy is not None:
            # A decoy at least a quarter of the document away from the needle.
            far = [d for d in (x / 20 for x in range(1, 20)) if abs(d - depths[i]) >= 0.25]
            plants.append((_boundary(doc, rng.choice(far)), decoy))
        # Insert from the back so earlier boundaries keep their meaning.
        for b, sentence in sorted(plants, key=lambda x: x[0], reverse=True):
            doc.insert(b, sentence)
        context = "\n\n".join(doc)
        all_words = context.split()

        # Choices: the answer at the gold letter, the three other values (the decoy's among them) elsewhere.
        wrong = values[1:]
        rng.shuffle(wrong)
        letter_values = {}
        for c in CHOICES:
            letter_values[c] = answer_value if c == golds[i] else wrong.pop()
        question = tpl["question"].format(key=key)
        choices = {f"choice_{c}": tpl["choice"].format(value=letter_values[c]) for c in CHOICES}
        prompt = build_prompt({"context": context, "question": question, **choices})
        rows.append({
            "id": f"mc-{i:03d}", "prompt": prompt, "answer": golds[i], "difficulty": difficulty,
            "length": length, "question": question, **choices,
            "needle": needle, "needle_depth": _depth(context, needle),
            "decoy": decoy, "decoy_depth": _depth(context, decoy) if decoy else None,
            "context_words": len(all_words), "context_chars": len(context),
            "template": tpl["name"], "source": source,
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=MC_SAMPLE_PATH)
    args = ap.parse_args()
    rows = make_rows(args.rows, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    words = [r["context_words"] for r in rows]
    print(f"wrote {args.out}: {len(rows)} rows, documents of {min(words)}-{max(words)} words, "
          f"{args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
