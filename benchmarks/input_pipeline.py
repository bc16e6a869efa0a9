r"""Input pipeline: examples per second on one core, and the peak memory of preparing.

  python benchmarks/input_pipeline.py                 # embedded corpus, lengths 128 and 512
  python benchmarks/input_pipeline.py --scale 10      # + preparing a corpus 10x the embedded

Preparation runs data.prepare.prepare (what `python -m data.prepare` runs) in a child process
on the embedded corpus written out once and `--scale` times, with the default document window
and records per file (1000, 65536) and with small ones (100, 2048) that the 1x corpus already
fills: memory bounded by these limits, not by the corpus, is the point. The peak is the
child's VmHWM (ru_maxrss would also count the parent's pages that the child held before its
exec). Reading is the grain stream of data/pipeline.py (decode, dynamic masking, batching)
pinned to one core, worker_count 0.
"""

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from configs import pretrain  # pylint: disable=g-import-not-at-top
from benchmarks import machine
from data import pipeline
from data import sources
from data import tokenizer as tokenizer_lib


def prepare_in_child(corpus: str, out_dir: str, seq_len: int, window: int, per_file: int):
  """(seconds, peak RSS MiB) of data.prepare.prepare on `corpus` in a fresh process."""
  code = ('import json, sys\n'
          'from configs import pretrain\n'
          'from data import prepare\n'
          'c = pretrain.get_config("postln,tiny")\n'
          'c.unlock()\n'
          'c.data.update(json.loads(sys.argv[1]))\n'
          'c.model.max_len = max(c.data.max_seq_length, 128)\n'
          'prepare.prepare(c, sys.argv[2])\n'
          'print("PEAK_KB", open("/proc/self/status").read().split("VmHWM:")[1].split()[0])')
  data = dict(sources=f'files:{corpus}', max_seq_length=seq_len, document_window=window,
              records_per_file=per_file)
  start = time.time()
  out = subprocess.run([sys.executable, '-c', code, json.dumps(data), out_dir], cwd=REPO,
                       check=True, capture_output=True, text=True).stdout
  return time.time() - start, int(out.rsplit('PEAK_KB', 1)[1].split()[0]) / 1024


def write_corpus(path: str, copies: int):
  with gzip.open(sources.EMBEDDED_CORPUS, 'rb') as f:
    text = f.read()
  with open(path, 'wb') as f:
    for _ in range(copies):
      f.write(text)
  return len(text) * copies


def examples_per_second(prepared_dir: str, seq_len: int, batch: int, seconds: float) -> float:
  config = pretrain.get_config('postln,tiny')
  config.unlock()
  config.data.max_seq_length = seq_len
  config.data.max_predictions_per_seq = {128: 20, 512: 80}[seq_len]  # BERT's settings
  tok = tokenizer_lib.load_for_config(config.data)
  it = pipeline.make_pretraining_iterator(config.data, tok, prepared_dir,
                                          global_batch_size=batch, seed=0)
  next(it)
  n, start = 0, time.time()
  while time.time() - start < seconds:
    next(it)
    n += batch
  return n / (time.time() - start)


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--scale', type=int, default=10)
  p.add_argument('--seconds', type=float, default=10.0)
  p.add_argument('--batch', type=int, default=32)
  args = p.parse_args()
  if hasattr(os, 'sched_setaffinity'):
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
  tmp = tempfile.mkdtemp()
  print(machine.describe())
  print(f'# {" ".join(sys.argv)}')
  print('| prepare | corpus MB | document window | records per file | seconds | peak RSS MiB '
        '| examples |')
  print('|---|---|---|---|---|---|---|')
  prepared = {}
  for copies in sorted({1, args.scale}):
    corpus = os.path.join(tmp, f'corpus_x{copies}.txt')
    size = write_corpus(corpus, copies)
    runs = [(128, 1000, 65536), (128, 100, 2048)]
    runs += [(512, 1000, 65536)] if copies == 1 else []
    for seq_len, window, per_file in runs:
      out = os.path.join(tmp, f'prepared_x{copies}_{seq_len}_{window}')
      seconds, peak = prepare_in_child(corpus, out, seq_len, window, per_file)
      count = pipeline.prepare_lib.read_metadata(out)['counts']['train']
      print(f'| x{copies}, length {seq_len} | {size / 1e6:.0f} | {window} | {per_file} | '
            f'{seconds:.0f} | {peak:.0f} | {count:,} |')
      prepared[(copies, seq_len, window)] = out
    os.remove(corpus)
  print('\nPreparation holds at most data.document_window + 1 documents and, in its shard '
        'writer, the records of its current file (array_record keeps a few hundred bytes '
        'a record until the file is closed). At the defaults (1000, 65536) neither limit is '
        'reached by the 1x corpus (233 documents, 21k records); with (100, 2048) both are '
        'reached at 1x and 10x alike.')
  print('\n| stream (one core, batch %d) | examples/s |' % args.batch)
  print('|---|---|')
  for seq_len, sizes in ((128, 'tiny and base'), (512, 'base')):
    rate = examples_per_second(prepared[(1, seq_len, 1000)], seq_len, args.batch, args.seconds)
    print(f'| {sizes}, length {seq_len}, {20 if seq_len == 128 else 80} predictions | '
          f'{rate:,.0f} |')
  shutil.rmtree(tmp)


if __name__ == '__main__':
  main()
