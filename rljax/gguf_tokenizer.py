"""The tokenizer a GGUF file describes, built from its own metadata with ``tokenizers``.

llama.cpp stores the tokenizer as metadata: ``tokenizer.ggml.model``, ``tokens``, ``merges``,
``scores``, ``token_type`` (3 = control, 4 = user-defined, 6 = byte), the special token ids,
``pre`` (the pre-tokenizer: how text is split before the merges) and
``tokenizer.chat_template``. ``build(path)`` turns that into a
``transformers.PreTrainedTokenizerFast`` without transformers' GGUF loader, which needs PyTorch
for its checkpoint reader. Two kinds are built:

* ``gpt2``: byte-level BPE (SmolLM2, Qwen2/3, Llama 3), split as ``pre`` says. The same ids as
  transformers' conversion (compared on SmolLM2: ``tests/test_real_model.py``).
* ``llama`` (SentencePiece) in a Gemma file (``general.architecture`` gemma, gemma2, gemma3):
  ``rljax.gguf_spm``. The same ids as transformers' conversion (compared on Gemma 3 270M:
  ``tests/test_gemma.py``), in seconds where that conversion takes most of a minute.

``supported(path)`` says whether a file is one of those. Other tokenizer kinds (SentencePiece
``llama`` of other architectures, ``t5``, ...) stay with transformers' conversion.
"""
from __future__ import annotations

import functools

from rljax.models.gguf_file import GGUFFile

# tokenizer.ggml.pre values (llama.cpp's names) -> how text is split before the merges.
_GPT2 = None   # GPT-2's own split (ByteLevel's built-in regex)
_DIGITS = "digits"   # every digit alone, then GPT-2's split (llama.cpp: "\p{N}" first)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "default": _GPT2, "gpt2": _GPT2, "gpt-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2,
    "smollm": _DIGITS, "starcoder": _DIGITS, "refact": _DIGITS, "command-r": _DIGITS,
    "codeshell": _DIGITS, "exaone": _DIGITS, "minerva-7b": _DIGITS,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
}
CONTROL, USER_DEFINED = 3, 4   # llama.cpp token types


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies spell tokens in
    it: a space is "Ġ")."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def supported(path: str) -> bool:
    """Whether ``build`` handles the file's tokenizer (byte-level BPE with a known split, or
    Gemma's SentencePiece); False for a file this reader cannot parse (the caller's fallback
    reports it)."""
    try:
        f = GGUFFile(path)
    except (ValueError, OSError):
        return False
    return _kind(f) is not None


def _kind(f: GGUFFile) -> str | None:
    """Which builder here takes the file: ``"gpt2"``, ``"gemma"``, or None."""
    from rljax import gguf_spm

    kind = f.value("tokenizer.ggml.model", None)
    if kind == "gpt2" and f.value("tokenizer.ggml.pre", "default") in PRE_TOKENIZERS:
        return "gpt2"
    if kind == "llama" and f.value("general.architecture", None) in gguf_spm.ARCHITECTURES:
        return "gemma"
    return None


def build(path: str):
    """A ``transformers.PreTrainedTokenizerFast`` for the tokenizer in the GGUF file ``path``
    (see the module docstring for the kinds): control tokens as special tokens, user-defined
    ones as added tokens, bos/eos/unk/pad from the file's ids, the chat template, and a BOS
    (EOS) added by ``encode(..., add_special_tokens=True)`` when
    ``tokenizer.ggml.add_bos_token`` (``add_eos_token``)."""
    from rljax import gguf_spm

    f = GGUFFile(path)
    kind = _kind(f)
    if kind is None:
        raise ValueError(
            f"{path}: tokenizer {f.value('tokenizer.ggml.model', None)!r} with pre-tokenizer "
            f"{f.value('tokenizer.ggml.pre', 'default')!r} of architecture "
            f"{f.value('general.architecture', None)!r} is not built here (byte-level BPE with "
            "a known split, or Gemma's SentencePiece, only)")
    tokens = f.value("tokenizer.ggml.tokens")
    if kind == "gemma":
        unk = f.value("tokenizer.ggml.unknown_token_id", None)
        unk = tokens[unk] if unk is not None and 0 <= unk < len(tokens) else gguf_spm.UNK
        tok, vocab = gguf_spm.gemma_model(tokens, unk)
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        add_bos_default = True
        # Gemma's own tokenizer files (and transformers' conversion) name "<mask>" the mask
        # token; no GGUF key holds it.
        extra = {"mask_token": gguf_spm.MASK} if gguf_spm.MASK in vocab else {}
    else:
        tok, vocab = _byte_level_model(f, tokens)
        add_bos_default, extra = False, {}
    return _finish(f, tok, tokens, vocab, add_bos_default, extra)


def _byte_level_model(f: GGUFFile, tokens: list[str]):
    """The byte-level BPE ``tokenizers.Tokenizer`` (no added tokens yet) and its vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = set(bytes_to_unicode().values())
    spell = bytes_to_unicode()
    vocab = {(t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in f.value("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = PRE_TOKENIZERS[f.value("tokenizer.ggml.pre", "default")]
    if split is _DIGITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok, vocab


def _finish(f: GGUFFile, tok, tokens: list[str], vocab: dict[str, int], add_bos_default: bool,
            extra: dict[str, str]):
    """``tok`` with the file's added tokens, special tokens, BOS/EOS rule and chat template, as
    a ``transformers.PreTrainedTokenizerFast``."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    types = f.value("tokenizer.ggml.token_type", None) or [1] * len(tokens)
    byte_level = f.value("tokenizer.ggml.model", None) == "gpt2"
    alphabet = set(bytes_to_unicode().values())
    # Control tokens spelled outside the byte alphabet are llama.cpp mislabels (as
    # transformers' conversion treats them): adding them would grow the vocabulary.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, kind_ in zip(tokens, types)
                            if kind_ == CONTROL and (not byte_level or set(t) <= alphabet)])
    # A user-defined token is matched whole in the raw text, as llama.cpp does; one whose
    # spelling the model respells (Gemma's runs of spaces, "▁▁") is reached by the merges.
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, kind_ in zip(tokens, types) if kind_ == USER_DEFINED and t in vocab])

    ids = {}   # special token -> its id in the file

    def special(key):
        i = f.value(f"tokenizer.ggml.{key}", None)
        if i is None or not 0 <= i < len(tokens):
            return None
        ids[tokens[i]] = int(i)
        return tokens[i]

    bos, eos = special("bos_token_id"), special("eos_token_id")
    first = [bos] if f.value("tokenizer.ggml.add_bos_token", add_bos_default) and bos else []
    last = [eos] if f.value("tokenizer.ggml.add_eos_token", False) and eos else []
    if first or last:
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(first + ["$A"] + last),
            pair=" ".join(first + ["$A"] + last + [f"{t}:1" for t in first] + ["$B:1"]
                          + [f"{t}:1" for t in last]),
            special_tokens=[(t, ids[t]) for t in dict.fromkeys(first + last)])
    names = {"bos_token": bos, "eos_token": eos,
             "unk_token": special("unknown_token_id"), "pad_token": special("padding_token_id")}
    out = PreTrainedTokenizerFast(tokenizer_object=tok, **extra,
                                  **{k: v for k, v in names.items() if v is not None})
    template = f.value("tokenizer.chat_template", None)
    if template:
        out.chat_template = template
    return out
