r"""Prepares pretraining instances once, streaming, into array_record shards.

  python -m data.prepare --config configs/pretrain.py:postln,tiny --out_dir /tmp/prepared
  python -m data.prepare --config configs/pretrain.py:realformer,base \
      --config.data.sources='tfds:wikipedia/20230601.en;tfds:bookcorpus' \
      --config.data.tokenizer=/data/wiki_30k.model --out_dir gs://bucket/prepared
  python -m data.prepare --config configs/pretrain.py:postln,base \
      --config.data.sources='hf:wikimedia/wikipedia:20231101.en;hf:rojagtap/bookcorpus' \
      --config.data.weights='3;1' --out_dir /data/prepared

train.py calls the same code on first start (into <workdir>/data unless
config.data.prepared_dir is set). Writes train-XXXXX-of-NNNNN and eval-XXXXX-of-NNNNN
array_record shards (one sentence-pair instance per record, unmasked: masking is dynamic)
and metadata.json (counts, skipped items, and the fingerprint of the settings that shaped the
instances). Memory stays bounded: documents stream through a window of
`data.document_window` documents and instances go straight to the shard writers, which start a
new file every `data.records_per_file` records (default 65536: at most ~200 MB in 8 writers).
"""

import collections
import json
import os
import shutil
import time
import zlib

from array_record.python import array_record_module
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from data import pretraining
from data import sources
from data import tokenizer as tokenizer_lib
from realformer import cli

METADATA = 'metadata.json'
SPLITS = ('train', 'eval')


def fingerprint(config) -> dict:
  """The settings that determine the prepared instances (masking is not among them)."""
  d = config.data
  return {'sources': d.sources, 'weights': d.weights, 'tokenizer': d.tokenizer or 'embedded',
          'max_seq_length': d.max_seq_length, 'short_seq_prob': d.short_seq_prob,
          'dupe_factor': d.dupe_factor, 'eval_fraction': d.eval_fraction,
          'num_shards': d.num_shards, 'seed': config.seed,
          **({'hf_text_column': d.get('hf_text_column', 'text')} if 'hf:' in d.sources else {})}


def check_lengths(config):
  if config.data.max_seq_length > config.model.max_len:
    raise ValueError(f'data.max_seq_length={config.data.max_seq_length} exceeds the model\'s '
                     f'positions (model.max_len={config.model.max_len}); lower the first or '
                     'raise the second')


def is_eval_document(index: int, eval_fraction: float) -> bool:
  """A fixed, seed-independent share of documents is held out (hash of the index)."""
  return (zlib.crc32(str(index).encode()) % 1_000_000) < eval_fraction * 1_000_000


def _split_stream(documents, split, eval_fraction):
  for i, doc in enumerate(documents):
    if is_eval_document(i, eval_fraction) == (split == 'eval'):
      yield doc


def _tokenised(documents, tokenizer, stats):
  for doc in documents:
    ids = [tokenizer.encode(s) for s in doc]
    stats['empty_sentences'] += sum(not s for s in ids)  # nothing left after tokenising
    yield [s for s in ids if s]


def shard_paths(prepared_dir: str, split: str, num_shards: int):
  return [os.path.join(prepared_dir, f'{split}-{i:05d}-of-{num_shards:05d}')
          for i in range(num_shards)]


class ShardWriters:
  """`num_shards` array_record writers filled round-robin, each starting a new file after
  `records_per_file` records: a writer holds a few hundred bytes per record written until it
  is closed (about 100 MB per 200k records), so unbounded files would make preparation's
  memory grow with the corpus. `close` names the files {split}-XXXXX-of-NNNNN."""

  def __init__(self, directory: str, split: str, num_shards: int, records_per_file: int):
    self._dir, self._split, self._per_file = directory, split, records_per_file
    self._paths, self._written = [], 0
    self._writers = [self._open(i) for i in range(num_shards)]
    self._counts = [0] * num_shards

  def _open(self, shard: int):
    path = os.path.join(self._dir, f'{self._split}.part-{len(self._paths):05d}-{shard}')
    self._paths.append(path)
    return array_record_module.ArrayRecordWriter(path, 'group_size:1')

  def write(self, record: bytes):
    i = self._written % len(self._writers)
    if self._counts[i] == self._per_file:
      self._writers[i].close()
      self._writers[i], self._counts[i] = self._open(i), 0
    self._writers[i].write(record)
    self._counts[i] += 1
    self._written += 1

  def close(self) -> int:
    """Closes and names the files; returns how many there are."""
    for w in self._writers:
      w.close()
    for path, final in zip(self._paths, shard_paths(self._dir, self._split, len(self._paths))):
      os.rename(path, final)
    return len(self._paths)


