"""The pretraining input stream: prepared shards -> shuffled, dynamically masked, per-host
batches, with a state that Orbax saves beside the train state.

The stream is a pure function of (seed, position) for a given number of training hosts and
of grain worker processes (data.worker_count: each worker batches the positions it is handed,
i, i + W, i + 2W, ..., so W workers make other batches of the same records than none or one;
a resume keeps the count, workdir.check_resume_config): grain's IndexSampler shuffles the
records of every epoch with the seed, each host takes its own contiguous share (ShardOptions
by process; another host count reads another stream, so a run resumes on as many hosts as
saved it: check_saved_position), and
masking draws from a generator that grain seeds from the seed and the record's index in
the shuffled stream
(their sum: seed s at index i + 1 draws as seed s + 1 at index i, which another seed's
shuffle puts on another record), so an epoch re-masks every instance differently and a
restored iterator continues with exactly the batches an uninterrupted run would have seen.
"""

import collections
import contextlib
import json
import multiprocessing
import os
import re
import signal
import threading
import time
import zlib
from typing import Dict, List, Optional, Tuple

from absl import flags
from absl import logging
import grain.python as grain
import numpy as np

from data import prepare as prepare_lib
from data import pretraining
from realformer import config_checks
from realformer import storage
from realformer.run_names import RunNames


_WATCHING = False  # whether this process, a grain worker, watches for its parent's end


class _Decode(grain.MapTransform):
  """Record bytes -> padded [CLS] A [SEP] B [SEP] features and the NSP label (an MLM-only
  objective's instance is one segment, with no label)."""

  def __init__(self, tokenizer, max_seq_length):
    self._kw = dict(cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id, pad_id=tokenizer.pad_id,
                    max_seq_length=max_seq_length)

  def __setstate__(self, state):
    # How a grain worker process receives the stream's first operation: blocked on its full
    # queue, a worker outlived a run killed by SIGKILL (a preemption, the OOM killer) for
    # ever, holding its memory on the host where the run then started again.
    self.__dict__.update(state)
    global _WATCHING  # pylint: disable=global-statement
    parent = multiprocessing.parent_process()
    if parent is not None and not _WATCHING:  # (once a process)
      prepare_lib.die_with_parent(parent.pid)
      _WATCHING = True

  def map(self, record: bytes) -> Dict[str, np.ndarray]:
    return pretraining.make_features(pretraining.Instance.from_bytes(record), **self._kw)


class _Mask(grain.RandomMapTransform):
  """Dynamic masking; grain seeds `rng` from the sampler's seed and the record's index."""

  def __init__(self, masker: pretraining.Masker):
    self._masker = masker

  def random_map(self, features, rng: np.random.Generator):
    return self._masker(features, rng)


def parse_blocks(text: str) -> np.ndarray:
  """metadata.json's 'blocks' of a split ('block:file:first:count' ...) as int64 [segments, 4]."""
  return np.array([seg.split(':') for seg in text.split()], np.int64).reshape(-1, 4)


