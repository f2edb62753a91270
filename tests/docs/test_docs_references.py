"""README.md and docs/*.md name the repo's files, modules and definitions: each must exist.

Checked: every path that starts with a top-level folder of the repo (`supervisor/failover.py`,
`bench/results/soak/`, `.ci/run`), every dotted module name of a package
(`supervisor.kinds.vllm`, `cachedaemon.keeper.Keeper`), every relative Markdown link, and the
backticked names that directly follow a path to a Python file or package
("`supervisor/failover.py` `Failover.down`, `promote`"): each is defined in that file, a
`Class.attr` in that class or a base of it. Placeholders (`<run>/x.sock`, `bench/results/DIR/`,
`tests/*/test_cuda*.py`), event names (`engine.e1.promoted`) and file names
(`supervisor.lock`) are not references. Paths in fenced output blocks are not checked."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from holdfast_contract.events import EventName
from tests.engines.harness import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
UNTRACKED = {"build", "out", "__pycache__"}  # .gitignore's: made by runs, not the repo's
TOP_DIRS = sorted(
    p.name
    for p in REPO.iterdir()
    if p.is_dir()
    and (p.name == ".ci" or not p.name.startswith("."))
    and p.name not in UNTRACKED
    and not p.name.endswith(".egg-info")
)
PACKAGES = [d for d in TOP_DIRS if any((REPO / d).glob("*.py"))]

CHARS = r"[\w.<>*{}$-]"
PATH = re.compile(rf"(?<![\w/.<>*$-])((?:{'|'.join(map(re.escape, TOP_DIRS))})/(?:{CHARS}+/?)*)")
DOTTED = re.compile(
    rf"(?<![\w/.<>*$-])((?:{'|'.join(PACKAGES)})(?:\.(?:[\w*-]+|<\w+>))+)(?![\w/<>*-])"
)
LINK = re.compile(r"\]\(([^)\s#:]+)(?:#[^)]*)?\)")
NAME = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?"
# A backticked path, then the backticked names right after it ("`a.py` `X.y`, `z` and `w`").
CHAIN = re.compile(rf"`([\w./-]+)`((?:(?:\s+|\s*,\s*|\s+(?:and|or)\s+)`{NAME}(?:\([^`]*\))?`)+)")
CHAIN_NAME = re.compile(rf"`({NAME})(?:\([^`]*\))?`")
# Or a name, then the path it is in ("`Crew.on_state` in `supervisor/core.py`").
NAME_IN = re.compile(rf"`({NAME})` in `([\w./-]+)`")
# Any `Class.attr` where the repo defines a class of that name (else it is another
# project's: vLLM's, the standard library's).
CLASS_ATTR = re.compile(r"`([A-Z]\w*)\.([A-Za-z_]\w*)(?:\([^`]*\))?`")
FENCE = re.compile(r"^\s*(```+|~~~+)(.*)$")
FILE_WORDS = {"md", "py", "sh", "yaml", "yml", "json", "toml", "txt", "log", "lock", "sock"}
EVENT_KINDS = {"engine", "daemon", "supervisor", "broker", "router", "fleet"}
EVENTS = {e.value for e in EventName}
# Fenced blocks of output, by the word after the fence; in an untagged block, each line
# that reads as output (`output_line`).
OUTPUT_LANGS = {"text", "console", "output", "log", "mermaid"}


def placeholder(path: str) -> bool:
    """`<run>/x.sock`, `bench/results/DIR/`, `tests/*/test_cuda*.py`, `{a,b}.py`, `.../x`."""
    if any(c in path for c in "<>*{}$") or "..." in path:
        return True
    return any(re.fullmatch(r"[A-Z][A-Z0-9_]*", part) for part in path.split("/"))


def prose_and_code(text: str) -> tuple[str, str]:
    """The text with fenced blocks blanked (prose), and with prose and output blocks blanked
    (code: commands, YAML, Python), both keeping every line where it is."""
    prose: list[str] = []
    code: list[str] = []
    fence: str | None = None
    lang = ""
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence, lang = m.group(1), m.group(2).strip().lower()
            prose.append("")
            code.append("")
        elif fence is not None and m and m.group(1).startswith(fence) and not m.group(2).strip():
            fence = None
            prose.append("")
            code.append("")
        elif fence is None:
            prose.append(line)
            code.append("")
        else:
            prose.append("")
            code.append("" if lang in OUTPUT_LANGS or output_line(line) else line)
    return "\n".join(prose), "\n".join(code)


def output_line(line: str) -> bool:
    """A line of an untagged block that is output: not a command, YAML or a comment."""
    return bool(re.match(r"\s*(\||\+--|[│├└─]|\d+(\.\d+)?\s|\{|\[|\w+=)", line))


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


@functools.cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def sources_of(path: str) -> list[Path]:
    """The Python files a path reference stands for: the file, or a package's modules."""
    p = REPO / path.rstrip("/")
    if p.suffix == ".py" and p.is_file():
        return [p]
    if p.is_dir() and (p / "__init__.py").is_file():
        return sorted(p.glob("*.py"))
    return []


