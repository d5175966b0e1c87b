"""The docs stay true to the tree, and nothing in the tree names an issue number.

A name a doc cites is kept true by a test, not by memory. Docs are organised by topic: an issue number
means nothing to a user, so neither docs nor code may cite one.

**Paths.** README.md and docs/*.md are read for repository paths:

- every word (split at spaces and commas) of backticked text and of fenced code blocks whose first
  part is a top-level entry of this repository (``runner/embedded.py``, ``tests/faults/``,
  ``flink run -py flink_jobs/near_realtime.py``; of ``KEY=path`` the part after ``=``); a pytest node id
  (``path::test``) and a ``path:Name`` or ``path:line`` reference are checked by their path;
- every relative markdown link (``[x](capacity.md)``, ``![plot](../bench/results/routing.png)``), taken
  relative to the doc that holds it, as a renderer does.

Benchmark results under ``bench/results/`` are committed, so a result a doc cites is checked like any
other path. Not checked: words with globs or placeholders (``*``, ``<...>``, ``{...}``, ``$VAR``,
``...``), absolute paths and ``~`` (another machine's or a container's: ``/opt/flink``, ``~/.cache``),
URLs, and ``flink_jobs/lib/`` (ignored by git: the connector jars are fetched into it).

**Modules.** A dotted name in backticked text that starts with one of this repository's packages
(``pipeline.dead_letter``, ``llm_client.client.LLMClient.set_endpoints``, ``python -m bench.routing``,
``module:Name``), and the module of every ``python -m`` in a fenced block, must resolve: the longest
prefix that is a module file or package, then each further name defined at the top level of that module
(a def, a class, an assignment or an import), then inside a class body while the name is a class. Not
followed: attributes of values and inherited members. ``FOREIGN_NAMES`` holds the dotted names that
belong to other systems and only share a first part with a package here (Flink's ``pipeline.jars``).

**Issue numbers.** Every doc and every Python, YAML, TOML, JSON and Docker file, script and Makefile of
the repository (outside hidden folders) is searched for ``issue 12``, ``issues 3-4``, ``Issue #7``,
``the issue's``, ``this issue``, ``see issue``, ``item 3 of issue`` and ``(#12)``,
``PR #12``, ``fixes #12``; ``PKCS#8`` and ``#  comment`` are not issue numbers.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BACKTICKED = re.compile(r"`([^`\n]+)`")
FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
LINKED = re.compile(r"\]\(([^)\s#]+)")
RUN_MODULE = re.compile(r"-m\s+([A-Za-z_][\w.]*)")
PLACEHOLDER = re.compile(r"[*<>{}$~|]|\.\.\.")
NOT_IN_TREE = ("flink_jobs/lib/",)
FOREIGN_NAMES = frozenset({"pipeline.jars"})
ISSUE_REFERENCE = re.compile(
    r"\bissues?\s*#?\d+"
    r"|\bissue's\b"
    r"|\b(?:this|see|per)\s+issue\b"
    r"|\bitems?\s+\d+(?:\s*[-–,]\s*\d+)*\s+of\s+(?:the\s+|this\s+)?issue\b"
    r"|\(#\d+\)|\b(?:PR|pull request|fixes|closes|resolves)\s+#\d+",
    re.IGNORECASE,
)
SCANNED_FOR_ISSUES = ["*.py", "*.md", "*.yaml", "*.yml", "*.toml", "*.json", "*Dockerfile", "Makefile"]
SCANNED_FOLDERS = ("scripts",)


def docs(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def top_level(root: Path) -> set[str]:
    return {entry.name for entry in root.iterdir() if not entry.name.startswith(".")}


def packages(root: Path) -> set[str]:
    return {entry.name for entry in root.iterdir() if (entry / "__init__.py").is_file()}


def path_of(word: str) -> str:
    """The repository path a word of a doc names: no quotes or brackets around it, no ``KEY=`` before
    it, no ``::test``, ``:Name`` or ``:line`` after it, no sentence punctuation."""
    word = word.strip("'\"()[];\\").split("=", 1)[-1]
    word = word.split("::", 1)[0]
    return re.split(r":(?=\w)", word, maxsplit=1)[0].rstrip(".,;:")


def named_paths(text: str, roots: set[str]) -> Iterator[str]:
    spans = [*BACKTICKED.findall(text), *FENCED.findall(text)]
    for word in (word for span in spans for word in re.split(r"[\s,]+", span)):
        path = path_of(word)
        if PLACEHOLDER.search(path) or path.startswith(("/", "http")) or "/" not in path:
            continue
        if path.split("/", 1)[0] in roots and not path.startswith(NOT_IN_TREE):
            yield path


def linked_paths(doc: Path, text: str) -> Iterator[Path]:
    for target in LINKED.findall(text):
        if "://" not in target and not target.startswith(("mailto:", "/")):
            yield doc.parent / target


def missing_paths(doc_files: list[Path], root: Path) -> list[str]:
    roots = top_level(root)
    missing = []
    for doc in doc_files:
        text = doc.read_text()
        named = {root / path for path in named_paths(text, roots)} | set(linked_paths(doc, text))
        for path in sorted(named):
            if not path.exists():
                missing.append(f"{doc.relative_to(root)}: {os.path.relpath(path, root)}")
    return missing


def named_modules(text: str, root: Path) -> Iterator[str]:
    names = "|".join(sorted(packages(root)))
    dotted = re.compile(rf"(?<![\w./-])((?:{names})(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_][\w.]*)?)")
    for span in BACKTICKED.findall(text):
        yield from (name for name in dotted.findall(span) if name not in FOREIGN_NAMES)
    for block in FENCED.findall(text):
        yield from (name for name in RUN_MODULE.findall(block) if name.split(".")[0] in packages(root))


def module_file(root: Path, parts: list[str]) -> Path | None:
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def defined_names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    names: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            names.update({target.id: node for target in node.targets if isinstance(target, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(alias.asname or alias.name).split(".")[0]: node for alias in node.names})
        elif isinstance(node, (ast.If, ast.Try)):
            names.update(defined_names(node.body))
    return names


def resolves(name: str, root: Path) -> bool:
    parts = name.replace(":", ".").split(".")
    for split in range(len(parts), 0, -1):
        found = module_file(root, parts[:split])
        if found is not None:
            break
    else:
        return False
    scope = defined_names(ast.parse(found.read_text()).body)
    for attribute in parts[split:]:
        node = scope.get(attribute)
        if node is None:
            return False
        if not isinstance(node, ast.ClassDef):
            return True
        scope = defined_names(node.body)
    return True


def unresolved_modules(doc_files: list[Path], root: Path) -> list[str]:
    return [
        f"{doc.relative_to(root)}: {name}"
        for doc in doc_files
        for name in sorted(set(named_modules(doc.read_text(), root)))
        if not resolves(name, root)
    ]


def issue_references(files: list[Path], root: Path) -> list[str]:
    hits = []
    for file in files:
        for number, line in enumerate(file.read_text(errors="replace").splitlines(), 1):
            if ISSUE_REFERENCE.search(line):
                hits.append(f"{file.relative_to(root)}:{number}: {line.strip()[:120]}")
    return hits


def project_files(root: Path) -> list[Path]:
    """Hidden folders (``.venv``, ``.git``), build metadata and caches are not the project's text."""
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [
            name
            for name in subfolders
            if not name.startswith(".") and not name.endswith((".egg-info", "__pycache__"))
        ]
        in_scanned_folder = Path(folder).relative_to(root).parts[:1] in [(name,) for name in SCANNED_FOLDERS]
        for name in names:
            if in_scanned_folder or any(fnmatch(name, pattern) for pattern in SCANNED_FOR_ISSUES):
                files.append(Path(folder) / name)
    return sorted(file for file in files if file != Path(__file__).resolve())


