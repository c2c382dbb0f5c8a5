"""The redo log keeps what a batch rolled back would need fed again, within its budget."""

from applier.worker.redo import RedoLog


def test_it_keeps_every_batch_since_the_last_clean_point_in_order() -> None:
    log = RedoLog(budget=100)
    log.record([b"a" * 10])
    log.clean()
    log.record([b"b" * 10, b"c" * 10])
    log.record([b"d" * 10])
    assert log.complete
    assert log.batches() == [[b"b" * 10, b"c" * 10], [b"d" * 10]]


def test_past_its_budget_it_lets_go_until_the_next_clean_point() -> None:
    log = RedoLog(budget=25)
    log.record([b"a" * 10, b"b" * 10])
    log.record([b"c" * 10])  # 30 bytes: over the budget
    assert not log.complete
    log.record([b"d"])  # nothing is kept meanwhile: a redo must restart the session
    assert not log.complete
    log.clean()
    log.record([b"e" * 10])
    assert log.complete and log.batches() == [[b"e" * 10]]


def test_a_budget_of_zero_keeps_nothing() -> None:
    log = RedoLog(budget=0)
    log.record([b"x"])
    assert not log.complete
