"""The documentation's code runs as written, in README.md and every docs/*.md page: every
```python block is executed (on the tiny local models its code builds: nothing is
downloaded), and every ``dualrl`` / ``make`` command of a ```bash block is parsed by the
real CLI and its config loaded and checked as the command would before starting anything
(nothing is run).  Cases are named by page and line (``docs/backends.md-python-line20``).
Every relative link between the pages must point at a file and heading that exist.

A block may be preceded by an HTML comment (invisible on GitHub):
``<!-- snippet: slow (reason) -->`` marks its case ``slow`` (it starts Ray workers);
``<!-- snippet: skip (reason) -->`` skips it -- the reason is required for both.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
_MARKER = re.compile(r"^<!-- snippet: (slow|skip) \((.+)\) -->$")


@dataclass(frozen=True)
class Snippet:
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    marker: str | None  # "slow" | "skip" | None
    reason: str | None
    page: str = "README.md"  # relative to the repository

    @property
    def id(self) -> str:
        return f"{self.page}-{self.lang}-line{self.line}"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def read_snippets(text: str, page: str = "README.md") -> list[Snippet]:
    """Every fenced block with a language, with the marker comment right above it."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\w+)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        indent = len(fence.group(1))  # a block inside a list item is indented
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marked = _MARKER.match(above)
        out.append(
            Snippet(
                fence.group(2),
                "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n",
                i + 1,
                marked.group(1) if marked else None,
                marked.group(2) if marked else None,
                page,
            )
        )
        i = end + 1
    return out


def _page_name(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


SNIPPETS = [s for path in PAGES for s in read_snippets(path.read_text(), _page_name(path))]
PYTHON = [s for s in SNIPPETS if s.lang == "python"]
BASH = [s for s in SNIPPETS if s.lang == "bash"]


def _case(snippet: Snippet):
    return pytest.param(snippet, id=snippet.id, marks=[pytest.mark.slow] if snippet.marker == "slow" else [])


@pytest.mark.parametrize("path", PAGES, ids=_page_name)
def test_every_marker_has_a_reason_and_a_block(path):
    snippets = read_snippets(path.read_text(), _page_name(path))
    assert all(s.reason.strip() for s in snippets if s.marker)
    # A marker that matches no block (a typo, or a block moved away) would silently do nothing.
    markers = [line for line in path.read_text().splitlines() if line.strip().startswith("<!-- snippet")]
    assert len(markers) == sum(1 for s in snippets if s.marker), markers


def test_the_pages_have_snippets():
    assert {p.name for p in PAGES} >= {"README.md", "configuration.md", "backends.md", "troubleshooting.md"}
    assert len(PYTHON) >= 4 and len(BASH) >= 6
    assert any(s.page == "README.md" for s in BASH)  # the README's commands are checked too


def test_a_marker_is_read_from_the_line_above_its_block():
    text = "x\n<!-- snippet: skip (needs a GPU) -->\n\n```python\nprint(1)\n```\n```bash\nmake run\n```\n"
    first, second = read_snippets(text, "docs/x.md")
    assert (first.marker, first.reason, first.code, first.line) == ("skip", "needs a GPU", "print(1)\n", 4)
    assert (second.lang, second.marker, second.id) == ("bash", None, "docs/x.md-bash-line7")
    (indented,) = read_snippets("* item:\n\n  ```bash\n  make test\n  ```\n")
    assert (indented.code, indented.line) == ("make test\n", 3)


@pytest.mark.parametrize("snippet", [_case(s) for s in PYTHON])
def test_python_snippet_runs_as_written(snippet, tmp_path, monkeypatch, request):
    if snippet.marker == "skip":
        pytest.skip(snippet.reason)
    if "init_ray" in snippet.code:
        request.getfixturevalue("ray_session")  # the test session's Ray (the snippet's init_ray() joins it)
    # Run from a scratch directory that sees the repository's configs at the same relative
    # paths, so what the snippet writes (models, checkpoints) stays out of the checkout.
    (tmp_path / "core").symlink_to(REPO / "core")
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet.code, str(REPO / snippet.page) + f":{snippet.line}", "exec"), {"__name__": "doc_snippet"})


# ----------------------------------------------------------------------------- bash
def dualrl_argv(command: str, make_args_default: str) -> list[str] | None:
    """The ``dualrl`` arguments a documented command line runs, or None for another command.

    ``make run`` runs ``dualrl $(ARGS)``; ``.venv/bin/dualrl`` / ``dualrl`` are the CLI itself.
    """
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value before the command
        words = words[1:]
    if words[:2] == ["make", "run"]:
        args = next((w.split("=", 1)[1] for w in words[2:] if w.startswith("ARGS=")), make_args_default)
        return shlex.split(args)
    if words and Path(words[0]).name == "dualrl":
        return words[1:]
    return None


