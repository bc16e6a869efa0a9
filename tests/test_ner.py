"""Named-entity recognition (realformer/finetune/tasks/ner.py, data/conll.py): conlleval's
entities and scores on known cases, BERT's first-piece labels, the reader's one-line errors,
and a tiny fine-tuning run end to end whose reported F1 is its prediction file's."""

import json
import os

import jax
import numpy as np
import pytest

import finetune
from configs import finetune as finetune_configs
from data import conll
from data import tokenizer as tokenizer_lib
from realformer.finetune import metrics as finetune_metrics
from realformer.finetune import registry
from realformer.train import checkpoints
from realformer.train import partitioning
from realformer.train.run_dir import RunDir
from tests.test_finetune import save_tiny_encoder

PEOPLE = ['lincoln', 'washington', 'roosevelt', 'grant']
PLACES = [['ohio'], ['texas'], ['new', 'york'], ['great', 'britain']]
OTHER = 'the president spoke of war and peace in a long speech to congress'.split()


def test_chunks_read_iob1_and_iob2_as_conlleval_does():
  assert conll.chunks(['B-PER', 'I-PER', 'O', 'B-LOC']) == [('PER', 0, 2), ('LOC', 3, 4)]
  # IOB1 (the original CoNLL-2003 files): I- begins an entity after O or another type, B-
  # only where one follows another of its type.
  assert conll.chunks(['I-PER', 'I-PER', 'O', 'I-LOC', 'B-LOC']) == [
      ('PER', 0, 2), ('LOC', 3, 4), ('LOC', 4, 5)]
  assert conll.chunks(['B-PER', 'I-ORG', 'I-ORG']) == [('PER', 0, 1), ('ORG', 1, 3)]
  assert conll.chunks(['O', 'O']) == [] and conll.chunks([]) == []


def test_entity_scores_on_known_cases():
  # seqeval's README example: one of two entities found in each direction, F1 0.5.
  gold = [['O', 'O', 'O', 'B-MISC', 'I-MISC', 'I-MISC', 'O'], ['B-PER', 'I-PER', 'O']]
  pred = [['O', 'O', 'B-MISC', 'I-MISC', 'I-MISC', 'I-MISC', 'O'], ['B-PER', 'I-PER', 'O']]
  scores = finetune_metrics.entity_scores(gold, pred)
  assert scores['precision'] == scores['recall'] == scores['f1'] == 0.5
  assert scores['f1_PER'] == 1.0 and scores['f1_MISC'] == 0.0
  assert scores['accuracy'] == pytest.approx(8 / 10)  # (two words' tags differ)
  # Three gold entities, two predicted, one of them right: P 1/2, R 1/3, F1 2PR/(P+R) = 0.4;
  # an IOB1 prediction of the same span counts as found.
  gold = [['B-LOC', 'O', 'B-PER', 'I-PER', 'O', 'B-ORG']]
  pred = [['O', 'O', 'I-PER', 'I-PER', 'O', 'B-LOC']]
  scores = finetune_metrics.entity_scores(gold, pred)
  assert (scores['precision'], scores['recall']) == (0.5, pytest.approx(1 / 3))
  assert scores['f1'] == pytest.approx(0.4) and scores['f1_ORG'] == 0.0
  assert finetune_metrics.entity_scores([['O']], [['O']])['f1'] == 0.0  # (none to find)


def _tokenizer():
  return tokenizer_lib.load_for_config(finetune_configs.pretrain.get_config('postln,tiny').data)


