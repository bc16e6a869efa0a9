"""The flash kernel's tiles: each of its three kernels alone, over a grid of tilings.

realformer/layers/flash_attention.py runs three Pallas kernels (forward; dK and dV; dQ), each
at a `Tiling(block_q, block_c, num_warps, num_stages)` (`default_tilings` picks them). This
times each kernel alone at BERT-base's attention (12 heads of 64, bfloat16, attention dropout
0.1, sequences of T/2 to T real tokens) at the shapes of the device suite's steps, length 512
at batch 64 and 128 at batch 256, for every tiling of a grid, and checks each against the
default tiling: the same mask bit for bit, outputs and gradients within bfloat16's rounding.
For scale it also times the whole attention, forward and backward, at the default tilings, at
the fastest tiling of each kernel, and through cuDNN's fused kernel without dropout (what a
tuned kernel that draws no mask takes).

The tilings compile in parallel threads (Triton's compiler, inside XLA, runs outside
Python's lock); once every compile of a length is done (none competes with the timing for
the host), they are timed one at a time, the default first, the reference the others are
checked against. A tiling that fails to compile or to run is a row with its error. Results
go to `--out` (flash_tiles.json, flash_tiles.md) after each length, so a run stopped by
`--budget_s` keeps what it timed.

    python benchmarks/flash_tiles.py --out results/       # one GPU: about 2 minutes
    python benchmarks/flash_tiles.py --smoke --out /tmp/t  # any CPU: Pallas's interpreter, tiny
"""

import argparse
import concurrent.futures
import itertools
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

# pylint: disable=protected-access  (it times the module's kernels one by one)
from benchmarks import machine  # pylint: disable=g-import-not-at-top
from realformer.layers import flash_attention as flash_lib  # pylint: disable=g-import-not-at-top
from realformer.model import attention as attn_lib  # pylint: disable=g-import-not-at-top

Tiling = flash_lib.Tiling
KERNELS = ('forward', 'dkv', 'dq')
RATE = 0.1


def shapes(smoke: bool):
  """(batch, length, heads, head_dim) of each measured shape."""
  if smoke:
    return [(2, 32, 2, 16)]
  return [(64, 512, 12, 64), (256, 128, 12, 64)]


def candidates(kernel: str, default: Tiling, length: int, smoke: bool):
  """The default tiling first, then the grid (Triton's dots need 16 or more a side)."""
  if smoke:
    grid = [Tiling(8, 2), Tiling(16, 4)]
  else:
    block_qs = {'forward': (64, 128), 'dkv': (16, 32, 64, 128), 'dq': (32, 64, 128)}[kernel]
    grid = [Tiling(q, c, w, s) for q, c, w, s in itertools.product(
        block_qs, (16, 32), (4, 8), (2, 3)) if q <= length and 4 * c <= length]
  return [default] + [t for t in grid if t != default]


def make_inputs(batch, length, heads, head_dim):
  rng = np.random.default_rng(0)
  q, k, v, dout = (jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.bfloat16)
                   for _ in range(4))
  real = rng.integers(length // 2, length + 1, size=batch)
  bias = jnp.asarray(np.where(np.arange(length)[None] < real[:, None], 0.0, attn_lib.NEG_INF),
                     jnp.float32)
  key = jax.random.key_data(jax.random.PRNGKey(1)).astype(jnp.uint32)
  return q, k, v, dout, bias, key


def kernel_fns(q, k, v, dout, bias, key, pad_to: flash_lib.Tilings, first: Tiling,
               interpret: bool):
  """{kernel: (function of a Tiling -> jitted callable, its arguments)} at these inputs,
  padded for the tiles of `pad_to`; the backward's inputs from the forward at `first`."""
  ops, d = flash_lib.kernel_inputs(q, k, v, bias, RATE, key, (0, 0, None), pad_to)
  out, _, stats = jax.jit(lambda ops: flash_lib._forward(ops, d, first, interpret))(ops)
  dout = jnp.pad(dout, ((0, 0), (0, ops.q.shape[1] - dout.shape[1]), (0, 0), (0, 0)))
  args = flash_lib._backward_args(ops, out, stats, dout)
  forward = lambda t: jax.jit(lambda ops: flash_lib._forward(ops, d, t, interpret))
  dkv = lambda t: jax.jit(lambda *a: flash_lib._dkv(a, d, t, interpret))
  dq = lambda t: jax.jit(lambda *a: flash_lib._dq(a, d, t, interpret))
  return {'forward': (forward, (ops,)), 'dkv': (dkv, args),
          'dq': (dq, args)}


def time_ms(fn, args, smoke: bool) -> float:
  """Median over blocks of back-to-back calls, each block from its first call to its last
  result, after two warm-up calls."""
  blocks, calls = (2, 1) if smoke else (5, 10)
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(blocks):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls * 1e3)
  return statistics.median(times)


