"""The configuration reference in README.md, generated from ``applier.config.OPTIONS``.

Owns the markdown table and the markers it lives between. ``python -m applier.ops.reference``
rewrites the block in README.md; a test checks the README holds exactly ``config_reference()``.
Must never describe an option any other way than its ``Option`` does.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..config import OPTIONS, Option

__all__ = ["BEGIN", "END", "config_reference", "readme_block", "update_readme"]

BEGIN = "<!-- BEGIN CONFIG REFERENCE: generated from applier/config.py by `python -m applier.ops.reference` -->"
END = "<!-- END CONFIG REFERENCE -->"


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


def readme_block(readme: str) -> str:
    """The text between the markers in ``readme``."""
    try:
        start = readme.index(BEGIN) + len(BEGIN)
        end = readme.index(END, start)
    except ValueError:
        raise ValueError(f"README.md lacks the markers {BEGIN!r} ... {END!r}") from None
    return readme[start:end].strip("\n")


def update_readme(path: Path) -> bool:
    """Rewrite the block in ``path``; True when it changed."""
    readme = path.read_text()
    current = readme_block(readme)
    generated = config_reference()
    if current == generated:
        return False
    start = readme.index(BEGIN) + len(BEGIN)
    end = readme.index(END, start)
    path.write_text(readme[:start] + "\n" + generated + "\n" + readme[end:])
    return True


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("README.md")
    print(f"{target}: {'updated' if update_readme(target) else 'already current'}")