def prepare(config, out_dir: str, tokenizer=None, overwrite: bool = True) -> dict:
  """Writes the shards and metadata.json into `out_dir` (atomically); returns the metadata.

  With overwrite=False a preparation that another process finished first is kept (and its
  metadata returned) instead of being replaced.
  """
  check_lengths(config)
  d = config.data
  tokenizer = tokenizer or tokenizer_lib.load_for_config(d)
  tmp = f'{out_dir.rstrip("/")}.tmp-{os.getpid()}'
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  try:
    return _prepare_into(config, tokenizer, tmp, out_dir, overwrite)
  finally:  # nothing half-made is left behind, whatever went wrong
    shutil.rmtree(tmp, ignore_errors=True)


def _prepare_into(config, tokenizer, tmp: str, out_dir: str, overwrite: bool) -> dict:
  d = config.data
  counts, files, stats, start = {}, {}, collections.Counter(), time.time()
  for split in SPLITS:
    split_stats = collections.Counter()
    docs = sources.iter_documents(d.sources, tfds_data_dir=d.tfds_data_dir, stats=split_stats,
                                  weights=d.weights, seed=config.seed,
                                  tfds_text_feature=d.get('tfds_text_feature', 'text'),
                                  hf_text_column=d.get('hf_text_column', 'text'))
    docs = _tokenised(_split_stream(docs, split, d.eval_fraction), tokenizer, split_stats)
    writers = ShardWriters(tmp, split, d.num_shards, d.get('records_per_file', 65536))
    n = 0
    for inst in pretraining.stream_instances(
        docs, max_seq_length=d.max_seq_length, short_seq_prob=d.short_seq_prob,
        dupe_factor=d.dupe_factor, seed=config.seed + (split == 'eval'), stats=split_stats,
        window=d.get('document_window', 1000)):
      writers.write(inst.to_bytes())
      n += 1
    files[split] = writers.close()
    counts[split] = n
    stats.update({f'{split}/{k}': v for k, v in split_stats.items()})
  if stats['eval/documents'] == 1 and counts['eval']:
    logging.warning('the eval split holds one document, so its random-next segments come from '
                    'that same document and eval NSP accuracy means nothing; raise '
                    'data.eval_fraction (now %g) to hold out at least two documents',
                    d.eval_fraction)
  # Each split's pass reads every file: the count of one pass is the corpus's.
  undecodable = max(stats['train/non_utf8_lines'], stats['eval/non_utf8_lines'])
  if undecodable:
    logging.warning('%d lines of config.data.sources=%r are not UTF-8 and were skipped; '
                    'convert the files to UTF-8 (e.g. iconv -f latin1 -t utf-8)', undecodable,
                    d.sources)
  if counts['train'] == 0:
    raise ValueError(f'config.data.sources={d.sources!r} gave no training examples '
                     f'({dict(stats) or "no documents"}); check the files and their format '
                     '(one sentence per line, blank line between documents)')
  metadata = {'counts': counts, 'files': files, 'stats': dict(stats),
              'fingerprint': fingerprint(config),
              'tokenizer_path': tokenizer.path, 'vocab_size': tokenizer.vocab_size,
              'max_seq_length': d.max_seq_length, 'seconds': round(time.time() - start, 1)}
  with open(os.path.join(tmp, METADATA), 'w') as f:
    json.dump(metadata, f, indent=2)
  if os.path.exists(out_dir):
    if not overwrite and os.path.exists(os.path.join(out_dir, METADATA)):
      return read_metadata(out_dir)
    shutil.rmtree(out_dir)
  try:
    os.rename(tmp, out_dir)
  except OSError:  # another process renamed its preparation into place first
    if overwrite or not os.path.exists(os.path.join(out_dir, METADATA)):
      raise
    return read_metadata(out_dir)
  return metadata


def read_metadata(prepared_dir: str, config=None) -> dict:
  path = os.path.join(prepared_dir, METADATA)
  if not os.path.exists(path):
    raise FileNotFoundError(f'{prepared_dir} holds no prepared data ({METADATA} missing); run '
                            '`python -m data.prepare` or let train.py prepare it')
  with open(path) as f:
    metadata = json.load(f)
  if config is not None and metadata['fingerprint'] != fingerprint(config):
    want, have = fingerprint(config), metadata['fingerprint']
    diff = {k: (have.get(k), want[k]) for k in want if have.get(k) != want[k]}
    raise ValueError(f'prepared data in {prepared_dir} was made with other settings '
                     f'(prepared, configured): {diff}; point config.data.prepared_dir '
                     'elsewhere or delete the directory to prepare again')
  return metadata


def main(argv):
  del argv
  print(json.dumps(prepare(flags.FLAGS.config, flags.FLAGS.out_dir), indent=2))


if __name__ == '__main__':
  # Flags are defined only when run as a program: train.py imports this module.
  with cli.config_overrides():
    config_flags.DEFINE_config_file('config', None, 'configs/pretrain.py:<variant>,<size>')
  flags.DEFINE_string('out_dir', None, 'Where to write the shards.')
  flags.mark_flags_as_required(['config', 'out_dir'])
  app.run(lambda argv: cli.run_main(main, argv), flags_parser=cli.parse_flags)
