r"""The train state of a start from a checkpoint: drawing only what the checkpoint lacks,
against drawing every parameter and replacing the restored ones.

  python benchmarks/init_state.py --config postln,base --repeats 3

A fine-tuning start restores the encoder and draws its new head. Both arms here make the
state of the config's pretraining program (on all local devices, no compilation cache) with
every parameter known except the pooler and the NSP head (the arrays a checkpoint would give,
zeros here, made before the clock starts):

  known   Program.init(params): one program that draws the unknown leaves only (XLA drops
          the other draws) and initialises the optimizer, what the trainer runs;
  whole   Program.init() and then the optimizer's init of the replaced params as its own
          program: what the trainer ran before.

Each arm runs in a fresh process (its compiles are part of its time), the arms alternating;
reported: the median seconds of tracing, compiling and running it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import machine  # pylint: disable=g-import-not-at-top,wrong-import-position

ARMS = ('known', 'whole')


def drawn(path: str) -> bool:
  """The leaves a fine-tuning start draws here: the pooler and the NSP head."""
  return 'pooler' in path or 'nsp_head' in path


def one(config_arg: str, arm: str) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from realformer.train import partitioning  # pylint: disable=g-import-not-at-top
  from realformer.train import pretraining  # pylint: disable=g-import-not-at-top
  from configs import pretrain  # pylint: disable=g-import-not-at-top
  config = pretrain.get_config(config_arg)
  config.data.sources = 'synthetic'
  program = pretraining.program(config, partitioning.make_mesh(config.mesh))
  known = jax.tree_util.tree_map_with_path(
      lambda path, a: None if drawn(jax.tree_util.keystr(path)) else jnp.zeros(
          a.shape, a.dtype, device=a.sharding), program.abstract.params)
  jax.block_until_ready(known)
  start = time.perf_counter()
  if arm == 'known':
    state = program.init(known)
  else:
    state = program.init()
    params = jax.tree.map(lambda k, d: d if k is None else k, known, state.params,
                          is_leaf=lambda x: x is None)
    opt_state = jax.jit(program.tx.init, out_shardings=program.shardings.opt_state)(params)
    state = state.replace(params=params, opt_state=opt_state)
  jax.block_until_ready(state)
  return dict(arm=arm, seconds=time.perf_counter() - start,
              drawn=len(jax.tree.leaves(program.abstract.params)) - len(jax.tree.leaves(known)))


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--config', default='postln,base',
                 help="configs/pretrain.py's argument: variant and size")
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--arm', choices=ARMS, help='(internal) one measurement in this process')
  args = p.parse_args()
  if args.arm:
    print(json.dumps(one(args.config, args.arm)))
    return
  print(machine.describe())
  times = {arm: [] for arm in ARMS}
  for _ in range(args.repeats):
    for arm in ARMS:
      out = subprocess.run([sys.executable, os.path.abspath(__file__), '--config', args.config,
                            '--arm', arm], cwd=REPO, capture_output=True, text=True, check=True)
      row = json.loads(out.stdout.strip().splitlines()[-1])
      times[arm].append(row['seconds'])
  print(f'configs/pretrain.py:{args.config}, {row["drawn"]} leaves drawn, median of '
        f'{args.repeats} fresh processes')
  for arm in ARMS:
    print(f'{arm:6s} {statistics.median(times[arm]):7.2f} s   '
          f'({" ".join(f"{t:.2f}" for t in times[arm])})')
  ratio = statistics.median(times['whole']) / statistics.median(times['known'])
  print(f'whole / known: {ratio:.2f}x')


if __name__ == '__main__':
  main()
