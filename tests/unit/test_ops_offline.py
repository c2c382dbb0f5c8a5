"""Operations without a server: lag and its limits, log lines, the configuration reference."""

from __future__ import annotations

import io
import json
import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from applier.config import ConfigError, load_settings, mask_dsn
from applier.ops import logs
from applier.ops.lag import Lag, measure_lag, parse_lag_limit
from applier.ops.reference import REFERENCE_PATH, config_reference, reference_block
from applier.protocol.lsn import LSN

REPO = Path(__file__).resolve().parents[2]
NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)


def test_lag_counts_only_unhandled_wal() -> None:
    assert measure_lag(LSN(1000), LSN(1000), None, NOW) == Lag(0, 0.0)
    assert measure_lag(LSN(1000), LSN(2000), None, NOW) == Lag(0, 0.0)  # confirmed beyond: no lag
    assert measure_lag(LSN(1500), LSN(1000), NOW - timedelta(seconds=7), NOW) == Lag(500, 7.0)
    assert measure_lag(LSN(1500), LSN(1000), None, NOW) == Lag(500, None)


@pytest.mark.parametrize("text, size, seconds", [
    ("64MB", 64 * 1024**2, None), ("0", 0, None), ("1048576B", 1048576, None),
    ("30s", None, 30.0), ("5min", None, 300.0), ("2h", None, 7200.0), ("500ms", None, 0.5),
    ("1 day", None, 86400.0),
])
def test_lag_limits(text: str, size: int | None, seconds: float | None) -> None:
    limit = parse_lag_limit(text)
    assert (limit.bytes, limit.seconds) == (size, seconds)


def test_lag_limit_exceeded() -> None:
    assert parse_lag_limit("1kB").exceeded_by(Lag(1025, 0.0))
    assert not parse_lag_limit("1kB").exceeded_by(Lag(1024, 100.0))
    assert parse_lag_limit("10s").exceeded_by(Lag(1, 11.0))
    assert not parse_lag_limit("10s").exceeded_by(Lag(10**9, 9.0))
    assert parse_lag_limit("10s").exceeded_by(Lag(1, None))  # pending, nothing ever applied
    assert not parse_lag_limit("10s").exceeded_by(Lag(0, None))


@pytest.mark.parametrize("text", ["1048576", "5", "0.5"])
def test_lag_limit_without_unit_is_refused(text: str) -> None:
    """Bytes or seconds? Only 0 means the same either way."""
    with pytest.raises(ValueError, match=rf"lag limit '{text}' has no unit.*{text}MB.*{text}s"):
        parse_lag_limit(text)


def test_bad_lag_limit_says_what_is_valid() -> None:
    """Checked when the settings load, so the command stops before it connects anywhere."""
    with pytest.raises(ConfigError, match=r"--max-lag: invalid lag limit '5 parsecs'.*64MB.*30s"):
        load_settings("status", {"max_lag": "5 parsecs"}, None, {})
    with pytest.raises(ConfigError, match=r"APPLIER_READY_MAX_LAG: lag limit '5' has no unit"):
        load_settings("run", {}, None, {"APPLIER_READY_MAX_LAG": "5"})


def test_passwords_inside_longer_text_are_masked_without_eating_the_rest() -> None:
    line = ("connecting to postgresql://app:s3cret@db:5432/x then host=h password=hunter2 "
            "user=u; see http://127.0.0.1:9188/metrics and mail ops@example.com")
    masked = mask_dsn(line)
    assert "s3cret" not in masked and "hunter2" not in masked
    assert "postgresql://app:****@db:5432/x" in masked and "user=u;" in masked
    assert "http://127.0.0.1:9188/metrics and mail ops@example.com" in masked


def _log(fmt: str, level: int, message: str, *args: object, context: dict | None = None,
         **extra: object) -> str:
    out = io.StringIO()
    logs.configure_logging("DEBUG", fmt, out)
    logs.set_log_context((lambda: context) if context is not None else None)
    try:
        logging.getLogger("applier.test").log(level, message, *args, extra=extra or None)
    finally:
        logs.set_log_context(None)
        logging.getLogger().handlers.clear()
    return out.getvalue()


def test_text_errors_name_slot_lsn_and_xid() -> None:
    context = {"slot": "s1", "lsn": LSN(0x16B374D848), "xid": 77}
    error = _log("text", logging.ERROR, "apply failed on %s", "postgresql://u:pw@h/db",
                 context=context)
    assert error.rstrip().endswith("[slot=s1 received_lsn=16/B374D848 xid=77]")
    assert "pw@" not in error and "u:****@h/db" in error
    info = _log("text", logging.INFO, "streaming", context=context)
    assert "slot=" not in info  # routine lines stay short


def test_the_context_follows_the_whole_message() -> None:
    """A message of several lines (a server's DETAIL, the skip command last) keeps its lines
    together: the received LSN comes after them, never between the error and the LSN to skip."""
    error = _log("text", logging.ERROR, "source transaction xid 7, commit LSN 0/10: failed\n"
                 "DETAIL: x. skip it: applier skip --lsn 0/10",
                 context={"slot": "s1", "lsn": LSN(0x20), "xid": 7})
    first, second = error.rstrip().splitlines()
    assert "source transaction xid 7, commit LSN 0/10: failed" in first and "[" not in first
    assert second == "DETAIL: x. skip it: applier skip --lsn 0/10 [slot=s1 received_lsn=0/20 xid=7]"


def test_json_lines_carry_fields_and_mask_passwords() -> None:
    line = _log("json", logging.WARNING, "lost %s", "host=h password='a b' dbname=x",
                context={"slot": "s1", "lsn": LSN(42), "xid": None}, xid=9)
    entry = json.loads(line)
    assert entry["level"] == "WARNING" and entry["logger"] == "applier.test"
    assert entry["slot"] == "s1" and entry["lsn"] == "0/2A" and entry["xid"] == 9
    assert "a b" not in entry["message"] and "dbname=x" in entry["message"]


def test_json_tracebacks_are_masked() -> None:
    out = io.StringIO()
    logs.configure_logging("INFO", "json", out)
    try:
        try:
            raise RuntimeError("cannot reach postgresql://u:topsecret@h/db")
        except RuntimeError:
            logging.getLogger("applier.test").exception("failed")
    finally:
        logging.getLogger().handlers.clear()
    entry = json.loads(out.getvalue())
    assert "RuntimeError" in entry["exception"] and "topsecret" not in entry["exception"]


def test_configuration_reference_is_current() -> None:
    document = (REPO / REFERENCE_PATH).read_text()
    assert reference_block(document) == config_reference(), \
        f"{REFERENCE_PATH} is stale: run python -m applier.ops.reference"
