"""The caption tokenizer: a thin wrapper over a ``tokenizers.Tokenizer``.

Why a wrapper: the captioning head needs exactly four things from a tokenizer (ids for text, text
for ids, and the pad/bos/eos ids), whether the tokenizer was trained here on the training captions
(a small word-level vocabulary, the default) or is a local GPT-2 style directory from HuggingFace.
Hiding the special-token naming differences here keeps the model and trainer independent of them.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from mtl.errors import DataError
from mtl.files import write_atomic

PAD, BOS, EOS, UNK = "[PAD]", "[BOS]", "[EOS]", "[UNK]"
SPECIALS = [PAD, BOS, EOS, UNK]  # in this order, so [PAD] is id 0

# Names other tokenizers use for the same roles; the first one present wins.
_CANDIDATES = {
    "pad": [PAD, "<pad>", "<|pad|>", "<|padding|>"],
    "bos": [BOS, "<s>", "<bos>", "<|startoftext|>", "<|begin_of_text|>", "[CLS]", "<|endoftext|>"],
    "eos": [EOS, "</s>", "<eos>", "<|endoftext|>", "<|end_of_text|>", "[SEP]"],
    "unk": [UNK, "<unk>", "<|unk|>"],
}

FILE_NAME = "tokenizer.json"


def _configured_names(directory: str) -> dict:
    """Special-token names from a HuggingFace ``tokenizer_config.json``, if there is one."""
    out = {}
    path = os.path.join(directory, "tokenizer_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            conf = json.load(f)
    except (OSError, ValueError):
        return out
    for role in _CANDIDATES:
        value = conf.get(f"{role}_token") if isinstance(conf, dict) else None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[role] = value
    return out


class CaptionTokenizer:
    """Text <-> ids for captions, with the special ids the captioning head needs."""

    def __init__(self, tokenizer: Tokenizer, names: dict | None = None, source: str = "<memory>"):
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tok = tokenizer
        ids = {}
        for role, candidates in _CANDIDATES.items():
            for name in ([names[role]] if names and role in names else []) + candidates:
                tid = tokenizer.token_to_id(name)
                if tid is not None:
                    ids[role] = tid
                    break
        # GPT-2 style: one <|endoftext|> serves as BOS and EOS; no pad token: pad with EOS
        ids.setdefault("bos", ids.get("eos"))
        ids.setdefault("eos", ids.get("bos"))
        if ids["bos"] is None:
            raise DataError(
                f"tokenizer {source}: no BOS or EOS token found (looked for {', '.join(_CANDIDATES['eos'])}) "
                "— use a tokenizer with one, or set tokenizer.path=null to train one on the captions"
            )
        ids.setdefault("pad", ids["eos"])
        self.pad_id: int = ids["pad"]
        self.bos_id: int = ids["bos"]
        self.eos_id: int = ids["eos"]
        self.unk_id: int | None = ids.get("unk")  # byte-level BPE has none: nothing is unknown
        self._word_level = isinstance(tokenizer.model, models.WordLevel)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """{token: id}, the special tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def kind(self) -> str:
        """The tokenizers model: WordLevel (trained here), BPE, WordPiece, Unigram."""
        return type(self._tok.model).__name__

    @property
    def can_grow(self) -> bool:
        """Whether ``with_words`` can add words: a word-level vocabulary can (a word is one id)."""
        return self._word_level

    def unknown_tokens(self, texts: Iterable[str]) -> tuple[int, int]:
        """(how many of the tokens of ``texts`` are the unknown token, how many tokens there are)."""
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        total = sum(len(e.ids) for e in encodings)
        return (0 if self.unk_id is None else sum(e.ids.count(self.unk_id) for e in encodings)), total

    def unknown_words(self, texts: Iterable[str]) -> Counter:
        """{a piece of text this tokenizer encodes as its unknown token (normalized, as the vocabulary keeps it):
        how often}, over ``texts``."""
        found: Counter = Counter()
        if self.unk_id is None:  # byte-level BPE: every text encodes
            return found
        texts = list(texts)
        norm = self._tok.normalizer
        for text, enc in zip(texts, self._tok.encode_batch(texts, add_special_tokens=False)):
            for tid, (start, end) in zip(enc.ids, enc.offsets):
                if tid == self.unk_id:
                    piece = text[start:end]
                    found[norm.normalize_str(piece) if norm is not None else piece] += 1
        return found

    def with_words(self, words: Iterable[str]) -> CaptionTokenizer:
        """A copy that also knows ``words`` (word-level only): each new word gets the next free id, in the given
        order, so every token keeps its id (the embedding rows of a model trained with this tokenizer stay right)."""
        if not self._word_level:
            raise DataError(f"a {self.kind} tokenizer cannot be extended with new words here")
        data = json.loads(self._tok.to_str())
        vocab = data["model"]["vocab"]
        next_id = max(self.vocab().values(), default=-1) + 1
        for word in words:
            if word not in vocab:
                vocab[word] = next_id
                next_id += 1
        return CaptionTokenizer(Tokenizer.from_str(json.dumps(data)))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without any special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are dropped and words joined by single spaces."""
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=True)
        return " ".join(text.split())

    def normalize(self, text: str) -> str:
        """What ``decode(encode(text))`` gives when every word is known (for comparing captions)."""
        norm = self._tok.normalizer
        text = norm.normalize_str(text) if norm is not None else text
        pre = self._tok.pre_tokenizer
        if self._word_level and pre is not None:
            return " ".join(word for word, _ in pre.pre_tokenize_str(text))
        return " ".join(text.split())

    def save(self, directory: str) -> str:
        """Write ``directory/tokenizer.json`` atomically: a reader sees the old file or the whole new one."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, FILE_NAME)
        write_atomic(path, self._tok.to_str().encode("utf-8"))
        return path

    @classmethod
    def load(cls, directory: str) -> CaptionTokenizer:
        path = os.path.join(directory, FILE_NAME)
        if not os.path.isfile(path):
            raise DataError(
                f"tokenizer file {path!r} not found — point tokenizer.path at a directory holding "
                f"{FILE_NAME}, or set tokenizer.path=null to train one on the captions"
            )
        try:
            tok = Tokenizer.from_file(path)
        except Exception as e:  # the tokenizers library raises a bare Exception for bad files
            raise DataError(f"tokenizer file {path!r} is not a valid tokenizers JSON file: {e}") from None
        return cls(tok, _configured_names(directory), source=repr(path))