def test_each_word_is_labelled_at_its_first_piece():
  tokenizer = _tokenizer()
  sentences = [conll.Sentence(['Lincoln', 'spoke', 'unconstitutionally', 'in', 'Ohio'],
                              ['B-PER', 'O', 'O', 'O', 'B-LOC'])]
  labels = conll.CONLL2003_LABELS
  ids = conll.label_ids(sentences, labels, 'x.txt')
  features, placed, cut = conll.featurize(sentences, ids, tokenizer, 32)
  pieces, word_of = tokenizer.encode_words(sentences[0].words)
  assert len(pieces) > 5 and cut == 0  # (a word of several pieces)
  row = features['labels'][0]
  assert list(features['input_ids'][0, :len(pieces) + 2]) == [tokenizer.cls_id, *pieces,
                                                             tokenizer.sep_id]
  firsts = [1 + word_of.index(w) for w in range(5)]
  assert [int(p) for p, _ in placed[0]] == firsts and [int(w) for _, w in placed[0]] == [
      0, 1, 2, 3, 4]
  assert [labels[i] for i in row[firsts]] == sentences[0].tags
  assert (np.delete(row, firsts) == conll.IGNORE).all()  # [CLS], [SEP], other pieces, padding
  assert features['attention_mask'][0].sum() == len(pieces) + 2
  # The predicted tags come back to the words from their first pieces.
  logits = np.zeros((1, 32, len(labels)))
  logits[0, firsts, [labels.index(t) for t in reversed(sentences[0].tags)]] = 1.0
  assert conll.word_tags(logits, placed, sentences, labels) == [
      list(reversed(sentences[0].tags))]
  # Too long: the words whose first piece fits keep their labels, the others are cut off
  # (predicted O).
  short = len(pieces) - 1  # [CLS] + all but the last two pieces + [SEP]
  features, placed, cut = conll.featurize(sentences, ids, tokenizer, short)
  kept = word_of[short - 3] + 1
  assert cut == 5 - kept and len(placed[0]) == kept
  assert conll.word_tags(np.zeros((1, short, len(labels))), placed, sentences, labels)[0][
      kept:] == ['O'] * (5 - kept)
  # A word the tokenizer gives no piece (a zero-width space) has no position: predicted O,
  # and counted with the words cut off; the words after it keep theirs.
  odd = [conll.Sentence(['Ohio', '\u200b', 'Texas'], ['B-LOC', 'B-LOC', 'B-LOC'])]
  features, placed, unplaced = conll.featurize(
      odd, conll.label_ids(odd, labels, 'x.txt'), tokenizer, 32)
  assert unplaced == 1 and [int(w) for _, w in placed[0]] == [0, 2]
  logits = np.zeros((1, 32, len(labels)))
  logits[0, [int(p) for p, _ in placed[0]], labels.index('B-LOC')] = 1.0
  assert conll.word_tags(logits, placed, odd, labels) == [['B-LOC', 'O', 'B-LOC']]


def test_the_reader_and_the_labels_say_what_is_wrong(tmp_path):
  path = tmp_path / 'train.txt'
  path.write_text('-DOCSTART- -X- O O\n\nLincoln NNP B-NP B-PER\nspoke\n')
  with pytest.raises(ValueError, match=r"train.txt, line 4: 'spoke' has no tag"):
    conll.read(str(path))
  path.write_text('-DOCSTART- O\n\n')
  with pytest.raises(ValueError, match='holds no sentence'):
    conll.read(str(path))
  path.write_text('Lincoln B-PER\nspoke O\n\nOhio B-GPE\n')
  sentences = conll.read(str(path))
  assert [s.words for s in sentences] == [['Lincoln', 'spoke'], ['Ohio']]
  with pytest.raises(ValueError, match=r"train.txt, line 4: tag 'B-GPE' of 'Ohio' is not among "
                                       r'the labels \(O,B-PER,.*\); add it to config.ner.labels'):
    conll.label_ids(sentences, conll.CONLL2003_LABELS, str(path))
  # Lines end at \n alone, columns part at spaces and tabs alone: a word may hold U+0085 or a
  # no-break space (str.splitlines and str.split broke it into a word without its tag).
  path.write_bytes('said\x85 O\r\nNew\xa0York B-LOC\n'.encode('utf-8'))
  assert conll.read(str(path))[0].words == ['said\x85', 'New\xa0York']
  path.write_text('\ufeffLincoln S-PER\n')  # (a byte-order mark: not part of the word)
  sentences = conll.read(str(path))
  assert sentences[0].words == ['Lincoln']
  with pytest.raises(ValueError, match=r"line 1: tag 'S-PER' of 'Lincoln' is IOBES"):
    conll.label_ids(sentences, conll.CONLL2003_LABELS, str(path))
  with pytest.raises(ValueError, match=r"tags \['S-PER'\] are not BIO"):
    conll.check_labels(['O', 'S-PER'])
  with pytest.raises(ValueError, match='must hold O and no tag twice'):
    conll.check_labels(['B-PER', 'I-PER'])
  with pytest.raises(ValueError, match=r"tags \['B-GPE-X'\] hold a '-' in their type"):
    conll.check_labels(['O', 'B-GPE-X'])
  path.write_bytes('M\xfcller B-PER\n\n'.encode('latin-1'))
  with pytest.raises(ValueError, match=r'train.txt: not UTF-8 text \(invalid start byte at '
                                       r'byte 1\); convert it'):
    conll.read(str(path))
  with pytest.raises(FileNotFoundError, match=r'no dev file in .*: name it dev.txt or '
                                              r'valid.txt or eng.testa'):
    conll.split_file(str(tmp_path), 'dev')
  with pytest.raises(FileNotFoundError, match=r'config.data_dir=.*nope is not a folder'):
    conll.split_file(str(tmp_path / 'nope'), 'train')


