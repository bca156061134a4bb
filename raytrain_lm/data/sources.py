"""Where text comes from: files, folders and globs on local disk or any `pyarrow.fs`
filesystem, in plain text, JSON Lines or Parquet (optionally gzip or zstd compressed), and two
corpora that ship with every Python (`builtin:python-stdlib`, `builtin:python-docs`).

Undecodable bytes are replaced (U+FFFD) and counted, never fatal: the count is reported by
`prepare` and recorded in the manifest. An input that is clearly not text (see
`_refuse_non_text`) is refused, naming it.
"""

from __future__ import annotations

import ast
import fnmatch
import glob
import json
import os
import re
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain_lm.errors import UserError
from raytrain_lm.storage import filesystem, is_uri

BUILTIN_DOCS = "builtin:python-docs"
BUILTIN_STDLIB = "builtin:python-stdlib"
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text"}
JSONL_SUFFIXES = {".jsonl", ".ndjson", ".json"}
PARQUET_SUFFIXES = {".parquet"}
COMPRESSION_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
SNIFF_BYTES = 8192  # how much of a text input is looked at to tell that it is not text
NON_TEXT_SHARE = 0.25
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")
# Test suites and vendored trees are skipped: they are huge and read unlike ordinary code.
_STDLIB_SKIP = {
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "dist-packages",
    "lib2to3",
    "ensurepip",
}
_DOC_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@dataclass(frozen=True)
class Document:
    source: str
    text: str
    replaced_bytes: int = 0  # undecodable bytes turned into U+FFFD


@dataclass(frozen=True)
class InputFile:
    """One input: a local path, a URI, or a builtin corpus marker; size/mtime identify it."""

    uri: str
    size: int = 0
    mtime_ns: int = 0
    source: int = 0  # which of `data.sources` named it (curation counts per source)

    def identity(self) -> dict:
        if self.uri == BUILTIN_DOCS:
            return {"input": self.uri, "python": sys.version.split()[0]}
        return {"input": self.uri, "bytes": self.size, "mtime_ns": self.mtime_ns}


def _kind(name: str) -> tuple[str, str | None]:
    """('text' | 'jsonl' | 'parquet' | '', compression) from a file name."""
    stem, suffix = os.path.splitext(name.lower())
    compression = COMPRESSION_SUFFIXES.get(suffix)
    if compression:
        suffix = os.path.splitext(stem)[1]
    if suffix in JSONL_SUFFIXES:
        return "jsonl", compression
    if suffix in PARQUET_SUFFIXES and not compression:
        return "parquet", None
    if suffix in TEXT_SUFFIXES:
        return "text", compression
    return "", compression


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP and not d.startswith("_"))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


def _file(info: pafs.FileInfo, uri: str) -> InputFile:
    mtime = info.mtime_ns if info.mtime_ns is not None else 0
    return InputFile(uri, info.size or 0, mtime)


def _uri_for(source: str, inner: str) -> str:
    if is_uri(source):
        return (
            f"{source.split('://', 1)[0]}://{inner.lstrip('/')}"
            if not source.startswith("file://")
            else f"file://{inner}"
        )
    return inner


def _builtin_inputs(source: str) -> list[InputFile]:
    if source == BUILTIN_DOCS:
        return [InputFile(BUILTIN_DOCS)]
    if source == BUILTIN_STDLIB:
        local = pafs.LocalFileSystem()
        return [_file(local.get_file_info(str(p)), str(p)) for p in _stdlib_files()]
    raise UserError(f"unknown builtin corpus '{source}'; use {BUILTIN_STDLIB} or {BUILTIN_DOCS}")


def _local_glob_matches(source: str, fs: pafs.FileSystem) -> list[tuple[pafs.FileInfo, str]]:
    """A local glob, as Python's glob reads it (`**` spans folders), after `~` is expanded."""
    matches = sorted(
        p for p in glob.glob(os.path.expanduser(source), recursive=True) if os.path.isfile(p)
    )
    return [(fs.get_file_info(os.path.abspath(p)), os.path.abspath(p)) for p in matches]


def _uri_glob_matches(fs: pafs.FileSystem, pattern: str) -> list[tuple[pafs.FileInfo, str]]:
    """A glob in a URI, which pyarrow's filesystems do not expand: every file under the folder
    before its first wildcard, matched against the pattern."""
    base = pattern[: min(pattern.index(c) for c in "*?[" if c in pattern)].rsplit("/", 1)[0]
    listing = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    return [
        (i, i.path)
        for i in listing
        if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, pattern)
    ]


def _path_matches(source: str, fs: pafs.FileSystem, path: str) -> list[tuple[pafs.FileInfo, str]]:
    """A file, or the files of a folder that hold text, JSON Lines or Parquet."""
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return [(info, path)]
    if info.type != pafs.FileType.Directory:
        raise UserError(f"input not found: {source}")
    listing = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    files = [(i, i.path) for i in listing if i.type == pafs.FileType.File and _kind(i.base_name)[0]]
    if not files:
        raise UserError(f"input folder {source} holds no text, JSON Lines or Parquet files")
    return files


def expand_source(source: str) -> list[InputFile]:
    """A source spec -> the concrete inputs it names, sorted."""
    if source.startswith("builtin:"):
        return _builtin_inputs(source)
    try:
        fs, inner = filesystem(source)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise UserError(f"cannot open input {source}: {exc}".splitlines()[0]) from None
    if not is_uri(source) and any(c in source for c in "*?["):
        infos = _local_glob_matches(source, fs)
    elif any(c in inner for c in "*?["):
        infos = _uri_glob_matches(fs, inner)
    else:
        infos = _path_matches(source, fs, inner)
    if not infos:
        raise UserError(f"input not found: {source}")
    return [_file(info, _uri_for(source, path)) for info, path in sorted(infos, key=lambda x: x[1])]


