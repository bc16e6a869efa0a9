r"""Times one dropout mask: flax.linen.Dropout against realformer.layers.dropout.Dropout.

  python benchmarks/dropout_masks.py                      # BERT-base attention probabilities
  python benchmarks/dropout_masks.py --shape 8,128,768    # a hidden-state mask

Each contender is a jitted x -> dropout(x) at rate 0.1 under the same threefry key (and,
for ours, also under an unsafe_rbg key); the table gives the median over --repeats calls.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # pylint: disable=g-import-not-at-top
import jax
import jax.numpy as jnp

from realformer.layers import dropout as dropout_lib
from benchmarks import machine


def median_seconds(f, args, repeats):
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--shape', default='8,12,128,128')
  p.add_argument('--rate', type=float, default=0.1)
  p.add_argument('--repeats', type=int, default=9)
  args = p.parse_args()
  shape = tuple(int(d) for d in args.shape.split(','))
  x = jnp.ones(shape, jnp.float32)

  def jitted(module):
    return jax.jit(lambda key, x: module.apply({}, x, False, rngs={'dropout': key}))

  contenders = [
      ('flax.linen.Dropout (threefry)', jitted(nn.Dropout(args.rate)), jax.random.PRNGKey(0)),
      ('realformer.layers.dropout (threefry)', jitted(dropout_lib.Dropout(args.rate)),
       jax.random.PRNGKey(0)),
      ('realformer.layers.dropout (unsafe_rbg)', jitted(dropout_lib.Dropout(args.rate)),
       jax.random.key(0, impl='unsafe_rbg')),
  ]
  print(machine.describe())
  print(f'# mask {shape}, rate {args.rate}, median of {args.repeats}')
  print('| contender | ms | vs flax |\n|---|---|---|')
  base = None
  for name, f, key in contenders:
    s = median_seconds(f, (key, x), args.repeats)
    base = base or s
    print(f'| {name} | {s * 1e3:.1f} | {s / base:.2f} |')


if __name__ == '__main__':
  main()
