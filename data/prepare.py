r"""Prepares pretraining instances once, streaming, into array_record shards.

  python -m data.prepare --config configs/pretrain.py:postln,tiny --out_dir /tmp/prepared
  python -m data.prepare --config configs/pretrain.py:realformer,base \
      --config.data.sources='tfds:wikipedia/20230601.en' \
      --config.data.tokenizer=/data/wiki_30k.model --out_dir gs://my-bucket/prepared
  python -m data.prepare --config configs/pretrain.py:postln,base \
      --config.data.sources='hf:wikimedia/wikipedia:20231101.en;hf:rojagtap/bookcorpus' \
      --config.data.hf_rows_per_document='1;100' \
      --config.data.tokenizer=/data/uncased_L-12_H-768_A-12/vocab.txt --out_dir /data/prepared

train.py calls the same code on first start (into <workdir>/data unless
config.data.prepared_dir is set). Writes train-XXXXX-of-NNNNN and eval-XXXXX-of-NNNNN
array_record shards (one instance per record: a sentence pair, or RoBERTa's one segment;
unmasked: masking is dynamic)
and metadata.json (counts, skipped items, and the fingerprint of the settings that shaped the
instances). Memory stays bounded: documents stream in blocks of `data.document_window`
documents (a document's random-next segments come from its block) and instances go straight
to each worker's shard writer, which starts a new file at least every `data.records_per_file`
records (default 65536: ~30 MB held until it closes).

Parallel: each split's document stream is cut into those blocks, numbered in stream order,
and the blocks are dealt out in runs of `data.blocks_per_file` consecutive ones: run r goes to
worker r mod W, W counting the `data.prepare_workers` processes of every host of the run
(train.py: every host of a multi-host run prepares its share; the command line:
--process_index/--process_count). A block's instances depend only on its documents, the seed,
the split and its number b, so the prepared set (instances, split, counts) and the order readers take it
in (block after block: metadata.json's 'blocks' says where each block's records lie) are the
same whatever W is: so is the stream a seed trains on. A file holds (part of) one run, so a
host, which reads a contiguous share of that order, needs about its share of the files.
Every worker reads the whole stream once, both splits at a time, and tokenises only its own
blocks (tokenising is most of the work). Workers write into <out_dir>.tmp/worker-XXXXX/ and mark
themselves done; process 0 gathers them into <out_dir>. An interrupted preparation resumes:
finished workers (same settings, same W) are kept, the others start their share again. The
gathering links the workers' files into <out_dir>.tmp/gathered/ and renames that to
<out_dir>, so a worker's files stay in place until <out_dir> is complete: a host that
arrives late sees its share done (or <out_dir> made) and never redoes it.

Into a bucket (out_dir gs://...): object storage has no rename, so the same protocol runs
with objects. Each host's workers write into a local staging folder and upload their files,
then their done.json, to <out_dir>.tmp/worker-XXXXX/; process 0 copies them under their final
names into <out_dir> (server-side copies) and writes metadata.json last: a preparation is
complete exactly when its metadata.json exists. Failure notices (failed-*.txt) are objects
there too. Training reads a bucket's shards through a local copy checked against the bucket
(data/pipeline.py, local_copy).
"""

import collections
import concurrent.futures
import importlib
import json
import multiprocessing
import os
import re
import shutil
import sys
import threading
import time
import zlib
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from array_record.python import array_record_module
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from data import pretraining
from data import sources
from data import tokenizer as tokenizer_lib
from realformer import cli
from realformer import config_checks
from realformer import storage

METADATA = 'metadata.json'
SPLITS = ('train', 'eval')
# How often a host waiting on the others (their shares, process 0's gathering, a preparation
# lease) looks again.
POLL_SECONDS = 2.0


# What a preparation writes for the same settings, as a number: raise it with any change to
# that (data/pretraining.py's instance builders, data/sources.py's documents and sentence
# splitting, the tokenising in _work), and prepared data of an older version is refused
# instead of reused under the new code.
PREPARE_VERSION = 1

# Fingerprint keys present only when they differ from these values.
FINGERPRINT_DEFAULTS = {'hf_rows_per_document': '1', 'instances': 'pairs', 'version': 1}
# Keys a finished preparation is reused whatever they were: of the files' layout, not of the
# stream (blocks_per_file; num_shards, of older fingerprints: the writers whose files' order
# was the stream's before the records were read in block order). A preparation's workers
# resume only under the same ones.
FINGERPRINT_LAYOUT = ('blocks_per_file', 'num_shards')


def _objective_of(instances: str) -> str:
  """The config.objective whose instances a preparation holds ('a or b' where several)."""
  return ' or '.join(name for name, o in pretraining.OBJECTIVES.items()
                     if o.instances_name == instances) or '?'


def data_seed(config) -> int:
  """The preparation's seed: config.data.seed, else the run's config.seed."""
  seed = config.data.get('seed')
  return int(config.seed if seed is None else seed)


