"""The pretraining input: a tfds source prepared end to end, BERT's instance creation and
masking, prepared shards, and the deterministic, resumable, per-host stream. (The tokenizer
and the sources have their own files: test_tokenizer.py, test_sources.py.)"""

import collections
import errno
import fcntl
import itertools
import json
import os
import random
import shutil
import threading

import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow_datasets as tfds

from configs import pretrain
from data import pipeline
from data import prepare
from data import pretraining
from data import sources
from data import tokenizer as tokenizer_lib
from realformer import storage


@pytest.fixture(scope='module')
def tok():
  return tokenizer_lib.Tokenizer.load(tokenizer_lib.EMBEDDED_TOKENIZER)


def embedded_documents(n):
  return list(itertools.islice(sources.iter_documents('embedded'), n))


# ------------------------------------------------------------------------------ tfds source

class TinyWiki(tfds.core.GeneratorBasedBuilder):
  """A Wikipedia-shaped tfds dataset (title, text with paragraphs) built locally."""
  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return self.dataset_info_from_configs(features=tfds.features.FeaturesDict(
        {'title': tfds.features.Text(), 'text': tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples()}

  def _generate_examples(self):
    for i, doc in enumerate(embedded_documents(6)):
      paragraphs = [' '.join(doc[j:j + 3]) for j in range(0, len(doc), 3)]
      yield i, {'title': f'speech {i}', 'text': '\n'.join(paragraphs)}


def test_tfds_source_goes_through_the_wikipedia_path(tmp_path):
  TinyWiki(data_dir=str(tmp_path)).download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))  # no network
  docs = list(sources.iter_documents('tfds:tiny_wiki:train', tfds_data_dir=str(tmp_path)))
  assert len(docs) == 6
  assert sorted(map(len, docs)) == sorted(map(len, embedded_documents(6)))
  config = tiny_config('tfds:tiny_wiki', tfds_data_dir=str(tmp_path))
  metadata = prepare.prepare(config, str(tmp_path / 'prepared'))
  assert metadata['counts']['train'] > 100
  with pytest.raises(FileNotFoundError, match='tfds build'):
    list(sources.iter_documents('tfds:tiny_wiki', tfds_data_dir=str(tmp_path / 'nothing')))


# ------------------------------------------------------------------------------ instances

class ScriptedRng:
  """random.Random stand-in that returns scripted values (to hand-compute BERT's choices)."""

  def __init__(self, randoms, randints):
    self.randoms, self.randints, self.ranges = list(randoms), list(randints), []

  def random(self):
    return self.randoms.pop(0)

  def randint(self, a, b):
    v = self.randints.pop(0)
    assert a <= v <= b
    self.ranges.append((a, b))
    return v


