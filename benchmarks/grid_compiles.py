r"""What a fine-tuning grid compiles: each run's programs compiled and loaded, and the time.

  python benchmarks/grid_compiles.py --tasks rte,wnli --learning_rates 1e-4,3e-4 --seeds 2

Runs `python -m realformer.tools.finetune_grid` once into a fresh root with an empty
compilation cache (the grid's own runs share it, as on a user's machine), then reads each
run's log.txt: the programs it compiled and those it loaded (realformer/train/compile_cache.py,
jax's 1 s threshold), its first step (tracing, compiling or loading, running; trainer.py logs
it where it does) and the span of its log. The encoder is a tiny one made here (2 layers,
width 32) unless --init_checkpoint names a workdir; the data are the GLUE files the tests
ship (tests/data/glue), or --data_dir's.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def tiny_encoder(workdir: str) -> str:
  """A params-only checkpoint of a freshly initialised 2-layer, 32-wide Post-LN encoder."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from configs import pretrain  # pylint: disable=g-import-not-at-top
  from realformer import models  # pylint: disable=g-import-not-at-top
  from realformer.train import checkpoints  # pylint: disable=g-import-not-at-top
  config = pretrain.get_config('postln,tiny')
  config.unlock()
  config.model.num_layers, config.model.hidden_size = 2, 32
  config.model.num_heads, config.model.mlp_dim = 2, 64
  batch = {k: np.zeros((1, 8), np.int32)
           for k in ('input_ids', 'segment_ids', 'attention_mask')}
  params = nn.unbox(models.build(config.model).init(jax.random.PRNGKey(0), batch)['params'])
  checkpoints.save_params(workdir, params, config, step=1)
  return workdir


def seconds(clock: str) -> float:
  hh, mm, ss = clock.split(':')
  return int(hh) * 3600 + int(mm) * 60 + float(ss)


def read_run(log: str) -> dict:
  text = open(log, encoding='utf-8').read()
  clocks = re.findall(r'^[IWE]\d{4} (\d\d:\d\d:\d\d\.\d+)', text, re.M)
  counts = re.findall(r'after the run: (\d+) programs? loaded from it, (\d+) compiled', text)
  first = re.search(r'first step: ([\d.]+) s', text)
  return {'loaded': int(counts[-1][0]), 'compiled': int(counts[-1][1]),
          'first_step': float(first.group(1)) if first else None,
          'span': (seconds(clocks[-1]) - seconds(clocks[0])) % 86400, 'start': clocks[0]}


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--tasks', default='rte,wnli')
  p.add_argument('--learning_rates', default='1e-4,3e-4')
  p.add_argument('--seeds', default='2')
  p.add_argument('--init_checkpoint', default='')
  p.add_argument('--data_dir', default=os.path.join(REPO, 'tests', 'data', 'glue'))
  p.add_argument('--set', action='append', default=['max_seq_length=32', 'length_buckets=0'],
                 help='KEY=VALUE for every run (default: max_seq_length=32, length_buckets=0)')
  args = p.parse_args()
  scratch = tempfile.mkdtemp(prefix='grid_compiles_')
  init = args.init_checkpoint or tiny_encoder(os.path.join(scratch, 'encoder'))
  env = dict(os.environ, REALFORMER_COMPILATION_CACHE=os.path.join(scratch, 'cache'))
  root = os.path.join(scratch, 'grid')
  cmd = [sys.executable, '-m', 'realformer.tools.finetune_grid', '--tasks', args.tasks,
         '--root', root, '--init_checkpoint', init, '--data_dir', args.data_dir,
         '--learning_rates', args.learning_rates, '--batch_sizes', '2', '--epochs', '1',
         '--seeds', args.seeds] + [a for kv in args.set for a in ('--set', kv)]
  start = time.perf_counter()
  subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
  wall = time.perf_counter() - start
  runs = []
  for task in sorted(os.listdir(root)):
    folder = os.path.join(root, task)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
      log = os.path.join(folder, name, 'log.txt')
      if os.path.isfile(log):
        runs.append(dict(read_run(log), run=f'{task}/{name}'))
  runs.sort(key=lambda r: r['start'])
  print('| run | programs compiled | loaded | first step s | log span s |')
  print('|---|---|---|---|---|')
  for r in runs:
    first = '-' if r['first_step'] is None else f'{r["first_step"]:.1f}'
    print(f'| {r["run"]} | {r["compiled"]} | {r["loaded"]} | {first} | {r["span"]:.1f} |')
  later = runs[1:]
  print(f'grid: {len(runs)} runs in {wall:.1f} s; the first compiled {runs[0]["compiled"]}, '
        f'the later ones {sum(r["compiled"] for r in later)} in all; median log span of the '
        f'later runs {statistics.median(r["span"] for r in later):.1f} s')


if __name__ == '__main__':
  main()
