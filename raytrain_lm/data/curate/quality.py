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

from raytrain_lm.config.curate import QualityConfig

STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
BULLETS = ("•", "‣", "⁃", "◦", "▪", "●", "-", "*")
ELLIPSES = ("...", "…")
# C4's terminal punctuation, and the closing quotes that may follow it.
TERMINAL = (".", "!", "?", '"', "'", "”", "’")
_STRIP = string.punctuation + "“”‘’«»…"

RULES = (
    "words",
    "mean_word_length",
    "symbols",
    "bullets",
    "ellipsis_lines",
    "alpha_words",
    "stop_words",
    "duplicate_lines",
    "duplicate_line_chars",
    "duplicate_paragraphs",
    "duplicate_paragraph_chars",
    "top_ngram",
    "punctuated_lines",
)


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


def first_failed_rule(text: str, cfg: QualityConfig) -> str | None:
    """The first rule of RULES that `text` fails, or None when it passes them all."""
    raw = text.split()
    words = [w for w in (token.strip(_STRIP) for token in raw) if w]
    n = len(words)
    if not cfg.min_words <= n <= cfg.max_words:
        return "words"
    mean = sum(len(w) for w in words) / n if n else 0.0
    if not cfg.min_mean_word_length <= mean <= cfg.max_mean_word_length:
        return "mean_word_length"
    ellipses = sum(text.count(e) for e in ELLIPSES)
    if max(text.count("#"), ellipses) > cfg.max_symbol_word_ratio * max(1, len(raw)):
        return "symbols"  # either symbol alone over the ratio, as Gopher counts them
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    n_lines = max(1, len(lines))
    if sum(line.startswith(BULLETS) for line in lines) > cfg.max_bullet_line_fraction * n_lines:
        return "bullets"
    if sum(line.endswith(ELLIPSES) for line in lines) > cfg.max_ellipsis_line_fraction * n_lines:
        return "ellipsis_lines"
    alpha = sum(any(c.isalpha() for c in token) for token in raw)
    if alpha < cfg.min_alpha_word_fraction * max(1, len(raw)):
        return "alpha_words"
    if len(STOP_WORDS.intersection(w.lower() for w in words)) < cfg.min_stop_words:
        return "stop_words"  # distinct stop words
    chars = max(1, len(text))
    repeated, repeated_chars = _repeats(lines)
    if repeated > cfg.max_duplicate_line_fraction * n_lines:
        return "duplicate_lines"
    if repeated_chars > cfg.max_duplicate_line_char_fraction * chars:
        return "duplicate_line_chars"
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    repeated, repeated_chars = _repeats(paragraphs)
    if repeated > cfg.max_duplicate_paragraph_fraction * max(1, len(paragraphs)):
        return "duplicate_paragraphs"
    if repeated_chars > cfg.max_duplicate_paragraph_char_fraction * chars:
        return "duplicate_paragraph_chars"
    for size, limit in sorted(cfg.max_top_ngram_char_fraction.items()):
        if _top_ngram_chars(words, size) > limit * chars:
            return "top_ngram"
    if sum(line.endswith(TERMINAL) for line in lines) < cfg.min_punctuated_line_fraction * n_lines:
        return "punctuated_lines"
    return None