def fingerprint(config) -> dict:
  """The settings that determine the prepared instances and their files (masking is not
  among them)."""
  d = config.data
  specs = sources.source_specs(d.sources)
  rows = config_checks.rows_per_document(d.get('hf_rows_per_document', '1'), d.sources)
  grouped = any(r != 1 and s.startswith('hf:') for s, r in zip(specs, rows))
  return {'sources': d.sources, 'weights': d.weights, 'tokenizer': d.tokenizer or 'embedded',
          'max_seq_length': d.max_seq_length, 'short_seq_prob': d.short_seq_prob,
          'dupe_factor': d.dupe_factor, 'eval_fraction': d.eval_fraction,
          'blocks_per_file': d.get('blocks_per_file', 8), 'seed': data_seed(config),
          'document_window': d.get('document_window', 1000),  # the blocks' layout
          **({'hf_text_column': d.get('hf_text_column', 'text')} if 'hf:' in d.sources else {}),
          **({'tfds_text_feature': d.get('tfds_text_feature', 'text')}
             if 'tfds:' in d.sources else {}),
          **({'hf_rows_per_document': ';'.join(map(str, rows))} if grouped else {}),
          **({'files': files} if (files := sources.files_signature(d.sources)) else {}),
          **({'instances': kind}
             if (kind := pretraining.of_config(config).instances_name) != 'pairs' else {}),
          **({'tokenizer_crc': crc} if (crc := tokenizer_lib.signature(d.tokenizer)) else {}),
          # (held out by the documents' numbers in their own sources: is_eval_document)
          **({'eval_split': 'by_source'} if len(specs) > 1 else {}),
          # (sources of paragraphs, split by sources.split_sentences: its rule since a capital
          # of any script opens a sentence; data of the rule before, ASCII capitals alone,
          # keeps being read, as a key added since it was made is not held against it)
          **({'sentence_split': 2} if 'tfds:' in d.sources or 'hf:' in d.sources else {}),
          **({'version': PREPARE_VERSION} if PREPARE_VERSION != 1 else {})}


def is_eval_document(index: int, eval_fraction: float) -> bool:
  """A fixed share of documents is held out: a hash of the document's number in its own
  source (sources.iter_documents(numbered=True)), the same for every seed and interleave,
  and for every copy of a source listed twice (a document used twice is held out or trained
  on both times, never both)."""
  return (zlib.crc32(str(index).encode()) % 1_000_000) < eval_fraction * 1_000_000


def undecodable_lines(stats) -> int:
  """The corpus's lines that were not UTF-8, from a preparation's stats (the stream's count;
  a preparation of before the stream was read once counted it in each split's pass)."""
  return int(stats.get('non_utf8_lines', 0) or max(stats.get('train/non_utf8_lines', 0),
                                                   stats.get('eval/non_utf8_lines', 0)))


def split_of(number: int, eval_fraction: float) -> str:
  """The split of the document of that number in its own source (is_eval_document)."""
  return 'eval' if is_eval_document(number, eval_fraction) else 'train'


def num_files(metadata: dict, split: str) -> int:
  """How many files of `split` a preparation's metadata.json counts (one written before
  it counted them made num_shards of each)."""
  return (metadata['files'][split] if 'files' in metadata else
          metadata['fingerprint']['num_shards'])


def shard_paths(prepared_dir: str, split: str, num_shards: int):
  return [os.path.join(prepared_dir, f'{split}-{i:05d}-of-{num_shards:05d}')
          for i in range(num_shards)]


class ShardWriters:
  """One worker's array_record files of a split, filled block after block: a file holds the
  records of consecutive blocks of one run of `blocks_per_file` (a worker's share of the
  stream comes in such runs) and at most `records_per_file` records, since a writer holds a
  few hundred bytes per record written until it is closed (about 100 MB per 200k records).

  `close` returns the files, named {split}-XXXXX-of-NNNNN by `name_files`; `records` is how
  many records each holds and `segments` where each block's records lie: [block, file, first
  record, count] in the order written (a block in more than one file has a segment in each).
  """

  def __init__(self, directory: str, split: str, records_per_file: int, blocks_per_file: int):
    self._dir, self._split = directory, split
    self._per_file, self._blocks_per_file = records_per_file, blocks_per_file
    self._paths, self.records, self.segments = [], [], []
    self._writer, self._run = None, None  # the open file, and the run of blocks it holds

  def write(self, record: bytes, block: int):
    """Writes one of `block`'s records (blocks come in order, a block's records together)."""
    run = block // self._blocks_per_file
    if self._writer is None or run != self._run or self.records[-1] == self._per_file:
      if self._writer is not None:
        self._writer.close()
      self._paths.append(os.path.join(self._dir, f'{self._split}.part-{len(self._paths):05d}'))
      self.records.append(0)
      self._writer = array_record_module.ArrayRecordWriter(self._paths[-1], 'group_size:1')
      self._run = run
    f = len(self._paths) - 1
    if not self.segments or self.segments[-1][:2] != [block, f]:
      self.segments.append([block, f, self.records[f], 0])
    self._writer.write(record)
    self.records[f] += 1
    self.segments[-1][3] += 1

  def close(self) -> List[str]:
    """Closes the last file; returns the files' paths, in order."""
    if self._writer is not None:
      self._writer.close()
    return list(self._paths)


def name_files(paths: List[str], directory: str, split: str) -> int:
  """Links the files as {split}-XXXXX-of-NNNNN in `directory` (copies them where the
  filesystem has no hard links); returns how many."""
  for path, final in zip(paths, shard_paths(directory, split, len(paths))):
    try:
      os.link(path, final)
    except OSError:
      shutil.copyfile(path, final)
  return len(paths)


def _keeps_workers(error: BaseException) -> bool:
  """Only bad input (a ValueError: no examples, an undecodable or missing corpus) throws the
  finished workers away. Ctrl-C, SIGTERM's exit, a worker process killed (out of memory) or
  a storage fault (a full disk, a mount that refuses a rename) are not the workers' fault:
  they stay for the next attempt, as they do when a Hugging Face source could not be loaded
  (no network, the hub rate-limiting the workers' requests)."""
  return (not isinstance(error, ValueError) or
          isinstance(error, sources.SourceUnavailableError))


