"""README.md's code runs as written: every ```python block is executed (on the tiny local
models its code builds: nothing is downloaded), and every ``dualrl`` / ``make`` command of
a ```bash block is parsed by the real CLI and its config loaded and checked as the command
would before starting anything (nothing is run).

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
_MARKER = re.compile(r"^<!-- snippet: (slow|skip) \((.+)\) -->$")


@dataclass(frozen=True)
class Snippet:
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    marker: str | None  # "slow" | "skip" | None
    reason: str | None

    @property
    def id(self) -> str:
        return f"{self.lang}-line{self.line}"


def read_snippets(text: str) -> list[Snippet]:
    """Every fenced block with a language, with the marker comment right above it."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w+)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marked = _MARKER.match(above)
        out.append(
            Snippet(
                fence.group(1),
                "\n".join(lines[i + 1 : end]) + "\n",
                i + 1,
                marked.group(1) if marked else None,
                marked.group(2) if marked else None,
            )
        )
        i = end + 1
    return out


SNIPPETS = read_snippets(README.read_text())
PYTHON = [s for s in SNIPPETS if s.lang == "python"]
BASH = [s for s in SNIPPETS if s.lang == "bash"]


def test_the_readme_has_snippets_and_every_marker_has_a_reason():
    assert len(PYTHON) >= 3 and len(BASH) >= 3
    assert all(s.reason.strip() for s in SNIPPETS if s.marker)
    # A marker that matches no block (a typo, or a block moved away) would silently do nothing.
    markers = [line for line in README.read_text().splitlines() if line.startswith("<!-- snippet")]
    assert len(markers) == sum(1 for s in SNIPPETS if s.marker), markers


def test_a_marker_is_read_from_the_line_above_its_block():
    text = "x\n<!-- snippet: skip (needs a GPU) -->\n\n```python\nprint(1)\n```\n```bash\nmake run\n```\n"
    first, second = read_snippets(text)
    assert (first.marker, first.reason, first.code, first.line) == ("skip", "needs a GPU", "print(1)\n", 4)
    assert (second.lang, second.marker) == ("bash", None)


@pytest.mark.parametrize(
    "snippet", [pytest.param(s, id=s.id, marks=[pytest.mark.slow] if s.marker == "slow" else []) for s in PYTHON]
)
def test_python_snippet_runs_as_written(snippet, tmp_path, monkeypatch, request):
    if snippet.marker == "skip":
        pytest.skip(snippet.reason)
    if "init_ray" in snippet.code:
        request.getfixturevalue("ray_session")  # the test session's Ray (the snippet's init_ray() joins it)
    # Run from a scratch directory that sees the repository's configs at the same relative
    # paths, so what the snippet writes (models, checkpoints) stays out of the checkout.
    (tmp_path / "core").symlink_to(REPO / "core")
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet.code, f"{README}:{snippet.line}", "exec"), {"__name__": "readme_snippet"})


# ----------------------------------------------------------------------------- bash
def dualrl_argv(command: str, make_args_default: str) -> list[str] | None:
    """The ``dualrl`` arguments a README command line runs, or None for another command.

    ``make run`` runs ``dualrl $(ARGS)``; ``.venv/bin/dualrl`` / ``dualrl`` are the CLI itself.
    """
    words = shlex.split(command)
    if words[:2] == ["make", "run"]:
        args = next((w.split("=", 1)[1] for w in words[2:] if w.startswith("ARGS=")), make_args_default)
        return shlex.split(args)
    if words and Path(words[0]).name == "dualrl":
        return words[1:]
    return None


def bash_commands() -> list[tuple[Snippet, str]]:
    """(block, command line) of every non-comment line of the bash blocks."""
    return [
        (s, line.split(" #")[0].strip())
        for s in BASH
        for line in s.code.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
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
    assert sum(dualrl_argv(cmd, "grpo") is not None for _, cmd in bash_commands()) >= 8


def test_every_bash_command_parses_and_its_config_is_accepted(monkeypatch):
    from dualrl.cli import build_parser, load_command_config

    monkeypatch.chdir(REPO)  # the commands use paths relative to the checkout
    makefile = (REPO / "Makefile").read_text()
    make_args = re.search(r"^ARGS\s*\?=\s*(.*)$", makefile, re.M).group(1).strip()
    for snippet, command in bash_commands():
        where = f"README.md:{snippet.line}: {command!r}"
        words = shlex.split(command)
        if words[0] == "make":
            assert re.search(rf"^{re.escape(words[1])}:", makefile, re.M), f"{where}: no such make target"
        argv = dualrl_argv(command, make_args)
        if argv is None:
            continue
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: dualrl does not accept these arguments")
        if args.command in ("config", "grpo", "sft", "dpo") and Path(args.config).is_file():
            load_command_config(args)  # raises ConfigError naming the field (and the override)
        # (a --config file that is not in the checkout, like my_sft.yaml, stands for the reader's own)
