"""docs/plugins.md's hook sections, rendered from the hook specs' docstrings.

Each hook's docstring in :mod:`kvrunner.plugin_api.hookspecs` is the one statement of
its rules; the ``### `hook` `` section of docs/plugins.md is its signature and that
docstring in Markdown. ``python tests/core/hook_docs.py --write`` rewrites the sections
after a docstring changes; the test beside this file fails while they differ.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

from kvrunner.plugin_api import hookspecs

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def hooks() -> list[str]:
    """Every hook spec, in the order of the module."""
    found = [(fn.__code__.co_firstlineno, name) for name, fn in vars(hookspecs).items()
             if inspect.isfunction(fn) and hasattr(fn, "kvrunner_spec")]
    return [name for _, name in sorted(found)]


def _markdown(text: str) -> str:
    """reST roles and literals as Markdown; ``:param x:`` fields as a list."""
    def role(m: re.Match) -> str:  # ``:func:`~a.b``` shows ``b``, ``:mod:`a.b``` all of it
        return f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`"

    text = re.sub(r":(?:func|class|mod|meth|attr|data):`(~?)([\w.]+)`", role, text)
    text = text.replace("``", "`")
    lines = []
    for line in text.split("\n"):
        field = re.match(r":param (\w+): ?(.*)", line)
        if field:
            lines.append(f"- `{field.group(1)}`: {field.group(2)}")
        elif line.startswith("    ") and lines and lines[-1].startswith(("- ", "  ")):
            lines.append("  " + line.strip())
        else:
            lines.append(line)
    return "\n".join(lines)


def signature(name: str) -> str:
    sig = inspect.signature(getattr(hookspecs, name))
    params = ", ".join(p.name for p in sig.parameters.values())
    return f"`{name}({params}) -> {sig.return_annotation}`"


def section(name: str) -> str:
    """The Markdown of one hook's section, heading included."""
    doc = inspect.cleandoc(getattr(hookspecs, name).__doc__)
    return f"### `{name}`\n\n{signature(name)}\n\n{_markdown(doc)}\n"


def rendered(docs: str) -> str:
    """``docs`` with every hook's section replaced by its rendering; raises naming a
    hook that has no section."""
    for name in hooks():
        heading = f"### `{name}`\n"
        if heading not in docs:
            raise LookupError(f"docs/plugins.md has no section for the hook {name!r}")
        start = docs.index(heading)
        end = re.search(r"^##", docs[start + len(heading):], re.M)
        stop = start + len(heading) + end.start() if end else len(docs)
        docs = docs[:start] + section(name) + "\n" + docs[stop:]
    return docs


if __name__ == "__main__":
    text = DOCS.read_text()
    new = rendered(text)
    if "--write" in sys.argv:
        DOCS.write_text(new)
        print(f"{DOCS}: {'rewritten' if new != text else 'unchanged'}")
    else:
        sys.stdout.write(new)
