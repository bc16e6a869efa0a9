"""Pretraining examples without a tokenizer: masking hand-computed with a scripted
generator, whole-word groups, sentence pairs that keep to their documents, the bounded
document window that keeps preparation's memory independent of the corpus size, and
RoBERTa's single-segment DOC-SENTENCES inputs.

(tests/test_data.py covers the same code on the embedded corpus: rates, NSP balance, the
hand-computed instance layout and truncation.)"""

import collections

import numpy as np
import pytest

from data import pretraining

VOCAB, SPECIAL, MASK = 20, range(5), 4
CLS, SEP = 2, 3


class ScriptedGenerator:
  """np.random.Generator stand-in returning scripted draws (to hand-compute the masking)."""

  def __init__(self, permutation, randoms, choices=()):
    self._permutation, self._randoms, self._choices = permutation, randoms, list(choices)

  def permutation(self, n):
    assert len(self._permutation) == n
    return np.asarray(self._permutation)

  def random(self, n):
    assert len(self._randoms) == n
    return np.asarray(self._randoms)

  def choice(self, values, k):
    out, self._choices = self._choices[:k], self._choices[k:]
    assert all(v in values for v in out)
    return np.asarray(out, np.int32)


def masker(prob, max_predictions, whole_word=False):
  starts = np.ones(VOCAB, bool)
  starts[[11, 12]] = False  # pieces 11 and 12 continue the word before them
  return pretraining.Masker(vocab_size=VOCAB, special_ids=SPECIAL, mask_id=MASK,
                            masked_lm_prob=prob, max_predictions_per_seq=max_predictions,
                            whole_word_masking=whole_word, word_start_mask=starts)


def features(tokens_a, tokens_b, length=8):
  return pretraining.make_features(pretraining.Instance(tokens_a, tokens_b, False), cls_id=CLS,
                                   sep_id=SEP, pad_id=0, max_seq_length=length)


def test_masking_hand_computed():
  f = features([10, 11, 12], [13])  # [CLS] 10 11 12 [SEP] 13 [SEP] [PAD]
  np.testing.assert_array_equal(f['input_ids'], [2, 10, 11, 12, 3, 13, 3, 0])
  # 7 real tokens * 0.25 -> 2 predictions; candidates are positions 1, 2, 3, 5. The
  # permutation picks position 5, then 1; draws (sorted by position) 0.95 -> random token
  # 17 at 1, 0.5 -> [MASK] at 5.
  m = masker(0.25, 3)(f, ScriptedGenerator([3, 0, 1, 2], [0.95, 0.5], [17]))
  np.testing.assert_array_equal(m['input_ids'], [2, 17, 11, 12, 3, MASK, 3, 0])
  np.testing.assert_array_equal(m['masked_lm_positions'], [1, 5, 0])
  np.testing.assert_array_equal(m['masked_lm_ids'], [10, 13, 0])
  np.testing.assert_array_equal(m['masked_lm_weights'], [1, 1, 0])
  for k in ('segment_ids', 'attention_mask', 'next_sentence_labels'):
    np.testing.assert_array_equal(m[k], f[k])
  # 0.85 keeps the token: it is still predicted.
  m = masker(0.25, 3)(f, ScriptedGenerator([0, 3, 1, 2], [0.85, 0.1]))
  np.testing.assert_array_equal(m['input_ids'], [2, 10, 11, 12, 3, MASK, 3, 0])
  np.testing.assert_array_equal(m['masked_lm_ids'], [10, 13, 0])
  # max_predictions_per_seq caps the count.
  m = masker(0.5, 1)(f, ScriptedGenerator([2, 0, 1, 3], [0.1]))
  np.testing.assert_array_equal(m['masked_lm_positions'], [3])
  np.testing.assert_array_equal(m['input_ids'], [2, 10, 11, MASK, 3, 13, 3, 0])


