"""Quality rules for prose (`data.curate.quality`): a documented subset of the Gopher rules
(Rae et al. 2021, arXiv 2112.11446, as datatrove implements them) and FineWeb's share of lines
that end in punctuation (arXiv 2406.17557, after C4's line rule). Each rule is a measure of the
document and a threshold from the config; `first_failed_rule` names the first one a document
fails, in RULES order, so a removed document is counted once, under one rule.

Words are the document's whitespace-separated tokens with surrounding punctuation stripped
(Gopher tokenizes with a word tokenizer; on prose the two counts differ little), lines are its
non-blank lines, paragraphs its blocks between blank lines.
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
    """Characters the most frequent word n-gram covers (its length times its count), when it
    occurs more than once."""
    if len(words) < n:
        return 0
    grams = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    gram, count = grams.most_common(1)[0]
    return count * sum(len(w) for w in gram) if count > 1 else 0


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
    symbols = text.count("#") + sum(text.count(e) for e in ELLIPSES)
    if symbols > cfg.max_symbol_word_ratio * max(1, len(raw)):
        return "symbols"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    n_lines = max(1, len(lines))
    if sum(line.startswith(BULLETS) for line in lines) > cfg.max_bullet_line_fraction * n_lines:
        return "bullets"
    if sum(line.endswith(ELLIPSES) for line in lines) > cfg.max_ellipsis_line_fraction * n_lines:
        return "ellipsis_lines"
    alpha = sum(any(c.isalpha() for c in token) for token in raw)
    if alpha < cfg.min_alpha_word_fraction * max(1, len(raw)):
        return "alpha_words"
    if sum(w.lower() in STOP_WORDS for w in words) < cfg.min_stop_words:
        return "stop_words"
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
    word_chars = max(1, sum(len(w) for w in words))
    for size, limit in sorted(cfg.max_top_ngram_char_fraction.items()):
        if _top_ngram_chars(words, size) > limit * word_chars:
            return "top_ngram"
    if sum(line.endswith(TERMINAL) for line in lines) < cfg.min_punctuated_line_fraction * n_lines:
        return "punctuated_lines"
    return None
