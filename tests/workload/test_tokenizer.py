"""The byte tokenizer: id == byte value, exact round trips, offline AutoTokenizer loading."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.workload.zoo import (
    BOS_ID,
    BYTE_VOCAB_SIZE,
    EOS_ID,
    PAD_ID,
    build_byte_tokenizer,
    bytes_to_ids,
    default_model_dir,
    ids_to_bytes,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("bytetok")
    tok.save_pretrained(path)
    return path


def test_vocab_and_specials(tok):
    assert len(tok) == BYTE_VOCAB_SIZE == 259
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert tok.convert_tokens_to_ids(["<bos>", "<eos>", "<pad>"]) == [256, 257, 258]


def test_ids_are_utf8_bytes(tok):
    assert tok.encode("def f():", add_special_tokens=False) == [100, 101, 102, 32, 102, 40, 41, 58]
    assert tok.encode("é中\x00\n", add_special_tokens=False) == [
        0xC3,
        0xA9,
        0xE4,
        0xB8,
        0xAD,
        0x00,
        0x0A,
    ]
    # No BOS/EOS is added implicitly: ids are exactly the bytes.
    assert tok("ab")["input_ids"] == [97, 98]


@pytest.mark.parametrize(
    "text",
    ["", " ", "  leading and trailing  ", "\x00\x01\x7f", "tab\tcr\rlf\n", "é ü 中文 🎉", "Ġ Ċ"],
)
def test_round_trip_examples(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=64))
def test_round_trip_any_text(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == bytes_to_ids(text.encode("utf-8"))
    assert tok.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=64))
def test_raw_bytes_round_trip(tok, data):
    ids = bytes_to_ids(data)
    assert ids_to_bytes(ids) == data
    # Each byte id is a real vocab entry of the tokenizer, never <unk> or a special.
    assert all(tok.convert_ids_to_tokens(i) not in ("<bos>", "<eos>", "<pad>") for i in ids)


def test_invalid_utf8_bytes(tok):
    data = b"\xff\xfe\x00"
    assert bytes_to_ids(data) == [255, 254, 0]
    assert ids_to_bytes([BOS_ID, 255, 254, 0, EOS_ID]) == data
    # The HF decode of invalid UTF-8 is lossy (replacement char); bytes helpers are exact.
    assert "\ufffd" in tok.decode([255, 254])


def test_decode_skips_specials(tok):
    assert tok.decode([BOS_ID, 104, 105, EOS_ID], skip_special_tokens=True) == "hi"


def test_auto_tokenizer_offline(saved_dir):
    loaded = transformers.AutoTokenizer.from_pretrained(saved_dir, local_files_only=True)
    assert len(loaded) == 259
    text = "class A:\n    x = 'ß'\n"
    assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text
    names = sorted(p.name for p in saved_dir.iterdir())
    assert names == ["tokenizer.json", "tokenizer_config.json"]


def test_shipped_tokenizer_matches_builder(tok):
    shipped = default_model_dir() / "tokenizer.json"
    if not shipped.is_file():
        pytest.skip("embedded model not built yet")
    vocab = json.loads(shipped.read_text())["model"]["vocab"]
    assert vocab == json.loads(tok.backend_tokenizer.to_str())["model"]["vocab"]


def test_the_incremental_detokenizer_steps_tokenizers_decode_stream(tok):
    """Detokenizer pushes through tokenizers' DecodeStream (same pieces as its own two
    decodes a token); its own code stays for the end of a text inside a character,
    where the stream gives nothing and a whole decode gives U+FFFD."""
    from tokenizers.decoders import DecodeStream

    from kvstrata.engine.sampling import Detokenizer

    ids = tok.encode("é€😀 x = 'ü'\n", add_special_tokens=False) + [0xE2, 0x82]  # € cut
    streamed = Detokenizer(tok, [BOS_ID])
    assert streamed.stream is not None
    own = Detokenizer(tok, [BOS_ID])
    own.stream = None  # its own decodes
    pieces = [streamed.push([t]) for t in ids]
    assert pieces == [own.push([t]) for t in ids]
    assert pieces[:6] == ["", "é", "", "", "€", ""]
    assert "".join(pieces) + streamed.flush() == tok.decode(ids) == "é€😀 x = 'ü'\n\ufffd"
    library = DecodeStream(skip_special_tokens=True)
    assert "".join(library.step(tok.backend_tokenizer, t) or "" for t in ids) == "é€😀 x = 'ü'\n"