def test_whole_word_groups_and_bert_skipping_of_words_that_do_not_fit():
  f = features([10, 11, 12], [13])  # words: (10 11 12) at 1-3, (13) at 5
  # 7 * 0.5 -> 4 predictions: the one-piece word, then the three-piece word fits.
  m = masker(0.5, 5, whole_word=True)(f, ScriptedGenerator([1, 0], [0.1] * 4))
  np.testing.assert_array_equal(m['masked_lm_positions'], [1, 2, 3, 5, 0])
  # 7 * 0.45 -> 3 predictions: after (13) the three-piece word would make 4: skipped, as in
  # BERT, so only one token is predicted.
  m = masker(0.45, 5, whole_word=True)(f, ScriptedGenerator([1, 0], [0.1]))
  np.testing.assert_array_equal(m['masked_lm_weights'], [1, 0, 0, 0, 0])
  np.testing.assert_array_equal(m['masked_lm_positions'], [5, 0, 0, 0, 0])
  # At most 2 predictions an instance: a word of more pieces (a text without spaces, to
  # sentencepiece) could never be chosen whole: its pieces are groups of their own.
  m = masker(0.5, 2, whole_word=True)(f, ScriptedGenerator([3, 0, 1, 2], [0.1] * 2))
  np.testing.assert_array_equal(m['masked_lm_positions'], [1, 5])
  # A continuation piece right after [SEP] (or first) starts its own group.
  ids = np.array([CLS, 11, 10, 11, SEP, 12, SEP, 0])
  groups = masker(0.5, 5, whole_word=True)._groups(ids, 7)  # pylint: disable=protected-access
  assert [g.tolist() for g in groups] == [[1], [2, 3], [5]]
  with pytest.raises(ValueError, match='word_start_mask'):
    pretraining.Masker(vocab_size=VOCAB, special_ids=SPECIAL, mask_id=MASK,
                       masked_lm_prob=0.15, max_predictions_per_seq=5,
                       whole_word_masking=True)
  with pytest.raises(ValueError, match='masked_lm_prob'):
    masker(1.5, 5)


def test_masking_statistics_and_specials_never_masked():
  rng = np.random.default_rng(0)
  m = masker(0.15, 20)
  n_real = n_masked = n_mask = n_same = 0
  for _ in range(2000):
    la = int(rng.integers(1, 40))
    lb = int(rng.integers(1, 61 - la))
    f = features(rng.integers(5, VOCAB, la).tolist(), rng.integers(5, VOCAB, lb).tolist(), 64)
    out = m(f, rng)
    w = out['masked_lm_weights'] > 0
    pos = out['masked_lm_positions'][w]
    assert not np.isin(f['input_ids'][pos], SPECIAL).any()
    assert not np.isin(out['input_ids'][~np.isin(np.arange(64), pos)], [MASK]).any()
    new = out['input_ids'][pos]  # [MASK], the token itself, or a random non-special one
    assert np.all((new == MASK) | ~np.isin(new, SPECIAL))
    n_real += f['attention_mask'].sum()
    n_masked += w.sum()
    n_mask += (out['input_ids'][pos] == MASK).sum()
    n_same += (out['input_ids'][pos] == f['input_ids'][pos]).sum()
  assert abs(n_masked / n_real - 0.15) < 0.01
  assert abs(n_mask / n_masked - 0.8) < 0.02
  # A random replacement draws the original 1 time in 15 (15 non-special ids), so "same"
  # is 10% + 10%/15.
  assert abs(n_same / n_masked - (0.1 + 0.1 / 15)) < 0.015


def doc(k, sentence_lengths):
  """Document k: sentences whose tokens are all 100 + k (so each token names its document)."""
  return [[100 + k] * n for n in sentence_lengths]