def _checked(config, out_dir: str, tokenizer, process_index: int, process_count: int):
  """prepare()'s checks of the config, the output and this host's inputs before its workers
  write anything: (the tokenizer, the data's fingerprint, the folder this host's workers write,
  their number)."""
  config_checks.check_lengths(config)
  config_checks.check_document_window(config.data)
  config_checks.check_fractions(config.data)
  refuse_other_files(out_dir)
  if not storage.is_url(out_dir) and os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ValueError(f'{out_dir} is a file; the prepared data needs a folder there: give '
                     'another path (config.data.prepared_dir or --out_dir)')
  d = config.data
  if tokenizer is None and not d.tokenizer and any(
      spec != 'embedded' for spec in sources.source_specs(d.sources)):
    logging.warning('data.tokenizer is empty: the shipped 8k vocabulary of the State of the '
                    'Union speeches tokenizes %s; name your corpus\'s vocabulary with '
                    '--config.data.tokenizer (python -m data.tokenizer trains one; BERT\'s '
                    'vocab.txt works too)', d.sources)
  tokenizer = tokenizer or tokenizer_lib.load_for_config(d)
  workers = int(d.get('prepare_workers', 1) or 1)
  if workers < 1 or process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f'data.prepare_workers={workers} must be >= 1 (and process '
                     f'{process_index} of {process_count} valid)')
  unpinned = sources.unpinned_hub_sources(d.sources)
  if unpinned and workers * process_count > 1:
    logging.warning('%s: every one of the %d workers streams it on its own; pin a revision '
                    '(hf:<dataset>@<commit or tag>) so that all of them, and a resumed '
                    'preparation, read the same rows', ', '.join(unpinned),
                    workers * process_count)
  fp = fingerprint(config)  # reads the corpus files' names and sizes: fails before any write
  # Where this process's workers write: for a bucket, a local folder of its own.
  staging = (staging_dir(out_dir, process_index) if storage.is_url(out_dir)
             else tmp_dir(out_dir))
  os.makedirs(staging, exist_ok=True)
  return tokenizer, fp, staging, workers


def prepare(config, out_dir: str, tokenizer=None, overwrite: bool = True, *,
            process_index: int = 0, process_count: int = 1, timeout_s: float = 6 * 3600
            ) -> dict:
  """Writes the shards and metadata.json into `out_dir` (atomically); returns the metadata.

  Runs this host's `data.prepare_workers` workers; process 0 then waits for every host's and
  gathers them (the other processes return None: they wait for metadata.json, as
  data.pipeline.ensure_prepared does). With overwrite=False a preparation that another
  process finished first is kept (and its metadata returned) instead of being replaced.
  Bad input (a ValueError) removes what this host wrote; anything else (an interrupted or
  killed run, a storage fault) leaves finished workers for the next attempt to keep.
  """
  if getattr(multiprocessing.current_process(), '_inheriting', False):
    # A worker this started is importing the caller's script (the spawn start method runs
    # its top level again), which called prepare: it would wait on its parent's lock.
    raise RuntimeError('data.prepare.prepare was called as its worker process imported the '
                       'calling script; call it under `if __name__ == "__main__":`')
  started = time.time()
  storage.check_location(out_dir, 'the prepared data folder')
  out_dir = os.fspath(storage.path(out_dir)).rstrip('/')  # (a local one absolute, ~ expanded)
  tmp = tmp_dir(out_dir)  # the workers' results and failure notices, where process 0 finds them
  if process_count > 1:  # an earlier attempt's notices of this host's are not this one's
    for stale in [f'{process_index:05d}'] + (['gather'] if process_index == 0 else []):
      _path(tmp, f'failed-{stale}.txt').unlink(missing_ok=True)
  try:
    tokenizer, fp, staging, workers = _checked(config, out_dir, tokenizer, process_index,
                                               process_count)
  except BaseException as e:  # the others would wait for this host's workers for hours
    if process_count > 1:
      _notice(tmp, f'{process_index:05d}', e)
    raise
  # What this attempt's files are newer than, by the clock that stamps them (read beside
  # the output, not in a folder a gathering deletes; 1 s earlier: a file system may keep
  # coarser times).
  since = storage.clock(out_dir) - 1
  remote = storage.is_url(out_dir)
  lock = _single_host_lock(staging) if process_count == 1 else None
  try:
    if not overwrite and _path(out_dir, METADATA).exists():
      return read_metadata(out_dir)  # another process finished while this one waited
    total = workers * process_count
    ids = [process_index * workers + w for w in range(workers)]
    todo = [i for i in ids if not (remote and _done(tmp, i, total, fp))]
    try:
      _run_workers(config, tokenizer, staging, todo, total,
                   made_since=_path(out_dir, METADATA) if process_index else None,
                   since=since)
      if remote:  # each worker's files, then its done.json (the mark that it finished)
        for i in todo:  # (none done: process 0 gathered every host's while this one looked)
          if _done(staging, i, total, fp):
            _upload_worker(staging, tmp, i)
    except BaseException as e:
      keep = _keeps_workers(e)
      for i in ids:  # nothing half-made of this host's is left behind
        if not (keep and _done(staging, i, total, fp)):
          shutil.rmtree(_worker_dir(staging, i), ignore_errors=True)
      if process_count == 1:
        if not keep or not any(n.startswith('worker-') for n in os.listdir(staging)):
          shutil.rmtree(staging, ignore_errors=True)
      else:  # process 0 stops waiting for this host
        _notice(tmp, f'{process_index:05d}', e)
      raise
    if remote:
      shutil.rmtree(staging, ignore_errors=True)  # uploaded
    if process_index != 0:
      if not remote:
        try:  # left empty when process 0 had gathered everything before this host looked
          os.rmdir(tmp)
        except OSError:
          pass
      return None
    try:
      # Signed again: a corpus that changed while it was prepared is an error, not a mix.
      if _wait_for_workers(out_dir, total, fingerprint(config), timeout_s, since=since,
                           made=None if overwrite else _path(out_dir, METADATA)):
        return read_metadata(out_dir)  # another preparation gathered them first
      return _gather(config, tokenizer, tmp, out_dir, total, overwrite, started)
    except BaseException as e:
      if process_count > 1:  # the other hosts, waiting for metadata.json, stop too
        _notice(tmp, 'gather', e)
      raise
  finally:
    if lock is not None:
      lock.close()


