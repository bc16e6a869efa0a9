"""data.sources: the sentence splitter, the embedded corpus, BERT-format files (gzip or
plain, bad bytes and empty files counted), tfds datasets read through the Wikipedia code
path from a dataset built locally, and mixing several sources."""

import base64
import collections
import gzip
import itertools
import json
import os
import shutil
import tarfile

import numpy as np
import pytest
import tensorflow_datasets as tfds

from data import sources


def test_sentence_splitter_rules():
  text = ('Mr. Smith went to Washington on Jan. 5, 1790. The U.S. Senate met! Did J. Q. '
          'Adams speak? "Yes." He spoke at 3 p.m. Then 2 members left. The debt fell by '
          '$1.5 million, i.e. 3.2 per cent. \u201cWhy?\u201d (Nobody knew.) It was '
          'St. Louis, Mo., and Gen. Grant of the Dept. of War. 1791 came.')
  assert sources.split_sentences(text) == [
      'Mr. Smith went to Washington on Jan. 5, 1790.', 'The U.S. Senate met!',
      'Did J. Q. Adams speak?', '"Yes."', 'He spoke at 3 p.m. Then 2 members left.',
      'The debt fell by $1.5 million, i.e. 3.2 per cent.', '\u201cWhy?\u201d',
      '(Nobody knew.)', 'It was St. Louis, Mo., and Gen. Grant of the Dept. of War.',
      '1791 came.']
  assert sources.split_sentences('  ') == []
  assert sources.split_sentences('no capital after. so one sentence') == [
      'no capital after. so one sentence']
  # Any script's capitals open a sentence (a corpus in French, Greek or Russian is split).
  assert sources.split_sentences('Le président est arrivé. Élysée confirme. Ώρα. (Это ещё.) '
                                 'é minuscule.') == [
      'Le président est arrivé.', 'Élysée confirme.', 'Ώρα.', '(Это ещё.) é minuscule.']


def test_embedded_corpus_is_the_speeches_in_bert_format():
  stats = collections.Counter()
  docs = list(sources.iter_documents('embedded', stats=stats))
  assert len(docs) == 233 and not stats  # one document per speech, 1790-2021
  assert docs[0][0].startswith('Fellow-Citizens of the Senate and House of Representatives')
  assert 60_000 < sum(map(len, docs)) < 70_000
  assert all(s and s == s.strip() for doc in docs for s in doc)
  with gzip.open(sources.EMBEDDED_CORPUS, 'rt', encoding='utf-8') as f:
    assert f.read().count('\n\n') == 233


def test_files_gzip_and_plain_bad_bytes_and_empty_files(tmp_path):
  (tmp_path / 'a.txt').write_bytes(b'First one.\r\nSecond one.\n\n\n\nOther doc.\n'
                                   b'\xff\xfe bad\nStill other.\n')
  with gzip.open(tmp_path / 'b.txt.gz', 'wb') as f:
    f.write(b'Zipped sentence.\nAnother.\n\n')
  with gzip.open(tmp_path / 'c.data', 'wb') as f:  # gzip is told by its bytes, not its name
    f.write('Caf\u00e9 \u201cquoted\u201d.\n'.encode())
  (tmp_path / 'd.txt').write_bytes(b'')
  (tmp_path / 'e.txt').write_bytes(b'\n\n  \n')
  (tmp_path / 'sub').mkdir()  # a directory the glob matches is not a file
  stats = collections.Counter()
  docs = list(sources.iter_documents(f'files:{tmp_path}/*', stats=stats))
  assert docs == [['First one.', 'Second one.'], ['Other doc.', 'Still other.'],
                  ['Zipped sentence.', 'Another.'], ['Caf\u00e9 \u201cquoted\u201d.']]
  assert stats == {'non_utf8_lines': 1, 'empty_files': 2}
  assert list(sources.iter_file_documents(str(tmp_path / 'b.txt.gz'), stats)) == [docs[2]]

  with pytest.raises(FileNotFoundError, match=r'files:.*\*\.nothing matches no file'):
    list(sources.iter_documents(f'files:{tmp_path}/*.nothing'))
  (tmp_path / 'cut.gz').write_bytes((tmp_path / 'b.txt.gz').read_bytes()[:20])
  with pytest.raises(ValueError, match='cut.gz is a corrupt or truncated gzip'):
    list(sources.iter_documents(f'files:{tmp_path}/cut.gz'))
  with pytest.raises(ValueError, match='unknown data source'):
    list(sources.iter_documents('wikipedia'))
  with pytest.raises(ValueError, match='sources is empty'):
    list(sources.iter_documents(' ; '))


