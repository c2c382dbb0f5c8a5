"""The fast path, one module family: several source transactions in one target transaction.

``path.FastPath`` is what the rest of the apply stage talks to: it owns the target transaction
of a batch, its parts sent ahead and its commit. Behind it: ``batch`` records the changes
(the one owner of ``ops.Op``), ``ops`` holds their shapes and sizes, ``sql`` turns them into
statements and COPYs, ``pipeline`` sends them with their expected row counts, and the C lane
(``lane``, its core in ``apply/_lane.c``) takes plain transactions straight from the received
payloads into the batch through its seat (``seat``). Must never decide which transactions take
it: ``plan`` does. This module imports none of them.
"""
