"""The change feed's writers in the apply stage, one package behind one interface.

The apply stage writes through ``writer.FeedWriter`` (the session's writer: a change row's
meta, the change tables' partitions, the commit's row of applier.change_commits); beside it
``meta`` encodes a change row's meta columns once per transaction for every route, ``rows`` is
the SQL and COPY data of the fast path's change rows, and ``spool`` keeps the change rows of a
transaction applied as it streams until its commit LSN is known. Imported in that order (meta,
spool, rows, writer), no circle; this module imports none of them, so that the fast path's
modules may import ``meta`` alone. Must never decide what is applied.
"""