def test_every_path_a_doc_names_exists() -> None:
    assert missing_paths(docs(ROOT), ROOT) == []


def test_every_module_a_doc_names_resolves() -> None:
    assert unresolved_modules(docs(ROOT), ROOT) == []


def test_no_doc_or_code_names_an_issue_number() -> None:
    assert issue_references(project_files(ROOT), ROOT) == []


def test_the_checks_can_fail(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    for package in ("runner", "pipeline"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "runner" / "real.py").write_text("class Real:\n    def go(self) -> None: ...\n")
    (tmp_path / "README.md").write_text(
        "See `runner/real.py`, `runner/gone.py::test_x` and [t](runner/gone_too.py).\n"
    )
    (tmp_path / "docs" / "a.md").write_text(
        "[ok](../runner/real.py), [no](other.md), `python -m runner.real`, `runner.real.Real.go` are fine;\n"
        "`runner.real.Real.stop` and `runner.gone` are not; `pipeline.jars` is Flink's.\n"
        "```bash\nflink run -py runner/missing.py\npython -m runner.nowhere --x\n```\n"
    )
    assert missing_paths(docs(tmp_path), tmp_path) == [
        "README.md: runner/gone.py",
        "README.md: runner/gone_too.py",
        "docs/a.md: docs/other.md",
        "docs/a.md: runner/missing.py",
    ]
    assert unresolved_modules(docs(tmp_path), tmp_path) == [
        "docs/a.md: runner.gone",
        "docs/a.md: runner.nowhere",
        "docs/a.md: runner.real.Real.stop",
    ]
    code = tmp_path / "code.py"
    code.write_text(
        "# fixed in issue 12\nx = 1  # (issue 3, item 2)\n# see Issue #7\n# item 3 of this issue\n"
        "# the issue's shape\n# closes #4\n# PKCS#8 key, issues are tracked elsewhere\n"
    )
    assert [hit.split(":")[1] for hit in issue_references([code], tmp_path)] == ["1", "2", "3", "4", "5", "6"]
