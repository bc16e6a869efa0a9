r"""Sentencepiece vocabularies with BERT's special tokens at fixed ids, and their training.

  [PAD]=0  [UNK]=1  [CLS]=2  [SEP]=3  [MASK]=4

Train one (an uncased unigram model; 30k for the BERT sizes, smaller for tiny runs):

  python -m data.tokenizer --input corpus1.txt.gz corpus2.txt --model_prefix /tmp/wiki_30k \
      --vocab_size 30000

and name it in the config: `--config.data.tokenizer=/tmp/wiki_30k.model`. The embedded corpus
comes with `data/embedded/sotu_uncased_8k.model` (the default). A 30k unigram vocabulary needs
more text than a few MB (sentencepiece refused above about 26k on 4.7 MB). A `.txt` path is an
HF WordPiece vocab.txt (for imported HF checkpoints; see data/wordpiece.py).
"""

import argparse
import collections
import os
from typing import Iterable, Iterator, List, Sequence

import numpy as np
import sentencepiece as spm

from data import sources

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
      if processor.piece_to_id(token) != i or processor.id_to_piece(i) != token:
        raise ValueError(
            f'tokenizer {path or "(in memory)"} does not have {token} at id {i}; retrain it '
            'with `python -m data.tokenizer` (which reserves [PAD] [UNK] [CLS] [SEP] [MASK] '
            'as ids 0-4)')
    self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = range(5)
    self.special_ids = frozenset(range(5))

  @classmethod
  def load(cls, path: str):
    """A sentencepiece .model, or an HF WordPiece vocab.txt (dispatched to data.wordpiece)."""
    if not os.path.exists(path):
      raise FileNotFoundError(f'tokenizer {path!r} not found; set config.data.tokenizer to a '
                              'sentencepiece .model (or a WordPiece vocab.txt), or train one '
                              'with `python -m data.tokenizer`')
    if path.endswith('.txt'):
      from data import wordpiece  # pylint: disable=g-import-not-at-top
      return wordpiece.WordPieceTokenizer.load(path)
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

  def decode(self, ids: Sequence[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  def id_to_piece(self, i: int) -> str:
    return self._sp.id_to_piece(int(i))

  def word_start_mask(self) -> np.ndarray:
    """[vocab_size] bool: True where a piece begins a word (whole-word masking groups a
    word's first piece with the continuation pieces after it). Special tokens count as
    word starts; byte-fallback pieces continue the word they sit in."""
    pieces = [self._sp.id_to_piece(i) for i in range(self.vocab_size)]
    mask = np.array([p.startswith('\u2581') for p in pieces])
    mask[list(self.special_ids)] = True
    return mask


def load_for_config(config_data) -> Tokenizer:
  """The tokenizer that `config.data.tokenizer` names ('' = the embedded corpus's)."""
  return Tokenizer.load(config_data.tokenizer or EMBEDDED_TOKENIZER)


def split_long_line(line: str, max_bytes: int = MAX_SENTENCE_BYTES) -> List[str]:
  """Splits a line over `max_bytes` at sentence boundaries, then at whitespace."""
  if len(line.encode('utf-8')) <= max_bytes:
    return [line]
  parts = []
  for sentence in sources.split_sentences(line):
    if len(sentence.encode('utf-8')) <= max_bytes:
      parts.append(sentence)
      continue
    chunk = []
    size = 0
    for word in sentence.split():
      n = len(word.encode('utf-8')) + 1
      if chunk and size + n > max_bytes:
        parts.append(' '.join(chunk))
        chunk, size = [], 0
      chunk.append(word[: max_bytes // 4])  # one giant "word" is cut, not dropped
      size += min(n, max_bytes // 4 + 1)
    if chunk:
      parts.append(' '.join(chunk))
  return parts


def _training_sentences(lines: Iterable[str], stats) -> Iterator[str]:
  for line in lines:
    pieces = split_long_line(line)
    if len(pieces) > 1:
      stats['long_lines_split'] += 1
    yield from pieces


def train_sentencepiece(inputs, model_prefix: str, vocab_size: int, *,
                        model_type: str = 'unigram', lowercase: bool = True,
                        character_coverage: float = 0.9999,
                        input_sentence_size: int = 10_000_000) -> collections.Counter:
  """Trains `<model_prefix>.model` from BERT-format files (paths) or an iterable of lines.

  Streams the sentences (sentencepiece samples at most `input_sentence_size` of them), keeps
  BERT's special tokens at ids 0-4, uses byte fallback (no unknown curly quotes or accents),
  and lower-cases through sentencepiece's normaliser when `lowercase`. Returns counts of what
  was split or skipped.
  """
  stats = collections.Counter()
  if inputs and all(isinstance(p, str) and os.path.exists(p) for p in inputs):
    paths = list(inputs)
    lines = (s for path in paths for doc in sources.iter_file_documents(path, stats)
             for s in doc)
  else:
    lines = (line.strip() for line in inputs if line.strip())
  os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
  spm.SentencePieceTrainer.train(
      sentence_iterator=_training_sentences(lines, stats), model_prefix=model_prefix,
      vocab_size=vocab_size, model_type=model_type, character_coverage=character_coverage,
      pad_id=0, pad_piece='[PAD]', unk_id=1, unk_piece='[UNK]', bos_id=-1, eos_id=-1,
      control_symbols=['[CLS]', '[SEP]', '[MASK]'], byte_fallback=True,
      normalization_rule_name='nmt_nfkc_cf' if lowercase else 'nmt_nfkc',
      max_sentence_length=MAX_SENTENCE_BYTES, input_sentence_size=input_sentence_size,
      shuffle_input_sentence=True, train_extremely_large_corpus=False,
      minloglevel=2)
  Tokenizer.load(model_prefix + '.model')  # check the special ids
  return stats


def main(argv=None):
  parser = argparse.ArgumentParser(description='Train a sentencepiece vocabulary with '
                                   "BERT's special tokens at ids 0-4.")
  parser.add_argument('--input', nargs='+', required=True,
                      help="BERT-format text files (one sentence per line), gzip or plain")
  parser.add_argument('--model_prefix', required=True)
  parser.add_argument('--vocab_size', type=int, default=30000)
  parser.add_argument('--model_type', default='unigram', choices=('unigram', 'bpe'))
  parser.add_argument('--cased', action='store_true', help='keep case (default: uncased)')
  args = parser.parse_args(argv)
  missing = [p for p in args.input if not os.path.exists(p)]
  if missing:
    parser.error(f'input files not found: {", ".join(missing)}')
  stats = train_sentencepiece(args.input, args.model_prefix, args.vocab_size,
                              model_type=args.model_type, lowercase=not args.cased)
  print(f'wrote {args.model_prefix}.model ({dict(stats) or "nothing skipped"})')


if __name__ == '__main__':
  main()
