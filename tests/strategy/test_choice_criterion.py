"""The training benchmark's acceptance criterion (bench/train/choice.py) on a results set made by hand.

The set has 12 settings and 7 strategies. Memory per rank is the same in every setting (one model), in the order
GGG < IGG < IIG < NGG < ING < NNG < NNN; in the settings named ``budget-*`` and ``tight-*`` only the smaller ones fit.
Tokens/s (the figures of the first six settings are of the order the emulated cluster measured):

| setting          | fits                  | NNN | NNG | NGG  | ING | IIG | IGG  | GGG | best |
|------------------|-----------------------|-----|-----|------|-----|-----|------|-----|------|
| full-1g-a1       | all                   | 259 | 357 | 317  | 268 | 215 | 261  | 293 | NNG  |
| full-1g-a4       | all                   | 631 | 687 | 478  | 392 | 338 | 326  | 290 | NNG  |
| full-100m-a1     | all                   | 58  | 62  | 63.4 | 58  | 56  | 61.5 | 44  | NGG  |
| full-100m-a4     | all                   | 202 | 215 | 95   | 179 | 161 | 88   | 45  | NNG  |
| full-100m-a8     | all                   | 300 | 330 | 110  | 260 | 240 | 100  | 60  | NNG  |
| peft-100m-a4     | all                   | 889 | 897 | 470  | 598 | 539 | 356  | 101 | NNG  |
| budget-100m-a1   | IIG IGG GGG           | 58  | 62  | 63.4 | 58  | 56  | 61   | 44  | IGG  |
| budget-100m-a4   | IIG IGG GGG           | 202 | 215 | 95   | 179 | 160 | 88   | 45  | IIG  |
| budget-100m-a8   | IIG IGG GGG           | 300 | 330 | 110  | 260 | 250 | 100  | 50  | IIG  |
| budget-peft-a4   | ING IIG IGG GGG       | 889 | 897 | 470  | 598 | 540 | 356  | 101 | ING  |
| budget-1g-a1     | IIG IGG GGG           | 259 | 357 | 317  | 268 | 215 | 261  | 293 | GGG  |
| tight-1g-a4      | IGG GGG               | 631 | 687 | 478  | 392 | 338 | 326  | 290 | IGG  |

(Strategies that do not fit keep a figure, as if measured without the budget: a picker that takes one must fail
however fast it is.)

Worked out by hand from the table:

* "always NNG": NNG does not fit in the six budget/tight settings -> fails (and it is within 5% of the best in only
  the first six: at full-100m-a1, 62 / 63.4 = 0.978).
* "always the lowest-memory strategy that fits" (GGG, which fits everywhere): within 5% only at budget-1g-a1
  (293 = best); elsewhere 293/357 = 0.82, 290/687 = 0.42, 44/63.4 = 0.69, ..., 290/326 = 0.89 -> 1 of 12, fails.
* the per-setting best: 12 of 12, passes.
* the per-setting best except NNG at budget-100m-a1 (62 tokens/s there, faster than the best fitting IGG's 61, but
  NNG does not fit) -> 11 of 12 by speed, but a non-fitting pick: fails.
* best everywhere except IGG at budget-100m-a4 (88 / 160 = 0.55) and NNN at full-1g-a4 (631 / 687 = 0.918): 10 of 12,
  passes; one more miss (GGG at tight-1g-a4, 290 / 326 = 0.89): 9 of 12, fails.
* choice matters: 7 settings have a best other than NNG (NGG, IGG, IIG, IIG, ING, GGG, IGG: 5 different ones).
"""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "train" / "choice.py"
_spec = importlib.util.spec_from_file_location("bench_train_choice", _PATH)
choice = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = choice  # dataclasses look their module up while the class is made
_spec.loader.exec_module(choice)

