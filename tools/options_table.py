"""The options x backends table of docs/configuration.md, from the backends' specs.

    python tools/options_table.py           # print the table (Markdown)
    python tools/options_table.py --check   # exit 1 when docs/configuration.md holds another one

A cell is ✓ (the backend implements the option), "refused" (asked for, it is refused by name on
the driver, before any worker starts; the footnote says why) or – (the key is another backend's
own block, which this backend never reads).  The rows are :data:`core.policy.options.OPTIONS`
and each backend's block keys; the columns the registered backends.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "configuration.md"
BEGIN, END = "<!-- options-table: begin (tools/options_table.py) -->", "<!-- options-table: end -->"


def table() -> str:
    sys.path.insert(0, str(REPO))
    from core.policy.options import OPTIONS
    from core.policy.registry import all_specs

    specs = all_specs()
    notes: list[str] = []
    lines = [
        "| option | " + " | ".join(f"`{s.name}`" for s in specs) + " |",
        "|---|" + "---|" * len(specs),
    ]
    for opt in OPTIONS:
        cells = []
        for spec in specs:
            if opt.key in spec.supports:
                cells.append("✓")
                continue
            why = spec.why_not.get(opt.key)
            if why:
                notes.append(f"{spec.name}, `{opt.key}`: {why}.")
            cells.append(f"refused[^{len(notes)}]" if why else "refused")
        lines.append(f"| `policy.{opt.key}` ({opt.what}) | " + " | ".join(cells) + " |")
    for owner in specs:
        block = owner.config_block
        for key in block.model_fields if block is not None else ():
            cells = ["✓" if spec is owner else "–" for spec in specs]
            lines.append(f"| `policy.{owner.config_key}.{key}` | " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", *(f"[^{i}]: {note}" for i, note in enumerate(notes, 1))])


def documented() -> str:
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help=f"exit 1 when {DOC.name} holds another table")
    args = parser.parse_args()
    if not args.check:
        print(table())
        return 0
    if documented() != table():
        print(f"{DOC.relative_to(REPO)}: the options table is out of date; run python tools/options_table.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
