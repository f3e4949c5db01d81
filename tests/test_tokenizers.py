"""Tokenizers: HF directory, SentencePiece model and CharTokenizer, all built offline."""
import json
import os

import numpy as np
import pytest

from rljax import tokenizers

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["what is two plus three", "the answer is five", "two plus two is four",
          "three plus three is six", "hello world"] * 4


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(CORPUS, trainers.WordLevelTrainer(
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("hf_tok")
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("sp")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(CORPUS + ["12 + 7 = 19", "numbers and words"] * 5))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(d / "sp"), vocab_size=40,
                                   model_type="unigram", pad_id=3, unk_id=0, bos_id=1, eos_id=2,
                                   minloglevel=2)
    return str(d / "sp.model")


def test_hf_roundtrip_specials_and_chat(hf_dir):
    tok = tokenizers.load(hf_dir)
    assert isinstance(tok, tokenizers.HFTokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    ids = tok.encode("two plus three")
    assert len(ids) == 3 and tok.bos_id not in ids
    assert tok.encode("two plus three", add_bos=True) == [tok.bos_id] + ids
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == "two plus three"
    assert tok.vocab_size == len(tok.hf_tokenizer)
    assert tok.has_chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|user|>hi\n<|assistant|>"


def test_batch_encode_left_pads(hf_dir):
    tok = tokenizers.load(hf_dir)
    tokens, mask = tok.batch_encode(["hello world", "two plus two is four"], max_length=6)
    assert tokens.dtype == np.int32 and mask.dtype == bool and tokens.shape == (2, 6)
    assert mask.tolist() == [[False] * 4 + [True] * 2, [False] + [True] * 5]
    assert (tokens[~mask] == tok.pad_id).all()
    assert tok.batch_decode(tokens, mask) == ["hello world", "two plus two is four"]
    right, rmask = tok.batch_encode(["hello world"], max_length=3, left_pad=False)
    assert rmask.tolist() == [[True, True, False]]


def test_batch_encode_never_truncates():
    tok = tokenizers.CharTokenizer()
    with pytest.raises(ValueError, match="max_length=3"):
        tok.batch_encode(["12+7="], max_length=3)
    tokens, mask = tok.batch_encode(["1+1=", "12+7="])  # no max_length -> longest
    assert tokens.shape == (2, 5) and mask.sum() == 9


def test_sentencepiece(sp_model):
    tok = tokenizers.load(sp_model)
    assert isinstance(tok, tokenizers.SentencePieceTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    assert tok.vocab_size == 40
    ids = tok.encode("two plus three", add_bos=True)
    assert ids[0] == tok.bos_id
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == "two plus three"
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tokens, mask = tok.batch_encode(["hello world", "two"], max_length=8)
    assert tok.batch_decode(tokens, mask) == ["hello world", "two"]


def test_char_tokenizer_roundtrip_and_save(tmp_path):
    tok = tokenizers.CharTokenizer()
    text = "12+7=19\nWhat is (3*4)-5? A: 7."
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == tok.bos_id and all(i >= 4 for i in ids[1:])
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == text
    assert tok.decode([tok.bos_id, 4], skip_special=False) == "<bos>0"
    assert tok.encode("é") == [tok.unk_id]  # unknown characters do not crash
    path = tok.save(str(tmp_path))
    assert os.path.basename(path) == tokenizers.CHAR_TOKENIZER_FILE
    for p in (str(tmp_path), path):
        again = tokenizers.load(p)
        assert isinstance(again, tokenizers.CharTokenizer)
        assert again.encode(text) == tok.encode(text) and again.vocab_size == tok.vocab_size
    small = tokenizers.CharTokenizer("0123456789+=")
    assert small.vocab_size == 16 and small.encode("1+1=") == [5, 14, 5, 15]
    assert "User: hi\nAssistant: " == tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_bad_paths_name_the_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        tokenizers.load(missing)
    with pytest.raises(ValueError, match=str(tmp_path)):
        tokenizers.load(str(tmp_path))  # empty directory
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"kind": "other"}))
    with pytest.raises(ValueError, match="x.json"):
        tokenizers.load(str(bad))


def test_gguf_tokenizer_cache_entry_follows_the_file(tmp_path, monkeypatch):
    """The cache entry of a GGUF file's converted tokenizer changes when the file does (size,
    mtime)."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setenv("RLJAX_CACHE_DIR", str(tmp_path / "cache"))
    entry = tokenizers._gguf_cache_entry(str(model))
    assert entry.startswith(str(tmp_path / "cache" / "tokenizers"))
    assert tokenizers._gguf_cache_entry(str(model)) == entry
    os.utime(model, ns=(1, 1))
    touched = tokenizers._gguf_cache_entry(str(model))
    assert touched != entry
    model.write_bytes(b"GGUF" + bytes(61))
    os.utime(model, ns=(1, 1))
    assert tokenizers._gguf_cache_entry(str(model)) not in (entry, touched)


@pytest.mark.parametrize("root", ["gs://bucket/cache", "blocked"])
def test_gguf_tokenizer_converts_without_a_usable_cache(root, tmp_path, monkeypatch):
    """With the cache root on a URL, or a root that cannot be created, the GGUF tokenizer is
    converted (here a stand-in for transformers' conversion) and nothing is written locally."""
    from transformers import AutoTokenizer

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    (tmp_path / "blocked").write_text("")   # a file where the cache folder would go
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLJAX_CACHE_DIR", root if "://" in root else str(tmp_path / root))
    converted = object()
    calls = []

    def convert(*args, **kwargs):
        calls.append(kwargs.get("gguf_file"))
        return converted
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", convert)
    assert tokenizers._gguf_tokenizer(str(model)) is converted
    assert calls == ["m.gguf"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocked", "m.gguf"]
