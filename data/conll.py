"""Named-entity recognition data in the CoNLL-2003 format (Tjong Kim Sang and De Meulder 2003):
reading, BERT's features, and entity chunks.

A file holds one token per line, its columns separated by whitespace, the word first and its
tag last (CoNLL-2003's word, part of speech, chunk and entity tag; or word and tag alone); a
blank line ends a sentence and `-DOCSTART-` lines separate documents. Tags are BIO: O, B-<type>
and I-<type>, as IOB2 writes them (every entity begins with B-) or IOB1 (the original
CoNLL-2003 files: I- but where an entity follows one of its own type); `chunks` reads both as
conlleval.pl does.

Features (BERT's practice, Devlin et al. 2019 section 5.3, and transformers' run_ner): each
word is tokenised alone, [CLS] pieces [SEP], the word's tag is the label of its first piece
and the other pieces (and [CLS], [SEP], padding) are labelled IGNORE; a sentence whose pieces
do not fit max_seq_length keeps those that do, and its words without a piece among them are
predicted O and scored so. With document context (the paper's "maximal document context
provided by the data"), the rest of a sentence's sequence is filled with the pieces of its
document's sentences around it, as many before as after where the document has them, and
only the sentence's own words are labelled (and predicted): each sentence is still one
example.
"""

import dataclasses
import re
from typing import Dict, List, Sequence, Tuple

import numpy as np

from realformer import storage

IGNORE = -1  # the label of pieces that are not a word's first (no loss, no prediction)
# The tag set of CoNLL-2003's English NER, in the order of tfds's and Hugging Face's copies.
CONLL2003_LABELS = ('O', 'B-PER', 'I-PER', 'B-ORG', 'I-ORG', 'B-LOC', 'I-LOC', 'B-MISC',
                    'I-MISC')
# The file of each split in data_dir, by the names its copies use: this project's and most
# copies' (train/dev/test.txt), Hugging Face's and flair's valid.txt, the original eng.*.
SPLIT_FILES = {'train': ('train.txt', 'eng.train'),
               'dev': ('dev.txt', 'valid.txt', 'eng.testa'),
               'test': ('test.txt', 'eng.testb')}


@dataclasses.dataclass
class Sentence:
  words: List[str]
  tags: List[str]
  line: int = 0  # the line of its first word in its file (for errors)
  document: int = 0  # the -DOCSTART- lines before it in its file


def split_file(data_dir: str, split: str) -> str:
  """The path of `split`'s file in data_dir (the first of SPLIT_FILES' names there);
  FileNotFoundError naming them all where none is, or naming the folder where it is not
  one."""
  if data_dir.startswith('hf:') or not storage.is_dir(data_dir):
    raise FileNotFoundError(f'config.data_dir={data_dir} is not a folder; give the folder of '
                            'the CoNLL files (train.txt, dev.txt, test.txt)')
  names = SPLIT_FILES[split]
  for name in names:
    path = storage.join(data_dir, name)
    if storage.path(path).exists():
      return path
  raise FileNotFoundError(f'no {split} file in {data_dir}: name it {" or ".join(names)} '
                          '(CoNLL-2003 format: a word and its tag per line)')


def read(path: str) -> List[Sentence]:
  """The sentences of a CoNLL file, each with its document (the -DOCSTART- lines before it:
  a file without them is one document); ValueError naming the file and line for a line of
  one column, and for a file without a sentence."""
  sentences, words, tags, first, document = [], [], [], 0, 0
  try:
    text = storage.path(path).read_bytes().decode('utf-8-sig')  # (a byte-order mark: none)
  except UnicodeDecodeError as e:
    raise ValueError(f'{path}: not UTF-8 text ({e.reason} at byte {e.start}); convert it to '
                     'UTF-8 (CoNLL-2003\'s German files are Latin-1: iconv -f latin1 -t utf8)'
                     ) from None
  # Lines end at \n alone and columns part at spaces and tabs alone (str.splitlines and
  # str.split also break at U+0085, U+2028, a no-break space, ... inside a word).
  for number, line in enumerate(text.split('\n'), 1):
    columns = [c for c in re.split(r'[ \t]+', line.rstrip('\r')) if c]
    if not columns or columns[0] == '-DOCSTART-':
      if words:
        sentences.append(Sentence(words, tags, first, document))
        words, tags = [], []
      document += bool(columns)
      continue
    if not words:
      first = number
    if len(columns) < 2:
      raise ValueError(f'{path}, line {number}: {line.strip()!r} has no tag; a line holds a '
                       'word and its tag (the last column), separated by whitespace')
    words.append(columns[0])
    tags.append(columns[-1])
  if words:
    sentences.append(Sentence(words, tags, first, document))
  if not sentences:
    raise ValueError(f'{path} holds no sentence (a word and its tag per line, a blank line '
                     'after each sentence); is it a CoNLL file?')
  return sentences


def check_labels(labels: Sequence[str]) -> None:
  """ValueError for a tag set that is not BIO: O, B-<type>, I-<type>."""
  if len(set(labels)) != len(labels) or 'O' not in labels:
    raise ValueError(f'the tags {",".join(labels)} must hold O and no tag twice')
  odd = [t for t in labels if t != 'O' and (t[:2] not in ('B-', 'I-') or len(t) < 3)]
  if odd:
    raise ValueError(f'tags {odd} are not BIO (O, B-<type>, I-<type>); convert IOBES or '
                     'other schemes to BIO')
  dashed = [t for t in labels if '-' in t[2:]]
  if dashed:  # conlleval.pl reads a type up to its next '-' (B-GPE-X is of type GPE)
    raise ValueError(f'tags {dashed} hold a \'-\' in their type, which conlleval.pl would '
                     'cut there; name each type without one')


