"""Write each ``## sncaffe COMMAND`` section's usage and argument table in docs/cli.md from the
command line's own parser, keeping the prose around them; ``--check`` exits 1 where the page
differs from what ``--help`` says.

    python tools/render_cli_docs.py            # rewrite docs/cli.md
    python tools/render_cli_docs.py --check
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sncaffe.cli import parser  # noqa: E402

PAGE = ROOT / "docs" / "cli.md"


def _table(command) -> str:
    rows = ["| argument | meaning |", "|---|---|"]
    for action in command._actions:        # argparse keeps its arguments there and nowhere public
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            names = ", ".join(sorted(action.option_strings, key=lambda s: (not s.startswith("--"), s)))
            shown = action.metavar or ("{" + ",".join(map(str, action.choices)) + "}" if action.choices
                                       else action.dest.upper())
            metavar = "" if action.nargs == 0 else " " + shown
            name = names + metavar
        else:
            name = action.metavar or action.dest
        text = (action.help or "") % {"default": action.default, "choices": action.choices} if action.help else ""
        rows.append(f"| `{name}` | {' '.join(text.split()).replace('|', '/')} |")
    return "\n".join(rows)


def _usage(command) -> str:
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"           # argparse wraps the usage at the terminal's width
    try:
        return command.format_usage().strip()
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def render(text=None) -> str:
    """docs/cli.md with each command's usage block and argument table as the parser says."""
    text = PAGE.read_text() if text is None else text
    for name, command in parser().commands.items():
        block = f"```\n{_usage(command)}\n```\n\n{_table(command)}\n"
        head = f"## sncaffe {name}\n"
        if head not in text:
            text = text.replace("## Caffe's tools\n", f"{head}\n{command.description or ''}\n\n{block}\n## Caffe's tools\n")
            continue
        start = text.index(head) + len(head)
        end = text.find("\n## ", start)
        end = len(text) if end < 0 else end + 1
        section = text[start:end]
        m = re.search(r"```\nusage:.*?```\n\n\| argument \| meaning \|\n(?:\|.*\|\n)*", section, re.S)
        section = (section[:m.start()] + block + section[m.end():]) if m else section.rstrip("\n") + "\n\n" + block
        text = text[:start] + section + ("\n" if not section.endswith("\n\n") and end < len(text) else "") + text[end:]
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md differs from --help")
    args = ap.parse_args(argv)
    fresh = render()
    if args.check:
        if fresh != PAGE.read_text():
            print("docs/cli.md differs from the parser's --help: run python tools/render_cli_docs.py")
            return 1
        return 0
    PAGE.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
