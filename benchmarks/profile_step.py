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


def device_events(trace_dir: str, on_cpu: bool):
  """(name, microseconds) of every complete event on a device track of the trace (on_cpu:
  of the host threads, where a CPU program's ops run)."""
  path, = glob.glob(os.path.join(trace_dir, 'plugins', 'profile', '*', '*.trace.json.gz'))
  with gzip.open(path) as f:
    trace = json.load(f)
  devices = {e['pid'] for e in trace['traceEvents']
             if e.get('ph') == 'M' and e.get('name') == 'process_name'
             and any(k in str(e.get('args', {}).get('name', '')) for k in ('/device:GPU', '/device:TPU'))}
  if not devices and on_cpu:  # XLA's ops run on host threads
    devices = {e['pid'] for e in trace['traceEvents'] if e.get('ph') == 'M'
               and e.get('name') == 'process_name'
               and '/host:CPU' in str(e.get('args', {}).get('name', ''))}
  if not devices:
    raise ValueError(f'the trace in {trace_dir} has no device track')
  return [(e['name'], e.get('dur', 0)) for e in trace['traceEvents']
          if e.get('ph') == 'X' and e.get('pid') in devices]


def top_kernels(trace_dir: str, steps: int, top: int, on_cpu: bool) -> dict:
  """The trace in trace_dir summarised: device milliseconds per step, and the `top` kernels
  by total time as rows (ms per step, share of the device time, calls per step, name).
  on_cpu: the program ran on the CPU, whose ops are the host threads' events."""
  events = device_events(trace_dir, on_cpu)
  total = collections.Counter()
  count = collections.Counter()
  for name, dur in events:
    total[name] += dur
    count[name] += 1
  all_us = sum(total.values()) or 1
  return dict(device_ms_per_step=all_us / 1e3 / steps, events_per_step=len(events) // steps,
              kernels=[(us / 1e3 / steps, us / all_us, count[name] / steps, name[:110])
                       for name, us in total.most_common(top)])


def kernel_table(summary: dict) -> str:
  return '\n'.join(['| ms/step | share | calls/step | kernel |', '|---|---|---|---|'] + [
      f'| {ms:.2f} | {share:.1%} | {calls:g} | {name} |'
      for ms, share, calls, name in summary['kernels']])


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
  import train_step  # pylint: disable=g-import-not-at-top
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
  summary = profile(c, args.out, args.steps, args.top)
  print(f'{c.name}: {args.size}, length {args.seq_len}, batch {args.batch}, {args.dtype}; '
        f'{args.steps} steps, {summary["device_ms_per_step"]:.1f} ms of device time per step '
        f'in {summary["events_per_step"]} events')
  print(kernel_table(summary))


def profile(contender, out: str, steps: int, top: int) -> dict:
  """Traces `steps` steps of a warmed-up contender into `out` (emptied first: device_events
  reads the one trace there) and returns top_kernels' summary."""
  import jax  # pylint: disable=g-import-not-at-top
  shutil.rmtree(out, ignore_errors=True)
  with jax.profiler.trace(out):
    contender.step(steps)
  return top_kernels(out, steps, top, on_cpu=jax.devices()[0].platform == 'cpu')


if __name__ == '__main__':
  main()
