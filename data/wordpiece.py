"""BERT's WordPiece tokenizer over an HF / TF1 `vocab.txt`, with data.tokenizer's interface.

For checkpoints imported from elsewhere (realformer/interop.py), whose embeddings are indexed
by their own vocabulary. `data.tokenizer.Tokenizer.load('.../vocab.txt')` dispatches here.

The algorithm is BERT's (google-research/bert tokenization.py), which HF's BertTokenizer
reproduces:
  1. basic tokenization: drop NUL, U+FFFD and control characters, turn whitespace into
     spaces, put spaces around CJK ideographs, split on whitespace; when uncased, lower-case
     and strip accents (NFD, drop combining marks); split off every punctuation character
     (ASCII symbols count as punctuation, as in BERT);
  2. WordPiece: greedy longest-match-first over the vocabulary, continuation pieces carry a
     '##' prefix; a word longer than 100 characters, or one that cannot be covered, is a
     single [UNK].
Special tokens are looked up by their strings ([PAD], [UNK], [CLS], [SEP], [MASK]); their ids
differ from the sentencepiece vocabularies trained here (e.g. [PAD]=0, [UNK]=100, [CLS]=101 in
Google's uncased vocabulary). Text is never parsed for special-token strings: "[MASK]" in a
sentence is punctuation and letters, as in BERT (HF's tokenizer instead keeps such a string
as its special token). Lower-casing is letter by letter, as in HF's BertTokenizer (Rust): a
word-final capital sigma becomes 'σ', where Python's str.lower() in google-research/bert
gives 'ς'.
"""

import json
import os
import unicodedata
from typing import Dict, List, Optional, Sequence

import numpy as np

SPECIAL_TOKENS = {'pad': '[PAD]', 'unk': '[UNK]', 'cls': '[CLS]', 'sep': '[SEP]',
                  'mask': '[MASK]'}
MAX_CHARS_PER_WORD = 100
CONTINUATION = '##'
TOKENIZER_CONFIG = 'tokenizer_config.json'  # HF's file; only its do_lower_case is read


def _is_whitespace(ch: str) -> bool:
  return ch in ' \t\n\r' or unicodedata.category(ch) == 'Zs'


def _is_control(ch: str) -> bool:
  if ch in '\t\n\r':
    return False
  return unicodedata.category(ch).startswith('C')


def _is_punctuation(ch: str) -> bool:
  """BERT's definition: every non-alphanumeric ASCII symbol, plus Unicode P* categories."""
  cp = ord(ch)
  if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
    return True
  return unicodedata.category(ch).startswith('P')


