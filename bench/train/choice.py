"""The training benchmark's acceptance criterion for a strategy picker, as pure functions of measured results.

A *picker* maps a setting to the strategy it would train with (``sharding="auto"``'s choice, or a constant such as
"always NNG"). It passes on a results set of N >= 12 settings when

* in all but at most 2 of them (10 of 12), the strategy it picks is within 5% of the best fitting strategy's measured
  tokens/s (the pick's tokens/s >= 0.95 x the best's), and
* it never picks a strategy that does not fit the setting's memory budget.

A results set is one where *the choice matters* when it has at least 12 settings, in at least 4 of them the best
fitting strategy is not NNG, and no one strategy is the best in all of those (so that no constant picker can be
within 5% of the best everywhere by being the right constant).

Nothing here runs anything: the inputs are measured figures (``bench/results/train/*.json``, or a hand-made set in
the tests), the outputs a :class:`Score` and a yes or no.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

TOLERANCE = 0.05
"""A pick counts when its tokens/s are at least (1 - TOLERANCE) times the best fitting strategy's."""
MIN_SETTINGS = 12
"""Settings a results set needs for the criterion to apply."""
ALLOWED_MISSES = 2
"""Settings in which a passing picker may be more than TOLERANCE below the best (10 of 12)."""
MIN_NOT_NNG = 4
"""Settings whose best fitting strategy is not NNG in a set where the choice matters."""


@dataclass(frozen=True)
class SettingResult:
    """What was measured in one setting."""

    name: str
    """The setting, e.g. ``"2x2-100m-a4"``."""
    tokens_per_s: Mapping[str, float]
    """Measured tokens/s per strategy (three letters, e.g. ``"NNG"``)."""
    fits: frozenset[str]
    """The strategies that fit the setting's memory budget."""
    memory_bytes: Mapping[str, float] = field(default_factory=dict)
    """Memory per strategy (for pickers that choose by memory); optional."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fits", frozenset(self.fits))
        unmeasured = sorted(self.fits - set(self.tokens_per_s))
        if unmeasured:
            raise ValueError(f"{self.name}: fitting strategies without a measurement: {', '.join(unmeasured)}.")
        if not self.fits:
            raise ValueError(f"{self.name}: no strategy fits, so no pick can pass.")

    @property
    def best(self) -> str:
        """The fitting strategy of highest measured tokens/s (ties: the first in alphabetical order)."""
        return min(self.fits, key=lambda s: (-self.tokens_per_s[s], s))


@dataclass(frozen=True)
class Score:
    """A picker scored on one results set."""

    settings: int
    """N: settings scored."""
    picks: Mapping[str, str]
    """Setting -> the strategy picked."""
    within: tuple[str, ...]
    """Settings where the pick fits and is within TOLERANCE of the best fitting strategy's tokens/s."""
    misses: tuple[str, ...]
    """Settings where it is not (slower than that, or not fitting)."""
    non_fitting: tuple[str, ...]
    """Settings where the pick does not fit the memory budget."""
    passed: bool
    """N >= MIN_SETTINGS, at most ALLOWED_MISSES misses and no non-fitting pick."""
    reason: str
    """One sentence: why it passed or failed."""


def ratio(setting: SettingResult, strategy: str, tokens_per_s: float | None = None) -> float:
    """``strategy``'s tokens/s (or ``tokens_per_s``, a run of its own) over the best fitting strategy's."""
    own = setting.tokens_per_s[strategy] if tokens_per_s is None else tokens_per_s
    return own / setting.tokens_per_s[setting.best]


