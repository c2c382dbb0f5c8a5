"""The configuration reference in docs/configuration.md, generated from ``applier.config.OPTIONS``.

Owns the markdown table and the markers it lives between. ``python -m applier.ops.reference``
(run from the repository root) rewrites the block in docs/configuration.md; a test checks that
file holds exactly ``config_reference()``. Must never describe an option any other way than its
``Option`` does.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..config import OPTIONS, Option

__all__ = ["BEGIN", "END", "REFERENCE_PATH", "config_reference", "reference_block",
           "update_reference"]

BEGIN = "<!-- BEGIN CONFIG REFERENCE: generated from applier/config/options.py by `python -m applier.ops.reference` -->"
END = "<!-- END CONFIG REFERENCE -->"

#: Where the reference lives, relative to the repository root.
REFERENCE_PATH = Path("docs") / "configuration.md"


def _default(option: Option) -> str:
    text = option.default_text
    if text is None:
        return ""
    return text if option.kind == "bool" else f"`{text}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_reference() -> str:
    """One row per option: flag, environment variable, commands, default, meaning."""
    lines = ["| option (`--flag` / TOML key) | environment | commands | default | meaning |",
             "|---|---|---|---|---|"]
    for option in OPTIONS:
        values = f" (`{'`, `'.join(option.choices)}`)" if option.choices else ""
        flag = f"--[no-]{option.flag[2:]}" if option.kind == "bool" else option.flag
        lines.append(f"| `{flag}` / `{option.name}` | `{option.env}` | "
                     f"{', '.join(option.commands)} | {_default(option)} | "
                     f"{_cell(option.help)}{values} |")
    return "\n".join(lines)


def reference_block(document: str) -> str:
    """The text between the markers in ``document``."""
    try:
        start = document.index(BEGIN) + len(BEGIN)
        end = document.index(END, start)
    except ValueError:
        raise ValueError(f"{REFERENCE_PATH} lacks the markers {BEGIN!r} ... {END!r}") from None
    return document[start:end].strip("\n")


def update_reference(path: Path) -> bool:
    """Rewrite the block in ``path``; True when it changed."""
    document = path.read_text()
    current = reference_block(document)
    generated = config_reference()
    if current == generated:
        return False
    start = document.index(BEGIN) + len(BEGIN)
    end = document.index(END, start)
    path.write_text(document[:start] + "\n" + generated + "\n" + document[end:])
    return True


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else REFERENCE_PATH
    if not target.is_file():
        sys.exit(f"{target} does not exist: run this from the repository root, or name the file")
    print(f"{target}: {'updated' if update_reference(target) else 'already current'}")