def test_pairs_keep_to_their_documents_and_nsp_is_balanced():
  rng = np.random.default_rng(1)
  # Long documents: a chunk of one sentence (a document's last, say) is always a random
  # next, as in BERT, which would tilt the balance in short ones.
  docs = [doc(k, rng.integers(2, 9, rng.integers(40, 60)).tolist()) for k in range(100)]
  stats = collections.Counter()
  instances = list(pretraining.block_instances(docs, max_seq_length=24, short_seq_prob=0.1,
                                               dupe_factor=2, seed=0, stats=stats))
  assert stats['documents'] == 100 and len(instances) > 2000
  for inst in instances:
    assert len(set(inst.tokens_a)) == 1 and len(set(inst.tokens_b)) == 1
    assert len(inst.tokens_a) + len(inst.tokens_b) <= 21
    # Actual next: B continues A's document. Random next: B is from another document.
    assert (inst.tokens_a[0] != inst.tokens_b[0]) == inst.is_random_next
  # A coin flip for each chunk of two sentences or more; a chunk of one (a document's last,
  # say) is always a random next: 0.53-0.57 over seeds 0-5 here.
  assert 0.5 < np.mean([i.is_random_next for i in instances]) < 0.6
  again = list(pretraining.block_instances(docs, max_seq_length=24, short_seq_prob=0.1,
                                           dupe_factor=2, seed=0, stats=collections.Counter()))
  assert again == instances  # deterministic from the seed


def test_empty_and_one_sentence_documents():
  stats = collections.Counter()
  docs = [[], [[]], doc(1, [4]), doc(2, [3, 3]), doc(3, [5, 2])]
  instances = list(pretraining.block_instances(docs, max_seq_length=16, short_seq_prob=0.0,
                                               dupe_factor=1, seed=0, stats=stats))
  assert stats['empty_documents'] == 2 and stats['single_sentence_documents'] == 1
  assert stats['documents'] == 3
  one = [i for i in instances if i.tokens_a[0] == 101]
  assert len(one) == 1 and one[0].is_random_next and one[0].tokens_b[0] != 101
  with pytest.raises(ValueError, match='max_seq_length=4'):
    list(pretraining.block_instances(docs, max_seq_length=4, short_seq_prob=0.0,
                                     dupe_factor=1, seed=0, stats=stats))


def test_records_round_trip_and_overlong_records_are_clear_errors():
  inst = pretraining.Instance([7, 8, 9], [10], True)
  assert pretraining.Instance.from_bytes(inst.to_bytes()) == inst
  with pytest.raises(ValueError, match='prepare again'):
    features(list(range(5, 15)), [5], length=8)


def test_block_instances_draw_random_next_from_every_other_document_of_the_block():
  rng = np.random.default_rng(2)
  docs = [doc(k, rng.integers(2, 9, rng.integers(30, 40)).tolist()) for k in range(12)]
  docs.insert(3, [[]])  # an empty document is counted and left out
  stats = collections.Counter()
  instances = list(pretraining.block_instances(docs, max_seq_length=24, short_seq_prob=0.1,
                                               dupe_factor=2, seed=5, stats=stats))
  assert stats['documents'] == 12 and stats['empty_documents'] == 1
  random_next = [i for i in instances if i.is_random_next]
  assert all(i.tokens_a[0] != i.tokens_b[0] for i in random_next)  # never its own document
  assert 0.4 < len(random_next) / len(instances) < 0.65  # one-sentence chunks: always random
  # Every document (the last one too) draws from documents before and after it.
  sources = collections.defaultdict(set)
  for i in random_next:
    sources[i.tokens_a[0]].add(i.tokens_b[0])
  pairs = {(a, b) for a, bs in sources.items() for b in bs}
  assert len(pairs) > 0.5 * 12 * 11  # most of the 132 (document, other document) pairs
  assert any(b < a for a, b in pairs if a < 111)  # not only the documents after it
  again = list(pretraining.block_instances(docs, max_seq_length=24, short_seq_prob=0.1,
                                           dupe_factor=2, seed=5, stats=collections.Counter()))
  assert again == instances
  single = list(pretraining.block_instances([doc(7, [3, 3])], max_seq_length=16,
                                            short_seq_prob=0.0, dupe_factor=1, seed=0,
                                            stats=collections.Counter()))
  # A block of one document: its actual next pairs, no random next (there is no other).
  assert single and not any(x.is_random_next for x in single)