def label_ids(sentences: Sequence[Sentence], labels: Sequence[str], path: str
              ) -> List[List[int]]:
  """Each sentence's tags as ids into `labels`; ValueError naming the line, word and tag
  of one not among them (and an IOBES file as such)."""
  index = {t: i for i, t in enumerate(labels)}
  out = []
  for s in sentences:
    for k, tag in enumerate(s.tags):
      if tag not in index:
        where = f'{path}, line {s.line + k}: tag {tag!r} of {s.words[k]!r}'
        if tag[:2] in ('S-', 'E-'):
          raise ValueError(f'{where} is IOBES (S- and E- tags); convert the files to BIO '
                           '(S- to B-, E- to I-)')
        raise ValueError(f'{where} is not among the labels ({",".join(labels)}); add it to '
                         'config.ner.labels (in id order), or fix the file')
    out.append([index[t] for t in s.tags])
  return out


def featurize(sentences: Sequence[Sentence], ids: Sequence[Sequence[int]], tokenizer,
              max_seq_length: int, document_context: bool = False
              ) -> Tuple[Dict[str, np.ndarray], List[np.ndarray], int]:
  """(features: input_ids, segment_ids, attention_mask and labels [N, max_seq_length], each
  word's tag id at its first piece and IGNORE elsewhere; for each sentence, its words that
  are labelled as [K, 2] rows (first-piece position, word index); the number of words left
  without a position: cut off by max_seq_length, or given no piece by the tokenizer (a
  control character alone), each predicted O). `document_context`: the sequence around a
  sentence's pieces filled with its document's (context_pieces)."""
  n = len(sentences)
  input_ids = np.full((n, max_seq_length), tokenizer.pad_id, np.int32)
  mask = np.zeros((n, max_seq_length), np.int32)
  labels = np.full((n, max_seq_length), IGNORE, np.int32)
  placed, unplaced = [], 0
  encoded = [tokenizer.encode_words(s.words) for s in sentences]
  kept = max_seq_length - 2  # (a word whose first piece fits keeps its label)
  for i, (s, tag_ids) in enumerate(zip(sentences, ids)):
    pieces, word_of = encoded[i][0][:kept], encoded[i][1][:kept]
    before, after = (context_pieces(sentences, encoded, i, kept - len(pieces))
                     if document_context else ([], []))
    tokens = [tokenizer.cls_id, *before, *pieces, *after, tokenizer.sep_id]
    input_ids[i, :len(tokens)] = tokens
    mask[i, :len(tokens)] = 1
    rows = np.asarray([(1 + len(before) + p, w) for p, w in enumerate(word_of)
                       if p == 0 or w != word_of[p - 1]], np.int64).reshape(-1, 2)
    labels[i, rows[:, 0]] = np.asarray(tag_ids, np.int32)[rows[:, 1]]
    placed.append(rows)
    unplaced += len(s.words) - len(rows)
  return ({'input_ids': input_ids, 'segment_ids': np.zeros_like(input_ids),
           'attention_mask': mask, 'labels': labels}, placed, unplaced)


def context_pieces(sentences: Sequence[Sentence], encoded: Sequence[Tuple[List[int], list]],
                   i: int, room: int) -> Tuple[List[int], List[int]]:
  """The pieces of sentence i's document around it that fill `room` positions: those just
  before it and just after it, half the room each, and the rest of either side's share to
  the other where one side of the document runs out (a context piece may be a word's
  middle: it is not labelled)."""
  document = sentences[i].document
  def side(order):  # the document's sentences in `order`, until they hold `room` pieces
    out, count = [], 0
    for j in order:
      if sentences[j].document != document or count >= room:
        break
      out.append(encoded[j][0])
      count += len(encoded[j][0])
    return out
  left = [p for pieces in reversed(side(range(i - 1, -1, -1))) for p in pieces]
  right = [p for pieces in side(range(i + 1, len(sentences))) for p in pieces]
  take_left = min(len(left), max(room // 2, room - len(right)))
  take_right = min(len(right), room - take_left)
  return left[len(left) - take_left:], right[:take_right]


def word_tags(logits: np.ndarray, placed: Sequence[np.ndarray],
              sentences: Sequence[Sentence], labels: Sequence[str]) -> List[List[str]]:
  """Each sentence's predicted tags from the per-token logits [N, T, labels]: the argmax at
  each word's first piece (featurize's `placed`); O for a word without one."""
  out = []
  for i, s in enumerate(sentences):
    tags = ['O'] * len(s.words)
    best = np.asarray(logits[i]).argmax(-1)
    for position, word in placed[i]:
      tags[word] = labels[int(best[position])]
    out.append(tags)
  return out


def chunks(tags: Sequence[str]) -> List[Tuple[str, int, int]]:
  """The entities of a BIO tag sequence as (type, start, end), as conlleval.pl reads them:
  an entity starts at B-, or at an I- after O or after a tag of another type (IOB1 and
  IOB2 alike), and ends before O, before a B-, or before a tag of another type."""
  found, start, kind = [], None, None
  for i, tag in enumerate(list(tags) + ['O']):
    prefix, _, this = tag.partition('-')
    if start is not None and (prefix in ('O', 'B') or this != kind):
      found.append((kind, start, i))
      start = None
    if prefix in ('B', 'I') and start is None:
      start, kind = i, this
  return found


def write_predictions(path: str, sentences: Sequence[Sentence],
                      predicted: Sequence[Sequence[str]]) -> str:
  """conlleval.pl's input: a line `word gold predicted` per word, a blank line after each
  sentence."""
  lines = []
  for s, tags in zip(sentences, predicted):
    lines += [f'{w} {g} {p}\n' for w, g, p in zip(s.words, s.tags, tags)] + ['\n']
  return str(storage.write_text(path, ''.join(lines)))

