"""The product's pages: README.md and docs/*.md link only to what exists, docs/commands.md is
what the commands' --help says today (scripts/command_reference.py writes it), every file a page
names as `*.py` exists, and docs/architecture.md's module tables have one row for each module.

What this is not: a check of what the pages say about the product; the tests of each feature
check its behaviour, and a few check the words a page quotes (tests/test_protocol.py).
"""

import ast
import importlib.util
import inspect
import re
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ARCHITECTURE = REPO / "docs" / "architecture.md"
PACKAGES = ("common", "psserver", "psworker")  # the product's modules: architecture.md's tables
SOURCE_DIRS = (*PACKAGES, "tests", "scripts", "benchmarks", "deploy")  # where a named .py may be
PY_FILE = re.compile(r"(?<![\w./-])(\w[\w./-]*\.py)\b")  # scripts/x.py, wire/protocol.py, cli.py
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target); images are not links
FENCE = re.compile(r"^\s*(```|~~~)")
# How a product page must not speak: of the way the project was developed.
DEVELOPMENT_TALK = re.compile(
    r"([0-9]+(st|nd|rd|th)|first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth"
    r"|eleventh|twelfth|[a-z]+teenth|twentieth) session|session-?[0-9]+|helper-[0-9]|subagent",
    re.IGNORECASE,
)


def command_reference() -> ModuleType:
    """scripts/command_reference.py, imported from its file (scripts/ is not a package)."""
    path = REPO / "scripts" / "command_reference.py"
    spec = importlib.util.spec_from_file_location("command_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prose_lines(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks (where a [x](y) is code, not a link)."""
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    assert not fenced, f"{page.name}: a code block is never closed (an odd number of ```)"
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every heading's anchor on a page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(page):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        base = slug(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def test_the_command_reference_is_what_the_commands_help_says() -> None:
    reference = command_reference()
    page = REPO / "docs" / "commands.md"
    assert page.exists(), "docs/commands.md is missing: run python scripts/command_reference.py"
    assert page.read_text() == reference.render(), (
        "docs/commands.md is stale (a command's --help changed): run "
        "python scripts/command_reference.py and commit docs/commands.md"
    )


def test_the_command_reference_renders_the_same_whatever_the_terminal_and_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reference = command_reference()
    plain = reference.render()
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("PS_WORKERS", "7")
    monkeypatch.setenv("PS_LR", "0.5")
    assert reference.render() == plain


def test_the_command_reference_covers_every_console_script() -> None:
    """Each command of [project.scripts] is on the page, from the module its script runs."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    reference = command_reference()
    with (REPO / "pyproject.toml").open("rb") as file:
        scripts = tomllib.load(file)["project"]["scripts"]
    assert set(reference.COMMANDS) == set(scripts)
    for name, target in scripts.items():
        entry_module, function = target.split(":")
        source = inspect.getsource(getattr(importlib.import_module(entry_module), function))
        assert f'run_command("{reference.COMMANDS[name]}")' in source, (name, source)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_every_relative_link_points_at_a_file_and_heading_that_exist(page: Path) -> None:
    broken = []
    targets = LINK.findall("\n".join(prose_lines(page)))  # a link's text may span lines
    for target in targets:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not checked here
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", [*PAGES, REPO / "BENCHMARKS.md"], ids=lambda p: p.name)
def test_the_pages_speak_of_the_product_not_of_its_development(page: Path) -> None:
    said = [m.group(0) for m in DEVELOPMENT_TALK.finditer(page.read_text())]
    assert not said, f"{page.relative_to(REPO)} speaks of how it was developed: {said}"


def test_the_readme_links_every_docs_page() -> None:
    readme = (REPO / "README.md").read_text()
    missing = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert not missing, f"README.md links no docs page {missing}; add them to its Documentation"


def test_the_quick_start_holds_the_commands_ci_runs() -> None:
    """.ci/run installs and tests as the quick start's second command says."""
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    command = (
        'python3 -m venv .venv && .venv/bin/pip install ".[test]" && .venv/bin/ruff check . && '
        ".venv/bin/ruff format --check . && .venv/bin/mypy && .venv/bin/pytest"
    )
    assert command in readme
    assert command in ci


def python_files() -> list[str]:
    """Every .py of the repository's own folders, as paths from its root."""
    found = [path for folder in SOURCE_DIRS for path in (REPO / folder).rglob("*.py")]
    return sorted(p.relative_to(REPO).as_posix() for p in [*found, *REPO.glob("*.py")])


def is_bare_package(path: Path) -> bool:
    """An __init__.py that holds at most its docstring: a package, not a module to describe."""
    body = ast.parse(path.read_text()).body
    return path.name == "__init__.py" and all(
        isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body
    )


def module_table_names() -> list[str]:
    """The modules architecture.md's tables name in their first column, as paths from the
    repository root: a table's names are relative to the package its heading names
    (### `psserver/`), and a row may name several."""
    names: list[str] = []
    package, in_modules = None, False
    for line in prose_lines(ARCHITECTURE):
        if line.startswith("## "):
            in_modules = line.strip() == "## Modules"
        heading = re.match(r"### `([\w/]+)/`", line)
        if in_modules and heading:
            package = heading.group(1)
        elif in_modules and line.startswith("| `"):
            assert package is not None, f"a module row before any ### `package/` heading: {line}"
            names += [f"{package}/{name}" for name in PY_FILE.findall(line.split("|")[1])]
    return names


def test_the_architecture_has_one_row_for_each_module() -> None:
    names = module_table_names()
    modules = {
        name
        for name in python_files()
        if name.split("/")[0] in PACKAGES and not is_bare_package(REPO / name)
    }
    unlisted = sorted(modules - set(names))
    absent = sorted(name for name in set(names) if not (REPO / name).is_file())
    twice = sorted({name for name in names if names.count(name) > 1})
    assert not (unlisted or absent or twice), (
        "docs/architecture.md's module tables (## Modules) must name each module once: "
        f"no row for {unlisted}; no such file for {absent}; named twice {twice}"
    )


@pytest.mark.parametrize("page", [*PAGES, REPO / "BENCHMARKS.md"], ids=lambda p: p.name)
def test_every_python_file_a_page_names_exists(page: Path) -> None:
    """A path (scripts/bench_optimizer.py) exists from the repository's root; a module named
    within its package (wire/protocol.py, cli.py) is the end of a file's path."""
    files = python_files()
    named = set(PY_FILE.findall(page.read_text()))
    missing = sorted(
        name
        for name in named
        if name not in files and not any(path.endswith(f"/{name}") for path in files)
    )
    assert not missing, f"{page.relative_to(REPO)} names files that do not exist: {missing}"
