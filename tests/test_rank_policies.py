"""`tdutils.eval.rank_policies`: pooled exact match per (mode, policy) at one drop ratio, its Wilson interval,
ranks and the separations it reports, on a hand-made `task_eval`-shaped table."""

import pandas as pd
import pytest

from tdutils.answers import wilson_interval
from tdutils.eval import rank_policies


def _table():
    rows = []
    for mode in ("aware", "agnostic"):
        for task, full, snap, rand in (("niah_single", 20, 19 if mode == "aware" else 8, 2),
                                       ("variable_tracking", 18, 17 if mode == "aware" else 6, 0)):
            rows.append(dict(task=task, mode=mode, policy="full", drop_ratio=0.0, correct=full, n=20))
            for r, extra in ((0.5, 0), (0.75, -1)):
                rows.append(dict(task=task, mode=mode, policy="snapkv", drop_ratio=r, correct=snap + 1 + extra, n=20))
                rows.append(dict(task=task, mode=mode, policy="random", drop_ratio=r, correct=rand + 1 + extra, n=20))
    t = pd.DataFrame(rows)
    return t.assign(accuracy=t.correct / t.n)


def test_pools_tasks_and_ranks_at_the_largest_ratio():
    rank = rank_policies(_table())
    aware = rank[rank["mode"] == "aware"].set_index("policy")
    assert list(rank["mode"]) == ["aware"] * 3 + ["agnostic"] * 3
    assert list(aware.index) == ["full", "snapkv", "random"]
    assert list(aware["rank"]) == [1, 2, 3]
    # snapkv at 0.75: (19 + 1 - 1) + (17 + 1 - 1) = 36 of 40; random: (2 + 0) + (0 + 0) = 2 of 40
    assert (aware.loc["snapkv", "correct"], aware.loc["snapkv", "n"]) == (36, 40)
    assert aware.loc["snapkv", "drop_ratio"] == 0.75 and aware.loc["full", "drop_ratio"] == 0.0
    assert aware.loc["random", "accuracy"] == pytest.approx(2 / 40)
    assert (aware.loc["snapkv", "ci_low"], aware.loc["snapkv", "ci_high"]) == pytest.approx(wilson_interval(36, 40))
    # full 38/40 and snapkv 36/40 overlap; both lie wholly above random's 2/40
    assert aware.loc["full", "above"] == "random" and aware.loc["snapkv", "above"] == "random"
    assert aware.loc["random", "above"] == ""


def test_chosen_ratio_ties_and_modes():
    t = _table()
    rank = rank_policies(t, drop_ratio=0.5)
    agn = rank[rank["mode"] == "agnostic"].set_index("policy")
    assert (agn.loc["snapkv", "correct"], agn.loc["random", "correct"]) == (8 + 1 + 6 + 1, 2 + 1 + 0 + 1)
    assert agn.loc["full", "above"] == "snapkv, random"  # 38/40 vs 16/40: separated in this mode
    tie = t.copy()
    tie.loc[tie.policy == "random", "correct"] = tie.loc[tie.policy == "snapkv", "correct"].to_numpy()
    ranks = rank_policies(tie).query("mode == 'aware'").set_index("policy")["rank"]
    assert ranks["snapkv"] == ranks["random"] == 2


def test_refuses_a_ratio_it_does_not_have():
    with pytest.raises(ValueError, match="no rows at drop ratio 0.9"):
        rank_policies(_table(), drop_ratio=0.9)
    with pytest.raises(ValueError, match="drop ratio above 0"):
        rank_policies(_table().query("policy == 'full'"))


def test_plot_ranking_draws_every_policy_even_at_zero(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from tdutils.eval import plot_ranking

    t = _table()
    # 0 of 250: the Wilson interval's low end is 8.7e-19, above the accuracy (0) by rounding
    t.loc[t.policy == "random", ["correct", "accuracy", "n"]] = (0, 0.0, 125)
    rank = rank_policies(t)
    fig = plot_ranking(rank, tmp_path / "rank.png")
    assert (tmp_path / "rank.png").stat().st_size > 0
    assert [len(ax.get_yticks()) for ax in fig.axes] == [3, 3]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["1. full", "2. snapkv", "3. random"]
