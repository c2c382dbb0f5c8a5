"""Whether a replica would survive a failover of its source: the part of ``applier status`` that
looks at the source's standbys.

A logical slot survives the promotion of a physical standby only as a failover slot (PostgreSQL
17+) that the standby keeps a synchronised copy of, and the replica can go on from that copy only
if the standby had received everything the worker applied: the primary's
``synchronized_standby_slots`` makes the slot wait for the standbys it names. So this reads, on
the primary (the source), the slot's failover flag, ``synchronized_standby_slots`` and its
physical slots; and on each standby given (``--standby``): that it is a standby of this primary,
the settings slot synchronisation needs (``wal_level = logical``, ``sync_replication_slots``,
``hot_standby_feedback``, ``primary_slot_name`` naming a physical slot of the primary, a
``dbname`` in ``primary_conninfo``), and its copy of the slot: there, synchronised, persistent,
valid, and how far behind the primary's slot. Each problem says what to change, on which server.

Owns those reads and that assessment. Must never change anything on any server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from psycopg.conninfo import conninfo_to_dict

from ..protocol.lsn import LSN
from ..queries import rows
from ..quoting import ident
from ..source.slots import SlotInfo

__all__ = ["FailoverReport", "PrimaryFacts", "StandbyFacts", "StandbyReport", "assess",
           "read_primary", "read_standby", "render_failover", "standby_label"]

#: The settings a standby's slot synchronisation needs, and their values.
_STANDBY_SETTINGS = ("wal_level", "sync_replication_slots", "hot_standby_feedback",
                     "primary_slot_name", "primary_conninfo")
_RELOAD = "SELECT pg_catalog.pg_reload_conf()"


@dataclass(frozen=True)
class PrimaryFacts:
    """The source's side: version, system identifier, synchronized_standby_slots (None before
    17), its physical slots (and which a standby streams from now), whether any slot is a
    failover slot."""

    version: int
    system_identifier: str
    synchronized: list[str] | None
    physical_slots: list[str]
    active_physical_slots: list[str]
    any_failover_slot: bool


@dataclass(frozen=True)
class StandbyFacts:
    """One standby as it says itself: recovery, identity, settings (a setting it may not read
    is missing), replayed position, and its copy of the slot (None: none)."""

    version: int
    in_recovery: bool
    system_identifier: str
    settings: dict[str, str]
    replay_lsn: LSN | None
    copy: dict[str, Any] | None


@dataclass
class StandbyReport:
    """What status says about one standby: ready to take over the replica, or what to change."""

    standby: str                     # host:port, never the connection string's secrets
    ready: bool
    copy: str                        # the synchronised copy of the slot, in words
    behind_bytes: int | None = None  # the copy's confirmed position behind the primary's slot
    replay_behind_bytes: int | None = None
    problems: list[str] = field(default_factory=list)


@dataclass
class FailoverReport:
    """The slot's failover readiness: ``slot_failover`` None on a source before 17."""

    supported: bool
    slot_failover: bool | None
    synchronized_standby_slots: list[str] | None
    standbys: list[StandbyReport]
    warnings: list[str]

    @property
    def ready(self) -> bool:
        """With standbys given: every one can take over the replica."""
        return all(standby.ready for standby in self.standbys)


def read_primary(conn: Any) -> PrimaryFacts:
    """The source's side (a psycopg or SQLAlchemy connection)."""
    row = rows(conn, "SELECT pg_catalog.current_setting('server_version_num')::int, "
                     "pg_catalog.current_setting('synchronized_standby_slots', true), "
                     "(SELECT system_identifier::text FROM pg_catalog.pg_control_system()), "
                     "ARRAY(SELECT slot_name::text FROM pg_catalog.pg_replication_slots "
                     "      WHERE slot_type = 'physical' ORDER BY 1), "
                     "ARRAY(SELECT slot_name::text FROM pg_catalog.pg_replication_slots "
                     "      WHERE slot_type = 'physical' AND active ORDER BY 1), "
                     "EXISTS (SELECT FROM pg_catalog.pg_replication_slots s "
                     "        WHERE (pg_catalog.to_jsonb(s) ->> 'failover')::bool)")[0]
    synchronized = None if row[1] is None else [n.strip() for n in row[1].split(",") if n.strip()]
    return PrimaryFacts(row[0], row[2], synchronized, list(row[3]), list(row[4]), bool(row[5]))


