"""Tokenizers behind one small interface.

Three kinds, one shape (see docs/internals.md):

* ``HFTokenizer``: a local Hugging Face tokenizer directory (``tokenizer.json``,
  ``tokenizer_config.json``, chat template), or the tokenizer inside a llama.cpp ``.gguf`` file
  (vocabulary, merges, special ids and chat template from its metadata), loaded through
  ``transformers.AutoTokenizer`` with ``local_files_only=True`` so nothing is ever downloaded.
  ``save(dir)`` writes it as a HF tokenizer directory (e.g. next to an exported model).
* ``SentencePieceTokenizer``: a SentencePiece ``.model`` file.
* ``CharTokenizer``: an offline, deterministic character-level tokenizer for tests and the
  built-in demo; saved and loaded as a small JSON file so a workdir can carry it.

``load(path)`` detects the kind from what is on disk.

Every tokenizer offers ``encode``, ``decode`` (special tokens skipped by default),
``batch_encode`` (left padding for prompts), the special ids and ``vocab_size``, and
``apply_chat_template`` when a chat template is known. ``batch_encode`` never truncates: a text
longer than ``max_length`` is an error, because a silently cut prompt changes the task.
"""
from __future__ import annotations

import json
import os
import string
from typing import Iterable, Sequence

import numpy as np

from rljax import cache_dirs

__all__ = ["Tokenizer", "HFTokenizer", "SentencePieceTokenizer", "CharTokenizer", "load",
           "CHAR_TOKENIZER_FILE"]

# File name a CharTokenizer is saved under when given a directory.
CHAR_TOKENIZER_FILE = "char_tokenizer.json"


class Tokenizer:
    """Base class: subclasses provide ``encode``/``decode`` and the special ids.

    ``bos_id`` may be ``None`` for tokenizers that have no BOS token (e.g. Qwen); ``add_bos``
    is then a no-op. ``pad_id`` is always an int (tokenizers without a pad token pad with EOS;
    the mask, not the id, tells padding apart).
    """

    bos_id: int | None
    eos_id: int
    pad_id: int
    vocab_size: int

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        raise NotImplementedError

    @property
    def has_chat_template(self) -> bool:
        return False

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        raise ValueError(f"{type(self).__name__} has no chat template; use a plain prompt template")

    def batch_encode(self, texts: Sequence[str], max_length: int | None = None,
                     left_pad: bool = True, add_bos: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Encodes and pads ``texts`` to ``[B, L]``.

        Returns ``(tokens int32[B, L], mask bool[B, L])`` with True on real tokens. ``L`` is
        ``max_length`` when given (a fixed bucket, so shapes stay static), else the longest text.
        Left padding is the default because prompts are continued on the right by the sampler.
        Raises ValueError if any text is longer than ``max_length`` (never truncates).
        """
        encoded = [self.encode(t, add_bos=add_bos) for t in texts]
        longest = max((len(e) for e in encoded), default=0)
        length = longest if max_length is None else int(max_length)
        for i, e in enumerate(encoded):
            if len(e) > length:
                raise ValueError(f"text {i} has {len(e)} tokens, more than max_length={length}: "
                                 f"{texts[i][:60]!r}...")
        tokens = np.full((len(texts), length), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(texts), length), dtype=bool)
        for i, e in enumerate(encoded):
            if not e:
                continue
            sl = slice(length - len(e), length) if left_pad else slice(0, len(e))
            tokens[i, sl] = e
            mask[i, sl] = True
        return tokens, mask

    def batch_decode(self, ids: np.ndarray, mask: np.ndarray | None = None,
                     skip_special: bool = True) -> list[str]:
        """Decodes rows of ``ids``; positions where ``mask`` is False are dropped first."""
        ids = np.asarray(ids)
        rows = []
        for i in range(ids.shape[0]):
            row = ids[i] if mask is None else ids[i][np.asarray(mask[i], dtype=bool)]
            rows.append(self.decode(row.tolist(), skip_special=skip_special))
        return rows


class HFTokenizer(Tokenizer):
    """A local Hugging Face tokenizer directory or GGUF file, via ``transformers.AutoTokenizer``."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer  # heavy import, only when used

        self.path = path
        if _is_gguf(path):
            self._tok = _gguf_tokenizer(path)
        else:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        tok = self._tok
        self.bos_id = tok.bos_token_id
        eos = tok.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer at {path!r} has no eos token; set eos_token in tokenizer_config.json")
        self.eos_id = int(eos)
        self.pad_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(tok)  # includes added tokens, unlike tok.vocab_size

    @property
    def hf_tokenizer(self):
        """The wrapped ``transformers`` tokenizer, for callers that need more."""
        return self._tok

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        # add_special_tokens=False: templates already contain whatever specials the model wants.
        ids = list(self._tok.encode(text, add_special_tokens=False))
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        if not self.has_chat_template:
            super().apply_chat_template(messages, add_generation_prompt)
        from rljax import chat_limits  # a template is code: bound what it may render

        if getattr(self, "_checked_template", None) is not self._tok.chat_template:
            chat_limits.check_chat_template(self._tok.chat_template,
                                            self._tok.special_tokens_map)
            self._checked_template = self._tok.chat_template
        return chat_limits.check_rendered(self._tok.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt))

    def save(self, out_dir: str) -> list[str]:
        """Writes the tokenizer's files into ``out_dir`` (``tokenizer.json``,
        ``tokenizer_config.json`` with the special tokens and the chat template) so that
        ``AutoTokenizer.from_pretrained(out_dir)`` and :func:`load` give the same ids and
        template, e.g. next to ``models.save_hf``'s files (export); returns the files."""
        os.makedirs(out_dir, exist_ok=True)
        return _write_hf_files(self._tok, out_dir)