class _single_host_lock:  # pylint: disable=invalid-name
  """Concurrent preparations on one host take turns: an flock on <staging>.lock, a file
  opened for writing (a network file system's flock is a byte-range lock, which needs one:
  on a folder it fails), removed by its holder as it lets go (a waiter that then holds the
  removed file takes the new one). A file system without locks is one line."""

  def __init__(self, staging: str):
    self._path = staging.rstrip('/') + '.lock'
    os.makedirs(os.path.dirname(self._path), exist_ok=True)
    self._fd = storage.lock_file(self._path, wait=True, fix='prepare into a folder on a '
                                 'local disk, or a gs:// bucket')

  def close(self):
    try:
      os.unlink(self._path)
    except FileNotFoundError:
      pass
    os.close(self._fd)  # releases the lock


PREPARED_NAME = re.compile(r'(%s)-\d{5}-of-\d{5}' % '|'.join(SPLITS))


def refuse_other_files(out_dir: str) -> None:
  """A preparation replaces its folder whole (an earlier preparation, or the shards of one
  cut short): a folder holding anything else is refused before anything is written."""
  folder = _path(out_dir)
  if not storage.is_dir(folder):  # (an outage raises: the folder is deleted next)
    return
  # (A bucket folder made in the console holds a placeholder object named after the folder.)
  other = sorted(p.name for p in folder.iterdir()
                 if p.name not in (METADATA, folder.name, '') and
                 not PREPARED_NAME.fullmatch(p.name))
  if other:
    raise ValueError(f'{out_dir} holds {len(other)} files that are not prepared data (e.g. '
                     f'{other[0]}), which a preparation would delete; give a new or empty '
                     'folder (config.data.prepared_dir or --out_dir)')


def _path(*parts: str):
  """A local path or an object URL, as an etils.epath.Path."""
  return storage.path(parts[0]).joinpath(*parts[1:])


def _worker_dir(tmp: str, worker: int) -> str:
  return os.path.join(tmp, f'worker-{worker:05d}')


def staging_dir(url: str, process_index: int) -> str:
  """The local folder where a process's workers write a preparation bound for `url` (one
  per URL and process: concurrent preparations on one host take turns on its .lock)."""
  return os.path.join(storage.cache_dir('prepared'), storage.cache_key(url) + '.staging',
                      f'process-{process_index:05d}')


def _upload_worker(staging: str, tmp: str, worker: int) -> None:
  local, remote = _worker_dir(staging, worker), _worker_dir(tmp, worker)
  done = json.loads(_path(local, 'done.json').read_text())
  for name in [n for split in SPLITS for n in done['files'][split]] + ['done.json']:
    storage.upload(os.path.join(local, name), remote + '/' + name)


def _done(tmp: str, worker: int, total: int, fp: dict) -> Optional[dict]:
  """The worker's result, if it finished with these settings and this worker count."""
  path = _path(_worker_dir(tmp, worker), 'done.json')
  if not storage.is_file(path):
    return None
  done = json.loads(path.read_text())
  if done['fingerprint'] != fp or done['workers'] != total:
    return None
  names = [n for split in SPLITS for n in done['files'][split]]
  if not all(storage.is_file(_path(_worker_dir(tmp, worker), n)) for n in names):
    return None  # a gathering was cut short after moving its files: redo this worker
  return done


def die_with_parent(parent: int, poll_s: float = 0.5) -> None:
  """In a worker process (the preparation pool's initializer; grain's workers, as they
  receive the stream: pipeline._Decode): exit as soon as `parent` is gone. A parent killed
  with SIGKILL (the OOM killer picks the large process) cannot stop its workers, which would
  otherwise finish their shares and write into the folder that a restarted preparation is
  rewriting, or wait for ever on a full queue."""
  def watch():
    while os.getppid() == parent:
      time.sleep(poll_s)
    os._exit(1)  # pylint: disable=protected-access
  threading.Thread(target=watch, daemon=True, name='die_with_parent').start()


def _run_workers(config, tokenizer, tmp: str, ids: List[int], total: int,
                 made_since=None, since: float = 0.0):
  """Runs the workers among `ids` that have not finished. `made_since`: a host other than
  process 0 passes <out_dir>/metadata.json; written since `since`, it means process 0 has
  gathered this attempt's workers (and removed them) while this host looked."""
  fp = fingerprint(config)
  todo = [i for i in ids if _done(tmp, i, total, fp) is None]
  if len(todo) < len(ids):
    logging.info('preparation: %d of this host\'s %d workers finished before; resuming the '
                 'others', len(ids) - len(todo), len(ids))
  if todo and made_since and made_since.exists() and storage.mtime(made_since) >= since:
    return
  if not todo:
    return
  if len(todo) == 1 and len(ids) == 1:  # in this process: no start-up cost
    _work(config, tokenizer, tmp, todo[0], total)
    return
  context = multiprocessing.get_context('spawn')  # never fork a process that runs JAX
  work = importlib.import_module('data.prepare')._work  # by its module name, also under -m
  before = set(multiprocessing.active_children())
  pool = concurrent.futures.ProcessPoolExecutor(len(todo), mp_context=context,
                                               initializer=die_with_parent,
                                               initargs=(os.getpid(),))
  try:
    futures = [pool.submit(work, config, tokenizer.path, tmp, i, total) for i in todo]
    done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    for future in done:  # the first failure, as soon as it happens
      try:
        future.result()
      except concurrent.futures.BrokenExecutor:  # (a process of the pool gone)
        raise RuntimeError('a preparation worker process ended abruptly (its lines above say '
                           'why: killed, out of memory, or the calling script ran prepare '
                           'again as the worker imported it, outside `if __name__ == '
                           '"__main__":`)') from None
  except BaseException:  # a failed worker, Ctrl-C or SIGTERM: stop the pool's other workers
    for child in set(multiprocessing.active_children()) - before:  # now, not after their
      child.terminate()                                            # whole share
    pool.shutdown(wait=False, cancel_futures=True)
    raise
  pool.shutdown()