def module_file(dotted: list[str]) -> Path | None:
    p = REPO.joinpath(*dotted)
    if p.with_suffix(".py").is_file():
        return p.with_suffix(".py")
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    return None


def targets(node: ast.AST) -> Iterator[str]:
    """The names a statement defines."""
    if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        yield node.name
    elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
        for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    yield n.id
                elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
                    yield from [n.attr] if n.value.id in ("self", "cls") else []
    elif isinstance(node, ast.Import | ast.ImportFrom):
        for alias in node.names:
            yield (alias.asname or alias.name).split(".")[0]


def defines(path: Path, name: str) -> bool:
    """`name` is defined anywhere in the file (a function, class, method, assignment or a
    re-export); `Class.attr`: in that class or a base class, else wherever `Class` is
    something other than a class."""
    head, _, attr = name.partition(".")
    if not attr:
        return any(name in targets(n) for n in ast.walk(tree(path)))
    cls = top_class(path, head)
    if cls is None:
        return defines(path, head) and imported_or_assigned(path, head)
    return class_defines(path, cls, attr, depth=0)


@functools.cache
def repo_classes() -> dict[str, list[tuple[Path, ast.ClassDef]]]:
    found: dict[str, list[tuple[Path, ast.ClassDef]]] = {}
    for package in PACKAGES:
        if not (REPO / package / "__init__.py").is_file():
            continue  # tests/, bench/: scripts and fakes
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(tree(path)):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append((path, node))
    return found


def top_class(path: Path, name: str) -> ast.ClassDef | None:
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def imported_or_assigned(path: Path, name: str) -> bool:
    """A name defined as something other than a function (an instance, a re-export): its
    attributes are not checked."""
    for node in ast.walk(tree(path)):
        if name in targets(node) and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return True
    return False


def class_defines(path: Path, cls: ast.ClassDef, attr: str, depth: int) -> bool:
    if any(attr in targets(n) for n in ast.walk(cls)):
        return True
    if depth > 4:
        return False
    for base in cls.bases:
        if not isinstance(base, ast.Name):
            continue
        found = base_class(path, base.id)
        if found and class_defines(found[0], found[1], attr, depth + 1):
            return True
    return False


def base_class(path: Path, name: str) -> tuple[Path, ast.ClassDef] | None:
    """A base class defined in the file, or imported from a module of the repo."""
    cls = top_class(path, name)
    if cls is not None:
        return path, cls
    for node in tree(path).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    where = module_file(node.module.split("."))
                    found = top_class(where, alias.name) if where else None
                    return (where, found) if where and found else None
    return None


def dotted_missing(ref: str) -> str | None:
    """What of `pkg.mod.Name.attr` does not exist, or None."""
    parts = ref.split(".")
    if parts[-1] in FILE_WORDS or "*" in ref or "<" in ref:
        return None  # supervisor.lock, engine.<name>.promoted, supervisor.main.*
    if event_name(parts):
        return None  # engine.e1.promoted, supervisor.main.started
    for n in range(len(parts), 0, -1):
        where = module_file(parts[:n])
        if where is None:
            continue
        rest = parts[n:]
        if not rest:
            return None
        if len(rest) <= 2 and defines(where, ".".join(rest)):
            return None
        return ref if n == 1 else f"{'.'.join(rest)} in {where.relative_to(REPO)}"
    return ref


