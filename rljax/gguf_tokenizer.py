"""The tokenizer a GGUF file describes, built from its own metadata with ``tokenizers``.

llama.cpp stores the tokenizer as metadata: ``tokenizer.ggml.model`` (``gpt2``: byte-level
BPE, as in SmolLM2, Qwen2/3 and Llama 3), ``tokens``, ``merges``, ``token_type`` (3 = control,
4 = user-defined), the special token ids, ``pre`` (the pre-tokenizer: how text is split before
the merges) and ``tokenizer.chat_template``. ``build(path)`` turns that into a
``transformers.PreTrainedTokenizerFast`` without transformers' GGUF loader, which needs PyTorch
for its checkpoint reader. The result gives the same ids as transformers' conversion
(compared on SmolLM2: ``tests/test_real_model.py``).

Byte-level BPE only; ``supported(path)`` says whether a file is one of those. Other tokenizer
kinds (SentencePiece ``llama``, ``t5``, ...) stay with transformers' conversion.
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
    """Whether ``build`` handles the file's tokenizer (byte-level BPE with a known split);
    False for a file this reader cannot parse (the caller's fallback reports it)."""
    try:
        f = GGUFFile(path)
    except (ValueError, OSError):
        return False
    return (f.value("tokenizer.ggml.model", None) == "gpt2"
            and f.value("tokenizer.ggml.pre", "default") in PRE_TOKENIZERS)


def build(path: str):
    """A ``transformers.PreTrainedTokenizerFast`` for the byte-level BPE tokenizer in the GGUF
    file ``path``: vocabulary and merges, control tokens as special tokens, user-defined ones
    as added tokens, bos/eos/unk/pad from the file's ids, the chat template, and a BOS added
    by ``encode(..., add_special_tokens=True)`` when ``tokenizer.ggml.add_bos_token``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    f = GGUFFile(path)
    kind, pre = f.value("tokenizer.ggml.model", None), f.value("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not built "
                         "here (byte-level BPE with a known split only)")
    tokens = f.value("tokenizer.ggml.tokens")
    types = f.value("tokenizer.ggml.token_type", None) or [1] * len(tokens)
    alphabet = set(bytes_to_unicode().values())
    spell = bytes_to_unicode()
    vocab = {(t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in f.value("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = PRE_TOKENIZERS[pre]
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
    # Control tokens spelled outside the byte alphabet are llama.cpp mislabels (as
    # transformers' conversion treats them): adding them would grow the vocabulary.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, kind_ in zip(tokens, types)
                            if kind_ == CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, kind_ in zip(tokens, types) if kind_ == USER_DEFINED and t in vocab])

    def special(key):
        i = f.value(f"tokenizer.ggml.{key}", None)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = special("bos_token_id")
    if f.value("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, int(f.value("tokenizer.ggml.bos_token_id")))])
    names = {"bos_token": bos, "eos_token": special("eos_token_id"),
             "unk_token": special("unknown_token_id"), "pad_token": special("padding_token_id")}
    out = PreTrainedTokenizerFast(tokenizer_object=tok,
                                  **{k: v for k, v in names.items() if v is not None})
    template = f.value("tokenizer.chat_template", None)
    if template:
        out.chat_template = template
    return out
