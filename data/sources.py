"""Document sources for pretraining: the embedded corpus, local text files, tfds datasets.

`config.data.sources` names them, several joined by ';' and mixed by `config.data.weights`:

  embedded                        the CC0 State of the Union corpus shipped in data/embedded/
  files:<glob>                    BERT's format: one sentence per line, a blank line between
                                  documents; gzip or plain (detected from the bytes)
  tfds:<name>[:<split>]           a tensorflow-datasets text dataset, e.g.
                                  tfds:wikipedia/20230601.en or tfds:bookcorpus; its 'text'
                                  feature is split into sentences (paragraphs at newlines)

Every source streams: a document (a list of sentence strings) at a time, so memory does not
grow with the corpus. What is skipped is counted in `stats` (a collections.Counter):
empty files, lines that are not UTF-8, empty documents.
"""

import collections
import glob as glob_lib
import gzip
import os
import re
from typing import Iterable, Iterator, List, Optional

import numpy as np

EMBEDDED_CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'embedded',
                               'sotu.txt.gz')

# Words that end with a period without ending the sentence.
_ABBREVIATIONS = frozenset("""
mr mrs ms dr st sr jr messrs gen col capt lt maj sgt adm gov hon rev prof pres supt
jan feb mar apr jun jul aug sep sept oct nov dec no nos vol art sec ch pp vs viz etc
inc co corp ltd bros dept u.s u.s.a a.m p.m e.g i.e cf al ft mt
""".split())
_BOUNDARY = re.compile(r'([.!?]["\')\]]*)\s+(?=["\'(\[]?[A-Z0-9])')


def split_sentences(text: str) -> List[str]:
  """Rule-based English sentence splitter (abbreviations and initials do not end sentences)."""
  sentences, start = [], 0
  for m in _BOUNDARY.finditer(text):
    end = m.end(1)
    words = text[start:m.start(1) + 1].split()
    last = words[-1].rstrip('.').lower() if words else ''
    last = last.lstrip('"\'([')
    if m.group(1).startswith('.') and (last in _ABBREVIATIONS or re.fullmatch(r'[a-z]', last)):
      continue
    sentence = text[start:end].strip()
    if sentence:
      sentences.append(sentence)
    start = m.end()
  tail = text[start:].strip()
  if tail:
    sentences.append(tail)
  return sentences


def _open_text(path: str):
  with open(path, 'rb') as f:
    magic = f.read(2)
  return gzip.open(path, 'rb') if magic == b'\x1f\x8b' else open(path, 'rb')


def iter_file_documents(path: str, stats: collections.Counter) -> Iterator[List[str]]:
  """Documents of one BERT-format file: sentences per line, blank lines between documents."""
  doc, lines = [], 0
  with _open_text(path) as f:
    for raw in f:
      lines += 1
      try:
        line = raw.decode('utf-8').strip()
      except UnicodeDecodeError:
        stats['non_utf8_lines'] += 1
        continue
      if line:
        doc.append(line)
      elif doc:
        yield doc
        doc = []
  if doc:
    yield doc
  if lines == 0:
    stats['empty_files'] += 1


def _files(pattern: str, stats) -> Iterator[List[str]]:
  paths = sorted(glob_lib.glob(os.path.expanduser(pattern)))
  if not paths:
    raise FileNotFoundError(f'data source files:{pattern} matches no file; check the path in '
                            'config.data.sources')
  for path in paths:
    yield from iter_file_documents(path, stats)


def _tfds(spec: str, data_dir: Optional[str], stats) -> Iterator[List[str]]:
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  name, _, split = spec.partition(':')
  builder = tfds.builder(name, data_dir=data_dir)
  try:
    ds = builder.as_dataset(split=split or 'train', shuffle_files=False)
  except AssertionError as e:  # tfds: "Dataset ... not found / not prepared"
    raise FileNotFoundError(
        f'tfds dataset {name!r} is not prepared in {builder.data_dir!r}: run '
        f'`tfds build {name} --data_dir=DIR` on a machine with network and set '
        f'config.data.tfds_data_dir=DIR ({e})') from None
  for example in tfds.as_numpy(ds):
    text = example['text']
    text = text.decode('utf-8', errors='replace') if isinstance(text, bytes) else str(text)
    doc = [s for para in text.split('\n') for s in split_sentences(para)]
    if doc:
      yield doc
    else:
      stats['empty_documents'] += 1


def _single(spec: str, tfds_data_dir, stats) -> Iterator[List[str]]:
  if spec == 'embedded':
    return iter_file_documents(EMBEDDED_CORPUS, stats)
  if spec.startswith('files:'):
    return _files(spec[len('files:'):], stats)
  if spec.startswith('tfds:'):
    return _tfds(spec[len('tfds:'):], tfds_data_dir, stats)
  raise ValueError(f'unknown data source {spec!r} in config.data.sources; use embedded, '
                   'files:<glob> or tfds:<name>[:<split>], several joined by ";"')


def parse_weights(weights: str, n: int) -> Optional[np.ndarray]:
  if not weights:
    return None
  w = np.array([float(x) for x in weights.split(';')])
  if len(w) != n or (w < 0).any() or w.sum() <= 0:
    raise ValueError(f'config.data.weights={weights!r} must give {n} non-negative weights '
                     'joined by ";", one per source')
  return w / w.sum()


def iter_documents(sources: str, *, tfds_data_dir: Optional[str] = None,
                   stats: Optional[collections.Counter] = None, weights: str = '',
                   seed: int = 0) -> Iterator[List[str]]:
  """Yields documents (lists of sentences) of `config.data.sources`, streaming.

  Several sources are interleaved: each next document comes from a source drawn with the
  given weights (deterministic from `seed`), or round-robin when `weights` is empty, until
  every source is exhausted.
  """
  stats = collections.Counter() if stats is None else stats
  specs = [s.strip() for s in sources.split(';') if s.strip()]
  if not specs:
    raise ValueError('config.data.sources is empty; use embedded, files:<glob> or tfds:<name>')
  probs = parse_weights(weights, len(specs))
  iters = [_single(s, tfds_data_dir, stats) for s in specs]
  rng = np.random.default_rng(seed)
  live = list(range(len(iters)))
  turn = 0
  while live:
    if probs is None:
      i = live[turn % len(live)]
      turn += 1
    else:
      p = probs[live] / probs[live].sum() if probs[live].sum() > 0 else None
      if p is None:
        return
      i = live[rng.choice(len(live), p=p)]
    doc = next(iters[i], None)
    if doc is None:
      live.remove(i)
      continue
    doc = [s for s in doc if s.strip()]
    if doc:
      yield doc
    else:
      stats['empty_documents'] += 1


def iter_sentences(documents: Iterable[List[str]]) -> Iterator[str]:
  for doc in documents:
    yield from doc