STRATEGIES = ("NNN", "NNG", "NGG", "ING", "IIG", "IGG", "GGG")
MEMORY = {"GGG": 1.0, "IGG": 2.0, "IIG": 3.0, "NGG": 4.0, "ING": 5.0, "NNG": 6.0, "NNN": 7.0}  # GB per rank
ALL = set(STRATEGIES)
TABLE = [  # setting, fits, tokens/s in the order of STRATEGIES, the best fitting strategy
    ("full-1g-a1", ALL, (259, 357, 317, 268, 215, 261, 293), "NNG"),
    ("full-1g-a4", ALL, (631, 687, 478, 392, 338, 326, 290), "NNG"),
    ("full-100m-a1", ALL, (58, 62, 63.4, 58, 56, 61.5, 44), "NGG"),
    ("full-100m-a4", ALL, (202, 215, 95, 179, 161, 88, 45), "NNG"),
    ("full-100m-a8", ALL, (300, 330, 110, 260, 240, 100, 60), "NNG"),
    ("peft-100m-a4", ALL, (889, 897, 470, 598, 539, 356, 101), "NNG"),
    ("budget-100m-a1", {"IIG", "IGG", "GGG"}, (58, 62, 63.4, 58, 56, 61, 44), "IGG"),
    ("budget-100m-a4", {"IIG", "IGG", "GGG"}, (202, 215, 95, 179, 160, 88, 45), "IIG"),
    ("budget-100m-a8", {"IIG", "IGG", "GGG"}, (300, 330, 110, 260, 250, 100, 50), "IIG"),
    ("budget-peft-a4", {"ING", "IIG", "IGG", "GGG"}, (889, 897, 470, 598, 540, 356, 101), "ING"),
    ("budget-1g-a1", {"IIG", "IGG", "GGG"}, (259, 357, 317, 268, 215, 261, 293), "GGG"),
    ("tight-1g-a4", {"IGG", "GGG"}, (631, 687, 478, 392, 338, 326, 290), "IGG"),
]
RESULTS = [choice.SettingResult(name, dict(zip(STRATEGIES, tokens)), frozenset(fits), MEMORY)
           for name, fits, tokens, _ in TABLE]
BEST = {name: best for name, _, _, best in TABLE}


def _picker(picks):
    """The picker that picks ``picks[name]`` where given and the best fitting strategy elsewhere."""
    return lambda s: picks.get(s.name, BEST[s.name])


def test_the_hand_made_set_has_the_bests_of_the_table_and_the_choice_matters():
    assert {s.name: s.best for s in RESULTS} == BEST
    assert choice.choice_matters(RESULTS)


def test_always_nng_fails():
    score = choice.score(RESULTS, choice.always("NNG"))
    assert not score.passed
    assert score.non_fitting == tuple(name for name, *_ in TABLE[6:])
    assert score.within == tuple(name for name, *_ in TABLE[:6])  # 62 / 63.4 = 0.978 at full-100m-a1
    assert "does not fit" in score.reason


def test_always_the_lowest_memory_strategy_that_fits_fails():
    assert {choice.lowest_memory_that_fits(s) for s in RESULTS} == {"GGG"}
    score = choice.score(RESULTS, choice.lowest_memory_that_fits)
    assert not score.passed and score.non_fitting == ()
    assert score.within == ("budget-1g-a1",) and len(score.misses) == 11
    assert "in 1 of 12 settings; needs 10" in score.reason


def test_every_constant_picker_fails():
    for strategy in STRATEGIES:
        assert not choice.score(RESULTS, choice.always(strategy)).passed, strategy


def test_the_best_fitting_strategy_passes():
    score = choice.score(RESULTS, choice.best_fitting)
    assert score.passed and len(score.within) == 12 and score.misses == () and score.non_fitting == ()
    assert score.picks == BEST


def test_one_pick_that_does_not_fit_fails_however_fast():
    fast_but_too_big = _picker({"budget-100m-a1": "NNG"})  # 62 tokens/s, above IGG's 61, but NNG does not fit
    score = choice.score(RESULTS, fast_but_too_big)
    assert not score.passed and score.non_fitting == ("budget-100m-a1",)
    assert len(score.within) == 11


def test_two_misses_pass_and_three_fail():
    two = {"budget-100m-a4": "IGG", "full-1g-a4": "NNN"}  # 88 / 160 = 0.55 and 631 / 687 = 0.918
    score = choice.score(RESULTS, _picker(two))
    assert score.passed and len(score.within) == 10 and set(score.misses) == set(two)
    three = {**two, "tight-1g-a4": "GGG"}  # 290 / 326 = 0.89
    score = choice.score(RESULTS, _picker(three))
    assert not score.passed and len(score.within) == 9 and "in 9 of 12 settings; needs 10" in score.reason


