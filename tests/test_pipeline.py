"""The prepared-shard stream on a slice of the embedded corpus: every epoch re-masks every
instance, a restore continues exactly (also across an epoch, also on another host), worker
processes give the same batches, and preparation is safe with several processes.

(tests/test_data.py covers the single-epoch basics: layout, same seed same batches, a
mid-epoch restore, disjoint host shares, clear errors.)"""

import collections
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import textwrap
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import pretrain
from data import pipeline
from data import prepare
from data import pretraining
from data import sources
from data import tokenizer as tokenizer_lib
from realformer import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 8


@pytest.fixture(scope='module')
def tok():
  return tokenizer_lib.Tokenizer.load(tokenizer_lib.EMBEDDED_TOKENIZER)


def tiny_config(corpus, **data):
  c = pretrain.get_config('postln,tiny')
  c.unlock()
  c.data.update(dict(sources=f'files:{corpus}', max_seq_length=32, max_predictions_per_seq=5,
                     eval_fraction=0.2), **data)
  return c


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  path = tmp_path_factory.mktemp('corpus') / 'corpus.txt'
  docs = itertools.islice(sources.iter_documents('embedded'), 4)
  path.write_text(''.join('\n'.join(d) + '\n\n' for d in docs))
  return str(path)


@pytest.fixture(scope='module')
def prepared(corpus, tmp_path_factory):
  config = tiny_config(corpus)
  out = str(tmp_path_factory.mktemp('prepared') / 'shards')
  return config, out, prepare.prepare(config, out)


def stream(prepared, tok, **kw):
  config, prepared_dir, _ = prepared
  kw = dict(dict(global_batch_size=BATCH, seed=5), **kw)
  return pipeline.make_pretraining_iterator(config.data, tok, prepared_dir, **kw)


def originals(batch):
  """The unmasked input_ids of each row (masked positions get their labels back)."""
  ids = batch['input_ids'].copy()
  for row, pos, lab, w in zip(ids, batch['masked_lm_positions'], batch['masked_lm_ids'],
                              batch['masked_lm_weights']):
    row[pos[w > 0]] = lab[w > 0]
  return [tuple(r) for r in ids]


def assert_same(a, b):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_every_epoch_reshuffles_and_remasks(prepared, tok):
  n = prepared[2]['counts']['train']
  rows = []
  for b in stream(prepared, tok, num_epochs=2):
    rows += [(o, tuple(p), tuple(i)) for o, p, i in zip(
        originals(b), b['masked_lm_positions'], b['input_ids'])]
  first, second = rows[:n], rows[n:]
  assert len(first) == n and len(second) >= n - BATCH
  assert [r[0] for r in first] != [r[0] for r in second[:len(first)]]  # a new order
  once = {o for o, c in collections.Counter(r[0] for r in first).items() if c == 1}
  masks = collections.defaultdict(list)
  for o, positions, ids in rows:
    if o in once:
      masks[o].append((positions, ids))
  twice = [m for m in masks.values() if len(m) == 2]
  assert len(twice) > 0.9 * len(once)  # the same instances again...
  remasked = np.mean([m[0] != m[1] for m in twice])
  assert remasked > 0.9, remasked  # ...masked anew


def test_restore_across_epochs_on_a_second_host(prepared, tok, tmp_path):
  kw = dict(process_index=1, process_count=2)
  per_host = prepared[2]['counts']['train'] // 2 // (BATCH // 2)  # batches per epoch
  steps = per_host + 3
  it = stream(prepared, tok, **kw)
  expected = [next(it) for _ in range(steps + 2)]
  for stop in (per_host - 1, per_host + 1):  # just before and just after the epoch ends
    it = stream(prepared, tok, **kw)
    for _ in range(stop):
      next(it)
    with ocp.CheckpointManager(tmp_path / f'ckpt{stop}', item_names=('data',)) as mngr:
      mngr.save(stop, args=ocp.args.Composite(
          data=pipeline.iterator_checkpoint_args(it, 'save')))
      mngr.wait_until_finished()
    fresh = stream(prepared, tok, **kw)
    with ocp.CheckpointManager(tmp_path / f'ckpt{stop}', item_names=('data',)) as mngr:
      mngr.restore(stop, args=ocp.args.Composite(
          data=pipeline.iterator_checkpoint_args(fresh, 'restore')))
    for want in expected[stop:stop + 3]:
      assert_same(next(fresh), want)
  with pytest.raises(ValueError, match='save or restore'):
    pipeline.iterator_checkpoint_args(it, 'load')


def test_worker_processes_give_the_same_batches(prepared, tok):
  config = prepared[0]
  it = stream(prepared, tok)
  want = [next(it) for _ in range(4)]
  with_workers = (prepared[0].copy_and_resolve_references(), *prepared[1:])
  with_workers[0].data.worker_count = 1
  it = stream(with_workers, tok)
  for w in want:
    assert_same(next(it), w)
  assert config.data.worker_count == 0


def _run_with_workers(prepared, tmp_path, then: str) -> subprocess.CompletedProcess:
  """A process that reads the first batch of a stream with one grain worker, `then` runs."""
  config, prepared_dir, _ = prepared
  config = config.copy_and_resolve_references()
  config.data.worker_count = 1
  (tmp_path / 'data.json').write_text(config.data.to_json())
  code = textwrap.dedent(f"""
      import json, multiprocessing, os, signal, sys
      signal.signal(signal.SIGINT, signal.default_int_handler)  # (as at a terminal)
      sys.path.insert(0, {REPO!r})
      import ml_collections
      from data import pipeline, tokenizer
      data = ml_collections.ConfigDict(json.load(open({str(tmp_path / 'data.json')!r})))
      it = pipeline.make_pretraining_iterator(
          data, tokenizer.Tokenizer.load(tokenizer.EMBEDDED_TOKENIZER), {prepared_dir!r},
          global_batch_size={BATCH}, seed=5)
      next(it)
      workers = multiprocessing.active_children()
      """) + textwrap.dedent(then)
  return subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True,
                        text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS='cpu'))


