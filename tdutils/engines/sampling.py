"""Token choice of one decode step: greedy or temperature sampling with per-request seeds, and teacher forcing
(`decode(forced_ids=...)`), plus the checks of their inputs."""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence

import torch


def request_seed(seed: int, request_id: int) -> int:
    """The seed of one request's sampling generator: the first 4 bytes of BLAKE2b(`"seed:request_id"`), as an
    unsigned int (torch's CPU generator uses 32 bits of a seed): distinct streams per request and per seed,
    independent of the batch the request decodes in."""
    return int.from_bytes(hashlib.blake2b(f"{int(seed)}:{int(request_id)}".encode(), digest_size=4).digest(), "little")


def request_generators(seed: int, request_ids) -> dict[int, torch.Generator]:
    """One CPU generator per request, seeded with `request_seed(seed, request_id)`: a request samples the same
    tokens whatever batch it decodes in (vLLM's per-request seed semantics)."""
    return {rid: torch.Generator(device="cpu").manual_seed(request_seed(seed, rid)) for rid in request_ids}


def choose_tokens(logits: torch.Tensor, running: dict, temperature: float, generators: dict[int, torch.Generator],
                  forced: dict[int, list[int]] | None) -> torch.Tensor:
    """The next token of every row of one decode step, `[rows]` int64 on the CPU.

    Args:
        logits: `[rows, vocab]`, at least fp32; rows of free slots are ignored (greedy gives them any id).
        running: `{slot: request}` (`request_id`, `output_ids`) of the rows that decode.
        temperature: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature), each request from its
            own generator in `generators` (`request_generators`).
        forced: teacher forcing, `{request_id: ids}`: row `slot` takes `ids[len(output_ids)]` whatever was chosen.
    """
    if temperature > 0:
        probs = torch.softmax(logits / temperature, dim=-1).cpu()
        new_ids = torch.zeros(logits.shape[0], dtype=torch.long)
        for slot, r in running.items():
            new_ids[slot] = torch.multinomial(probs[slot], 1, generator=generators[r.request_id])[0]
    else:
        new_ids = logits.argmax(dim=-1).cpu()
    if forced is not None:  # teacher forcing: the given token is the output and is fed next
        for slot, r in running.items():
            new_ids[slot] = forced[r.request_id][len(r.output_ids)]
    return new_ids


def _check_forced_list(rid: int, ids, m: int, vocab_size: int) -> list[int]:
    """One request's forced ids: the first `m` as ints in `[0, vocab_size)` (see `check_forced_ids`)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, torch.Tensor)):
        raise TypeError(f"forced_ids[{rid}] must be a list of token ids, got {type(ids).__name__}")
    clean = []
    for j, t in enumerate(ids[:m]):
        if isinstance(t, (bool, float, str, bytes)) or (isinstance(t, torch.Tensor) and t.is_floating_point()):
            raise TypeError(f"forced_ids[{rid}][{j}] = {t!r} is not an integer token id")
        try:
            t = operator.index(t)
        except TypeError:
            raise TypeError(f"forced_ids[{rid}][{j}] = {t!r} is not an integer token id") from None
        if not 0 <= t < vocab_size:
            raise ValueError(f"forced_ids[{rid}][{j}] = {t} lies outside the vocabulary [0, {vocab_size})")
        clean.append(t)
    if len(clean) < m:
        raise ValueError(f"forced_ids[{rid}] holds {len(clean)} token ids; decode generates {m} for this request, so "
                         f"it needs at least {m}")
    return clean


def check_forced_ids(forced_ids, request_ids: list[int], per_request: list[int], vocab_size: int) -> dict[int, list[int]]:
    """`decode(forced_ids=...)` checked: one list of at least `max_tokens` integer ids in the vocabulary per request.

    Returns:
        `{request_id: ids}` with the first `max_tokens` ids of each request as Python ints.

    Raises:
        TypeError: not a sequence of sequences of integers (a string, a float or bool id, a generator).
        ValueError: another number of lists than requests, a list shorter than its `max_tokens`, an id outside
            `[0, vocab_size)` (the message names the list, the index and the id).
    """
    if isinstance(forced_ids, (str, bytes)) or not isinstance(forced_ids, Sequence):
        raise TypeError(f"forced_ids must be a list with one token-id list per request, got {type(forced_ids).__name__}")
    if len(forced_ids) != len(request_ids):
        raise ValueError(f"forced_ids must hold one token-id list per request ({len(request_ids)}), got {len(forced_ids)}")
    return {rid: _check_forced_list(rid, ids, m, vocab_size)
            for rid, m, ids in zip(request_ids, per_request, forced_ids)}
