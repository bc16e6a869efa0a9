"""Document sources for pretraining: the embedded corpus, local text files, tfds datasets.

`config.data.sources` names them, several joined by ';' and interleaved in the order
`config.data.weights` draws (every document is used once whatever the weights: they decide
which documents share a block, not how often each source is read; list a source twice to
read it twice, weight 0 leaves it out):

  embedded                        the CC0 State of the Union corpus shipped in data/embedded/
  files:<glob>                    BERT's format: one sentence per line, a blank line between
                                  documents; gzip or plain (detected from the bytes)
  tfds:<name>[:<split>]           a tensorflow-datasets text dataset, e.g.
                                  tfds:wikipedia/20230601.en (split 'train' by default) or
                                  tfds:wikipedia/20230601.en:train[:10%]; each example's
                                  text feature ('text' unless told) is one document, its
                                  paragraphs (lines) split into sentences
  hf:<dataset>[@<revision>][:<config>][:<split>]
                                  a Hugging Face dataset, streamed, e.g.
                                  hf:wikimedia/wikipedia:20231101.en or
                                  hf:HuggingFaceFW/fineweb-edu:sample-10BT:train (split
                                  'train' by default); @<revision> pins a hub commit or tag
                                  (prepared data is known by the source's text, so a pinned
                                  revision is what makes a resumed preparation read the same
                                  rows); <dataset> may also be a local directory
                                  (parquet/json/csv files, or one written by save_to_disk).
                                  Each row's text column ('text' unless config.data.
                                  hf_text_column says) is one document, split like tfds's;
                                  a corpus with a sentence per row (BookCorpus's copies on
                                  the hub) needs config.data.hf_rows_per_document > 1 (one
                                  number for every hf: source, or one per source like
                                  weights), so that consecutive rows make a document and
                                  next-sentence pairs exist (the groups ignore the corpus's
                                  own boundaries, such as books)

Every source streams a document (a list of sentence strings) at a time, so memory does not
grow with the corpus. What is skipped is counted in `stats` (a collections.Counter):
'empty_files' (files with no document), 'non_utf8_lines', 'empty_documents'.

Hugging Face datasets stream from the hub (network, or its cache with HF_HUB_OFFLINE=1) or
from a local directory; nothing is downloaded in the tests or the default run.
tfds datasets are read, never downloaded here: build them once where there is network
(`tfds build wikipedia/20230601.en --data_dir=DIR`, which needs apache-beam and
mwparserfromhell) and set `config.data.tfds_data_dir=DIR`.
"""

import collections
import contextlib
import glob as glob_lib
import gzip
import json
import os
import re
import zlib
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
from absl import logging

from realformer import config_checks
from realformer import storage

EMBEDDED_CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'embedded',
                               'sotu.txt.gz')
_SOURCES_HELP = ('use embedded, files:<glob>, tfds:<name>[:<split>] or '
                 'hf:<dataset>[@<revision>][:<config>][:<split>], several joined by ";"')

# Words that end with a period without ending the sentence.
_ABBREVIATIONS = frozenset("""
mr mrs ms dr st sr jr messrs gen col capt lt maj sgt adm gov hon rev prof pres supt
jan feb mar apr jun jul aug sep sept oct nov dec no nos vol art sec ch pp vs viz etc
inc co corp ltd bros dept u.s u.s.a a.m p.m e.g i.e cf al ft mt
""".split())
# A candidate boundary: terminal punctuation (with closing quotes/brackets), whitespace, then
# a word character, perhaps after an opening quote (split_sentences asks a capital or a digit
# of it: any script's capitals, which a regular expression of Python's cannot name).
_BOUNDARY = re.compile(r'([.!?]["\'\u201d\u2019)\]]*)\s+(?=["\'\u201c\u2018(\[]?\w)')
_OPENERS = '"\'\u201c\u2018(['


