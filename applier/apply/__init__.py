"""Apply stage: whole source transactions -> target transactions.

``dispatch.Applier`` is the stage's face (the assembler's ``TransactionSink``); ``build`` puts it
together for a target session; ``plan`` decides each transaction's route. Inside: the one
owner of the target transaction (``transaction``), over the target session (``target``) and the bookkeeping store
(``progress.store``); the relations and their mappings onto target tables (``relation_cache``,
``mapping``); the careful path (``careful``, one statement per row, conflicts resolved by
``conflicts``) and the fast path (the ``fast`` package: ``path``, ``batch``, ``ops``, ``sql``,
``pipeline``, and the ``lane`` with its C core and its ``seat``; ``copy`` encodes COPY data);
the change feed's writers (the ``feed`` package); and the handlers beyond rows (``handlers``:
``twophase``, ``origins``, ``messages``, ``skipping``), the divert interface they use
(``divert``), the initial copy's filter (``sync_filter``) and the second session that applies a
streamed transaction as it streams (``streaming``). Must never read the network stream or decide
transaction boundaries: the assembler drives it.

Import the modules themselves: this package imports nothing, so that loading one part does not
load them all.
"""