def test_instances_hand_computed():
  doc = [[10, 11], [12, 13, 14], [15]]
  # Not short (0.5), split after 2 sentences; alone, so the actual next (no draw for it).
  rng = ScriptedRng([0.5], [2])
  (inst,) = pretraining.instances_from_document(doc, [], 10, 0.1, rng)
  assert inst == pretraining.Instance([10, 11, 12, 13, 14], [15], False)
  assert not rng.randoms and not rng.randints
  f = pretraining.make_features(inst, cls_id=2, sep_id=3, pad_id=0, max_seq_length=10)
  np.testing.assert_array_equal(f['input_ids'], [2, 10, 11, 12, 13, 14, 3, 15, 3, 0])
  np.testing.assert_array_equal(f['segment_ids'], [0, 0, 0, 0, 0, 0, 0, 1, 1, 0])
  np.testing.assert_array_equal(f['attention_mask'], [1] * 9 + [0])
  assert f['next_sentence_labels'] == 0

  # Random next (0.3 < 0.5) from sentence 1 of the other document; [15] is put back and
  # becomes a one-sentence chunk, which always takes a random next (no draw for it).
  other = [[20, 21], [22]]
  rng = ScriptedRng([0.5, 0.3], [2, 0, 1, 0, 0])
  a, b = pretraining.instances_from_document(doc, [other], 10, 0.1, rng)
  assert a == pretraining.Instance([10, 11, 12, 13, 14], [22], True)
  assert b == pretraining.Instance([15], [20, 21, 22], True)

  # Alone in its block (no other document), a document never pairs with itself as a
  # "random" next: its pairs are actual nexts, and a one-sentence chunk makes none.
  rng, made = random.Random(0), 0
  for _ in range(50):
    doc = [[rng.randint(5, 99) for _ in range(rng.randint(1, 4))] for _ in range(8)]
    for inst in pretraining.instances_from_document(doc, [], 12, 0.3, rng):
      assert not inst.is_random_next
      made += 1
  assert made > 50

  # Short (0.05 < 0.1): one target length of randint(2, max_seq_length - 3) = 3 for the
  # whole document: chunks close at 3 tokens, and only the limit (7) truncates.
  rng = ScriptedRng([0.05], [3, 1, 1])
  a, b = pretraining.instances_from_document([[10, 11], [12, 13, 14], [15], [16, 17]], [], 10,
                                             0.1, rng)
  assert a == pretraining.Instance([10, 11], [12, 13, 14], False)
  assert b == pretraining.Instance([15], [16, 17], False)
  assert rng.ranges == [(2, 7), (1, 1), (1, 1)] and not rng.randoms

  tokens_a, tokens_b = list(range(6)), [9, 9]
  pretraining.truncate_seq_pair(tokens_a, tokens_b, 5, ScriptedRng([0.1, 0.9, 0.1], []))
  assert tokens_a == [2, 3, 4] and tokens_b == [9, 9]  # front, back, front of the longer


@pytest.fixture(scope='module')
def corpus_instances(tok):
  docs = [[tok.encode(s) for s in d] for d in embedded_documents(40)]
  stats = collections.Counter()
  # At 128 tokens most chunks hold several sentences; a one-sentence chunk (common when the
  # length is short compared with the sentences) always takes a random next, as in BERT.
  instances = list(pretraining.block_instances(docs, max_seq_length=128, short_seq_prob=0.1,
                                               dupe_factor=2, seed=0, stats=stats))
  return instances, stats


def test_instances_on_real_text_fit_and_balance_nsp(corpus_instances):
  instances, stats = corpus_instances
  assert stats["documents"] == 40 and len(instances) > 1500
  assert all(1 <= len(i.tokens_a) and 1 <= len(i.tokens_b) for i in instances)
  assert all(len(i.tokens_a) + len(i.tokens_b) <= 125 for i in instances)
  # One-sentence chunks always take a random next (as in BERT), so the share sits a little
  # above one half (0.51-0.58 over seeds); test_pretraining_data.py checks long documents.
  assert 0.45 < np.mean([i.is_random_next for i in instances]) < 0.62


def masked_examples(tok, instances, whole_word=False, seed=0):
  masker = pretraining.Masker(vocab_size=tok.vocab_size, special_ids=tok.special_ids,
                              mask_id=tok.mask_id, masked_lm_prob=0.15,
                              max_predictions_per_seq=20, whole_word_masking=whole_word,
                              word_start_mask=tok.word_start_mask())
  rng = np.random.default_rng(seed)
  for inst in instances:
    f = pretraining.make_features(inst, cls_id=tok.cls_id, sep_id=tok.sep_id,
                                  pad_id=tok.pad_id, max_seq_length=128)
    yield f, masker(f, rng)