def split_sentences(text: str) -> List[str]:
  """Rule-based sentence splitter for one paragraph of cased text (English's abbreviations).

  Splits after '.', '!' or '?' (and any closing quotes or brackets) when whitespace and a
  capital letter (of any script: Élysée, Это) or a digit follow, except after an
  abbreviation (Mr., Jan., U.S., p.m., ...) or a single-letter initial (J. Q. Adams).
  Decimals (1.5) never split: no whitespace follows the period. Text in lower case is not
  split (give such a corpus one sentence per line, files:). The text of each sentence is
  kept as is (no case or spacing changes).
  """
  sentences, start = [], 0
  for m in _BOUNDARY.finditer(text):
    first = text[m.end() + (text[m.end()] in _OPENERS)]  # (the lookahead's \w)
    if not (first.isupper() or first in '0123456789'):
      continue
    words = text[start:m.start(1) + 1].split()
    last = words[-1].rstrip('.').lstrip(_OPENERS).lower() if words else ''
    if m.group(1).startswith('.') and (last in _ABBREVIATIONS or re.fullmatch(r'[a-z]', last)):
      continue
    sentence = text[start:m.end(1)].strip()
    if sentence:
      sentences.append(sentence)
    start = m.end()
  tail = text[start:].strip()
  if tail:
    sentences.append(tail)
  return sentences


# A stream yields (document, progress) pairs; progress is the fraction of the source read so
# far (in [0, 1]), or None where the source's size is unknown.
_Stream = Iterator[Tuple[List[str], Optional[float]]]


def _open_binary(raw, size: int):
  """(lines, fraction read): `raw` (a file of `size` bytes) itself, or a gzip reader over it
  (recognised by its magic bytes), with a function telling how far through the file the
  reader is. For gzip: the text read over the size the trailer states (exact for one
  member), but never past the compressed bytes read (ahead by the reader's buffer), which
  hold where the trailer's size is not the whole text's: a file of several members
  (`cat a.gz b.gz`, bgzip), whose trailer is the last member's, or one over 4 GiB (modulo
  2**32)."""
  if raw.read(2) != b'\x1f\x8b':
    raw.seek(0)
    return raw, lambda: raw.tell() / max(size, 1)
  raw.seek(max(size - 4, 0))
  isize = int.from_bytes(raw.read(4), 'little')
  raw.seek(0)
  reader = gzip.GzipFile(fileobj=raw, mode='rb')
  return reader, lambda: min(reader.tell() / max(isize, 1), raw.tell() / max(size, 1))


def _file_stream(path: str, stats: collections.Counter, done_bytes: int = 0,
                 total_bytes: int = 0) -> _Stream:
  """Documents of one BERT-format file, with the progress through `total_bytes` (the sizes
  of all files of its source, of which `done_bytes` were read before this one)."""
  size = storage.path(path).stat().length
  total_bytes = total_bytes or size
  n = 0
  with storage.open_binary(path) as raw:
    lines, fraction = _open_binary(raw, size)
    progress = lambda: min(1.0, (done_bytes + fraction() * size) / max(total_bytes, 1))
    try:
      doc = []
      for line_bytes in lines:
        try:
          line = line_bytes.decode('utf-8').strip()
        except UnicodeDecodeError:
          stats['non_utf8_lines'] += 1
          continue
        if line:
          doc.append(line)
        elif doc:
          n += 1
          yield doc, progress()
          doc = []
      if doc:
        n += 1
        yield doc, progress()
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
      raise ValueError(f'{path} is a corrupt or truncated gzip file ({e}); re-create it or '
                       'leave it out of config.data.sources') from None
  if n == 0:
    stats['empty_files'] += 1


def iter_file_documents(path: str, stats: collections.Counter) -> Iterator[List[str]]:
  """Documents of one BERT-format file: sentences per line, blank lines between documents."""
  return (doc for doc, _ in _file_stream(path, stats))


def _files_stream(pattern: str, stats: collections.Counter) -> _Stream:
  found = storage.glob_files(pattern)
  if not found:
    folder = storage.path(pattern).is_dir()
    raise FileNotFoundError(f'data source files:{pattern} matches no file; ' + (
        f'it is a folder: give its files, files:{pattern.rstrip("/")}/*' if folder else
        'check the path in config.data.sources'))
  paths, sizes = [p for p, _ in found], [n for _, n in found]
  done = 0
  for path, size in zip(paths, sizes):
    yield from _file_stream(path, stats, done, sum(sizes))
    done += size


def load_tfds_task(name: str, split: str, data_dir: Optional[str], offline: str):
  """tfds.load of a fine-tuning task, which tfds downloads and prepares on first use; a
  failure (most often no network, after tfds's retries) is one line with the offline route
  (`offline`: what to pass instead). Yields numpy examples."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  with _tfds_failure(name, offline):
    return tfds.as_numpy(tfds.load(name, split=split, data_dir=data_dir,
                                   shuffle_files=False))


def prepare_tfds_task(name: str, data_dir: Optional[str], offline: str) -> None:
  """Downloads and prepares tfds dataset `name` into `data_dir` where it is not there yet
  (what load_tfds_task would do first), saying so first (without network tfds gives up only
  after minutes of retries): on one host of several that share the folder, before the
  others read it (tfds's preparations of one dataset at once collide at their final
  rename)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  with _tfds_failure(name, offline):
    builder = tfds.builder(name, data_dir=data_dir)
    if builder.is_prepared():
      return
    logging.warning('%s is not in %s: tfds downloads and prepares it there once (without '
                    'network it gives up after about 3 minutes of retries; then %s)', name,
                    builder.data_dir, offline)
    builder.download_and_prepare()


