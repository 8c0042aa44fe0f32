"""`tdutils.eval.rank_policies`: pooled scores per (mode, policy) at one drop ratio, ranks that tie where the
test does not separate, on hand-made `task_eval`-shaped tables: paired tests (McNemar, sign-flip) when the rows
keep per-prompt scores, unpaired Wilson intervals for runs stored without them."""

import pandas as pd
import pytest

from tdutils.answers import wilson_interval
from tdutils.eval import UNPAIRED, rank_policies


def _table():
    rows = []
    for mode in ("aware", "agnostic"):
        for task, full, snap, rand in (("niah_single", 20, 19 if mode == "aware" else 8, 2),
                                       ("variable_tracking", 18, 17 if mode == "aware" else 6, 0)):
            rows.append({"task": task, "mode": mode, "policy": "full", "drop_ratio": 0.0, "correct": full, "n": 20})
            for r, extra in ((0.5, 0), (0.75, -1)):
                rows.append({"task": task, "mode": mode, "policy": "snapkv", "drop_ratio": r, "correct": snap + 1 + extra, "n": 20})
                rows.append({"task": task, "mode": mode, "policy": "random", "drop_ratio": r, "correct": rand + 1 + extra, "n": 20})
    t = pd.DataFrame(rows)
    return t.assign(accuracy=t.correct / t.n)


def test_pools_tasks_and_ranks_at_the_largest_ratio():
    rank = rank_policies(_table())
    aware = rank[rank["mode"] == "aware"].set_index("policy")
    assert list(rank["mode"]) == ["aware"] * 3 + ["agnostic"] * 3
    assert list(aware.index) == ["full", "snapkv", "random"]
    assert list(aware["rank"]) == [1, 1, 3]  # full and snapkv: the intervals overlap, so they share rank 1
    assert set(rank["test"]) == {UNPAIRED}
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
    assert ranks["snapkv"] == ranks["random"] == 1  # tied exactly, and neither separated from the full cache


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
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["1. full", "1. snapkv", "3. random"]


def _paired_table(full, others, measure="exact", tasks=("t1",)):
    """One row per (task, policy) with per-prompt `scores`: `full` and each of `others` (`{policy: scores}`) are
    score lists, the same for every task."""
    rows = []
    for mode in ("aware",):
        for task in tasks:
            for policy, r, xs in (("full", 0.0, full), *((p, 0.5, x) for p, x in others.items())):
                rows.append({"task": task, "mode": mode, "policy": policy, "drop_ratio": r, "context_length": 2048, "n": len(xs),
                                 "correct": sum(xs), "accuracy": sum(xs) / len(xs), "measure": measure,
                                 "scores": {measure: list(xs), "partial": list(xs)}})
    return pd.DataFrame(rows)


def test_paired_ranking_separates_what_the_intervals_do_not():
    # full 20/20, snapkv 14/20 on the same prompts: the Wilson intervals (83.9-100 and 48.1-85.5) overlap, but the
    # six discordant pairs all favour the full cache: exact McNemar p = 2 * 0.5**6 = 0.03125 < 0.05
    t = _paired_table([1] * 20, {"snapkv": [1] * 14 + [0] * 6})
    rank = rank_policies(t).set_index("policy")
    assert list(rank["rank"]) == [1, 2]
    assert rank.loc["full", "above"] == "snapkv" and rank.loc["snapkv", "above"] == ""
    assert rank.loc["snapkv", "test"] == "exact McNemar, Holm-corrected, alpha 0.05"
    unpaired = rank_policies(t.drop(columns=["scores"])).set_index("policy")
    assert list(unpaired["rank"]) == [1, 1] and unpaired.loc["full", "above"] == ""


