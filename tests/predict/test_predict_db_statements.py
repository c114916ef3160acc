"""Statements reach both drivers intact: parameter markers are translated, literals are not."""

from __future__ import annotations

import pytest

from lightning_paro.predict.db import Database, advisory_key, to_pyformat


def test_only_markers_outside_literals_become_pyformat_and_percent_is_escaped():
    assert to_pyformat("SELECT a FROM t WHERE b = ? AND c = ?") == "SELECT a FROM t WHERE b = %s AND c = %s"
    assert to_pyformat("SELECT 'why?', ? WHERE x LIKE '5%'") == "SELECT 'why?', %s WHERE x LIKE '5%%'"
    assert to_pyformat("SELECT 'it''s ?', \"col?\" FROM t") == "SELECT 'it''s ?', \"col?\" FROM t"
    assert to_pyformat("SELECT 7 % 3 -- what?\nWHERE a = ?") == "SELECT 7 %% 3 -- what?\nWHERE a = %s"
    assert to_pyformat("SELECT /* ? */ ?") == "SELECT /* ? */ %s"


@pytest.mark.parametrize(
    "statement, params, expected",
    [
        ("SELECT 'a?b', ?", (5,), ("a?b", 5)),
        ("SELECT '100%', ?", ("x",), ("100%", "x")),
        ("SELECT 7 % 3, ?", (1,), (1, 1)),
        ("SELECT 'it''s?' || ?, 'q'", ("!",), ("it's?!", "q")),
        ("SELECT ? -- a comment with ? and %\n", (2,), (2,)),
    ],
)
def test_literal_question_marks_and_percents_reach_the_database_intact(ledger_location, statement, params, expected):
    db = Database(ledger_location)
    try:
        assert tuple(db.query(statement, params)[0]) == expected
        with db.transaction("some-job") as tx:
            assert tuple(tx.fetchone(statement, params)) == expected
    finally:
        db.close()


def test_like_pattern_with_a_percent_and_a_question_mark_in_data(ledger_location):
    db = Database(ledger_location)
    try:
        with db.transaction() as tx:
            tx.execute("CREATE TABLE IF NOT EXISTS paro_test_literals (name TEXT)")
            tx.execute("DELETE FROM paro_test_literals")
            tx.insert_rows("paro_test_literals", ["name"], [("what?",), ("50% off",), ("plain",)])
        rows = db.query("SELECT name FROM paro_test_literals WHERE name LIKE '%?%' OR name LIKE ? ORDER BY name",
                        ("50%",))
        assert [r[0] for r in rows] == ["50% off", "what?"]
    finally:
        db.close()


def test_advisory_keys_are_stable_signed_64_bit_and_differ_between_jobs():
    key = advisory_key("job-a")
    assert key == advisory_key("job-a")
    assert -(2**63) <= key < 2**63
    assert key != advisory_key("job-b")