def max_difference(got, want) -> float:
  """Largest |got - want| over the largest |want|, over the outputs that are not the mask."""
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  worst = 0.0
  for g, w in zip(got, want):
    if w.dtype == jnp.uint8:
      continue
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    worst = max(worst, float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30)))
  return worst


def mask_equal(got, want):
  """Whether the forward's mask equals the reference's; None for the backward kernels."""
  masks = [(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))
           if w.dtype == jnp.uint8]
  return all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in masks) if masks else None


def whole_attention_ms(q, k, v, dout, bias, key, tilings, interpret, smoke) -> float:
  """Forward and backward of flash_attention at `tilings`."""
  def f(q, k, v):
    out, vjp = jax.vjp(lambda q, k, v: flash_lib.flash_attention(
        q, k, v, bias, dropout_rate=RATE, dropout_key=key, interpret=interpret,
        tilings=tilings), q, k, v)
    return out, vjp(dout)
  return time_ms(jax.jit(f), (q, k, v), smoke)


def cudnn_ms(q, k, v, dout, bias, smoke) -> float:
  """cuDNN's fused attention, forward and backward, without dropout, with the padding bias
  broadcast as realformer/model/attention.py passes it."""
  full_bias = jnp.broadcast_to(bias[:, None, None, :].astype(q.dtype),
                               (q.shape[0], 1, q.shape[1], k.shape[1]))

  def f(q, k, v):
    out, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, bias=full_bias, implementation='cudnn'), q, k, v)
    return out, vjp(dout)
  return time_ms(jax.jit(f), (q, k, v), smoke)


def measure_shape(shape, smoke: bool, interpret: bool, deadline: float, workers: int,
                  log) -> dict:
  batch, length, heads, head_dim = shape
  q, k, v, dout, bias, key = make_inputs(batch, length, heads, head_dim)
  default = flash_lib.default_tilings(length, length)
  grid = [(kn, t) for kn in KERNELS for t in candidates(kn, getattr(default, kn), length, smoke)]
  # Inputs padded for the largest tile in the grid, so that every tiling reads the same ones.
  widest = flash_lib.Tilings.same(max(t.block_q for _, t in grid),
                                  max(t.block_c for _, t in grid))
  fns = kernel_fns(q, k, v, dout, bias, key, widest, default.forward, interpret)
  result = {'batch': batch, 'length': length, 'heads': heads, 'head_dim': head_dim,
            'rate': RATE, 'default': {kn: vars(getattr(default, kn)) for kn in KERNELS},
            'rows': []}
  jobs = [(kn, tiling, fns[kn][0](tiling), fns[kn][1]) for kn, tiling in grid]
  log(f'length {length}, batch {batch}: lowering {len(jobs)} kernels')

  def compile_job(job):
    _, _, fn, args = job
    try:
      return fn.trace(*args).lower().compile(), None
    except Exception as e:  # pylint: disable=broad-except
      return None, f'{type(e).__name__}: {str(e).splitlines()[0][:200]}'

  reference = {}
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    futures = [pool.submit(compile_job, job) for job in jobs]
    concurrent.futures.wait(futures, timeout=max(0.0, deadline - time.time()))
    log(f'  compiled {sum(f.done() for f in futures)} of {len(jobs)}')
    for (kn, tiling, _, args), future in zip(jobs, futures):
      row = {'kernel': kn, **vars(tiling), 'default': tiling == getattr(default, kn)}
      if time.time() > deadline or not future.done():
        row['error'] = 'not timed before the deadline'
        result['rows'].append(row)
        continue
      compiled, error = future.result()
      if compiled is not None:
        try:
          outputs = compiled(*args)
          if row['default']:
            reference[kn] = outputs
          if kn in reference:  # else the default failed: nothing to check against
            row['max_difference'] = max_difference(outputs, reference[kn])
            row['mask_equal'] = mask_equal(outputs, reference[kn])
          row['ms'] = time_ms(compiled, args, smoke)
        except Exception as e:  # pylint: disable=broad-except
          error = f'{type(e).__name__}: {str(e).splitlines()[0][:200]}'
      if error:
        row['error'] = error
      result['rows'].append(row)
      log(f'  {kn} {tiling}: ' + (f"{row['ms']:.3f} ms" if 'ms' in row else row['error']))
    for future in futures:
      future.cancel()

  best = {}
  for kn in KERNELS:
    timed = [r for r in result['rows'] if r['kernel'] == kn and 'ms' in r
             and r.get('mask_equal') is not False and r.get('max_difference', 1.0) < 0.02]
    if timed:
      fastest = min(timed, key=lambda r: r['ms'])
      best[kn] = Tiling(*(fastest[f] for f in ('block_q', 'block_c', 'num_warps',
                                                'num_stages')))
  result['best'] = {kn: vars(t) for kn, t in best.items()}
  whole = {}
  timings = [('flash, default tilings', lambda: whole_attention_ms(
      q, k, v, dout, bias, key, default, interpret, smoke))]
  if len(best) == 3:
    timings.append(('flash, fastest tiling of each kernel', lambda: whole_attention_ms(
        q, k, v, dout, bias, key, flash_lib.Tilings(**best), interpret, smoke)))
  if jax.default_backend() == 'gpu':
    timings.append(('cuDNN, no dropout', lambda: cudnn_ms(q, k, v, dout, bias, smoke)))
  for name, timing in timings:
    if time.time() > deadline:
      break
    try:
      whole[name] = timing()
    except Exception:  # pylint: disable=broad-except
      whole[name] = traceback.format_exc(limit=2)[-400:]
  result['whole_ms'] = whole
  return result