def test_grain_workers_leave_ctrl_c_to_the_run(prepared, tmp_path):
  """A Ctrl-C at the terminal reaches the run's whole process group; grain's workers ignore
  it and go on feeding the run, which saves at its next step (workdir.stop_signals), where
  they died with a KeyboardInterrupt and the stream stopped once their batches ran out."""
  proc = _run_with_workers(prepared, tmp_path, """
      assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (restored)
      for worker in workers:  # as the terminal's Ctrl-C to the process group
        os.kill(worker.pid, signal.SIGINT)
      print('read', sum(1 for _ in zip(range(40), it)), 'batches after', len(workers),
            'workers were sent SIGINT', flush=True)
      """)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'read 40 batches after 1 workers were sent SIGINT' in proc.stdout, proc.stderr[-3000:]
  assert 'KeyboardInterrupt' not in proc.stderr, proc.stderr[-3000:]


def _running(pid: int) -> bool:
  """Whether process `pid` runs (a zombie that nobody reaps has ended)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except FileNotFoundError:
    return False


def test_grain_workers_end_with_a_run_killed_by_sigkill(prepared, tmp_path):
  """A run killed by SIGKILL (a preemption, the OOM killer) takes its grain workers with it:
  blocked on their full queues, they lived on for ever, holding their memory on the host
  where the run then starts again (prepare.die_with_parent, as the preparation's workers)."""
  proc = _run_with_workers(prepared, tmp_path, """
      print('workers', *[w.pid for w in workers], flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
      """)
  assert proc.returncode == -9, proc.stderr[-3000:]
  workers = [int(pid) for pid in proc.stdout.split('workers', 1)[1].split()]
  assert len(workers) == 1, proc.stdout
  deadline = time.time() + 30
  while any(map(_running, workers)) and time.time() < deadline:
    time.sleep(0.2)
  alive = [pid for pid in workers if _running(pid)]
  for pid in alive:  # (not left behind by a failure)
    os.kill(pid, signal.SIGKILL)
  assert not alive, f'grain workers {alive} outlived their run'


def test_metadata_records_what_was_prepared(prepared):
  _, prepared_dir, metadata = prepared
  with open(os.path.join(prepared_dir, 'metadata.json')) as f:
    assert json.load(f) == metadata
  assert metadata['tokenizer_path'] == tokenizer_lib.EMBEDDED_TOKENIZER
  assert metadata['vocab_size'] == 8000 and metadata['max_seq_length'] == 32
  stats = metadata['stats']
  assert stats['train/documents'] + stats['eval/documents'] == 4
  assert stats['eval/documents'] >= 1  # 1 in 5 held out by the hash of the index: 1 of 4


def test_an_eval_split_of_one_document_is_flagged(corpus, tmp_path, caplog):
  # One eval document has no other to draw random-next segments from, so its NSP labels are
  # all 0: preparing says so. Two documents (0 and 2 of 4 at 0.25) do not, nor do ALBERT's
  # sentence-order pairs of one document (swapped half the time).
  for fraction, objective, warned in ((0.2, 'mlm_nsp', True), (0.25, 'mlm_nsp', False),
                                      (0.2, 'mlm_sop', False)):
    caplog.clear()
    config = tiny_config(corpus, eval_fraction=fraction)
    config.objective = objective
    metadata = prepare.prepare(config, str(tmp_path / f'{fraction}{objective}'))
    stats = metadata['stats']
    assert stats['eval/documents'] == (1 if fraction == 0.2 else 2)
    assert ('eval NSP accuracy means nothing' in caplog.text) == warned
    assert (stats.get('eval/swapped', 0) > 0) == (objective == 'mlm_sop')
    ones = stats.get('eval/random_next', 0) + stats.get('eval/swapped', 0)  # label 1
    assert 0 < ones < metadata['counts']['eval'] or warned
  config.objective = 'mlm_nsp'  # (ALBERT's pairs are not BERT's)
  with pytest.raises(ValueError, match="instances.*sentence_order_pairs.*mlm_sop"):
    prepare.read_metadata(str(tmp_path / '0.2mlm_sop'), config)


def test_a_sentence_per_row_source_is_flagged_and_rows_make_documents(tmp_path, caplog):
  """A Hugging Face corpus of one sentence per row (BookCorpus's copies on the hub): each row
  a document gives only random-next pairs, and preparing says so; with
  data.hf_rows_per_document consecutive rows make documents and true next sentences exist."""
  import datasets  # pylint: disable=g-import-not-at-top
  rows = list(itertools.islice(itertools.chain.from_iterable(
      sources.iter_documents('embedded')), 400))
  saved = tmp_path / 'rows'
  datasets.DatasetDict({'train': datasets.Dataset.from_dict({'text': rows})}).save_to_disk(
      str(saved))
  labels = {}
  for per_document in ('1', '20'):
    caplog.clear()
    config = tiny_config(f'{tmp_path}/unused', hf_rows_per_document=per_document,
                         max_seq_length=128, max_predictions_per_seq=20)  # several sentences
    config.data.sources = f'hf:{saved}'
    out = str(tmp_path / f'prepared{per_document}')
    metadata = prepare.prepare(config, out)
    assert ('hold one sentence, so all their instances are random next' in caplog.text) == (
        per_document == '1')
    assert metadata['stats']['train/documents'] + metadata['stats']['eval/documents'] == (
        400 // int(per_document))
    assert metadata['fingerprint'].get('hf_rows_per_document', '1') == per_document
    labels[per_document] = [pretraining.Instance.from_bytes(r).is_random_next
                            for r in _records(out, metadata)['train']]
    assert metadata['stats'].get('train/random_next', 0) == sum(labels[per_document])
    # (the share itself said: a corpus split otherwise than in sentences shows it alone)
    assert ('100% of the training pairs are random next (NSP label 1; about half in BERT'
            in caplog.text) == (per_document == '1')
  assert all(labels['1']) and 0.3 < np.mean(labels['20']) < 0.7
  # The grouped preparation is not taken for one of single rows, nor the other way round
  # (a fingerprint without the key, as before the setting existed, stands for rows of 1).
  for prepared, configured in (('20', '1'), ('1', '20')):
    config.data.hf_rows_per_document = configured
    with pytest.raises(ValueError, match=f"'hf_rows_per_document': \\('{prepared}', "
                                         f"'{configured}'\\)"):
      prepare.read_metadata(str(tmp_path / f'prepared{prepared}'), config)
  for bad in ('0', '1;2', 'x'):
    config.data.hf_rows_per_document = bad
    with pytest.raises(ValueError, match=f"hf_rows_per_document='{bad}': give a positive"):
      prepare.prepare(config, str(tmp_path / 'bad'))


def test_hosts_wait_for_process_zero_and_finished_preparations_are_kept(
    prepared, tmp_path, monkeypatch):
  config = prepared[0].copy_and_resolve_references()
  config.data.prepared_dir = str(tmp_path / 'shared')
  monkeypatch.setattr(jax, 'process_index', lambda: 1)  # the second of two hosts: it
  monkeypatch.setattr(jax, 'process_count', lambda: 2)  # prepares its share, then waits
  monkeypatch.setattr(prepare, 'POLL_SECONDS', 0.1)      # (looking every 0.1 s, not 2)
  with pytest.raises(TimeoutError, match='did not finish preparing'):
    pipeline.ensure_prepared(config, str(tmp_path), timeout_s=0.1)
  writer = threading.Timer(0.5, prepare.prepare, (config, config.data.prepared_dir))
  writer.start()
  start = time.time()
  assert pipeline.ensure_prepared(config, str(tmp_path)) == config.data.prepared_dir
  writer.join()
  assert time.time() - start >= 0.5
  # A second writer that finishes later keeps the first preparation (hosts may be reading).
  first = prepare.read_metadata(config.data.prepared_dir)
  assert prepare.prepare(config, config.data.prepared_dir, overwrite=False) == first


def test_a_re_preparation_killed_midway_never_leaves_a_half_deleted_one(prepared, tmp_path,
                                                                        monkeypatch):
  """The preparation an overwrite replaces is never deleted in place: a kill while it is
  deleted (here, once every file but its metadata.json is gone) would leave a folder that a
  run takes for complete."""
  import shutil  # pylint: disable=g-import-not-at-top
  config, _, _ = prepared
  out = str(tmp_path / 'shards')
  prepare.prepare(config, out)
  rmtree = shutil.rmtree

  def killed_midway(path, *args, **kwargs):  # any deletion of a preparation, at any depth
    held = [(folder, names) for folder, _, names in os.walk(path) if prepare.METADATA in names]
    if held:
      for folder, names in held:
        for name in names:
          if name != prepare.METADATA:
            os.remove(os.path.join(folder, name))
      raise KeyboardInterrupt
    return rmtree(path, *args, **kwargs)
  monkeypatch.setattr(shutil, 'rmtree', killed_midway)
  try:
    prepare.prepare(config, out)  # overwrites
  except KeyboardInterrupt:
    pass
  monkeypatch.setattr(shutil, 'rmtree', rmtree)
  metadata = prepare.read_metadata(out)
  for split in prepare.SPLITS:
    for path in prepare.shard_paths(out, split, prepare.num_files(metadata, split)):
      assert os.path.isfile(path), path


def test_an_old_preparation_of_a_source_listed_twice_is_refused(prepared, tmp_path):
  """A preparation made before the held-out documents were chosen by their number in their
  source (its fingerprint has no eval_split) put a source listed twice in both splits."""
  config = prepared[0].copy_and_resolve_references()
  config.data.sources = f'{config.data.sources};{config.data.sources}'
  (tmp_path / prepare.METADATA).write_text(json.dumps(
      {'fingerprint': {k: v for k, v in prepare.fingerprint(config).items()
                       if k != 'eval_split'}}))
  with pytest.raises(ValueError, match=r'made by an earlier version, which held out documents '
                                       r'by their place in the mixed stream, so the source '
                                       r'listed twice \(files:'):
    prepare.read_metadata(str(tmp_path), config)
  # A preparation of this version from the source once is not "earlier": its sources differ.
  once = prepared[0].copy_and_resolve_references()
  (tmp_path / prepare.METADATA).write_text(json.dumps(
      {'fingerprint': prepare.fingerprint(once)}))
  with pytest.raises(ValueError, match='made with other settings') as e:
    prepare.read_metadata(str(tmp_path), config)
  assert 'earlier version' not in str(e.value) and 'sources' in str(e.value)


def test_data_prepared_by_an_older_version_of_the_code_is_refused(prepared, monkeypatch):
  """A change to what a preparation writes for the same settings (an instance builder, the
  sentence splitting) raises PREPARE_VERSION: data prepared before is refused, not reused."""
  config, out, _ = prepared
  prepare.read_metadata(out, config)  # (prepared at version 1)
  monkeypatch.setattr(prepare, 'PREPARE_VERSION', 2)
  with pytest.raises(ValueError, match=r"made with another version of the preparation's code "
                                       r"\(data/prepare.py PREPARE_VERSION\) \(prepared, "
                                       r"configured\): \{'version': \(1, 2\)\}"):
    prepare.read_metadata(out, config)


@pytest.mark.parametrize('skew', [0.0, 30.0])
def test_hosts_waiting_for_process_zero_stop_when_it_fails(prepared, tmp_path, monkeypatch,
                                                           skew):
  """Process 0 fails to gather (an empty corpus gives no examples): the other hosts stop
  with its message instead of waiting hours for metadata.json, also a host whose clock is
  `skew` seconds ahead of the one that stamps the shared files (the notice is dated by it)."""
  import types  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(pipeline, 'time', types.SimpleNamespace(
      time=lambda: time.time() + skew, sleep=time.sleep))
  (tmp_path / 'empty.txt').write_text('')
  config = prepared[0].copy_and_resolve_references()
  config.data.sources = f'files:{tmp_path}/empty.txt'
  config.data.prepared_dir = str(tmp_path / 'shared')
  monkeypatch.setattr(jax, 'process_index', lambda: 1)
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  monkeypatch.setattr(prepare, 'POLL_SECONDS', 0.1)

  def process_zero():
    with pytest.raises(ValueError, match='gave no training examples'):
      prepare.prepare(config, config.data.prepared_dir, process_index=0, process_count=2)
  host = threading.Timer(0.5, process_zero)
  host.start()
  start = time.time()
  with pytest.raises(ValueError,
                     match=r'failed on process 0 \(gathering\): .*no training examples'):
    pipeline.ensure_prepared(config, str(tmp_path), timeout_s=30)
  host.join()
  assert time.time() - start < 60


def test_command_line(corpus, tmp_path):
  def run(*flags):
    return subprocess.run(
        [sys.executable, '-m', 'data.prepare', '--config', 'configs/pretrain.py:postln,tiny',
         f'--config.data.sources=files:{corpus}', '--config.data.max_seq_length=32',
         '--out_dir', str(tmp_path / 'out'), *flags], cwd=REPO, capture_output=True,
        text=True, timeout=120, check=False)
  done = run()
  assert done.returncode == 0, done.stderr[-2000:]
  metadata = json.loads(done.stdout)  # (stdout: the metadata alone, for jq and scripts)
  assert metadata['counts']['train'] > 100
  out = tmp_path / 'out'
  assert (f'prepared {out}: {metadata["counts"]["train"]} train and '
          f'{metadata["counts"]["eval"]} eval instances in ') in done.stderr
  assert (f'train.py reads them with --config.data.prepared_dir={out} and the same '
          '--config.data.* settings and seed (or data.seed)') in done.stderr
  assert sorted(os.listdir(tmp_path / 'out')) == sorted(
      [prepare.METADATA] + [os.path.basename(p) for split in prepare.SPLITS
                            for p in prepare.shard_paths(str(tmp_path / 'out'), split,
                                                         metadata['files'][split])])


def test_files_rotate_so_writers_hold_a_bounded_number_of_records(corpus, tok, tmp_path):
  """Two blocks, a file (or more) each, in files of at most 30 records."""
  config = tiny_config(corpus, records_per_file=30, document_window=2, blocks_per_file=1)
  out = str(tmp_path / 'rotated')
  metadata = prepare.prepare(config, out)
  n = metadata['counts']['train']
  per_block = collections.Counter()
  for block, _, _, count in pipeline.parse_blocks(metadata['blocks']['train']).tolist():
    per_block[block] += count
  assert n > 60 and sorted(per_block) == [0, 1] and sum(per_block.values()) == n
  assert metadata['files']['train'] == sum(-(-k // 30) for k in per_block.values())
  assert max(metadata['file_records']['train']) == 30
  names = sorted(f for f in os.listdir(out) if f.startswith('train'))
  assert names == [os.path.basename(p) for p in
                   prepare.shard_paths(out, 'train', metadata['files']['train'])]
  seen = sum(len(b['input_ids']) for b in pipeline.make_pretraining_iterator(
      config.data, tok, out, global_batch_size=BATCH, seed=0, num_epochs=1))
  assert seen == n // BATCH * BATCH


def _records(prepared_dir, metadata):
  """The prepared records of each split in the order the pipeline reads them (block
  order); metadata.json's record count of each file is checked against the file."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  out = {}
  for split in prepare.SPLITS:
    paths = prepare.shard_paths(prepared_dir, split, metadata['files'][split])
    for path, count in zip(paths, metadata['file_records'][split], strict=True):
      reader = array_record_module.ArrayRecordReader(path)
      assert reader.num_records() == count, path
      reader.close()
    source = pipeline.PreparedShards(paths, metadata['file_records'][split],
                                     metadata['blocks'][split])
    out[split] = [source[i] for i in range(len(source))]
  return out


def test_a_host_reads_and_needs_only_the_files_of_its_share(corpus, tok, tmp_path):
  """Three hosts over files of 20 records: grain's sampler gives each host the records
  host_records names, epoch after epoch; a folder holding only the host's files
  (host_files, as a bucket's local copy does) gives the same batches as the whole folder,
  and so does a preparation that did not count each file's records; a folder lacking one
  of the host's files is a one-line error."""
  import grain.python as grain  # pylint: disable=g-import-not-at-top
  config = tiny_config(corpus, records_per_file=20)
  full = str(tmp_path / 'full')
  metadata = prepare.prepare(config, full)
  records = metadata['file_records']['train']
  n = metadata['counts']['train']
  assert len(records) > 6 and sum(records) == n
  _records(full, metadata)  # the counts are each file's
  old = str(tmp_path / 'uncounted')  # as prepared before file_records existed
  os.makedirs(old)
  for name in os.listdir(full):
    os.symlink(os.path.join(full, name), os.path.join(old, name))
  os.unlink(os.path.join(old, prepare.METADATA))
  with open(os.path.join(old, prepare.METADATA), 'w') as f:
    json.dump({k: v for k, v in metadata.items() if k != 'file_records'}, f)
  for index in range(3):
    sampler = grain.IndexSampler(
        num_records=n, shuffle=True, seed=5, num_epochs=2,
        shard_options=grain.ShardOptions(shard_index=index, shard_count=3,
                                         drop_remainder=True))
    start, end = pipeline.host_records(n, index, 3)
    keys = [sampler[i].record_key for i in range(index, len(sampler), 3)]
    assert sorted(keys) == sorted(list(range(start, end)) * 2)
    share = pipeline.host_files(metadata, 'train', index, 3)
    assert 1 < len(share) < len(records) - 2
    own = tmp_path / f'host{index}'
    os.makedirs(own)
    os.symlink(os.path.join(full, prepare.METADATA), own / prepare.METADATA)
    for split in prepare.SPLITS:
      paths = prepare.shard_paths(full, split, metadata['files'][split])
      for i in pipeline.host_files(metadata, split, index, 3):
        os.symlink(paths[i], own / os.path.basename(paths[i]))
    kw = dict(global_batch_size=6, seed=5, process_index=index, process_count=3)
    for split in prepare.SPLITS:
      want = pipeline.make_pretraining_iterator(config.data, tok, full, split=split, **kw)
      got = pipeline.make_pretraining_iterator(config.data, tok, str(own), split=split, **kw)
      uncounted = pipeline.make_pretraining_iterator(config.data, tok, old, split=split, **kw)
      for _ in range(2 * n // 6 // 3 + 2 if split == 'train' else 1):  # past an epoch
        batch = next(want)
        assert_same(next(got), batch)
        assert_same(next(uncounted), batch)
  os.unlink(tmp_path / 'host1' / os.path.basename(
      prepare.shard_paths(full, 'train', len(records))[pipeline.host_files(
          metadata, 'train', 1, 3)[-1]]))
  with pytest.raises(FileNotFoundError, match='one of the 1 files of process 1 of 3'):
    pipeline.make_pretraining_iterator(config.data, tok, str(tmp_path / 'host1'),
                                       global_batch_size=6, seed=5, process_index=1,
                                       process_count=3)


def test_parallel_preparation_gives_the_same_stream_for_any_workers_and_hosts(corpus, tok,
                                                                            tmp_path):
  """One worker, two worker processes, and two hosts (one worker each, the second host
  first, as hosts start at any time): the same instances in the same order, split and
  counts, so the same seed trains on the same batches."""
  # Two documents per block: the 3 training documents of this corpus are 2 blocks, which the
  # two workers (and the two hosts) share out 1 + 1.
  config = tiny_config(corpus, document_window=2, blocks_per_file=1)
  one = prepare.prepare(config, str(tmp_path / 'one'))
  config.data.prepare_workers = 2
  two = prepare.prepare(config, str(tmp_path / 'two'))
  config.data.prepare_workers = 1
  assert prepare.prepare(config, str(tmp_path / 'hosts'), process_index=1,
                         process_count=2) is None  # a worker host: no gathering
  hosts = prepare.prepare(config, str(tmp_path / 'hosts'), process_index=0, process_count=2)
  assert (one['workers'], two['workers'], hosts['workers']) == (1, 2, 2)
  assert one['counts']['train'] > 100 and one['counts']['eval'] > 0
  for other in (two, hosts):
    assert other['counts'] == one['counts'] and other['stats'] == one['stats']
  records = _records(str(tmp_path / 'one'), one)
  assert _records(str(tmp_path / 'two'), two) == records
  assert _records(str(tmp_path / 'hosts'), hosts) == records
  assert sorted(os.listdir(tmp_path)) == ['hosts', 'one', 'two']  # nothing else left
  streams = [pipeline.make_pretraining_iterator(config.data, tok, str(tmp_path / name),
                                                global_batch_size=BATCH, seed=3)
             for name in ('one', 'two')]
  for _ in range(5):
    assert_same(*(next(it) for it in streams))


@pytest.fixture(scope='module')
def many_documents(tmp_path_factory):
  """30 documents of 8 sentences (the speeches cut up): with eval_fraction 0.2 several go to
  eval, so the eval split too is shared out over blocks, workers and hosts."""
  path = tmp_path_factory.mktemp('many') / 'corpus.txt'
  sentences = itertools.chain.from_iterable(sources.iter_documents('embedded'))
  docs = [list(itertools.islice(sentences, 8)) for _ in range(30)]
  path.write_text(''.join('\n'.join(d) + '\n\n' for d in docs))
  return str(path)


def test_the_same_stream_for_uneven_workers_and_hosts_with_several_workers(many_documents,
                                                                           tmp_path):
  """Blocks of 3 documents (10 blocks, the eval documents in several of them) over 1
  worker, 3 workers (4 + 3 + 3 blocks), and 2 hosts x 2 workers (worker ids 0-3 across the
  hosts, 3 + 3 + 2 + 2 blocks, host 1 first): the same instances of both splits in the
  same order, and the same counts."""
  config = tiny_config(many_documents, document_window=3, blocks_per_file=1)
  one = prepare.prepare(config, str(tmp_path / 'one'))
  assert one['stats']['eval/documents'] >= 3 and one['counts']['eval'] > 0
  config.data.prepare_workers = 3
  three = prepare.prepare(config, str(tmp_path / 'three'))
  config.data.prepare_workers = 2
  assert prepare.prepare(config, str(tmp_path / 'hosts'), process_index=1,
                         process_count=2) is None
  hosts = prepare.prepare(config, str(tmp_path / 'hosts'), process_index=0, process_count=2)
  assert (three['workers'], hosts['workers']) == (3, 4)
  records = _records(str(tmp_path / 'one'), one)
  for name, other in (('three', three), ('hosts', hosts)):
    assert other['blocks'] != one['blocks']  # the files differ; the order read does not
    assert other['counts'] == one['counts'] and other['stats'] == one['stats']
    assert _records(str(tmp_path / name), other) == records, name
  assert sorted(os.listdir(tmp_path)) == ['hosts', 'one', 'three']


class _NoFile:
  """An array_record writer that writes nothing (the layout's bookkeeping alone)."""

  def __init__(self, *args):
    del args

  def write(self, record):
    del record

  def close(self):
    pass


@pytest.mark.parametrize('workers', [16, 64])
def test_each_host_needs_about_its_share_of_the_files(workers, monkeypatch):
  """2000 blocks of 300 records prepared by 16 or 64 workers (runs of 8 blocks each, dealt
  in turn), read by 16 hosts: a host's records, a contiguous share of the block order, lie
  in files that hold little more than its share (a bucket's hosts copy only those)."""
  monkeypatch.setattr(prepare.array_record_module, 'ArrayRecordWriter', _NoFile)
  results = []
  for worker in range(workers):
    writers = prepare.ShardWriters('/nowhere', 'train', 65536, 8)
    for block in [b for b in range(2000) if prepare.owns(b, 8, worker, workers)]:
      for _ in range(300):
        writers.write(b'', block)
    writers.close()
    results.append({'file_records': {'train': writers.records, 'eval': []},
                    'blocks': {'train': writers.segments, 'eval': []}})
  layout = prepare._layout(results)
  records = np.array(layout['file_records']['train'])
  assert records.sum() == 2000 * 300 and len(records) == 250  # a file per run of 8 blocks
  for host in range(16):
    share = records[pipeline.host_files(layout, 'train', host, 16)].sum() / records.sum()
    assert 1 / 16 <= share <= 1 / 16 + 2 / 250, (host, share)


def test_a_preparation_killed_midway_resumes_to_the_same_set(tmp_path):
  """`python -m data.prepare` with 3 workers killed with SIGKILL once a worker has
  finished (its workers exit with it); the rerun keeps the finished workers, redoes the
  rest, and gives the instances of an uninterrupted preparation. Worker 0's documents (every
  third, one per block) are short and the others' long, so it finishes well before them."""
  import signal  # pylint: disable=g-import-not-at-top
  sentences = itertools.cycle(itertools.chain.from_iterable(itertools.islice(
      sources.iter_documents('embedded'), 20)))
  docs = [list(itertools.islice(sentences, 2 if i % 3 == 0 else 1500)) for i in range(15)]
  corpus = tmp_path / 'corpus.txt'
  corpus.write_text(''.join('\n'.join(d) + '\n\n' for d in docs))
  out = tmp_path / 'out'
  args = [sys.executable, '-m', 'data.prepare', '--config', 'configs/pretrain.py:postln,tiny',
          f'--config.data.sources=files:{corpus}', '--config.data.max_seq_length=32',
          '--config.data.max_predictions_per_seq=5',
          '--config.data.eval_fraction=0.2', '--config.data.document_window=2',
          '--config.data.prepare_workers=3', '--out_dir', str(out)]
  proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  tmp = tmp_path / 'out.tmp'
  try:
    deadline = time.time() + 240
    while not (tmp.exists() and any((w / 'done.json').exists() for w in tmp.iterdir()
                                    if w.name.startswith('worker-'))):
      assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
      time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert not (out / prepare.METADATA).exists()  # it was killed before the end
  finished = [w.name for w in tmp.iterdir() if (w / 'done.json').exists()]
  assert finished
  resumed = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=240)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f'{len(finished)} of this host\'s 3 workers finished before' in resumed.stderr
  config = tiny_config(str(corpus), document_window=2)
  fresh = prepare.prepare(config, str(tmp_path / 'fresh'))
  metadata = json.loads((out / prepare.METADATA).read_text())
  assert metadata['counts'] == fresh['counts']
  assert _records(str(out), metadata) == _records(str(tmp_path / 'fresh'), fresh)
  assert not tmp.exists()


def test_an_interrupted_preparation_keeps_finished_workers(corpus, tmp_path, caplog):
  config = tiny_config(corpus, document_window=5)
  config.data.prepare_workers = 2
  out = str(tmp_path / 'out')
  # A killed run: worker 1 finished, worker 0 left half a directory without done.json.
  prepare._work(config, prepare.tokenizer_lib.load_for_config(config.data), out + '.tmp', 1,
                2)
  os.makedirs(out + '.tmp/worker-00000')
  open(out + '.tmp/worker-00000/train.part-00000-0', 'w').close()
  done = os.path.getmtime(out + '.tmp/worker-00001/done.json')
  caplog.set_level('INFO', logger='absl')
  resumed = prepare.prepare(config, out)
  assert '1 of this host\'s 2 workers finished before' in caplog.text
  fresh = prepare.prepare(config, str(tmp_path / 'fresh'))
  assert resumed['counts'] == fresh['counts']
  assert _records(out, resumed) == _records(str(tmp_path / 'fresh'), fresh)
  assert done < time.time() and not os.path.exists(out + '.tmp')


@pytest.mark.parametrize('interruption', [
    KeyboardInterrupt(), SystemExit(75),  # Ctrl-C, SIGTERM (train.py's handler)
    prepare.concurrent.futures.BrokenExecutor('a worker was killed'),
    OSError(28, 'No space left on device'),
    sources.SourceUnavailableError("Hugging Face dataset 'x' could not be loaded: 429")])
def test_an_interruption_keeps_the_workers_that_finished_before(corpus, tmp_path, monkeypatch,
                                                                interruption):
  """Ctrl-C, SIGTERM, a worker process killed (out of memory), a full disk or a Hugging
  Face source that could not be loaded (the hub rate-limiting the workers) while the
  unfinished workers run: the finished ones stay for the next attempt; bad input
  (ValueError) removes it all."""
  config = tiny_config(corpus, document_window=5, prepare_workers=2)
  out, tok = str(tmp_path / 'out'), tokenizer_lib.load_for_config(config.data)
  prepare._work(config, tok, out + '.tmp', 1, 2)  # an earlier attempt finished worker 1
  os.makedirs(out + '.tmp/worker-00000')  # ... and left worker 0 half-made

  def run_workers(*args, **kwargs):
    raise interruption
  monkeypatch.setattr(prepare, '_run_workers', run_workers)
  with pytest.raises(type(interruption)):
    prepare.prepare(config, out)
  assert sorted(os.listdir(out + '.tmp')) == ['worker-00001']
  assert prepare._done(out + '.tmp', 1, 2, prepare.fingerprint(config))
  monkeypatch.undo()
  resumed = prepare.prepare(config, out)
  fresh = prepare.prepare(config, str(tmp_path / 'fresh'))
  assert _records(out, resumed) == _records(str(tmp_path / 'fresh'), fresh)

  prepare._work(config, tok, out + '2.tmp', 1, 2)
  monkeypatch.setattr(prepare, '_run_workers', lambda *a, **k: (_ for _ in ()).throw(
      ValueError('bad input')))
  with pytest.raises(ValueError, match='bad input'):
    prepare.prepare(config, out + '2')
  assert not os.path.exists(out + '2.tmp')


def test_an_interrupted_gathering_keeps_every_worker(corpus, tmp_path, monkeypatch):
  config = tiny_config(corpus, document_window=5, prepare_workers=2)
  out = str(tmp_path / 'out')
  finish = prepare._finish

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(prepare, '_finish', interrupted)
  with pytest.raises(KeyboardInterrupt):
    prepare.prepare(config, out)
  assert sorted(os.listdir(out + '.tmp')) == ['worker-00000', 'worker-00001']
  monkeypatch.setattr(prepare, '_finish', finish)
  monkeypatch.setattr(prepare, '_work', lambda *a: pytest.fail('a finished worker redone'))
  resumed = prepare.prepare(config, out)
  assert resumed['counts']['train'] > 100 and not os.path.exists(out + '.tmp')


def test_a_host_arriving_while_process_zero_gathers_does_not_redo_its_share(
    corpus, tmp_path, monkeypatch):
  """Two hosts whose workers all finished in an earlier attempt: process 0 gathers at once,
  and host 1 looks while it does. Host 1 finds its share done (the gathering links the
  files, it does not move them) and the output holds only the shards. A failure file of the
  earlier attempt does not stop this one."""
  config = tiny_config(corpus, document_window=5)
  out, tok = str(tmp_path / 'out'), tokenizer_lib.load_for_config(config.data)
  for worker in (0, 1):
    prepare._work(config, tok, out + '.tmp', worker, 2)
  stale = out + '.tmp/failed-00001.txt'
  with open(stale, 'w') as f:
    f.write('ConnectionError: an earlier attempt')
  os.utime(stale, (time.time() - 3600,) * 2)
  finish, redone = prepare._finish, []
  monkeypatch.setattr(prepare, '_work', lambda *a: redone.append(a[3]))

  def host_one_looks_meanwhile(*args, **kwargs):
    assert prepare.prepare(config, out, process_index=1, process_count=2) is None
    return finish(*args, **kwargs)
  monkeypatch.setattr(prepare, '_finish', host_one_looks_meanwhile)
  gathered = prepare.prepare(config, out, process_index=0, process_count=2)
  assert redone == [] and not os.path.exists(out + '.tmp')
  assert not [n for n in os.listdir(out) if n.startswith('worker-')]
  monkeypatch.undo()
  fresh = prepare.prepare(config, str(tmp_path / 'fresh'))
  assert _records(out, gathered) == _records(str(tmp_path / 'fresh'), fresh)


def test_a_host_that_fails_before_its_workers_start_stops_process_zero_at_once(
    corpus, tmp_path, monkeypatch):
  """A host that cannot begin (its vocabulary is a local file the others have; a corpus file
  it does not see) leaves a failure notice, which stops process 0's wait for its workers in
  one line naming it (it waited for them until timeout_s: 6 hours by default), also where
  the host failed before process 0 began (hosts started by hand, seconds apart)."""
  config = tiny_config(corpus, document_window=5)
  out = str(tmp_path / 'out')
  theirs = config.copy_and_resolve_references()
  theirs.data.tokenizer = str(tmp_path / 'on_the_other_hosts.model')
  with pytest.raises(Exception, match='on_the_other_hosts.model'):
    prepare.prepare(theirs, out, process_index=1, process_count=2)
  notice = out + '.tmp/failed-00001.txt'
  os.utime(notice, (time.time() - 20,) * 2)  # 20 s before process 0 begins
  monkeypatch.setattr(prepare, 'POLL_SECONDS', 0.1)
  start = time.time()
  with pytest.raises(cli.UserError, match=r'^preparing \S+ failed on host 1: \w+Error: .*'
                                         r'on_the_other_hosts.model'):
    prepare.prepare(config, out, process_index=0, process_count=2, timeout_s=30)
  assert time.time() - start < 25


def test_a_block_of_one_document_is_refused_in_one_line(corpus, tmp_path):
  """NSP draws its random next from the block's other documents: a window of 1 has none."""
  config = tiny_config(corpus, document_window=1)
  with pytest.raises(ValueError, match=r'data.document_window=1: the random next sentences '
                                       r'come from other documents of the same block; give at '
                                       r'least 2 \(default 1000\)'):
    prepare.prepare(config, str(tmp_path / 'out'))
  assert not (tmp_path / 'out').exists()


def test_an_unsupported_storage_url_is_an_error_not_a_local_folder(corpus, tmp_path,
                                                                   monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match='supported for gs://'):
    prepare.prepare(tiny_config(corpus), 's3://bucket/prepared')
  assert os.listdir(tmp_path) == []


def test_a_folder_holding_other_files_is_refused_and_left_intact(corpus, tmp_path):
  """A preparation replaces its folder whole; pointed at a folder of other files it refuses
  before writing anything, instead of deleting them. An earlier preparation's folder, or
  an empty one, is taken."""
  out = tmp_path / 'mine'
  out.mkdir()
  (out / 'notes.txt').write_text('kept')
  with pytest.raises(ValueError, match=r'mine holds 1 files that are not prepared data \(e.g. '
                                       r'notes.txt\), which a preparation would delete'):
    prepare.prepare(tiny_config(corpus), str(out))
  assert os.listdir(out) == ['notes.txt'] and not os.path.exists(f'{out}.tmp')
  (out / 'notes.txt').unlink()
  first = prepare.prepare(tiny_config(corpus), str(out))
  again = prepare.prepare(tiny_config(corpus), str(out))  # its own files: replaced
  assert again['counts'] == first['counts'] and again['file_records'] == first['file_records']


def test_worker_processes_exit_when_their_parent_is_killed(tmp_path):
  """The preparation's worker pool (spawned, with prepare.die_with_parent as initializer):
  kill -9 of the parent ends its workers within seconds instead of leaving them writing."""
  import signal  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  pids = tmp_path / 'pids'
  parent = subprocess.Popen([sys.executable, '-c', textwrap.dedent(f'''
      import concurrent.futures, multiprocessing, os, time
      from data import prepare
      pool = concurrent.futures.ProcessPoolExecutor(
          2, mp_context=multiprocessing.get_context('spawn'),
          initializer=prepare.die_with_parent, initargs=(os.getpid(),))
      workers = [pool.submit(os.getpid) for _ in range(4)]
      waiting = [pool.submit(time.sleep, 120) for _ in range(2)]
      with open({str(pids)!r}, 'w') as f:
        f.write(' '.join(str(p) for p in {{w.result() for w in workers}}))
      time.sleep(120)
      ''')], cwd=REPO)
  deadline = time.time() + 120
  while not (pids.exists() and pids.read_text()) and time.time() < deadline:
    assert parent.poll() is None
    time.sleep(0.1)
  workers = [int(p) for p in pids.read_text().split()]
  assert workers and parent.pid not in workers
  parent.send_signal(signal.SIGKILL)
  parent.wait()

  def alive(pid):
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return False
    with open(f'/proc/{pid}/stat') as f:  # a zombie waiting for init to reap it is gone
      return f.read().split(') ')[-1][0] != 'Z'

  deadline = time.time() + 10
  while any(alive(p) for p in workers) and time.time() < deadline:
    time.sleep(0.1)
  assert not any(alive(p) for p in workers)


# The prepared records of the `prepared` fixture (4 documents of the embedded corpus, length
# 32, a fifth held out), in the order the pipeline reads them: what this version of the
# preparation writes for these settings (data/prepare.PREPARE_VERSION).
PREPARED_SHA256 = {
    'train': '7a46bfb2cedf78e441df7271435a28c3da55532593669f03ca95901c69c16540',
    'eval': '85b82d4dc72d20d5163b04dad0870c2954e207ebbf212235cf76be2599c14f26'}


def test_the_preparation_writes_what_its_version_says(prepared):
  """A change to what a preparation writes for the same settings (an instance builder, the
  sentence splitting, the tokenising, the stream's order) changes these digests: raise
  data/prepare.PREPARE_VERSION with it, so that data prepared before is refused instead of
  reused, and write the new digests here. (A change of the settings themselves, such as a
  default of configs/pretrain.py, changes the fingerprint, which refuses the old data
  already: then only the digests are written anew.)"""
  config, out, metadata = prepared
  got = {split: hashlib.sha256(b''.join(records)).hexdigest()
         for split, records in _records(out, metadata).items()}
  assert prepare.PREPARE_VERSION == 1 and got == PREPARED_SHA256, (
      f'the prepared records changed ({got}): raise data/prepare.PREPARE_VERSION and '
      'update PREPARED_SHA256')



def test_a_script_that_prepares_outside_a_main_guard_stops_in_seconds(tmp_path):
  """Workers start by the spawn method, which imports the calling script again: one that
  calls prepare at its top level had each worker wait on its parent's lock for ever. The
  workers now refuse at once, naming the fix, and the parent says what ended them."""
  script = tmp_path / 'mine.py'
  script.write_text(textwrap.dedent(f'''
      import sys
      sys.path.insert(0, {REPO!r})
      from configs import pretrain
      from data import prepare
      config = pretrain.get_config('postln,tiny')
      config.data.prepare_workers = 2
      config.data.max_seq_length, config.data.max_predictions_per_seq = 32, 5
      prepare.prepare(config, {str(tmp_path / 'out')!r})
      '''))
  proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                        timeout=120, cwd=str(tmp_path))
  assert proc.returncode == 1
  assert ('RuntimeError: data.prepare.prepare was called as its worker process imported the '
          'calling script; call it under `if __name__ == "__main__":`') in proc.stderr
  assert proc.stderr.rstrip().endswith(
      'RuntimeError: a preparation worker process ended abruptly (its lines above say why: '
      'killed, out of memory, or the calling script ran prepare again as the worker imported '
      'it, outside `if __name__ == "__main__":`)'), proc.stderr[-2000:]
