"""`tdutils.eval.statistics`: exact McNemar, paired bootstrap, sign-flip test and Holm against hand-computed values,
and `paired_differences` of a table against its full cache."""

import numpy as np
import pandas as pd
import pytest

from tdutils.eval.statistics import (
    has_scores,
    holm,
    mcnemar_exact,
    paired_bootstrap,
    paired_differences,
    paired_test,
    pairwise_tests,
    sign_flip_test,
)


def test_mcnemar_hand_computed():
    # b = 0, c = 5: two-sided exact binomial on 5 discordant pairs, 2 * 0.5**5
    assert mcnemar_exact([0] * 5 + [1] * 3, [1] * 5 + [1] * 3) == (0, 5, pytest.approx(0.0625))
    # b = 1, c = 9: 2 * (C(10,0) + C(10,1)) / 2**10 = 22 / 1024
    x, y = [1] + [0] * 9 + [1, 0], [0] + [1] * 9 + [1, 0]
    assert mcnemar_exact(x, y) == (1, 9, pytest.approx(22 / 1024))
    assert mcnemar_exact([1, 0], [1, 0]) == (0, 0, 1.0)  # no discordant pair: nothing to test
    with pytest.raises(ValueError, match="binary"):
        mcnemar_exact([0.5], [1])
    with pytest.raises(ValueError, match="same prompts"):
        mcnemar_exact([1, 0], [1])


def test_bootstrap_interval_covers_a_known_difference():
    rng = np.random.default_rng(7)
    y = rng.normal(size=200)
    x = y + 0.5 + rng.normal(scale=0.2, size=200)  # true paired difference 0.5
    diff, low, high = paired_bootstrap(x, y)
    assert diff == pytest.approx(float(np.mean(x - y)))
    assert low < 0.5 < high and low > 0.4 and high < 0.6
    assert paired_bootstrap(x, y) == (diff, low, high)  # seeded: the same interval every time
    assert paired_bootstrap([1.0, 2.0], [0.5, 1.5]) == (0.5, 0.5, 0.5)  # a constant difference has no spread


def test_sign_flip_and_holm_hand_computed():
    # 5 prompts, every difference positive: exact test over 2**5 sign flips, 2 of them as extreme: 2 / 32
    assert sign_flip_test([1, 2, 3, 4, 5], [0, 0, 0, 0, 0]) == pytest.approx(0.0625)
    assert sign_flip_test([1, 2], [1, 2]) == 1.0
    assert sign_flip_test([0.7], [0.2]) == 1.0  # one prompt: both flips are as extreme (a `--n 1` quick look)
    # sorted 0.01, 0.03, 0.04: 3 * 0.01, max(0.03, 2 * 0.03), max(0.06, 1 * 0.04)
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def test_paired_test_and_pairwise():
    r = paired_test([1] * 6 + [0] * 4, [1] * 10, "exact")
    assert (r.b, r.c, r.n, r.diff, r.test) == (0, 4, 10, pytest.approx(-0.4), "exact McNemar")
    assert r.p_value == pytest.approx(0.125)
    pairs = pairwise_tests({"a": [1] * 10, "b": [0] * 10, "c": [1] * 10}, "exact")
    assert list(zip(pairs["a"], pairs["b"], pairs["better"])) == [("a", "b", "a"), ("a", "c", ""), ("b", "c", "c")]
    # p = 2 * 0.5**10 for a-b and b-c, 1 for a-c; Holm: 3 * p, 2 * p (the running max), 1
    assert list(pairs["p_holm"]) == pytest.approx([3 * 2 / 1024, 1.0, 3 * 2 / 1024])


def test_paired_differences_against_the_full_cache():
    rows = [{"task": "t", "mode": "aware", "context_length": 8, "policy": "full", "drop_ratio": 0.0, "measure": "exact",
                 "scores": {"exact": [1, 1, 1, 1, 1]}},
            {"task": "t", "mode": "aware", "context_length": 8, "policy": "snapkv", "drop_ratio": 0.5, "measure": "exact",
                 "scores": {"exact": [0, 0, 0, 0, 0]}}]
    d = paired_differences(pd.DataFrame(rows))
    assert len(d) == 1
    row = d.iloc[0]
    assert (row["policy"], row["b"], row["c"], row["diff"]) == ("snapkv", 0, 5, -1.0)
    assert row["p_value"] == pytest.approx(0.0625)
    old = pd.DataFrame(rows).drop(columns=["scores"])
    assert not has_scores(old)
    with pytest.raises(ValueError, match="keeps no per-prompt scores"):
        paired_differences(old)


def test_plot_paired_differences_draws_every_cell(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from tdutils.eval import plot_paired_differences

    rows = [{"task": "t", "mode": mode, "context_length": 8, "policy": p, "drop_ratio": r, "measure": "exact",
             "scores": {"exact": xs}}
            for mode in ("aware", "agnostic")
            for p, r, xs in (("full", 0.0, [1] * 6), ("snapkv", 0.5, [1] * 5 + [0]), ("random", 0.5, [0] * 6))]
    d = paired_differences(pd.DataFrame(rows))
    fig = plot_paired_differences(d, tmp_path / "diff.png")
    assert (tmp_path / "diff.png").stat().st_size > 0
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["snapkv @ 0.5", "random @ 0.5"]
    assert list(d["diff"]) == [pytest.approx(-1 / 6), -1.0] * 2 and list(d["c"]) == [1, 6] * 2