class PreparedShards(grain.ArrayRecordDataSource):
  """One split's prepared array_record shards, its records in block order: record i of the
  source is the i-th of the blocks' records taken block after block (metadata.json's
  'blocks'), the same records in the same order for any number of preparation workers and
  hosts, so a seed trains on the same stream however the data was prepared.

  Given each file's record count (`records`, metadata.json's file_records), no file is opened
  until one of its records is read, so a folder holding only this host's files serves its
  share (host_files); without them, every file is opened to count its records (and the
  records come in the files' order, as from a preparation that predates 'blocks').

  Named in the iterator's checkpoint by what it holds (the record count of each block, or of
  each file's name) rather than by its folder (grain's default hashes the absolute paths): a
  moved workdir, data.prepared_dir pointed at a copy, or a folder prepared again with another
  worker count resumes; a preparation that gives other records does not."""

  def __init__(self, paths: List[str], records: Optional[List[int]] = None,
               blocks: Optional[str] = None):
    super().__init__(paths if records is None else
                     [f'{p}[0:{n}]' for p, n in zip(paths, records, strict=True)])
    self._names = [os.path.basename(p) for p in paths]
    self._blocks = None
    if blocks is not None and records is not None:
      table = parse_blocks(blocks)
      counts = table[:, 3]
      if counts.sum() != len(self):
        raise ValueError(f'metadata.json\'s blocks of {os.path.dirname(paths[0])} hold '
                         f'{counts.sum()} records, its files {len(self)}; prepare it again')
      file_starts = np.concatenate([[0], np.cumsum(records)[:-1]]).astype(np.int64)
      self._physical = file_starts[table[:, 1]] + table[:, 2]  # each segment's first record
      self._ends = np.cumsum(counts)  # each segment's end, in block order
      self._blocks = table

  @property
  def block_ordered(self) -> bool:
    """Whether the records are read in block order (else in the files' order)."""
    return self._blocks is not None

  def physical(self, indices: np.ndarray) -> np.ndarray:
    """The positions, in the files' order, of records `indices` (block order)."""
    indices = np.asarray(indices, np.int64)
    if self._blocks is None:
      return indices
    s = np.searchsorted(self._ends, indices, side='right')  # each record's segment
    return self._physical[s] + indices - (self._ends[s] - self._blocks[s, 3])

  def __getitem__(self, record_key):
    return super().__getitem__(int(self.physical(record_key.__index__())))

  def __getitems__(self, record_keys):
    return super().__getitems__(
        self.physical([k.__index__() for k in record_keys]).tolist())

  def __repr__(self) -> str:
    if self._blocks is None:
      crc = zlib.crc32('\n'.join(self._names).encode())
      return f'PreparedShards(files={len(self._names)}, names_crc={crc:08x}, records={len(self)})'
    per_block = collections.Counter()
    for block, _, _, n in self._blocks.tolist():
      per_block[block] += n
    crc = zlib.crc32(' '.join(f'{b}:{n}' for b, n in per_block.items()).encode())
    return f'PreparedShards(blocks={len(per_block)}, counts_crc={crc:08x}, records={len(self)})'


class _Iterator:
  """The data loader's iterator, restoring states saved before PreparedShards named the
  shards (grain's path hash then stood for them; the prepared data's fingerprint has been
  checked against the config, so they are taken as these shards, if these are read in the
  files' order as all were then)."""

  def __init__(self, iterator, source: PreparedShards, workers: bool = False):
    self._iterator, self._source = iterator, source
    self._workers_to_start = workers

  def __iter__(self):
    return self

  def __next__(self):
    if self._workers_to_start:  # grain starts them for the first batch
      with _workers_deaf_to_ctrl_c():
        batch = next(self._iterator)
      self._workers_to_start = False
      return batch
    return next(self._iterator)

  def get_state(self) -> bytes:
    return self._iterator.get_state()

  def set_state(self, state: bytes):
    decoded = json.loads(state.decode())
    if (str(decoded.get('data_source', '')).startswith('ArrayRecordDataSource(') and
        not self._source.block_ordered):  # (those states read the files in their order)
      decoded['data_source'] = repr(self._source)
      state = json.dumps(decoded).encode()
    self._iterator.set_state(state)

  def start_prefetch(self):
    self._iterator.start_prefetch()


