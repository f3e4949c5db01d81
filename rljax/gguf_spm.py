"""Gemma's SentencePiece tokenizer (``tokenizer.ggml.model == "llama"`` in a gemma, gemma2 or
gemma3 GGUF file) as a ``tokenizers`` BPE model, built from the token list alone.

What the file gives and what the model needs:

* Pieces spell a space as "▁"; the normalizer does the same to the text (every space, and no
  space is prepended: Gemma's ``add_space_prefix`` is false), and nothing splits the text
  before the merges, so a run of spaces can become one piece.
* Runs of two or more spaces are stored as real spaces ("  "), where every other piece spells
  them "▁▁": they are respelled, so the text (already "▁▁" after normalizing) reaches them.
* The file has no merges, and Gemma's ``scores`` do not follow its merge order; the order of
  the tokens does (a piece listed earlier is merged first). The merges are recovered from the
  vocabulary: every split of a token into two pieces that are both tokens, ranked by the
  token's position, then longer left piece first -- the merges, in the same order,
  transformers' GGUF conversion recovers, so the ids are the same.
* Characters no piece covers become their UTF-8 bytes (``<0x41>``: byte fallback); decoding
  turns "▁" back into spaces and those bytes back into characters.
"""
from __future__ import annotations

# general.architecture values whose SentencePiece tokenizer is built here.
ARCHITECTURES = ("gemma", "gemma2", "gemma3")
SPACE = "\u2581"   # "▁", SentencePiece's spelling of a space
MASK, UNK = "<mask>", "<unk>"


def respell(tokens: list[str]) -> list[str]:
    """The tokens as the model looks them up: runs of spaces spelled with "▁"."""
    return [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]


def merges(pieces: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges for SentencePiece ``pieces`` listed best first: for each token in the order
    of its id, its splits (left, right) into two tokens, longer left piece first."""
    out = []
    append = out.append   # a plain loop: ~1.5M splits of Gemma's 262k tokens, in seconds
    for i, piece in enumerate(pieces):
        if len(piece) < 2 or vocab[piece] != i:   # a repeated spelling: ranked where kept
            continue
        for k in range(len(piece) - 1, 0, -1):
            left = piece[:k]
            if left in vocab:
                right = piece[k:]
                if right in vocab:
                    append((left, right))
    if len(vocab) < len(pieces):   # repeated spellings: back into id order (a stable sort)
        out.sort(key=lambda m: vocab[m[0] + m[1]])
    return out


def gemma_model(tokens: list[str], unk: str = UNK):
    """The ``tokenizers.Tokenizer`` (no added tokens yet) for Gemma's ``tokens``, and the
    vocabulary it looks pieces up in ({respelled token: id})."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    pieces = respell(tokens)
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges(pieces, vocab),
                               unk_token=unk if unk in vocab else None, fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    return tok, vocab
