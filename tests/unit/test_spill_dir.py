"""Where a worker spills by default: one directory per target database and slot, as the worker
lock, whatever the spelling of the target's connection string; and a spill that finds its
directory gone makes it again."""

from __future__ import annotations

from applier.assembler.buffer import StreamBuffer, default_spill_dir, spill_path


def test_one_directory_per_target_database_and_slot(monkeypatch) -> None:
    monkeypatch.delenv("PGPORT", raising=False)
    monkeypatch.delenv("PGHOST", raising=False)
    one = default_spill_dir("s", "postgresql://app@db.example:5432/orders")
    assert one.name.startswith("applier-spill-s-")
    # The same database however it is spelt, 5432 being libpq's default port.
    assert default_spill_dir("s", "host=db.example dbname=orders user=other password=x") == one
    assert default_spill_dir("s", "postgresql://db.example/orders?application_name=x") == one
    others = {default_spill_dir("s", "postgresql://db.example:5433/orders"),
              default_spill_dir("s", "postgresql://db.example/invoices"),
              default_spill_dir("s", "postgresql://other.example/orders"),
              default_spill_dir("t", "postgresql://db.example/orders")}
    assert one not in others and len(others) == 4
    assert default_spill_dir("a/b c", "dbname=x").name.startswith("applier-spill-a_b_c-")


def test_a_spill_makes_its_directory_again(tmp_path) -> None:
    """The directory stood empty between spills and went (another cleaner's doing): the next
    transaction to spill makes it again, and reads back what it spilled."""
    directory = tmp_path / "spill"
    buffer = StreamBuffer(7, spill_path(directory, 7))
    buffer.append(None, b"first")
    buffer.spill()
    buffer.append(None, b"second")
    assert [raw for raw in buffer.replay()] == [b"first", b"second"]
