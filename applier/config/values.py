"""Values with a grammar of their own: table names (``schema.table``, either part quoted) and
conflict policies (``[schema.table=]policy``). Must never read settings.
"""

from __future__ import annotations

from collections.abc import Sequence

from .option import ConfigError

__all__ = ["CONFLICT_POLICIES", "parse_conflict_policies", "parse_table_name"]


#: Conflict policies (--conflict-policy): the source wins, stop, or the target row wins.
CONFLICT_POLICIES = ("apply", "error", "keep-local")


def parse_table_name(text: str, option: str = "conflict_policy") -> tuple[str, str]:
    """``schema.table`` (either part may be double-quoted) or ``table`` (schema public)."""
    parts: list[str] = []
    current: list[str] = []
    i, quoted = 0, False
    while i < len(text):
        ch = text[i]
        if quoted:
            if ch == '"' and text[i + 1:i + 2] == '"':
                current.append('"')
                i += 1
            elif ch == '"':
                quoted = False
            else:
                current.append(ch)
        elif ch == '"':
            quoted = True
        elif ch == ".":
            parts.append("".join(current))
            current = []
        else:
            current.append(ch.lower())
        i += 1
    parts.append("".join(current))
    if quoted or not 1 <= len(parts) <= 2 or not all(parts):
        raise ConfigError(f"{option}: {text!r} is not a table name (schema.table or table)")
    return ("public", parts[0]) if len(parts) == 1 else (parts[0], parts[1])


def parse_conflict_policies(entries: Sequence[str]) -> tuple[str, dict[tuple[str, str], str]]:
    """``["error", "app.orders=keep-local"]`` -> (default policy, {(schema, table): policy})."""
    default = "apply"
    per_table: dict[tuple[str, str], str] = {}
    for entry in entries:
        table, sep, policy = entry.rpartition("=")
        policy = policy.strip().lower()
        if policy not in CONFLICT_POLICIES:
            raise ConfigError(f"conflict_policy: {policy!r} in {entry!r} is not one of "
                              f"{', '.join(CONFLICT_POLICIES)}")
        if sep:
            per_table[parse_table_name(table.strip())] = policy
        else:
            default = policy
    return default, per_table
