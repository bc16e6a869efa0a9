r"""Sentencepiece vocabularies with BERT's special tokens at fixed ids, and their training.

  [PAD]=0  [UNK]=1  [CLS]=2  [SEP]=3  [MASK]=4

Train one (an uncased unigram model; 30k for the BERT sizes, smaller for tiny runs):

  python -m data.tokenizer --input corpus1.txt.gz corpus2.txt --model_prefix /tmp/wiki_30k \
      --vocab_size 30000

and name it in the config: `--config.data.tokenizer=/tmp/wiki_30k.model`. The embedded corpus
comes with `data/embedded/sotu_uncased_8k.model` (the default; tiny runs). BERT's 30k needs
more text than a few MB (on the 10.8 MB embedded corpus sentencepiece allows at most 24236
pieces): train it on Wikipedia (e.g. written out in BERT's format) or a large mixture.
A `.txt` path is an HF WordPiece vocab.txt (for imported HF checkpoints;
see data/wordpiece.py), with the same interface.

The vocabularies are uncased (sentencepiece's nmt_nfkc_cf normalisation: NFKC, then case
folding) unless trained with --cased, and use byte fallback: a character outside the
vocabulary becomes its UTF-8 byte pieces (<0xE2>...), never [UNK]. Lines over
sentencepiece's 4192-byte limit, which it would skip silently, are split first and counted.
"""

import collections
import itertools
import os
import zlib
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import sentencepiece as spm

from data import sources
from realformer import storage

_HERE = os.path.dirname(os.path.abspath(__file__))
EMBEDDED_CORPUS = sources.EMBEDDED_CORPUS
EMBEDDED_TOKENIZER = os.path.join(_HERE, 'embedded', 'sotu_uncased_8k.model')

SPECIAL_TOKENS = ('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]')  # at ids 0..4
# sentencepiece skips longer lines silently; we split them first (and count the splits).
MAX_SENTENCE_BYTES = 4192