def owns(block: int, run: int, worker: int, total: int) -> bool:
  """Whether worker `worker` of `total` prepares the block of that number: blocks are dealt
  to the workers in turn, in runs of `run` (data.blocks_per_file) consecutive blocks."""
  return block // run % total == worker


class _Share:
  """One worker's share of one split, fed the split's documents in the stream's order: they
  are numbered within the split and cut into blocks of `document_window`; the documents of
  the worker's blocks (those of the runs of `blocks_per_file` consecutive blocks numbered r
  with r % total == worker) are tokenised as they come (a block holds their compact ids,
  not their text), and each such block, once whole, is made into instances and written; the
  other documents are passed over untouched."""

  def __init__(self, config, tokenizer, out: str, split: str, worker: int, total: int):
    d = config.data
    self.config, self.tokenizer, self.split = config, tokenizer, split
    self.worker, self.total = worker, total
    self.block_size, self.run = d.get('document_window', 1000), d.get('blocks_per_file', 8)
    self.writers = ShardWriters(out, split, d.get('records_per_file', 65536), self.run)
    self.make_instances = pretraining.of_config(config).instances
    self.stats, self.count = collections.Counter(), 0
    self.seen, self.block, self.docs = 0, 0, []

  def add(self, doc) -> None:
    block = self.seen // self.block_size
    self.seen += 1
    if block != self.block:
      self._write()
      self.block = block
    if owns(block, self.run, self.worker, self.total):
      ids = self.tokenizer.encode_batch(sources.sentences(doc))
      self.stats['empty_sentences'] += sum(not s for s in ids)  # nothing left after tokenising
      self.docs.append([np.asarray(s, np.int32) for s in ids if s])

  def _write(self) -> None:
    if not self.docs:
      return
    d = self.config.data
    seed = int(np.random.SeedSequence([data_seed(self.config), SPLITS.index(self.split),
                                       self.block]).generate_state(1)[0])
    for inst in self.make_instances(
        self.docs, max_seq_length=d.max_seq_length, short_seq_prob=d.short_seq_prob,
        dupe_factor=d.dupe_factor, seed=seed, stats=self.stats):
      self.writers.write(inst.to_bytes(), self.block)
      self.count += 1
    self.docs = []

  def close(self) -> dict:
    """Writes the last block and closes the files: what done.json records of the split."""
    self._write()
    return {'files': [os.path.basename(p) for p in self.writers.close()],
            'counts': self.count, 'file_records': self.writers.records,
            'blocks': self.writers.segments,
            'stats': {f'{self.split}/{k}': v for k, v in self.stats.items()}}


def _work(config, tokenizer, tmp: str, worker: int, total: int):
  """One worker: its blocks of both splits into <tmp>/worker-XXXXX/, then done.json. The
  stream is read once: each document goes to its split (is_eval_document), whose share
  tokenises it if it is the worker's."""
  d = config.data
  if isinstance(tokenizer, str):  # a spawned process loads its own
    tokenizer = tokenizer_lib.Tokenizer.load(tokenizer)
  out = _worker_dir(tmp, worker)
  shutil.rmtree(out, ignore_errors=True)
  os.makedirs(out)
  read_stats = collections.Counter()
  docs = sources.iter_documents(d.sources, tfds_data_dir=d.tfds_data_dir, stats=read_stats,
                                weights=d.weights, seed=data_seed(config),
                                tfds_text_feature=d.get('tfds_text_feature', 'text'),
                                hf_text_column=d.get('hf_text_column', 'text'),
                                hf_rows_per_document=d.get('hf_rows_per_document', '1'),
                                lazy=True,  # sentences split only in the owned blocks
                                numbered=True)
  shares = {split: _Share(config, tokenizer, out, split, worker, total) for split in SPLITS}
  for number, doc in docs:
    shares[split_of(number, d.eval_fraction)].add(doc)
  result = {'fingerprint': fingerprint(config), 'workers': total, 'counts': {}, 'files': {},
            'file_records': {}, 'blocks': {}, 'stats': {},
            'read_stats': dict(read_stats)}  # (the whole stream's, read once)
  for split, share in shares.items():
    done = share.close()
    result['stats'].update(done.pop('stats'))
    for key, value in done.items():
      result[key][split] = value
  with open(os.path.join(out, 'done.json.tmp'), 'w') as f:
    json.dump(result, f)
  os.replace(os.path.join(out, 'done.json.tmp'), os.path.join(out, 'done.json'))


def _wait_for_workers(out_dir: str, total: int, fp: dict, timeout_s: float, since: float,
                      made=None) -> bool:
  """Waits until every worker of the preparation of `out_dir` is done (False), or until
  `made` (the output's metadata.json) exists: another preparation gathered them first
  (True)."""
  tmp = tmp_dir(out_dir)
  deadline = time.time() + timeout_s
  while True:
    missing = [i for i in range(total) if _done(tmp, i, total, fp) is None]
    if not missing:
      return False
    if made is not None and made.exists():
      return True
    for i in missing:  # finished in this attempt, but from other settings or corpus files
      path = _path(_worker_dir(tmp, i), 'done.json')
      try:
        if storage.mtime(path) < since:
          continue  # an earlier attempt's: the worker will redo it
        theirs = json.loads(path.read_text())['fingerprint']
      except (FileNotFoundError, ValueError, KeyError):
        continue
      diff = {k: (theirs.get(k), fp.get(k)) for k in sorted(set(theirs) | set(fp))
              if theirs.get(k) != fp.get(k)}
      if diff:
        raise ValueError(f'preparation worker {i} of {total} saw other settings or corpus '
                         f'files than process 0 (worker, process 0): {diff}; give every '
                         'host the same corpus and config')
    failed = _failure(tmp, since, hosts_only=True)
    if failed:
      raise cli.UserError(f'preparing {out_dir} failed on {failed}')
    if time.time() > deadline:
      raise TimeoutError(f'preparation workers {missing[:8]} of {total} did not finish in '
                         f'{timeout_s:.0f} s; is every host running it?')
    time.sleep(POLL_SECONDS)