def test_masking_rate_80_10_10_and_labels_only_at_masked_positions(tok, corpus_instances):
  n_real = n_masked = n_mask = n_same = 0
  for f, m in masked_examples(tok, corpus_instances[0][:1500]):
    w = m['masked_lm_weights'] > 0
    pos, labels = m['masked_lm_positions'][w], m['masked_lm_ids'][w]
    assert (np.diff(pos) > 0).all() and not (m['masked_lm_ids'][~w]).any()
    np.testing.assert_array_equal(labels, f['input_ids'][pos])  # labels are the originals
    assert not np.isin(f['input_ids'][pos], list(tok.special_ids)).any()
    changed = np.flatnonzero(m['input_ids'] != f['input_ids'])
    assert set(changed) <= set(pos)  # nothing changes outside the masked positions
    for k in ('segment_ids', 'attention_mask'):
      np.testing.assert_array_equal(m[k], f[k])
    n_real += f['attention_mask'].sum()
    n_masked += w.sum()
    n_mask += (m['input_ids'][pos] == tok.mask_id).sum()
    n_same += (m['input_ids'][pos] == labels).sum()
  assert abs(n_masked / n_real - 0.15) < 0.01
  assert abs(n_mask / n_masked - 0.8) < 0.02
  assert abs(n_same / n_masked - 0.1) < 0.015
  assert abs(1 - (n_mask + n_same) / n_masked - 0.1) < 0.015


def test_whole_word_masking_masks_whole_words(tok, corpus_instances):
  starts = tok.word_start_mask()
  some_multi_piece = False
  for f, m in masked_examples(tok, corpus_instances[0][:300], whole_word=True):
    masked = np.zeros(128, bool)
    masked[m['masked_lm_positions'][m['masked_lm_weights'] > 0]] = True
    ids, n = f['input_ids'], int(f['attention_mask'].sum())
    for p in range(1, n):
      special = {int(ids[p]), int(ids[p - 1])} & tok.special_ids
      if not starts[ids[p]] and not special:  # the piece at p continues the word at p-1
        assert masked[p] == masked[p - 1]
        some_multi_piece |= bool(masked[p])
  assert some_multi_piece


# ------------------------------------------------------------------------------ pipeline

def tiny_config(sources_spec, **data):
  c = pretrain.get_config('postln,tiny')
  c.unlock()
  c.data.sources = sources_spec
  c.data.max_seq_length = 32
  c.data.max_predictions_per_seq = 5
  c.data.eval_fraction = 0.2
  for k, v in data.items():
    c.data[k] = v
  return c


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
  root = tmp_path_factory.mktemp('prepared')
  corpus = root / 'corpus.txt'
  corpus.write_text(''.join('\n'.join(d) + '\n\n' for d in embedded_documents(8)))
  config = tiny_config(f'files:{corpus}', document_window=2, blocks_per_file=1)
  metadata = prepare.prepare(config, str(root / 'shards'))
  return config, str(root / 'shards'), metadata


def test_a_prepared_folder_under_home_is_prepared_there(prepared, tmp_path, monkeypatch):
  """data.prepared_dir='~/...' (a config file's, or --flag=~/... that no shell expands) is
  the home folder's, as --workdir is, not a folder named ~ in the current one."""
  config = prepared[0].copy_and_resolve_references()
  config.data.prepared_dir = '~/shards'
  monkeypatch.setenv('HOME', str(tmp_path / 'home'))
  (tmp_path / 'elsewhere').mkdir()
  monkeypatch.chdir(tmp_path / 'elsewhere')
  got = pipeline.ensure_prepared(config, str(tmp_path / 'workdir'))
  assert got == str(tmp_path / 'home' / 'shards')
  assert (tmp_path / 'home' / 'shards' / prepare.METADATA).exists()
  assert not os.listdir(tmp_path / 'elsewhere')


def batches(config, tok, prepared_dir, n, **kw):
  kw = dict(dict(global_batch_size=8, seed=3), **kw)
  it = pipeline.make_pretraining_iterator(config.data, tok, prepared_dir, **kw)
  return it, [next(it) for _ in range(n)]