@contextlib.contextmanager
def _workers_deaf_to_ctrl_c():
  """SIGINT ignored while grain starts its worker processes (from a thread of its own, for
  an iterator's first batch), which keep an ignored signal (a blocked one they do not:
  Python's spawn clears the mask): a Ctrl-C at the terminal reaches the whole process group,
  and the run then saves at its next step (workdir.stop_signals) while its workers go on
  feeding it, where they would have died with a KeyboardInterrupt (a traceback each, and a
  failed run once the batches they had prefetched ran out). Only the main thread may set a
  handler (elsewhere this does nothing); a Ctrl-C while an iterator reads its first batch
  (the training's, and each evaluation's) is lost."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


def host_records(num_records: int, process_index: int, process_count: int) -> Tuple[int, int]:
  """The records [start, end) that a host reads in every epoch: grain's IndexSampler with
  ShardOptions(drop_remainder=True) gives each process one run of num_records //
  process_count consecutive records, and each epoch shuffles within it."""
  per_host = num_records // process_count
  return per_host * process_index, per_host * (process_index + 1)


def host_files(metadata: dict, split: str, process_index: int, process_count: int
               ) -> Optional[List[int]]:
  """The indices of the split's files that hold the host's records (host_records, in block
  order); None for a preparation that did not count each file's records (every file is then
  read)."""
  records = metadata.get('file_records', {}).get(split)
  if records is None:
    return None
  start, end = host_records(sum(records), process_index, process_count)
  blocks = metadata.get('blocks', {}).get(split)
  if blocks is None:  # the records in the files' order
    ends = np.cumsum(records)
    return [i for i, (n, last) in enumerate(zip(records, ends))
            if last - n < end and last > start]
  table = parse_blocks(blocks)
  ends = np.cumsum(table[:, 3])
  return sorted({int(f) for f, n, last in zip(table[:, 1], table[:, 3], ends)
                 if last - n < end and last > start})


def allow_open_files(files: int) -> None:
  """Grain keeps a reader open on every file it has read from: raises this process's soft
  limit on open files (`ulimit -n`, often 1024) to hold `files` more than are open now, up
  to its hard limit; a one-line error where even that is too low."""
  import resource  # pylint: disable=g-import-not-at-top
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  try:
    open_now = len(os.listdir('/proc/self/fd'))
  except OSError:  # not Linux
    open_now = 256
  need = open_now + files + 64
  if soft == resource.RLIM_INFINITY or need <= soft:
    return
  if hard != resource.RLIM_INFINITY and need > hard:
    raise ValueError(f'reading the prepared data keeps {files} files open, but this process '
                     f'may open at most {hard} (ulimit -Hn); raise that limit, or prepare '
                     'again with larger data.blocks_per_file and data.records_per_file')
  resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
  logging.info('raised the limit on open files from %d to %d for the prepared data', soft, need)


def make_masker(config_data, tokenizer) -> pretraining.Masker:
  return pretraining.Masker(
      vocab_size=tokenizer.vocab_size, special_ids=tokenizer.special_ids,
      mask_id=tokenizer.mask_id, masked_lm_prob=config_data.masked_lm_prob,
      max_predictions_per_seq=config_data.max_predictions_per_seq,
      whole_word_masking=config_data.whole_word_masking,
      word_start_mask=tokenizer.word_start_mask() if config_data.whole_word_masking else None)


def make_pretraining_iterator(config_data, tokenizer, prepared_dir: str, *, split: str = 'train',
                              global_batch_size: int, seed: int, process_index: int = 0,
                              process_count: int = 1, num_epochs=None):
  """This host's iterator of numpy batches of `global_batch_size // process_count` examples.

  Batch: input_ids, segment_ids, attention_mask int32 [b, T]; masked_lm_positions,
  masked_lm_ids int32 [b, P]; masked_lm_weights float32 [b, P]; next_sentence_labels int32 [b]
  where the objective predicts the next sentence (mlm_nsp).
  """
  if split not in prepare_lib.SPLITS:
    raise ValueError(f'split {split!r}: use one of {prepare_lib.SPLITS}')
  if global_batch_size % process_count:
    raise ValueError(f'global batch {global_batch_size} does not divide over {process_count} '
                     'processes; make train.batch_size a multiple of the process count')
  metadata = prepare_lib.read_metadata(prepared_dir)
  if metadata['vocab_size'] != tokenizer.vocab_size:
    raise ValueError(f'{prepared_dir} was prepared with a vocabulary of '
                     f'{metadata["vocab_size"]} pieces but the tokenizer has '
                     f'{tokenizer.vocab_size}; prepare again with this tokenizer')
  paths = prepare_lib.shard_paths(prepared_dir, split, prepare_lib.num_files(metadata, split))
  share = host_files(metadata, split, process_index, process_count)
  missing = [paths[i] for i in share or [] if not os.path.exists(paths[i])]
  if missing:
    raise FileNotFoundError(f'{missing[0]} (one of the {len(missing)} files of process '
                            f'{process_index} of {process_count}) is missing; use the whole '
                            'prepared folder, or for a bucket the folder ensure_prepared copies')
  # (A split without records has no files, which grain's source refuses: this says why.)
  check_split(metadata, prepared_dir, split, metadata['counts'][split], global_batch_size,
              process_count)
  allow_open_files(len(paths) if share is None else len(share))
  source = PreparedShards(paths, metadata.get('file_records', {}).get(split),
                          metadata.get('blocks', {}).get(split))
  per_host = global_batch_size // process_count
  sampler = grain.IndexSampler(
      num_records=len(source), shuffle=True, seed=seed, num_epochs=num_epochs,
      shard_options=grain.ShardOptions(shard_index=process_index, shard_count=process_count,
                                       drop_remainder=True))
  operations = [_Decode(tokenizer, config_data.max_seq_length),
                _Mask(make_masker(config_data, tokenizer)),
                grain.Batch(per_host, drop_remainder=True)]
  if config_data.worker_count and not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()  # grain's workers read its absl flags (defaults suffice)
  # Reading threads contend for the GIL with the masking: on local shards, reading in the
  # consuming thread is fastest; raise data.read_threads for remote files.
  read_options = grain.ReadOptions(num_threads=config_data.get('read_threads', 0),
                                   prefetch_buffer_size=64)
  loader = grain.DataLoader(data_source=source, sampler=sampler, operations=operations,
                            worker_count=config_data.worker_count, read_options=read_options)
  return _Iterator(iter(loader), source, workers=config_data.worker_count > 0)


def check_split(metadata: dict, prepared_dir: str, split: str, examples: int,
                global_batch_size: int, process_count: int, batches: int = 0) -> None:
  """A one-line error if the split holds less than one batch for each process; with
  `batches` (an evaluation's steps), a warning if they read examples more than once."""
  per_host = global_batch_size // process_count
  if examples // process_count < per_host:
    undecodable = prepare_lib.undecodable_lines(metadata.get('stats', {}))
    why = (f' ({undecodable} lines of the corpus were not UTF-8 and were skipped: convert the '
           f'files to UTF-8 and delete {prepared_dir} to prepare again)' if undecodable else '')
    fix = ('a larger data.eval_fraction (prepared again in a new data.prepared_dir), or '
           'train.eval_steps=0 to train without evaluating' if split == 'eval' else
           'a larger corpus or a smaller train.batch_size')
    raise ValueError(f'the {split} split of {prepared_dir} has {examples} examples, fewer than '
                     f'one batch of {per_host} per process{why}; use {fix}')
  held = examples // process_count
  if batches * per_host > held:
    whole = held // per_host
    logging.warning('train.eval_steps=%d batches of %d read %d examples per process, but the '
                    '%s split holds %d: the evaluation counts some more than once; '
                    'train.eval_steps=%d reads %d of them once%s', batches, per_host,
                    batches * per_host, split, held, whole, whole * per_host,
                    '' if whole * per_host == held else
                    ' (a larger data.eval_fraction, prepared again in a new '
                    'data.prepared_dir, holds more)')


def check_saved_position(step_dir: str, process_count: int) -> None:
  """A one-line error if the stream's position in a checkpoint's step folder (grain's
  data/process_<i>-of-<n>.json, one per host) was saved by another number of training
  processes: each host reads its own share of the records (host_records), so n hosts'
  positions say nothing about where m hosts stand."""
  folder = storage.path(step_dir) / 'data'
  saved = {int(m.group(1)) for m in (re.fullmatch(r'process_\d+-of-(\d+)\.json', p.name)
                                     for p in (folder.iterdir() if storage.is_dir(folder)
                                               else ()))
           if m}
  if saved and saved != {process_count}:
    n = max(saved)
    raise ValueError(
        f'{step_dir} holds the input position of {n} training process{"es" * (n > 1)} and '
        f'this start has {process_count}: a pretraining run resumes on as many hosts as it '
        f'was saved by (each reads its own share of the records); resume it on {n}, or start '
        f'a new run (another --workdir) from its params with '
        f'--config.train.init_checkpoint={step_dir}')


def iterator_checkpoint_args(it, mode: str):
  """Orbax args for a CheckpointManager item 'data': save the state, or restore it in place."""
  if mode == 'save':
    return grain.PyGrainCheckpointSave(it)
  if mode == 'restore':
    return grain.PyGrainCheckpointRestore(it)
  raise ValueError(f'mode {mode!r}: use save or restore')


def ensure_prepared(config, workdir: str, timeout_s: float = 6 * 3600,
                    reader: Optional[Tuple[int, int]] = None,
                    splits: Tuple[str, ...] = prepare_lib.SPLITS) -> str:
  """Prepares the shards once (every host its share; process 0 gathers them and writes
  metadata.json, the others wait for it) and returns the local folder to read them from:
  the prepared folder itself, or for a bucket (gs://) this host's copy of the files that
  hold the share of each of `splits` that `reader`, (process index, process count), reads:
  by default this process's (host_files; every file for a preparation that did not count
  each file's records), checked against the bucket (storage.local_copy).

  An existing preparation made with other settings is a clear error, never silently reused.
  """
  import jax  # pylint: disable=g-import-not-at-top
  prepared_dir = os.fspath(storage.path(  # (a local one absolute, ~ expanded)
      config.data.prepared_dir or f'{str(workdir).rstrip("/")}/{RunNames.DATA}'))
  config_checks.check_lengths(config)
  metadata = storage.path(prepared_dir) / prepare_lib.METADATA
  made = not metadata.exists()
  if made:
    start = time.time()
    # The failure notices of this attempt, which the hosts but process 0 wait on, are newer,
    # by the clock that stamps them (1 s earlier: a file system may keep coarser times).
    started = (storage.clock(prepared_dir) - 1 if jax.process_index() != 0 else None)
    # Every host prepares its share (data.prepare_workers processes each); process 0 gathers.
    prepare_lib.prepare(config, prepared_dir, overwrite=False,
                        process_index=jax.process_index(),
                        process_count=jax.process_count(), timeout_s=timeout_s)
    if jax.process_index() != 0:
      deadline = time.time() + timeout_s
      while not metadata.exists():
        failed = prepare_lib.failure_since(prepared_dir, started)
        if failed:
          raise ValueError(f'preparing {prepared_dir} failed on {failed}')
        if time.time() > deadline:
          raise TimeoutError(f'process 0 did not finish preparing {prepared_dir}')
        time.sleep(prepare_lib.POLL_SECONDS)
  found = prepare_lib.read_metadata(prepared_dir, config)
  counts = found.get('counts', {})
  logging.info('%s %s: %s train and %s eval instances%s', 'prepared' if made else 'reading',
               prepared_dir, counts.get('train'), counts.get('eval'),
               f' in {time.time() - start:.0f} s' if made else ' (prepared before)')
  if not storage.is_url(prepared_dir):
    return prepared_dir
  reader = reader or (jax.process_index(), jax.process_count())
  names = [prepare_lib.METADATA]
  for split in splits:
    num_files = prepare_lib.num_files(found, split)
    paths = prepare_lib.shard_paths(prepared_dir, split, num_files)
    share = host_files(found, split, *reader)
    names += [os.path.basename(paths[i]) for i in (range(num_files) if share is None else share)]
  return storage.local_copy(prepared_dir, names)