def test_doc_sentences_pack_a_documents_consecutive_sentences_into_one_segment():
  """RoBERTa's DOC-SENTENCES (config.objective=mlm_doc): each document's sentences in order,
  packed up to max_seq_length - 2 tokens, a longer sentence cut into pieces of that length,
  never two documents in one instance; [CLS] A [SEP], one segment, no NSP label."""
  docs = [[[5, 6, 7], [8, 9], [10, 11, 12, 13]],  # 3 + 2 fit in 6; the next does not
          [[], [14] * 14],  # an empty sentence; one of 14 tokens: 6 + 6 + 2
          [[]],  # empty: counted, left out
          [[15]]]
  stats = collections.Counter()
  got = list(pretraining.doc_sentence_instances(docs, max_seq_length=8, short_seq_prob=0.5,
                                                dupe_factor=2, seed=0, stats=stats))
  packed = [[5, 6, 7, 8, 9], [10, 11, 12, 13], [14] * 6, [14] * 6, [14] * 2, [15]]
  assert [i.tokens_a for i in got] == packed[:2] * 2 + packed[2:5] * 2 + packed[5:] * 2
  assert all(i.tokens_b == [] and not i.is_random_next for i in got)
  assert stats['documents'] == 3 and stats['empty_documents'] == 1
  f = features([5, 6, 7], [], length=8)
  np.testing.assert_array_equal(f['input_ids'], [CLS, 5, 6, 7, SEP, 0, 0, 0])
  np.testing.assert_array_equal(f['segment_ids'], np.zeros(8))
  np.testing.assert_array_equal(f['attention_mask'], [1, 1, 1, 1, 1, 0, 0, 0])
  assert 'next_sentence_labels' not in f
  assert 'next_sentence_labels' in features([5], [6], length=8)
  with pytest.raises(ValueError, match='leaves no room for \\[CLS\\] A \\[SEP\\]'):
    list(pretraining.doc_sentence_instances(docs, max_seq_length=2, short_seq_prob=0.0,
                                            dupe_factor=1, seed=0, stats=stats))
  with pytest.raises(ValueError, match='config.objective=.electra.; choose mlm_nsp'):
    pretraining.objective('electra')


def test_full_sentences_pack_across_documents_with_a_separator_between_them():
  """RoBERTa's FULL-SENTENCES (config.objective=mlm): the block's sentences in order, packed
  up to max_seq_length - 2 tokens across documents, a separator (DOCUMENT_BREAK, [SEP] in
  the features) where one document ends and the next begins, none opening an instance; a
  longer sentence cut into pieces; one segment, no NSP label."""
  brk = pretraining.DOCUMENT_BREAK
  docs = [[[5, 6], [7]],  # 2 + 1
          [[8, 9]],  # + break + 2 = 6 tokens: full
          [[], [10] * 7],  # an empty sentence; 7 tokens: cut into 6 + 1
          [[]],  # empty: counted, left out
          [[11, 12]]]
  stats = collections.Counter()
  got = list(pretraining.full_sentence_instances(docs, max_seq_length=8, short_seq_prob=0.5,
                                                 dupe_factor=1, seed=0, stats=stats))
  assert [i.tokens_a for i in got] == [[5, 6, 7, brk, 8, 9], [10] * 6, [10, brk, 11, 12]]
  assert all(i.tokens_b == [] and not i.is_random_next for i in got)
  assert stats['documents'] == 4 and stats['empty_documents'] == 1
  f = features(got[2].tokens_a, [], length=8)
  np.testing.assert_array_equal(f['input_ids'], [CLS, 10, SEP, 11, 12, SEP, 0, 0])
  np.testing.assert_array_equal(f['segment_ids'], np.zeros(8))
  assert 'next_sentence_labels' not in f
  assert pretraining.objective('mlm').instances is pretraining.full_sentence_instances
  assert pretraining.objective('mlm_doc').instances is pretraining.doc_sentence_instances