def score(results: Sequence[SettingResult], picker: Callable[[SettingResult], str],
          own_tokens_per_s: Mapping[str, float] | None = None, tolerance: float = TOLERANCE,
          allowed_misses: int = ALLOWED_MISSES, min_settings: int = MIN_SETTINGS) -> Score:
    """Score ``picker`` on ``results`` by the benchmark's criterion (module docstring).

    Args:
        results: one :class:`SettingResult` per setting.
        picker: setting -> the strategy it picks.
        own_tokens_per_s: setting name -> the picker's own measured tokens/s there (``auto``'s run, its probe and
            plan included); where absent, the picked strategy's measured tokens/s count.
    """
    names = [s.name for s in results]
    if len(set(names)) != len(names):
        raise ValueError(f"settings must have distinct names, got {names}.")
    picks, within, misses, non_fitting = {}, [], [], []
    for s in results:
        pick = picker(s)
        picks[s.name] = pick
        if pick not in s.fits:
            non_fitting.append(s.name)
            misses.append(s.name)
            continue
        own = None if own_tokens_per_s is None else own_tokens_per_s.get(s.name)
        if ratio(s, pick, own) >= 1 - tolerance:
            within.append(s.name)
        else:
            misses.append(s.name)
    n = len(results)
    if n < min_settings:
        passed, reason = False, f"{n} settings: the criterion needs at least {min_settings}."
    elif non_fitting:
        passed, reason = False, f"picks a strategy that does not fit in {', '.join(non_fitting)}."
    elif len(misses) > allowed_misses:
        passed, reason = False, (f"within {tolerance:.0%} of the best fitting strategy in {len(within)} of {n}"
                                 f" settings; needs {n - allowed_misses}.")
    else:
        passed, reason = True, (f"within {tolerance:.0%} of the best fitting strategy in {len(within)} of {n}"
                                " settings, and every pick fits.")
    return Score(n, picks, tuple(within), tuple(misses), tuple(non_fitting), passed, reason)


def choice_matters(results: Sequence[SettingResult], min_settings: int = MIN_SETTINGS,
                   min_not_nng: int = MIN_NOT_NNG) -> bool:
    """Whether ``results`` can tell a planner from a constant: at least ``min_settings`` settings, at least
    ``min_not_nng`` of them with a best fitting strategy other than NNG, and those not all won by one strategy."""
    others = [s.best for s in results if s.best != "NNG"]
    return len(results) >= min_settings and len(others) >= min_not_nng and len(set(others)) > 1


# ------------------------------------------------------------------------------------------------- constant pickers
def always(strategy: str) -> Callable[[SettingResult], str]:
    """The picker that always picks ``strategy``."""
    return lambda setting: strategy


def lowest_memory_that_fits(setting: SettingResult) -> str:
    """The picker that picks the fitting strategy of least memory (ties: alphabetical)."""
    if not setting.memory_bytes:
        raise ValueError(f"{setting.name}: no memory figures to pick by.")
    return min(setting.fits, key=lambda s: (setting.memory_bytes[s], s))


RULE = ("NNG", "IIG", "IGG")
"""The simple rule a planner must beat: NNG if it fits, else IIG, else IGG (else the lowest-memory that fits)."""


def three_line_rule(setting: SettingResult) -> str:
    """The first of ``RULE`` that fits the setting, else the lowest-memory strategy that fits."""
    for strategy in RULE:
        if strategy in setting.fits:
            return strategy
    return lowest_memory_that_fits(setting)


def best_fitting(setting: SettingResult) -> str:
    """The picker that picks the measured best fitting strategy (an oracle: it passes whenever anything can)."""
    return setting.best


# ---------------------------------------------------------------------------------------- from the benchmark's rows
def setting_from_rows(name: str, rows: Iterable[Mapping], budget_bytes: float | None = None,
                      memory_key: str = "peak_rss_bytes_max_rank") -> SettingResult:
    """A setting from ``bench/train/run.py``'s rows: the ``paro_<xyz>`` systems as strategies XYZ (other systems
    and rows with an error are left out); a strategy fits when its ``memory_key`` is at most ``budget_bytes`` (every
    measured one when None)."""
    tokens, memory = {}, {}
    for row in rows:
        system = row.get("system", "")
        if not system.startswith("paro_") or "error" in row or not row.get("tokens_per_s"):
            continue
        strategy = system[len("paro_"):].upper()
        tokens[strategy] = float(row["tokens_per_s"])
        if row.get(memory_key) is not None:
            memory[strategy] = float(row[memory_key])
    fits = {s for s in tokens if budget_bytes is None or (s in memory and memory[s] <= budget_bytes)}
    return SettingResult(name, tokens, frozenset(fits), memory)
