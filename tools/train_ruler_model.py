r"""Train the bundled model `tiny-qwen3-ruler` on the RULER-style tasks of `tdutils.data` (issue 17), on CPU.

The bundled weights come from nine runs of this script, each continuing the previous one (`--init-from`), one
torch thread each, on the shared 2-core machine (2026-12-01; 388 min in all). A run stops at the end of its `--max-minutes`
budget, or was stopped by hand at a checkpoint (the learning-rate schedule follows the budget given):

    python tools/train_ruler_model.py --lengths 128,256 --recall 0.5 --drop-aug 0 --lr 2e-3 --warmup-steps 50 \
        --max-minutes 10 --save-every 3 --eval-length 256 --out /tmp/r1                  # 1: its 6-minute checkpoint
    python tools/train_ruler_model.py --init-from /tmp/r1 --lengths 128,256 --recall 0.5 --drop-aug 0 \
        --pointer-weight 1 --prev-token-weight 1 --lr 3e-3 --warmup-steps 50 --max-minutes 12 --save-every 3 \
        --eval-length 256 --out /tmp/r2                                                   # 2: its 6-minute checkpoint
    python tools/train_ruler_model.py --init-from /tmp/r2 --recall 0.3 --pointer-weight 1 --prev-token-weight 1 \
        --lr 3e-3 --warmup-steps 50 --max-minutes 55 --save-every 8 --out /tmp/r3         # 3: its 48-minute checkpoint
    python tools/train_ruler_model.py --init-from /tmp/r3 --lengths 256,512,1024,1024,2048,4096 \
        --pointer-max-length 2048 --recall 0.2 --pointer-weight 1 --prev-token-weight 1 --probe-warmup-steps 60 \
        --lr 1e-3 --warmup-steps 20 --max-minutes 30 --save-every 6 --seed 3 --out /tmp/r4  # 4
    python tools/train_ruler_model.py --init-from /tmp/r4 --lengths 1024,2048,4096,4096 --recall 0 \
        --pointer-weight 1 --prev-token-weight 1 --probe-warmup-steps 60 --drop-aug 0.3 --lr 1e-3 \
        --warmup-steps 20 --max-minutes 70 --save-every 10 --eval-length 4096 --seed 5 --threads 1 --out /tmp/r5  # 5
    python tools/train_ruler_model.py --init-from /tmp/r5 --lengths 1024,2048,4096,4096 --recall 0 \
        --pointer-weight 1 --prev-token-weight 1 --drop-aug 0.3 --lr 5e-4 --warmup-steps 20 --max-minutes 33 \
        --save-every 11 --eval-length 4096 --seed 10 --threads 1 --out /tmp/r6                            # 6
    python tools/train_ruler_model.py --init-from /tmp/r6 --lengths 1024,2048,4096,4096 --recall 0 \
        --pointer-weight 1 --prev-token-weight 1 --drop-aug 0.3 --lr 5e-4 --warmup-steps 20 --max-minutes 70 \
        --save-every 10 --eval-length 4096 --seed 20 --threads 1 --out /tmp/r7                            # 7
    python tools/train_ruler_model.py --init-from /tmp/r7 --lengths 1024,2048,4096,4096 --recall 0 \
        --pointer-weight 1 --prev-token-weight 1 --drop-aug 0.3 --lr 4e-4 --warmup-steps 20 --max-minutes 55 \
        --save-every 10 --eval-length 4096 --seed 30 --threads 1 --out /tmp/r8                            # 8
    python tools/train_ruler_model.py --init-from /tmp/r8 --rope-theta 100000 --lengths 1024,2048,4096,4096 \
        --recall 0 --pointer-weight 1 --prev-token-weight 1 --probe-warmup-steps 60 --drop-aug 0.3 --lr 5e-4 \
        --warmup-steps 20 --max-minutes 70 --save-every 10 --eval-length 4096 --seed 50 --threads 1 --out /tmp/r9  # 9

Runs 1 to 3 used earlier states of this script and of the task generator: the needles `pass key W V .` as now,
but the multi-value question `pass key W` (runs 1-3; run 4 retrained it on `pass key every W`, see below), and in
runs 1-2 variable tracking's needles `pass key X2 = X1 .` with no pointer target, one pointer head, and recall
sequences of 2-8 needles. Runs 1-4 computed the pointer loss from eager attention (the same values as
`PointerRows`, ~4x slower at 4096 tokens), so run 4 kept it to 2048 tokens; run 4 left no saved probe, hence
run 5's `--probe-warmup-steps`. Wall-clock budgets make the runs depend on the machine's load; the data stream
is seeded (`TRAIN_SEED_BASE + --seed`).

What it learns (teacher-forced exact match on the development seed 0, n = 100 per task and length, full cache;
after run 4 / run 5 (3611 steps in 70 min) / run 6 (1851 steps in 33 min) / run 7 (3919 steps in 70 min) /
run 8 (2676 steps in 55 min, beside CI)):

| tokens | niah_single | niah_multikey | niah_multivalue | niah_multiquery | variable_tracking |
|---|---|---|---|---|---|
| 1024 | 100 / 99 / 100 / 100 / 100 | 98 / 99 / 98 / 98 / 99 | 87 / 90 / 94 / 97 / 98 | 93 / 91 / 92 / 93 / 95 | 100 / 99 / 100 / 100 / 100 |
| 2048 | 100 / 99 / 100 / 100 / 100 | 83 / 95 / 97 / 99 / 97 | 50 / 90 / 91 / 95 / 96 | 61 / 89 / 90 / 93 / 98 | 88 / 100 / 100 / 99 / 98 |
| 4096 | 60 / 100 / 100 / 100 / 100 | 38 / 83 / 87 / 92 / 91 | 0 / 66 / 73 / 79 / 82 | 5 / 52 / 57 / 72 / 74 | 7 / 81 / 84 / 87 / 87 |

(docs/results.md's table, on the held-out seed, agrees within a few points.) Run 5 trained at 1024-4096 tokens only,
with the pointer loss and the predecessor probe at every length (`PointerRows` made that affordable), and took
2048 tokens from 50-100% to 89-100% on every task, 4096 from 0-60% to 52-100%; 1024 stayed within a few points.
Its teacher-forced exact match at 4096 tokens (dev seed, n = 32) rose over the run, checkpoint by checkpoint: multi-key
50 / 72 / 66 / 78 / 75 / 81%, multi-value 16 / 22 / 34 / 38 / 66 / 62%, multi-query 16 / 19 / 19 / 28 / 38 / 38%:
more steps at these lengths still help, and runs 6-8 (the same recipe at lr 5e-4 / 5e-4 / 4e-4, 158 min) took
4096 tokens further, to 74-100%, and every task at 1k-2k to 95-100% on this seed. Checkpoints at 4096 tokens
(dev seed, n = 32) every 10 min: run 7 multi-value 50 / 75 / 69 / 75 / 84 / 88%, multi-query 34 / 53 / 53 / 59 /
75 / 78%; run 8 multi-value 72 / 75 / 66 / 75 / 88%, multi-query 75 / 72 / 66 / 84 / 72%.
After run 8 the issue's bar (>= 95% on every task at 1k, 2k and 4k tokens) was not met at 4096 tokens, where
the multi-item tasks reached 80.5-91.5% on the held-out seed; run 9 met it (below).
What went wrong at 4096 (attention of the pointer head, the last layer's head 0, on 4 examples per task, run
4's weights): the first digit of a multi-value answer came from a later needle with the same key (document order
is asked for: the model must pick the earliest of four matching needles), and most other errors were a later
digit copied from the wrong needle: a digit is found by the digit before it, and digits repeat across needles.
Tried beside runs 5-7 and not used:
- a deeper sibling of run 7: run 6 with two identity-initialised layers inserted before the pointer layer
  (`--insert-layers 2`, 6 layers, 0.92M parameters), lr 7e-4, seed 21, 68 min beside run 7: 2421 steps (a step
  costs ~1.6x), dev seed n = 100 at 1024 / 2048 / 4096 tokens: multi-key 98 / 96 / 90, multi-value 97 / 96 / 74,
  multi-query 91 / 92 / 67, variable tracking 100 / 99 / 87%: per step about as good as run 7, per minute
  worse (run 7: 98 / 99 / 92, 97 / 95 / 79, 93 / 93 / 72, 100 / 99 / 87%);
- a 45-min sibling of run 5 from its 30-minute checkpoint at 2048-4096 tokens only, pointer weight 3, lr 7e-4:
  4096 tokens better (100 / 89 / 73 / 70 / 86%), 1024 worse (96 / 93 / 83 / 77 / 96%);
- a probe that reads the needle's key word at every value digit and answer position (to make the later digits'
  lookup unambiguous), weight 1, lr 1e-3, 18 min from run 4 as run 5 otherwise: its loss fell only from 4.0 to
  2.0 nats, and multi-value at 1024 tokens scored 0.36 on the training batches at step 1000 (run 5: 0.68); stopped;
- run 5 continued with pointer weight 3 at lr 5e-4: no better at 4096 tokens after 10 min (81 / 44 / 41%
  multi-key / multi-value / multi-query, n = 32); stopped.
Earlier (runs 1-4): on dropped (shorter) caches during training, multi-key at 2048 tokens scored 67-88% while the
full cache scored 25-53%; two continuations of run 4's state with eager attention up to 4096 tokens (219 and 202
steps in 18 and 14 min) were not better.

Run 9: the RoPE base (theta 10000 -> 100000) was what 4096 tokens lacked, not more steps.
- **Diagnosis** (run 8's weights, dev seed, n = 32 per task at 4096 tokens): the wrong answers were needle
  confusion, not dilution over the filler. On a wrong answer token the pointer head put 0.25-0.37 of its
  attention on the right source and 0.63-0.75 on other needles' tokens (typically the same digit of another
  needle), ~0 on the filler; on a right one 0.985 on the source.
- **Why theta.** A key is matched by content in the rotary pairs that turn little over the distance: with
  theta 10000 and head_dim 32, about one of the 16 pairs turns less than 1 radian over 4096 tokens, with
  100000 about four. A larger base for longer contexts: Xiong et al., "Effective Long-Context Scaling of
  Foundation Models", arXiv:2309.16039 (adjusted base frequency); Llama 3 and Qwen ship theta 500000-1000000.
  Changing theta without training breaks the model (run 8's weights at 1024 tokens, dev n = 16: theta 100000
  single 94% / multi-query 12%, theta 500000 50% / 0%), so `--rope-theta` sets it and the run retrains.
- **Run 9** (3051 steps in 70 min, beside a CI run for its first 30 min): dev seed, n = 32 at 4096 tokens, every
  10 min, multi-key 91 / 100 / 97 / 97 / 97 / 100%, multi-value 91 / 97 / 94 / 97 / 97 / 97%, multi-query
  81 / 94 / 91 / 97 / 97 / 100%, variable tracking 97 / 94 / 100 / 100 / 100 / 100% (single 100% throughout).
  Held-out seed, n = 200, full cache (`docs/results/ruler_full.json`), 1024 / 2048 / 4096 tokens: single
  100 / 100 / 100, multi-key 99.0 / 99.5 / 99.0, multi-value 96.5 / 98.5 / 98.5, multi-query 99.0 / 98.5 /
  97.5, variable tracking 99.0 / 99.5 / 100%: >= 95% on every task at every length. Its 30-minute checkpoint
  had 4096 at 89.0-100% but 1024 tokens below run 8 (multi-value 94.0, multi-query 90.0%): the
  remaining 40 min at the decaying learning rate brought both back.
- Tried beside run 9, not used: run 8's recipe continued at theta 10000 (lr 4e-4, seed 40, 33 min; dev n = 32 at
  4096 every 10 min: multi-key 91 / 81 / 91, multi-value 78 / 66 / 69, multi-query 81 / 66 / 69%: no better
  than run 8); the same with the predecessor probe reading tokens t-1..t-3 instead of t-1 (35 min: multi-value
  78 / 81 / 78, multi-query 69 / 69 / 72%); theta 500000 (10 min: multi-key 91, multi-value 97, multi-query 91%,
  behind run 9's 100 / 97 / 94% at 20 min, stopped); run 9's 30-minute checkpoint continued 35 min at
  1024,1024,2048,4096 tokens and lr 3e-4 (dev n = 32 at 1024: 100% on every task after 20 min; not evaluated on
  the held-out seed, as run 9 already met the bar). (Those siblings ran in a session whose script changes, such
  as the t-1..t-3 probe, did not land; the measurements are as seen.)
- Next to try for longer contexts: 8192 tokens with theta 500000 or more (`BATCH` has no 8192 entry yet).

How key matching was learned (measured; the earlier weights copied a needle without matching its key):
- **Needle format.** With `pass key W = V .` and the question `pass key W =`, every value follows the same `=`,
  and the model (grown from the passkey model, which attends from `=` to what follows `=`) copied one needle's
  value without its key: multi-key 14-25% (chance 25%) after four runs (~80 min). The key now sits right before
  its value (`pass key W V .`, question `pass key W`), so the lookup is one induction step.
- **Dense recall alone did not do it.** `make_recall_batch` (2-12 needles, all asked again: ~6 supervised tokens
  per lookup) from the grown model: multi-key stayed at 16-28%, chance level (5 runs of 4-12 min at lr 1e-3 to
  5e-3, in the old and the new format); from random weights, 0% on every task after 2 min.
- **Pointer loss alone did not do it.** Supervising the attention of the last layer's head 0 to the copied
  token (`pointer_sources`): the head put 0.243 of its attention on the right needle's first digit and 0.249 on
  each wrong one (32 examples): the first digit's residual did not hold its key word, so no query could find it.
- **Pointer loss plus the predecessor probe did.** A linear probe that reads token t-1 from the residual at t
  at the pointer layer's input (`--prev-token-weight`; the probe is not part of the model) puts the key word into its
  value's first digit. Multi-key at 256 tokens went from 16% to 75% in 3 min and 100% in 6 min (lr 3e-3; at
  lr 1e-3 it had not moved after 3 min), and the other tasks followed in run 3.
- **The multi-value question.** With the same question `pass key W` for single, multi-key and multi-value, the
  model got every digit of a multi-key answer right but wrote `,` instead of the final `.` 29% of the time (1024
  tokens, run 3): the question did not say whether more values were wanted. RULER words the two questions
  differently too; `pass key every W` took multi-key from 62-65% to 97% at 1024 tokens within 6 min of run 4.

Tasks (`tdutils.data.RULER_TASKS`; Hsieh et al., "RULER", arXiv:2404.06654): single / multi-key / multi-value /
multi-query needles and variable tracking, word-level with the bundled tokenizer, at 128 to 4096 tokens. Examples
come from `tdutils.data.make_task_example`, the generator the evaluation uses, from a `random.Random` stream
seeded with `TRAIN_SEED_BASE + --seed` (evaluation seeds stay below it).

Model: Qwen3 architecture, the tokenizer and vocabulary of `tiny-qwen3`, 4 layers (0.62M parameters) (the 2-layer passkey model's
depth is too little for multi-hop chains and multi-item answers), hidden 128, 4 query heads and 2 KV heads
(GQA group 2) of head_dim 32, RoPE theta 100000 (10000 until run 8; run 9 above).

Training (teacher forcing; the loss is the cross-entropy of the answer tokens only, so the model learns to
look up and copy, never to continue the filler), plus two auxiliary losses on the full-cache steps of contexts up
to `--pointer-max-length` tokens (the model runs with SDPA; `PointerRows` recomputes only the pointer layer's
attention rows at the answer positions: ~1.1 s a step at 4096 tokens on one thread, where eager attention,
which keeps `[B, H, T, T]` for every layer, took ~4 s):
- pointer loss (`--pointer-weight`): -log of the attention that the pointer layer's heads 0 and 1 put on the
  token each answer token copies (`pointer_sources`: head 0 copies the token, head 1 the token before it);
- predecessor probe (`--prev-token-weight`): cross-entropy of a linear probe reading token t-1 from the
  residual at t at the pointer layer's input (the probe is not a model weight: it is saved beside `--out` as
  `OUT.probe.pt` and read back by `--init-from`; `--probe-warmup-steps` lets a fresh one learn alone first when
  continuing a model whose run left no probe);
- dense recall sequences (`--recall`, the fraction of steps of contexts up to 512 tokens; `make_recall_batch`);
- every step draws one task and one context length; batch size shrinks with length (tokens per step ~4k); tasks
  are drawn with weight 0.1 + the error rate of their last 20 full-cache batches;
- lengths by phase of the time budget (`PHASES`): 128-512 for the first 30%, 512-2048 until 60%, then 1024-4096
  (4096 twice as often); `--lengths` draws fixed lengths for the whole run instead;
- AdamW (betas (0.9, 0.95), weight decay 0.01 on matrices), linear warm-up, cosine decay to 5% of lr over the
  wall-clock budget, gradient clipping at 1.0;
- dropped-cache augmentation (`--drop-aug`, default 0.5, lengths >= 512), as `tools/train_tiny_model.py`
  does for passkey: prefill, keep the first 4 tokens, every needle token, the last 16 prefilled tokens and a
  uniform sample of the rest (drop ratio 0.25 / 0.5 / 0.75 / 0.9), re-rotate the kept keys to positions
  0..k-1 and compute the answer loss over that edited cache, half the time in the query-aware flow (the
  question is prefilled before the edit; the last prompt token is fed again, as `HFEngine.decode` does)
  and half in the query-agnostic flow (the context alone is prefilled and edited, then the question is
  prefilled on top, as `HFEngine.extend` does). The K/V of the non-needle tokens after the first needle come
  from a second prefill whose needle keys and values were replaced by random ones, so copies of the answer
  outside the needles point to wrong answers and only the needles themselves can be read (the shortcut
  measured for the passkey model: without decoys random dropping scored as well as SnapKV).

The script saves `model.safetensors` (plus config and tokenizer files) to `--out` every `--save-every` minutes
and at the end, and prints teacher-forced exact match per task at 1024 tokens on the development seed as it goes,
and a final report at 1024, 2048 and 4096 tokens.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch

TRAIN_SEED_BASE = 10_000_000
BATCH = {64: 64, 128: 32, 256: 16, 512: 8, 1024: 4, 2048: 2, 4096: 1}
# (end of phase as a fraction of the time budget, lengths drawn, dropped-cache augmentation on)
PHASES = ((0.30, (128, 256, 512), False), (0.60, (512, 1024, 2048), True),
          (1.01, (1024, 2048, 4096, 4096), True))
AUG_MIN_LENGTH = 512
RECALL_MAX_LENGTH = 512  # longest context of the dense recall sequences
AUG_DROP_RATIOS = (0.25, 0.5, 0.75, 0.9)
REPORT_LENGTHS = (1024, 2048, 4096)
ARCH = {"num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 8192}


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_batch(task: str, length: int, batch: int, *, tokenizer, rng: random.Random):
    """`(prompt [B, T], answer [B, A], context_len)` for `batch` examples of `task` at `length` tokens.

    Prompts of one task and length have the same token count and the same question length (the generator
    fills to exactly `length` with the bundled tokenizer), so they stack without padding.
    """
    from tdutils.data import make_task_example

    prompts, answers, ctx = [], [], set()
    for _ in range(batch):
        ex = make_task_example(task, length, tokenizer=tokenizer, rng=rng)
        prompts.append(encode(tokenizer, ex["prompt"]))
        answers.append(encode(tokenizer, ex["answer"]))
        ctx.add(len(encode(tokenizer, ex["context"])))
    if len({len(p) for p in prompts}) != 1 or len({len(a) for a in answers}) != 1 or len(ctx) != 1:
        raise RuntimeError(f"{task}: examples of unequal length; the generator changed")
    return torch.tensor(prompts), torch.tensor(answers), ctx.pop()


def make_recall_batch(length: int, batch: int, *, tokenizer, rng: random.Random):
    """`(ids [B, T], labels [B, T], sources [B, T])`: dense associative-recall sequences of `length` tokens.

    Each sequence holds 2-12 needles `pass key W V .` (distinct keys; fewer in short sequences) in filler, then
    some of them asked again in the same form, in random order. `labels` are the value digits and the closing `.`
    of each asked needle (-100 elsewhere): every asked key gives 6 supervised tokens that only a key match can
    predict (several needles compete), where a task example gives one lookup; the signal of multi-query
    associative recall (MQAR; Arora et al., "Zoology", arXiv:2312.04927). `sources` is the needle position each
    label is copied from (-1: none), the target of the pointer loss (see `pointer_sources`).
    """
    from tdutils.data import TASK_KEY_WORDS, _haystack, _value

    ids, labels, sources = [], [], []
    for _ in range(batch):
        n = rng.randint(2, max(2, min(12, length // 21)))  # needles and their questions fill up to ~95%
        keys = rng.sample(TASK_KEY_WORDS, n)
        values = [_value(rng) for _ in range(n)]
        asked = rng.sample(range(n), rng.randint(1, n))
        needles = [encode(tokenizer, f"pass key {k} {v} .") for k, v in zip(keys, values)]
        q_ids, q_lab, q_src = [], [], []
        for i in asked:
            head = encode(tokenizer, f"pass key {keys[i]}")
            tail = encode(tokenizer, f"{values[i]} .")
            q_ids += head + tail
            q_lab += [-100] * (len(head) - 1) + tail + [-100]
            q_src += [(-1, 0)] * (len(head) - 1) + [(i, j) for j in range(len(tail))] + [(-1, 0)]
        budget = length - sum(map(len, needles)) - len(q_ids)
        if budget < n:
            raise ValueError(f"length {length} is too short for {n} needles")
        words = encode(tokenizer, " ".join(_haystack(budget, rng)))[:budget]
        cuts = sorted(rng.randrange(budget + 1) for _ in needles)
        seq, prev, value_at = [], 0, []
        for cut, needle in zip(cuts, needles):
            seq += words[prev:cut]
            value_at.append(len(seq) + 3)  # `pass key W` then the value's first digit
            seq += needle
            prev = cut
        seq += words[prev:]
        ids.append(seq + q_ids)
        labels.append([-100] * len(seq) + q_lab)  # labels[t] is the token at t + 1 (-100: no loss)
        sources.append([-1] * len(seq) + [value_at[i] + j if i >= 0 else -1 for i, j in q_src])  # head 0
    return torch.tensor(ids), torch.tensor(labels), torch.tensor(sources)


def pointer_sources(task: str, prompt: list[int], answer: list[int], ids: dict[str, int]) -> list[tuple[int, int]]:
    """`(prompt position, pointer head)` each answer token is copied from (`(-1, 0)`: none, e.g. a separator).

    The pointer loss trains two attention heads of the pointer layer to attend, at the position that predicts
    answer token j, to the prompt token the answer copies there. Head 0 copies the token itself: the asked
    needle's digits, the question's key (multi-query). Head 1 copies the token *before* it: a variable-tracking
    name, read at the value it is bound to (`pass key X2 X1 .`: after `X1`, attend to that `X1` and emit `X2`;
    the first name is read at its number's first digit). The lookup (which needle) is what the answer loss alone
    trains only through the copied token; measured, it stayed at chance without this signal.
    """
    needles = [i for i in range(len(prompt) - 1) if prompt[i] == ids["pass"] and prompt[i + 1] == ids["key"]]
    question, needles = needles[-1], needles[:-1]  # every needle is `pass key W X ... .`, X at i + 3
    if task == "variable_tracking":  # the chain's needles in order; the answer lists their names, then `.`
        return [(needles[k] + 3, 1) for k in range(len(answer) - 1)] + [(-1, 0)]
    keyed = {}
    for i in needles:
        keyed.setdefault(prompt[i + 2], []).append(i)
    digits = lambda i: [(i + 3 + j, 0) for j in range(5)]
    if task == "niah_multiquery":  # `pass key W1 W2 W3 W4 ?` -> `W1 d d d d d , W2 ... .`
        out = []
        for k in range(len(answer) // 7):
            out += [(question + 2 + k, 0)] + digits(keyed[prompt[question + 2 + k]][0]) + [(-1, 0)]
        return out
    asked = keyed[prompt[-1]]  # `pass key W` (multi-value: `pass key every W`)
    if task == "niah_multivalue":
        return [x for i in asked for x in digits(i) + [(-1, 0)]]
    return digits(asked[0]) + [(asked[0] + 8, 0)]  # the digits and the needle's `.`


class PointerRows:
    """Attention rows of one layer's heads, recomputed only where the pointer loss needs them.

    A forward pre-hook keeps the layer's attention input (`hidden_states` `[B, T, hidden]`, RoPE `cos`/`sin`);
    `hit` recomputes q for the queried positions and k for all positions, exactly as `Qwen3Attention.forward`
    does (q/k projections, per-head q_norm/k_norm, RoPE, `scaling`, causal mask), and returns the softmax weight
    on each source. The model itself runs with SDPA, so a step costs O(T) memory per row instead of eager
    attention's `[B, H, T, T]` for every layer: the pointer loss at 4096 tokens goes from ~4 s a step to ~1 s.
    """

    def __init__(self, attn):
        self.attn, self.saved = attn, None
        self.handle = attn.register_forward_pre_hook(self._keep, with_kwargs=True)

    def _keep(self, module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        pos = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
        self.saved = (hidden, pos)

    def hit(self, b: torch.Tensor, head: torch.Tensor, qpos: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """`[N]` attention weight of query head `head` at position `qpos` on `src` (all `[N]`, batch rows `b`)."""
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        attn, (hidden, (cos, sin)) = self.attn, self.saved
        B, T, _ = hidden.shape
        d = attn.head_dim
        cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)  # position_ids are shared: [1, T, d]
        q = attn.q_norm(attn.q_proj(hidden[b, qpos]).view(len(b), -1, d))  # [N, Hq, d]
        q = q[torch.arange(len(b)), head]  # [N, d]
        k = attn.k_norm(attn.k_proj(hidden).view(B, T, -1, d)).transpose(1, 2)  # [B, Hkv, T, d]
        # RoPE of the queries at their own positions, of the keys at all positions
        q, _ = apply_rotary_pos_emb(q[:, None, None], q[:, None, None], cos[b, qpos][:, None], sin[b, qpos][:, None])
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        group = attn.config.num_attention_heads // attn.config.num_key_value_heads
        k = k[b, head // group]  # [N, T, d]
        logits = torch.einsum("nd,ntd->nt", q[:, 0, 0], k) * attn.scaling  # [N, T]
        logits = logits.masked_fill(torch.arange(T)[None] > qpos[:, None], float("-inf"))
        return logits.float().softmax(-1).gather(1, src[:, None])[:, 0]


def needle_mask(prompt: torch.Tensor, context_len: int, pass_id: int, dot_id: int) -> torch.Tensor:
    """`[B, T]` bool: the tokens of every needle `pass key ... .` inside the context."""
    mask = torch.zeros_like(prompt, dtype=torch.bool)
    for b, row in enumerate(prompt[:, :context_len].tolist()):
        inside = False
        for i, t in enumerate(row):
            inside = inside or t == pass_id
            mask[b, i] = inside
            if inside and t == dot_id:
                inside = False
    return mask


def decoy(prompt: torch.Tensor, mask: torch.Tensor, swap: dict[int, list[int]], rng: random.Random) -> torch.Tensor:
    """`prompt` with every needle digit and key word replaced by another random one of its kind."""
    out = prompt.clone()
    for b, i in mask.nonzero().tolist():
        t = int(prompt[b, i])
        if t in swap:
            choices = swap[t]
            out[b, i] = choices[rng.randrange(len(choices))]
    return out


def prefill_layers(model, ids: torch.Tensor, kw: str):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache})
    return [(lay.keys, lay.values) for lay in cache.layers]


def edited_logits(model, prefix: torch.Tensor, keep: torch.Tensor, suffix: torch.Tensor, n_out: int,
                  inv_freq: torch.Tensor, kw: str, decoy_prefix: torch.Tensor | None = None,
                  late: torch.Tensor | None = None) -> torch.Tensor:
    """Logits `[B, n_out, vocab]` of the last `n_out` suffix positions, decoded over an edited cache.

    Prefills `prefix` `[B, T]`, keeps rows `keep` `[B, k]` (sorted), re-rotates their keys from positions
    `keep[b, i]` to `i` (k cos(d) + rotate_half(k) sin(d), d = (i - keep[b, i]) inv_freq; a differentiable
    `tdutils.rope.rerotate_keys`) and feeds `suffix` `[B, S]` at positions k..k+S-1. With `decoy_prefix` and
    `late` (`[B, T]` bool), the K/V of the `late` positions come from a prefill of `decoy_prefix`.
    """
    from transformers import DynamicCache

    layers = prefill_layers(model, prefix, kw)
    if decoy_prefix is not None:
        other = prefill_layers(model, decoy_prefix, kw)
        sel = late[:, None, :, None]  # [B, 1, T, 1]
        layers = [(torch.where(sel, ok, kk), torch.where(sel, ov, vv)) for (kk, vv), (ok, ov) in zip(layers, other)]
    from train_tiny_model import kept_rerotated  # a sibling script: tools/ is on sys.path when this one runs

    B, k = keep.shape
    edited = DynamicCache(config=model.config)
    for i, (keys, values) in enumerate(kept_rerotated(layers, keep, inv_freq)):
        edited.update(keys, values, i)
    positions = torch.arange(k, k + suffix.shape[1])[None].expand(B, -1)
    return model(input_ids=suffix, position_ids=positions, use_cache=True, logits_to_keep=n_out, **{kw: edited}).logits


def random_keep(mask: torch.Tensor, length: int, ratio: float, rng: random.Random) -> torch.Tensor:
    """`[B, k]` sorted kept indices of a `length`-token prefix: first 4, needle tokens, last 16, random rest."""
    from tdutils.selection import keep_count

    k = keep_count(length, ratio)
    rows = []
    for b in range(mask.shape[0]):
        protected = set(range(4)) | set(range(length - 16, length)) | set(mask[b, :length].nonzero().flatten().tolist())
        if len(protected) >= k:
            protected = set(sorted(protected)[:k]) if len(protected) > k else protected
        rest = [i for i in range(length) if i not in protected]
        rows.append(sorted(protected | set(rng.sample(rest, max(0, k - len(protected))))))
    width = min(len(r) for r in rows)
    return torch.tensor([r[:width] if len(r) == width else sorted(r)[:width] for r in rows])


@torch.no_grad()
def exact_match(model, tokenizer, task: str, length: int, *, n: int, seed: int, batch: int) -> float:
    """Teacher-forced exact match (every answer token the argmax = greedy decoding gives the answer)."""
    from tdutils.data import make_task_dataset

    model.eval()
    model.config._attn_implementation = "sdpa"
    rows = make_task_dataset(task, n, length, tokenizer=tokenizer, seed=seed)
    correct = 0
    for s in range(0, n, batch):
        chunk = rows[s:s + batch]
        ans = [encode(tokenizer, r["answer"]) for r in chunk]
        ids = torch.tensor([encode(tokenizer, r["prompt"]) + a[:-1] for r, a in zip(chunk, ans)])
        tgt = torch.tensor(ans)
        pred = model(input_ids=ids, logits_to_keep=tgt.shape[1], use_cache=False).logits.argmax(-1)
        correct += int((pred == tgt).all(-1).sum())
    model.train()
    return correct / n


def grow_from_passkey_model(model, folder: Path) -> None:
    """Initialise `model` (4 layers) from the 2-layer passkey model so that it computes the same function.

    Embeddings, final norm and layers 0-1 are copied; the added layers keep their random attention and MLP
    weights but start with zero output projections (`o_proj`, `down_proj`), so they add nothing to the
    residual stream until training grows them (depth up-scaling with identity-initialised blocks). The
    passkey model has already formed the copy (induction) circuits every task here needs; measured from a
    random initialisation, 800 steps over 20 minutes left every task at 0% exact match.
    """
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise SystemExit(f"passkey weights do not fit the grown model: unexpected {unexpected}")
    model.tie_weights()
    with torch.no_grad():
        for layer in model.model.layers[2:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def insert_layers(model, n: int):
    """A copy of `model` with `n` identity-initialised decoder layers inserted before its last layer.

    The pointer layer (the last) keeps its weights and stays last; the new layers sit between it and the
    layers that build its inputs, where the failures at 4096 tokens say more capacity is wanted (the later
    digits of a value must be told apart by the needle they belong to). Each new layer has random attention
    and MLP weights but zero output projections (`o_proj`, `down_proj`), so the grown model computes the same
    function as `model` until training moves them (depth up-scaling, as `grow_from_passkey_model`).
    """
    from transformers import Qwen3ForCausalLM

    old = model.config.num_hidden_layers
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.num_hidden_layers = old + n
    config.layer_types = [model.config.layer_types[0]] * (old + n)
    grown = Qwen3ForCausalLM(config)
    src = model.state_dict()
    # old layer i -> new layer i for i < old - 1; the last old layer -> the last new layer
    remap = {f"model.layers.{old - 1}.": f"model.layers.{old + n - 1}."}
    state = {}
    for key, value in src.items():
        for a, b in remap.items():
            if key.startswith(a):
                key = b + key[len(a):]
        state[key] = value
    missing, unexpected = grown.load_state_dict(state, strict=False)
    new = {f"model.layers.{i}." for i in range(old - 1, old - 1 + n)}
    if unexpected or any(not any(k.startswith(p) for p in new) for k in missing):
        raise SystemExit(f"cannot insert layers: missing {missing}, unexpected {unexpected}")
    grown.tie_weights()
    with torch.no_grad():
        for layer in grown.model.layers[old - 1:old - 1 + n]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return grown


def probe_path(out: Path) -> Path:
    """Where a run keeps its predecessor probe: beside the model folder, never in it (not a model weight)."""
    return out.parent / f"{out.name}.probe.pt"


def save(model, tokenizer_dir: Path, out: Path, probe: torch.nn.Module) -> None:
    """The model, config and tokenizer files into `out`; the predecessor probe beside it (`probe_path`)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "tmp-save"
    model.save_pretrained(tmp)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        if (tmp / name).exists():
            shutil.move(str(tmp / name), str(out / name))
    shutil.rmtree(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    torch.save(probe.state_dict(), probe_path(out))


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written (its commands keep their line breaks) and each option's default (none shown for
    options whose default is None: their help says what happens without them)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def main(argv=None) -> int:
    summary, _, history = __doc__.partition("\n\n")
    # options first; the runs and measurements (~140 lines) follow them
    from tdutils.cli.args import (  # bad options in one line, exit 2, as the other commands
        OneLineParser,
        usable_cores,
    )

    ap = OneLineParser(description=summary, epilog=history, formatter_class=_HelpFormatter)
    ap.add_argument("--seed", type=int, default=0,
                    help="data stream TRAIN_SEED_BASE + seed (give a continuation its own, or it replays its parent's)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    ap.add_argument("--min-lr-ratio", type=float, default=0.05, help="final lr / peak lr of the cosine decay")
    ap.add_argument("--warmup-steps", type=int, default=100, help="steps of linear lr warm-up")
    ap.add_argument("--drop-aug", type=float, default=0.5,
                    help="fraction of steps (contexts >= 512 tokens) on a randomly dropped cache")
    ap.add_argument("--max-minutes", type=float, default=60.0,
                    help="wall-clock budget; the lr schedule follows it")
    ap.add_argument("--save-every", type=float, default=10.0, help="minutes between checkpoints")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default 2, or the cores this process may use where fewer)")
    ap.add_argument("--tasks", default=None, help="comma-separated subset of RULER_TASKS (default: all five)")
    ap.add_argument("--init-from", type=Path, default=None, help="model folder to continue from")
    ap.add_argument("--rope-theta", type=float, default=None,
                    help="set the RoPE base frequency (config rope_parameters.rope_theta) before training; a larger "
                         "base turns the low-frequency rotary pairs slower, so content matching survives longer "
                         "distances (adjusted base frequency: Xiong et al., 2023, arXiv:2309.16039). Default: keep "
                         "the --init-from model's (10000 for a new model)")
    ap.add_argument("--insert-layers", type=int, default=0,
                    help="with --init-from: insert this many identity-initialised layers before the last (pointer) "
                         "layer, so the continued model starts from the same function with more depth")
    ap.add_argument("--scratch", action="store_true",
                    help="random initial weights instead of growing the passkey model tiny-qwen3")
    ap.add_argument("--eval-n", type=int, default=100, help="examples per task and length of the final report")
    ap.add_argument("--recall", type=float, default=0.0,
                    help="fraction of steps on dense recall sequences (make_recall_batch) instead of task examples")
    ap.add_argument("--pointer-weight", type=float, default=0.0,
                    help="weight of the pointer loss (pointer_sources) on full-cache steps")
    ap.add_argument("--pointer-max-length", type=int, default=4096,
                    help="longest context of the pointer and predecessor losses")
    ap.add_argument("--pointer-layer", type=int, default=-1, help="layer of the pointer head (-1: the last)")
    ap.add_argument("--pointer-head", type=int, default=0,
                    help="first of the two query heads trained as pointer heads (pointer_sources)")
    ap.add_argument("--prev-token-weight", type=float, default=0.0,
                    help="weight of the auxiliary loss that a linear probe reads each token's predecessor from the "
                         "input of the pointer layer (puts the key word into its value's first digit)")
    ap.add_argument("--probe-warmup-steps", type=int, default=0,
                    help="steps in which the predecessor probe learns alone (use when continuing a trained model)")
    ap.add_argument("--eval-length", type=int, default=1024, help="context length of the checkpoint evaluations")
    ap.add_argument("--lengths", default=None,
                    help="fine-tuning: draw these lengths (comma-separated, repeat one to weight it) for the whole "
                         "run, with dropped-cache augmentation, instead of the phases")
    ap.add_argument("--out", type=Path, required=True,
                    help="folder the model is saved to (the predecessor probe goes beside it, OUT.probe.pt); to "
                         "update the bundled model, copy OUT/model.safetensors into tdutils/assets/tiny-qwen3-ruler")
    args = ap.parse_args(argv)

    from transformers import AutoConfig, Qwen3ForCausalLM

    from tdutils.data import RULER_TASKS, TASK_KEY_WORDS
    from tdutils.models import ASSETS, TINY_MODEL_DIR, load_tokenizer
    from tdutils.rope import RopeSpec

    tasks = args.tasks.split(",") if args.tasks else list(RULER_TASKS)
    if unknown := [t for t in tasks if t not in RULER_TASKS]:
        ap.error(f"unknown tasks {unknown}; choose from {RULER_TASKS}")
    out = args.out
    if out.resolve().is_relative_to(ASSETS.resolve()):
        ap.error(f"--out {out} is inside the package's assets ({ASSETS}); write to another folder and copy "
                 "model.safetensors into tdutils/assets/tiny-qwen3-ruler once its figures are checked")
    if args.init_from is not None and not (args.init_from / "config.json").is_file():
        ap.error(f"--init-from {args.init_from} is not a model folder (no config.json); pass the --out folder of "
                 "an earlier run or tdutils/assets/tiny-qwen3-ruler")
    for name in ("max_minutes", "save_every"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0 minutes, got {getattr(args, name)}")
    if args.insert_layers < 0:
        ap.error(f"--insert-layers must be a count >= 0, got {args.insert_layers}")
    if args.insert_layers and args.init_from is None:
        ap.error("--insert-layers needs --init-from (the trained model to grow)")
    cores = usable_cores()
    if args.threads is None:
        args.threads = min(2, cores)
    if not 1 <= args.threads <= cores:
        ap.error(f"--threads must be between 1 and the {cores} CPU core(s) this process may use, got {args.threads}")
    if out.exists() and not out.is_dir():  # found now, not by the save after the whole budget
        ap.error(f"--out {out} is a file; give a folder (new or from an earlier run) for the model")
    if not 0 < args.lr < math.inf:
        ap.error(f"--lr must be a finite number > 0, got {args.lr}")
    if args.rope_theta is not None and not 1 < args.rope_theta < math.inf:
        ap.error(f"--rope-theta must be > 1 and finite (the RoPE base frequency, e.g. 100000), got {args.rope_theta}")
    for name in ("drop_aug", "recall"):
        if not 0 <= getattr(args, name) <= 1:
            ap.error(f"--{name.replace('_', '-')} must be a fraction of steps in [0, 1], got {getattr(args, name)}")
    if args.eval_length not in BATCH:
        ap.error(f"--eval-length must be one of the trained lengths {sorted(BATCH)}, got {args.eval_length}")
    if args.eval_n < 1:
        ap.error(f"--eval-n must be >= 1 examples per task, got {args.eval_n}")
    phases = PHASES
    if args.lengths:
        try:
            fixed = tuple(int(x) for x in args.lengths.split(","))
        except ValueError:
            ap.error(f"--lengths must be comma-separated integers such as 1024,2048,4096, got {args.lengths!r}")
        if any(n not in BATCH for n in fixed):
            ap.error(f"--lengths must be taken from {sorted(BATCH)}, got {args.lengths!r}")
        phases = ((1.01, fixed, True),)
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(str(TINY_MODEL_DIR))
    torch.manual_seed(args.seed)
    if args.init_from is not None:
        config = AutoConfig.from_pretrained(args.init_from)
        if args.rope_theta is not None:
            config.rope_parameters["rope_theta"] = args.rope_theta
        model = Qwen3ForCausalLM.from_pretrained(args.init_from, config=config)
        if args.insert_layers:
            model = insert_layers(model, args.insert_layers)
            print(f"inserted {args.insert_layers} identity-initialised layer(s) before the last: "
                  f"{model.config.num_hidden_layers} layers", flush=True)
    else:
        config = AutoConfig.from_pretrained(TINY_MODEL_DIR)
        for key, value in ARCH.items():
            setattr(config, key, value)
        config.layer_types = ["full_attention"] * ARCH["num_hidden_layers"]
        if args.rope_theta is not None:
            config.rope_parameters["rope_theta"] = args.rope_theta
        model = Qwen3ForCausalLM(config)
        if not args.scratch:
            grow_from_passkey_model(model, TINY_MODEL_DIR)
    model.train()
    import inspect

    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    inv_freq = RopeSpec.from_config(model.config).inv_freq.float()
    pass_id, dot_id = tokenizer.convert_tokens_to_ids(["pass", "."])
    digits = tokenizer.convert_tokens_to_ids([str(d) for d in range(10)])
    keys = tokenizer.convert_tokens_to_ids(list(TASK_KEY_WORDS))
    tok_ids = dict(zip(("pass", "key"), tokenizer.convert_tokens_to_ids(["pass", "key"])))
    ptr_stats: list[float] = []
    swap = {t: [u for u in digits if u != t] for t in digits} | {t: [u for u in keys if u != t] for t in keys}
    print(f"tiny-qwen3-ruler: {sum(p.numel() for p in model.parameters())} parameters, tasks {tasks}, "
          f"threads {torch.get_num_threads()}, data seed {TRAIN_SEED_BASE + args.seed}", flush=True)

    n_layers = model.config.num_hidden_layers
    if not -n_layers <= args.pointer_layer < n_layers:
        ap.error(f"--pointer-layer {args.pointer_layer} is not a layer of this {n_layers}-layer model; give "
                 f"0..{n_layers - 1} or -1 for the last")
    n_heads = model.config.num_attention_heads
    if not 0 <= args.pointer_head <= n_heads - 2:  # heads pointer_head and pointer_head + 1 are trained
        ap.error(f"--pointer-head {args.pointer_head} must be 0..{n_heads - 2} in this {n_heads}-head model (it and the "
                 "next head are the two pointer heads)")
    rows = PointerRows(model.model.layers[args.pointer_layer].self_attn)
    probe = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    if args.init_from is not None and probe_path(args.init_from).exists():  # continue with the run's probe
        probe.load_state_dict(torch.load(probe_path(args.init_from)))
        print(f"predecessor probe from {probe_path(args.init_from)}", flush=True)
    elif args.prev_token_weight > 0 and args.init_from is not None and args.probe_warmup_steps == 0:
        print(f"note: {args.init_from} has no saved probe ({probe_path(args.init_from).name}); a fresh one starts "
              "from random weights: pass --probe-warmup-steps 60 so it learns before it moves the model", flush=True)
    prev_stats: list[float] = []
    decay = [p for p in model.parameters() if p.dim() >= 2] + list(probe.parameters())
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    rng = random.Random(TRAIN_SEED_BASE + args.seed)
    t0 = time.perf_counter()
    budget = 60 * args.max_minutes
    next_save = 60 * args.save_every
    step = 0
    stats: dict[tuple[str, int, str], list[float]] = {}
    full_acc: dict[str, list[float]] = {}
    while (elapsed := time.perf_counter() - t0) < budget:
        frac = elapsed / budget
        lengths, aug = next((ls, a) for end, ls, a in phases if frac < end)
        length = rng.choice(lengths)
        # Tasks the model has not learned yet are drawn more often (weight 0.1 + error rate of the last 20
        # full-cache batches): measured with uniform draws, single-needle retrieval reached 100% in 10 min
        # while the multi-needle tasks stayed near chance.
        err = {t: 1 - sum(full_acc.get(t, [0.0])[-20:]) / len(full_acc.get(t, [0.0])[-20:]) for t in tasks}
        task = rng.choices(tasks, weights=[0.1 + err[t] for t in tasks])[0]
        lr = args.lr * min(1.0, (step + 1) / args.warmup_steps)
        lr *= args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        for g in opt.param_groups:
            g["lr"] = lr
        ptr = args.pointer_weight > 0 and length <= args.pointer_max_length
        hidden = args.prev_token_weight > 0 and length <= args.pointer_max_length
        if length <= RECALL_MAX_LENGTH and rng.random() < args.recall:
            task, kind = "recall", "full"
            ids, labels, sources = make_recall_batch(length, BATCH[length], tokenizer=tokenizer, rng=rng)
            res = model(input_ids=ids, use_cache=False, output_hidden_states=hidden)
            logits = res.logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
            sup = labels != -100
            acc = float(((logits.argmax(-1) == labels) | ~sup).all(-1).float().mean())
            qpos = torch.arange(ids.shape[1])[None].expand_as(ids)
            heads = torch.zeros_like(sources)
        else:
            prompt, answer, ctx = make_batch(task, length, BATCH[length], tokenizer=tokenizer, rng=rng)
            n_out = answer.shape[1]
            kind = "full"
            if aug and length >= AUG_MIN_LENGTH and rng.random() < args.drop_aug:
                ptr = hidden = False
                kind = rng.choice(("aware", "agnostic"))
                mask = needle_mask(prompt, ctx, pass_id, dot_id)
                first = mask.float().argmax(1)  # [B] first needle token
                late = (torch.arange(prompt.shape[1])[None] > first[:, None]) & ~mask
                fake = decoy(prompt, mask, swap, rng)
                ratio = rng.choice(AUG_DROP_RATIOS)
                cut = prompt.shape[1] - 1 if kind == "aware" else ctx
                keep = random_keep(mask, cut, ratio, rng)
                suffix = torch.cat([prompt[:, cut:], answer[:, :-1]], 1)
                logits = edited_logits(model, prompt[:, :cut], keep, suffix, n_out, inv_freq, kw,
                                       fake[:, :cut], late[:, :cut])
            else:
                ids = torch.cat([prompt, answer[:, :-1]], 1)
                res = model(input_ids=ids, logits_to_keep=n_out, use_cache=False, output_hidden_states=hidden)
                logits = res.logits
                if ptr:
                    pairs = torch.tensor([pointer_sources(task, p, a, tok_ids)
                                          for p, a in zip(prompt.tolist(), answer.tolist())])  # [B, A, 2]
                    sources, heads = pairs[..., 0], pairs[..., 1]
                    qpos = torch.arange(prompt.shape[1] - 1, prompt.shape[1] - 1 + n_out)[None].expand_as(sources)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), answer.reshape(-1))
            acc = float((logits.argmax(-1) == answer).all(-1).float().mean())
        if hidden:  # the probe reads token t-1 from the residual at t, at the pointer layer's input
            h = res.hidden_states[args.pointer_layer % model.config.num_hidden_layers]  # [B, T, hidden]
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            if step < args.probe_warmup_steps:  # a fresh probe (the run continued left none) first learns alone
                h = h.detach()
            prev_loss = torch.nn.functional.cross_entropy(probe(h[:, 1:]).flatten(0, 1), ids[:, :-1].flatten())
            prev_stats.append(float(prev_loss.detach()))
            loss = loss + args.prev_token_weight * prev_loss
        if ptr and bool((sources >= 0).any()):  # (variable tracking has no source token)
            valid = sources >= 0
            b = torch.arange(sources.shape[0])[:, None].expand_as(sources)
            hit = rows.hit(b[valid], args.pointer_head + heads[valid], qpos[valid], sources[valid])  # on the copied token
            ptr_loss = -torch.log(hit + 1e-6).mean()
            ptr_stats.append(float(hit.detach().mean()))
            loss = loss + args.pointer_weight * ptr_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        stats.setdefault((task, length, kind), []).append(acc)
        if kind == "full" and task != "recall":
            full_acc.setdefault(task, []).append(acc)
        if step % 100 == 0:
            summary = " ".join(f"{t.replace('niah_', '').replace('variable_tracking', 'vt').replace('recall', 'rec')}/{n}/{k[:3]}={sum(v[-20:]) / len(v[-20:]):.2f}"
                               for (t, n, k), v in sorted(stats.items()) if n == length or k == "full" and n >= 1024)
            ptr_note = f" ptr-att {sum(ptr_stats[-50:]) / max(1, len(ptr_stats[-50:])):.2f}" if ptr_stats else ""
            ptr_note += f" prev-ce {sum(prev_stats[-50:]) / max(1, len(prev_stats[-50:])):.2f}" if prev_stats else ""
            print(f"step {step} {elapsed / 60:5.1f} min lr {lr:.1e} loss {float(loss.detach()):.3f}{ptr_note} | {summary}",
                  flush=True)
        if elapsed > next_save:
            next_save += 60 * args.save_every
            save(model, TINY_MODEL_DIR, out, probe)
            accs = {t: exact_match(model, tokenizer, t, args.eval_length, n=32, seed=0, batch=8) for t in tasks}
            print(f"checkpoint at {elapsed / 60:.1f} min, step {step}; exact match @{args.eval_length} (dev seed, n=32): "
                  + ", ".join(f"{t} {a:.2f}" for t, a in accs.items()), flush=True)
    save(model, TINY_MODEL_DIR, out, probe)
    print(f"trained {step} steps in {(time.perf_counter() - t0) / 60:.1f} min; saved {out}", flush=True)
    for length in REPORT_LENGTHS:
        accs = {t: exact_match(model, tokenizer, t, length, n=args.eval_n, seed=0, batch=4) for t in tasks}
        print(f"exact match @{length} (dev seed 0, n={args.eval_n}, full cache, teacher forced): "
              + ", ".join(f"{t} {a:.3f}" for t, a in accs.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
