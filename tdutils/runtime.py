"""Where a notebook runs, and what it did there: the Colab notebooks' runtime choice and closing report.

`plan_runtime` turns the notebooks' `"auto"` parameters into concrete settings: on a GPU a small real
model in the GPU's best half-precision dtype (a Colab T4 has no bfloat16, so float16) and the short demo
dataset; without a GPU the bundled tiny model and bundled passkey data, so "Run all" still works and every
printed figure still means something. `runtime_report` prints what the hardware did: seconds per phase
per run and the peak GPU memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .data import DEMO_DATASET_SHORT, SAMPLE_NAME
from .models import TINY_MODEL_NAME

AUTO = "auto"
GPU_MODEL = "Qwen/Qwen3-1.7B"  # fits a 15 GB T4 in float16 with room for the KV cache of 4 1k-token requests
GPU_DATASET = DEMO_DATASET_SHORT  # 10 prompts of ~1k Qwen3 tokens
CPU_MAX_TOKENS = 64  # decode tokens per request on the CPU fallback (the tiny model answers in 5)
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class RuntimePlan:
    """Concrete settings for one notebook run.

    Attributes:
        device: `"cuda"` or `"cpu"`.
        hardware: what runs it, e.g. `"Tesla T4 (14.7 GiB)"` or `"CPU (2 threads)"`.
        model, dtype, dataset: what `open_engine("hf", model=..., dtype=..., device=...)` and
            `load_prompts(dataset)` get.
        max_tokens: decode tokens per request.
        fallback: True when `"auto"` settings fell back to the bundled tiny model and data (no GPU).
    """

    device: str
    hardware: str
    model: str
    dtype: str
    dataset: str
    max_tokens: int
    fallback: bool

    def describe(self) -> str:
        head = f"{self.hardware}: model {self.model} ({self.dtype}), dataset {self.dataset}, {self.max_tokens} decode tokens"
        if self.fallback:
            data = ("its passkey data" if self.dataset == SAMPLE_NAME else
                    f"dataset {self.dataset!r} (the tiny model reads only its passkey data, dataset='auto' or 'sample')")
            return (head + f"\nNo GPU found, so this run falls back to the bundled tiny model with {data} (CPU, "
                    "minutes). On Colab choose Runtime > Change runtime type > T4 GPU and run all again for the real model.")
        return head


def plan_runtime(model: str = AUTO, dataset: str = AUTO, dtype: str = AUTO, *, max_tokens: int = 256,
                 device: str = AUTO, gpu_model: str = GPU_MODEL, gpu_dataset: str = GPU_DATASET,
                 cpu_max_tokens: int = CPU_MAX_TOKENS) -> RuntimePlan:
    """Resolve `"auto"` settings for the machine this runs on.

    Args:
        model: `"auto"` (GPU: `gpu_model`; CPU: the bundled `tiny-qwen3`) or any model `load_model` takes.
        dataset: `"auto"` (the bundled passkey `"sample"` for the tiny model, `gpu_dataset` otherwise) or
            any dataset `load_prompts` takes.
        dtype: `"auto"` (CUDA: bfloat16 where the GPU supports it, else float16 — a T4 has no bfloat16;
            CPU: float32) or a torch dtype name.
        max_tokens: decode tokens per request; on the CPU fallback at most `cpu_max_tokens`.
        device: `"auto"` (CUDA when available), `"cuda"` or `"cpu"`.

    Returns:
        A `RuntimePlan`; `plan.describe()` says what was chosen and why.

    Raises:
        ValueError: unknown device, or `device="cuda"` without a usable GPU, or `max_tokens < 1`.
    """
    if device not in (AUTO, "cuda", "cpu"):
        raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    for what, value in (("model", model), ("dataset", dataset), ("dtype", dtype)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{what} must be a non-empty string ('auto' or a name), got {value!r}")
    if dtype not in (AUTO, *DTYPES):
        raise ValueError(f"dtype must be 'auto' or one of {DTYPES}, got {dtype!r}")
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise ValueError("device='cuda' but torch sees no GPU (torch.cuda.is_available() is False); "
                         "use device='auto' to fall back to CPU, or pick a GPU runtime")
    dev = device if device != AUTO else ("cuda" if has_cuda else "cpu")
    if dev == "cuda":
        props = torch.cuda.get_device_properties(0)
        hardware = f"{props.name} ({props.total_memory / 2**30:.1f} GiB)"
    else:
        hardware = f"CPU ({torch.get_num_threads()} threads)"
    fallback = dev == "cpu" and model == AUTO
    resolved_model = model if model != AUTO else (gpu_model if dev == "cuda" else TINY_MODEL_NAME)
    if dataset == AUTO:
        dataset = SAMPLE_NAME if resolved_model == TINY_MODEL_NAME else gpu_dataset
    if dtype == AUTO:
        dtype = ("bfloat16" if torch.cuda.is_bf16_supported() else "float16") if dev == "cuda" else "float32"
    tokens = min(max_tokens, int(cpu_max_tokens)) if fallback else max_tokens
    return RuntimePlan(device=dev, hardware=hardware, model=resolved_model, dtype=dtype, dataset=dataset,
                       max_tokens=tokens, fallback=fallback)


def runtime_report(table, plan: RuntimePlan | None = None) -> str:
    """What the hardware did: seconds per phase per run (from a `phase_table`) and peak GPU memory.

    Args:
        table: the pandas phase table of `tdutils.compare` / `phase_table` (columns `prefill_s`, `modify_s`,
            `decode_s`, `end_to_end_s`, `decode_tok_s`, `peak_batch`).
        plan: the run's `RuntimePlan`, for the hardware line.

    Returns:
        The report text (also printed): one line per run, then `torch.cuda.max_memory_allocated` /
        `max_memory_reserved` of this process in GiB when CUDA is in use, or the process's peak RSS on CPU.
    """
    lines = [f"hardware: {plan.hardware}" if plan else f"hardware: {'cuda' if torch.cuda.is_available() else 'cpu'}"]
    for run, row in table.iterrows():
        lines.append(f"{run:>16}: prefill {row['prefill_s']:7.2f} s | modify {row['modify_s']:6.2f} s | "
                     f"decode {row['decode_s']:7.2f} s ({row['decode_tok_s']:8.1f} tok/s, peak batch "
                     f"{int(row['peak_batch'])}) | end to end {row['end_to_end_s']:7.2f} s")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gib = 2**30
        total = torch.cuda.get_device_properties(0).total_memory
        lines.append(f"GPU memory: peak allocated {torch.cuda.max_memory_allocated() / gib:.2f} GiB, "
                     f"peak reserved {torch.cuda.max_memory_reserved() / gib:.2f} GiB of {total / gib:.1f} GiB")
    else:
        lines.append(f"CPU memory: peak RSS of this process {_peak_rss_gib():.2f} GiB")
    text = "\n".join(lines)
    print(text)
    return text


def _peak_rss_gib() -> float:
    """Peak resident set size of this process (GiB); Linux reports ru_maxrss in KiB, macOS in bytes."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20