@contextlib.contextmanager
def _tfds_failure(name: str, offline: str):
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except (requests, tfds, OSError, ...)
    text = ' '.join(str(e).split())
    host = re.search(r"\bhost='([^']+)'", text)  # requests' and urllib3's connection errors
    cause = re.search(r'Caused by (\w+)\(', text)  # (name resolution, TLS, a proxy, ...)
    why = (f'could not reach {host.group(1)}' + (f' ({cause.group(1)})' if cause else '')
           if host else ' '.join((str(e).strip().splitlines() or [''])[0].split()))
    if len(why) > 160:
      why = why[:157] + '...'
    raise ValueError(f'tfds could not load {name} ({type(e).__name__}: {why}); without '
                     f'network, {offline}') from e


def _tfds_stream(spec: str, data_dir: Optional[str], text_feature: str,
                 stats: collections.Counter) -> _Stream:
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  name, _, split = spec.partition(':')
  split = split or 'train'
  hint = (f'build it where there is network (`tfds build {name} --data_dir=DIR`) and set '
          'config.data.tfds_data_dir=DIR')
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise ValueError(f'unknown tfds dataset {name!r} in config.data.sources: '
                     f'{str(e).splitlines()[0]}') from None
  try:
    ds = builder.as_dataset(split=split, shuffle_files=False, read_config=tfds.ReadConfig(
        interleave_cycle_length=1))  # the dataset's order
  except AssertionError:  # tfds: "Dataset ...: could not find data in ..."
    raise FileNotFoundError(f'tfds dataset {name!r} is not prepared in {builder.data_dir!r}; '
                            f'{hint}') from None
  features = builder.info.features
  if text_feature not in features:
    raise ValueError(f'tfds dataset {name!r} has no feature {text_feature!r} (it has '
                     f'{sorted(features.keys())}); name its text feature with tfds_text_feature')
  try:
    total = builder.info.splits[split].num_examples
  except (KeyError, ValueError):
    total = 0
  texts = (t.decode('utf-8', errors='replace') if isinstance(t, bytes) else str(t)
           for t in tfds.as_numpy(ds.map(lambda ex: ex[text_feature])))
  yield from _text_documents(texts, total, stats)


class Unsplit(str):
  """The text of one document (paragraphs on their own lines, not blank) whose sentences are
  split only when asked (`sentences`): iter_documents(lazy=True) yields these, so that each
  preparation worker splits only the documents it owns, not every document of the stream."""


def sentences(doc: Union[List[str], 'Unsplit']) -> List[str]:
  """A document's sentences: split_sentences of each paragraph of an Unsplit text; a list of
  sentences as it is."""
  if isinstance(doc, Unsplit):
    return [s for para in doc.split('\n') for s in split_sentences(para)]
  return doc


def _text_documents(texts: Iterable[str], total: int, stats: collections.Counter) -> _Stream:
  """Texts (one per document; paragraphs on their own lines) -> Unsplit documents; a blank
  text is counted and dropped (a text that is not blank has at least one sentence: the
  splitter keeps every non-blank character, so emptiness needs no split)."""
  for i, text in enumerate(texts, 1):
    if text and text.strip():
      yield Unsplit(text), min(1.0, i / total) if total else None
    else:
      stats['empty_documents'] += 1


class SplitNotFoundError(ValueError):
  """A Hugging Face dataset without the asked split (e.g. GLUE's optional test)."""


class SourceUnavailableError(ValueError):
  """A Hugging Face dataset that could not be loaded (no network, the hub refusing, a path
  not there): a one-line error, after which a preparation keeps its finished workers (the
  next attempt, with the source back, reuses them)."""


