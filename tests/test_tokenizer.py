"""CharTokenizer: blank = 0, round trips, files, and clear unknown-character errors."""

import pytest

from ddptrain.data import CharTokenizer, DataConfig, DataError, TokenizerError, load_or_build_tokenizer
from ddptrain.data.synthetic import write_synthetic_corpus

TEXTS = ["hello world", "héllo", "abc cab"]


def test_build_is_deterministic_with_blank_zero():
    tok = CharTokenizer.build(TEXTS)
    assert tok.vocab[0] == "<blank>" and tok.blank_id == 0
    assert tok.vocab == CharTokenizer.build(reversed(TEXTS)).vocab
    assert tok.vocab_size == 1 + len(set("".join(TEXTS)))
    ids = tok.encode("hello world")
    assert 0 not in ids and tok.decode(ids) == "hello world"


def test_unicode_forms_are_the_same_token():
    tok = CharTokenizer.build(["caf\u00e9"])  # precomposed
    assert tok.encode("cafe\u0301") == tok.encode("caf\u00e9")  # e + combining accent


def test_ctc_decode_merges_repeats_then_drops_blanks():
    tok = CharTokenizer.build(["ab"])
    a, b = tok.encode("ab")
    assert tok.decode([a, a, 0, a, b, b, 0]) == "aaabb"  # plain: only blanks go
    assert tok.decode([a, a, 0, a, b, b, 0], ctc=True) == "aab"  # a blank separates a real repeat
    assert tok.decode([a, a, b], ctc=True) == "ab"
    assert tok.decode([a, a, b]) == "aab"


@pytest.mark.parametrize("name", ["vocab.json", "vocab.txt"])
def test_save_and_load_round_trip(tmp_path, name):
    for unk in (None, "<unk>"):
        tok = CharTokenizer.build(TEXTS + ["tab\there"], unk_token=unk) if name.endswith("json") else \
            CharTokenizer.build(TEXTS, unk_token=unk)
        tok.save(tmp_path / name)
        back = CharTokenizer.load(tmp_path / name)
        assert back.vocab == tok.vocab and back.unk_token == tok.unk_token
        assert back.encode("hello world") == tok.encode("hello world")
    if name.endswith("txt"):
        assert "<space>" in (tmp_path / name).read_text(encoding="utf-8").split("\n")


def test_unknown_characters_are_named_or_mapped():
    tok = CharTokenizer.build(["abc"])
    with pytest.raises(TokenizerError, match=r"'z' \(U\+007A\).*'abz'"):
        tok.encode("abz")
    assert isinstance(TokenizerError("x"), DataError)
    unk = CharTokenizer.build(["abc"], unk_token="<unk>")
    assert unk.unk_id == 1
    assert unk.encode("azb") == [unk.encode("a")[0], 1, unk.encode("b")[0]]


def test_bad_files_and_vocabularies(tmp_path):
    with pytest.raises(DataError, match="cannot read tokenizer file"):
        CharTokenizer.load(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text('{"type": "bpe", "vocab": []}')
    with pytest.raises(DataError, match="malformed tokenizer file"):
        CharTokenizer.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="CTC blank"):
        CharTokenizer(["a", "b"])


def test_build_from_manifest_and_load_or_build(tmp_path):
    m = write_synthetic_corpus(str(tmp_path / "c"), [0.3, 0.4], texts=["xy z", "zz"])
    tok = CharTokenizer.build(m)
    assert tok.vocab == ["<blank>", " ", "x", "y", "z"]
    path = str(tmp_path / "tok.json")
    cfg = DataConfig(train_manifest=m, tokenizer=path)
    built = load_or_build_tokenizer(cfg)  # file absent: built and saved
    assert CharTokenizer.load(path).vocab == built.vocab
    assert load_or_build_tokenizer(cfg).vocab == built.vocab  # now loaded
