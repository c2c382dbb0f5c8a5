"""Initial sync: ``applier sync`` copies every published table from a snapshot that matches the
slot, then streams as ``applier run`` does, with no gap and no overlap.

Modules: :mod:`.catalog` (what the source publishes and how it is defined), :mod:`.target`
(target tables checked or created), :mod:`.snapshot` (the exported snapshot and its slot),
:mod:`.copy` (parallel COPY in block ranges), :mod:`.progress` (display), :mod:`.state` (per-table
state on the target and the apply-side filter), :mod:`.runner` (the command). Must never apply
streamed changes: the worker does; this package only tells it, per table, from which source LSN on
changes are not yet in the copy.

Importing this package imports nothing else: the worker imports :mod:`.state` without pulling in
the copy machinery (which itself imports the worker).
"""