def _split_slice(name: str, split: str, what: str) -> Tuple[str, Optional[slice]]:
  """'train[1000:5000]' -> ('train', slice(1000, 5000)): rows by index, which a streamed
  split can skip and take (datasets' own slicing, percentages included, needs the whole
  split downloaded)."""
  base, bracket, rest = split.partition('[')
  if not bracket:
    return split, None
  m = re.fullmatch(r'(\d*):(\d*)\]', rest)
  if not m:
    raise ValueError(f'hf:{name} in {what}: split {split!r} is not <split>[<start>:<stop>] '
                     f'with row numbers (e.g. {base}[:100000]; percentages are not supported)')
  start, stop = (int(x) if x else None for x in m.groups())
  return base, slice(start, stop)


def _sliced(ds, rows: Optional[slice]):
  if rows is None:
    return ds
  start = rows.start or 0
  if hasattr(ds, '__len__'):  # a Dataset in memory or on disk
    stop = len(ds) if rows.stop is None else min(rows.stop, len(ds))
    return ds.select(range(min(start, len(ds)), stop))
  ds = ds.skip(start) if start else ds
  return ds if rows.stop is None else ds.take(max(0, rows.stop - start))


def load_hf(name: str, config: str = '', split: str = 'train', streaming: bool = True,
            what: str = 'config.data.sources'):
  """One split of a Hugging Face dataset: a hub name, a local directory of data files (its
  subdirectory `config`, if given), or a directory written by save_to_disk. The split may
  take rows by number, e.g. 'train[:100000]'."""
  split, rows = _split_slice(name, split, what)
  return _sliced(_load_hf(name, config, split, streaming, what), rows)


def _load_hf(name: str, config: str, split: str, streaming: bool, what: str):
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(f'hf:{name} in {what} needs the datasets package: pip install -r '
                     'requirements.txt') from None
  datasets.logging.set_verbosity_error()
  datasets.disable_progress_bars()
  local = os.path.isdir(name)
  saved = os.path.join(name, config) if config else name
  name, revision = (name, None) if local else (name.partition('@')[0],
                                               name.partition('@')[2] or None)
  try:
    if local and (os.path.isfile(os.path.join(saved, 'dataset_dict.json')) or
                  os.path.isfile(os.path.join(saved, 'state.json'))):
      ds = datasets.load_from_disk(saved)
      if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
          raise SplitNotFoundError(f'hf:{name} in {what}: no split {split!r} in {saved} (it '
                                   f'has {list(ds)})')
        ds = ds[split]
      return ds
    if local:  # the hub's file names, <split>-*.parquet (or <split>.jsonl, ...), by split
      base = split
      patterns = [p for p in (f'{base}-*', f'{base}.*') if glob_lib.glob(os.path.join(saved, p))]
      if not patterns:
        raise SplitNotFoundError(f'hf:{name} in {what}: no data files {base}-* or {base}.* in '
                                 f'{saved}')
      prefix = f'{config}/' if config else ''
      return datasets.load_dataset(name, data_files={base: [prefix + p for p in patterns]},
                                   split=split, streaming=streaming)
    return datasets.load_dataset(name, config or None, split=split, streaming=streaming,
                                 revision=revision)
  except SplitNotFoundError:
    raise
  except ValueError as e:
    error = SplitNotFoundError if 'split' in str(e).lower() else ValueError
    raise error(f'hf:{name} in {what}: {str(e).splitlines()[0]}') from None
  except (FileNotFoundError, ConnectionError, OSError,
          datasets.exceptions.DatasetNotFoundError) as e:
    hint = ('check the path' if local or name.startswith(('/', '.')) else
            'check the name on huggingface.co/datasets (it needs network, or the hub cache '
            'with HF_HUB_OFFLINE=1)')
    raise SourceUnavailableError(
        f'Hugging Face dataset {name!r} (config {config or "default"}, split '
        f'{split!r}) in {what} could not be loaded: '
        f'{str(e).splitlines()[0] if str(e) else type(e).__name__}; {hint}') from None


def _hf_parts(spec: str) -> Tuple[str, str, str]:
  """'<dataset>[:<config>][:<split>]' (after 'hf:') -> (dataset, config, split). Colons
  inside a split's brackets ('train[:1000]') are the split's; a single field with brackets
  after the dataset is a split ('hf:<dataset>:train[:1000]', no config)."""
  fields, depth, current = [], 0, ''
  for c in spec:
    depth += (c == '[') - (c == ']')
    if c == ':' and depth == 0:
      fields.append(current)
      current = ''
    else:
      current += c
  name, rest = fields[0] if fields else current, (fields + [current])[1:]
  if len(rest) == 1 and '[' in rest[0]:
    return name, '', rest[0]
  return name, rest[0] if rest else '', ':'.join(rest[1:])


