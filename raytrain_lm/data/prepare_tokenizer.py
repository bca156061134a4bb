"""The tokenizer `prepare` writes the token stream with: the one given (to `prepare`, or by
`data.tokenizer.path`), a byte tokenizer, a char tokenizer of the alphabet of the documents
under the byte cap, or byte-level BPE trained on a bounded sample of them."""

from __future__ import annotations

from raytrain_lm.config import DataConfig
from raytrain_lm.data.cap import under_cap, within_cap
from raytrain_lm.data.prepare_job import map_input_groups, metadata_rows
from raytrain_lm.data.prepare_tasks import group_alphabet, read_group
from raytrain_lm.data.sources import InputFile, expand_sources
from raytrain_lm.errors import UserError
from raytrain_lm.tokenization import BPETokenizer, ByteTokenizer, CharTokenizer, Tokenizer

BPE_SAMPLE_BYTES = 20_000_000


def _capped_texts(
    inputs: list[InputFile], cfg: DataConfig, limit: int | None, duplicates: str | None = None
):
    """Document texts in order while their bytes fit under `limit` (for a BPE sample)."""
    documents = map_input_groups(
        inputs, read_group, text_field=cfg.text_field, curate=cfg.curate, duplicates=duplicates
    )
    for rows in within_cap(documents.iter_batches(batch_format="pyarrow", batch_size=None), limit):
        yield from rows.column("text").to_pylist()


def _capped_alphabet(
    inputs: list[InputFile], cfg: DataConfig, duplicates: str | None
) -> CharTokenizer:
    """A char tokenizer for the characters of the documents under `data.max_source_bytes`."""
    chars: set[str] = set()
    rows = metadata_rows(
        map_input_groups(
            inputs, group_alphabet, text_field=cfg.text_field, curate=cfg.curate,
            duplicates=duplicates,
        )
    )  # fmt: skip
    for row, cut in under_cap(rows, cfg.max_source_bytes):
        for index, end, new in zip(row["new_at"], row["new_end"], row["new_chars"], strict=True):
            if cut.keeps(index, end):
                chars.update(new)
    return CharTokenizer(chars)


def build_tokenizer(
    cfg: DataConfig, inputs: list[InputFile], given: Tokenizer | None, duplicates: str | None
) -> Tokenizer:
    """`given`, else the tokenizer of `data.tokenizer.kind` for these inputs. `duplicates`:
    the file of documents that deduplication removed, which no alphabet or sample reads."""
    tok = cfg.tokenizer
    if given is not None:
        return given
    if tok.kind == "byte":
        return ByteTokenizer()
    if tok.kind == "char":
        return _capped_alphabet(inputs, cfg, duplicates)
    limit = min(BPE_SAMPLE_BYTES, cfg.max_source_bytes or BPE_SAMPLE_BYTES)
    return train_bpe(cfg, inputs, limit, duplicates)


def train_bpe(
    cfg: DataConfig,
    inputs: list[InputFile] | None = None,
    sample_bytes: int = BPE_SAMPLE_BYTES,
    duplicates: str | None = None,
) -> BPETokenizer:
    """Byte-level BPE trained on the first `sample_bytes` of the configured inputs (the one
    pass whose text reaches the driver: a bounded sample, as training BPE needs it)."""
    inputs = inputs if inputs is not None else expand_sources(cfg.sources)
    sample = list(_capped_texts(inputs, cfg, sample_bytes, duplicates))
    if not any(t.strip() for t in sample):
        raise UserError(f"empty corpus: no text in {', '.join(cfg.sources)}")
    return BPETokenizer.train(sample, cfg.tokenizer.vocab_size)