def write_docs(path, name, n, compress=False):
  text = ''.join(f'{name} {i} first.\n{name} {i} second.\n\n' for i in range(n))
  if compress:
    with gzip.open(path, 'wt') as f:
      f.write(text)
  else:
    path.write_text(text)


def test_mixing_by_weights_is_deterministic(tmp_path):
  write_docs(tmp_path / 'a.txt', 'a', 200)
  write_docs(tmp_path / 'b.txt', 'b', 200)
  spec = f'files:{tmp_path}/a.txt;files:{tmp_path}/b.txt'

  def firsts(**kwargs):
    return [d[0].split()[0] for d in sources.iter_documents(spec, **kwargs)]

  first = firsts(weights='3;1', seed=1)
  assert first == firsts(weights=[3, 1], seed=1)  # numbers or a ';'-joined string
  assert first != firsts(weights='3;1', seed=2)
  assert len(first) == 400  # every source read to its end
  assert 0.65 < first[:200].count('a') / 200 < 0.85  # a drawn 3x as often while both last
  assert firsts(weights='1;0') == ['a'] * 200  # weight 0: never read
  for bad in ('1', '1;-1', '0;0', 'x;1'):
    with pytest.raises(ValueError, match='must give 2 non-negative weights'):
      list(sources.iter_documents(spec, weights=bad))


def test_no_weights_interleave_in_proportion_to_size(tmp_path):
  write_docs(tmp_path / 'big.txt.gz', 'big', 3000, compress=True)
  write_docs(tmp_path / 'small.txt', 'small', 1000)
  order = [d[0].split()[0] for d in sources.iter_documents(
      f'files:{tmp_path}/big.txt.gz;files:{tmp_path}/small.txt')]
  assert order.count('big') == 3000 and order.count('small') == 1000
  for quarter in range(4):  # 3:1 all along, so both end together
    part = order[quarter * 1000:(quarter + 1) * 1000]
    assert 700 < part.count('big') < 800, quarter