# The CJK Unified Ideographs blocks (not Hangul, Hiragana or Katakana, which BERT keeps
# inside words).
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
               (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _is_cjk(ch: str) -> bool:
  cp = ord(ch)
  return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


def _clean(text: str) -> str:
  out = []
  for ch in text:
    if ch in '\x00\ufffd' or _is_control(ch):
      continue
    out.append(' ' if _is_whitespace(ch) else (f' {ch} ' if _is_cjk(ch) else ch))
  return ''.join(out)


def _strip_accents(text: str) -> str:
  return ''.join(ch for ch in unicodedata.normalize('NFD', text)
                 if unicodedata.category(ch) != 'Mn')


def _lower(word: str) -> str:
  """Letter by letter (no final-sigma rule), like HF's Rust BertTokenizer."""
  return ''.join(ch.lower() for ch in word)


def _split_punctuation(word: str) -> List[str]:
  pieces, current = [], []
  for ch in word:
    if _is_punctuation(ch):
      if current:
        pieces.append(''.join(current))
        current = []
      pieces.append(ch)
    else:
      current.append(ch)
  if current:
    pieces.append(''.join(current))
  return pieces


def basic_tokenize(text: str, do_lower_case: bool = True) -> List[str]:
  """BERT's BasicTokenizer: text -> words and punctuation marks."""
  words = []
  for word in _clean(text).split():
    if do_lower_case:
      word = _strip_accents(_lower(word))
    words.extend(_split_punctuation(word))
  return words


def read_do_lower_case(directory: str, default: bool = True) -> bool:
  """`do_lower_case` from an HF tokenizer_config.json in `directory` (default if absent)."""
  path = os.path.join(directory, TOKENIZER_CONFIG)
  if not os.path.isfile(path):
    return default
  with open(path, encoding='utf-8') as f:
    value = json.load(f).get('do_lower_case', default)
  return bool(default if value is None else value)


class WordPieceTokenizer:
  """A WordPiece vocabulary (one piece per line; the line number is the id)."""

  def __init__(self, pieces: Sequence[str], do_lower_case: bool = True, path: str = ''):
    self.path = path
    self.do_lower_case = do_lower_case
    self._pieces = list(pieces)
    self._ids: Dict[str, int] = {p: i for i, p in enumerate(self._pieces)}
    ids = {}
    for name, token in SPECIAL_TOKENS.items():
      if token not in self._ids:
        raise ValueError(f'WordPiece vocabulary {path or "(in memory)"} has no {token} line; '
                         "BERT's special tokens [PAD] [UNK] [CLS] [SEP] [MASK] must all be in "
                         'vocab.txt (add the missing one as its own line)')
      ids[name] = self._ids[token]
    self.pad_id, self.unk_id = ids['pad'], ids['unk']
    self.cls_id, self.sep_id, self.mask_id = ids['cls'], ids['sep'], ids['mask']
    self.special_ids = frozenset(ids.values())
    self._cache: Dict[str, List[int]] = {}

  @classmethod
  def load(cls, path: str, do_lower_case: Optional[bool] = None) -> 'WordPieceTokenizer':
    """Reads a vocab.txt (UTF-8, one piece per line).

    do_lower_case: False for cased vocabularies (e.g. bert-base-cased); None reads it from
    an HF `tokenizer_config.json` beside the vocab.txt (the imports write one), else True.
    """
    if not os.path.isfile(path):
      raise FileNotFoundError(f'WordPiece vocabulary {path!r} not found; pass the vocab.txt '
                              'that came with the checkpoint')
    if do_lower_case is None:
      do_lower_case = read_do_lower_case(os.path.dirname(path))
    try:
      with open(path, encoding='utf-8') as f:
        pieces = [line.rstrip('\n') for line in f]
    except UnicodeDecodeError as e:
      raise ValueError(f'{path} is not a UTF-8 vocab.txt ({e}); pass the vocab.txt that came '
                       'with the checkpoint') from None
    while pieces and not pieces[-1]:  # a trailing blank line is not a piece
      pieces.pop()
    return cls(pieces, do_lower_case=do_lower_case, path=path)

  @property
  def vocab_size(self) -> int:
    return len(self._pieces)

  def _wordpiece(self, word: str) -> List[int]:
    """Greedy longest-match-first; an uncoverable or over-long word is one [UNK]."""
    if len(word) > MAX_CHARS_PER_WORD:
      return [self.unk_id]
    ids, start = [], 0
    while start < len(word):
      end = len(word)
      while end > start:
        piece = word[start:end] if start == 0 else CONTINUATION + word[start:end]
        if piece in self._ids:
          ids.append(self._ids[piece])
          break
        end -= 1
      else:
        return [self.unk_id]
      start = end
    return ids

  def tokenize(self, text: str) -> List[str]:
    return [self._pieces[i] for i in self.encode(text)]

  def encode(self, text: str) -> List[int]:
    """Text -> piece ids, without [CLS] / [SEP]."""
    ids = []
    for word in basic_tokenize(text, self.do_lower_case):
      cached = self._cache.get(word)
      if cached is None:
        cached = self._wordpiece(word)
        if len(self._cache) < 100_000:
          self._cache[word] = cached
      ids.extend(cached)
    return ids

  def decode(self, ids: Sequence[int]) -> str:
    """Ids -> text: pieces joined by spaces, '##' pieces glued to the one before; [PAD],
    [CLS], [SEP] and [MASK] are dropped (like sentencepiece's control symbols)."""
    dropped = self.special_ids - {self.unk_id}
    text = ' '.join(self._pieces[int(i)] for i in ids if int(i) not in dropped)
    return text.replace(' ' + CONTINUATION, '')

  def id_to_piece(self, i: int) -> str:
    return self._pieces[int(i)]

  def piece_to_id(self, piece: str) -> int:
    return self._ids.get(piece, self.unk_id)

  def word_start_mask(self) -> np.ndarray:
    """[vocab_size] bool: False for '##' continuation pieces, True otherwise (specials too)."""
    mask = np.array([not p.startswith(CONTINUATION) for p in self._pieces], dtype=bool)
    mask[list(self.special_ids)] = True
    return mask