def test_sentence_order_pairs_are_a_documents_segments_in_order_or_swapped():
  """ALBERT's sentence-order prediction (config.objective=mlm_sop), as its
  create_pretraining_data.py makes it: A and B are consecutive segments of one document, in
  order (label 0) or swapped (label 1) with probability 1/2; a chunk of one sentence is
  paired with another document's segment (label 1), as in BERT's pairs."""
  rng = np.random.default_rng(1)
  docs, start = [], 0  # token t: the t-th of the corpus, documents 1000 apart: order shows
  for _ in range(100):
    lengths = rng.integers(2, 9, rng.integers(40, 60))
    ends = start + np.cumsum(lengths)
    docs.append([list(range(e - n, e)) for e, n in zip(ends.tolist(), lengths.tolist())])
    start = ends[-1] + 1000
  docs.append([[10**6] * 5])  # a document of one sentence
  stats = collections.Counter()
  instances = list(pretraining.sentence_order_instances(
      docs, max_seq_length=24, short_seq_prob=0.1, dupe_factor=2, seed=0, stats=stats))
  assert stats['documents'] == 101 and len(instances) > 2000
  kinds = collections.Counter()
  for inst in instances:
    a, b = inst.tokens_a, inst.tokens_b
    assert a == sorted(a) and b == sorted(b) and len(a) + len(b) <= 21
    kind = ('random' if abs(b[0] - a[0]) >= 1000 else 'in order' if a[-1] < b[0] else
            'swapped' if b[-1] < a[0] else 'neither')
    kinds[kind] += 1
    assert inst.is_random_next == (kind != 'in order'), (kind, inst)
    if kind == 'random':  # (a chunk of one sentence: at most 8 tokens)
      assert len(a) <= 8
  assert kinds['neither'] == 0 and stats['swapped'] == kinds['swapped']
  assert stats['random_next'] == kinds['random']  # (the preparation's counts, apart)
  assert 0.45 < kinds['swapped'] / (kinds['swapped'] + kinds['in order']) < 0.55
  assert 0 < kinds['random'] < 0.1 * len(instances)  # documents' last sentences, mostly
  alone = [i for i in instances if i.tokens_a[0] == 10**6]
  assert len(alone) == 2 and all(i.is_random_next for i in alone)  # (dupe_factor 2)
  sop = pretraining.objective('mlm_sop')
  assert sop.next_sentence and sop.instances is pretraining.sentence_order_instances
  names = [o.instances_name for o in pretraining.OBJECTIVES.values()]
  assert len(set(names)) == len(names)  # (the fingerprint tells them apart)


def test_the_objective_is_checked_before_anything_runs():
  """config.objective: a name of OBJECTIVES, and BERT's pairs need two token types (RoBERTa's
  single segment takes one); a sweep checks each run's before any starts."""
  from configs import pretrain  # pylint: disable=g-import-not-at-top
  from realformer.tools import sweep  # pylint: disable=g-import-not-at-top
  config = pretrain.get_config('postln,tiny')
  assert pretraining.check_objective(config).next_sentence
  config.model.type_vocab_size = 1
  with pytest.raises(ValueError, match=r'model.type_vocab_size=1: pretraining pairs'):
    pretraining.check_objective(config)
  config.objective = 'mlm'
  assert not pretraining.check_objective(config).next_sentence
  runs = sweep.expand(['objective=mlm,electra'], types=sweep.field_types('configs/pretrain.py'))
  with pytest.raises(ValueError, match=r"the run with objective=electra: config.objective="
                                       r"'electra'; choose mlm_nsp"):
    sweep.check_keys('configs/pretrain.py:postln,tiny', runs)