def markdown(results: dict) -> str:
  lines = ['# Flash kernel tilings', '', results['machine'], '']
  for shape in results['shapes']:
    lines += [f"## length {shape['length']}, batch {shape['batch']}, {shape['heads']} heads of "
              f"{shape['head_dim']}, dropout {shape['rate']}", '']
    for name, ms in shape.get('whole_ms', {}).items():
      lines.append(f'- forward and backward, {name}: ' +
                   (f'{ms:.3f} ms' if isinstance(ms, float) else str(ms)))
    lines += ['', '| kernel | block_q | block_c | warps | stages | ms | vs default | mask | '
              'max difference |', '|---|---|---|---|---|---|---|---|---|']
    defaults = {r['kernel']: r.get('ms') for r in shape['rows'] if r['default']}
    for kn in KERNELS:
      rows = sorted((r for r in shape['rows'] if r['kernel'] == kn),
                    key=lambda r: r.get('ms', float('inf')))
      for r in rows[:8] + [r for r in rows[8:] if r['default']]:
        tag = ' (default)' if r['default'] else ''
        if 'ms' in r:
          ratio = f"{defaults[kn] / r['ms']:.2f}x" if defaults.get(kn) else ''
          mask = {True: 'same', False: 'DIFFERS', None: '-'}[r.get('mask_equal')]
          diff = f"{r['max_difference']:.1e}" if 'max_difference' in r else 'unchecked'
          lines.append(f"| {kn}{tag} | {r['block_q']} | {r['block_c']} | {r['num_warps']} | "
                       f"{r['num_stages']} | {r['ms']:.3f} | {ratio} | {mask} | {diff} |")
        else:
          lines.append(f"| {kn}{tag} | {r['block_q']} | {r['block_c']} | {r['num_warps']} | "
                       f"{r['num_stages']} | {r['error']} | | | |")
      failed = sum('ms' not in r for r in rows)
      lines.append(f'| {kn}: {len(rows)} tilings, {failed} not timed | | | | | | | | |')
    lines.append('')
  return '\n'.join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--out', default=os.environ.get('OUT') or '/tmp/flash_tiles')
  p.add_argument('--smoke', action='store_true', help="tiny sizes (Pallas's interpreter off GPU)")
  p.add_argument('--budget_s', type=float, default=300.0,
                 help='wall time; tilings not timed by then are rows saying so')
  p.add_argument('--workers', type=int,
                 help='compiling threads (default: the cores less two; 1 in the interpreter)')
  args = p.parse_args()
  start = time.time()
  interpret = jax.default_backend() != 'gpu'
  workers = args.workers or (1 if interpret else max(1, (os.cpu_count() or 2) - 2))
  if interpret and not args.smoke:
    raise SystemExit('flash_tiles: no GPU here (jax backend: '
                     f'{jax.default_backend()}); run with --smoke for the interpreter')
  os.makedirs(args.out, exist_ok=True)
  log = lambda msg: print(f'[{time.time() - start:6.1f} s] {msg}', flush=True)
  results = {'machine': machine.describe(), 'shapes': []}
  for shape in shapes(args.smoke):
    results['shapes'].append(measure_shape(shape, args.smoke, interpret,
                                           start + args.budget_s, workers, log))
    with open(os.path.join(args.out, 'flash_tiles.json'), 'w', encoding='utf-8') as f:
      json.dump(results, f, indent=1)
    with open(os.path.join(args.out, 'flash_tiles.md'), 'w', encoding='utf-8') as f:
      f.write(markdown(results))
  print(markdown(results))


if __name__ == '__main__':
  main()