def test_within_five_percent_is_measured_against_the_best_fitting_strategy():
    # full-100m-a1: NNG's 62 is 2.2% below NGG's 63.4 (within); IGG's 61.5 is 3.0% below (within); NNN's 58 is 8.5%
    # below (a miss). budget-100m-a1: the best fitting is IGG (61), not NGG (63.4), which does not fit: IIG's 56 is
    # 56 / 61 = 0.918 of it (a miss).
    setting = {s.name: s for s in RESULTS}
    assert choice.ratio(setting["full-100m-a1"], "NNG") == pytest.approx(62 / 63.4)
    assert choice.ratio(setting["budget-100m-a1"], "IIG") == pytest.approx(56 / 61)
    for picks, misses in (({"full-100m-a1": "NNG"}, ()), ({"full-100m-a1": "IGG"}, ()),
                          ({"full-100m-a1": "NNN"}, ("full-100m-a1",)),
                          ({"budget-100m-a1": "IIG"}, ("budget-100m-a1",))):
        assert choice.score(RESULTS, _picker(picks)).misses == misses
    # a run of the picker's own (auto: probe and plan included) counts instead of the picked strategy's figure
    slow_own_run = {"budget-100m-a1": 0.94 * 61}
    assert choice.score(RESULTS, choice.best_fitting, slow_own_run).misses == ("budget-100m-a1",)
    assert choice.score(RESULTS, choice.best_fitting, {"budget-100m-a1": 0.96 * 61}).misses == ()


def test_fewer_than_twelve_settings_never_pass():
    score = choice.score(RESULTS[:11], choice.best_fitting)
    assert not score.passed and len(score.within) == 11 and "needs at least 12" in score.reason
    assert not choice.choice_matters(RESULTS[:11])


def test_the_choice_does_not_matter_when_one_strategy_wins_every_setting_nng_does_not():
    # 6 settings won by NNG and 6 by IIG: the settings NNG does not win have one winner, so the set does not matter;
    # one of them won by IGG instead makes it matter. 9 won by NNG and 3 by others: too few not won by NNG.
    def won_by(name, best):
        tokens = {s: 100.0 for s in STRATEGIES}
        tokens[best] = 120.0
        return choice.SettingResult(name, tokens, frozenset(STRATEGIES), MEMORY)

    one_winner = [won_by(f"a{i}", "NNG") for i in range(6)] + [won_by(f"b{i}", "IIG") for i in range(6)]
    assert not choice.choice_matters(one_winner)
    two_winners = one_winner[:-1] + [won_by("b5", "IGG")]
    assert choice.choice_matters(two_winners)
    few = [won_by(f"a{i}", "NNG") for i in range(9)] + [won_by("b0", "IIG"), won_by("b1", "IGG"),
                                                        won_by("b2", "GGG")]
    assert not choice.choice_matters(few)
    assert choice.choice_matters(few[1:] + [won_by("b3", "IIG")])


def test_setting_from_benchmark_rows():
    rows = [
        {"system": "ddp", "tokens_per_s": 500.0, "peak_rss_bytes_max_rank": 9e8},
        {"system": "paro_nng", "tokens_per_s": 300.0, "peak_rss_bytes_max_rank": 6e8},
        {"system": "paro_iig", "tokens_per_s": 200.0, "peak_rss_bytes_max_rank": 5e8},
        {"system": "paro_ggg", "tokens_per_s": 100.0, "peak_rss_bytes_max_rank": 4e8},
        {"system": "paro_ngg", "error": "killed"},
        {"system": "paro", "tokens_per_s": 290.0, "auto_choice": "NNG"},
    ]
    every = choice.setting_from_rows("s", rows)
    assert every.tokens_per_s == {"NNG": 300.0, "IIG": 200.0, "GGG": 100.0} and every.best == "NNG"
    budget = choice.setting_from_rows("s", rows, budget_bytes=5e8)
    assert budget.fits == {"IIG", "GGG"} and budget.best == "IIG"
    assert choice.lowest_memory_that_fits(budget) == "GGG"


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="without a measurement: NNG"):
        choice.SettingResult("s", {"IIG": 1.0}, frozenset({"NNG", "IIG"}))
    with pytest.raises(ValueError, match="no strategy fits"):
        choice.SettingResult("s", {"IIG": 1.0}, frozenset())
    with pytest.raises(ValueError, match="distinct names"):
        choice.score(RESULTS + RESULTS[:1], choice.best_fitting)