def tmp_dir(out_dir: str) -> str:
  """Where a preparation of `out_dir` keeps its workers' results and failure notices."""
  return f'{out_dir.rstrip("/")}.tmp'


def failure_since(out_dir: str, since: float) -> Optional[str]:
  """The message of a host's failed preparation of `out_dir` written after `since` (a
  host waiting for metadata.json stops on it), or None."""
  return _failure(tmp_dir(out_dir), since)


def _notice(tmp: str, who: str, error: BaseException) -> None:
  """<tmp>/failed-<who>.txt, the failure notice that the other hosts' waits stop on (process
  0 waiting for the workers, the others for metadata.json): `who` is a host's number
  (05d) or 'gather', process 0's gathering. A notice that cannot be written is logged (the
  error raised stays the host's own)."""
  try:
    notice = _path(tmp, f'failed-{who}.txt')
    notice.parent.mkdir(parents=True, exist_ok=True)
    notice.write_text(f'{type(error).__name__}: {error}')
  except Exception as e:  # pylint: disable=broad-except
    logging.warning('could not tell the other hosts that this one failed (%s)', e)


# Hosts begin apart (started by hand; one reads more to check its inputs): a failure notice
# from up to this long before an attempt's start (`since`) is still the attempt's.
START_SKEW_SECONDS = 60.0


def _failure(tmp: str, since: float, hosts_only: bool = False) -> Optional[str]:
  """'<who>: <message>' of a failure file in `tmp` written since `since` (START_SKEW_SECONDS
  allowed; an earlier attempt's is not this one's), or None; `hosts_only` passes over
  process 0's gathering."""
  try:
    names = sorted(p.name for p in _path(tmp).iterdir() if p.name.startswith('failed-') and
                   (p.name[7:12].isdigit() or not hosts_only))
  except FileNotFoundError:
    return None
  for name in names:
    path = _path(tmp, name)
    try:
      if storage.mtime(path) >= since - START_SKEW_SECONDS:
        who = name[len('failed-'):-len('.txt')]
        who = 'process 0 (gathering)' if who == 'gather' else f'host {int(who)}'
        return f'{who}: {path.read_text()}'
    except FileNotFoundError:
      continue
  return None


def _gather(config, tokenizer, tmp: str, out_dir: str, total: int, overwrite: bool,
            started: float) -> dict:
  """Process 0: every worker's files under their final names, and metadata.json."""
  if storage.is_url(out_dir):
    return _gather_objects(config, tokenizer, tmp, out_dir, total, overwrite, started)
  fp = fingerprint(config)
  results = [_done(tmp, i, total, fp) for i in range(total)]
  if any(r is None for r in results):  # another preparation gathered them meanwhile
    return read_metadata(out_dir)  # (or says that nothing was made)
  gathered = os.path.join(tmp, 'gathered')
  shutil.rmtree(gathered, ignore_errors=True)  # a gathering that was cut short
  os.makedirs(gathered)
  try:
    files = {}
    for split in SPLITS:
      paths = [os.path.join(_worker_dir(tmp, i), name)
               for i, r in enumerate(results) for name in r['files'][split]]
      files[split] = name_files(paths, gathered, split)
    counts, stats = _totals(results)
    metadata = _finish(config, tokenizer, gathered, out_dir, overwrite, counts, files, stats,
                       _layout(results), total, started)
  except BaseException as e:
    if _keeps_workers(e):  # the workers stay for the next attempt
      shutil.rmtree(gathered, ignore_errors=True)
    else:
      shutil.rmtree(tmp, ignore_errors=True)
    raise
  shutil.rmtree(tmp, ignore_errors=True)  # the workers, and any of another worker count
  return metadata


def _gather_objects(config, tokenizer, tmp: str, out_dir: str, total: int, overwrite: bool,
                    started: float) -> dict:
  """_gather into a bucket: the workers' objects copied under their final names, then
  metadata.json (written last: the preparation's commit). Two preparations of the same
  output (runs on separate machines) take turns on a lease object; the second finds the
  first's metadata.json and keeps it."""
  lease = storage.Lease(f'{out_dir}.lock', storage.holder_record('data.prepare'),
                        guards=out_dir)
  deadline = time.time() + storage.LEASE_SECONDS * 2
  while True:
    try:
      lease.take()
      break
    except storage.HeldError as e:
      if not overwrite and _path(out_dir, METADATA).exists():
        return read_metadata(out_dir)
      if time.time() > deadline:
        raise cli.UserError(str(e)) from None
      time.sleep(POLL_SECONDS)

  def fence():  # a gatherer whose lease lapsed writes nothing more: another may be at work
    if lease.lost:
      raise cli.UserError(f'{lease.lost}; this preparation of {out_dir} stopped before '
                          'writing again: run it again')
  try:
    return _copy_objects(config, tokenizer, tmp, out_dir, total, overwrite, started, fence)
  finally:
    lease.release()


def _copy_objects(config, tokenizer, tmp: str, out_dir: str, total: int, overwrite: bool,
                  started: float, fence: Callable[[], None]) -> dict:
  """_gather_objects' work under the lease; `fence()` before every write."""
  fp = fingerprint(config)
  results = [_done(tmp, i, total, fp) for i in range(total)]  # read under the lease
  if any(r is None for r in results):  # another preparation gathered them meanwhile
    return read_metadata(out_dir)  # (or says that nothing was made)
  if _path(out_dir, METADATA).exists():
    if not overwrite:
      return read_metadata(out_dir)
    fence()
    _path(out_dir, METADATA).unlink()  # first: never a metadata.json over mixed shards
  if _path(out_dir).exists():
    fence()
    _path(out_dir).rmtree()  # shards of an earlier attempt cut short
  files = {}
  for split in SPLITS:
    paths = [_worker_dir(tmp, i) + '/' + name
             for i, r in enumerate(results) for name in r['files'][split]]
    for path, final in zip(paths, shard_paths(out_dir, split, len(paths))):
      fence()
      _path(path).copy(_path(final), overwrite=True)
    files[split] = len(paths)
  counts, stats = _totals(results)
  metadata = _metadata(config, tokenizer, counts, files, stats, _layout(results), total,
                       started)
  fence()
  _path(out_dir, METADATA).write_text(json.dumps(metadata, indent=2))
  try:
    fence()
  except cli.UserError as e:  # committed: it stands; the workers' objects are left alone
    logging.warning('%s (after its metadata.json was written: the preparation is complete)',
                    e)
    return metadata
  _path(tmp).rmtree()
  return metadata