def read_standby(conn: Any, slot: str) -> StandbyFacts:
    """A standby's side, and its copy of ``slot``."""
    row = rows(conn, "SELECT pg_catalog.current_setting('server_version_num')::int, "
                     "pg_catalog.pg_is_in_recovery(), "
                     "(SELECT system_identifier::text FROM pg_catalog.pg_control_system()), "
                     "pg_catalog.pg_last_wal_replay_lsn()::text")[0]
    # pg_settings leaves out what the role may not read (primary_conninfo holds a password).
    settings = dict(rows(conn, "SELECT name, setting FROM pg_catalog.pg_settings "
                               "WHERE name = ANY(%(names)s)", {"names": list(_STANDBY_SETTINGS)}))
    found = rows(conn, "SELECT (j ->> 'synced')::bool, s.temporary, j ->> 'invalidation_reason', "
                       "s.confirmed_flush_lsn::text, (j ->> 'failover')::bool "
                       "FROM pg_catalog.pg_replication_slots s, pg_catalog.to_jsonb(s) AS j "
                       "WHERE s.slot_name = %(slot)s", {"slot": slot})
    copy = None
    if found:
        synced, temporary, invalidated, confirmed, failover = found[0]
        copy = {"synced": synced, "temporary": temporary, "invalidation_reason": invalidated,
                "confirmed_flush_lsn": LSN.parse(confirmed) if confirmed else None,
                "failover": failover}
    return StandbyFacts(row[0], bool(row[1]), row[2], settings,
                        LSN.parse(row[3]) if row[3] else None, copy)


def standby_label(dsn: str) -> str:
    """``host:port`` of a standby's connection string, for the report."""
    params = conninfo_to_dict(dsn)
    return f"{params.get('host') or params.get('hostaddr') or 'localhost'}:{params.get('port') or 5432}"


def assess(slot_name: str, slot: SlotInfo | None, primary: PrimaryFacts, wal_lsn: LSN,
           standbys: list[tuple[str, StandbyFacts | str]]) -> FailoverReport:
    """The report: ``standbys`` as (label, what it said, or why it could not be read)."""
    supported = primary.version >= 170000
    report = FailoverReport(supported, slot.failover if slot else None, primary.synchronized,
                            [], _primary_warnings(primary))
    for label, facts in standbys:
        if isinstance(facts, str):
            report.standbys.append(StandbyReport(label, False, "unknown", problems=[facts]))
        else:
            report.standbys.append(_standby(slot_name, slot, primary, wal_lsn, label, facts))
    if slot is not None and supported and slot.failover is False:
        fix = (f"slot {slot_name!r} is not a failover slot, so no standby keeps a copy of it and a "
               "failover of the source ends the replica: stop the worker, run "
               f"psql \"<source DSN> replication=database\" -c 'ALTER_REPLICATION_SLOT "
               f"{ident(slot_name)} (FAILOVER true)' and start it again")
        report.warnings.append(fix)
        for standby in report.standbys:
            standby.ready = False
    return report


def _primary_warnings(primary: PrimaryFacts) -> list[str]:
    if primary.version < 170000:
        return [f"the source runs PostgreSQL {primary.version // 10000}, which has no failover "
                "slots: after a failover of the source, only a new replica (applier sync) "
                "can follow it"]
    named = primary.synchronized or []
    warnings = []
    if primary.any_failover_slot and not named:
        suggestion = ", ".join(primary.active_physical_slots or primary.physical_slots) or "NAME"
        warnings.append(
            "the source has failover slots but synchronized_standby_slots is empty: the worker may "
            "apply changes a standby has not received, and after that standby's promotion it "
            "stops, the replica holding changes the new primary never had. On the source: ALTER "
            f"SYSTEM SET synchronized_standby_slots = '{suggestion}' (the standbys' physical "
            f"slots); {_RELOAD}")
    for name in named:
        if name not in primary.physical_slots:
            warnings.append(
                f"synchronized_standby_slots names {name!r}, which is no physical slot of the "
                "source: failover slots wait for it, and the worker receives nothing. Create it "
                f"(SELECT pg_catalog.pg_create_physical_replication_slot('{name}')) or remove it "
                f"from synchronized_standby_slots; {_RELOAD}")
    missing = [name for name in primary.active_physical_slots if name not in named]
    if named and missing:
        warnings.append(
            f"synchronized_standby_slots does not name {', '.join(map(repr, missing))}, physical "
            "slot(s) a standby streams from now: the worker may apply changes that standby has "
            "not received, and could not go on after its promotion. Add them on the source: "
            f"ALTER SYSTEM SET synchronized_standby_slots = '{', '.join(named + missing)}'; {_RELOAD}")
    return warnings


def _standby(slot_name: str, slot: SlotInfo | None, primary: PrimaryFacts, wal_lsn: LSN,
             label: str, facts: StandbyFacts) -> StandbyReport:
    report = StandbyReport(label, False, "none")
    if facts.replay_lsn is not None:
        report.replay_behind_bytes = max(0, int(wal_lsn) - int(facts.replay_lsn))
    problems = report.problems
    if not facts.in_recovery:
        problems.append(f"{label} is not in recovery: not a standby (a promoted one is a primary)")
        return report
    if facts.system_identifier != primary.system_identifier:
        problems.append(f"{label} is a standby of another server (system identifier "
                        f"{facts.system_identifier}, the source's is {primary.system_identifier})")
        return report
    if facts.version < 170000:
        problems.append(f"{label} runs PostgreSQL {facts.version // 10000}: standbys keep copies "
                        "of logical slots from PostgreSQL 17 on")
        return report
    problems.extend(_settings_problems(label, facts.settings, primary))
    report.copy, copy_problem = _copy(slot_name, slot, facts.copy, report)
    if copy_problem:
        problems.append(f"{label}: {copy_problem}")
    report.ready = not problems
    return report


