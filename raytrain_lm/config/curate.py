"""`data.curate`: what `prepare` removes or rewrites before tokenizing (data/curate/), each stage
off by default and on its own. Every setting is part of the prepared dataset's fingerprint.

The quality thresholds are the Gopher rules' (Rae et al. 2021, arXiv 2112.11446, as
datatrove's GopherQualityFilter and GopherRepetitionFilter apply them) and FineWeb's share of
lines ending in punctuation (Penedo et al. 2024, arXiv 2406.17557, from C4's line rule).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from raytrain_lm.config.base import _Section

CODE_EXTENSIONS = [
    ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".java", ".js", ".ts", ".go", ".rs",
    ".rb", ".php", ".cs", ".swift", ".kt", ".scala", ".sh", ".sql", ".r", ".jl", ".lua",
]  # fmt: skip


class QualityConfig(_Section):
    enabled: bool = False
    min_words: int = Field(50, ge=0, description="fewer words: removed (Gopher)")
    max_words: int = Field(100_000, ge=1, description="more words: removed (Gopher)")
    min_mean_word_length: float = Field(3.0, ge=0, description="characters per word, at least")
    max_mean_word_length: float = Field(10.0, gt=0, description="characters per word, at most")
    max_symbol_word_ratio: float = Field(
        0.1, ge=0, description="'#' and ellipses per word, at most (Gopher)"
    )
    max_bullet_line_fraction: float = Field(
        0.9, ge=0, le=1, description="share of lines starting with a bullet, at most"
    )
    max_ellipsis_line_fraction: float = Field(
        0.3, ge=0, le=1, description="share of lines ending in an ellipsis, at most"
    )
    min_alpha_word_fraction: float = Field(
        0.8, ge=0, le=1, description="share of words with a letter, at least"
    )
    min_stop_words: int = Field(
        2, ge=0, description="English stop words (the, be, to, of, and, that, have, with), at least"
    )
    max_duplicate_line_fraction: float = Field(
        0.3, ge=0, le=1, description="share of lines that repeat an earlier line, at most"
    )
    max_duplicate_line_char_fraction: float = Field(
        0.2, ge=0, le=1, description="share of characters in repeated lines, at most"
    )
    max_duplicate_paragraph_fraction: float = Field(
        0.3, ge=0, le=1, description="share of paragraphs that repeat an earlier one, at most"
    )
    max_duplicate_paragraph_char_fraction: float = Field(
        0.2, ge=0, le=1, description="share of characters in repeated paragraphs, at most"
    )
    max_top_ngram_char_fraction: dict[int, float] = Field(
        default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16},
        description="n -> share of characters the most frequent word n-gram covers, at most",
    )
    min_punctuated_line_fraction: float = Field(
        0.12, ge=0, le=1, description="share of lines ending in punctuation, at least (FineWeb)"
    )
    code_extensions: list[str] = Field(
        default_factory=lambda: list(CODE_EXTENSIONS),
        description="inputs with these endings are code: the prose rules skip them",
    )


class PiiConfig(_Section):
    enabled: bool = False
    email_placeholder: str = Field("email@example.com", description="what replaces an e-mail")
    ip_placeholder: str = Field(
        "192.0.2.1", description="what replaces an IPv4 or IPv6 address (TEST-NET-1)"
    )


Scope = Literal["source", "global"]


class ExactDedupConfig(_Section):
    enabled: bool = False
    scope: Scope = Field(
        "global", description="duplicates within each source, or across all of them"
    )


class NearDedupConfig(_Section):
    """MinHash over word n-grams and LSH banding, FineWeb's parameters by default: a pair of
    documents with Jaccard similarity s becomes a candidate with probability
    1 - (1 - s^rows_per_band)^bands (about 0.5 at s = 0.72 with 14 x 8)."""

    enabled: bool = False
    ngram: int = Field(5, ge=1, description="words per shingle")
    bands: int = Field(14, ge=1, description="LSH bands")
    rows_per_band: int = Field(8, ge=1, description="MinHash values per band")
    seed: int = Field(1, ge=0, description="the MinHash permutations' seed")
    scope: Scope = Field(
        "source",
        description="near-duplicates within each source (FineWeb: per crawl dump), or across all",
    )


class CurateConfig(_Section):
    sample_removed: int = Field(
        0, ge=0, description="the first N removed documents of each rule, in removed/<rule>.jsonl"
    )
    pii: PiiConfig = Field(default_factory=PiiConfig)
    quality: QualityConfig = Field(default_factory=QualityConfig)
    exact_dedup: ExactDedupConfig = Field(default_factory=ExactDedupConfig)
    near_dedup: NearDedupConfig = Field(default_factory=NearDedupConfig)

    @property
    def dedup(self) -> bool:
        return self.exact_dedup.enabled or self.near_dedup.enabled

    @property
    def enabled(self) -> bool:
        return self.pii.enabled or self.quality.enabled or self.dedup
