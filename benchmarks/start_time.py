r"""Time to the first training step, with the persistent compilation cache cold and warm.

  python benchmarks/start_time.py --config configs/pretrain.py:postln,base --repeats 2

Each repeat runs train.py twice in fresh workdirs: once with an empty cache folder (cold),
once with the folder the cold run filled (warm). Reported per arm: seconds from the process's
start to the end of its first step (the log line that counts the cache's programs), and the
whole process, as medians; synthetic data (no preparation), one step, no evaluation.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from realformer.train import machine  # pylint: disable=g-import-not-at-top,wrong-import-position


def run_once(config: str, cache: str, batch: int, extra) -> dict:
  workdir = tempfile.mkdtemp(prefix='start_time_')
  args = [sys.executable, 'train.py', f'--workdir={workdir}', f'--config={config}',
          f'--compilation_cache={cache}', '--config.data.sources=synthetic',
          '--config.train.num_steps=1', '--config.train.eval_steps=0',
          f'--config.train.batch_size={batch}', *extra]
  start = time.time()
  proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
  whole = time.time() - start
  shutil.rmtree(workdir, ignore_errors=True)
  if proc.returncode:
    raise SystemExit(proc.stderr[-3000:])
  line = next(l for l in proc.stderr.splitlines() if 'programs loaded from it' in l)
  hh, mm, ss = map(float, re.search(r' (\d\d):(\d\d):(\d\d\.\d+) ', line).groups())
  first = hh * 3600 + mm * 60 + ss
  t0 = time.localtime(start)
  started = t0.tm_hour * 3600 + t0.tm_min * 60 + t0.tm_sec + start % 1
  loaded = int(line.split(' programs loaded from it')[0].split()[-1])
  return {'first_step': (first - started) % 86400, 'whole': whole, 'loaded': loaded}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--config', default='configs/pretrain.py:postln,base')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--repeats', type=int, default=2)
  args, extra = parser.parse_known_args()
  print(machine.describe())
  arms = {'cold': [], 'warm': []}
  for _ in range(args.repeats):
    cache = tempfile.mkdtemp(prefix='start_time_cache_')
    arms['cold'].append(run_once(args.config, cache, args.batch, extra))
    arms['warm'].append(run_once(args.config, cache, args.batch, extra))
    shutil.rmtree(cache, ignore_errors=True)
  print(f'{args.config}, batch {args.batch}, synthetic data, 1 step; medians of '
        f'{args.repeats}')
  print('| cache | to the first step (s) | whole process (s) | programs loaded |')
  print('|---|---|---|---|')
  for arm, runs in arms.items():
    med = lambda k: statistics.median(r[k] for r in runs)
    print(f'| {arm} | {med("first_step"):.1f} | {med("whole"):.1f} | {med("loaded"):.0f} |')
  cold = statistics.median(r['first_step'] for r in arms['cold'])
  warm = statistics.median(r['first_step'] for r in arms['warm'])
  print(f'warm / cold time to the first step: {warm / cold:.2f}')


if __name__ == '__main__':
  main()