class Tokenizer:
  """A sentencepiece model whose special tokens sit at BERT's fixed ids."""

  def __init__(self, processor: spm.SentencePieceProcessor, path: str = ''):
    self._sp = processor
    self.path = path
    for i, token in enumerate(SPECIAL_TOKENS):
      if processor.id_to_piece(i) != token:
        found = processor.piece_to_id(token)
        where = (f'{token} is at id {found}' if processor.id_to_piece(found) == token else
                 f'it has no {token}')
        raise ValueError(
            f'tokenizer {path or "(in memory)"} does not have {token} at id {i}; retrain it '
            'with `python -m data.tokenizer` (which reserves [PAD] [UNK] [CLS] [SEP] [MASK] '
            f'as ids 0-4) or name another in config.data.tokenizer ({where})')
    self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = range(5)
    self.special_ids = frozenset(range(5))

  @classmethod
  def load(cls, path: str):
    """A sentencepiece .model, or an HF WordPiece vocab.txt (dispatched to data.wordpiece);
    a gs:// URL is read through this host's copy of it (storage.local_copy)."""
    if storage.path(path).is_dir():
      vocab = f'{path.rstrip("/")}/vocab.txt'
      raise ValueError(f'tokenizer {path!r} is a folder; ' + (
          f'give the WordPiece vocabulary in it: config.data.tokenizer={vocab}'
          if storage.path(vocab).exists() else
          'give a sentencepiece .model or a WordPiece vocab.txt file'))
    path = local_files(path)
    if not storage.path(path).exists():
      raise FileNotFoundError(f'tokenizer {path!r} not found; set config.data.tokenizer to a '
                              'sentencepiece .model (or a WordPiece vocab.txt), or train one '
                              'with `python -m data.tokenizer`')
    if path.endswith('.txt'):
      try:
        from data import wordpiece  # pylint: disable=g-import-not-at-top
      except ImportError as e:
        raise ValueError(f'tokenizer {path!r} is a WordPiece vocab.txt, which needs '
                         f'data/wordpiece.py ({e}); use a sentencepiece .model') from None
      return wordpiece.WordPieceTokenizer.load(path, check_case=True)
    processor = spm.SentencePieceProcessor()
    try:
      processor.load(path)
    except (OSError, RuntimeError) as e:
      raise ValueError(f'tokenizer {path!r} is not a sentencepiece model ({e})') from None
    return cls(processor, path)

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  def encode(self, text: str) -> List[int]:
    return self._sp.encode(text, out_type=int)

  def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
    """encode() of every text, in parallel (sentencepiece's threads)."""
    return self._sp.encode(list(texts), out_type=int)

  def encode_words(self, words: Sequence[str]) -> Tuple[List[int], List[int]]:
    """Pre-split words -> (piece ids, the index of each piece's word), each word encoded on
    its own (so each starts with its own '\u2581' piece, as in the whole text)."""
    ids, word_index = [], []
    for w, pieces in enumerate(self.encode_batch(words) if words else []):
      ids += pieces
      word_index += [w] * len(pieces)
    return ids, word_index

  def decode(self, ids: Sequence[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  def id_to_piece(self, i: int) -> str:
    return self._sp.id_to_piece(int(i))

  def word_start_mask(self) -> np.ndarray:
    """[vocab_size] bool: True where a piece begins a word.

    Whole-word masking groups a word's first piece with the continuation pieces after it.
    A sentencepiece piece begins a word when it starts with '\u2581' (the space marker; a
    piece without it continues the previous word), so a word is what whitespace separates:
    punctuation joins the word it touches ('\u2581institutions' '.'), where BERT's WordPiece
    splits it apart (a WordPiece vocabulary groups as BERT does). Special tokens count as
    word starts, so they never join a word. Byte-fallback pieces (<0x..>) never start a
    word: a character outside the vocabulary is preceded by the '\u2581' piece when it
    starts a word, so its bytes continue that word.
    """
    pieces = [self._sp.id_to_piece(i) for i in range(self.vocab_size)]
    mask = np.array([p.startswith('\u2581') for p in pieces])
    mask[list(self.special_ids)] = True
    return mask


def files(path: str) -> List[str]:
  """The files of a tokenizer (config.data.tokenizer): a sentencepiece .model (which holds
  its normalization), or a WordPiece vocab.txt and the tokenizer_config.json beside it (its
  casing) where there is one; none for the embedded one ('')."""
  if not path:
    return []
  from data.wordpiece import TOKENIZER_CONFIG  # pylint: disable=g-import-not-at-top
  folder = path.rstrip('/').rpartition('/')[0]
  casing = storage.join(folder, TOKENIZER_CONFIG) if folder else TOKENIZER_CONFIG
  return [path] + ([casing] if path.endswith('.txt') and storage.is_file(casing) else [])


def signature(path: str) -> Optional[str]:
  """A CRC32 of the tokenizer's files as they are now (`files`; '' is the embedded one's):
  the same pieces and normalisation wherever the files lie. A tokenizer retrained at the
  same path makes other instances: a preparation records it, so that reusing or resuming
  it is refused instead of mixing the two, and a run's resume compares it with the run's
  own copy. None where the file is not here."""
  path = path or EMBEDDED_TOKENIZER
  if not storage.is_file(path):  # (loading it then says what is wrong)
    return None
  crc = 0
  for f in files(path):
    crc = zlib.crc32(storage.path(f).read_bytes(), crc)
  return f'{crc:08x}'


def local_files(path: str) -> str:
  """`path`, or for a gs:// tokenizer this host's checked copy of its files
  (storage.local_copy): a sentencepiece .model, or a vocab.txt with the
  tokenizer_config.json beside it (its casing) where the bucket has one."""
  if not storage.is_url(path) or not storage.path(path).is_file():
    return path
  from data.wordpiece import TOKENIZER_CONFIG  # pylint: disable=g-import-not-at-top
  folder, _, name = path.rstrip('/').rpartition('/')
  casing = name.endswith('.txt') and storage.is_file(f'{folder}/{TOKENIZER_CONFIG}')
  local = storage.local_copy(folder, [name] + [TOKENIZER_CONFIG] * casing, kind='tokenizers')
  if not casing and os.path.isfile(os.path.join(local, TOKENIZER_CONFIG)):
    os.unlink(os.path.join(local, TOKENIZER_CONFIG))  # (an earlier copy's, gone since)
  return os.path.join(local, name)


def load_for_config(config_data) -> Tokenizer:
  """The tokenizer that `config.data.tokenizer` names ('' = the embedded corpus's)."""
  return Tokenizer.load(config_data.tokenizer or EMBEDDED_TOKENIZER)


def _cut_bytes(word: str, max_bytes: int) -> List[str]:
  """A word cut into pieces of at most `max_bytes` UTF-8 bytes (never inside a character)."""
  pieces, piece, size = [], [], 0
  for ch in word:
    n = len(ch.encode('utf-8'))
    if piece and size + n > max_bytes:
      pieces.append(''.join(piece))
      piece, size = [], 0
    piece.append(ch)
    size += n
  return pieces + [''.join(piece)]


def split_long_line(line: str, max_bytes: int = MAX_SENTENCE_BYTES) -> List[str]:
  """`line` as parts of at most `max_bytes` UTF-8 bytes, nothing dropped.

  Splits at sentence boundaries first, then at whitespace; a single word longer than the
  limit is cut into pieces.
  """
  if len(line.encode('utf-8')) <= max_bytes:
    return [line]
  parts = []
  for sentence in sources.split_sentences(line):
    if len(sentence.encode('utf-8')) <= max_bytes:
      parts.append(sentence)
      continue
    chunk, size = [], 0
    for word in sentence.split():
      for piece in _cut_bytes(word, max_bytes):
        n = len(piece.encode('utf-8'))
        if chunk and size + 1 + n > max_bytes:
          parts.append(' '.join(chunk))
          chunk, size = [], 0
        size += n + bool(chunk)
        chunk.append(piece)
    if chunk:
      parts.append(' '.join(chunk))
  return parts


def _training_sentences(lines: Iterable[str], stats: collections.Counter) -> Iterator[str]:
  for line in lines:
    for line in line.split('\n'):  # a paragraph given as one string
      line = line.strip()
      if not line:
        continue
      parts = split_long_line(line)
      if len(parts) > 1:
        stats['long_lines_split'] += 1
      stats['sentences'] += len(parts)
      yield from parts


def _is_file(p: str) -> bool:
  return storage.path(p).is_file() if p.startswith('gs://') else os.path.isfile(p)


def _input_lines(inputs, stats: collections.Counter) -> Iterator[str]:
  """Sentences of a path, a list of paths (BERT-format files, local or gs://) or an iterable
  of sentences. A path (a str) that is no file is an error, and so is a list whose strings
  name files but for some: never a sentence to train on."""
  if isinstance(inputs, str):  # a path, never a sentence
    if not _is_file(inputs):
      raise FileNotFoundError(f'input files not found: {inputs}')
    inputs = [inputs]
  if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(p, str) for p in inputs):
    files = [_is_file(p) for p in inputs]
    if all(files):
      return (s for path in inputs for doc in sources.iter_file_documents(path, stats)
              for s in doc)
    if any(files):  # some paths, some not: the missing ones (a list of sentences has none)
      raise FileNotFoundError('input files not found: '
                              f'{", ".join(p for p, f in zip(inputs, files) if not f)}')
  return iter(inputs)


def _sentences(inputs, stats: collections.Counter) -> Iterator[str]:
  """The training sentences of `inputs` (_input_lines); a ValueError before any training if
  there are none."""
  sentences = _training_sentences(_input_lines(inputs, stats), stats)
  first = next(sentences, None)
  if first is None:
    skipped = ', '.join(f'{n} {what}' for what, n in sorted(stats.items()) if n)
    raise ValueError('no sentences to train the tokenizer on'
                     f'{f" ({skipped})" if skipped else ""}; check --input')
  return itertools.chain([first], sentences)


def train_wordpiece(inputs: Union[str, Sequence[str], Iterable[str]], out_dir: str,
                    vocab_size: int, *, lowercase: bool = True) -> collections.Counter:
  """A BERT WordPiece vocabulary (<out_dir>/vocab.txt, data/wordpiece.py) from the same
  inputs as train_sentencepiece; returns the same counts."""
  from data import wordpiece  # pylint: disable=g-import-not-at-top
  stats = collections.Counter()
  wordpiece.train_wordpiece(_sentences(inputs, stats), out_dir, vocab_size,
                            do_lower_case=lowercase)
  return stats


def train_sentencepiece(inputs: Union[str, Sequence[str], Iterable[str]], model_prefix: str,
                        vocab_size: int, *, model_type: str = 'unigram',
                        lowercase: bool = True, character_coverage: float = 0.9999,
                        input_sentence_size: int = 10_000_000,
                        seed_sentencepiece_size: int = 1_000_000) -> collections.Counter:
  """Trains `<model_prefix>.model` (and `.vocab`) with BERT's special tokens at ids 0-4.

  Args:
    inputs: a path or a list of paths of BERT-format files (one sentence per line, gzip or
      plain), or an iterable of sentences (streamed; never held as a list here).
    model_prefix: where to write; its directory is created.
    vocab_size: pieces in all, the 5 special tokens and 256 byte pieces included. 8000 suits
      the embedded corpus (a few MB); BERT's 30k needs far more text (sentencepiece refuses
      more than 24236 on the 10.8 MB embedded corpus): Wikipedia or a large mixture.
    model_type: 'unigram' (default) or 'bpe'.
    lowercase: uncased (BERT-uncased): sentencepiece's nmt_nfkc_cf normalisation (NFKC and
      Unicode case folding) applies when training and when encoding; else nmt_nfkc.
    character_coverage: characters outside it go to byte pieces, not [UNK].
    input_sentence_size: sentencepiece samples at most this many sentences (reservoir
      sampling over the stream) to bound its memory.
    seed_sentencepiece_size: unigram's initial seed pieces.

  Returns:
    Counts: 'sentences' fed, 'long_lines_split' (lines over sentencepiece's
    MAX_SENTENCE_BYTES, which it would otherwise skip silently, split at sentence boundaries
    and then whitespace), and what the sources skipped ('non_utf8_lines', 'empty_files').
  """
  stats = collections.Counter()
  sentences = _sentences(inputs, stats)
  os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
  trainer_args = dict(
      sentence_iterator=sentences, model_prefix=model_prefix,
      vocab_size=vocab_size, model_type=model_type, character_coverage=character_coverage,
      # [PAD] and [UNK] take sentencepiece's own pad/unk slots; [CLS] [SEP] [MASK] are control
      # symbols: they have ids but text never encodes to them (a literal "[MASK]" in a
      # sentence stays text, as in BERT). No <s> </s>.
      pad_id=0, pad_piece='[PAD]', unk_id=1, unk_piece='[UNK]', bos_id=-1, eos_id=-1,
      control_symbols=list(SPECIAL_TOKENS[2:]), byte_fallback=True,
      normalization_rule_name='nmt_nfkc_cf' if lowercase else 'nmt_nfkc',
      max_sentence_length=MAX_SENTENCE_BYTES, input_sentence_size=input_sentence_size,
      seed_sentencepiece_size=seed_sentencepiece_size, shuffle_input_sentence=True,
      minloglevel=2)
  try:
    spm.SentencePieceTrainer.train(**trainer_args)
  except RuntimeError as e:
    said = str(e).rsplit(']', 1)[-1].strip()
    if 'Vocabulary size too high' in str(e):
      raise ValueError(f'vocab_size={vocab_size} is too large for this text (sentencepiece: '
                       f'{said}); give more text or a smaller vocab_size') from None
    if 'smaller than required_chars' in str(e):  # (the 256 byte pieces count among them)
      raise ValueError(f'vocab_size={vocab_size} is too small for this text (sentencepiece: '
                       f'{said}); give a larger vocab_size') from None
    raise
  Tokenizer.load(model_prefix + '.model')  # check the special ids
  return stats


def _define(f):
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_multi_string('input', None, 'BERT-format text files (one sentence per line), '
                            'gzip or plain: --input A B C, or --input A --input B',
                            flag_values=f, required=True)
  flags.DEFINE_string('model_prefix', None, 'sentencepiece: writes <prefix>.model; wordpiece: '
                      'the folder of vocab.txt', flag_values=f, required=True)
  flags.DEFINE_integer('vocab_size', 30000, 'pieces in the vocabulary', lower_bound=1,
                       flag_values=f)
  flags.DEFINE_enum('model_type', 'unigram', ['unigram', 'bpe', 'wordpiece'],
                    "wordpiece: BERT's tokenizer (the tokenizers library's trainer)",
                    flag_values=f)
  flags.DEFINE_boolean('cased', False, 'keep case (default: uncased)', flag_values=f)
  flags.DEFINE_integer('input_sentence_size', 10_000_000, 'sentences sentencepiece samples '
                       'from the stream (memory bound)', flag_values=f)


def main(argv=None):
  """Train a sentencepiece (or BERT WordPiece) vocabulary with BERT's special tokens at ids
  0-4."""
  from realformer import cli  # pylint: disable=g-import-not-at-top
  args, words = cli.parse_tool_flags(_define, argv, prog='python -m data.tokenizer',
                                     doc=main.__doc__, positional=('*more_inputs',))
  args.input += words['*more_inputs']  # --input A B C: B and C come as words
  missing = [p for p in args.input if not _is_file(p)]
  if missing:
    cli.fail(f'input files not found: {", ".join(missing)}')
  if args.model_type == 'wordpiece':
    stats = train_wordpiece(args.input, args.model_prefix, args.vocab_size,
                            lowercase=not args.cased)
    print(f'wrote {os.path.join(args.model_prefix, "vocab.txt")} ({dict(stats)})')
    return
  stats = train_sentencepiece(args.input, args.model_prefix, args.vocab_size,
                              model_type=args.model_type, lowercase=not args.cased,
                              input_sentence_size=args.input_sentence_size)
  print(f'wrote {args.model_prefix}.model ({dict(stats)})')


if __name__ == '__main__':
  from realformer import cli  # pylint: disable=g-import-not-at-top
  cli.run_main(main)