GGUF_CONVERTER = "rljax.gguf_tokenizer 2"  # in the cache key: a new converter converts again


def _gguf_tokenizer(path: str):
    """The ``transformers`` tokenizer of a GGUF file, converted once per file and kept in
    ``cache_dirs.root()/tokenizers``. ``_convert_gguf`` builds it (vocabulary, merges, special
    tokens, chat template) from the GGUF metadata in Python: ~4 s for SmolLM2's 49,152 tokens,
    paid by every process and twice per ``train`` (its pre-flight check and its setup); the
    saved HF files load in ~0.2 s. The entry is keyed by the file (path, size, mtime) and the
    transformers, tokenizers and converter versions, so an edited file or a new converter
    converts again;
    an unreadable or unwritable cache (or one on a URL) falls back to converting."""
    from transformers import AutoTokenizer

    entry = _gguf_cache_entry(path)
    if "://" in entry:   # a cache root on a URL ($RLJAX_CACHE_DIR=gs://...): convert each time
        entry = None
    elif os.path.isfile(os.path.join(entry, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(entry, local_files_only=True)
        except Exception:  # noqa: BLE001 -- any damage: convert again, replace it below
            pass
    tok = _convert_gguf(path)
    if entry:
        _save_cache_entry(tok, entry)
    return tok


def _convert_gguf(path: str):
    """The GGUF file's tokenizer as a ``transformers`` tokenizer: built from the file's own
    metadata with ``tokenizers`` (``rljax.gguf_tokenizer``: byte-level BPE, as in SmolLM2,
    Qwen and Llama 3, and Gemma's SentencePiece; no PyTorch needed), else by transformers'
    GGUF conversion (other tokenizer kinds; transformers' GGUF reader needs PyTorch)."""
    from rljax import gguf_tokenizer

    if gguf_tokenizer.supported(path):
        return gguf_tokenizer.build(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                             gguf_file=os.path.basename(path),
                                             local_files_only=True)
    except ImportError as e:  # transformers' GGUF reader: "Please install torch and gguf ..."
        raise ValueError(f"the tokenizer of {os.path.basename(path)} is neither byte-level "
                         "BPE nor Gemma's SentencePiece, and transformers' GGUF conversion of "
                         f"it needs PyTorch ({e}); "
                         "install torch, or pass tokenizer.path=<an HF tokenizer directory>"
                         ) from None


def _gguf_cache_entry(path: str) -> str:
    import hashlib

    import tokenizers as hf_tokenizers
    import transformers

    path = os.path.abspath(path)
    st = os.stat(path)
    key = json.dumps([path, st.st_size, st.st_mtime_ns, transformers.__version__,
                      hf_tokenizers.__version__, GGUF_CONVERTER])
    return os.path.join(cache_dirs.root(), "tokenizers",
                        hashlib.sha256(key.encode()).hexdigest()[:24])


def _save_cache_entry(tok, entry: str) -> None:
    """Writes ``tok`` as HF files to ``entry`` atomically (a temporary folder renamed into
    place: hosts of a multi-host run may convert the same file at once); gives up silently
    when the cache cannot be written."""
    import shutil
    import tempfile

    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(entry) + ".", dir=os.path.dirname(entry))
    except OSError:
        return
    try:
        _write_hf_files(tok, tmp)
        if os.path.isdir(entry):   # a damaged entry (a complete one was loaded, not replaced)
            shutil.rmtree(entry, ignore_errors=True)
        os.rename(tmp, entry)
    except Exception:  # noqa: BLE001 -- a cache write never fails the load it follows
        pass   # e.g. another process renamed its copy first, or the disk is full / read-only
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_hf_files(tok, out_dir: str) -> list[str]:
    """``tok`` (a ``transformers`` tokenizer) as ``tokenizer.json`` + ``tokenizer_config.json``
    (special tokens and chat template) in ``out_dir``; returns the files."""
    # save_jinja_files=False: the template goes into tokenizer_config.json, where every
    # transformers version (and other HF-format readers) looks for it.
    files = [os.fspath(f) for f in tok.save_pretrained(out_dir, save_jinja_files=False)]
    config_file = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    # transformers 5 names its fast tokenizer "TokenizersBackend", a class transformers 4
    # does not have; "PreTrainedTokenizerFast" is the same class in 5 and exists in 4.
    # local_files_only/is_local describe how *this* copy was loaded, not the tokenizer.
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("local_files_only", "is_local"):
        config.pop(key, None)
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return files


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file. SentencePiece models carry no chat template."""

    def __init__(self, path: str):
        import sentencepiece as spm

        self.path = path
        self._sp = spm.SentencePieceProcessor(model_file=path)
        sp = self._sp
        self.bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
        if sp.eos_id() < 0:
            raise ValueError(f"SentencePiece model {path!r} has no eos piece")
        self.eos_id = sp.eos_id()
        # SentencePiece disables pad by default (id -1); pad with EOS then.
        self.pad_id = sp.pad_id() if sp.pad_id() >= 0 else self.eos_id
        self.vocab_size = sp.get_piece_size()

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(self._sp.encode(text))
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special:
            special = {self.bos_id, self.eos_id, self.pad_id}
            ids = [i for i in ids if i not in special and not self._sp.is_control(i)]
        return self._sp.decode(ids)


# Default CharTokenizer alphabet: enough for arithmetic, countdown and short English prompts.
DEFAULT_ALPHABET = (string.digits + "+-*/=()<>^%.,:;!?'\"#$&_[]{}|\\~@`" + string.ascii_letters
                    + " \n")
CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


class CharTokenizer(Tokenizer):
    """Character-level tokenizer: ids 0..3 are pad, bos, eos, unk; then one id per character.

    Deterministic and offline. Characters outside the alphabet map to ``<unk>`` (and decode to
    nothing), so an odd character in a prompt cannot crash training. ``apply_chat_template`` uses
    a tiny fixed template ("User: ...\\nAssistant: ...") so chat configs also run in the demo.
    """

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("CharTokenizer alphabet has repeated characters")
        self.alphabet = alphabet
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = 0, 1, 2, 3
        self._offset = len(CHAR_SPECIALS)
        self._to_id = {c: i + self._offset for i, c in enumerate(alphabet)}
        self.vocab_size = self._offset + len(alphabet)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [self._to_id.get(c, self.unk_id) for c in text]
        return [self.bos_id] + ids if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i >= self._offset and i < self.vocab_size:
                out.append(self.alphabet[i - self._offset])
            elif not skip_special and 0 <= i < self._offset:
                out.append(CHAR_SPECIALS[i])
        return "".join(out)

    @property
    def has_chat_template(self) -> bool:
        return True

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        names = {"system": "System", "user": "User", "assistant": "Assistant"}
        text = "".join(f"{names.get(m['role'], m['role'])}: {m['content']}\n" for m in messages)
        return text + ("Assistant: " if add_generation_prompt else "")

    def save(self, path: str) -> str:
        """Writes JSON to ``path`` (or ``path/char_tokenizer.json`` for a directory); returns the file.

        ``path`` may be a URL (``gs://...``, written through ``etils.epath``); a URL not ending in
        ``.json`` is taken as a directory."""
        path = os.fspath(path)
        text = json.dumps({"kind": "char", "specials": list(CHAR_SPECIALS), "alphabet": self.alphabet})
        if _is_url(path):
            from etils import epath  # local: only URL paths need it

            if not path.endswith(".json"):  # a directory (object stores may not list empty ones)
                path = path.rstrip("/") + "/" + CHAR_TOKENIZER_FILE
            epath.Path(path).write_text(text, encoding="utf-8")  # one object write: atomic
            return path
        if os.path.isdir(path):
            path = os.path.join(path, CHAR_TOKENIZER_FILE)
        # Atomic (tmp + rename): several hosts of a multi-host run may save the same file while
        # another reads it.
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str) -> "CharTokenizer":
        """Reads a file written by :meth:`save` (a directory holding one, or a URL)."""
        path = os.fspath(path)
        if _is_url(path):
            from etils import epath  # local: only URL paths need it

            if not path.endswith(".json"):  # a directory (object stores may not list empty ones)
                path = path.rstrip("/") + "/" + CHAR_TOKENIZER_FILE
            spec = json.loads(epath.Path(path).read_text(encoding="utf-8"))
        else:
            if os.path.isdir(path):
                path = os.path.join(path, CHAR_TOKENIZER_FILE)
            with open(path, encoding="utf-8") as f:
                spec = json.load(f)
        if spec.get("kind") != "char" or tuple(spec.get("specials", ())) != CHAR_SPECIALS:
            raise ValueError(f"{path!r} is not a CharTokenizer file")
        return cls(spec["alphabet"])


def _is_url(path: str) -> bool:
    """``scheme://...`` (gs://, s3://, ...): read and written through ``etils.epath``."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.isidentifier() and len(scheme) > 1


def _is_gguf(path: str) -> bool:
    """A llama.cpp GGUF model file (its metadata carries the tokenizer)."""
    return os.fspath(path).lower().endswith(".gguf") and os.path.isfile(path)


def _is_char_json(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f).get("kind") == "char"
    except (OSError, ValueError, AttributeError):
        return False


def load(path: str) -> Tokenizer:
    """Loads a tokenizer, detecting its kind from the path.

    * a directory with ``char_tokenizer.json`` or a JSON file with ``"kind": "char"`` -> CharTokenizer
    * a directory with ``tokenizer.json`` / ``tokenizer_config.json`` -> HFTokenizer
    * a ``.model`` file (or a directory holding ``tokenizer.model`` only) -> SentencePieceTokenizer
    * a ``.gguf`` file -> HFTokenizer built from its metadata
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path does not exist: {path!r}")
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if CHAR_TOKENIZER_FILE in names:
            return CharTokenizer.load(path)
        if names & {"tokenizer.json", "tokenizer_config.json"}:
            return HFTokenizer(path)
        if "tokenizer.model" in names:
            return SentencePieceTokenizer(os.path.join(path, "tokenizer.model"))
        raise ValueError(f"no tokenizer found in directory {path!r}: expected tokenizer.json, "
                         f"tokenizer_config.json, tokenizer.model or {CHAR_TOKENIZER_FILE}")
    if path.endswith(".json") and _is_char_json(path):
        return CharTokenizer.load(path)
    if path.endswith(".model"):
        return SentencePieceTokenizer(path)
    if _is_gguf(path):
        return HFTokenizer(path)
    raise ValueError(f"unrecognised tokenizer file {path!r}: expected an HF tokenizer directory, "
                     f"a SentencePiece .model file, a .gguf file or a CharTokenizer JSON")
