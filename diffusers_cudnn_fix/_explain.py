"""``diffusers-cudnn-fix explain [TOPIC]``: the docs and the upstream reports, read from the installed package.

Every problem message ends by naming this command with a docs section (``explain fixes.md#cudnn_bool_mask``),
and the doctor names it with ``upstream/<fix id>`` for a bug still open upstream. The command prints that
section, page or report from files inside the package, so each reference works from a wheel installed anywhere,
with no checkout at hand.

Where the files are: the wheel carries ``docs/*.md`` and ``upstream/`` under ``diffusers_cudnn_fix/_docs/``, copied
there when the wheel is built (``setup.py``: git keeps one copy, at the top of the source tree). A source checkout,
and the editable install made from it, has no ``_docs/``: only there, recognised by the project's own
``pyproject.toml`` next to the package, are the files read from the checkout.

Nothing is imported at module level: ``_warnings`` imports :func:`command_for` while the package is imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable
    from importlib.abc import Traversable  # importlib.resources.abc from Python 3.11 on

#: The console script (``[project.scripts]``); ``python -m diffusers_cudnn_fix`` takes the same arguments.
PROG = "diffusers-cudnn-fix"
#: Where the built package carries the shipped files (the same layout as the source tree: docs/, upstream/).
SHIPPED = "_docs"
#: The page with a section per fix, under the fix's id: ``explain <fix id>`` prints that section.
FIXES_PAGE = "fixes.md"

DESCRIPTION = """\
Print a section or page of the package's documentation, or a bug report ready to file upstream, from the files
installed with the package (no checkout needed). Each problem message names the topic to ask for:
  diffusers-cudnn-fix explain fixes.md#cudnn_bool_mask     a section of a page
  diffusers-cudnn-fix explain cudnn_bool_mask              a fix's section (fixes.md), by the fix's id
  diffusers-cudnn-fix explain fixes.md                     the whole page
  diffusers-cudnn-fix explain upstream/cudnn_bool_mask     an upstream report: ISSUE.md and fix.patch