def _settings_problems(label: str, settings: dict[str, str], primary: PrimaryFacts) -> list[str]:
    on_standby = f"on {label}:"
    problems = []
    if settings.get("wal_level") != "logical":
        problems.append(f"{on_standby} wal_level is {settings.get('wal_level')!r}; a standby keeps "
                        "logical slots only with ALTER SYSTEM SET wal_level = logical, then a "
                        "restart of the standby")
    for name in ("sync_replication_slots", "hot_standby_feedback"):
        if settings.get(name) != "on":
            problems.append(f"{on_standby} {name} is off: ALTER SYSTEM SET {name} = on; {_RELOAD}")
    slot = settings.get("primary_slot_name", "")
    if not slot:
        problems.append(f"{on_standby} primary_slot_name is empty; slot synchronisation needs the "
                        "standby to stream through a physical slot: on the source SELECT "
                        "pg_catalog.pg_create_physical_replication_slot('NAME'), then on the standby "
                        f"ALTER SYSTEM SET primary_slot_name = 'NAME'; {_RELOAD}")
    elif slot not in primary.physical_slots:
        problems.append(f"the source has no physical slot {slot!r}, {label}'s primary_slot_name: "
                        "on the source SELECT pg_catalog.pg_create_physical_replication_slot("
                        f"'{slot}')")
    elif slot not in (primary.synchronized or []):
        problems.append(f"the source's synchronized_standby_slots does not name {slot!r} ({label}'s "
                        "slot): the worker may apply changes the standby has not received, and "
                        "could not go on after its promotion. On the source: ALTER SYSTEM SET "
                        f"synchronized_standby_slots = '{', '.join((primary.synchronized or []) + [slot])}'; "
                        f"{_RELOAD}")
    conninfo = settings.get("primary_conninfo")
    if conninfo is None:
        problems.append(f"{on_standby} primary_conninfo cannot be read by this role (a superuser or "
                        "a member of pg_read_all_settings can): make sure it names a dbname, which "
                        "slot synchronisation connects to")
    elif not conninfo_to_dict(conninfo).get("dbname"):
        problems.append(f"{on_standby} primary_conninfo names no dbname, which slot synchronisation "
                        "connects to: add dbname=postgres (or any database) to it; "
                        f"ALTER SYSTEM SET primary_conninfo = '...'; {_RELOAD}")
    return problems


def _copy(slot_name: str, slot: SlotInfo | None, copy: dict[str, Any] | None,
          report: StandbyReport) -> tuple[str, str | None]:
    """The standby's copy of the slot in words, and what is wrong with it (None: usable)."""
    if copy is None:
        return "none", (f"holds no copy of slot {slot_name!r} yet: the slot sync worker makes one "
                        "within seconds once the primary's slot is a failover slot and the "
                        "settings above are right")
    if not copy["synced"]:
        return "not synchronised", (f"its slot {slot_name!r} was created on the standby, not "
                                    "synchronised from the source: drop it there")
    if copy["invalidation_reason"]:
        return f"invalidated ({copy['invalidation_reason']})", (
            f"its copy of slot {slot_name!r} is invalidated ({copy['invalidation_reason']}): the "
            "slot sync worker replaces it once the settings above are right")
    confirmed = copy["confirmed_flush_lsn"]
    if slot is not None and slot.confirmed_flush_lsn is not None and confirmed is not None:
        report.behind_bytes = max(0, int(slot.confirmed_flush_lsn) - int(confirmed))
    if copy["temporary"]:
        return "synchronised, not yet persistent", (
            f"its copy of slot {slot_name!r} is not usable yet: it stays temporary until the "
            "source's slot moves past what the standby can decode from (a running worker moves "
            "it, within about 15 s of activity); a promotion now would drop it")
    return f"synchronised (confirmed flush {confirmed})", None


def render_failover(report: FailoverReport) -> list[tuple[str, str]]:
    """Rows for status's table."""
    if not report.supported:
        return [("failover slot", "not supported by the source (PostgreSQL 17+)")]
    state = {True: "yes", False: "no", None: "unknown: the slot is missing"}[report.slot_failover]
    synchronized = report.synchronized_standby_slots
    result = [("failover slot", state),
              ("synchronized_standby_slots", ", ".join(synchronized) if synchronized else "empty")]
    for standby in report.standbys:
        text = ("ready" if standby.ready else "NOT READY") + f": copy {standby.copy}"
        if standby.behind_bytes is not None:
            text += f", {standby.behind_bytes} bytes behind the slot"
        if standby.replay_behind_bytes is not None:
            text += f"; replay {standby.replay_behind_bytes} bytes behind the source"
        text += "".join(f"\n  - {problem}" for problem in standby.problems)
        result.append((f"standby {standby.standby}", text))
    return result