def _finish(config, tokenizer, gathered: str, out_dir: str, overwrite: bool, counts, files,
            stats, layout, workers: int, started: float) -> dict:
  metadata = _metadata(config, tokenizer, counts, files, stats, layout, workers, started)
  with open(os.path.join(gathered, METADATA), 'w') as f:
    json.dump(metadata, f, indent=2)
  if os.path.exists(out_dir):
    if not overwrite and os.path.exists(os.path.join(out_dir, METADATA)):
      return read_metadata(out_dir)
    # The old preparation leaves by a rename (deleted from <out_dir>.tmp with the workers'
    # files), never deleted in place: a kill midway would leave its metadata.json beside
    # some of its shards, which a run would take for a complete preparation.
    replaced = os.path.join(os.path.dirname(gathered), 'replaced')
    shutil.rmtree(replaced, ignore_errors=True)
    os.rename(out_dir, replaced)
  try:
    os.rename(gathered, out_dir)
  except OSError:  # another process renamed its preparation into place first
    if overwrite or not os.path.exists(os.path.join(out_dir, METADATA)):
      raise
    return read_metadata(out_dir)
  return metadata


def _totals(results) -> Tuple[Dict[str, int], collections.Counter]:
  """The workers' instance counts by split and their statistics, summed: each worker's
  counts of its own documents add up, and the stream's (`read_stats`), which every worker
  read whole, are taken once."""
  counts = {split: sum(r['counts'][split] for r in results) for split in SPLITS}
  stats = collections.Counter()
  for r in results:
    stats.update(r['stats'])
  stats.update(results[0]['read_stats'])
  return counts, collections.Counter({k: v for k, v in stats.items() if v})


def _layout(results) -> dict:
  """Where the gathered records lie, from the workers' done.json: 'file_records', each
  split's records per file in the files' final order, and 'blocks', each split's segments
  in block order (the order readers take the records in), as 'block:file:first:count'
  separated by spaces. Either is left out if a worker's done.json predates it (readers then
  count the files, and take the records in the files' order)."""
  layout = {}
  if all('file_records' in r for r in results):
    layout['file_records'] = {split: [n for r in results for n in r['file_records'][split]]
                              for split in SPLITS}
  if all('blocks' in r for r in results) and layout:
    layout['blocks'] = {}
    for split in SPLITS:
      segments, first = [], 0  # first: the worker's first file, in the final order
      for r in results:
        segments += [(b, first + f, start, n) for b, f, start, n in r['blocks'][split]]
        first += len(r['file_records'][split])
      segments.sort(key=lambda segment: segment[0])  # stable: a block's own stay in order
      layout['blocks'][split] = ' '.join('%d:%d:%d:%d' % seg for seg in segments)
  return layout


# The share of training pairs from chunks of one sentence (always paired with a random
# document's segment) above which the preparation warns: with BERT's coin flip for the other
# chunks, 70% of its pairs random next.
ONE_SENTENCE_CHUNKS_WARNING = 0.4


def _metadata(config, tokenizer, counts, files, stats, layout, workers: int,
              started: float) -> dict:
  """metadata.json of a gathered preparation; bad input (no training example) raises.
  `layout` (_layout) puts the records in block order, whatever the worker and host count,
  and lets each host read (and copy from a bucket) only the files that hold its share of
  them (data.pipeline)."""
  d = config.data
  objective = pretraining.of_config(config)
  pairs = objective.next_sentence
  ones = stats['eval/random_next'] + stats['eval/swapped']  # (label 1: ALBERT's swaps too)
  if pairs and stats['eval/documents'] == 1 and counts['eval'] and ones in (0, counts['eval']):
    logging.warning('the eval split holds one document, so it has no random-next segments '
                    '(every NSP label is 0) and eval NSP accuracy means nothing; raise '
                    'data.eval_fraction (now %g) to hold out at least two documents',
                    d.eval_fraction)
  single, documents = stats['train/single_sentence_documents'], stats['train/documents']
  if pairs and documents and single > documents / 2:
    logging.warning('%d of the %d training documents hold one sentence, so all their '
                    'instances are random next (NSP label 1) with a one-sentence B; a source '
                    'with a sentence per row (hf:) needs config.data.hf_rows_per_document > 1, '
                    'and files a blank line between documents, not between sentences',
                    single, documents)
  order = objective.instances is pretraining.sentence_order_instances
  random_next = stats['train/random_next'] / max(counts['train'], 1)
  one_sentence = random_next if order else 2 * random_next - 1  # (BERT: half the rest too)
  if pairs and counts['train'] and one_sentence > ONE_SENTENCE_CHUNKS_WARNING:
    logging.warning('%.0f%% of the training pairs are random next (NSP label 1; %s): most '
                    'chunks of the documents are one sentence, which is always paired at '
                    'random. Sentences longer than data.max_seq_length (%d), or text that '
                    'was not split into sentences (a paragraph a line; tfds:/hf: text in '
                    'lower case), do that: give files: one sentence per line',
                    100 * random_next, 'ALBERT\'s sentence order pairs no other chunk so'
                    if order else 'about half in BERT\'s data', d.max_seq_length)
  undecodable = undecodable_lines(stats)
  if undecodable:
    logging.warning('%d lines of config.data.sources=%r are not UTF-8 and were skipped; '
                    'convert the files to UTF-8 (e.g. iconv -f latin1 -t utf-8)', undecodable,
                    d.sources)
  if counts['train'] == 0:
    raise ValueError(f'config.data.sources={d.sources!r} gave no training examples '
                     f'({dict(stats) or "no documents"}); check the files and their format '
                     '(one sentence per line, blank line between documents)')
  return {'counts': counts, 'files': files, **layout, 'stats': dict(stats),
          'fingerprint': fingerprint(config),
          'tokenizer_path': tokenizer.path, 'vocab_size': tokenizer.vocab_size,
          'max_seq_length': d.max_seq_length, 'workers': workers,
          'seconds': round(time.time() - started, 1)}


