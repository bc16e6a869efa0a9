r"""Input pipeline: examples per second on one core, and the peak memory of preparing.

  python benchmarks/input_pipeline.py                 # embedded corpus, lengths 128 and 512
  python benchmarks/input_pipeline.py --scale 10      # + preparing a corpus 10x the embedded

Preparation runs `python -m data.prepare` in a child process (its peak RSS is the child's
ru_maxrss) on the embedded corpus written out once and `--scale` times: memory that does not
grow with the corpus is the point. Reading is the grain stream of data/pipeline.py (decode,
dynamic masking, batching) pinned to one core, worker_count 0.
"""

import argparse
import datetime
import gzip
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from configs import pretrain  # pylint: disable=g-import-not-at-top
from data import pipeline
from data import sources
from data import tokenizer as tokenizer_lib


def prepare_in_child(corpus: str, out_dir: str, seq_len: int):
  """(seconds, peak RSS MiB) of `python -m data.prepare` on `corpus` in a fresh process."""
  code = ('import resource, runpy\n'
          'try:\n  runpy.run_module("data.prepare", run_name="__main__")\n'
          'except SystemExit:\n  pass\n'
          'print("PEAK_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)')
  args = ['--config', os.path.join(REPO, 'configs', 'pretrain.py') + ':postln,tiny',
          '--out_dir', out_dir, f'--config.data.sources=files:{corpus}',
          f'--config.data.max_seq_length={seq_len}', f'--config.model.max_len={max(seq_len, 128)}']
  start = time.time()
  out = subprocess.run([sys.executable, '-c', code] + args, cwd=REPO, check=True,
                       capture_output=True, text=True).stdout
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
  print(f'# {datetime.date.today()} {platform.node()} ({os.cpu_count()} cores); '
        f'{" ".join(sys.argv)}')
  print('| what | corpus MB | seconds | peak RSS MiB | examples |')
  print('|---|---|---|---|---|')
  prepared = {}
  for copies in sorted({1, args.scale}):
    corpus = os.path.join(tmp, f'corpus_x{copies}.txt')
    size = write_corpus(corpus, copies)
    for seq_len in ((128, 512) if copies == 1 else (128,)):
      out = os.path.join(tmp, f'prepared_x{copies}_{seq_len}')
      seconds, peak = prepare_in_child(corpus, out, seq_len)
      count = pipeline.prepare_lib.read_metadata(out)['counts']['train']
      print(f'| prepare x{copies}, length {seq_len} | {size / 1e6:.0f} | {seconds:.0f} | '
            f'{peak:.0f} | {count:,} |')
      prepared[(copies, seq_len)] = out
    os.remove(corpus)
  print('\nPreparation holds at most data.document_window + 1 = 1001 documents: the 1x corpus '
        '(233 documents) fits in the window, the larger one fills it.')
  print('\n| stream (one core, batch %d) | examples/s |' % args.batch)
  print('|---|---|')
  for seq_len, sizes in ((128, 'tiny and base'), (512, 'base')):
    rate = examples_per_second(prepared[(1, seq_len)], seq_len, args.batch, args.seconds)
    print(f'| {sizes}, length {seq_len}, {20 if seq_len == 128 else 80} predictions | '
          f'{rate:,.0f} |')
  shutil.rmtree(tmp)


if __name__ == '__main__':
  main()
