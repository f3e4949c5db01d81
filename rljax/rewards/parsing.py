"""Answer extraction and number parsing shared by the verifiers.

A completion's *final answer* is read from the last answer marker it contains (the model's last
word is its conclusion), in any of these phrasings: ``\\boxed{18}``, ``#### 18``,
``<answer>18</answer>``, ``The answer is $18.``, ``Answer: 18``, ``A: 18``. Without a marker the
last number in the text is used. Only the first number after the marker counts, so hedging
("the answer is 17 or 18") is not rewarded.

Numbers are compared exactly as fractions after normalising unicode (NFKC, unicode minus signs),
thousands separators (``1,234`` and LaTeX ``1{,}234``), currency and percent signs.
"""
from __future__ import annotations

import re
import unicodedata
from fractions import Fraction

__all__ = ["normalize_text", "find_boxed", "final_answer_text", "parse_number", "extract_number",
           "reference_number"]

# Minus-like characters models and datasets use for negative numbers.
_MINUS = {"\u2212": "-", "\u2012": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-"}
# A number: grouped thousands, plain digits or a leading-dot decimal, with an optional fraction.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s?/\s?\d+(?:\.\d+)?)?|-?\.\d+")
# Markers after which the final answer follows; the last marker in the text wins.
_MARKERS = [
    re.compile(r"####\s*"),
    re.compile(r"<answer>\s*"),
    re.compile(r"\banswer\s*(?:is|:|=)\s*(?:[:=])?\s*", re.IGNORECASE),
    re.compile(r"(?:^|(?<=\s))A\s*:\s*"),
]


def normalize_text(text: str) -> str:
    """NFKC-normalises and rewrites minus signs and LaTeX noise that hides numbers."""
    text = unicodedata.normalize("NFKC", str(text))
    for src, dst in _MINUS.items():
        text = text.replace(src, dst)
    # LaTeX: 1{,}000 thousands, \! and \, spacing, \$ and \% escapes, \dfrac/\tfrac -> \frac.
    text = text.replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("\\ ", " ")
    text = text.replace("\\$", "$").replace("\\%", "%")
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    # \frac{a}{b} with plain numbers -> a/b so fractions parse as numbers.
    text = re.sub(r"\\frac\{\s*(-?[\d.]+)\s*\}\{\s*(-?[\d.]+)\s*\}", r"\1/\2", text)
    return text


def find_boxed(text: str) -> tuple[int, str] | None:
    """Returns (position, content) of the last ``\\boxed{...}`` / ``\\fbox{...}``, braces balanced."""
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for m in reversed(starts):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return m.start(), text[m.end():i - 1]
    return None


def final_answer_text(text: str) -> str | None:
    """The text of the completion's final answer (after the last marker), or None if no marker."""
    text = normalize_text(text)
    best_pos, best = -1, None
    boxed = find_boxed(text)
    if boxed is not None:
        best_pos, best = boxed
    for marker in _MARKERS:
        for m in marker.finditer(text):
            if m.start() > best_pos:
                best_pos, best = m.start(), text[m.end():]
    if best is None:
        return None
    # The answer ends at the end of its line (or a closing tag).
    return best.split("</answer>")[0].split("\n")[0]


def parse_number(token: str) -> Fraction | None:
    """Parses one number string ("1,234.5", "-3/4") into an exact Fraction."""
    token = token.replace(",", "").replace(" ", "")
    try:
        if "/" in token:
            num, den = token.split("/")
            value = Fraction(num) / Fraction(den)
        else:
            value = Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def _first_number(text: str) -> Fraction | None:
    m = _NUMBER.search(text)
    return parse_number(m.group(0)) if m else None


def extract_number(completion: str) -> Fraction | None:
    """The completion's final numeric answer: first number after the last marker, else the last number."""
    answer = final_answer_text(completion)
    if answer is not None:
        return _first_number(answer)
    numbers = _NUMBER.findall(normalize_text(completion))
    return parse_number(numbers[-1]) if numbers else None


def reference_number(reference) -> Fraction | None:
    """A dataset's reference answer as a number: the full GSM8K answer ("... #### 18") or bare ("18")."""
    if isinstance(reference, (int, Fraction)) and not isinstance(reference, bool):
        return Fraction(reference)
    if isinstance(reference, float):
        return Fraction(repr(reference))  # 0.1 -> 1/10, not the binary float's exact value
    text = normalize_text(str(reference))
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return _first_number(text)