def command_lines(snippet: Snippet) -> list[str]:
    """The non-comment command lines of a bash block (a trailing `` # comment`` cut off, a
    line ending in ``\\`` joined with the next)."""
    code = re.sub(r"\s*\\\n\s*", " ", snippet.code)
    return [
        line.split(" #")[0].strip() for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]


def test_bash_command_lines_are_recognised():
    assert dualrl_argv('make run ARGS="config --backend jax_pjit a.b=1"  ', "grpo") == [
        "config",
        "--backend",
        "jax_pjit",
        "a.b=1",
    ]
    assert dualrl_argv("make run", "grpo") == ["grpo"]
    assert dualrl_argv(".venv/bin/dualrl sft --resume", "grpo") == ["sft", "--resume"]
    assert dualrl_argv("make test", "grpo") is None
    assert dualrl_argv("KEY=tml-x dualrl serve serve.host=0.0.0.0", "grpo") == ["serve", "serve.host=0.0.0.0"]
    joined = Snippet("bash", "dualrl grpo \\\n    a.b=1\n", 1, None, None)
    assert command_lines(joined) == ["dualrl grpo a.b=1"]
    assert sum(dualrl_argv(cmd, "grpo") is not None for s in BASH for cmd in command_lines(s)) >= 8


def benchmark_parser(argv: list[str]):
    """(parser, its arguments) of ``dualrl parity | bench [--gpu] ...``, as ``dualrl.cli.main``
    dispatches them."""
    if argv[0] == "parity":
        from benchmarks.parity import build_parser

        return build_parser(), argv[1:]
    if "--gpu" in argv:
        from benchmarks.gpu import build_parser

        return build_parser(), [a for a in argv[1:] if a != "--gpu"]
    from benchmarks.compare import build_parser

    return build_parser(), argv[1:]


@pytest.mark.parametrize("snippet", [_case(s) for s in BASH])
def test_every_bash_command_parses_and_its_config_is_accepted(snippet, monkeypatch):
    from dualrl.cli import build_parser, fill_default_config, load_command_config, load_eval_config

    monkeypatch.chdir(REPO)  # the commands use paths relative to the checkout
    makefile = (REPO / "Makefile").read_text()
    make_args = re.search(r"^ARGS\s*\?=\s*(.*)$", makefile, re.M).group(1).strip()
    for command in command_lines(snippet):
        where = f"{snippet.where}: {command!r}"
        words = shlex.split(command)
        if words[0] == "make":
            assert re.search(rf"^{re.escape(words[1])}:", makefile, re.M), f"{where}: no such make target"
        argv = dualrl_argv(command, make_args)
        if argv is None:
            continue
        if argv[0] in ("bench", "parity"):  # dualrl.cli.main forwards every option to the benchmark
            parser, argv = benchmark_parser(argv)
            try:
                parser.parse_args(argv)
            except SystemExit:
                pytest.fail(f"{where}: the benchmark does not accept these arguments")
            continue
        if argv[0] == "serve":  # dualrl.cli.main forwards it to the server's own parser and config
            from core.tinker_api.config import load_serve_config
            from core.tinker_api.serve import build_parser as serve_parser

            try:
                serve_args = serve_parser("dualrl serve").parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"{where}: dualrl serve does not accept these arguments")
            load_serve_config(serve_args.config, list(serve_args.overrides), serve_args.backend)
            continue
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: dualrl does not accept these arguments")
        fill_default_config(args)  # as dualrl.cli.main does
        if args.command in ("config", "grpo", "sft", "dpo") and Path(args.config).is_file():
            load_command_config(args)  # raises ConfigError naming the field (and the override)
        if args.command == "eval" and not (args.checkpoint or args.model or args.config):
            load_eval_config(args)  # the embedded config with the line's flags and overrides
        # (a --config file that is not in the checkout, like my_sft.yaml, stands for the reader's own)


# ----------------------------------------------------------------------------- links
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces -> '-'."""
    anchors, in_code = set(), False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"^#{1,6}\s+(.*?)\s*$", line)):
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return anchors


def test_heading_anchors_follow_github():
    text = "# A `dualrl config`: check it\n## Worker output: `workers.log`\n```bash\n# not a heading\n```\n"
    assert heading_anchors(text) == {"a-dualrl-config-check-it", "worker-output-workerslog"}


@pytest.mark.parametrize("path", PAGES, ids=_page_name)
def test_relative_links_point_at_existing_pages_and_headings(path):
    broken = []
    for target in _LINK.findall(path.read_text()):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text()):
            broken.append(f"{target}: no heading with that anchor in {linked.name}")
    assert not broken, f"{_page_name(path)}: {broken}"