def event_name(parts: list[str]) -> bool:
    """`<kind>.<name>.<event>`, whose `<kind>.<name>` is no module."""
    if len(parts) != 3 or parts[0] not in EVENT_KINDS or module_file(parts[:2]) is not None:
        return False
    return parts[2] in EVENTS or parts[2].startswith("reported-")


def problems(text: str, doc: Path) -> list[str]:
    """Each reference of the doc's text that does not exist: "line N: what"."""
    prose, code = prose_and_code(text)
    found: list[tuple[int, str]] = []
    for body in (prose, code):
        for m in PATH.finditer(body):
            path = m.group(1).rstrip(".")
            if not placeholder(path) and not (REPO / path).exists():
                found.append((line_of(body, m.start(1)), f"no {path}"))
        for m in DOTTED.finditer(body):
            missing = dotted_missing(m.group(1))
            if missing:
                found.append((line_of(body, m.start(1)), f"no {missing}"))
    for m in LINK.finditer(prose):
        target = m.group(1)
        if not placeholder(target) and not (doc.parent / target).exists():
            found.append((line_of(prose, m.start(1)), f"no {target} (a link)"))
    placed: set[int] = set()  # names checked in the file the text puts them in
    for m in CHAIN.finditer(prose):
        for n in CHAIN_NAME.finditer(m.group(2)):
            placed.add(m.start(2) + n.start(1))
            found.extend(undefined(prose, m.start(2) + n.start(1), n.group(1), m.group(1)))
    for m in NAME_IN.finditer(prose):
        placed.add(m.start(1))
        found.extend(undefined(prose, m.start(1), m.group(1), m.group(2)))
    for m in CLASS_ATTR.finditer(prose):
        cls, attr = m.groups()
        defined = [] if m.start(1) in placed else repo_classes().get(cls, [])
        if defined and not any(class_defines(f, c, attr, depth=0) for f, c in defined):
            found.append((line_of(prose, m.start(1)), f"no {cls}.{attr} (class {cls} has none)"))
    return [f"line {line}: {what}" for line, what in sorted(set(found))]


def undefined(text: str, pos: int, name: str, path: str) -> list[tuple[int, str]]:
    """`name` (`Class.attr`) where the text says it is defined: `path` (a file or package)."""
    if name.rpartition(".")[2] in FILE_WORDS or not PATH.fullmatch(path):
        return []  # "`bench/attach.py`, `attach_cpu.json`"
    files = sources_of(path)
    if not files or any(defines(f, name) for f in files):
        return []
    return [(line_of(text, pos), f"no {name} in {path}")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_doc_references_exist(doc: Path) -> None:
    found = problems(doc.read_text(), doc)
    assert not found, f"{doc.relative_to(REPO)} names what does not exist:\n" + "\n".join(found)


MADE_UP = """\
The exit is seen by `supervisor/failover.py` `Failover.down`, `promote` and `on_exit`, then
`supervisor/roster.py` `Roster.best_standby` (`supervisor/decisions.py` `best_standby`);
runs write `<run>/keeper.sock` and `bench/results/DIR/`, events `engine.e1.promoted`,
modules `supervisor.kinds.vllm`, `cachedaemon.keeper.Keeper`; see [fleet](fleet.md#x).
`supervisor/router.py` was moved; `supervisor/failover.py` `Failover.nothing_here`;
`supervisor.streams` and `supervisor.kinds.vllm.no_such_name` are gone: [x](nowhere.md).
`Roster.epoch` is there, `PrimaryView.set` too, and `Failover.gone`; `Thread.start` is not ours.

```
| supervisor/old_output.py | 12 ms |
python3 bench/no_such_bench.py --out bench/results/DIR/
```
"""


def test_checker_finds_exactly_the_bad_references() -> None:
    found = problems(MADE_UP, REPO / "docs" / "made-up.md")
    assert found == [
        "line 5: no Failover.nothing_here in supervisor/failover.py",
        "line 5: no supervisor/router.py",
        "line 6: no no_such_name in supervisor/kinds/vllm.py",
        "line 6: no nowhere.md (a link)",
        "line 6: no supervisor.streams",
        "line 7: no Failover.gone (class Failover has none)",
        "line 11: no bench/no_such_bench.py",
    ]
