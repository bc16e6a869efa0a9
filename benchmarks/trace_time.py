r"""What every start pays before it can compile or load its train step: tracing the step
and lowering it to StableHLO, with the layers unrolled and scanned.

  python benchmarks/trace_time.py --config configs/pretrain.py:postln,base --repeats 3 \
      [--target v5p:2x2x1] [--fused_attention flash]

The persistent compilation cache keys a program by its lowered text, so a warm start traces
and lowers as a cold one does; neither depends on the accelerator (it is Python and MLIR on
the host), so this machine's figures stand for a GPU host's up to the processors' speed.
For each `model.scan_layers` setting, the median over `--repeats` fresh traces (jax's trace
caches cleared between them) of `train_step.trace(...)` and of `.lower()`, for the step the
launch check builds on one local device (train.py's step: the same model, loss and update).
"""

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import machine  # pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

from realformer import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from realformer.layers import flash_attention as flash_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from realformer.tools import launch  # pylint: disable=g-import-not-at-top,wrong-import-position
from realformer.train import train_lib  # pylint: disable=g-import-not-at-top,wrong-import-position


def trace_and_lower(config, target) -> tuple:
  """(seconds tracing, seconds lowering) of one fresh trace of the config's train step for
  the target's devices."""
  jax.clear_caches()
  mesh, program, batch = launch.build(config, target, config.train.batch_size)
  # (as the launch check compiles it: the flash kernels' tiles for the target's card)
  with jax.set_mesh(mesh), flash_lib.compiling_for(target.devices):
    start = time.perf_counter()
    traced = program.train_step.trace(program.abstract, batch,
                                      *train_lib.abstract_step_arguments(mesh))
    traced_at = time.perf_counter()
    traced.lower()
    return traced_at - start, time.perf_counter() - traced_at


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--config', default='configs/pretrain.py:postln,base')
  parser.add_argument('--seq_len', type=int, default=128)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--dtype', default='bfloat16')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--target', default='local',
                      help="local, or a target of train.py's --compile_for (v5p:2x2x1, ...)")
  parser.add_argument('--fused_attention', default='auto', help='model.fused_attention')
  args = parser.parse_args()
  base = cli.load_config(args.config)
  target = (launch.local_target() if args.target == 'local' else
            launch.target_for(args.target))
  print(f'{args.config}, length {args.seq_len}, batch {args.batch}, {args.dtype}, '
        f'fused_attention={args.fused_attention}, for {args.target}, jax {jax.__version__}, '
        f'median of {args.repeats}\n')
  print('| layers | trace s | lower s |\n|---|---|---|')
  for scan in (False, True):
    c = base.copy_and_resolve_references()
    c.unlock()
    c.model.scan_layers, c.model.dtype = scan, args.dtype
    c.model.fused_attention = args.fused_attention
    c.data.sources = 'synthetic'
    c.data.max_seq_length = args.seq_len
    c.data.max_predictions_per_seq = max(1, round(args.seq_len * 20 / 128))
    c.train.batch_size = args.batch
    runs = [trace_and_lower(c, target) for _ in range(args.repeats)]
    print(f'| {"scanned" if scan else "unrolled"} | '
          f'{statistics.median(r[0] for r in runs):.2f} | '
          f'{statistics.median(r[1] for r in runs):.2f} |', flush=True)


if __name__ == '__main__':
  main()
