"""Quality rules for prose (`data.curate.quality`): a documented subset of the Gopher rules
(Rae et al. 2021, arXiv 2112.11446, as datatrove implements them) and FineWeb's share of lines
that end in punctuation (arXiv 2406.17557, after C4's line rule). Each rule is a measure of the
document and a threshold from the config; `first_failed_rule` names the first one a document
fails, in RULES order, so a removed document is counted once, under one rule.

Words are the document's whitespace-separated tokens with surrounding punctuation stripped
(Gopher tokenizes with a word tokenizer; on prose the two counts differ little), lines are its
non-blank lines, paragraphs its blocks between blank lines. Stop words are counted distinct and
regardless of case; repeated characters and the top n-gram's are shares of the whole text.
"""

from __future__ import annotations

import string
from collections import Counter
from collections.abc import Callable
from functools import cached_property

from raytrain_lm.config.curate import QualityConfig

STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
BULLETS = ("•", "‣", "⁃", "◦", "▪", "●", "-", "*")
ELLIPSES = ("...", "…")
# C4's terminal punctuation, and the closing quotes that may follow it.
TERMINAL = (".", "!", "?", '"', "'", "”", "’")
_STRIP = string.punctuation + "“”‘’«»…"


def _repeats(parts: list[str]) -> tuple[int, int]:
    """(how many parts repeat an earlier one, their characters), as Gopher counts them."""
    seen: set[str] = set()
    count = chars = 0
    for part in parts:
        if part in seen:
            count += 1
            chars += len(part)
        else:
            seen.add(part)
    return count, chars


def _top_ngram_chars(words: list[str], n: int) -> int:
    """Characters the most frequent word n-gram covers: its length (words joined by spaces)
    times its count, as datatrove's GopherRepetitionFilter counts them."""
    if len(words) < n:
        return 0
    grams = Counter(" ".join(words[i : i + n]) for i in range(len(words) - n + 1))
    gram, count = grams.most_common(1)[0]
    return count * len(gram)


class _Document:
    """The views of a document that the rules measure. Each is computed when a rule first
    needs it: most junk fails an early, cheap rule, and the n-gram counts are the costly ones."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.chars = max(1, len(text))

    @cached_property
    def tokens(self) -> list[str]:
        """Whitespace-separated, punctuation kept: what Gopher's per-word ratios divide by."""
        return self.text.split()

    @cached_property
    def words(self) -> list[str]:
        return [w for w in (token.strip(_STRIP) for token in self.tokens) if w]

    @cached_property
    def lines(self) -> list[str]:
        return [line.strip() for line in self.text.splitlines() if line.strip()]

    @cached_property
    def paragraphs(self) -> list[str]:
        return [p.strip() for p in self.text.split("\n\n") if p.strip()]

    @cached_property
    def repeated_lines(self) -> tuple[int, int]:
        return _repeats(self.lines)

    @cached_property
    def repeated_paragraphs(self) -> tuple[int, int]:
        return _repeats(self.paragraphs)

    def line_share(self, count: int, fraction: float) -> bool:
        """Whether `count` lines are more than `fraction` of the lines (a blank text has one)."""
        return count > fraction * max(1, len(self.lines))


def _mean_word_length(words: list[str]) -> float:
    return sum(len(w) for w in words) / len(words) if words else 0.0


def _symbols(doc: _Document) -> int:
    """The larger of the '#' and ellipsis counts: either symbol alone over the ratio fails
    the rule, as Gopher counts them."""
    return max(doc.text.count("#"), sum(doc.text.count(e) for e in ELLIPSES))


def _fails_top_ngram(doc: _Document, cfg: QualityConfig) -> bool:
    return any(
        _top_ngram_chars(doc.words, size) > limit * doc.chars
        for size, limit in sorted(cfg.max_top_ngram_char_fraction.items())
    )


_Check = Callable[[_Document, QualityConfig], bool]
# Each rule with its test of failing, in the order they are tried.
_FAILS: tuple[tuple[str, _Check], ...] = (
    ("words", lambda doc, cfg: not cfg.min_words <= len(doc.words) <= cfg.max_words),
    (
        "mean_word_length",
        lambda doc, cfg: (
            not (
                cfg.min_mean_word_length <= _mean_word_length(doc.words) <= cfg.max_mean_word_length
            )
        ),
    ),
    (
        "symbols",
        lambda doc, cfg: _symbols(doc) > cfg.max_symbol_word_ratio * max(1, len(doc.tokens)),
    ),
    (
        "bullets",
        lambda doc, cfg: doc.line_share(
            sum(line.startswith(BULLETS) for line in doc.lines), cfg.max_bullet_line_fraction
        ),
    ),
    (
        "ellipsis_lines",
        lambda doc, cfg: doc.line_share(
            sum(line.endswith(ELLIPSES) for line in doc.lines), cfg.max_ellipsis_line_fraction
        ),
    ),
    (
        "alpha_words",
        lambda doc, cfg: (
            sum(any(c.isalpha() for c in token) for token in doc.tokens)
            < cfg.min_alpha_word_fraction * max(1, len(doc.tokens))
        ),
    ),
    (
        "stop_words",  # distinct stop words
        lambda doc, cfg: (
            len(STOP_WORDS.intersection(w.lower() for w in doc.words)) < cfg.min_stop_words
        ),
    ),
    (
        "duplicate_lines",
        lambda doc, cfg: doc.line_share(doc.repeated_lines[0], cfg.max_duplicate_line_fraction),
    ),
    (
        "duplicate_line_chars",
        lambda doc, cfg: doc.repeated_lines[1] > cfg.max_duplicate_line_char_fraction * doc.chars,
    ),
    (
        "duplicate_paragraphs",
        lambda doc, cfg: (
            doc.repeated_paragraphs[0]
            > cfg.max_duplicate_paragraph_fraction * max(1, len(doc.paragraphs))
        ),
    ),
    (
        "duplicate_paragraph_chars",
        lambda doc, cfg: (
            doc.repeated_paragraphs[1] > cfg.max_duplicate_paragraph_char_fraction * doc.chars
        ),
    ),
    ("top_ngram", _fails_top_ngram),
    (
        "punctuated_lines",
        lambda doc, cfg: (
            sum(line.endswith(TERMINAL) for line in doc.lines)
            < cfg.min_punctuated_line_fraction * max(1, len(doc.lines))
        ),
    ),
)
RULES = tuple(name for name, _ in _FAILS)


def first_failed_rule(text: str, cfg: QualityConfig) -> str | None:
    """The first rule of RULES that `text` fails, or None when it passes them all."""
    doc = _Document(text)
    return next((name for name, fails in _FAILS if fails(doc, cfg)), None)
