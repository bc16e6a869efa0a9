r"""Parallel preparation: data.prepare with 1 and with N worker processes on the same corpus.

  python benchmarks/prepare_workers.py --scale 10 --workers 1,2 --rounds 2
  python benchmarks/prepare_workers.py --scale 10 --workers 1,2 --document_window 100
  python benchmarks/prepare_workers.py --scale 10 --workers 1,2 --source hf

The embedded corpus written out `--scale` times; each setting prepares it (length 128, blocks
of `--document_window` documents, 1000 by default) in a fresh process, settings alternating
round after round. Blocks are handed to workers in runs of `--blocks_per_file` (run r to
worker r mod W; 1 by default here, the measured runs' dealing, where the default config deals
runs of 8, which a corpus this small cannot spread): the 10x corpus holds only 2,330 documents
(speeches), 3 blocks of 1000, so 2 workers get 2 and 1 blocks; a real corpus (millions of
documents) has thousands, which a smaller window models.
Prints wall seconds, CPU seconds (user + system of the child and its workers), prepared
instances per second, the main process's peak RSS (VmHWM) and the largest worker process's
peak RSS (with one worker, the work runs in the main process), and the bound on all the
processes together (main + workers x the largest worker's peak; the peaks need not coincide),
and checks that every setting prepared the same counts. `--source hf`: the same documents as a local Hugging Face dataset
(parquet, one document per row, its sentences joined by spaces), read through `hf:`, whose
sentences the preparation splits (the files are in BERT's format, one sentence per line).
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import input_pipeline  # pylint: disable=g-import-not-at-top
from benchmarks import machine

CHILD = '''import json, resource, sys
from configs import pretrain
from data import prepare
c = pretrain.get_config("postln,tiny")
c.unlock()
c.data.update(json.loads(sys.argv[1]))
m = prepare.prepare(c, sys.argv[2])
peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
print("RESULT", json.dumps({"counts": m["counts"], "peak_kb": peak,
      "workers_peak_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
'''


def write_hf(corpus: str, out_dir: str) -> str:
  """The documents of a BERT-format corpus as <out_dir>/train-00000-of-00001.parquet."""
  import datasets  # pylint: disable=g-import-not-at-top
  from data import sources  # pylint: disable=g-import-not-at-top
  texts = [' '.join(doc) for doc in sources.iter_documents(f'files:{corpus}')]
  os.makedirs(out_dir)
  datasets.Dataset.from_dict({'text': texts}).to_parquet(
      os.path.join(out_dir, 'train-00000-of-00001.parquet'))
  return f'hf:{out_dir}'


def run(source: str, out_dir: str, workers: int, window: int, blocks_per_file: int):
  data = dict(sources=source, max_seq_length=128, prepare_workers=workers,
              document_window=window, blocks_per_file=blocks_per_file)
  start, before = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
  out = subprocess.run([sys.executable, '-c', CHILD, json.dumps(data), out_dir], cwd=REPO,
                       check=True, capture_output=True, text=True).stdout
  seconds, after = time.time() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
  shutil.rmtree(out_dir)
  result = json.loads(out.rsplit('RESULT', 1)[1])
  result['cpu_seconds'] = cpu
  return seconds, result


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--scale', type=int, default=10)
  p.add_argument('--workers', default='1,2')
  p.add_argument('--rounds', type=int, default=2)
  p.add_argument('--document_window', type=int, default=1000)
  p.add_argument('--blocks_per_file', type=int, default=1)
  p.add_argument('--source', default='files', choices=('files', 'hf'))
  args = p.parse_args()
  print(machine.describe())
  print(f'# {" ".join(sys.argv)}')
  tmp = tempfile.mkdtemp()
  corpus = os.path.join(tmp, 'corpus.txt')
  size = input_pipeline.write_corpus(corpus, args.scale)
  source = (f'files:{corpus}' if args.source == 'files' else
            write_hf(corpus, os.path.join(tmp, 'hf')))
  settings = [int(w) for w in args.workers.split(',')]
  results = {w: [] for w in settings}
  for _ in range(args.rounds):
    for w in settings:
      results[w].append(run(source, os.path.join(tmp, 'out'), w, args.document_window,
                            args.blocks_per_file))
  counts = {json.dumps(r['counts']) for rs in results.values() for _, r in rs}
  assert len(counts) == 1, counts
  n = sum(json.loads(counts.pop()).values())
  print(f'corpus {size / 1e6:.0f} MB ({args.source}), blocks of {args.document_window} '
        f'documents, {n:,} '
        f'instances (train + eval), the same for every setting; median of {args.rounds} rounds')
  print('| workers | seconds | CPU seconds | instances/s | main process peak MiB '
        '| largest worker peak MiB | all processes, at most MiB |')
  print('|---|---|---|---|---|---|---|')
  for w, rs in results.items():
    seconds = statistics.median(s for s, _ in rs)
    cpu = statistics.median(r['cpu_seconds'] for _, r in rs)
    main_peak = statistics.median(r['peak_kb'] for _, r in rs) / 1024
    worker_peak = statistics.median(r['workers_peak_kb'] for _, r in rs) / 1024
    worker = f'{worker_peak:.0f}' if w > 1 else '(in main)'
    # Peaks of different processes need not coincide: main + W x the largest is a bound.
    total = main_peak + (w * worker_peak if w > 1 else 0)
    print(f'| {w} | {seconds:.1f} | {cpu:.1f} | {n / seconds:,.0f} | {main_peak:.0f} '
          f'| {worker} | {total:.0f} |')
  shutil.rmtree(tmp)


if __name__ == '__main__':
  main()