def _write_split(path, n, rng):
  """n sentences of OTHER's words with people (PER) and places (LOC, some of two words)."""
  lines = []
  for _ in range(n):
    for _ in range(rng.integers(1, 4)):
      lines += [f'{w} O' for w in rng.choice(OTHER, rng.integers(1, 4))]
      if rng.random() < 0.5:
        lines.append(f'{rng.choice(PEOPLE).title()} B-PER')
      else:
        place = PLACES[rng.integers(len(PLACES))]
        lines += [f'{w.title()} {"B" if i == 0 else "I"}-LOC' for i, w in enumerate(place)]
    lines.append('')
  path.write_text('-DOCSTART- O\n\n' + '\n'.join(lines) + '\n')


def test_document_context_fills_each_sequence_from_the_sentences_around_it(tmp_path):
  """ner.document_context: a sentence's sequence is a stretch of its document's pieces (never
  another document's) holding all its own that fit, as long as max_seq_length or the
  document allows, as much before it as after where the document has them; its own words
  alone labelled, as without context."""
  rng = np.random.default_rng(1)
  for name, n in (('a.txt', 7), ('b.txt', 2)):
    _write_split(tmp_path / name, n, rng)
  path = tmp_path / 'train.txt'
  path.write_text((tmp_path / 'a.txt').read_text() + (tmp_path / 'b.txt').read_text())
  sentences = conll.read(str(path))
  assert [s.document for s in sentences] == [1] * 7 + [2] * 2
  tokenizer, labels = _tokenizer(), conll.CONLL2003_LABELS
  ids = conll.label_ids(sentences, labels, str(path))
  encoded = [tokenizer.encode_words(s.words)[0] for s in sentences]
  for max_len in (12, 40, 400):
    alone, placed_alone, cut_alone = conll.featurize(sentences, ids, tokenizer, max_len)
    ctx, placed, cut = conll.featurize(sentences, ids, tokenizer, max_len,
                                       document_context=True)
    assert cut == cut_alone
    for i, s in enumerate(sentences):
      same = [j for j in range(len(sentences)) if sentences[j].document == s.document]
      stream = [p for j in same for p in encoded[j]]
      start = sum(len(encoded[j]) for j in same if j < i)
      own = min(len(encoded[i]), max_len - 2)
      room, after = max_len - 2 - own, len(stream) - start - len(encoded[i])
      n = int(ctx['attention_mask'][i].sum()) - 2
      assert n == own + min(room, len(stream) - len(encoded[i]))
      assert ctx['input_ids'][i, 0] == tokenizer.cls_id
      assert ctx['input_ids'][i, n + 1] == tokenizer.sep_id
      left = min(start, max(room // 2, room - after))
      assert list(ctx['input_ids'][i, 1:n + 1]) == stream[start - left:start - left + n]
      np.testing.assert_array_equal(placed[i], placed_alone[i] + [left, 0])
      assert (ctx['labels'][i][ctx['labels'][i] != conll.IGNORE].tolist() ==
              alone['labels'][i][alone['labels'][i] != conll.IGNORE].tolist())
    if max_len == 400:  # the whole document (b's two sentences share theirs)
      assert (ctx['attention_mask'].sum(1) - 2).tolist() == [
          sum(len(encoded[j]) for j in range(7))] * 7 + [len(encoded[7]) + len(encoded[8])] * 2


class _OnePiecePerWord:
  """A tokenizer whose piece of a word is the number the word is (ids 0-2 special)."""
  pad_id, cls_id, sep_id = 0, 1, 2

  def encode_words(self, words):
    return [int(w) for w in words], list(range(len(words)))


def test_document_context_by_hand(tmp_path):
  """The context's split counted by hand; documents as -DOCSTART- lines separate them (none
  before the first; two in a row; a file without any is one document)."""
  path = tmp_path / 'train.txt'
  words = lambda first, n: ''.join(f'{w} O\n' for w in range(first, first + n)) + '\n'
  path.write_text(words(90, 2) + '-DOCSTART- O\n\n' + words(10, 10) + words(20, 3) +
                  words(30, 10) + '-DOCSTART- O\n-DOCSTART- O\n' + words(40, 3))
  sentences = conll.read(str(path))
  documents = [s.document for s in sentences]
  assert documents[0] != documents[1] == documents[2] == documents[3] != documents[4]
  ids = [[0] * len(s.words) for s in sentences]
  features = lambda n: conll.featurize(sentences, ids, _OnePiecePerWord(), n,
                                       document_context=True)[0]['input_ids'].tolist()
  # 12 positions: the middle sentence's 3 pieces leave 7, 3 before it and 4 after; the last
  # sentence of 10 leaves none; another document's sentences are never context.
  assert features(12)[2] == [1, 17, 18, 19, 20, 21, 22, 30, 31, 32, 33, 2]
  assert features(12)[3] == [1, *range(30, 40), 2]
  assert features(12)[4] == [1, 40, 41, 42, 2] + [0] * 7
  # 20 positions: the last sentence's 8 all before it (nothing after), the first's all after.
  assert features(20)[3] == [1, *range(15, 20), 20, 21, 22, *range(30, 40), 2]
  assert features(20)[1] == [1, *range(10, 20), 20, 21, 22, 30, 31, 32, 33, 34, 2]
  assert features(20)[0] == [1, 90, 91, 2] + [0] * 16
  path.write_text(words(10, 2) + words(20, 2))
  assert [s.document for s in conll.read(str(path))] == [0, 0]  # (no -DOCSTART-: one)


@pytest.fixture(scope='module')
def ner_data(tmp_path_factory):
  root = tmp_path_factory.mktemp('ner')
  rng = np.random.default_rng(0)
  for name, n in (('train.txt', 96), ('valid.txt', 16), ('test.txt', 16)):
    _write_split(root / name, n, rng)
  return str(root)


def test_ner_fine_tunes_scores_and_writes_conlleval_files(ner_data, tmp_path):
  """A tiny encoder fine-tuned on generated sentences (bf16-free, one device): the loss
  falls, dev and test are scored each epoch, the reported scores are conlleval's on the
  prediction files, and best/ and final/ record the tags for an export."""
  pretrained = str(tmp_path / 'pretrained')
  save_tiny_encoder(pretrained, 'postln', num_layers=2, num_heads=2, step=10)
  config = finetune_configs.get_config('ner/conll2003')
  config.unlock()
  config.init_checkpoint, config.data_dir = pretrained, ner_data
  config.batch_size, config.eval_batch_size, config.num_epochs = 8, 8, 3
  config.max_seq_length, config.log_every_steps = 32, 4
  # (NER's default: random batches, each padded to the shortest length bucket that holds its
  # longest sentence, so the per-token labels are cut with the inputs to that length; two
  # lengths here)
  config.length_buckets, config.bucket_multiple, config.bucket_compile_seconds = 2, 4, 0.0
  config.optimizer.learning_rate = 5e-3
  config.ner.labels = 'O,B-PER,I-PER,B-LOC,I-LOC'
  workdir = str(tmp_path / 'ner')
  summary = finetune.finetune(config, workdir, devices=jax.devices()[:1])
  assert summary['task'] == 'conll2003' and summary['step'] == 3 * 96 // 8
  plan = json.load(open(os.path.join(workdir, RunDir.LENGTH_BUCKETS)))
  assert len(plan['lengths']) == 2 and plan['settings']['group_by_length'] is False, plan
  default = finetune_configs.get_config('ner/x')
  assert not default.group_by_length and default.length_buckets == 5
  assert not default.ner.document_context
  # Dev picks best/; the test set (its tags public, as CoNLL-2003's) is scored beside it
  # under its own split.
  assert set(summary['dev']) == set(summary['test']) == {'conll2003'}
  assert summary['headline'] == summary['dev']['conll2003']['f1']
  results = json.load(open(os.path.join(workdir, 'results.json')))
  assert results['test'] == summary['test'] and 'test' in results['best']
  records = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  losses = [r['loss'] for r in records if r['split'] == 'train']
  assert losses[-1] < 0.5 * losses[0], (losses, summary['dev'])
  assert len([r for r in records if r['split'] == 'test_conll2003']) == 3  # each epoch
  for split in ('dev', 'test'):
    rows = [l.split() for l in open(os.path.join(workdir, 'predictions', f'{split}.txt'))]
    sentences, tags = [[]], [[]]  # conlleval's input: word, gold, predicted; blank after each
    for row in rows:
      if row:
        sentences[-1].append(row[1])
        tags[-1].append(row[2])
      else:
        sentences.append([])
        tags.append([])
    assert not sentences[-1] and len(sentences) - 1 == 16
    want = summary[split]['conll2003']
    assert finetune_metrics.entity_scores(sentences[:-1], tags[:-1]) == pytest.approx(want)
    assert want['f1'] > 0.8, want  # (it learned: chance finds no entity)
  # The loss's normaliser is the words a batch holds on average, whatever its length bucket
  # (a batch's own count would weigh each word of short sentences more than one of long).
  mesh = partitioning.make_mesh(config.mesh, jax.devices()[:1])
  with jax.set_mesh(mesh):
    task = registry.get('ner')(config, mesh, RunDir(str(tmp_path / 'read')))
  labelled = task.train['labels'] != conll.IGNORE
  assert task.words_per_example == pytest.approx(labelled.sum(1).mean())
  by_length = np.argsort(labelled.sum(1))
  short, long_ = (jax.tree.map(lambda x: x[i], task.train) for i in (by_length[:8],
                                                                    by_length[-8:]))
  assert labelled[by_length[:8]].sum() < labelled[by_length[-8:]].sum()
  assert task.totals(short)['words'] == task.totals(long_)['words'] == pytest.approx(
      8 * task.words_per_example)
  # With document context the sentences' sequences hold their neighbours' pieces, and the
  # same labels.
  config.ner.document_context = True
  with jax.set_mesh(mesh):
    in_context = registry.get('ner')(config, mesh, RunDir(str(tmp_path / 'context')))
  assert (in_context.train['labels'] != conll.IGNORE).sum() == labelled.sum()
  assert (in_context.train['attention_mask'].sum() >
          1.5 * task.train['attention_mask'].sum())
  final = checkpoints.read_pretraining_config(os.path.join(workdir, RunDir.FINAL))
  assert final['finetuned'] == {'kind': 'ner', 'task': 'conll2003', 'labels': [
      'O', 'B-PER', 'I-PER', 'B-LOC', 'I-LOC'], 'hf_architecture': 'BertForTokenClassification'}


def test_the_grid_runs_conll2003_for_the_kind_and_takes_a_name_of_ones_own():
  from realformer.tools import finetune_grid  # pylint: disable=g-import-not-at-top
  assert finetune_grid.expand_tasks('ner,ner/sotu') == ['ner/conll2003', 'ner/sotu']
  assert finetune_grid.expand_tasks('squad') == ['squad/v1.1', 'squad/v2.0']
  with pytest.raises(ValueError, match="unknown task 'squad/v3'"):  # (a kind of fixed names)
    finetune_grid.expand_tasks('squad/v3')
