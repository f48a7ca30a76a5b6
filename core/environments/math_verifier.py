"""Answer extraction and comparison for GSM8K / MATH-style problems, and their environment.

A completion's final answer is, in order of preference: the last ``\\boxed{...}`` (or
``\\fbox{...}``), else what follows the last ``####`` (GSM8K's marker), else the last number
in the text.  Two answers match when both parse as numbers that agree (``1,234`` = ``1234``,
``\\frac{3}{4}`` = ``0.75``, ``$5`` = ``5``, ``50%`` = ``50``) or, failing that, when their
texts agree after trivial normalisation.

Nothing here imports torch, jax or ray.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from core.environments.config import EnvConfig, MathEnvConfig
from core.environments.interfaces import AnswerCheckingEnvironment, env_subsection

__all__ = [
    "extract_answer",
    "normalize_number",
    "answers_match",
    "ground_truth_answer",
    "MathEnvironment",
]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number as written in prose: optional sign (not glued to a preceding word or digit,
# so the "-" of "3-4" is not a sign), optional "$", thousands commas, decimals, "%".
_NUMBER = re.compile(r"(?:(?<![\w)])[-+])?\$?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)%?")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_LATEX_FRACTION = re.compile(r"([-+]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_SLASH_FRACTION = re.compile(r"([-+]?[\d.]+)/([-+]?[\d.]+)")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def extract_answer(text: str) -> str | None:
    """The final answer written in ``text`` (see the module docstring), or ``None``."""
    if not isinstance(text, str):
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        line = after.splitlines()[0].strip() if after else ""
        number = _NUMBER.search(line)
        if number is not None:
            return number.group(0)
        return line or None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_number(text: str) -> float | None:
    """``text`` as a float (``"1,234"`` -> 1234.0, ``"\\frac{3}{4}"`` -> 0.75), else ``None``."""
    if not isinstance(text, str):
        return None
    cleaned = _TEXT_WRAPPER.sub(r"\1", text)
    for noise in ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\left", "\\right", ","):
        cleaned = cleaned.replace(noise, "")
    cleaned = "".join(cleaned.split()).rstrip(".")
    if cleaned.startswith("(") and cleaned.endswith(")"):
        cleaned = cleaned[1:-1]
    if _PLAIN_NUMBER.fullmatch(cleaned):
        return float(cleaned)
    fraction = _LATEX_FRACTION.fullmatch(cleaned)
    if fraction is not None:
        sign, numerator, denominator = fraction.groups()
        value = _divide(normalize_number(numerator), normalize_number(denominator))
        return None if value is None else (-value if sign == "-" else value)
    fraction = _SLASH_FRACTION.fullmatch(cleaned)
    if fraction is not None:
        return _divide(normalize_number(fraction.group(1)), normalize_number(fraction.group(2)))
    return None


def answers_match(predicted: str | None, ground_truth: str, rel_tol: float = 1e-6) -> bool:
    """Whether ``predicted`` is the same answer as ``ground_truth``.

    Numerically (``math.isclose`` with ``rel_tol``; a tiny absolute tolerance so that 0
    matches 0.0) when both parse as numbers, else by text after removing whitespace,
    ``$`` signs and a trailing period.
    """
    if predicted is None:
        return False
    a, b = normalize_number(predicted), normalize_number(ground_truth)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-9)
    return _normalize_text(predicted) == _normalize_text(ground_truth)


def ground_truth_answer(raw: str) -> str:
    """The answer part of a reference solution.

    GSM8K ``"reasoning ... #### 72"`` -> ``"72"``; a solution with ``\\boxed{...}`` -> the
    box's content; anything else -> ``raw.strip()`` (already a bare answer).
    """
    raw = str(raw)
    if "####" in raw:
        return raw.rsplit("####", 1)[1].strip()
    boxed = _last_boxed(raw)
    return boxed if boxed is not None else raw.strip()


class MathEnvironment(AnswerCheckingEnvironment):
    """Reward 1.0 when the completion's final answer matches ``metadata["ground_truth"]``.

    Settings: ``env.math`` (:class:`~core.environments.config.MathEnvConfig`).
    """

    name = "math"

    def __init__(self, cfg: EnvConfig | Mapping[str, Any] | None = None) -> None:
        self.rel_tol = env_subsection(cfg, "math", MathEnvConfig).rel_tol

    def judge(self, completion: str, ground_truth: str) -> tuple[bool, str | None]:
        """The extracted answer equals the reference numerically (or as text).
        ``ground_truth_answer`` is idempotent on a bare answer, so metadata may carry either
        the raw reference solution or its final answer."""
        extracted = extract_answer(completion)
        return answers_match(extracted, ground_truth_answer(ground_truth), self.rel_tol), extracted

    def comparable(self, extracted: str | None) -> str | None:
        """A number as its float's repr (``1,000``, ``1000`` and ``\\frac{2000}{2}`` vote
        together), anything else as its normalised text.  Two numbers within ``rel_tol`` but
        not equal stay two answers: a vote counts spellings, not tolerances."""
        if extracted is None:
            return None
        number = normalize_number(extracted)
        return repr(number) if number is not None else _normalize_text(extracted)


# ---------------------------------------------------------------------- helpers
def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces."""
    for match in reversed(list(_BOXED.finditer(text))):
        content = _balanced_content(text, match.end())
        if content is not None:
            return content.strip()
    return None


def _balanced_content(text: str, start: int) -> str | None:
    """Text from ``start`` up to the brace closing the one just before it (None if unclosed)."""
    depth = 1
    for pos in range(start, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return text[start:pos]
    return None


def _divide(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def _normalize_text(text: str) -> str:
    return "".join(str(text).split()).replace("\\$", "").replace("$", "").rstrip(".")