def test_prepare_writes_shards_and_metadata(prepared, tok):
  config, prepared_dir, metadata = prepared
  assert metadata['counts']['train'] > 300 and metadata['counts']['eval'] > 0
  blocks = {int(b) for b in pipeline.parse_blocks(metadata['blocks']['train'])[:, 0]}
  assert metadata['files']['train'] == len(blocks) > 2  # blocks of 2 documents, a file each
  assert sorted(os.listdir(prepared_dir)) == sorted(
      ['metadata.json'] + [f'{s}-{i:05d}-of-{metadata["files"][s]:05d}' for s in ('train', 'eval')
                           for i in range(metadata['files'][s])])
  _, (b,) = batches(config, tok, prepared_dir, 1, split='eval')
  assert b['input_ids'].shape == (8, 32) and b['masked_lm_ids'].shape == (8, 5)
  assert (b['input_ids'][:, 0] == tok.cls_id).all()


def test_same_seed_same_batches_another_seed_other_batches(prepared, tok):
  config, prepared_dir, _ = prepared
  _, a = batches(config, tok, prepared_dir, 3)
  _, b = batches(config, tok, prepared_dir, 3)
  _, c = batches(config, tok, prepared_dir, 3, seed=4)
  for x, y in zip(a, b):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  assert not np.array_equal(a[0]['input_ids'], c[0]['input_ids'])
  # (that an epoch re-masks each instance anew: test_pipeline.py's
  # test_every_epoch_reshuffles_and_remasks)


def test_restored_iterator_continues_exactly(prepared, tok, tmp_path):
  config, prepared_dir, _ = prepared
  _, expected = batches(config, tok, prepared_dir, 6)
  it, _ = batches(config, tok, prepared_dir, 3)
  with ocp.CheckpointManager(tmp_path / 'ckpt', item_names=('data',)) as mngr:
    mngr.save(3, args=ocp.args.Composite(data=pipeline.iterator_checkpoint_args(it, 'save')))
    mngr.wait_until_finished()
  fresh = pipeline.make_pretraining_iterator(config.data, tok, prepared_dir, global_batch_size=8,
                                             seed=3)
  with ocp.CheckpointManager(tmp_path / 'ckpt', item_names=('data',)) as mngr:
    mngr.restore(3, args=ocp.args.Composite(
        data=pipeline.iterator_checkpoint_args(fresh, 'restore')))
  for want in expected[3:]:
    got = next(fresh)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])


def test_a_moved_preparation_resumes_and_old_states_restore(prepared, tok, tmp_path):
  """The iterator's state names the shards by their blocks' record counts, not their
  folder: restored over a copy at another path (a moved workdir, another prepared_dir) or
  over the data prepared again by another number of workers, it continues exactly; a state
  saved before (grain's path hash) restores onto a preparation of that time. Data prepared
  otherwise is refused."""
  config, prepared_dir, metadata = prepared
  _, expected = batches(config, tok, prepared_dir, 5)
  it, _ = batches(config, tok, prepared_dir, 3)
  state = it.get_state()
  assert b'PreparedShards(blocks=' in state and prepared_dir.encode() not in state
  copy = str(tmp_path / 'moved')
  shutil.copytree(prepared_dir, copy)
  again = str(tmp_path / 'again')
  more_workers = tiny_config(config.data.sources, document_window=2, blocks_per_file=1,
                             prepare_workers=2)
  assert prepare.prepare(more_workers, again)['file_records'] != metadata['file_records']
  for directory in (copy, again):
    fresh = pipeline.make_pretraining_iterator(config.data, tok, directory, global_batch_size=8,
                                               seed=3)
    fresh.set_state(state)
    for want in expected[3:]:
      got = next(fresh)
      for k in want:
        np.testing.assert_array_equal(got[k], want[k])
  # Grain's path hash named the data when preparations had no blocks (read in the files'
  # order): such a state restores onto such a preparation, not onto block-ordered data.
  legacy = str(tmp_path / 'legacy')
  shutil.copytree(prepared_dir, legacy)
  with open(os.path.join(legacy, prepare.METADATA), 'w') as f:
    json.dump({k: v for k, v in metadata.items() if k != 'blocks'}, f)
  _, expected = batches(config, tok, legacy, 5)
  it, _ = batches(config, tok, legacy, 3)
  old = json.loads(it.get_state())
  old['data_source'] = 'ArrayRecordDataSource(hash_of_paths=0123abcd)'
  fresh = pipeline.make_pretraining_iterator(config.data, tok, legacy, global_batch_size=8,
                                             seed=3)
  fresh.set_state(json.dumps(old).encode())
  for want in expected[3:]:
    got = next(fresh)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
  fresh = pipeline.make_pretraining_iterator(config.data, tok, prepared_dir,
                                             global_batch_size=8, seed=3)
  with pytest.raises(ValueError, match='does not match'):
    fresh.set_state(json.dumps(old).encode())
  other = str(tmp_path / 'other')  # other blocks: other records, in another order
  prepare.prepare(tiny_config(config.data.sources, document_window=3), other)
  fresh = pipeline.make_pretraining_iterator(config.data, tok, other, global_batch_size=8,
                                             seed=3)
  with pytest.raises(ValueError, match='does not match'):
    fresh.set_state(state)


