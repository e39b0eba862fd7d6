"""Character tokenizer for CTC (and attention) models, stored as a plain, diffable file.

Id 0 is always the CTC blank (``<blank>``): ``torch.nn.CTCLoss(blank=0)`` is the default, and
keeping it fixed means a model's output layer and its tokenizer file can never disagree about
it. If an unknown-character token is configured it takes id 1; the characters follow in sorted
order, so building twice from the same text gives the same ids.

Text is Unicode-NFC normalised before building and encoding: "é" typed as one code point and
as "e" + combining accent are the same letter to a reader and must be the same token.

File formats (chosen by extension): ``.json`` (``{"type": "char", "blank": ..., "unk": ...,
"vocab": [...]}``) or any other extension as text, one token per line in id order, with the
space written as ``<space>`` so trailing-whitespace editors cannot corrupt it.
"""

from __future__ import annotations

import json
import os
import unicodedata
from typing import Iterable, Mapping, Optional, Sequence, Union

from ddptrain.data.errors import DataError
from ddptrain.data.manifest import parse_manifest, split_paths

BLANK = "<blank>"
SPACE = "<space>"  # how " " is written in the .txt format


class TokenizerError(DataError):
    """Text with characters the tokenizer does not know (and no unknown token configured)."""


class CharTokenizer:
    """Maps text to character ids and back; id 0 is the CTC blank.

    Args:
        vocab: tokens in id order; ``vocab[0]`` must be ``"<blank>"``.
        unk_token: token that unknown characters map to (must be in ``vocab``); ``None`` makes
            an unknown character a :class:`TokenizerError`.
    """

    blank_id = 0

    def __init__(self, vocab: Sequence[str], unk_token: Optional[str] = None):
        if not vocab or vocab[0] != BLANK:
            raise ValueError(f"vocab[0] must be {BLANK!r} (the CTC blank), got {vocab[:1]}")
        if len(set(vocab)) != len(vocab):
            raise ValueError("vocab has duplicate tokens")
        if unk_token and unk_token not in vocab:
            raise ValueError(f"unk_token {unk_token!r} is not in the vocabulary")
        self.vocab = list(vocab)
        self.unk_token = unk_token or None
        self._ids = {t: i for i, t in enumerate(self.vocab)}
        self.unk_id = self._ids[unk_token] if unk_token else None

    # ------------------------------------------------------------------ building and files
    @classmethod
    def build(cls, texts_or_manifest: Union[str, os.PathLike, Iterable], unk_token: Optional[str] = None,
              fields: Optional[Mapping[str, str]] = None) -> "CharTokenizer":
        """Build from texts, manifest entries, or a manifest path (comma-separated paths too).

        Args:
            texts_or_manifest: iterable of strings or of ``ManifestEntry``, or manifest path(s).
            unk_token: add this token (id 1) and map unknown characters to it.
            fields: ``data.fields``, for a manifest path (keys of other names: manifest.py).
        """
        if isinstance(texts_or_manifest, (str, os.PathLike)):
            # bad lines are the validator's business (and may be skipped); the texts are what count
            # here, so no audio header is read for a line without duration
            texts: Iterable = (e.text for p in split_paths(texts_or_manifest)
                               for e in parse_manifest(p, fields, read_durations=False)[0])
        else:
            texts = (t if isinstance(t, str) else t.text for t in texts_or_manifest)
        chars: set[str] = set()
        for t in texts:
            chars.update(_normalize(t))
        specials = [BLANK] + ([unk_token] if unk_token else [])
        return cls(specials + sorted(chars - set(specials)), unk_token)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the vocabulary (``.json``, or one token per line for any other extension)."""
        path = os.fspath(path)
        if path.endswith(".json"):
            text = json.dumps({"type": "char", "version": 1, "blank": BLANK, "unk": self.unk_token,
                               "vocab": self.vocab}, ensure_ascii=False, indent=1) + "\n"
        else:
            for t in self.vocab:
                if t == SPACE or "\n" in t or "\r" in t or (t != " " and t != t.strip()):
                    raise ValueError(f"token {t!r} cannot be stored in the text format; use .json")
            lines = [SPACE if t == " " else t for t in self.vocab]
            header = f"#unk {self.unk_token}\n" if self.unk_token else ""
            text = header + "\n".join(lines) + "\n"
        tmp = path + ".tmp"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)  # never leave a half-written vocabulary behind

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "CharTokenizer":
        """Read a file written by :meth:`save`.

        Raises:
            DataError: missing or malformed file (named in the message).
        """
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                raw = f.read()
        except OSError as e:
            raise DataError(f"cannot read tokenizer file {path}: {e}") from None
        try:
            if path.endswith(".json"):
                obj = json.loads(raw)
                if obj.get("type") != "char":
                    raise ValueError(f"type is {obj.get('type')!r}, expected 'char'")
                return cls(obj["vocab"], obj.get("unk"))
            lines = raw.split("\n")
            unk = None
            if lines and lines[0].startswith("#unk "):
                unk = lines.pop(0)[len("#unk "):]
            if lines and lines[-1] == "":
                lines.pop()
            return cls([" " if t == SPACE else t for t in lines], unk)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(f"malformed tokenizer file {path}: {e}") from None

    # ------------------------------------------------------------------ use
    @property
    def vocab_size(self) -> int:
        """Number of ids including the blank: the size of a CTC model's output layer."""
        return len(self.vocab)

    def unknown_chars(self, text: str) -> list[str]:
        """Characters of ``text`` that are not in the vocabulary (sorted, unique)."""
        return sorted({c for c in _normalize(text) if c not in self._ids})

    def encode(self, text: str) -> list[int]:
        """Text -> ids (never contains the blank).

        Raises:
            TokenizerError: an unknown character and no ``unk_token``; the message names the
                characters (with code points, since many look alike) and the text.
        """
        text = _normalize(text)
        ids = self._ids
        try:
            return [ids[c] for c in text]
        except KeyError:
            if self.unk_id is not None:
                return [ids.get(c, self.unk_id) for c in text]
            bad = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in self.unknown_chars(text))
            snippet = text if len(text) <= 80 else text[:77] + "..."
            raise TokenizerError(f"unknown character(s) {bad} in text {snippet!r}; rebuild the "
                                 f"tokenizer or set data.unk_token") from None

    def decode(self, ids: Iterable[int], ctc: bool = False) -> str:
        """Ids -> text; blanks are dropped.

        Args:
            ids: token ids (a list or a 1-D tensor).
            ctc: treat ``ids`` as frame-wise CTC argmax output: merge repeats first, then drop
                blanks (so ``a a <blank> a`` is ``aa``).
        """
        out, prev = [], None
        for i in (int(x) for x in ids):
            if ctc and i == prev:
                continue
            prev = i
            if i != self.blank_id:
                out.append(self.vocab[i])
        return "".join(out)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, unk_token={self.unk_token!r})"


def _normalize(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def load_or_build_tokenizer(cfg) -> CharTokenizer:
    """The tokenizer a run uses: ``cfg.tokenizer`` if that file exists, else built from
    ``cfg.train_manifest`` (with ``cfg.unk_token``) and, when ``cfg.tokenizer`` names a path,
    saved there so evaluation and later runs use the very same ids.

    Args:
        cfg: a ``DataConfig``.
    """
    if cfg.tokenizer and os.path.exists(cfg.tokenizer):
        tok = CharTokenizer.load(cfg.tokenizer)
        if cfg.unk_token and tok.unk_token != cfg.unk_token:
            raise DataError(f"{cfg.tokenizer} has unk token {tok.unk_token!r} but data.unk_token is "
                            f"{cfg.unk_token!r}; rebuild the tokenizer or fix the config")
        return tok
    if not cfg.train_manifest:
        raise DataError("no tokenizer: set data.tokenizer to a file or data.train_manifest to build one")
    tok = CharTokenizer.build(cfg.train_manifest, unk_token=cfg.unk_token or None, fields=cfg.fields)
    if cfg.tokenizer:
        tok.save(cfg.tokenizer)
    return tok
