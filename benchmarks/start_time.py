r"""Time to the first training step: a fresh run with the persistent compilation cache cold
and warm, and a resume.

  python benchmarks/start_time.py --config configs/pretrain.py:postln,base --repeats 2
  python benchmarks/start_time.py --config configs/pretrain.py:postln,base --prepared

Each repeat runs train.py three times, two steps each with a checkpoint after every step: in
a fresh workdir with an empty cache folder (cold); in another fresh workdir with the folder the
cold run filled (warm); and in the cold run's workdir again, its step-2 checkpoint removed
(resume: the same command after a preemption, restoring step 1, with the cache warm).
Reported per arm: seconds from the process's start to the end of its first step (the log line
that counts the cache's programs), the first step alone (trainer.py's log: tracing, compiling
or loading, and running it), and the whole process, as medians; no evaluation. Synthetic data by default; --prepared first prepares the config's
corpus once (`python -m data.prepare`, not timed) and every run reads it.
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


def run_once(config: str, cache: str, batch: int, extra, workdir: str,
             data=('--config.data.sources=synthetic',)) -> dict:
  args = [sys.executable, 'train.py', f'--workdir={workdir}', f'--config={config}',
          f'--compilation_cache={cache}', *data, '--config.train.num_steps=2',
          '--config.train.checkpoint_every_steps=1', '--config.train.eval_steps=0',
          f'--config.train.batch_size={batch}', *extra]
  start = time.time()
  proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
  whole = time.time() - start
  if proc.returncode:
    raise SystemExit(proc.stderr[-3000:])
  line = next(l for l in proc.stderr.splitlines() if ' loaded from it' in l)
  hh, mm, ss = map(float, re.search(r' (\d\d):(\d\d):(\d\d\.\d+) ', line).groups())
  first = hh * 3600 + mm * 60 + ss
  t0 = time.localtime(start)
  started = t0.tm_hour * 3600 + t0.tm_min * 60 + t0.tm_sec + start % 1
  loaded = int(re.split(r' programs? loaded from it', line)[0].split()[-1])
  compile_s = float(re.search(r'first step: ([\d.]+) s', proc.stderr).group(1))
  return {'first_step': (first - started) % 86400, 'compile': compile_s, 'whole': whole,
          'loaded': loaded}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--config', default='configs/pretrain.py:postln,base')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--repeats', type=int, default=2)
  parser.add_argument('--prepared', action='store_true',
                      help="prepare the config's corpus once and train from it")
  args, extra = parser.parse_known_args()
  print(machine.describe())
  scratch = tempfile.mkdtemp(prefix='start_time_')
  data = ('--config.data.sources=synthetic',)
  if args.prepared:
    prepared = os.path.join(scratch, 'prepared')
    subprocess.run([sys.executable, '-m', 'data.prepare', f'--config={args.config}',
                    f'--out_dir={prepared}', *extra], cwd=REPO, check=True, capture_output=True)
    data = (f'--config.data.prepared_dir={prepared}',)
  arms = {'cold': [], 'warm': [], 'resume': []}
  for i in range(args.repeats):
    cache = os.path.join(scratch, f'cache{i}')
    first, other = os.path.join(scratch, f'run{i}'), os.path.join(scratch, f'warm{i}')
    run = lambda workdir: run_once(args.config, cache, args.batch, extra, workdir, data)
    arms['cold'].append(run(first))
    arms['warm'].append(run(other))
    shutil.rmtree(os.path.join(first, 'checkpoints', '2'))  # as if preempted after step 1
    arms['resume'].append(run(first))
  shutil.rmtree(scratch, ignore_errors=True)
  print(f'{args.config}, batch {args.batch}, '
        f'{"prepared" if args.prepared else "synthetic"} data, 2 steps; medians of '
        f'{args.repeats}')
  print('| cache | to the first step (s) | the first step alone (s) | whole process (s) | '
        'programs loaded |')
  print('|---|---|---|---|---|')
  for arm, runs in arms.items():
    med = lambda k: statistics.median(r[k] for r in runs)
    print(f'| {arm} | {med("first_step"):.1f} | {med("compile"):.1f} | {med("whole"):.1f} | '
          f'{med("loaded"):.0f} |')
  cold = statistics.median(r['first_step'] for r in arms['cold'])
  warm = statistics.median(r['first_step'] for r in arms['warm'])
  print(f'warm / cold time to the first step: {warm / cold:.2f}')


if __name__ == '__main__':
  main()