Without a topic, the topics are listed.
"""

EXIT_STATUSES = """\
exit status of explain:
  0   printed
  1   this installation carries no documentation (a wheel built without the package's setup.py)
  64  usage error: an unknown topic (the valid ones are listed)
"""


def command_for(section: str) -> str:
    """The command line that prints ``section`` (``"fixes.md#cudnn_bool_mask"``), as a problem message names it."""
    return f"{PROG} explain {section}"


def upstream_command(fix_id: str) -> str:
    """The command line that prints the upstream report of ``fix_id`` (``upstream/<fix_id>/``)."""
    return f"{PROG} explain upstream/{fix_id}"


# ------------------------------------------------------------------------------------------------------------
# The files
# ------------------------------------------------------------------------------------------------------------
def root() -> Traversable | None:
    """Where ``docs/`` and ``upstream/`` are: inside the installed package, else (a source checkout only) the
    checkout; None where neither is there."""
    from importlib import resources
    from pathlib import Path

    shipped = resources.files(__package__ or "diffusers_cudnn_fix") / SHIPPED
    if shipped.is_dir():
        return shipped
    # Not built (a checkout, or `pip install -e` of one): the tree above the package, if it is this project's own.
    checkout = Path(__file__).resolve().parent.parent
    project = checkout / "pyproject.toml"
    if project.is_file() and 'name = "diffusers-cudnn-fix"' in project.read_text(encoding="utf-8"):
        return checkout
    return None


def pages(top: Traversable) -> list[str]:
    """The docs pages, by file name (``fixes.md``)."""
    docs = top / "docs"
    return sorted(p.name for p in docs.iterdir() if p.name.endswith(".md")) if docs.is_dir() else []


def upstream_ids(top: Traversable) -> list[str]:
    """The fix ids with an upstream report (``upstream/<id>/ISSUE.md``)."""
    folder = top / "upstream"
    return sorted(p.name for p in folder.iterdir() if (p / "ISSUE.md").is_file()) if folder.is_dir() else []


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation (backticks too) dropped, spaces to hyphens."""
    import re

    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(text: str) -> dict[str, str]:
    """A page's sections by anchor: each from its heading to the next heading of the same or a higher level
    (its subsections included). Lines in fenced code blocks are no headings; a repeated anchor gets ``-1``,
    ``-2``, ... as on GitHub."""
    lines = text.splitlines()
    headings: list[tuple[int, int, str]] = []  # (line, level, anchor)
    seen: dict[str, int] = {}
    fenced = False
    for number, line in enumerate(lines):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (level := len(line) - len(line.lstrip("#"))) in range(1, 7) and line[level:][:1] == " ":
            anchor = _anchor(line[level:])
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            headings.append((number, level, anchor if count == 0 else f"{anchor}-{count}"))
    found = {}
    for i, (start, level, anchor) in enumerate(headings):
        end = next((n for n, lv, _ in headings[i + 1 :] if lv <= level), len(lines))
        found[anchor] = "\n".join(lines[start:end]).strip() + "\n"
    return found


def _upstream_text(folder: Traversable, fix_id: str) -> str:
    """An upstream report: ISSUE.md, fix.patch, and where the folder's other files (reproducer, test) are."""
    parts = [f"upstream/{fix_id}/ISSUE.md:\n", (folder / "ISSUE.md").read_text(encoding="utf-8").strip(), ""]
    if (folder / "fix.patch").is_file():
        parts += [f"upstream/{fix_id}/fix.patch:\n", (folder / "fix.patch").read_text(encoding="utf-8").rstrip(), ""]
    others = sorted(p.name for p in folder.iterdir() if p.name not in ("ISSUE.md", "fix.patch") and p.is_file())
    if others:
        parts.append("The folder's other files (the reproducer, and the test the patch adds to diffusers), to copy:")
        parts += [f"  {folder / name}" for name in others]
    return "\n".join(parts) + "\n"


def text_of(topic: str, top: Traversable | None = None) -> str | None:
    """What ``explain TOPIC`` prints, or None for a topic that is not there. Also takes the paths older messages
    named (``docs/fixes.md#...``, ``upstream/<id>/ISSUE.md``) and a trailing full stop copied with the command."""
    top = root() if top is None else top
    if top is None:
        return None
    topic = topic.strip().removesuffix(".").removeprefix("docs/")
    if topic in ("upstream", "upstream/"):
        readme = top / "upstream" / "README.md"
        return readme.read_text(encoding="utf-8") if readme.is_file() else None
    if topic.startswith("upstream/"):
        fix_id = topic.removeprefix("upstream/").removesuffix("/ISSUE.md").strip("/")
        return _upstream_text(top / "upstream" / fix_id, fix_id) if fix_id in upstream_ids(top) else None
    page, _, anchor = topic.partition("#")
    if page not in pages(top) and not anchor and FIXES_PAGE in pages(top):
        # A fix id, as the doctor's table and the warnings name it: its section of the fixes page.
        page, anchor = FIXES_PAGE, page
    if page not in pages(top):
        return None
    text = (top / "docs" / page).read_text(encoding="utf-8")
    return text if not anchor else sections(text).get(anchor.lower())


def topics(top: Traversable) -> list[str]:
    """Every topic: each page, each of its sections, the upstream index and each upstream report."""
    found = []
    for page in pages(top):
        found.append(page)
        found += [f"{page}#{anchor}" for anchor in sections((top / "docs" / page).read_text(encoding="utf-8"))]
    if (top / "upstream" / "README.md").is_file():
        found.append("upstream")
    return found + [f"upstream/{fix_id}" for fix_id in upstream_ids(top)]


# ------------------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------------------
def _listing(top: Traversable) -> str:
    """``explain`` alone: the topics, a page's sections indented under it."""
    lines = [f"Topics ({PROG} explain TOPIC):"]
    for topic in topics(top):
        lines.append(f"    {topic}" if "#" in topic else f"  {topic}")
    return "\n".join(lines) + "\n"


def _valid_near(topic: str, top: Traversable) -> str:
    """The valid topics to name after an unknown one: the page's sections where the page is known, else the pages
    and the upstream reports."""
    page = topic.removeprefix("docs/").partition("#")[0]
    near = [t for t in topics(top) if t.startswith(f"{page}#")] if page in pages(top) else []
    near = near or [t for t in topics(top) if "#" not in t]
    return "".join(f"\n  {t}" for t in near) + f"\n({PROG} explain, without a topic, lists every section)"


def main(argv: list[str], make_parser: Callable[[str, str, str, str], argparse.ArgumentParser]) -> int:
    """``explain [TOPIC]`` on the CLI's parser class (usage errors exit 64)."""
    import os
    import sys

    prog = f"{PROG} explain"
    parser = make_parser(prog, f"{prog} [TOPIC]", DESCRIPTION, EXIT_STATUSES)
    parser.add_argument("topic", nargs="?", help="page#section, page, fix id, or upstream/<fix id>; none: list them")
    args = parser.parse_args(argv)
    top = root()
    if top is None:
        print(
            f"{prog}: this installation of diffusers_cudnn_fix carries no documentation (no {SHIPPED}/ in the package:"
            " a wheel built without its setup.py?). Reinstall it from the release wheel or the sdist.",
            file=sys.stderr,
        )
        return 1
    if args.topic is None:
        out = _listing(top)
    else:
        text = text_of(args.topic, top)
        if text is None:
            parser.error(f"unknown topic {args.topic!r}; the topics:{_valid_near(args.topic, top)}")
        out = text
    try:
        sys.stdout.write(out)
        sys.stdout.flush()
    except BrokenPipeError:  # `explain fixes.md | head`: the reader left; no traceback, same status
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
