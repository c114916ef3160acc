"""Statements reach both drivers as written: ``$1``, ``$2``, ... are parameters (a number may repeat), and what is
inside a literal (a ``?``, a ``%``, a ``$1``) is text."""

from __future__ import annotations

import pytest

from lightning_paro.predict.db import Database, advisory_key, sqlite_params


def test_sqlite_binds_the_numbered_parameters_by_name():
    assert sqlite_params(("a", 5)) == {"1": "a", "2": 5}
    assert sqlite_params(()) == {}


@pytest.mark.parametrize(
    "statement, params, expected",
    [
        ("SELECT 'a?b', $1", (5,), ("a?b", 5)),
        ("SELECT '100%', $1", ("x",), ("100%", "x")),
        ("SELECT 7 % 3, $1", (1,), (1, 1)),
        ("SELECT 'it''s?' || $1, 'q'", ("!",), ("it's?!", "q")),
        ("SELECT $1 -- a comment with ? and % and $2\n", (2,), (2,)),
        ("SELECT '$1', $1", ("x",), ("$1", "x")),
        # a number used twice is one parameter, and the numbers need not come in order
        ("SELECT $2, $1, $2 + 1", (10, 20), (20, 10, 21)),
    ],
)
def test_markers_and_literals_reach_the_database_intact(ledger_location, statement, params, expected):
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
            tx.executemany("INSERT INTO paro_test_literals (name) VALUES ($1 || $2)", [("$", "1"), ("1", "%")])
        rows = db.query("SELECT name FROM paro_test_literals WHERE name LIKE '%?%' OR name LIKE $1 ORDER BY name",
                        ("50%",))
        assert [r[0] for r in rows] == ["50% off", "what?"]
        rows = db.query("SELECT name FROM paro_test_literals WHERE name IN ($1, $2) ORDER BY name", ("$1", "1%"))
        assert [r[0] for r in rows] == ["$1", "1%"]
    finally:
        db.close()


def test_advisory_keys_are_stable_signed_64_bit_and_differ_between_jobs():
    key = advisory_key("job-a")
    assert key == advisory_key("job-a")
    assert -(2**63) <= key < 2**63
    assert key != advisory_key("job-b")
