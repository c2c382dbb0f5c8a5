"""``applier demo``, the README's main command, end to end: its own two servers, sync creating
the target's tables, a live workload with a large streamed and a two-phase transaction and
schema changes, damage found and repaired (verify, verify --repair), a cutover with its default
checks (schemas compared, rows by hash) and a drop."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.server


@pytest.mark.slow
def test_demo_replicates_and_verifies(pg_pair) -> None:
    """``pg_pair`` only picks the version: the demo starts (and removes) servers of its own."""
    version = pg_pair.version
    done = subprocess.run([sys.executable, "-m", "applier", "demo", "--pg-version", str(version),
                           "--seconds", "8"], capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "prepared two-phase transaction" in out and "COMMIT PREPARED" in out, out[-4000:]
    assert "target equals source" in out and "replica retired" in out, out[-4000:]
    assert "public.reviews: missing on target: id=7" in out and "DIFFERENT, REPAIRED" in out, out[-4000:]
    assert "damage found and repaired" in out, out[-4000:]
    assert "verdict: SAFE" in out and "dropped replication slot 'demo' on the source" in out, out[-4000:]
    assert "schema changes on the source: ALTER TABLE customers ADD COLUMN vip" in out, out[-4000:]
    assert "[ok  ] schemas equal: the definitions of 4 table(s) are the source's" in out, out[-4000:]
    assert "[ok  ] tables equal: rows of 4 table(s) equal" in out, out[-4000:]
    assert re.search(r"summary: \d+ source transactions", out), out[-4000:]
