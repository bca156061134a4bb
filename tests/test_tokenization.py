import pytest

from raytrain_lm.errors import UserError
from raytrain_lm.tokenization import (
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    load_tokenizer,
    token_dtype,
)

pytestmark = pytest.mark.no_ray

TEXTS = [
    "def f(x):\n    return x ** 2  # square\n",
    "中文字符与表情符号 🌍🚀, naïve café, Ελληνικά",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text
    assert all(0 <= i < 256 for i in tok.encode(text))


def test_char_tokenizer_from_alphabet(tmp_path):
    tok = CharTokenizer.from_texts(TEXTS)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == len(set("".join(TEXTS))) + 1
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.encode(TEXTS[1]) == tok.encode(TEXTS[1]) and again.fingerprint == tok.fingerprint
    with pytest.raises(UserError, match="alphabet"):
        tok.encode("Ω")


def test_bpe_trains_round_trips_and_reloads(tmp_path):
    corpus = [t * 40 for t in TEXTS if t]
    tok = BPETokenizer.train(corpus, vocab_size=400)
    assert 256 < tok.vocab_size <= 400
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(TEXTS[0] * 3)) < len(TEXTS[0].encode()) * 3  # it merges
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert again.encode(TEXTS[1]) == tok.encode(TEXTS[1])


def test_bad_tokenizer_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_tokenizer(tmp_path)
    with pytest.raises(UserError, match="not found"):
        load_tokenizer(tmp_path / "missing")


def test_compact_token_dtype():
    assert token_dtype(200).itemsize == 1
    assert token_dtype(257).itemsize == 2
    assert token_dtype(50257).itemsize == 2
    assert token_dtype(100_000).itemsize == 4
