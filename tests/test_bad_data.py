"""Bad data is refused with one line naming the file (and line), from `prepare()` and from the
CLI; checks that need no Ray run before it starts; a prepared dataset the model cannot use
(either split shorter than one sequence) is refused before training."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_lm.config import DataConfig, ModelConfig
from raytrain_lm.data.checks import check_data_matches_model, check_inputs
from raytrain_lm.data.prepare import prepare
from raytrain_lm.errors import UserError
from raytrain_lm.tokenization import BPETokenizer, ByteTokenizer

GOOD = "a plain line of text that is long enough to be a document\n" * 20
# The head of an ELF executable: the binary most often passed by mistake.
BINARY = b"\x7fELF\x02\x01\x01" + bytes(9) + bytes(range(256)) * 16
NUL_FREE_BINARY = bytes(range(128, 256)) * 32  # no NUL byte, but not text in any sense


def _write(path, content) -> str:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return str(path)


def _refusal(tmp_path, source: str) -> UserError:
    """What prepare() raised for `source`, after checking that nothing was written."""
    cfg = DataConfig(sources=[source], cache_dir=str(tmp_path / "data"))
    with pytest.raises(UserError) as raised:
        prepare(cfg, progress=False)
    assert not (tmp_path / "data").exists()
    return raised.value


def _bad_inputs(tmp_path) -> list[tuple[str, str]]:
    """(source, the one line that refuses it) for each kind of bad input."""
    cases = []
    p = _write(tmp_path / "no_field.jsonl", json.dumps({"text": "fine"}) + '\n{"body": "x"}\n')
    cases.append((p, f"{p}, line 2: no 'text' field; set data.text_field"))
    p = _write(tmp_path / "columns.parquet", b"")
    pq.write_table(pa.table({"body": ["x"], "n": [1]}), p)
    cases.append((p, f"{p}: no column 'text' (columns: body, n); set data.text_field"))
    p = _write(tmp_path / "numbers.parquet", b"")
    pq.write_table(pa.table({"text": [1, 2]}), p)
    cases.append((p, f"{p}: column 'text' holds int64, not strings; set data.text_field"))
    p = _write(tmp_path / "fake.txt.gz", GOOD)
    cases.append((p, f"{p}: not valid gzip data (zlib inflate failed: incorrect header check)"))
    p = _write(tmp_path / "program", BINARY)
    cases.append((p, f"{p}: not a text file: it holds NUL bytes (binary, or UTF-16/32 text?)"))
    p = _write(tmp_path / "noise.txt", GOOD.encode() + NUL_FREE_BINARY)
    size = len(GOOD) + len(NUL_FREE_BINARY)
    cases.append(
        (p, f"{p}: not UTF-8 text: 4096 of its first {size} bytes do not decode (binary?)")
    )
    p = _write(tmp_path / "program.parquet", BINARY)
    cases.append(
        (
            p,
            f"{p}: not a valid Parquet file (Parquet magic bytes not found in footer. Either the "
            "file is corrupted or this is not a parquet file.)",
        )
    )
    return cases


def test_bad_inputs_are_refused_with_one_line_naming_the_file(tmp_path):
    for source, message in _bad_inputs(tmp_path):
        error = _refusal(tmp_path, source)
        assert type(error) is UserError  # the user's own error, not a Ray wrapper
        assert str(error) == message


def test_a_bad_input_past_the_byte_cap_is_not_reported(tmp_path):
    (tmp_path / "in").mkdir()
    _write(tmp_path / "in" / "a.txt", GOOD)
    _write(tmp_path / "in" / "b.jsonl", "{not json\n")
    cfg = DataConfig(
        sources=[str(tmp_path / "in")], cache_dir=str(tmp_path / "data"), max_source_bytes=len(GOOD)
    )
    assert prepare(cfg, progress=False).manifest.documents == 1


def test_prepare_cli_names_a_bad_json_line_in_one_line(tmp_path, ray_session):
    bad = _write(tmp_path / "bad.jsonl", json.dumps({"text": GOOD}) + "\n{not json\n")
    env = {
        **os.environ,
        # this session's own Ray (starting another costs half a minute)
        "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address,
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "raytrain_lm.cli",
            "prepare",
            "--set",
            f"data.sources={bad}",
            "--set",
            f"data.cache_dir={tmp_path / 'data'}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    # Joining through RAY_ADDRESS, ray.init announces the connection (INFO lines of its
    # worker.py) before the CLI has a say; apart from those, stderr is the error alone.
    lines = [line for line in done.stderr.splitlines() if "\tINFO worker.py:" not in line]
    assert lines == [
        f"raytrain-lm: error: {bad}, line 2: not valid JSON "
        "(Expecting property name enclosed in double quotes, column 2)"
    ]
    assert not (tmp_path / "data").exists()


def test_non_utf8_bytes_and_lone_surrogates_in_json_lines_are_replaced_and_counted(tmp_path):
    lines = [
        b'{"text": "caf\xe9 au lait, na\xefve"}',  # latin-1 bytes in a UTF-8 file
        b'{"text": "half an emoji: \\ud83d, then text"}',  # a lone surrogate escape
    ]
    source = _write(tmp_path / "mixed.jsonl", b"\n".join(lines) + b"\n")
    cfg = DataConfig(sources=[source], cache_dir=str(tmp_path / "data"), val_fraction=0.1)
    prepared = prepare(cfg, progress=False)
    assert prepared.manifest.replaced_bytes == 3
    assert prepared.manifest.documents == 2


def test_latin1_text_is_still_text(tmp_path):
    source = _write(
        tmp_path / "latin1.txt", "Caf\xe9, cr\xe8me br\xfbl\xe9e.\n".encode("latin-1") * 40
    )
    cfg = DataConfig(sources=[source], cache_dir=str(tmp_path / "data"))
    assert prepare(cfg, progress=False).manifest.replaced_bytes == 4 * 40


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"tokenizer": {"kind": "bpe", "path": "{tmp}/missing.json"}}, "tokenizer file not found"),
        ({"tokenizer": {"kind": "bpe", "path": "{tmp}/in"}}, "tokenizer file not found"),
        ({"tokenizer": {"kind": "bpe", "path": "{tmp}/other.json"}}, "not a tokenizer file"),
        ({"tokenizer": {"kind": "bpe", "path": "{tmp}/bad.json"}}, "not valid JSON"),
        ({"tokenizer": {"kind": "bpe", "path": "{tmp}/tok"}}, "holds a byte tokenizer"),
        ({"prepared": "{tmp}/in"}, "no manifest.json in"),
        ({"sources": ["{tmp}/in/*.jsonl"]}, "input not found"),
        ({"sources": ["{tmp}/in", "{tmp}/nowhere"]}, "input not found"),
    ],
)
def test_check_inputs_refuses_what_needs_no_ray(tmp_path, settings, message):
    (tmp_path / "in").mkdir()
    _write(tmp_path / "in" / "a.txt", GOOD)
    _write(tmp_path / "bad.json", "{not json")
    _write(tmp_path / "other.json", json.dumps({"a": 1}))
    (tmp_path / "tok").mkdir()
    ByteTokenizer().save(tmp_path / "tok")
    raw = json.loads(json.dumps(settings).replace("{tmp}", str(tmp_path)))
    cfg = DataConfig(**{"sources": [str(tmp_path / "in")], **raw})
    with pytest.raises(UserError, match=message) as raised:
        check_inputs(cfg)
    assert "\n" not in str(raised.value)
    with pytest.raises(UserError, match=message):  # prepare checks first, as train does
        prepare(cfg.model_copy(update={"cache_dir": str(tmp_path / "data")}), progress=False)
    assert not (tmp_path / "data").exists()


def test_a_tokenizer_folder_is_fingerprinted_by_its_tokenizer(tmp_path):
    tokenizer = BPETokenizer.train([GOOD], vocab_size=300)
    tokenizer.save(tmp_path)
    cfg = DataConfig(
        sources=[_write(tmp_path / "a.txt", GOOD)],
        cache_dir=str(tmp_path / "data"),
        tokenizer={"kind": "bpe", "path": str(tmp_path)},  # the folder, not the file
    )
    prepared = prepare(cfg, progress=False)
    assert prepared.manifest.tokenizer_fingerprint == tokenizer.fingerprint


def test_splits_shorter_than_one_sequence_are_refused(tmp_path):
    # 6 KB of byte tokens: 5.4 K train, 600 validation
    source = _write(tmp_path / "small.txt", "x" * 6000)
    cfg = DataConfig(sources=[source], cache_dir=str(tmp_path / "data"))
    manifest = prepare(cfg, progress=False).manifest
    check_data_matches_model(cfg, ModelConfig(block_size=512), manifest)
    with pytest.raises(UserError) as raised:
        check_data_matches_model(cfg, ModelConfig(block_size=1024), manifest)
    assert str(raised.value) == (
        f"validation split too small: {manifest.splits['val'].tokens} tokens, but no shard "
        "holds a whole sequence of 1025 (model.block_size + 1); use more data, a larger "
        "data.val_fraction or a smaller model.block_size"
    )
    with pytest.raises(UserError, match="^training split too small"):
        check_data_matches_model(cfg, ModelConfig(block_size=8192), manifest)


def test_prepared_data_must_match_the_model(tmp_path):
    source = _write(tmp_path / "a.txt", GOOD)
    prepared = prepare(DataConfig(sources=[source], cache_dir=str(tmp_path / "data")))
    cfg = DataConfig(prepared=prepared.directory, tokenizer={"kind": "char"})
    with pytest.raises(UserError, match="uses a byte tokenizer, the config says .*kind=char"):
        check_data_matches_model(cfg, ModelConfig(block_size=16), prepared.manifest)
    cfg = DataConfig(prepared=prepared.directory)
    with pytest.raises(UserError, match=r"model.vocab_size \(100\) is smaller"):
        check_data_matches_model(cfg, ModelConfig(block_size=16, vocab_size=100), prepared.manifest)