def train_tokenizer(captions: Iterable[str], vocab_size: int) -> CaptionTokenizer:
    """A word-level tokenizer (lower case; words and punctuation marks are tokens) on ``captions``.

    Word-level, not BPE: captions use a small closed vocabulary, and whole words make the
    generated text and its metrics easy to read. Words beyond ``vocab_size`` become [UNK].
    """
    if vocab_size < len(SPECIALS) + 1:
        raise DataError(f"tokenizer.vocab_size={vocab_size}: must be at least {len(SPECIALS) + 1}")
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # show_progress=False: the library's own bar ("Pre-processing sequences") would break into the run's console
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIALS,
                                        show_progress=False)
    tok.train_from_iterator(iter(captions), trainer=trainer)
    # no captions at all (an ImageFolder without captions.jsonl): the special tokens only. No task that reads
    # captions can be configured then (the run refuses it first, naming the task and the fix).
    return CaptionTokenizer(tok)


def extend_to_texts(tokenizer: CaptionTokenizer, texts: list[str], what: str) -> tuple[CaptionTokenizer, list[str]]:
    """(a tokenizer that knows every word of ``texts``, the words it added). A word-level tokenizer grows: the
    unknown words are appended after its last id (most frequent first, then alphabetically), every old id keeping
    its token, as transformers' ``add_tokens`` does. A tokenizer that cannot grow and meets unknown words is
    refused (DataError naming ``what``, the count and the fix): they would train as the unknown token."""
    unknown = tokenizer.unknown_words(texts)
    if not unknown:
        return tokenizer, []
    words = sorted(unknown, key=lambda w: (-unknown[w], w))
    if tokenizer.can_grow:
        return tokenizer.with_words(words), words
    unk, total = tokenizer.unknown_tokens(texts)
    shown = ", ".join(repr(w) for w in words[:5]) + (", ..." if len(words) > 5 else "")
    raise DataError(f"{what}: {len(words)} word(s) of the training captions are unknown to its {tokenizer.kind} "
                    f"tokenizer ({shown}; {unk} of {total} tokens), and a {tokenizer.kind} tokenizer cannot be "
                    "extended here, so they would train as its unknown token. Train without init_from (a word-level "
                    "tokenizer is then trained on these captions), or set tokenizer.path to a tokenizer that has "
                    "these words and fits the model's vocabulary")


def unknown_share_text(tokenizer: CaptionTokenizer, splits: dict[str, list[str]]) -> str:
    """The data summary's words on unknown tokens: per split, the share of its captions' tokens that are unknown."""
    if tokenizer.unk_id is None:
        return f"no unknown token ({tokenizer.kind}: every text encodes)"
    parts = []
    for split, texts in splits.items():
        unk, total = tokenizer.unknown_tokens(texts)
        parts.append(f"{split} {unk / max(total, 1):.2%} ({unk} of {total})")
    return "unknown tokens " + ", ".join(parts)
