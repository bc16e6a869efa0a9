"""The labelled sets made from the embedded corpus (data/sotu.py)."""

import collections

import pytest

from data import sotu
from data import sources


@pytest.fixture(scope='module')
def speeches():
  return sotu.load_speeches()


def read_tsv(path):
  with open(path, encoding='utf-8') as f:
    return [line.rstrip('\n').split('\t') for line in f][1:]


def test_the_speech_index_matches_the_embedded_corpus(speeches):
  assert len(speeches) == 233
  years = [s.year for s in speeches]
  assert years == sorted(years) and years[0] == 1790 and years[-1] == 2021
  assert (speeches[0].name, speeches[0].party) == ('George Washington', 'none')
  assert (speeches[-1].name, speeches[-1].party) == ('Joseph R Biden', 'Democratic')
  # Two speeches in 1961 (Eisenhower's last, Kennedy's first): the order is the corpus's.
  assert [s.name for s in speeches if s.year == 1961] == ['Dwight D Eisenhower',
                                                          'John F Kennedy']
  text = {(s.year, s.name): ' '.join(s.sentences) for s in speeches}
  assert 'the last best hope of earth' in text[1862, 'Abraham Lincoln']
  assert 'freedom from fear' in text[1941, 'Franklin D Roosevelt']
  assert 'Madam Speaker' in text[2021, 'Joseph R Biden']


def test_era_task_holds_out_whole_speeches(tmp_path, speeches):
  out = sotu.write_era_task(str(tmp_path), num_train=200, num_dev=100, speeches=speeches)
  train = read_tsv(tmp_path / 'SST-2' / 'train.tsv')
  dev = read_tsv(tmp_path / 'SST-2' / 'dev.tsv')
  assert out == str(tmp_path) and len(train) == 200 and 95 <= len(dev) <= 100
  assert collections.Counter(label for _, label in train) == {'0': 100, '1': 100}
  assert all(n >= 45 for n in collections.Counter(label for _, label in dev).values())
  dev_ids = [i for i in range(len(speeches)) if sotu.is_dev_speech(i)]
  dev_years = [speeches[i].year for i in dev_ids]
  assert len(dev_ids) == 47 and min(dev_years) < 1800 and max(dev_years) > 2010
  where = collections.defaultdict(set)  # sentence -> (is dev speech, era) of every speech
  for i, s in enumerate(speeches):
    for sentence in s.sentences:
      where[' '.join(sentence.split())].add((sotu.is_dev_speech(i), int(s.year >= 1900)))
  for rows, is_dev in ((train, False), (dev, True)):
    for sentence, label in rows:
      assert len(sentence.split()) >= 8
      assert (is_dev, int(label)) in where[sentence], sentence
  # The pretraining corpus is every other speech, whole and in order: no dev sentence.
  corpus = list(sources.iter_file_documents(str(tmp_path / 'pretraining_corpus.txt'),
                                            collections.Counter()))
  kept = [s.sentences for i, s in enumerate(speeches) if not sotu.is_dev_speech(i)]
  assert corpus == kept and len(corpus) == 186
  seen = {' '.join(x.split()) for doc in corpus for x in doc}
  assert not seen & {sentence for sentence, _ in dev}  # not even a recurring sentence
  test = read_tsv(tmp_path / 'SST-2' / 'test.tsv')
  assert [sentence for _, sentence in test] == [sentence for sentence, _ in dev]


def test_era_task_is_reproducible_seeded_and_nested(tmp_path, speeches):
  read = lambda d, split='train': (tmp_path / d / 'SST-2' / f'{split}.tsv').read_text()
  for name, seed, n in (('a', 0, 800), ('b', 0, 800), ('c', 1, 800), ('small', 0, 20)):
    sotu.write_era_task(str(tmp_path / name), num_train=n, num_dev=10, seed=seed,
                        speeches=speeches)
  assert read('a') == read('b') != read('c')
  # A smaller training set is a balanced subset of the 800, with the very same dev set.
  small = read_tsv(tmp_path / 'small' / 'SST-2' / 'train.tsv')
  assert len(small) == 20 and sum(label == '1' for _, label in small) == 10
  assert {tuple(r) for r in small} < {tuple(r) for r in read_tsv(tmp_path / 'a/SST-2/train.tsv')}
  assert read('small', 'dev') == read('a', 'dev')


def test_era_task_bad_requests(tmp_path, speeches):
  with pytest.raises(ValueError, match='must be even'):
    sotu.write_era_task(str(tmp_path), num_train=201, speeches=speeches)
  with pytest.raises(ValueError, match='lower num_train or min_words'):
    sotu.write_era_task(str(tmp_path), num_train=10**6, speeches=speeches)
  index = tmp_path / 'index.tsv'
  index.write_text('year\tname\tparty\n1790\tGeorge Washington\tnone\n')
  with pytest.raises(ValueError, match='lists 1 speeches but .* has 233'):
    sotu.load_speeches(index=str(index))