def _hf_stream(spec: str, text_column: str, stats: collections.Counter,
               rows_per_document: int = 1) -> _Stream:
  name, config, split = _hf_parts(spec)
  ds = load_hf(name, config, split or 'train')
  columns = ds.column_names or list(getattr(ds, 'features', None) or {})
  if columns and text_column not in columns:
    raise ValueError(f'Hugging Face dataset hf:{spec} has no column {text_column!r} (it has '
                     f'{columns}); name its text column with config.data.hf_text_column')
  total = 0
  try:
    total = len(ds)
  except TypeError:  # streaming: the split's size, when the dataset card gives it
    base, rows = _split_slice(name, split or 'train', 'config.data.sources')
    splits = getattr(ds.info, 'splits', None) or {}
    info = splits.get(base) if hasattr(splits, 'get') else None
    total = getattr(info, 'num_examples', 0) or 0
    if rows is not None:  # the rows taken of it
      total = (len(range(total)[rows]) if total else
               rows.stop - (rows.start or 0) if rows.stop is not None else 0)

  def texts():
    group = []
    for row in ds:
      if text_column not in row:  # a streamed dataset whose columns were not known ahead
        raise ValueError(f'Hugging Face dataset hf:{spec} has no column {text_column!r} (its '
                         f'rows have {sorted(row)}); name its text column with '
                         'config.data.hf_text_column')
      group.append(row[text_column] or '')
      if len(group) == rows_per_document:  # consecutive rows, one per line: a document
        yield '\n'.join(t for t in group if t.strip())
        group = []
    if group:
      yield '\n'.join(t for t in group if t.strip())
  yield from _text_documents(texts(), -(-total // rows_per_document), stats)


def _stream(spec: str, tfds_data_dir: Optional[str], tfds_text_feature: str,
            stats: collections.Counter, hf_text_column: str = 'text',
            hf_rows_per_document: int = 1) -> _Stream:
  if spec == 'embedded':
    return _file_stream(EMBEDDED_CORPUS, stats)
  if spec.startswith('files:'):
    return _files_stream(spec[len('files:'):], stats)
  if spec.startswith('tfds:'):
    return _tfds_stream(spec[len('tfds:'):], tfds_data_dir, tfds_text_feature, stats)
  if spec.startswith('hf:'):
    return _hf_stream(spec[len('hf:'):], hf_text_column, stats, hf_rows_per_document)
  raise ValueError(f'unknown data source {spec!r} in config.data.sources; {_SOURCES_HELP}')


def files_signature(sources: str) -> Optional[str]:
  """What the `files:` sources, and the `hf:` sources that are local directories, of
  `sources` hold now, as a short string: the number of files, their bytes, and a digest of
  every file's name and size. A prepared corpus records it, so an edited, converted, added
  or removed file is noticed instead of silently reusing instances made from the old text
  (names and sizes, not folders or times: a copy of the corpus at the same path on another
  host matches). None without such sources or when they match nothing here (prepared data
  can be used where the raw text is not). A hub dataset is known by its name only: pin it
  with hf:<dataset>@<revision> so that a resumed or repeated preparation reads the same rows."""
  matched = []
  for spec in (s.strip() for s in sources.split(';')):
    if spec.startswith('files:'):
      matched += [(os.path.basename(p), n)
                  for p, n in storage.glob_files(spec[len('files:'):])]
    elif spec.startswith('hf:') and os.path.isdir(_hf_parts(spec[3:])[0]):
      matched += _hf_local_files(spec[3:])
  if not matched:
    return None
  digest = zlib.crc32(repr(matched).encode())
  return f'{len(matched)} files, {sum(n for _, n in matched)} bytes, crc {digest:08x}'


def _hf_local_files(spec: str) -> List[Tuple[str, int]]:
  """(name, size) of the files a local hf:<dir>[:<config>][:<split>] source reads: the
  split's data files (<split>-*, <split>.*), or a save_to_disk folder's files (of the split,
  for a DatasetDict); not the folder's other files (caches, READMEs, other splits)."""
  name, config, split = _hf_parts(spec)
  split = (split or 'train').partition('[')[0]
  saved = os.path.join(name, config) if config else name

  def saved_dataset(folder):  # state.json names the arrow files
    try:
      with open(os.path.join(folder, 'state.json')) as f:
        data = [d['filename'] for d in json.load(f).get('_data_files', [])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
      data = []
    return [os.path.join(folder, n) for n in ['state.json', 'dataset_info.json'] + data]

  if os.path.isfile(os.path.join(saved, 'dataset_dict.json')):
    paths = [os.path.join(saved, 'dataset_dict.json')] + saved_dataset(
        os.path.join(saved, split))
  elif os.path.isfile(os.path.join(saved, 'state.json')):
    paths = saved_dataset(saved)
  else:
    paths = [p for pattern in (f'{split}-*', f'{split}.*')
             for p in glob_lib.glob(os.path.join(saved, pattern))]
  return [(os.path.relpath(p, saved), os.path.getsize(p)) for p in sorted(set(paths))
          if os.path.isfile(p)]  # glob passes over dot-files; a dangling link is no file


def parse_weights(weights: Union[str, Sequence[float], None], n: int) -> Optional[np.ndarray]:
  """Mixing probabilities from ';'-joined weights (or numbers); None when none are given."""
  if weights is None or (isinstance(weights, str) and not weights.strip()):
    return None
  try:
    w = np.array([float(x) for x in (weights.split(';') if isinstance(weights, str)
                                     else weights)])
  except ValueError:
    w = np.array([])
  if len(w) != n or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
    raise ValueError(f'config.data.weights={weights!r} must give {n} non-negative weights '
                     'joined by ";", one per source (or be empty: proportional to size)')
  return w / w.sum()


def unpinned_hub_sources(sources: str) -> List[str]:
  """The sources of `sources` that stream a Hugging Face hub dataset without a pinned
  revision (hf:<dataset>@<revision>): each preparation worker streams the dataset on its
  own, so the hub's rows changing between workers, hosts or a resumed preparation would
  duplicate or lose documents."""
  return [spec for spec in source_specs(sources) if spec.startswith('hf:') and
          '@' not in (name := _hf_parts(spec[3:])[0]) and not os.path.isdir(name)]


def source_specs(sources: str) -> List[str]:
  """config.data.sources -> its ';'-joined sources, in order (empty ones dropped)."""
  return [s.strip() for s in sources.split(';') if s.strip()]


def iter_documents(sources: str, *, tfds_data_dir: Optional[str] = None,
                   stats: Optional[collections.Counter] = None,
                   weights: Union[str, Sequence[float], None] = None, seed: int = 0,
                   tfds_text_feature: str = 'text',
                   hf_text_column: str = 'text', hf_rows_per_document: Union[int, str] = 1,
                   lazy: bool = False, numbered: bool = False) -> Iterator[List[str]]:
  """Yields the documents (lists of sentences) of `config.data.sources`, streaming; with
  lazy=True, the documents of tfds and hf sources as Unsplit texts (`sentences(doc)` splits
  one), the same documents in the same order; with numbered=True, (n, document) pairs, n the
  document's number in its own source (the same for a source listed twice).

  Several sources are interleaved until every one is exhausted. With `weights`, each next
  document comes from a source drawn with those probabilities (renormalised over the sources
  left; deterministic from `seed`); a source of weight 0 is never read. Without, the
  interleave is proportional to size: the next document comes from the source that is least
  far through its data (bytes read for files, examples for tfds), so all end together; if a
  source cannot tell its size (a tfds split without counts), round robin.
  """
  stats = collections.Counter() if stats is None else stats
  specs = source_specs(sources)
  if not specs:
    raise ValueError(f'config.data.sources is empty; {_SOURCES_HELP}')
  probs = parse_weights(weights, len(specs))
  rows = config_checks.rows_per_document(hf_rows_per_document, sources)
  streams = [_stream(s, tfds_data_dir, tfds_text_feature, stats, hf_text_column, r)
             for s, r in zip(specs, rows)]
  rng = np.random.default_rng(seed)
  progress = [0.0] * len(streams)
  yielded = [0] * len(streams)  # documents given of each source
  live = [i for i in range(len(streams)) if probs is None or probs[i] > 0]
  turn = 0
  while live:
    if probs is not None:
      p = probs[live]
      i = live[rng.choice(len(live), p=p / p.sum())]
    elif None in progress:
      i = live[turn % len(live)]
      turn += 1
    else:
      i = min(live, key=lambda j: (progress[j], j))
    item = next(streams[i], None)
    if item is None:
      live.remove(i)
      continue
    doc, progress[i] = item
    if isinstance(doc, Unsplit):
      doc = doc if lazy else sentences(doc)
    else:
      doc = [s for s in doc if s.strip()]
      if not doc:
        stats['empty_documents'] += 1
        continue
    yield (yielded[i], doc) if numbered else doc
    yielded[i] += 1