def expand_sources(sources: list[str]) -> list[InputFile]:
    """Every source's inputs, in the order the sources are given."""
    return [
        replace(item, source=n)
        for n, source in enumerate(sources)
        for item in expand_source(source)
    ]


def _decode(data: bytes) -> tuple[str, int]:
    """UTF-8 text with each undecodable byte replaced by U+FFFD, and how many there were."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        kept = len(data.decode("utf-8", errors="ignore").encode("utf-8"))
        return data.decode("utf-8", errors="replace"), len(data) - kept


def _refuse_non_text(data: bytes, uri: str) -> None:
    """Refuses a text or JSON Lines input that is clearly not UTF-8 text, judged by its first
    SNIFF_BYTES: any NUL byte (no text holds one; binaries and UTF-16/32 text do), or more
    than NON_TEXT_SHARE of bytes that do not decode (West European text in Latin-1 has a few
    percent, a binary or text in another encoding far more)."""
    head = data[:SNIFF_BYTES]
    if b"\0" in head:
        raise UserError(f"{uri}: not a text file: it holds NUL bytes (binary, or UTF-16/32 text?)")
    _, undecodable = _decode(head)
    if undecodable > NON_TEXT_SHARE * len(head):
        raise UserError(
            f"{uri}: not UTF-8 text: {undecodable} of its first {len(head)} bytes do not "
            "decode (binary?)"
        )


def _json_text(line: bytes, number: int, uri: str, text_field: str) -> tuple[str, int]:
    """The text field of one JSON line and how many characters of it were replaced: bytes
    that are not UTF-8, and escapes of half a surrogate pair (not text either)."""
    decoded, replaced = _decode(line)
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{uri}, line {number}: not valid JSON ({exc.msg}, column {exc.colno})"
        ) from None
    if not isinstance(record, dict) or text_field not in record:
        raise UserError(f"{uri}, line {number}: no '{text_field}' field; set data.text_field")
    text = record[text_field]
    if not isinstance(text, str):
        return "", replaced
    text, halves = _LONE_SURROGATE.subn("\ufffd", text)
    return text, replaced + halves


def _read_bytes(item: InputFile, compression: str | None) -> bytes:
    try:
        fs, inner = filesystem(item.uri)
        with fs.open_input_stream(inner, compression=None) as f:  # not detected: decoded below
            data = f.read()
    except OSError as exc:
        raise UserError(f"cannot read input {item.uri}: {exc}".splitlines()[0]) from None
    if compression is None:
        return data
    try:
        return pa.input_stream(pa.py_buffer(data), compression=compression).read()
    except OSError as exc:
        raise UserError(
            f"{item.uri}: not valid {compression} data ({exc})".splitlines()[0]
        ) from None


def _is_text_type(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):
        return _is_text_type(kind.value_type)
    return (
        pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)
    )


def _parquet_documents(item: InputFile, text_field: str) -> Iterator[Document]:
    try:
        fs, inner = filesystem(item.uri)
        with fs.open_input_file(inner) as f:
            parquet = pq.ParquetFile(f)
            schema = parquet.schema_arrow
            if text_field not in schema.names:
                raise UserError(
                    f"{item.uri}: no column '{text_field}' (columns: "
                    f"{', '.join(schema.names)}); set data.text_field"
                )
            kind = schema.field(text_field).type
            if not _is_text_type(kind):
                raise UserError(
                    f"{item.uri}: column '{text_field}' holds {kind}, not strings; "
                    "set data.text_field"
                )
            for batch in parquet.iter_batches(columns=[text_field]):
                for text in batch.column(0).to_pylist():
                    if text:
                        yield Document(item.uri, text)
    except OSError as exc:
        raise UserError(f"cannot read input {item.uri}: {exc}".splitlines()[0]) from None
    except pa.ArrowException as exc:
        raise UserError(f"{item.uri}: not a valid Parquet file ({exc})".splitlines()[0]) from None


def _python_docs() -> Iterator[Document]:
    """English prose that ships with Python: the reference's topics, then stdlib docstrings."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield Document(f"{BUILTIN_DOCS}/{name}", topics[name])
    for path in _stdlib_files():
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, _DOC_NODES))]
        docs = [d for d in (ast.get_docstring(n) for n in nodes) if d and len(d) > 80]
        if docs:
            yield Document(f"{BUILTIN_DOCS}/{path.stem}", "\n\n".join(docs))


def read_documents(item: InputFile, text_field: str = "text") -> Iterator[Document]:
    """The documents of one input, in order: a text file is one document, a JSON Lines file
    one per line, a Parquet file one per row of `text_field`. Anything wrong with the input
    raises a one-line UserError naming it (and the line, for JSON Lines)."""
    if item.uri == BUILTIN_DOCS:
        yield from _python_docs()
        return
    kind, compression = _kind(item.uri)
    if kind == "parquet":
        yield from _parquet_documents(item, text_field)
        return
    data = _read_bytes(item, compression)
    _refuse_non_text(data, item.uri)
    if kind != "jsonl":
        yield Document(item.uri, *_decode(data))
        return
    for number, line in enumerate(data.splitlines(), start=1):
        if line.strip():
            text, replaced = _json_text(line, number, item.uri, text_field)
            if text:
                yield Document(item.uri, text, replaced)
