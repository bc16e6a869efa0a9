"""How many compiles `--find_max_batch` (realformer.tools.launch.find_max_batch) spends, on
memory models shaped as a real search found it, with no compiler: each model is the
quadratic through a v5p search's figures (realformer,large in bfloat16 on v5p:4x4x4,
fsdp=4, length 128; BENCHMARKS.md, 2026-12-02), scaled in the batch, plus a noise of its own
per batch, and optionally the compiler's squeeze near the limit (a program up to 1 GiB over
the line fits, reported just under HBM). Every search must end one unit (64) from its
answer; the figures are the compiles it took, and how many searches needed more than the
command's default --max_compiles (12).

  python benchmarks/batch_search.py [--seeds 8]
"""

import argparse
import hashlib
import os
import statistics
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from configs import pretrain  # pylint: disable=g-import-not-at-top,wrong-import-position
from realformer.tools import launch  # pylint: disable=g-import-not-at-top,wrong-import-position

GiB = launch.GiB
HBM = 95.73  # v5p's usable GiB per chip
# (global batch, GiB per chip) of the real search: compiled totals, and the two refusals'
# temporaries plus the state.
MEASURED = np.array([(1024, 3.76), (26048, 60.99), (42496, 95.57), (62464, 136.2),
                     (82560, 179.3)])
CURVE = np.polyfit(MEASURED[:, 0], MEASURED[:, 1], 2)


def compile_model(noise: float, squeeze: float, seed: int, scale: float):
  """A stand-in for launch.compile_step: its Report for a batch, from the model."""
  def memory(b):
    h = int(hashlib.md5(f'{seed}-{b}'.encode()).hexdigest()[:8], 16) / 2**32
    value = np.polyval(CURVE, b / scale) + noise * (2 * h - 1)
    if squeeze and HBM - 1.5 < value < HBM + squeeze:
      value = min(value, HBM - 0.4 * h)
    return value

  def compile_step(config, target, batch_size=None, **_):
    del target
    b = batch_size or config.train.batch_size
    value = memory(b)
    if value > HBM + 2:
      return launch.Report(batch_size=b, fits=False, refusal='Ran out of memory on HBM',
                           refused_temp_bytes=int((value - 0.9) * GiB)), None
    return launch.Report(batch_size=b, fits=value <= HBM, total_bytes=int(value * GiB),
                         temp_bytes=int((value - 0.9) * GiB), state_bytes=int(0.877 * GiB),
                         code_bytes=int(0.034 * GiB)), object()
  return compile_step


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--seeds', type=int, default=8)
  args = parser.parse_args()
  config = pretrain.get_config('postln,tiny')
  target = launch.Target('model', 'tpu', jax.devices()[:1], 1, 'model', int(HBM * GiB))
  print('| noise GiB | squeeze GiB | searches | compiles: mean | max | over 12 |')
  print('|---|---|---|---|---|---|')
  means = []
  for noise in (0.0, 0.3, 0.8):
    for squeeze in (0.0, 1.0):
      counts = []
      for seed in range(args.seeds):
        for start, scale in ((1024, 1.0), (64, 1.0), (1024, 0.25), (8192, 3.0)):
          launch.compile_step = compile_model(noise, squeeze, seed, scale)
          config.train.batch_size = start
          tried = launch.find_max_batch(config, target, multiple=64, max_compiles=40,
                                        log=lambda *_: None)
          assert launch.search_summary(tried, 64)['converged']
          counts.append(len(tried))
      means.append(statistics.mean(counts))
      print(f'| {noise} | {squeeze} | {len(counts)} | {statistics.mean(counts):.2f} | '
            f'{max(counts)} | {sum(c > 12 for c in counts)} |')
  print(f'mean of the rows: {statistics.mean(means):.2f}')


if __name__ == '__main__':
  main()
