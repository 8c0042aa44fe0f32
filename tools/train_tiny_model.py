"""Train the bundled tiny model `tiny-qwen3` on passkey retrieval (docs/design.md §8, issue 8), on CPU.

    python tools/train_tiny_model.py                      # ~30 min on 2 cores; rewrites model.safetensors
    python tools/train_tiny_model.py --max-minutes 10     # hard time budget (saves what it has)
    python tools/train_tiny_model.py --out /tmp/tiny      # write elsewhere (the bundled assets stay as they are)

The bundled weights come from two runs: the curriculum run `--max-minutes 30` (28.3 min; full-cache exact match
100 / 99.0 / 93.0% at 512 / 1024 / 2048 tokens: the clock ended its curriculum at 512), then a fine-tune of
those weights on the long contexts (26.8 min on 2 shared cores; 100 / 100 / 99.5%):

    python tools/train_tiny_model.py --init-from tdutils/assets/tiny-qwen3 --seed 1 --lr 1e-3 \
        --lengths 512,1024,2048,2048 --final-steps 1500 --max-minutes 40

Task (passkey retrieval; Mohtashami & Jaggi, "Landmark Attention", arXiv:2305.16300): filler words from
the bundled text `assets/sample/filler.txt`, one needle `pass key = d d d d d .` at a uniformly random
depth, and the question `pass key =` at the very end; the answer is the five digits. Examples come from
`tdutils.data.make_passkey_example`, the generator the evaluation uses, so training and evaluation
prompts have the same distribution and the same tokenization (no BOS token).

Model: the architecture and the tokenizer/vocabulary of the current bundled model are loaded from
`tdutils/assets/tiny-qwen3` (config.json, tokenizer files) and stay unchanged; only the weights are new,
initialised from `torch.manual_seed(--seed)`. The script writes `model.safetensors` (and nothing else)
at the very end, so a crash or Ctrl-C leaves the bundled model as it was.

Training:
- loss: cross-entropy on the five answer digits only (teacher forcing: input = prompt + first four digits,
  logits of the last five positions); the filler is never a target, so the model learns to copy, not
  to continue English;
- AdamW (lr 3e-3, betas (0.9, 0.95), weight decay 0.01), gradient clipping at norm 1.0, linear warm-up;
- curriculum over context length 64 -> 128 -> 256 -> 512 -> 1024 -> 2048 tokens with shrinking batches
  (32, 32, 16, 8, 4, 4): a stage ends when the exact-match accuracy of its last >= 64 training examples
  reaches `--advance-at` (0.95), or after `--max-stage-steps`; the learning rate is constant during the
  curriculum (it advances on accuracy, so its length is not known in advance);
- then a consolidation phase of `--final-steps` steps that cycles through *every* curriculum length
  (round robin), with the learning rate decaying on a cosine to `--min-lr-ratio` x lr. A model only
  retrieves at lengths it was trained at (docs/design.md §8: 4% at 1024 after training up to 512), and training
  only at the longest length lets the shorter ones drift, so every evaluated length is trained last.

Dropped-cache augmentation (`--drop-aug`, default 0.5): the benchmark edits the cache after prefill and
decodes from what is left (`tdutils.eval`). A model trained only on whole contexts is brittle to
that even when every needle token is kept: measured with plain training (all lengths ~100% on the full
cache), SnapKV at drop ratio 0.5 kept all nine needle tokens of every 512-token prompt, yet only ~65%
were answered, nearly always failing on the last digit; keeping the positions of the kept tokens
(no re-rotation) did not help. So, for lengths >= 256, a fraction `--drop-aug` of the steps prefills
the prompt, keeps the first 4 tokens, the nine needle tokens, the last 16 tokens and a uniform random
sample of the others (drop ratio 0.25, 0.5 or 0.75, `tdutils.selection.keep_count`), moves the kept
keys to compact positions 0..k-1 (RoPE re-rotation) and computes the answer loss by re-feeding the last
prompt token and the digits against that edited cache, exactly as the `hf` engine decodes. Gradients
flow through the edited cache into the prefill.

Decoy digits after the needle: the K/V of every token after the needle are computed at prefill with
the needle in view, so they can carry copies of the digits, and the observation window that every
policy keeps is made of such tokens. A model that learns to read the answer there answers even when a
policy drops the needle, and the benchmark no longer tells policies apart. Measured: with augmented
steps that kept the last 16 tokens, the model answered 82% of 512-token prompts with only the first 4
and last 16 tokens cached, and random dropping at 0.5 scored 98% although it almost always loses a
needle digit; keeping nothing after the needle in augmented steps removed that shortcut but left the
model unable to read a cache that holds the window and question (SnapKV 85% at 0.5). So an augmented
step takes the K/V of the tokens after the needle from a second prefill of the same prompt whose five
needle digits are replaced by other random digits: copies there point to wrong digits, and only the
needle itself holds the answer.

Batch accuracy is exact match: with teacher forcing, "every digit is the argmax" is exactly "greedy
decoding produces the five digits", so it is the metric of `tdutils.eval` on the full cache.

Fine-tuning (`--init-from DIR`): the weights of DIR's model.safetensors, no curriculum, the consolidation phase
over `--lengths` (a repeated length is trained more often) with a fresh AdamW state and a linear warm-up.

Seeds: training examples come from one `random.Random` stream seeded with `TRAIN_SEED_BASE + --seed`
(>= 10_000_000); evaluation datasets (`tdutils.data.make_passkey_dataset`, `tdutils.eval`, the
tests) use seeds below 10_000_000 (small seeds such as 0, 1, 2), so no evaluation stream is a training
stream. The final report of this script evaluates on the evaluation seed `--eval-seed` (0 by default),
the default dataset of `tdutils.eval.passkey_eval`; it never trains on it. The bundled weights were chosen
on that report, so seed 0 is a development seed; the published accuracy table uses the held-out seed
`tdutils.eval.HELDOUT_SEED`, which this script refuses as `--eval-seed`.

Time budget `--max-minutes` (wall clock; a 2048-token step costs ~0.5-3 s on 2 shared cores, so the
budget, not the step count, usually binds): the curriculum may use at most `--curriculum-share` of it
(it then jumps to consolidation), and the consolidation's cosine follows whichever is further along,
its step count or the clock, so the learning rate has fully decayed when the budget ends and the saved
weights are never taken mid-schedule at the peak learning rate. Determinism: same seed, same torch
build, same thread count and a budget that does not bind give the same weights; when the clock binds
(the report says so), the number of steps depends on the machine's speed.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

TRAIN_SEED_BASE = 10_000_000  # training example streams; evaluation seeds stay below this
CURRICULUM = ((64, 32), (128, 32), (256, 16), (512, 8), (1024, 4), (2048, 4))  # (context tokens, batch)
REPORT_LENGTHS = (512, 1024, 2048)
NEEDLE_TOKENS = 9  # pass key = d d d d d .
AUG_MIN_LENGTH = 256
AUG_DROP_RATIOS = (0.25, 0.5, 0.75)


def make_batch(length: int, batch: int, *, tokenizer, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """One training batch at `length` context tokens.

    Returns:
        `(input_ids [B, length + 4], targets [B, 5])`: prompt plus the first four answer digits (teacher
        forcing), and the five answer digits, which the last five positions must predict. The needle is
        the first `pass` token of a prompt (the question's `pass` is the last but two).
    """
    from tdutils.data import make_passkey_example

    inputs, targets = [], []
    for _ in range(batch):
        ex = make_passkey_example(length, tokenizer=tokenizer, rng=rng)
        prompt = tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(ex["answer"], add_special_tokens=False)["input_ids"]
        inputs.append(prompt + answer[:-1])
        targets.append(answer)
    width = {len(x) for x in inputs}
    if len(width) != 1:  # make_passkey_example fills to exactly `length` tokens with this tokenizer
        raise RuntimeError(f"passkey prompts of unequal length {sorted(width)}; the generator changed")
    return torch.tensor(inputs), torch.tensor(targets)


def digit_logits(model, input_ids: torch.Tensor, n_digits: int) -> torch.Tensor:
    """Logits `[B, n_digits, vocab]` of the positions that predict the answer digits.

    The last `n_digits` positions of `prompt + answer[:-1]` are the last prompt token (predicts digit 1)
    and digits 1..n-1 (predict digits 2..n). `logits_to_keep` skips the LM head everywhere else.
    """
    return model(input_ids=input_ids, logits_to_keep=n_digits, use_cache=False).logits


def random_keep_with_needle(length: int, needle_start: int, drop_ratio: float, rng: random.Random) -> list[int]:
    """Sorted kept indices: the first 4, the 9 needle tokens, the last 16, and a uniform sample of the rest.

    Returns exactly `keep_count(length, drop_ratio)` indices (all when the protected ones reach that count).
    """
    from tdutils.selection import keep_count

    k = keep_count(length, drop_ratio)
    protected = set(range(4)) | set(range(needle_start, needle_start + NEEDLE_TOKENS)) | set(range(length - 16, length))
    if len(protected) >= k:
        return list(range(length))
    rest = [i for i in range(length) if i not in protected]
    return sorted(protected | set(rng.sample(rest, k - len(protected))))


def decoy_prompt(prompt: torch.Tensor, needle_starts: list[int], digit_ids: list[int],
                 rng: random.Random) -> torch.Tensor:
    """`prompt` `[B, T]` with every needle digit replaced by a different random digit."""
    decoy = prompt.clone()
    index = {t: d for d, t in enumerate(digit_ids)}
    for b, start in enumerate(needle_starts):
        for j in range(start + 3, start + 8):  # "pass key =" then five digits
            decoy[b, j] = digit_ids[(index[int(prompt[b, j])] + rng.randrange(1, 10)) % 10]
    return decoy


def kept_rerotated(layers: list[tuple[torch.Tensor, torch.Tensor]], keep: torch.Tensor,
                   inv_freq: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Kept K/V rows of every layer, keys re-rotated from positions `keep[b, i]` to `i` (differentiable).

    Args:
        layers: per layer `(keys, values)`, each `[B, H, T, d]`; keep: `[B, k]` sorted kept indices;
        inv_freq: `[d / 2]` RoPE inverse frequencies (neox layout, full rotary, as Qwen3).

    Returns per layer `(keys, values)` `[B, H, k, d]`: k_new = k cos(a) + rotate_half(k) sin(a) with
    a = (i - keep[b, i]) inv_freq, a differentiable version of `tdutils.rope.rerotate_keys`.
    """
    B, k = keep.shape
    ang = (torch.arange(k)[None, :] - keep).float()[..., None] * inv_freq  # [B, k, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]  # [B, 1, k, d]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    out = []
    for all_keys, all_values in layers:
        _, h, _, d = all_keys.shape
        idx = keep[:, None, :, None].expand(B, h, k, d)
        keys, values = all_keys.gather(2, idx), all_values.gather(2, idx)
        half = d // 2
        out.append((keys * cos + torch.cat([-keys[..., half:], keys[..., :half]], -1) * sin, values))
    return out


def dropped_cache_logits(model, prompt: torch.Tensor, answer: torch.Tensor, keep: torch.Tensor,
                         inv_freq: torch.Tensor, decoy: torch.Tensor | None = None,
                         after: torch.Tensor | None = None) -> torch.Tensor:
    """Answer logits `[B, 5, vocab]` decoded from an edited cache, as `HFEngine.decode` does after `modify`.

    Args:
        prompt: `[B, T]` prompt ids; answer: `[B, 5]` digit ids; keep: `[B, k]` sorted kept indices;
        inv_freq: `[head_dim / 2]` RoPE inverse frequencies (neox layout, full rotary, as Qwen3).

    Prefills `prompt`, gathers the kept K/V rows of every layer, re-rotates the keys from positions
    `keep[b, i]` to `i` (k_new = k cos(d) + rotate_half(k) sin(d), d = (i - keep[b, i]) inv_freq: a
    differentiable version of `tdutils.rope.rerotate_keys`), drops the last entry and feeds the last
    prompt token again at position k-1 followed by the first four digits. With `decoy` (`[B, T]`) and
    `after` (`[B]`), the K/V of positions `>= after[b]` come from a prefill of `decoy` instead.
    """
    import inspect

    from transformers import DynamicCache

    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{kw: cache})
    layers = [(lay.keys, lay.values) for lay in cache.layers]
    if decoy is not None:
        other = DynamicCache(config=model.config)
        model(input_ids=decoy, use_cache=True, logits_to_keep=1, **{kw: other})
        late = (torch.arange(prompt.shape[1])[None, :] >= after[:, None])[:, None, :, None]  # [B, 1, T, 1]
        layers = [(torch.where(late, o.keys, kk), torch.where(late, o.values, vv))
                  for (kk, vv), o in zip(layers, other.layers)]
    B, k = keep.shape
    edited = DynamicCache(config=model.config)
    for i, (keys, values) in enumerate(kept_rerotated(layers, keep, inv_freq)):
        edited.update(keys[:, :, :-1], values[:, :, :-1], i)
    inputs = torch.cat([prompt[:, -1:], answer[:, :-1]], 1)  # [B, 5]
    positions = torch.arange(k - 1, k + 4)[None].expand(B, -1)
    return model(input_ids=inputs, position_ids=positions, use_cache=True, **{kw: edited}).logits


