"""The decode scheduler (`tdutils.engines.scheduler`), the token choice (`engines.sampling`) and the cut bookkeeping
(`engines.decode_compression.cut_event`) on hand-computed cases; the engines' own tests run them end to end."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tdutils.engines.decode_compression import cut_event
from tdutils.engines.sampling import check_forced_ids, choose_tokens, request_generators
from tdutils.engines.scheduler import (
    DecodeScheduler,
    admits,
    check_extension_fits,
    check_prompt_fits,
    context_limits,
)


def _req(rid, n_out=0):
    return SimpleNamespace(request_id=rid, output_ids=[0] * n_out)


def test_admits_counts_budget_and_batch_cap():
    assert admits(60, 40, 1, 100, None)
    assert not admits(61, 40, 1, 100, None)
    assert admits(10**6, 40, 5, None, None)
    assert not admits(0, 1, 2, None, 2)


def test_blocks_are_granted_and_the_latest_admitted_other_is_preempted():
    # three requests of 10 cached tokens, 20 to generate, blocks of 8: reservations 18 each, budget 40
    sched = DecodeScheduler({0: 10, 1: 10, 2: 10}, {0: 20, 1: 20, 2: 20}, budget=40, max_batch_size=None, block=8)
    sched.waiting.extend(_req(i) for i in range(3))
    assert [sched.need(i) for i in range(3)] == [30, 30, 30]
    assert sched.reservation(0) == 18
    admitted = []
    while (r := sched.pop_admissible(free_slots=3)) is not None:
        sched.running[len(admitted)] = r
        admitted.append(r.request_id)
    assert admitted == [0, 1] and sched.reserved() == 36  # 36 + 18 > 40: request 2 waits
    sched.running[0].output_ids = [0] * 8  # request 0 used its block
    assert sched.needs_block(0, sched.running[0]) and not sched.needs_block(1, sched.running[1])
    sched.grant_block(0)
    assert sched.reservation(0) == 26 and sched.over_budget()  # 26 + 18 = 44 > 40
    assert sched.victim(0) == 1
    assert sched.preempt(1).request_id == 1
    assert [r.request_id for r in sched.waiting] == [1, 2] and not sched.over_budget()
    sched.grant_block(0)
    assert sched.reservation(0) == 30  # at most its limit of 20 tokens


def test_a_preempted_request_that_used_its_block_resumes_with_the_next():
    sched = DecodeScheduler({0: 4, 1: 4}, {0: 30, 1: 30}, budget=None, max_batch_size=None, block=8)
    sched.running[0], sched.running[1] = _req(0), _req(1, n_out=8)
    sched.preempt(1)
    assert sched.grant[1] == 16 and sched.grant[0] == 8


def test_fit_errors_give_the_numbers():
    sched = DecodeScheduler({0: 180}, {0: 8}, budget=100, max_batch_size=None, block=None)
    with pytest.raises(ValueError, match=r"^request 0 needs 188 KV tokens \(180 cached \+ 8 to generate\) but "
                                         r"kv_budget_tokens is 100; raise kv_budget_tokens"):
        sched.check_fits()
    comp = SimpleNamespace(budget=48, buffer=16)
    sched = DecodeScheduler({0: 20}, {0: 100}, budget=60, max_batch_size=None, block=None, caps={0: 65})
    with pytest.raises(ValueError, match=r"request 0 needs 65 KV tokens at once under compression \(the largest cache "
                                         r"it holds, max\(budget \+ buffer = 64, its 20 cached entries\), \+ 1\)"):
        sched.check_fits(comp)
    with pytest.raises(ValueError, match=r"would hold 50 KV tokens \(40 cached \+ 10 extension\) .* is 50"):
        check_extension_fits(3, 40, 10, 50)
    with pytest.raises(ValueError, match=r"would be 50 tokens \(40 \+ 10 extension\) but vLLM's max_model_len is 50"):
        check_extension_fits(3, 40, 10, None, max_model_len=50)
    check_extension_fits(3, 40, 9, 50, max_model_len=51)
    with pytest.raises(ValueError, match=r"prompt 1 has 64 tokens \(with 3 padding\) but vLLM's max_model_len is 64"):
        check_prompt_fits(1, 64, 3, 64)


def test_context_limits_cap_at_the_model_context():
    # request 0 feeds positions 9..9+n-1: n = 100 reaches position 108 >= 64, capped at 64 - 9 = 55 tokens
    with pytest.warns(UserWarning, match=r"max_tokens capped .* request 0: 55 tokens"):
        assert context_limits({0: 100, 1: 5}, {0: 9, 1: 9}, 64) == {0: 55, 1: 5}
    assert context_limits({0: 100}, {0: 9}, None) == {0: 100}
    # compact compression: positions stay below the cache bound (40), so nothing is capped
    assert context_limits({0: 100}, {0: 9}, 64, bounds={0: 40}, top=40) == {0: 100}


def test_choose_tokens_greedy_sampled_and_forced():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    running = {0: _req(0), 1: _req(1, n_out=2)}
    assert choose_tokens(logits, running, 0.0, {}, None).tolist() == [1, 0]
    assert choose_tokens(logits, running, 0.0, {}, {0: [2], 1: [9, 9, 7]}).tolist() == [2, 7]
    gens = request_generators(3, [0, 1])
    got = choose_tokens(logits, running, 0.7, gens, None)
    again = choose_tokens(logits, running, 0.7, request_generators(3, [0, 1]), None)
    assert torch.equal(got, again)  # one generator per request, seeded from (seed, request_id)


def test_check_forced_ids():
    assert check_forced_ids([[1, 2, 3], (4, 5)], [0, 1], [2, 2], 10) == {0: [1, 2], 1: [4, 5]}
    with pytest.raises(ValueError, match=r"forced_ids\[1\] holds 1 token ids; decode generates 2"):
        check_forced_ids([[1, 2], [3]], [0, 1], [2, 2], 10)
    with pytest.raises(ValueError, match=r"forced_ids\[0\]\[1\] = 10 lies outside the vocabulary \[0, 10\)"):
        check_forced_ids([[1, 10]], [0], [2], 10)
    with pytest.raises(TypeError, match=r"forced_ids\[0\]\[0\] = 1.0 is not an integer"):
        check_forced_ids([[1.0]], [0], [1], 10)


def test_cut_event_by_sequence_index():
    kept, event = cut_event([0, 1, 2, 5, 6, 7], [0, 2, 3], step=4)
    assert kept == [0, 2, 5] and event == {"step": 4, "before": 6, "after": 3, "kept": [0, 2, 5]}
    # the lmcache rounds: the cut sees the first 4 rows, the 2 after them stay
    kept, event = cut_event([0, 1, 2, 5, 6, 7], [1, 3], step=4, rows=4)
    assert kept == [1, 5, 6, 7] and event["before"] == 6 and event["after"] == 4