def test_paired_ranking_ties_and_holm():
    # three pairs, Holm: random loses to both (b = 20 discordant pairs each, p ~ 2e-6); full vs snapkv has one
    # discordant pair (p = 1): they tie at rank 1, random ranks 3 (two policies separated above it)
    t = _paired_table([1] * 10, {"snapkv": [1] * 9 + [0], "random": [0] * 10}, tasks=("t1", "t2"))
    rank = rank_policies(t).set_index("policy")
    assert rank.loc["full", "n"] == 20 and rank.loc["snapkv", "correct"] == 18
    assert list(rank["rank"]) == [1, 1, 3]
    assert rank.loc["full", "above"] == "random" and rank.loc["snapkv", "above"] == "random"
    # at alpha 1e-6 nothing is separated any more: every policy ranks 1
    assert set(rank_policies(t, alpha=1e-6)["rank"]) == {1}


def test_paired_ranking_of_a_continuous_measure_lower_is_better():
    full = [0.0] * 6
    t = _paired_table(full, {"snapkv": [0.1, 0.2, 0.1, 0.3, 0.2, 0.1], "random": [1.0, 2.0, 1.5, 1.0, 2.0, 3.0]},
                      measure="kl")
    rank = rank_policies(t)
    assert list(rank["policy"]) == ["full", "snapkv", "random"]
    # exact sign-flip test on 6 prompts all one way: p = 2 / 64 = 0.03125; Holm over 3 pairs: 0.09375 > 0.05,
    # so no pair is separated and all tie
    assert list(rank["rank"]) == [1, 1, 1]
    assert rank["correct"].isna().all() and rank.loc[0, "score"] == 0.0
    with pytest.raises(ValueError, match="no task of this table is scored by 'partial'"):
        rank_policies(t, measure="partial")


def test_a_policy_keeping_more_than_the_budget_is_flagged():
    t = _table()
    assert not rank_policies(t)["over_budget"].any() and rank_policies(t)["kept_tokens"].isna().all()
    # 1024-token contexts at 0.75: snapkv and random keep 256, middle_chunk keeps 512 (its first and last chunks)
    extra = t[t.policy == "random"].assign(policy="middle_chunk")
    t = pd.concat([t, extra], ignore_index=True)
    kept = {"full": 1024, "snapkv": 256, "random": 256, "middle_chunk": 512}
    t["kept_tokens"] = [kept[p] for p in t["policy"]]
    t.loc[(t.policy == "random") & (t.task == "variable_tracking"), "kept_tokens"] = 264  # pooled: (256 + 264) / 2
    rank = rank_policies(t).query("mode == 'aware'").set_index("policy")
    assert rank["kept_tokens"].to_dict() == {"full": 1024, "snapkv": 256, "random": 260, "middle_chunk": 512}
    # the dropped policies' median is 260; 512 > 1.05 * 260 >= 260; the full cache is never flagged
    assert rank["over_budget"].to_dict() == {"full": False, "snapkv": False, "random": False, "middle_chunk": True}


def test_ranking_lines_say_when_n_is_too_small_to_separate_anything():
    """At n = 5 even five prompts that all favour the full cache give McNemar p = 2 * 0.5**5 = 0.0625: every policy
    ties, and `eval` says why; at n = 6 the same pattern separates (p = 0.03125) and no note is printed."""
    from tdutils.cli.eval import MIN_SEPARABLE_N, ranking_lines

    small = ranking_lines(_paired_table([1] * 5, {"random": [0] * 5}))
    assert small[0] == ("ranked, exact @ 0.5, aware: 1. full 1, 1. random 0 (exact McNemar, Holm-corrected, "
                        "alpha 0.05)"), small
    assert small[1].startswith(f"note: at n = 5 prompts no paired test can separate two policies (both tests need at "
                               f"least {MIN_SEPARABLE_N} prompts where they differ"), small
    enough = ranking_lines(_paired_table([1] * 6, {"random": [0] * 6}))
    assert enough == ["ranked, exact @ 0.5, aware: 1. full 1, 2. random 0 (exact McNemar, Holm-corrected, "
                      "alpha 0.05)"], enough