def read_metadata(prepared_dir: str, config=None) -> dict:
  path = _path(prepared_dir, METADATA)
  if not path.exists():
    raise FileNotFoundError(f'{prepared_dir} holds no prepared data ({METADATA} missing); run '
                            '`python -m data.prepare` or let train.py prepare it')
  metadata = json.loads(path.read_text())
  if config is None:
    return metadata
  specs = sources.source_specs(config.data.sources)
  twice = sorted({x for x in specs if specs.count(x) > 1})
  if (twice and 'eval_split' not in metadata['fingerprint'] and
      metadata['fingerprint'].get('sources') == config.data.sources):
    raise ValueError(f'prepared data in {prepared_dir} was made by an earlier version, which '
                     'held out documents by their place in the mixed stream, so the source '
                     f'listed twice ({twice[0]}) put documents in both splits; delete the '
                     'directory (or point config.data.prepared_dir elsewhere) to prepare again')
  # Keys written only when they differ from their default stand for it when absent; keys
  # added to the fingerprint since a preparation was made are not held against it, nor are
  # those of the files' layout.
  have = {k: v for k, v in {**FINGERPRINT_DEFAULTS, **metadata['fingerprint']}.items()
          if k not in FINGERPRINT_LAYOUT}
  configured = fingerprint(config)
  want = {**FINGERPRINT_DEFAULTS, **{k: v for k, v in configured.items() if k in have}}
  if 'files' in have and 'files' not in want:  # the raw corpus is not on this machine
    logging.warning('the corpus files of %s are not here (config.data.sources=%r matches '
                    'none): using the prepared data without checking them against it',
                    prepared_dir, config.data.sources)
    want['files'] = have['files']
  if 'tokenizer_crc' in have and have['tokenizer_crc'] == want.get('tokenizer_crc'):
    want['tokenizer'] = have['tokenizer']  # the same files elsewhere (a run's kept copy)
  if 'tokenizer_crc' in have and 'tokenizer_crc' not in want:
    want['tokenizer_crc'] = have['tokenizer_crc']  # (loading it will say it is not there)
  if 'sentence_split' in configured and 'sentence_split' not in have:
    logging.warning('%s was prepared when only an ASCII capital opened a sentence: text of '
                    'another script (French\'s É, Greek, Russian) was left in paragraphs, so '
                    'its pairs were nearly all random next; if the corpus is not English, '
                    'prepare it again (a new data.prepared_dir)', prepared_dir)
  if have != want:
    diff = {k: (have.get(k), want.get(k)) for k in sorted(set(have) | set(want))
            if have.get(k) != want.get(k)}
    what = ('other corpus files' if set(diff) == {'files'} else
            'another tokenizer file (retrained at the same path?)'
            if set(diff) == {'tokenizer_crc'} else
            'another version of the preparation\'s code (data/prepare.py PREPARE_VERSION)'
            if set(diff) == {'version'} else 'other settings')
    seed = (f'set data.seed={diff["seed"][0]} (the seed it was prepared with), ' if
            set(diff) == {'seed'} else
            f'set config.objective={_objective_of(diff["instances"][0])} (what it was '
            'prepared for), ' if set(diff) == {'instances'} else '')
    raise ValueError(f'prepared data in {prepared_dir} was made with {what} '
                     f'(prepared, configured): {diff}; {seed}point config.data.prepared_dir '
                     'elsewhere or delete the directory to prepare again')
  return metadata


def main(argv):
  del argv
  f = flags.FLAGS
  if f.config is None or not f.out_dir:
    raise ValueError(('--config is required: e.g. --config configs/pretrain.py:postln,base'
                      if f.config is None else '--out_dir is required: the folder for the '
                      'prepared shards (give it to train.py as config.data.prepared_dir)'))
  start = time.time()
  metadata = prepare(f.config, f.out_dir, process_index=f.process_index,
                     process_count=f.process_count)
  print(json.dumps(metadata or {'worker_process': f.process_index, 'done': True}, indent=2))
  if metadata:  # (process 0's: the counts of every host's shards)
    counts = metadata.get('counts', {})
    print(f'prepared {f.out_dir}: {counts.get("train")} train and {counts.get("eval")} eval '
          f'instances in {time.time() - start:.0f} s; train.py reads them with '
          f'--config.data.prepared_dir={f.out_dir} and the same --config.data.* settings '
          'and seed (or data.seed)',
          file=sys.stderr)


if __name__ == '__main__':
  # Flags are defined only when run as a program: train.py imports this module.
  with cli.config_overrides():
    config_flags.DEFINE_config_file('config', None, 'configs/pretrain.py:<variant>,<size>')
  flags.DEFINE_string('out_dir', None, 'Where to write the shards.')
  flags.DEFINE_integer('process_index', 0, 'This host (0 gathers every host\'s workers).')
  flags.DEFINE_integer('process_count', 1, 'Hosts preparing together (a shared out_dir).')
  app.run(lambda argv: cli.run_main(main, argv), flags_parser=cli.parse_flags)
