"""BERT's WordPiece tokenizer over an HF / TF1 `vocab.txt`, with data.tokenizer's interface.

For checkpoints imported from elsewhere (realformer/tools/interop.py), whose embeddings are indexed
by their own vocabulary. `data.tokenizer.Tokenizer.load('.../vocab.txt')` dispatches here.

The work is done by Hugging Face's `tokenizers` library (Rust; the engine of transformers'
BertTokenizer), set up as BERT's algorithm (google-research/bert tokenization.py):
  1. BertNormalizer: drop NUL, U+FFFD and control characters (see below for which), turn
     whitespace into spaces,
     put spaces around CJK ideographs; when uncased, lower-case and strip accents (NFD, drop
     combining marks); HF's tokenizer_config.json beside the vocab.txt may set
     do_lower_case, strip_accents and tokenize_chinese_chars otherwise, as for BertTokenizer;
  2. BertPreTokenizer: split on whitespace and off every punctuation character (ASCII
     symbols count as punctuation, as in BERT);
  3. WordPiece: greedy longest-match-first over the vocabulary, continuation pieces carry a
     '##' prefix; a word longer than 100 characters, or one that cannot be covered, is a
     single [UNK].
Special tokens are looked up by their strings ([PAD], [UNK], [CLS], [SEP], [MASK]); their ids
differ from the sentencepiece vocabularies trained here (e.g. [PAD]=0, [UNK]=100, [CLS]=101 in
Google's uncased vocabulary). Text is never parsed for special-token strings: "[MASK]" in a
sentence is punctuation and letters, as in BERT (transformers' BertTokenizer instead keeps such
a string as its special token). Where this differs from google-research/bert (and agrees with
transformers' BertTokenizer, whose engine this is): lower-casing is letter by letter, so a
word-final capital sigma becomes 'σ', where Python's str.lower() gives 'ς'; and private-use
characters (Unicode category Co) are dropped with the control characters, where BERT drops
only Cc and Cf and keeps a private-use character inside its word, which then becomes [UNK]
('ab\ue000cd': BERT [UNK], here the pieces of 'abcd'); a word of 101 to 200 characters is
[UNK], where BERT (max_input_chars_per_word=200) gives its pieces; and the library's tables
of CJK ideographs and Unicode categories are its own (the 256 ideographs U+2B820-U+2B91F are
not split apart; marks newer than its Unicode version, such as U+0890, are classed
otherwise).
"""

import json
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import tokenizers
from tokenizers import models
from tokenizers import normalizers
from tokenizers import pre_tokenizers
from tokenizers import trainers

SPECIAL_TOKENS = {'pad': '[PAD]', 'unk': '[UNK]', 'cls': '[CLS]', 'sep': '[SEP]',
                  'mask': '[MASK]'}
MAX_CHARS_PER_WORD = 100
CONTINUATION = '##'
TOKENIZER_CONFIG = 'tokenizer_config.json'  # HF's file; its normalisation settings are read
# BERT's normalisation settings as HF's tokenizer_config.json names them, with BertTokenizer's
# defaults (strip_accents None: strip when lower-casing).
NORMALIZATION = {'do_lower_case': True, 'strip_accents': None, 'tokenize_chinese_chars': True}


def _normalizer(do_lower_case: bool, strip_accents: Optional[bool] = None,
                tokenize_chinese_chars: bool = True):
  return normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=tokenize_chinese_chars,
                                    strip_accents=strip_accents, lowercase=do_lower_case)


def basic_tokenize(text: str, do_lower_case: bool = True) -> List[str]:
  """BERT's BasicTokenizer: text -> words and punctuation marks."""
  normalized = _normalizer(do_lower_case).normalize_str(text)
  return [word for word, _ in pre_tokenizers.BertPreTokenizer().pre_tokenize_str(normalized)]


