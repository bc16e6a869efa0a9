r"""Labelled sets made from the embedded State of the Union corpus and its speech index.

The embedded corpus (data/embedded/sotu.txt.gz, one speech per document) comes with
data/embedded/sotu_speeches.tsv: each speech's year, president and party, in the same order.
That makes an in-domain labelled set for the question "does pretraining help?", where the
Amazon reviews of benchmarks/pretrained_vs_scratch.py are out of domain for a model
pretrained on speeches:

  era: is a sentence from an address given before 1900 or from 1900 on? (dating a text
       snippet, as in SemEval-2015 Task 7, Diachronic Text Evaluation)

The split is by speech: every fifth speech (index % 5 == 2, spread over all 231 years) is
held out for dev, the training sentences come from the other speeches, and
`write_era_task` also writes the pretraining corpus without the held-out speeches, so a
model pretrained on it has never seen a dev sentence, not even unlabelled. (The embedded
tokenizer's piece inventory was learnt from the whole corpus; it holds no labels.)
"""

import collections
import csv
import dataclasses
import os
import random
from typing import List, Sequence

from data import glue
from data import sources

SPEECH_INDEX = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'embedded',
                            'sotu_speeches.tsv')
INDEX_FIELDS = ('year', 'name', 'party')
NESTED_TRAIN = 800  # training sets up to this size are nested and share one dev set


@dataclasses.dataclass(frozen=True)
class Speech:
  year: int
  name: str
  party: str
  sentences: List[str]


def load_speeches(corpus: str = sources.EMBEDDED_CORPUS,
                  index: str = SPEECH_INDEX) -> List[Speech]:
  """The corpus's speeches with their year, president and party."""
  with open(index, encoding='utf-8', newline='') as f:
    rows = list(csv.DictReader(f, delimiter='\t'))
  docs = list(sources.iter_file_documents(corpus, collections.Counter()))
  if len(rows) != len(docs):
    raise ValueError(f'{index} lists {len(rows)} speeches but {corpus} has {len(docs)}; '
                     'rebuild both with `python -m data.build_embedded`')
  return [Speech(int(r['year']), r['name'], r['party'], doc) for r, doc in zip(rows, docs)]


def is_dev_speech(i: int) -> bool:
  return i % 5 == 2


def era_label(year: int, cutoff: int = 1900) -> int:
  return int(year >= cutoff)


def write_era_task(out_dir: str, num_train: int = NESTED_TRAIN, num_dev: int = 400, seed: int = 0,
                   cutoff: int = 1900, min_words: int = 8,
                   speeches: Sequence[Speech] = ()) -> str:
  """Writes <out_dir>/SST-2/{train,dev,test}.tsv (sentence, label: 1 = from `cutoff` on;
  sentences of at least `min_words` words; training sentences balanced; dev drawn balanced
  from the held-out speeches, less the few that also occur verbatim in a training speech, so
  no dev sentence is in the training speeches or the pretraining corpus) and
  <out_dir>/pretraining_corpus.txt (the corpus without the held-out speeches, BERT's format).
  Returns out_dir.

  Smaller training sets are nested: num_train <= 800 takes the first num_train / 2 of each
  class of the 800 drawn, and the dev set is the same for all of them (above 800 the draw,
  and so the dev set, changes)."""
  if num_train % 2 or num_dev % 2:
    raise ValueError(f'num_train ({num_train}) and num_dev ({num_dev}) must be even: the '
                     'two classes are sampled equally')
  speeches = list(speeches) or load_speeches()
  pools = {(split, label): [] for split in ('train', 'dev') for label in (0, 1)}
  for i, speech in enumerate(speeches):
    split = 'dev' if is_dev_speech(i) else 'train'
    label = era_label(speech.year, cutoff)
    pools[split, label] += [' '.join(s.split()) for s in speech.sentences
                            if len(s.split()) >= min_words]
  train_sentences = set(pools['train', 0] + pools['train', 1])
  rng = random.Random(seed)
  drawn = {}
  for split, n in (('train', max(num_train, NESTED_TRAIN)), ('dev', num_dev)):
    for label in (0, 1):
      if len(pools[split, label]) < n // 2:
        raise ValueError(f'only {len(pools[split, label])} {split} sentences of class {label} '
                         f'for the {n // 2} asked; lower num_{split} or min_words')
    rows = [(s, label) for label in (0, 1) for s in rng.sample(pools[split, label], n // 2)]
    rng.shuffle(rows)
    if split == 'dev':  # a few sentences recur verbatim in a president's next address
      rows = [r for r in rows if r[0] not in train_sentences]
    if split == 'train':  # nested: the first num_train / 2 of each class, in shuffled order
      taken, nested = collections.Counter(), []
      for row in rows:
        taken[row[1]] += 1
        if taken[row[1]] <= num_train // 2:
          nested.append(row)
      rows = nested
    drawn[split] = rows
  glue.write_sst2_layout(out_dir, drawn['train'], drawn['dev'])
  with open(os.path.join(out_dir, 'pretraining_corpus.txt'), 'w', encoding='utf-8') as f:
    f.writelines('\n'.join(s.sentences) + '\n\n'
                 for i, s in enumerate(speeches) if not is_dev_speech(i))
  return out_dir
