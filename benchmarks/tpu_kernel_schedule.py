"""The TPU flash kernels' static schedules, read from libtpu's compile on any CPU machine.

A Mosaic kernel runs its grid as one loop whose body, one grid step, is a straight run of
VLIW bundles (a bundle issues per cycle; a step that waits on a copy stalls beyond that).
libtpu writes the final schedule of every kernel it compiles where asked
(LIBTPU_INIT_ARGS=--xla_jf_dump_llo_text=true --xla_jf_dump_to=DIR); this compiles the
three kernels of realformer.layers.flash_attention_tpu, forward and backward, for a named
slice at BERT's attention, per chip as flash_attention_on_mesh calls them, and reports for
each kernel the bundles of its loop body x its grid steps: the kernel's cycles before stalls
(less the loop's back-branch and its delay slots, a few bundles a step).
No TPU runs: the figures compare designs of the kernels (tiles, how the mask is drawn),
they are not timings.

    python benchmarks/tpu_kernel_schedule.py                     # v5e:2x2, length 512
    python benchmarks/tpu_kernel_schedule.py --length 128 --batch 8 --topology v5p:2x2x1
    python benchmarks/tpu_kernel_schedule.py --block 128         # another tile

Each variant compiles in a process of its own (libtpu reads its dump settings once). Needs
libtpu (requirements-tpu.txt).
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# variant: (term batch: 0 none, 1 shared, -1 per example; the scores' dtype; a logit scale)
VARIANTS = {
    'plain': (0, None, None),
    'realformer': (-1, 'float32', None),
    'realformer_bf16_carry': (-1, 'bfloat16', None),
    'random_shared_term': (1, None, None),
}
KERNELS = ('forward', 'dkv', 'dq')
# A loop body's bundles in libtpu's final schedule: '<address> [LB]: > { ... }'.
_IN_LOOP = re.compile(r'^\s*(?:0x[0-9a-f]+|\d+)\s+(?:[A-Z]{2})?:\s*>', re.M)


def compile_one(args) -> None:
  """Compiles one variant's kernels (the dump settings are this process's environment)."""
  sys.path.insert(0, ROOT)
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from realformer.layers import flash_attention_tpu  # pylint: disable=g-import-not-at-top
  from realformer.tools import launch  # pylint: disable=g-import-not-at-top

  term_batch, scores_dtype, scale = VARIANTS[args.variant]
  target = launch.tpu_target(args.topology)
  mesh = jax.sharding.Mesh(np.array(target.devices), ('data',))
  n = len(target.devices)
  batch, t, heads = args.batch * n, args.length, args.heads
  data = NamedSharding(mesh, P('data'))
  dtype = None if scores_dtype is None else jnp.dtype(scores_dtype)

  def step(q, k, v, bias, key, term):
    def loss(q, k, v, term):
      result = flash_attention_tpu.flash_attention(
          q, k, v, bias, term=term, logit_scale=scale, scores_dtype=dtype,
          dropout_rate=args.rate, dropout_key=key, block=args.block, group=args.group)
      out, scores = result if dtype is not None else (result, None)
      value = out.astype(jnp.float32).sum()
      return value if scores is None else value + scores.astype(jnp.float32).sum()
    return jax.grad(loss, (0, 1, 2) + ((3,) if term is not None else ()))(q, k, v, term)

  term_spec = None if not term_batch else P() if term_batch == 1 else P('data')
  local = jax.shard_map(step, mesh=mesh, in_specs=(P('data'),) * 4 + (P(), term_spec),
                        out_specs=(P('data'),) * 3 + ((term_spec,) if term_batch else ()),
                        check_vma=False)
  q = jax.ShapeDtypeStruct((batch, t, heads, args.head_dim), jnp.dtype(args.dtype),
                           sharding=data)
  term = None if not term_batch else jax.ShapeDtypeStruct(
      (1 if term_batch == 1 else batch, heads, t, t), dtype or jnp.float32,
      sharding=NamedSharding(mesh, term_spec))
  jax.jit(local).trace(
      q, q, q, jax.ShapeDtypeStruct((batch, t), jnp.float32, sharding=data),
      jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P())),
      term).lower().compile()


def grid_steps(args, variant: str) -> int:
  """Each kernel's grid steps per chip: sequences x groups of heads x query tiles x key
  tiles."""
  block, group = args.block, args.group or 1
  if block is None or args.group is None:
    sys.path.insert(0, ROOT)
    import numpy as np  # pylint: disable=g-import-not-at-top
    from realformer.layers import flash_attention_tpu  # pylint: disable=g-import-not-at-top
    block = block or flash_attention_tpu.tile_for(args.length, args.length)
    term_batch, scores_dtype, _ = VARIANTS[variant]  # (the term in the scores' dtype)
    pairs = flash_attention_tpu.pair_bytes(
        args.dtype, (scores_dtype or 'float32') if term_batch else None, scores_dtype)
    group = args.group or flash_attention_tpu.heads_per_step(
        args.heads, block, args.head_dim, np.dtype(args.dtype).itemsize, pairs)
  tiles = -(-args.length // block)
  return args.batch * args.heads // group * tiles * tiles


def schedule(dump: str, steps: int) -> dict:
  """{kernel: {bundles_per_step, steps, bundles}} from a dump folder's final schedules."""
  found = {}
  for kernel in KERNELS:
    paths = [p for p in glob.glob(os.path.join(dump, f'*flash_attention_tpu_{kernel}_*'
                                                      '-final_bundles.txt'))
             if 'schedule-analysis' not in p]
    if len(paths) != 1:
      raise SystemExit(f'{kernel}: {len(paths)} final schedules in {dump} (want one)')
    with open(paths[0]) as f:
      text = f.read()
    if text.count(' LB:') != 1:
      raise SystemExit(f'{kernel}: {text.count(" LB:")} loops in its schedule; a loop inside '
                       'the grid step makes its bundle count no cycle count')
    per_step = len(_IN_LOOP.findall(text))
    found[kernel] = dict(bundles_per_step=per_step, steps=steps, bundles=per_step * steps)
  return found


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--topology', default='v5e:2x2')
  parser.add_argument('--batch', type=int, default=2, help='sequences per chip')
  parser.add_argument('--length', type=int, default=512)
  parser.add_argument('--heads', type=int, default=12)
  parser.add_argument('--head_dim', type=int, default=64)
  parser.add_argument('--rate', type=float, default=0.1, help='attention dropout')
  parser.add_argument('--dtype', default='bfloat16', help="q, k and v's (model.dtype)")
  parser.add_argument('--block', type=int, default=None,
                      help="the tile (default: the kernel's own, tile_for)")
  parser.add_argument('--group', type=int, default=None,
                      help="heads a grid step computes (default: the kernel's, heads_per_step)")
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--json', help='also write the figures here')
  parser.add_argument('--variant', help=argparse.SUPPRESS)  # (one variant, in a child)
  args = parser.parse_args()
  if args.variant:
    compile_one(args)
    return
  rows = {}
  for variant in args.variants.split(','):
    with tempfile.TemporaryDirectory() as dump:
      env = dict(os.environ, JAX_PLATFORMS='cpu', LIBTPU_INIT_ARGS=(
          f'{os.environ.get("LIBTPU_INIT_ARGS", "")} --xla_jf_dump_llo_text=true '
          f'--xla_jf_dump_to={dump}').strip())
      argv = [f'--{k}={v}' for k, v in vars(args).items()
              if v is not None and k not in ('variants', 'json')]
      subprocess.run([sys.executable, os.path.abspath(__file__), *argv, '--variant', variant],
                     env=env, check=True, stdout=subprocess.DEVNULL)
      rows[variant] = schedule(dump, grid_steps(args, variant))
  print(f'{args.topology}, {args.batch} sequences of {args.length} per chip, {args.heads} heads '
        f'of {args.head_dim}, dropout {args.rate}, tile {args.block or "tile_for"}, heads a step '
        f'{args.group or "heads_per_step"}: bundles '
        'per grid step x steps (the static schedule, per core)')
  for variant, kernels in rows.items():
    cells = [f'{k} {v["bundles_per_step"]} x {v["steps"]}' for k, v in kernels.items()]
    total = sum(v['bundles'] for v in kernels.values())
    print(f'  {variant:<22} {"; ".join(cells)}; total {total}')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == '__main__':
  main()
