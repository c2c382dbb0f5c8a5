"""How a target transaction takes a schema change (``TargetTransaction.schema_changes``).

Owns only the three modes' names, shared by the schema follower, the change feed and two-phase
apply. Must never make a schema change.
"""

from __future__ import annotations

__all__ = ["DDL_INLINE", "DDL_REFUSED", "DDL_SEPARATELY"]

#: Inside the transaction (the rule), committed on its own before it (then the source sends the
#: transaction again), or not at all (the transaction is applied elsewhere).
DDL_INLINE, DDL_SEPARATELY, DDL_REFUSED = "inline", "separately", "refused"