def _originals(batch):
  ids = batch['input_ids'].copy()
  for row, pos, lab, w in zip(ids, batch['masked_lm_positions'], batch['masked_lm_ids'],
                              batch['masked_lm_weights']):
    row[pos[w > 0]] = lab[w > 0]
  return [tuple(r) for r in ids]


def test_processes_read_disjoint_shares_that_cover_the_data(prepared, tok):
  config, prepared_dir, metadata = prepared
  n = metadata['counts']['train']
  seen = []
  for p in range(2):
    it = pipeline.make_pretraining_iterator(config.data, tok, prepared_dir, global_batch_size=8,
                                            seed=0, process_index=p, process_count=2,
                                            num_epochs=1)
    seen.append([x for b in it for x in _originals(b)])
  assert all(len(s) == (n // 2) // 4 * 4 for s in seen)  # per-host batches of 4
  everything = collections.Counter(seen[0]) + collections.Counter(seen[1])
  ds = pipeline.grain.ArrayRecordDataSource(
      prepare.shard_paths(prepared_dir, 'train', metadata['files']['train']))
  originals = collections.Counter(
      tuple(pretraining.make_features(pretraining.Instance.from_bytes(ds[i]), cls_id=2,
                                      sep_id=3, pad_id=0, max_seq_length=32)['input_ids'])
      for i in range(len(ds)))
  assert not set(seen[0]) & set(seen[1]) - {k for k, v in originals.items() if v > 1}
  assert sum((originals - everything).values()) < 8  # only the dropped remainder is missing


def test_bad_inputs_are_clear_errors(prepared, tok, tmp_path, caplog):
  config, prepared_dir, _ = prepared
  long = tiny_config(config.data.sources, max_seq_length=256)
  with pytest.raises(ValueError, match='exceeds the model\'s positions'):
    prepare.prepare(long, str(tmp_path / 'x'))
  (tmp_path / 'empty.txt').write_bytes(b'')
  with pytest.raises(ValueError, match='gave no training examples'):
    prepare.prepare(tiny_config(f'files:{tmp_path}/empty.txt'), str(tmp_path / 'y'))
  # a corpus of one's own read with the shipped speeches' vocabulary: said (a warning)
  assert ('data.tokenizer is empty: the shipped 8k vocabulary of the State of the Union '
          f'speeches tokenizes files:{tmp_path}/empty.txt') in caplog.text
  caplog.clear()
  with pytest.raises(ValueError, match='gave no training examples'):
    prepare.prepare(tiny_config(f'files:{tmp_path}/empty.txt',
                                tokenizer=tokenizer_lib.EMBEDDED_TOKENIZER), str(tmp_path / 'y'))
  assert 'data.tokenizer is empty' not in caplog.text
  other = tiny_config(config.data.sources, prepared_dir=prepared_dir, short_seq_prob=0.5)
  with pytest.raises(ValueError, match='made with other settings'):
    pipeline.ensure_prepared(other, str(tmp_path))
  with pytest.raises(ValueError, match='fewer than one batch'):
    pipeline.make_pretraining_iterator(config.data, tok, prepared_dir, split='eval',
                                       global_batch_size=4096, seed=0)
  none_held_out = tiny_config(config.data.sources, eval_fraction=0.0)
  assert prepare.prepare(none_held_out, str(tmp_path / 'z'))['files']['eval'] == 0
  with pytest.raises(ValueError, match='the eval split of .* has 0 examples, fewer than one '
                     'batch of 8 per process; use a larger data.eval_fraction'):
    pipeline.make_pretraining_iterator(config.data, tok, str(tmp_path / 'z'), split='eval',
                                       global_batch_size=8, seed=0)


def test_a_changed_corpus_is_not_silently_reused(tmp_path):
  """Prepared data records what its files: sources matched (names, sizes): a file that is
  converted, edited, added or removed afterwards is an error naming the change; a copy of
  the corpus elsewhere (another host's folder) still matches."""
  corpus = tmp_path / 'a' / 'corpus.txt'
  corpus.parent.mkdir()
  corpus.write_text(''.join('\n'.join(d) + '\n\n' for d in embedded_documents(8)))
  config = tiny_config(f'files:{tmp_path}/a/*.txt', prepared_dir=str(tmp_path / 'shards'))
  prepare.prepare(config, config.data.prepared_dir)
  assert prepare.read_metadata(config.data.prepared_dir)['fingerprint']['files'].startswith(
      '1 files, ')
  shutil.copytree(tmp_path / 'a', tmp_path / 'b')
  moved = tiny_config(f'files:{tmp_path}/b/*.txt', prepared_dir=str(tmp_path / 'shards'))
  with pytest.raises(ValueError, match='made with other settings'):  # sources differ
    pipeline.ensure_prepared(moved, str(tmp_path))
  assert (prepare.fingerprint(moved)['files'] == prepare.fingerprint(config)['files'])
  pipeline.ensure_prepared(config, str(tmp_path))  # unchanged: reused
  # A run of another seed: the preparation takes the run's seed, unless data.seed is set.
  other_seed = config.copy_and_resolve_references()
  other_seed.seed = 1
  with pytest.raises(ValueError, match=r"made with other settings \(prepared, configured\): "
                     r"\{'seed': \(0, 1\)\}; set data.seed=0 \(the seed it was prepared with"):
    pipeline.ensure_prepared(other_seed, str(tmp_path))
  other_seed.data.seed = 0
  pipeline.ensure_prepared(other_seed, str(tmp_path))  # reused
  with open(corpus, 'a') as f:
    f.write('One more sentence was added.\n')
  with pytest.raises(ValueError, match='made with other corpus files.*delete the directory'):
    pipeline.ensure_prepared(config, str(tmp_path))
  (tmp_path / 'a' / 'more.txt').write_text('Another file.\n')
  with pytest.raises(ValueError, match="'2 files, "):
    pipeline.ensure_prepared(config, str(tmp_path))
  # Where the raw text is not (deleted, or another machine), the prepared data is used.
  shutil.rmtree(tmp_path / 'a')
  assert pipeline.ensure_prepared(config, str(tmp_path)) == config.data.prepared_dir


def test_a_worker_that_saw_other_corpus_files_stops_the_gathering(tmp_path, monkeypatch):
  """The corpus changed while it was being prepared (or a host's copy differs): process 0
  stops at once with the difference instead of waiting for a worker that never matches."""
  corpus = tmp_path / 'corpus.txt'
  corpus.write_text(''.join('\n'.join(d) + '\n\n' for d in embedded_documents(8)))
  config = tiny_config(f'files:{corpus}')
  work = prepare._work

  def work_then_append(*args, **kwargs):
    work(*args, **kwargs)
    with open(corpus, 'a') as f:
      f.write('Appended while the worker ran.\n')
  monkeypatch.setattr(prepare, '_work', work_then_append)
  with pytest.raises(ValueError, match="worker 0 of 1 saw other settings or corpus files.*'files'"):
    prepare.prepare(config, str(tmp_path / 'data'), timeout_s=600)


def test_a_preparation_takes_its_turn_by_a_lock_a_network_file_system_grants(
    prepared, tmp_path, monkeypatch):
  """Preparations on one host take turns through an flock, which a network file system
  (NFS) grants as a byte-range lock only on a file open for writing (a workdir there holds
  its data/); it leaves no lock file; a file system without locks is one line."""
  real = fcntl.flock

  def nfs_flock(fd, op):
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
      raise OSError(errno.EBADF, os.strerror(errno.EBADF))
    return real(fd, op)
  monkeypatch.setattr(storage.fcntl, 'flock', nfs_flock)
  config = prepared[0]
  metadata = prepare.prepare(config, str(tmp_path / 'nfs' / 'data'))
  assert metadata['counts'] == prepared[2]['counts']
  assert os.listdir(tmp_path / 'nfs') == ['data']
  # Two at once: the second waits for the first to let go (then takes the file anew).
  staging = str(tmp_path / 'nfs' / 'data.tmp')
  first, taken = prepare._single_host_lock(staging), threading.Event()  # pylint: disable=protected-access
  second = []
  thread = threading.Thread(target=lambda: (second.append(
      prepare._single_host_lock(staging)), taken.set()))  # pylint: disable=protected-access
  thread.start()
  assert not taken.wait(0.5)
  first.close()
  assert taken.wait(30)
  thread.join()
  second[0].close()
  assert os.listdir(tmp_path / 'nfs') == ['data']

  def no_locks(*_):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
  monkeypatch.setattr(storage.fcntl, 'flock', no_locks)
  with pytest.raises(ValueError, match=f'{tmp_path}/nfs is on a file system that cannot lock '
                                       'files .*; prepare into a folder on a local disk, or a '
                                       'gs:// bucket'):
    prepare.prepare(config, str(tmp_path / 'nfs' / 'again'))


def test_failed_preparation_leaves_nothing_and_names_undecodable_lines(tmp_path, tok, caplog):
  with pytest.raises(FileNotFoundError, match='matches no file'):
    prepare.prepare(tiny_config(f'files:{tmp_path}/nothing*.txt'), str(tmp_path / 'data'))
  assert os.listdir(tmp_path) == []  # no orphan data.tmp-<pid>
  # Latin-1 text: every line with an accent is undecodable as UTF-8.
  lines = [f'Le caf\xe9 num\xe9ro {i} est ferm\xe9.' for i in range(40)]
  text = '\n\n'.join('\n'.join(lines[i:i + 4]) for i in range(0, 40, 4)) + '\n'
  (tmp_path / 'latin1.txt').write_bytes(text.encode('latin-1'))
  with pytest.raises(ValueError, match='no training examples.*non_utf8_lines'):
    prepare.prepare(tiny_config(f'files:{tmp_path}/latin1.txt'), str(tmp_path / 'data'))
  assert '40 lines of config.data.sources' in caplog.text and 'not UTF-8' in caplog.text
  assert sorted(os.listdir(tmp_path)) == ['latin1.txt']


def test_the_open_file_limit_is_raised_to_hold_the_prepared_files(monkeypatch):
  """Grain keeps every file it read from open: the soft limit (often 1024) is raised to hold
  a host's files, up to the hard limit; beyond it, a one-line error with the fix."""
  import resource  # pylint: disable=g-import-not-at-top
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  open_now = len(os.listdir('/proc/self/fd'))
  if hard != resource.RLIM_INFINITY and hard < open_now + 1000:
    pytest.skip(f'the hard limit on open files ({hard}) leaves no room to raise the soft one')
  try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 100, hard))
    pipeline.allow_open_files(500)
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= open_now + 500
  finally:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
  monkeypatch.setattr(resource, 'getrlimit', lambda _: (1024, 2048))
  with pytest.raises(ValueError, match='keeps 5000 files open, but this process may open at '
                     r'most 2048 \(ulimit -Hn\); raise that limit, or prepare again'):
    pipeline.allow_open_files(5000)
