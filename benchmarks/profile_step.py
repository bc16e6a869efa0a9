r"""Where a train step's device time goes: the kernels of a few profiled steps, by total time.

Builds one contender of benchmarks/train_step.py (our step, BERT's recipe), warms it up,
traces `--steps` steps with jax.profiler, and prints the kernels (GPU) or XLA ops (CPU) that
took the most time, grouped by name, with their share of the traced device time. The trace
(TensorBoard's profile plugin or Perfetto read it) stays in --out.

  python benchmarks/profile_step.py --variant postln --size base --seq_len 512 --batch 64
  python benchmarks/profile_step.py --size tiny --seq_len 64 --batch 2        # on a laptop
"""

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top

import train_step  # pylint: disable=g-import-not-at-top


def device_events(trace_dir: str):
  """(name, microseconds) of every complete event on a device track of the trace."""
  path, = glob.glob(os.path.join(trace_dir, 'plugins', 'profile', '*', '*.trace.json.gz'))
  with gzip.open(path) as f:
    trace = json.load(f)
  devices = {e['pid'] for e in trace['traceEvents']
             if e.get('ph') == 'M' and e.get('name') == 'process_name'
             and any(k in str(e.get('args', {}).get('name', '')) for k in ('/device:GPU', '/device:TPU'))}
  if not devices:  # CPU: XLA's ops run on host threads
    devices = {e['pid'] for e in trace['traceEvents'] if e.get('ph') == 'M'
               and e.get('name') == 'process_name'
               and '/host:CPU' in str(e.get('args', {}).get('name', ''))}
  return [(e['name'], e.get('dur', 0)) for e in trace['traceEvents']
          if e.get('ph') == 'X' and e.get('pid') in devices]


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--variant', default='postln')
  p.add_argument('--size', default='base')
  p.add_argument('--seq_len', type=int, default=512)
  p.add_argument('--batch', type=int, default=64)
  p.add_argument('--dtype', default='bfloat16')
  p.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                 help='a model config override, e.g. attention_dropout_rate=0.0')
  p.add_argument('--steps', type=int, default=3)
  p.add_argument('--top', type=int, default=30)
  p.add_argument('--out', default='/tmp/profile_step')
  args = p.parse_args()
  overrides = {}
  for kv in args.set:
    key, value = kv.split('=', 1)
    try:
      overrides[key] = json.loads(value)  # numbers, true/false
    except ValueError:
      overrides[key] = value  # names: cudnn, bfloat16, ...
  step_args = train_step.step_args(args.seq_len, args.batch, args.dtype)
  step_args.fused = overrides.pop('fused_attention', 'auto')
  c = train_step.Ours(args.variant, args.size, step_args, overrides=overrides)
  c.step(3)
  shutil.rmtree(args.out, ignore_errors=True)  # device_events reads the one trace there
  with jax.profiler.trace(args.out):
    c.step(args.steps)
  events = device_events(args.out)
  total = collections.Counter()
  count = collections.Counter()
  for name, dur in events:
    total[name] += dur
    count[name] += 1
  all_us = sum(total.values())
  print(f'{c.name}: {args.size}, length {args.seq_len}, batch {args.batch}, {args.dtype}; '
        f'{args.steps} steps, {all_us / 1e3 / args.steps:.1f} ms of device time per step '
        f'in {len(events) // args.steps} events')
  print('| ms/step | share | calls/step | kernel |\n|---|---|---|---|')
  for name, us in total.most_common(args.top):
    print(f'| {us / 1e3 / args.steps:.2f} | {us / all_us:.1%} | {count[name] / args.steps:g} | '
          f'{name[:110]} |')


if __name__ == '__main__':
  main()
