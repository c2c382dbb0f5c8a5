"""One replication session of the worker: connect, check, build the data path, stream, clean up.

Owns the order of a session's start (target session, source control connection, the slot and
publications checked, a vanished slot never replaced, the stream opened at the recorded position
and the server it reached checked against the target's records before anything is written:
``source.lineage``; then the apply stage built on that position),
the data path it wires (stream -> ingest gate -> assembler -> apply -> progress; the change
feed's tables registered before anything is applied), and tearing all
of it down whatever happened, each step on its own. A failure leaves as it came (the worker's
error policy decides what follows), except that one that stops the worker is described for the
operator: the slot, the last source LSN received, and how to skip a failing transaction. Must
never retry: the worker does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg

from ..apply.build import ApplyOptions, main_applier, second_applier
from ..apply.dispatch import Applier
from ..apply.fast.path import BatchLimits
from ..apply.mapping import Reflector
from ..apply.source_catalog import SourceCatalog
from ..apply.streaming import StreamingApply
from ..apply.target import TargetSession
from ..assembler import Assembler
from ..config import ConfigError, Settings, parse_table_name
from ..connections import connect
from ..errors import ApplyError, Cause, SourceError
from ..ingest.gate import IngestGate
from ..preflight import check_source
from ..progress.bookkeeping import SqlBookkeeping
from ..progress.feed import ChangeTable
from ..progress.feed_registry import FeedRegistry
from ..progress.records import AppliedPosition, SourceIdentity, TableName
from ..protocol.lsn import LSN
from ..protocol.messages import Relation
from ..source import ReplicationStream, StreamOptions, UnsupportedOption, options_for
from ..source.lineage import check_lineage, missing_slot
from ..source.slots import create_slot, failover_slot, slot_info
from ..source.stream import classify
from .loop import CaughtUp, StreamLoop
from .publication import PublicationFollower
from .requests import Requests

if TYPE_CHECKING:
    from ..headstart import HeadStart
    from ..ops.metrics import Telemetry

__all__ = ["ReplicationSession", "SessionState", "summary"]

log = logging.getLogger(__name__)


class SessionState:
    """What outlives one session: decided by an earlier one, or by the worker."""

    def __init__(self) -> None:
        #: Everything up to this source commit LSN goes through the careful, row-by-row path.
        self.careful_until = LSN(0)
        #: --binary auto met a relation whose binary values would not mean the same on the
        #: target: text values from then on.
        self.text_values = False
        #: Streamed xids whose early apply was open when a session ended: applied at their commit.
        self.refused_early: set[int] = set()
        #: Of those, the ones whose early apply met a conflict: row by row at their commit.
        self.careful_xids: set[int] = set()
        self.caught_up: CaughtUp | None = None
        #: A target transaction committed in the last session (the backoff starts over).
        self.progressed = False


@dataclass(frozen=True)
class SlotRecords:
    """What the target holds for the slot when a session starts."""

    position: AppliedPosition | None
    identity: SourceIdentity | None  # the source server the position comes from
    recorded: bool                   # any record: a worker or a sync ran for the slot

    @property
    def start_lsn(self) -> LSN:
        return self.position.end_lsn if self.position is not None else LSN(0)


class ReplicationSession:
    def __init__(self, settings: Settings, state: SessionState, telemetry: Telemetry,
                 head_start: HeadStart | None, stopping: threading.Event,
                 warn: Callable[[str], None], spill_dir: Path) -> None:
        self.settings = settings
        self.slot = settings.required("slot")
        self.state = state
        self.telemetry = telemetry
        self.head_start = head_start
        self.stopping = stopping
        self.warn = warn
        self.spill_dir = spill_dir
        self.stream: ReplicationStream | None = None

    def run(self) -> None:
        settings, state = self.settings, self.state
        target = self._target_session()
        try:
            control = connect(settings.required("source"), autocommit=True,
                              application_name="applier control")
        except psycopg.Error as exc:
            target.close()
            raise classify(exc) from exc
        stream: ReplicationStream | None = None
        assembler: Assembler | None = None
        applier: Applier | None = None
        early: StreamingApply | None = None
        loop: StreamLoop | None = None
        requests: Requests | None = None
        reflector = Reflector(settings.required("target"))
        catalog = SourceCatalog(settings.required("source"))
        try:
            records = self._records()
            slot_two_phase = self._check_source(control, records)
            try:
                options = options_for(settings, control, slot_two_phase,
                                      text_values=state.text_values)
            except UnsupportedOption as exc:
                raise ConfigError(str(exc)) from None
            # The server the stream reached is checked against the target's records before
            # anything is written to the target (a copy, the change feed) or applied.
            stream, started_early = self._open_stream(options, records.start_lsn,
                                                      target.server_encoding)
            self.stream = stream
            self._follow_source(stream, records)
            # Tables added to a publication (while stopped, or noticed last session) are copied
            # before anything else; their changes are then filtered by their sync LSN.
            publications = PublicationFollower(settings, self.slot, control, self.stopping)
            copied = publications.start()
            feeds = self._change_feed(publications.published, copied)

            def on_commit(end_lsn: LSN, target_lsn: LSN | None) -> None:
                state.progressed = True
                assert loop is not None
                loop.committed(end_lsn, target_lsn)

            applier = self._applier(target, options, reflector, on_commit,
                                    lambda msg: publications.relation(msg.namespace, msg.name,
                                                                      msg.relation_id),
                                    feeds, catalog)
            applied = applier.tx.applied
            # Nothing else writes the position while this worker holds the slot's lock.
            assert applied.end_lsn == records.start_lsn, (applied, records)
            if state.caught_up is None and settings.exit_when_caught_up:
                assert stream.lineage is not None  # read before the stream started
                state.caught_up = CaughtUp(stream.lineage.position)
                log.info("will exit once caught up with source position %s", state.caught_up.goal)
            # The early session applies as the fast path does: without it, at the commit.
            if (settings.streamed_apply == "early" and options.streaming != "off"
                    and applier.fast is not None):
                main = applier
                early = StreamingApply(
                    main, lambda: second_applier(main, self._target_session("streamed"), reflector,
                                               spill_dir=self.spill_dir),
                    state.refused_early)
            assembler = Assembler(applier, memory_budget=settings.memory_budget,
                                  spill_dir=self.spill_dir, heartbeat=stream.send_status_if_due,
                                  early=early)
            flushed = early.flushed_wal_lsn if early is not None else target.flushed_wal_lsn
            streaming = early
            requests = Requests(settings.required("target"), self.slot, applier, stream, publications,
                                self.stopping.is_set,
                                lambda: streaming is not None and streaming.applying)
            requests.start()  # a position to hold at is honoured from the first transaction on
            loop = StreamLoop(stream, assembler, applier, IngestGate(assembler, applier.lane),
                              control, self.slot, flushed, state.caught_up, self.stopping.is_set,
                              settings.progress_interval, publications.check,
                              requests.between_transactions,
                              lambda: streaming is not None and streaming.applying)
            self.telemetry.attach(stream, assembler, applier)
            log.info("streaming from %s (recorded commit %s) with %s%s", applied.end_lsn,
                     applied.commit_lsn, options.sql(),
                     ", started while the worker loaded" if started_early else "")
            if not started_early:
                stream.start(applied.end_lsn)
            loop.run()
        except ApplyError as exc:
            if exc.careful_until is not None:
                state.careful_until = LSN(max(state.careful_until, exc.careful_until))
            if exc.cause is Cause.TEXT_VALUES_NEEDED:
                state.text_values = True
            raise
        finally:
            if loop is not None:  # a stretch this session redid row by row, if any
                state.careful_until = LSN(max(state.careful_until, loop.careful_until))
            # Each step on its own: a failure in one (a dead connection) must not keep the next
            # from running, above all closing the replication connection, whose walsender
            # otherwise holds the slot.
            self.telemetry.detach()
            steps: list[Callable[[], object]] = []
            if requests is not None:
                steps.append(requests.close)  # a copy beside the stream stops first
            if early is not None:
                steps.append(early.close)
            if applier is not None:
                steps.append(applier.abort_open_transaction)
            if assembler is not None:
                steps.append(assembler.close)
            if loop is not None:
                steps.append(loop.confirm_durable)
            if stream is not None:
                steps += [stream.send_status, stream.close]
            if applier is not None:
                final = applier
                steps.append(lambda: log.info("%s", summary(final)))
            steps += [target.close, control.close, reflector.close, catalog.close]
            for step in steps:
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - the session is ending; its cause is reported
                    log.debug("cleanup step %s failed: %s", getattr(step, "__qualname__", step), exc)

    def describe(self, exc: BaseException) -> str:
        """``exc`` for the operator: the slot, and how to skip the transaction. The last
        received source LSN is the log line's (``received_lsn``): named here, before the
        transaction's LSN, it would be taken for the one to skip."""
        text = f"{exc} (slot {self.slot!r})"
        if isinstance(exc, ApplyError) and exc.commit_lsn is not None:
            text += (f". If this source transaction must not be applied, skip it: applier skip "
                     f"--target <target DSN> --slot {self.slot} --lsn {exc.commit_lsn} (or start "
                     f"the worker with --skip-lsn {exc.commit_lsn})")
        return text

    def _target_session(self, role: str | None = None) -> TargetSession:
        name = f"applier {self.slot}" + (f" ({role})" if role else "")
        return TargetSession(self.settings.required("target"), application_name=name,
                             synchronous_commit=self.settings.synchronous_commit)

    def _change_feed(self, published: set[TableName], copied: dict[TableName, LSN]
                     ) -> dict[TableName, ChangeTable]:
        """The change tables of the tables --change-feed records, registered (created, or
        history started again) before anything is applied: from the position recorded now on,
        or from a table's copy."""
        names = self.settings.change_feed
        if not names:
            return {}
        wanted = published if names == ["all"] else {parse_table_name(n, "change_feed") for n in names}
        missing = sorted(wanted - published)
        if missing:
            raise ConfigError(f"change_feed: {', '.join(f'{s}.{t}' for s, t in missing)} not published "
                              f"by {', '.join(self.settings.publication)}")
        with connect(self.settings.required("target")) as conn:
            store = SqlBookkeeping(conn)
            position = store.position(self.slot)
            sync_lsns = {key: state.sync_lsn for key, state in store.table_states(self.slot).items()
                         if state.sync_lsn is not None}
            sync_lsns.update(copied)
            return FeedRegistry(conn).register(self.slot, wanted,
                                               position.commit_lsn if position else LSN(0), sync_lsns,
                                               self.settings.change_feed_retention / 7)

    def _applier(self, target: TargetSession, options: StreamOptions, reflector: Reflector,
                 on_commit: Callable[[LSN, LSN | None], None],
                 on_relation: Callable[[Relation], None],
                 feeds: dict[TableName, ChangeTable], catalog: SourceCatalog) -> Applier:
        settings, state = self.settings, self.state
        # --batch-rows 0: no fast path, every source transaction on the careful path.
        limits = None if settings.batch_rows == 0 else BatchLimits(
            settings.batch_rows, min(settings.batch_bytes, settings.memory_budget // 2),
            settings.batch_time / 1000, settings.batch_wait / 1000)
        apply_options = ApplyOptions(
            slot=self.slot, limits=limits, track_target_lsn=settings.synchronous_commit == "off",
            # auto: binary values until a relation is found not binary-safe (checked per relation).
            binary_check=settings.binary == "auto" and options.binary,
            two_phase=options.two_phase, two_phase_mode=settings.two_phase_mode,
            replication_origin=settings.replication_origin, skip_origins=settings.skip_origin,
            message_sink=settings.message_sink, message_prefixes=settings.message_prefix,
            conflict_policy=settings.conflict_policy,
            follow_schema=settings.schema_changes == "follow", source=catalog,
            feeds=feeds, feed_interval=settings.change_feed_retention / 7)
        try:
            return main_applier(target, apply_options, reflector, on_commit,
                                careful_until=state.careful_until, careful_xids=state.careful_xids,
                                warn=self.warn,
                                on_relation=on_relation)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _open_stream(self, options: StreamOptions, start_lsn: LSN, encoding: str
                     ) -> tuple[ReplicationStream, bool]:
        """The stream started while the worker loaded, if it is the one this session would start
        (True); else a new connection, not started yet (False). Either has read its lineage."""
        if self.head_start is not None:
            stream = self.head_start.take(options, start_lsn, encoding)
            if stream is not None:
                return stream, True
        stream = ReplicationStream(self.settings.required("source"), self.slot, options,
                                   status_interval=self.settings.status_interval,
                                   client_encoding=encoding)
        try:
            stream.connect()
            stream.read_lineage()
        except BaseException:
            stream.close()
            raise
        return stream, False

    def _records(self) -> SlotRecords:
        """What the target holds for the slot, read before anything of the session starts."""
        with connect(self.settings.required("target"), autocommit=True,
                     application_name=f"applier {self.slot} (start)") as conn:
            store = SqlBookkeeping(conn)
            return SlotRecords(store.position(self.slot), store.source_identity(self.slot),
                               store.slot_recorded(self.slot))

    def _check_source(self, control: psycopg.Connection, records: SlotRecords) -> bool:
        """Slot and publications exist (creating the slot when asked, once everything else is
        checked: a failed start leaves no slot behind, and only where the target has no records
        of the slot: a slot that vanished is never replaced); returns the slot's two_phase."""
        settings = self.settings
        if records.recorded and slot_info(control, self.slot) is None:
            raise missing_slot(self.slot, records.position)
        problems = check_source(control, slot=self.slot, publications=settings.publication,
                                create_slot=bool(settings.create_slot))
        if problems:
            raise SourceError("; ".join(problems), cause=Cause.NEEDS_OPERATOR)
        info = slot_info(control, self.slot)
        if info is None:
            two_phase = bool(settings.two_phase)
            try:
                failover = failover_slot(settings.failover_slot, control.info.server_version,
                                         two_phase)
            except UnsupportedOption as exc:
                raise ConfigError(str(exc)) from None
            info = create_slot(control, self.slot, two_phase=two_phase, failover=failover)
            log.info("created %sslot %r at %s", "failover " if failover else "", self.slot,
                     info.confirmed_flush_lsn)
        return info.two_phase

    def _follow_source(self, stream: ReplicationStream, records: SlotRecords) -> None:
        """Refuse a source server the target's progress does not belong to (``lineage``), before
        the stream starts; then record the server it comes from from now on."""
        lineage = stream.lineage
        assert lineage is not None  # read before the stream started
        if lineage.slot is None:  # the control connection reached another server
            raise missing_slot(self.slot, records.position)
        followed = check_lineage(self.slot, lineage, records.identity, records.position)
        if followed is not None:
            log.warning("%s", followed)
        if records.identity != lineage.identity:
            with connect(self.settings.required("target"), autocommit=True,
                         application_name=f"applier {self.slot} (start)") as conn:
                SqlBookkeeping(conn).record_source_identity(self.slot, lineage.identity)


def summary(applier: Applier) -> str:
    counts = applier.counts
    text = (f"this session applied {counts['transactions']} transaction(s): "
            + ", ".join(f"{counts[kind]} {kind}" for kind in ("insert", "update", "delete", "truncate")))
    if counts["streamed_early"]:
        text += f"; {counts['streamed_early']} streamed transaction(s) applied as they streamed"
    if counts["skipped_origin"]:
        text += f"; dropped {counts['skipped_origin']} transaction(s) from skipped origins"
    if applier.conflicts:
        text += "; conflicts: " + ", ".join(f"{kind} on {table} x{n}"
                                            for (table, kind), n in sorted(applier.conflicts.items()))
    return text
