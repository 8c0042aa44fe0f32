"""Two forms of the hf engine's decode step on the same prefill, arms alternated: the lean step beside transformers'
forward (`--compare step`, the default), or the linear layers on tdutils' panel kernel beside oneDNN's
prepacked matmul (`--compare linears`, `tdutils.engines.packed`; both arms run the lean step).

    python bench/lean_step.py --model smollm2-135m --dtype bfloat16 --threads 1 --json runs/lean.json
    python bench/lean_step.py --model smollm2-135m --dtype float32|bfloat16 --compare linears --json runs/lin.json
    python bench/lean_step.py --summary docs/results/lean_step_smollm2_bfloat16_1t.json

One engine prefills `--batch-size` RULER prompts of `--context-length` tokens once; each repeat restores that
prefill and decodes `--max-tokens` greedy tokens (EOS ignored) once per arm, in alternating order: `step` runs
`lean_decode` on (the engine's default where the model allows it) and off (transformers' forward every step);
`linears` packs the linear weights again for each arm before its decode (not timed). Decode tok/s counts
the tokens after each request's first over the seconds after the batch's first step (`phase_split`), as
bench/peer_openvino.py counts both of its engines. Printed: per arm the median and best tok/s, the ratio of
medians, and whether the two arms' tokens agree (fp32: they must; bf16: rounding may part them late).
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/harness.py, also when loaded by path
import harness as H

from tdutils.cli.args import positive_int

COMPARE = {"step": ("lean", "transformers"), "linears": ("panels", "oneDNN")}


def _arms(engine, compare: str) -> dict:
    """`{arm: set-up}` for `compare`: each set-up puts the engine in that arm's form (ValueError where it cannot)."""
    if compare == "step":
        step = engine._lean

        def use(on):
            engine._lean = step if on else None
        return {"lean": lambda: use(True), "transformers": lambda: use(False)}
    from tdutils.kernels import linear_kernels

    packed, dtype = engine._packed, engine.model.dtype
    panels = linear_kernels(dtype)
    if packed is None or panels is None:
        raise ValueError(f"--compare linears needs packed linears and the compiled panel kernel for {dtype} "
                         f"(float32: AVX-512, bfloat16: AVX512-BF16); this engine has "
                         f"{'no packed linears' if packed is None else 'no panel kernel for its dtype'}")

    def use(kernels):
        packed._panels[dtype] = kernels
        packed.refresh()
    return {"panels": lambda: use(panels), "oneDNN": lambda: use(None)}


def measure(args) -> dict:
    import torch

    from tdutils.engines.hf import HFEngine
    from tdutils.kernels import kernel_status

    H.check_ruler_task(args.task)
    cores = H.bind_cores(args.threads or 1)
    engine = HFEngine(args.model, dtype=args.dtype, kv_budget_tokens=None, prefill_batch_size=args.batch_size,
                      progress=False)
    if engine.decode_path != "lean":
        raise ValueError(f"{args.model}: the engine runs transformers' forward for it (no lean step to compare)")
    _, prompts, _ = H.ruler_prompts(args.task, args.batch_size, args.context_length, engine.tokenizer, args.seed, 8)
    arms = COMPARE[args.compare]
    setup = _arms(engine, args.compare)
    engine.prefill(prompts)
    saved = engine.snapshot()
    speeds, tokens = {a: [] for a in arms}, {}
    for rep in range(args.repeats):
        for arm in arms if rep % 2 == 0 else arms[::-1]:
            setup[arm]()
            engine.restore(saved)
            outs = engine.decode(args.max_tokens, ignore_eos=True)
            speeds[arm].append(_steady_tok_s(engine))
            tokens[arm] = [o.output_ids for o in outs]
    setup[arms[0]]()  # the engine's default form again
    agree = [sum(a == b for a, b in zip(x, y)) / len(x) for x, y in zip(tokens[arms[0]], tokens[arms[1]])]
    med = {a: statistics.median(v) for a, v in speeds.items()}
    return {"meta": {**H.run_record("bench/lean_step.py"), "model": args.model, "dtype": args.dtype,
                     "compare": args.compare, "arms": list(arms),
                     "batch_size": args.batch_size, "context_length": args.context_length, "task": args.task,
                     "max_tokens": args.max_tokens, "repeats": args.repeats, "cores": cores, "seed": args.seed,
                     "kernels": kernel_status(), "torch_threads": torch.get_num_threads()},
            "tok_s": speeds, "median_tok_s": med, "ratio": med[arms[0]] / med[arms[1]],
            "token_agreement": agree}


def _steady_tok_s(engine) -> float:
    """Tokens after each request's first over the seconds after the batch's last first token (as
    `harness.decode_cells`' `steady_tok_s`)."""
    times = [r.token_times for r in engine.requests]  # seconds from the decode call's start, per token
    return sum(len(t) - 1 for t in times) / max(max(t[-1] for t in times) - max(t[0] for t in times), 1e-9)


def main(argv=None) -> int:
    ap = H.parser("bench/lean_step.py", __doc__)
    H.add_standard(ap, threads=1, repeats=6, model="smollm2-135m")
    ap.add_argument("--max-tokens", type=positive_int, default=32, help="greedy tokens per repeat (default 32)")
    ap.add_argument("--compare", choices=tuple(COMPARE), default="step", help="step: the lean step beside "
                    "transformers' forward (default); linears: the linears on tdutils' panels beside oneDNN")
    H.add_ruler_batch_options(ap, batch_help="prompts decoded together")
    return H.measure_main(ap, argv, "lean_step", "runs/lean.json", ("meta", "tok_s", "ratio"), measure)


if __name__ == "__main__":
    sys.exit(main())