class SotuWiki(tfds.core.GeneratorBasedBuilder):
  """A Wikipedia-shaped tfds dataset (title, text of paragraphs at newlines) built locally
  from inline text: no download."""
  VERSION = tfds.core.Version('1.0.0')
  ARTICLES = [
      ('Union', 'Mr. Lincoln spoke. The U.S. Congress listened.\n\nIt was 1862. Then war.'),
      ('Empty', '\n\n'),
      ('Money', 'The debt was $1.5 billion. Nobody paid.\nA new paragraph.'),
      ('Last', 'One sentence only'),
  ]

  def _info(self):
    return self.dataset_info_from_configs(features=tfds.features.FeaturesDict(
        {'title': tfds.features.Text(), 'text': tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples()}

  def _generate_examples(self):
    for i, (title, text) in enumerate(self.ARTICLES):
      yield i, {'title': title, 'text': text}


@pytest.fixture(scope='module')
def tfds_dir(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp('tfds'))
  SotuWiki(data_dir=data_dir).download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return data_dir


def test_tfds_source_reads_a_prepared_dataset_like_wikipedia(tfds_dir):
  stats = collections.Counter()
  docs = list(sources.iter_documents('tfds:sotu_wiki', tfds_data_dir=tfds_dir, stats=stats))
  assert sorted(docs) == [  # tfds stores examples in the order of their hashed keys
      ['Mr. Lincoln spoke.', 'The U.S. Congress listened.', 'It was 1862.', 'Then war.'],
      ['One sentence only'],
      ['The debt was $1.5 billion.', 'Nobody paid.', 'A new paragraph.']]
  assert stats == {'empty_documents': 1}
  assert docs == list(sources.iter_documents('tfds:sotu_wiki', tfds_data_dir=tfds_dir))
  titles = list(sources.iter_documents('tfds:sotu_wiki', tfds_data_dir=tfds_dir,
                                       tfds_text_feature='title'))
  assert sorted(titles) == [['Empty'], ['Last'], ['Money'], ['Union']]
  sliced = list(sources.iter_documents('tfds:sotu_wiki:train[2:]', tfds_data_dir=tfds_dir,
                                       tfds_text_feature='title'))
  assert sliced == titles[2:]
  mixed = list(sources.iter_documents('tfds:sotu_wiki;embedded', tfds_data_dir=tfds_dir))
  assert len(mixed) == 3 + 233 and mixed.index(docs[-1]) > 100  # spread by progress

  with pytest.raises(ValueError, match=r"has no feature 'body' \(it has \['text', 'title'\]"):
    list(sources.iter_documents('tfds:sotu_wiki', tfds_data_dir=tfds_dir,
                                tfds_text_feature='body'))
  with pytest.raises(FileNotFoundError, match='is not prepared in .*tfds build sotu_wiki '
                     r'--data_dir=DIR.*config.data.tfds_data_dir'):
    list(sources.iter_documents('tfds:sotu_wiki', tfds_data_dir=tfds_dir + '/nothing'))
  with pytest.raises(ValueError, match="unknown tfds dataset 'no_such_dataset_xyz'"):
    list(sources.iter_documents('tfds:no_such_dataset_xyz', tfds_data_dir=tfds_dir))


def test_progress_through_a_gzip_file_of_several_members(tmp_path):
  """A file of two gzip members (`cat a.gz b.gz`: its trailer states only the last one's
  size) reads about half-way at its middle and whole at its end, as one member does."""
  noise = base64.b64encode(np.random.default_rng(0).bytes(1_500_000))  # 2 MB, incompressible
  text = b''.join(noise[i:i + 78] + b'.\n\n' for i in range(0, len(noise), 78))
  one = tmp_path / 'one.gz'
  one.write_bytes(gzip.compress(text + b'Last doc.\n', 1))
  two = tmp_path / 'two.gz'
  two.write_bytes(gzip.compress(text, 1) + gzip.compress(b'Last doc.\n'))
  for path in (one, two):
    progress = [p for _, p in sources._file_stream(str(path), collections.Counter())]
    assert progress == sorted(progress)
    assert 0.4 < progress[len(progress) // 2] < 0.6 and progress[-1] == 1.0


def test_streaming_reads_only_what_is_asked(tmp_path):
  """The first documents of a 4 MB gzip file come before its cut-off end is read (only
  draining the stream meets it); a glob that matches nothing shows up on its first draw."""
  noise = base64.b64encode(np.random.default_rng(0).bytes(3_000_000))  # 4 MB, incompressible
  lines = [noise[i:i + 78] + (b'.\n\n' if i % 234 == 156 else b'.\n')
           for i in range(0, len(noise), 78)]
  big = tmp_path / 'big.txt.gz'
  big.write_bytes(gzip.compress(b''.join(lines), 1)[:-1_000_000])  # its last megabyte gone
  assert big.stat().st_size > 2_000_000
  stream = sources.iter_documents(f'files:{big}')
  assert len(list(itertools.islice(stream, 5))) == 5
  with pytest.raises(ValueError, match='is a corrupt or truncated gzip file'):
    list(stream)
  write_docs(tmp_path / 'a.txt', 'a', 10)
  stream = sources.iter_documents(f'files:{tmp_path}/a.txt;files:{tmp_path}/missing*')
  with pytest.raises(FileNotFoundError):  # the bad glob shows up on its first draw
    list(itertools.islice(stream, 5))


def test_build_embedded_corpus_from_the_npm_layout(tmp_path):
  from data import build_embedded  # pylint: disable=g-import-not-at-top
  package = tmp_path / 'package'
  (package / 'data').mkdir(parents=True)
  speeches = {'1791_george_washington_n': 'Fellow-Citizens: I meet you. Mr. Jefferson left.'
                                          '\nA second paragraph.',
              '1790_george_washington_n': 'The first one.'}
  for name, text in speeches.items():
    (package / 'data' / f'{name}.json').write_text(
        json.dumps({'year': int(name[:4]), 'name': 'George Washington', 'party': 'none',
                    'text': text}))
    (package / 'data' / f'{name}.txt').write_text(text)  # the package's plain copies
  with tarfile.open(tmp_path / 'sotu.tgz', 'w:gz') as tar:
    tar.add(package, arcname='package')
  for i, source in enumerate([package, tmp_path / 'sotu.tgz']):
    out = tmp_path / f'out{i}' / 'sotu.txt.gz'
    out.parent.mkdir()
    index = out.parent / 'speeches.tsv'
    assert build_embedded.build_corpus(str(source), str(out), str(index)) == 2
    assert index.read_text() == ('year\tname\tparty\n1790\tGeorge Washington\tnone\n'
                                 '1791\tGeorge Washington\tnone\n')
    assert list(sources.iter_file_documents(str(out), collections.Counter())) == [
        ['The first one.'],  # chronological
        ['Fellow-Citizens: I meet you.', 'Mr. Jefferson left.', 'A second paragraph.']]
  assert (tmp_path / 'out0/sotu.txt.gz').read_bytes() == (
      tmp_path / 'out1/sotu.txt.gz').read_bytes()  # byte for byte, whatever the input form
  for built in (tmp_path / 'out0/sotu.txt.gz',
                os.path.join(build_embedded.EMBEDDED_DIR, 'sotu.txt.gz')):
    with open(built, 'rb') as f:  # gzip's header names the file as the shipped one does
      head = f.read(64)
    assert head[3] & 0x08 and head[10:head.index(b'\0', 10)] == b'sotu.txt', head
  with pytest.raises(FileNotFoundError, match='no speeches'):
    build_embedded.build_corpus(str(tmp_path / 'out0'), str(tmp_path / 'none.gz'))
  # a rebuild that fails keeps the corpus there was: a missing package, one without speeches
  kept = (tmp_path / 'out0/sotu.txt.gz').read_bytes()
  for bad in (tmp_path / 'missing.tgz', tmp_path / 'out1'):
    with pytest.raises(FileNotFoundError):
      build_embedded.main(['--package_dir', str(bad), '--out_dir', str(tmp_path / 'out0')])
    assert (tmp_path / 'out0/sotu.txt.gz').read_bytes() == kept
    assert sorted(os.listdir(tmp_path / 'out0')) == ['sotu.txt.gz', 'speeches.tsv']


# ---------------------------------------------------------------------------- hf:<dataset>
# Hugging Face datasets written locally by the tests (no network): a save_to_disk directory
# and a directory of parquet files with a config subdirectory, the layout of hub repositories.

HF_TEXTS = ['First article. It has two sentences.\nA second paragraph here.',
            '',  # an empty row: counted, skipped
            'Another document! With a question? Yes.',
            'One line only']


def _hf_expected():
  return [[s for para in t.split('\n') for s in sources.split_sentences(para)]
          for t in HF_TEXTS if t]


def test_hf_source_from_save_to_disk_and_parquet(tmp_path):
  import datasets  # pylint: disable=g-import-not-at-top
  rows = {'text': HF_TEXTS, 'id': list(range(len(HF_TEXTS)))}
  saved = tmp_path / 'saved'
  datasets.DatasetDict({'train': datasets.Dataset.from_dict(rows)}).save_to_disk(str(saved))
  stats = collections.Counter()
  assert list(sources.iter_documents(f'hf:{saved}', stats=stats)) == _hf_expected()
  assert stats['empty_documents'] == 1
  (tmp_path / 'hub' / 'en').mkdir(parents=True)  # <dataset>/<config>/<split>-*.parquet
  datasets.Dataset.from_dict({'body': HF_TEXTS}).to_parquet(
      str(tmp_path / 'hub' / 'en' / 'validation-00000-of-00001.parquet'))
  docs = sources.iter_documents(f'hf:{tmp_path / "hub"}:en:validation', hf_text_column='body')
  assert list(docs) == _hf_expected()
  # Mixed with another source by weights, like any other: weight 0 leaves a source out,
  # weights 1;1 interleave the two.
  mixed = list(sources.iter_documents(f'hf:{saved};embedded', weights='1;0'))
  assert mixed == _hf_expected()
  embedded = list(itertools.islice(sources.iter_documents('embedded'), 50))
  both = list(itertools.islice(sources.iter_documents(f'hf:{saved};embedded', weights='1;1'),
                               len(_hf_expected()) + 10))
  from_hf = [d for d in both if d in _hf_expected()]
  assert from_hf == _hf_expected()  # every hf document, in its order
  assert [d for d in both if d not in from_hf] == embedded[:len(both) - len(from_hf)]
  # Rows by number, from a streamed split (parquet) and from one on disk (save_to_disk).
  for spec in (f'hf:{tmp_path / "hub"}:en:validation[2:]', f'hf:{saved}::train[2:]'):
    column = 'body' if 'hub' in spec else 'text'
    assert list(sources.iter_documents(spec, hf_text_column=column)) == _hf_expected()[1:]
  assert list(sources.iter_documents(f'hf:{saved}::train[:1]')) == _hf_expected()[:1]
  for empty in ('train[:0]', 'train[2:0]'):  # (stop 0 is not "to the end")
    assert list(sources.iter_documents(f'hf:{saved}::{empty}')) == []
  # A split with brackets right after the dataset: no config (the README's form).
  assert list(sources.iter_documents(f'hf:{saved}:train[:1]')) == _hf_expected()[:1]
  assert sources._hf_parts('a/b:train[:1000]') == ('a/b', '', 'train[:1000]')
  assert sources._hf_parts('a/b:en:train[10:20]') == ('a/b', 'en', 'train[10:20]')
  assert sources._hf_parts('a/b:en') == ('a/b', 'en', '')
  with pytest.raises(ValueError, match='percentages are not supported'):
    next(sources.iter_documents(f'hf:{saved}::train[:50%]'))


def test_hf_hub_sources_pass_their_name_config_split_and_revision(monkeypatch):
  """The hub path (no network here): what reaches datasets.load_dataset for each form."""
  import datasets  # pylint: disable=g-import-not-at-top
  calls = []

  def load_dataset(name, config=None, **kwargs):
    calls.append((name, config, kwargs['split'], kwargs.get('revision'), kwargs['streaming']))
    return datasets.Dataset.from_dict({'text': HF_TEXTS})
  monkeypatch.setattr(datasets, 'load_dataset', load_dataset)
  for spec in ('hf:org/corpus', 'hf:org/corpus:en', 'hf:org/corpus:en:validation',
               'hf:org/corpus@v1.2:en:train[:2]', 'hf:org/corpus@0a1b2c:train[1:]'):
    assert list(sources.iter_documents(spec))
  assert calls == [('org/corpus', None, 'train', None, True),
                   ('org/corpus', 'en', 'train', None, True),
                   ('org/corpus', 'en', 'validation', None, True),
                   ('org/corpus', 'en', 'train', 'v1.2', True),
                   ('org/corpus', None, 'train', '0a1b2c', True)]


def test_hf_source_errors_are_one_line(tmp_path):
  import datasets  # pylint: disable=g-import-not-at-top
  saved = tmp_path / 'saved'
  datasets.Dataset.from_dict({'content': HF_TEXTS}).save_to_disk(str(saved))
  with pytest.raises(ValueError, match="no column 'text'.*config.data.hf_text_column"):
    next(sources.iter_documents(f'hf:{saved}'))
  with pytest.raises(ValueError, match='could not be loaded.*check the path') as e:
    next(sources.iter_documents(f'hf:{tmp_path / "missing"}'))
  assert '\n' not in str(e.value)
  dd = tmp_path / 'dd'
  datasets.DatasetDict({'train': datasets.Dataset.from_dict({'text': HF_TEXTS})}
                       ).save_to_disk(str(dd))
  with pytest.raises(ValueError, match="no split 'test'"):
    next(sources.iter_documents(f'hf:{dd}::test'))
  (tmp_path / 'json').mkdir()  # streamed: the columns are known only from the rows
  (tmp_path / 'json' / 'train.jsonl').write_text('{"body": "A sentence. Another one."}\n')
  with pytest.raises(ValueError, match=r"no column 'text' \(its rows have \['body'\]\)"):
    list(sources.iter_documents(f'hf:{tmp_path / "json"}'))
  # Fine-tuning data without the task's columns (data_dir=hf:...).
  from data import glue  # pylint: disable=g-import-not-at-top
  from data import squad  # pylint: disable=g-import-not-at-top
  (tmp_path / 'glue' / 'rte').mkdir(parents=True)
  datasets.Dataset.from_dict({'premise': ['A man.'], 'label': [0], 'idx': [0]}).to_parquet(
      str(tmp_path / 'glue' / 'rte' / 'validation-00000-of-00001.parquet'))
  with pytest.raises(ValueError, match=r"has no columns \['sentence1', 'sentence2'\] \(it has "
                                       r"\['premise', 'label', 'idx'\]\); is it GLUE") as e:
    glue.read_hf('rte', 'dev', str(tmp_path / 'glue'))
  assert '\n' not in str(e.value)
  (tmp_path / 'squad').mkdir()
  datasets.Dataset.from_dict({'id': ['q'], 'question': ['Where?'], 'context': ['Here.']}
                             ).to_parquet(str(tmp_path / 'squad' / 'train-00000.parquet'))
  with pytest.raises(ValueError, match=r"has no columns \['answers'\].*rajpurkar/squad"):
    squad.read_hf('v1.1', 'train', str(tmp_path / 'squad'))


def test_a_hub_dataset_that_does_not_exist_is_one_line(monkeypatch):
  """What the hub answers for a name it does not have (no network here: datasets' own
  exception, raised where load_dataset would raise it)."""
  import datasets  # pylint: disable=g-import-not-at-top

  def load_dataset(name, *args, **kwargs):
    raise datasets.exceptions.DatasetNotFoundError(
        f"Dataset '{name}' doesn't exist on the Hub or cannot be accessed.\nMore lines.")
  monkeypatch.setattr(datasets, 'load_dataset', load_dataset)
  with pytest.raises(sources.SourceUnavailableError,
                     match=r"Hugging Face dataset 'org/no-such' \(config default, split "
                           r"'train'\) in config.data.sources could not be loaded: Dataset "
                           r"'org/no-such' doesn't exist on the Hub or cannot be accessed.; "
                           r"check the name on huggingface.co/datasets") as e:
    next(sources.iter_documents('hf:org/no-such'))
  assert '\n' not in str(e.value)


def test_hf_source_prepares_the_same_instances_as_the_same_text_in_files(tmp_path):
  """Preparation through hf: gives what the same documents give as BERT-format files."""
  import datasets  # pylint: disable=g-import-not-at-top
  from configs import pretrain  # pylint: disable=g-import-not-at-top
  from data import prepare  # pylint: disable=g-import-not-at-top
  docs = list(itertools.islice(sources.iter_documents('embedded'), 40))
  datasets.Dataset.from_dict({'text': [' '.join(d) for d in docs]}).save_to_disk(
      str(tmp_path / 'hf'))
  expected = [[s for s in sources.split_sentences(' '.join(d))] for d in docs]
  (tmp_path / 'corpus.txt').write_text('\n\n'.join('\n'.join(d) for d in expected) + '\n',
                                       encoding='utf-8')
  results = {}
  for name, spec in (('hf', f'hf:{tmp_path / "hf"}'), ('files', f'files:{tmp_path}/*.txt')):
    config = pretrain.get_config('postln,tiny')
    config.data.sources = spec
    metadata = prepare.prepare(config, str(tmp_path / f'prepared_{name}'))
    with open(prepare.shard_paths(str(tmp_path / f'prepared_{name}'), 'train', 1)[0],
              'rb') as f:
      results[name] = (metadata['counts'], f.read())
  assert results['hf'][0] == results['files'][0] and results['hf'][0]['train'] > 0
  assert results['hf'][1] == results['files'][1]  # byte for byte
  # lazy=True: the same documents, unsplit until asked; a worker splits only its own blocks.
  lazy = list(sources.iter_documents(f'hf:{tmp_path / "hf"}', lazy=True))
  assert all(isinstance(d, sources.Unsplit) for d in lazy)
  assert [sources.sentences(d) for d in lazy] == expected
  calls = []
  real_split = sources.split_sentences
  sources.split_sentences = lambda text: calls.append(text) or real_split(text)
  try:
    config.data.sources, config.data.document_window = f'hf:{tmp_path / "hf"}', 4
    config.data.blocks_per_file = 1  # the blocks dealt one by one
    prepare._work(config, prepare.tokenizer_lib.load_for_config(config.data),
                  str(tmp_path / 'w'), 0, 2)  # worker 0 of 2: blocks 0, 2, 4, ... of each split
  finally:
    sources.split_sentences = real_split
  assert 0 < len(calls) <= 24  # its documents (20 or so of the 40), not all 40


def test_a_changed_local_hf_dataset_is_noticed_not_reused(tmp_path, caplog):
  """A local hf: directory is signed like files: sources, so data prepared from it (and an
  interrupted preparation's finished workers) are not reused once its files change."""
  import datasets  # pylint: disable=g-import-not-at-top
  from configs import pretrain  # pylint: disable=g-import-not-at-top
  from data import prepare  # pylint: disable=g-import-not-at-top
  folder = tmp_path / 'hf'
  datasets.Dataset.from_dict({'text': HF_TEXTS}).save_to_disk(str(folder))
  config = pretrain.get_config('postln,tiny')
  config.data.sources = f'hf:{folder}'
  before = prepare.fingerprint(config)
  assert before['files'].startswith(f'{len(os.listdir(folder))} files')  # all read: saved
  prepare.prepare(config, str(tmp_path / 'prepared'))
  prepare.read_metadata(str(tmp_path / 'prepared'), config)  # unchanged: reused
  # Data split into sentences by the rule before (ASCII capitals alone, no key) is read on.
  assert before['sentence_split'] == 2
  metadata_path = tmp_path / 'prepared' / prepare.METADATA
  earlier = json.loads(metadata_path.read_text())
  del earlier['fingerprint']['sentence_split']
  metadata_path.write_text(json.dumps(earlier))
  with caplog.at_level('WARNING'):
    prepare.read_metadata(str(tmp_path / 'prepared'), config)
  assert 'was prepared when only an ASCII capital opened a sentence' in caplog.text
  (folder / 'README.md').write_text('notes')  # files the source does not read do not count
  (folder / '.cache').mkdir()
  (folder / '.cache' / 'lock').write_text('')
  os.symlink(folder / 'gone', folder / 'dangling')
  assert prepare.fingerprint(config) == before
  datasets.Dataset.from_dict({'text': HF_TEXTS[::-1] + ['One more document.']}).save_to_disk(
      str(tmp_path / 'hf2'))
  shutil.rmtree(folder)
  os.rename(tmp_path / 'hf2', folder)
  assert prepare.fingerprint(config)['files'] != before['files']
  with pytest.raises(ValueError, match='made with other corpus files'):
    prepare.read_metadata(str(tmp_path / 'prepared'), config)


def test_a_tokenizer_retrained_at_the_same_path_or_another_tfds_feature_is_noticed(tmp_path):
  """The fingerprint signs the tokenizer's files (a sentencepiece .model; a vocab.txt with
  its tokenizer_config.json) and, for tfds: sources, the text feature: data prepared (or a
  preparation's finished workers) with another of either is not reused."""
  from configs import pretrain  # pylint: disable=g-import-not-at-top
  from data import prepare  # pylint: disable=g-import-not-at-top
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  model = tmp_path / 'tok.model'
  shutil.copy(tokenizer_lib.EMBEDDED_TOKENIZER, model)
  vocab = tmp_path / 'wp' / 'vocab.txt'
  vocab.parent.mkdir()
  vocab.write_text('[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\n')
  (vocab.parent / 'tokenizer_config.json').write_text('{"do_lower_case": true}')
  config = pretrain.get_config('postln,tiny')
  config.data.sources = 'tfds:sotu_wiki;embedded'
  prepared = tmp_path / 'prepared'
  for tokenizer, change in ((str(model), lambda: model.write_bytes(model.read_bytes() + b' ')),
                            (str(vocab), lambda: (vocab.parent / 'tokenizer_config.json')
                             .write_text('{"do_lower_case": false}'))):
    config.data.tokenizer, config.data.tfds_text_feature = tokenizer, 'text'
    prepared.mkdir(exist_ok=True)
    (prepared / prepare.METADATA).write_text(json.dumps(
        {'fingerprint': prepare.fingerprint(config)}))
    prepare.read_metadata(str(prepared), config)  # the same: reused
    config.data.tfds_text_feature = 'title'
    with pytest.raises(ValueError, match="made with other settings .*'tfds_text_feature'"):
      prepare.read_metadata(str(prepared), config)
    config.data.tfds_text_feature = 'text'
    change()
    with pytest.raises(ValueError, match=r'made with another tokenizer file \(retrained at the '
                                         r'same path\?\)'):
      prepare.read_metadata(str(prepared), config)
  assert tokenizer_lib.signature(str(tmp_path)) is None  # a folder: loading it says so
  # Where the tokenizer file is not (the prepared data read on another machine): not checked.
  config.data.tokenizer = str(tmp_path / 'elsewhere' / 'vocab.txt')
  metadata = json.loads((prepared / prepare.METADATA).read_text())
  metadata['fingerprint']['tokenizer'] = config.data.tokenizer
  (prepared / prepare.METADATA).write_text(json.dumps(metadata))
  prepare.read_metadata(str(prepared), config)


def test_a_fine_tuning_task_tfds_cannot_download_is_one_line(monkeypatch, caplog):
  """GLUE and SQuAD without data_dir go through tfds.load, which downloads: without network
  its failure (after tfds's retries) names the offline route instead of a long traceback,
  and the host it could not reach; a download is said before it begins, one already
  prepared is not begun."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from data import glue, squad  # pylint: disable=g-import-not-at-top

  def no_network(name, **kw):
    raise ConnectionError(f"HTTPSConnectionPool: Failed to resolve 'dl.fbaipublicfiles.com'\n"
                          f'({name}, {kw["split"]})')
  monkeypatch.setattr(tfds, 'load', no_network)
  offline = (r"^tfds could not load glue/{} \(ConnectionError: HTTPSConnectionPool: Failed "
             r"to resolve 'dl.fbaipublicfiles.com'\); without network, pass "
             r"config.data_dir=<a folder with the task's ")
  with pytest.raises(ValueError, match=offline.format('rte')):
    glue.read_tfds('rte', 'train')
  with pytest.raises(ValueError, match=r'load squad/v2.0 .*train-v2.0.json'):
    squad.read_tfds('v2.0', 'train')
  # The same where process 0 downloads and prepares them before the hosts load them.
  class Offline:
    prepared = False

    def __init__(self, name, data_dir):
      self.name, self.data_dir = name, f'{data_dir}/{name}/1.0.0'

    def is_prepared(self):
      return self.prepared

    def download_and_prepare(self):
      raise ConnectionError(f"HTTPSConnectionPool: Failed to resolve 'dl.fbaipublicfiles.com'"
                            f'\n({self.name})')
  monkeypatch.setattr(tfds, 'builder', Offline)
  with pytest.raises(ValueError, match=offline.format('mnli')):
    glue.prepare_tfds('mnli_mismatched', '/tfds')
  assert ('glue/mnli is not in /tfds/glue/mnli/1.0.0: tfds downloads and prepares it there '
          'once (without network it gives up after about 3 minutes of retries; then pass '
          'config.data_dir=') in caplog.text
  with pytest.raises(ValueError, match=r'load squad/v1.1 .*train-v1.1.json'):
    squad.prepare_tfds('v1.1')
  # requests' own words: the host named, the message not cut in the middle of its brackets.
  Offline.download_and_prepare = lambda self: (_ for _ in ()).throw(ConnectionError(
      "HTTPSConnectionPool(host='dl.fbaipublicfiles.com', port=443): Max retries exceeded "
      "with url: /glue/data/RTE.zip (Caused by NameResolutionError(\"<urllib3.connection."
      "HTTPSConnection object at 0x7f>: Failed to resolve 'dl.fbaipublicfiles.com' ([Errno -3] "
      "Temporary failure in name resolution)\"))"))
  with pytest.raises(ValueError, match=r'^tfds could not load glue/rte \(ConnectionError: '
                     r'could not reach dl.fbaipublicfiles.com \(NameResolutionError\)\); without network, '
                     r'pass '):
    glue.prepare_tfds('rte', '/tfds')
  caplog.clear()
  Offline.prepared = True  # nothing to download: nothing said, nothing begun
  glue.prepare_tfds('rte', '/tfds')
  assert 'tfds downloads' not in caplog.text


def test_a_source_listed_twice_is_held_out_or_trained_on_both_times(tmp_path):
  """The held-out documents are chosen by their number in their own source, so a source
  listed twice (to use it twice) puts no document in both splits, and a second source of
  its own keeps the first one's split."""
  from data import prepare  # pylint: disable=g-import-not-at-top
  corpus = tmp_path / 'corpus.txt'
  docs = list(itertools.islice(sources.iter_documents('embedded'), 30))
  corpus.write_text(''.join('\n'.join(d) + '\n\n' for d in docs))
  split = lambda spec, name: [tuple(d) for i, d in sources.iter_documents(spec, numbered=True)
                              if prepare.split_of(i, 0.3) == name]
  once = {name: split(f'files:{corpus}', name) for name in prepare.SPLITS}
  twice = {name: split(f'files:{corpus};files:{corpus}', name) for name in prepare.SPLITS}
  assert once['eval'] and once['train'] and not set(twice['eval']) & set(twice['train'])
  assert sorted(twice['eval']) == sorted(once['eval'] * 2)
  assert sorted(twice['train']) == sorted(once['train'] * 2)


def test_hub_sources_without_a_pinned_revision_are_named(tmp_path):
  """A hub dataset without @<revision> is streamed by every preparation worker on its own
  (prepare warns where there are several); a pinned one, a local folder and the other kinds
  are not named."""
  got = sources.unpinned_hub_sources(
      f'embedded;hf:wikimedia/wikipedia:20231101.en;hf:org/books@v1.0:train;hf:{tmp_path}:train;'
      'files:/data/*.txt')
  assert got == ['hf:wikimedia/wikipedia:20231101.en']