@torch.no_grad()
def exact_match(model, tokenizer, length: int, *, n: int, seed: int, batch: int) -> float:
    """Exact-match accuracy on `make_passkey_dataset(n, length, seed=seed)` (teacher-forced argmax)."""
    from tdutils.data import make_passkey_dataset

    was_training = model.training
    model.eval()
    rows = make_passkey_dataset(n, length, tokenizer=tokenizer, seed=seed)
    correct = 0
    for start in range(0, n, batch):
        chunk = rows[start:start + batch]
        ids, tgt = [], []
        for r in chunk:
            answer = tokenizer(r["answer"], add_special_tokens=False)["input_ids"]
            ids.append(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] + answer[:-1])
            tgt.append(answer)
        tgt = torch.tensor(tgt)
        pred = digit_logits(model, torch.tensor(ids), tgt.shape[1]).argmax(-1)
        correct += int((pred == tgt).all(-1).sum())
    model.train(was_training)
    return correct / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="weight init seed; data stream TRAIN_SEED_BASE + seed")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05, help="final lr / lr at the end of the decay")
    ap.add_argument("--warmup-steps", type=int, default=50)
    ap.add_argument("--advance-at", type=float, default=0.95, help="batch exact match that ends a stage")
    ap.add_argument("--min-stage-steps", type=int, default=20)
    ap.add_argument("--max-stage-steps", type=int, default=1500)
    ap.add_argument("--final-steps", type=int, default=1500, help="consolidation steps over all lengths")
    ap.add_argument("--drop-aug", type=float, default=0.5,
                    help="fraction of steps (lengths >= 256) trained on an edited cache (0 disables)")
    ap.add_argument("--max-minutes", type=float, default=50.0, help="wall-clock budget for training")
    ap.add_argument("--curriculum-share", type=float, default=0.6,
                    help="fraction of --max-minutes the curriculum may use before consolidation starts")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (2 shared cores here)")
    ap.add_argument("--eval-n", type=int, default=200, help="final report: examples per length")
    ap.add_argument("--eval-seed", type=int, default=0, help="final report: evaluation dataset seed (< 1e7)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from this model folder's model.safetensors (same config) and skip the curriculum: "
                         "fine-tune with the consolidation phase only")
    ap.add_argument("--lengths", default=None,
                    help="consolidation context lengths, comma-separated, cycled in order; repeat one to weight it "
                         "(default: every curriculum length). Batch sizes follow the curriculum table.")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for model.safetensors (default: the bundled tdutils/assets/tiny-qwen3)")
    args = ap.parse_args(argv)
    if args.eval_seed >= TRAIN_SEED_BASE:
        ap.error(f"--eval-seed must be below {TRAIN_SEED_BASE} (training streams start there)")
    from tdutils.eval import HELDOUT_SEED

    if args.eval_seed == HELDOUT_SEED:
        ap.error(f"--eval-seed {HELDOUT_SEED} is the held-out seed of the published accuracy table; choosing weights "
                 f"on it would leak it: use the development seed 0 or another seed")
    batch_of = dict(CURRICULUM)
    try:
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [n for n, _ in CURRICULUM]
    except ValueError:
        ap.error(f"--lengths must be comma-separated integers such as 1024,2048,2048, got {args.lengths!r}")
    if not lengths or any(n not in batch_of for n in lengths):
        ap.error(f"--lengths must be taken from the curriculum lengths {sorted(batch_of)}, got {args.lengths!r}")
    consolidation = [(n, batch_of[n]) for n in lengths]
    if args.init_from is not None and not (args.init_from / "model.safetensors").is_file():
        ap.error(f"--init-from {args.init_from}: no model.safetensors there (give a model folder)")

    from transformers import AutoConfig, Qwen3ForCausalLM

    from tdutils.models import TINY_MODEL_DIR, load_tokenizer
    from tdutils.rope import RopeSpec

    torch.set_num_threads(args.threads)
    out_dir = args.out or TINY_MODEL_DIR
    tokenizer = load_tokenizer(str(TINY_MODEL_DIR))
    config = AutoConfig.from_pretrained(TINY_MODEL_DIR)
    if config.vocab_size != len(tokenizer):
        raise SystemExit(f"config vocab_size {config.vocab_size} != tokenizer size {len(tokenizer)}")
    config._attn_implementation = "sdpa"  # fastest causal attention on CPU; the weights do not depend on it
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(config)
    if args.init_from is not None:
        from safetensors.torch import load_file

        # strict=False only for the tied lm_head, which save_pretrained leaves out of the file.
        missing, unexpected = model.load_state_dict(load_file(args.init_from / "model.safetensors"), strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise SystemExit(f"--init-from {args.init_from}: weights do not match the bundled config "
                             f"(missing {missing}, unexpected {unexpected})")
        model.tie_weights()
        print(f"initialised from {args.init_from / 'model.safetensors'}; curriculum skipped", flush=True)
    model.train()
    spec = RopeSpec.from_config(config)
    if spec.layout != "neox" or spec.rotary_dim != spec.head_dim:
        raise SystemExit(f"dropped-cache augmentation assumes full-rotary neox RoPE, got {spec}")
    inv_freq = spec.inv_freq.float()
    pass_id = tokenizer.convert_tokens_to_ids("pass")
    digit_ids = tokenizer.convert_tokens_to_ids([str(d) for d in range(10)])
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny-qwen3: {n_params} parameters, vocabulary {config.vocab_size}, threads {torch.get_num_threads()}, "
          f"data seed {TRAIN_SEED_BASE + args.seed}", flush=True)

    # No weight decay on norms: decaying RMSNorm gains towards 0 only fights the loss.
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    rng = random.Random(TRAIN_SEED_BASE + args.seed)
    t0 = time.perf_counter()
    deadline = t0 + 60 * args.max_minutes
    curriculum_deadline = t0 + 60 * args.max_minutes * args.curriculum_share
    step = 0
    clock_bound = False

    def train_step(length: int, batch: int, lr: float) -> tuple[float, float]:
        for g in opt.param_groups:
            g["lr"] = lr
        ids, tgt = make_batch(length, batch, tokenizer=tokenizer, rng=rng)
        if length >= AUG_MIN_LENGTH and rng.random() < args.drop_aug:
            prompt = ids[:, :length]
            ratio = rng.choice(AUG_DROP_RATIOS)
            starts = [row.index(pass_id) for row in prompt.tolist()]
            keep = torch.tensor([random_keep_with_needle(length, st, ratio, rng) for st in starts])
            decoy = decoy_prompt(prompt, starts, digit_ids, rng)
            after = torch.tensor(starts) + NEEDLE_TOKENS
            logits = dropped_cache_logits(model, prompt, tgt, keep, inv_freq, decoy, after)
        else:
            logits = digit_logits(model, ids, tgt.shape[1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        acc = float((logits.argmax(-1) == tgt).all(-1).float().mean())
        return float(loss.detach()), acc

    def log(phase: str, length: int, loss: float, acc: float, lr: float) -> None:
        print(f"{phase:>11} len {length:5d} step {step:5d} loss {loss:.4f} batch_acc {acc:.3f} lr {lr:.2e} "
              f"elapsed {time.perf_counter() - t0:7.1f}s", flush=True)

    # --- curriculum ----------------------------------------------------------------------------------
    for length, batch in (CURRICULUM if args.init_from is None else ()):
        need = max(2, math.ceil(64 / batch))  # judge a stage on its last >= 64 examples
        recent: list[float] = []
        for stage_step in range(1, args.max_stage_steps + 1):
            if time.perf_counter() > curriculum_deadline:
                clock_bound = True
                break
            lr = args.lr * min(1.0, (step + 1) / args.warmup_steps)
            loss, acc = train_step(length, batch, lr)
            step += 1
            recent = (recent + [acc])[-need:]
            running = sum(recent) / len(recent)
            if step % args.log_every == 0:
                log("curriculum", length, loss, running, lr)
            if stage_step >= args.min_stage_steps and len(recent) == need and running >= args.advance_at:
                log("advance", length, loss, running, lr)
                break
        else:
            print(f"stage {length}: no {args.advance_at:.0%} after {args.max_stage_steps} steps; moving on", flush=True)
        if clock_bound:
            print(f"curriculum used its share of --max-minutes at length {length}, step {step}; consolidating",
                  flush=True)
            break

    # --- consolidation: every length, cosine-decayed learning rate -------------------------------------
    t_cons = time.perf_counter()
    for i in range(args.final_steps):
        now = time.perf_counter()
        clock = (now - t_cons) / max(1e-9, deadline - t_cons)
        if clock >= 1.0:
            clock_bound = True
            break
        progress = i / args.final_steps
        if clock > progress + 1 / args.final_steps:  # the clock is ahead of the steps: it sets the lr
            progress, clock_bound = clock, True
        length, batch = consolidation[i % len(consolidation)]
        warm = min(1.0, (i + 1) / args.warmup_steps) if args.init_from is not None else 1.0  # fresh optimizer state
        lr = warm * args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
        loss, acc = train_step(length, batch, lr)
        step += 1
        if step % args.log_every == 0 or i == args.final_steps - 1:
            log("consolidate", length, loss, acc, lr)
    train_s = time.perf_counter() - t0
    if clock_bound:
        print(f"note: the --max-minutes budget ({args.max_minutes}) set the schedule (step {step}); the step count "
              f"depends on the machine's speed", flush=True)

    # --- report and save -----------------------------------------------------------------------------
    model.eval()
    print(f"trained {step} steps in {train_s / 60:.1f} min; exact match on evaluation seed {args.eval_seed} "
          f"(n={args.eval_n} per length, full cache, greedy):", flush=True)
    for length in REPORT_LENGTHS:
        acc = exact_match(model, tokenizer, length, n=args.eval_n, seed=args.eval_seed, batch=8)
        print(f"  {length:5d} tokens: {acc:.3f}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # save_pretrained knows to drop the tied lm_head; copy only the weights so the config and
        # tokenizer files of the bundled model stay byte for byte as they are.
        model.save_pretrained(tmp)
        (out_dir / "model.safetensors").write_bytes((Path(tmp) / "model.safetensors").read_bytes())
    print(f"wrote {out_dir / 'model.safetensors'} (total {(time.perf_counter() - t0) / 60:.1f} min)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
