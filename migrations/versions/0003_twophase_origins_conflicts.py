"""Two-phase transactions, origins, logical messages, conflicts and skipped transactions.

Revision ID: 0003
Revises: 0001 (issue 5's table-sync revision 0002 is developed in parallel; at merge the chain
becomes 0001 -> 0002 -> 0003 by setting down_revision = "0002" here)
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE applier.prepared_transactions (
            slot_name     text NOT NULL,
            xid           bigint NOT NULL,
            mode          text NOT NULL CHECK (mode IN ('prepare', 'defer')),
            source_gid    text NOT NULL,
            prepare_lsn   pg_lsn NOT NULL,
            end_lsn       pg_lsn NOT NULL,
            prepare_time  timestamptz,
            origin_name   text,
            origin_lsn    pg_lsn,
            changes       bigint NOT NULL DEFAULT 0,
            stored_at     timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (slot_name, xid)
        )
    """)
    op.execute("COMMENT ON TABLE applier.prepared_transactions IS "
               "'Source transactions prepared but not yet committed or rolled back. mode defer: "
               "committed at PREPARE with the content in prepared_changes; mode prepare: written "
               "inside the target''s own prepared transaction, so visible only once it commits.'")
    op.execute("""
        CREATE TABLE applier.prepared_changes (
            slot_name text NOT NULL,
            xid       bigint NOT NULL,
            seq       integer NOT NULL,
            data      bytea NOT NULL,
            PRIMARY KEY (slot_name, xid, seq)
        )
    """)
    op.execute("COMMENT ON TABLE applier.prepared_changes IS "
               "'Content of deferred prepared transactions (two-phase mode defer): pgoutput "
               "messages, each an Int32 length then the bytes, in chunks, replayed at COMMIT "
               "PREPARED.'")
    op.execute("""
        CREATE TABLE applier.origins (
            slot_name    text NOT NULL,
            origin_name  text NOT NULL,
            origin_lsn   pg_lsn,
            commit_lsn   pg_lsn NOT NULL,
            commit_time  timestamptz,
            transactions bigint NOT NULL DEFAULT 1,
            applied_at   timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (slot_name, origin_name)
        )
    """)
    op.execute("COMMENT ON TABLE applier.origins IS "
               "'Per replication origin seen in the source stream: the origin LSN of the last "
               "transaction applied from it, written in that transaction.'")
    op.execute("""
        CREATE TABLE applier.messages (
            id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            slot_name     text NOT NULL,
            lsn           pg_lsn NOT NULL,
            transactional boolean NOT NULL,
            prefix        text NOT NULL,
            content       bytea NOT NULL,
            xid           bigint,
            commit_lsn    pg_lsn,
            received_at   timestamptz NOT NULL DEFAULT now(),
            UNIQUE (slot_name, lsn)
        )
    """)
    op.execute("COMMENT ON TABLE applier.messages IS "
               "'pg_logical_emit_message payloads (applier run --messages --message-sink table): "
               "transactional ones written in their transaction, non-transactional ones at once.'")
    op.execute("""
        CREATE TABLE applier.conflicts (
            id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            slot_name         text NOT NULL,
            conflict_type     text NOT NULL,
            resolution        text NOT NULL,
            table_schema      text NOT NULL,
            table_name        text NOT NULL,
            source_xid        bigint,
            source_lsn        pg_lsn,
            key               jsonb,
            local_row         jsonb,
            remote_row        jsonb,
            local_origin      text,
            local_commit_time timestamptz,
            detected_at       timestamptz NOT NULL DEFAULT now()
        )
    """)
    op.execute("CREATE INDEX conflicts_by_table ON applier.conflicts "
               "(slot_name, table_schema, table_name, conflict_type)")
    op.execute("COMMENT ON TABLE applier.conflicts IS "
               "'Every apply conflict with both row images, written in the transaction that "
               "resolved it (policy error: in its own transaction, before the worker stops).'")
    op.execute("""
        CREATE TABLE applier.skip_requests (
            slot_name    text PRIMARY KEY,
            lsn          pg_lsn NOT NULL,
            requested_at timestamptz NOT NULL DEFAULT now()
        )
    """)
    op.execute("COMMENT ON TABLE applier.skip_requests IS "
               "'applier skip --lsn: the finish (commit or prepare) LSN of the one source "
               "transaction to skip; removed in the transaction that skips it.'")
    op.execute("""
        CREATE TABLE applier.skipped_transactions (
            id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            slot_name   text NOT NULL,
            finish_lsn  pg_lsn NOT NULL,
            end_lsn     pg_lsn,
            xid         bigint,
            source_gid  text,
            kind        text NOT NULL,
            changes     bigint NOT NULL,
            tables      text[] NOT NULL,
            skipped_at  timestamptz NOT NULL DEFAULT now()
        )
    """)
    op.execute("COMMENT ON TABLE applier.skipped_transactions IS "
               "'Source transactions skipped on request, recorded in the transaction that "
               "records the position past them.'")


def downgrade() -> None:
    for table in ("skipped_transactions", "skip_requests", "conflicts", "messages", "origins",
                  "prepared_changes", "prepared_transactions"):
        op.execute(f"DROP TABLE applier.{table}")