def read_normalization(directory: str) -> dict:
  """NORMALIZATION's settings from an HF tokenizer_config.json in `directory` (BertTokenizer's
  defaults for those it does not give, or without the file)."""
  settings = dict(NORMALIZATION)
  path = os.path.join(directory, TOKENIZER_CONFIG)
  if os.path.isfile(path):
    try:
      with open(path, encoding='utf-8') as f:
        stored = json.load(f)
    except ValueError as e:
      raise ValueError(f'{path} is not JSON ({e}); fix or remove it (it holds the vocabulary\'s '
                       'do_lower_case and strip_accents)') from None
    stored = stored if isinstance(stored, dict) else {}
    kind = stored.get('tokenizer_class') or 'BertTokenizer'
    bert = kind in ('BertTokenizer', 'BertTokenizerFast')
    if not bert or stored.get('do_basic_tokenize') is False:
      raise ValueError(f'{path} describes {kind}{" without basic tokenization" if bert else ""}, '
                       'whose ids BERT\'s WordPiece tokenizer here would not reproduce; import a '
                       'checkpoint that uses BertTokenizer')
    for key, default in NORMALIZATION.items():
      value = stored.get(key, default)
      settings[key] = default if value is None else bool(value)
  return settings


def capitalised(pieces: List[str]) -> Tuple[List[str], bool]:
  """The pieces with capitals (not [CLS], <S>, ...), and whether they are so many that the
  vocabulary is a cased one (lower-cased input would never reach them)."""
  capitals = [p for p in pieces if p != p.lower() and p[:1] + p[-1:] not in ('[]', '<>')]
  return capitals, len(capitals) > max(20, len(pieces) // 200)


class WordPieceTokenizer:
  """A WordPiece vocabulary (one piece per line; the line number is the id)."""

  def __init__(self, pieces: Sequence[str], do_lower_case: bool = True, path: str = '',
               strip_accents: Optional[bool] = None, tokenize_chinese_chars: bool = True):
    self.path = path
    self.do_lower_case = do_lower_case
    self.normalization = {'do_lower_case': do_lower_case, 'strip_accents': strip_accents,
                          'tokenize_chinese_chars': tokenize_chinese_chars}
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
    self._tokenizer = tokenizers.Tokenizer(models.WordPiece(
        self._ids, unk_token=SPECIAL_TOKENS['unk'], continuing_subword_prefix=CONTINUATION,
        max_input_chars_per_word=MAX_CHARS_PER_WORD))
    self._tokenizer.normalizer = _normalizer(do_lower_case, strip_accents,
                                             tokenize_chinese_chars)
    self._tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()

  @classmethod
  def load(cls, path: str, do_lower_case: Optional[bool] = None,
           check_case: bool = False) -> 'WordPieceTokenizer':
    """Reads a vocab.txt (UTF-8, one piece per line).

    do_lower_case: False for cased vocabularies (e.g. bert-base-cased); None reads it from
    an HF `tokenizer_config.json` beside the vocab.txt (the imports write one), else True;
    with `check_case` (a run's config.data.tokenizer; the imports check their --cased
    themselves) a cased vocabulary (capitalised) that nothing says is cased, which
    lower-cased input would never reach, is a one-line error naming the file to add.
    strip_accents and tokenize_chinese_chars are read from that file too (BertTokenizer's
    defaults without it).
    """
    if not os.path.isfile(path):
      raise FileNotFoundError(f'WordPiece vocabulary {path!r} not found; pass the vocab.txt '
                              'that came with the checkpoint')
    settings = read_normalization(os.path.dirname(path))
    if do_lower_case is not None:
      settings['do_lower_case'] = do_lower_case
    try:
      with open(path, encoding='utf-8') as f:
        pieces = [line.rstrip('\n') for line in f]
    except UnicodeDecodeError as e:
      raise ValueError(f'{path} is not a UTF-8 vocab.txt ({e}); pass the vocab.txt that came '
                       'with the checkpoint') from None
    while pieces and not pieces[-1]:  # a trailing blank line is not a piece
      pieces.pop()
    config = os.path.join(os.path.dirname(path), TOKENIZER_CONFIG)
    if (check_case and do_lower_case is None and settings['do_lower_case']
        and not os.path.isfile(config)):
      capitals, cased = capitalised(pieces)
      if cased:
        raise ValueError(f'{path} holds {len(capitals)} pieces with capitals (e.g. '
                         f'{capitals[:3]}), a cased vocabulary, which BERT\'s default '
                         f'lower-casing would never reach; put a {TOKENIZER_CONFIG} with '
                         '{"do_lower_case": false} beside it (as a cased checkpoint ships)')
    return cls(pieces, path=path, **settings)

  @property
  def vocab_size(self) -> int:
    return len(self._pieces)

  def tokenize(self, text: str) -> List[str]:
    return [self._pieces[i] for i in self.encode(text)]

  def encode(self, text: str) -> List[int]:
    """Text -> piece ids, without [CLS] / [SEP]."""
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
    """encode() of every text, in parallel (the library's threads)."""
    return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

  def encode_words(self, words: Sequence[str]) -> Tuple[List[int], List[int]]:
    """Pre-split words -> (piece ids, the index of each piece's word): every word tokenised
    on its own, as BERT's run_squad does, in one call."""
    if not words:
      return [], []
    encoding = self._tokenizer.encode(list(words), is_pretokenized=True,
                                      add_special_tokens=False)
    return encoding.ids, list(encoding.word_ids)

  def encode_words_with_offsets(self, words: Sequence[str]
                                ) -> Tuple[List[int], List[int], List[Tuple[int, int]]]:
    """encode_words() and each piece's characters [start, end) within its word (of the
    original text: 'Café' -> 'cafe' spans (0, 4)), for SQuAD's answer mapping."""
    if not words:
      return [], [], []
    encoding = self._tokenizer.encode(list(words), is_pretokenized=True,
                                      add_special_tokens=False)
    return encoding.ids, list(encoding.word_ids), list(encoding.offsets)

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


def train_wordpiece(sentences: Iterable[str], out_dir: str, vocab_size: int, *,
                    do_lower_case: bool = True, min_frequency: int = 2,
                    limit_alphabet: int = 1000) -> str:
  """Learns a WordPiece vocabulary as BERT's uncased 30k one was made: over BERT's
  normalisation and pre-tokenisation (the classes above), with the tokenizers library's
  WordPieceTrainer (Google's own WordPiece trainer was never released; this is the one
  transformers' users train with).

  Writes <out_dir>/vocab.txt, BERT's special tokens [PAD] [UNK] [CLS] [SEP] [MASK] at ids 0-4
  (the ids of the sentencepiece vocabularies trained here) then the pieces, and an HF
  tokenizer_config.json holding do_lower_case; returns the vocab.txt path, which
  config.data.tokenizer takes. `sentences` is streamed (one sentence or paragraph per item).
  """
  tokenizer = tokenizers.Tokenizer(models.WordPiece(
      unk_token=SPECIAL_TOKENS['unk'], continuing_subword_prefix=CONTINUATION,
      max_input_chars_per_word=MAX_CHARS_PER_WORD))
  tokenizer.normalizer = _normalizer(do_lower_case)
  tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  trainer = trainers.WordPieceTrainer(
      vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
      special_tokens=list(SPECIAL_TOKENS.values()), limit_alphabet=limit_alphabet,
      continuing_subword_prefix=CONTINUATION)
  tokenizer.train_from_iterator(sentences, trainer=trainer)
  vocab = tokenizer.get_vocab()
  if len(vocab) <= len(SPECIAL_TOKENS):
    raise ValueError('no text to learn a WordPiece vocabulary from; check the input files')
  pieces = sorted(vocab, key=vocab.get)
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, 'vocab.txt')
  for name, text in ((path, '\n'.join(pieces) + '\n'),
                     (os.path.join(out_dir, TOKENIZER_CONFIG),
                      json.dumps({'do_lower_case': do_lower_case,
                                  'tokenizer_class': 'BertTokenizer'}, indent=1) + '\n')):
    with open(name + '.tmp', 'w', encoding='utf-8') as f:
      f.write(text)
    os.replace(name + '.tmp', name)
  WordPieceTokenizer.load(path)  # the special tokens are where they belong
  return path
