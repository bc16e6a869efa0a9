"""Where each test's time goes inside its own process: jax's tracing, lowering to MLIR, XLA's
compiles and compilation-cache reads (from jax.monitoring's duration events) and Python's
garbage collection (gc.callbacks); the rest is running the programs, the test's own Python
and the processes it starts. Beside it, the CPU seconds of the test's process and of the
processes it started and reaped (getrusage; a server that a module's fixture stops is
charged to the test it ends after). Wall time that neither spent ("waiting", a lower bound:
a test's threads can spend more CPU than wall time) is sleeps and timeouts, which two
workers on two cores cannot fill, or the work of processes not yet reaped (a server of the
module's, tests/preloaded.py's commands), or the CPU that other processes on the machine
took: read it on a quiet machine. A pytest plugin, then a summary by module:

  PYTHONPATH=benchmarks SUITE_PROFILE=/tmp/profile.jsonl \\
      python -m pytest -q -n 2 -p suite_profile tests          # the README's command, plus this
  python benchmarks/suite_profile.py /tmp/profile.jsonl [--programs N] [--waits N]

The plugin imports jax only once pytest is configured, after tests/conftest.py has set the
platform and XLA's flags. Each worker appends one JSON line per test to $SUITE_PROFILE.
"""

import argparse
import collections
import gc
import json
import os
import resource
import time

import pytest

_EVENTS = {'/jax/core/compile/jaxpr_trace_duration': 'trace',
           '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower',
           # XLA's compile, or a compilation-cache read (whose own event comes inside it)
           '/jax/core/compile/backend_compile_duration': 'backend',
           '/jax/compilation_cache/cache_retrieval_time_sec': 'cache'}
_TOTALS = collections.Counter()
# per test, by program name: [compiles, their seconds, cache loads, their seconds]
_PROGRAMS = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
_LOADED = [False]  # a cache read came inside the XLA compile event that ends next
_GC_START = [None]


def _on_duration(event: str, seconds: float, fun_name: str = '', **_):
  name = _EVENTS.get(event)
  if name:
    _TOTALS[name] += seconds
    _TOTALS['n_' + name] += 1
    if name == 'cache':
      _LOADED[0] = True
    elif name == 'backend':
      counts = _PROGRAMS[fun_name]
      counts[2 * _LOADED[0]] += 1
      counts[2 * _LOADED[0] + 1] += seconds
      _LOADED[0] = False


def _on_gc(phase: str, _):
  if phase == 'start':
    _GC_START[0] = time.perf_counter()
  elif _GC_START[0] is not None:
    _TOTALS['gc'] += time.perf_counter() - _GC_START[0]


def pytest_configure(config):  # pylint: disable=unused-argument
  from jax._src import monitoring  # pylint: disable=g-import-not-at-top
  monitoring.register_event_duration_secs_listener(_on_duration)
  gc.callbacks.append(_on_gc)


def _cpu_seconds() -> tuple[float, float]:
  """(this process's, its waited-for children's) user + system CPU seconds."""
  return tuple(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # pylint: disable=unused-argument
  before, start = collections.Counter(_TOTALS), time.perf_counter()
  cpu = _cpu_seconds()
  _PROGRAMS.clear()
  yield
  row = dict(test=item.nodeid, wall=time.perf_counter() - start, end=time.time(),
             worker=os.environ.get('PYTEST_XDIST_WORKER', 'main'))
  row['cpu'], row['children_cpu'] = (b - a for a, b in zip(cpu, _cpu_seconds()))
  row.update({k: _TOTALS[k] - before[k] for k in _TOTALS})
  row['programs'] = dict(_PROGRAMS)
  with open(os.environ.get('SUITE_PROFILE', 'suite_profile.jsonl'), 'a',
            encoding='utf-8') as f:
    f.write(json.dumps(row) + '\n')


COLUMNS = ('wall', 'trace', 'lower', 'compile', 'cache', 'gc', 'rest', 'cpu', 'children',
           'waiting')


def _waiting(row: dict) -> float:
  """Wall seconds of a test that neither its process nor its children spent on a CPU (0 for
  rows of a plugin that did not record CPU seconds)."""
  if 'cpu' not in row:
    return 0.0
  return max(0.0, row['wall'] - row['cpu'] - row['children_cpu'])


def by_module(path: str) -> dict[str, collections.Counter]:
  """{module: seconds of each column, and 'tests'}, the whole run as 'all'."""
  modules = collections.defaultdict(collections.Counter)
  with open(path, encoding='utf-8') as f:
    for row in map(json.loads, f):
      t = collections.Counter(row)
      seconds = dict(wall=t['wall'], trace=t['trace'], lower=t['lower'],
                     compile=t['backend'] - t['cache'], cache=t['cache'], gc=t['gc'])
      seconds['rest'] = t['wall'] - sum(v for k, v in seconds.items() if k != 'wall')
      seconds.update(cpu=t['cpu'], children=t['children_cpu'], waiting=_waiting(row))
      for name in (row['test'].split('::')[0].split('/')[-1].removesuffix('.py'), 'all'):
        modules[name].update(seconds)
        modules[name]['tests'] += 1
  return modules


def by_program(path: str) -> dict[str, list]:
  """{program name: [compiles, their seconds, cache loads, their seconds]}, the whole run."""
  programs = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
  with open(path, encoding='utf-8') as f:
    for row in map(json.loads, f):
      for name, counts in row.get('programs', {}).items():
        programs[name] = [a + b for a, b in zip(programs[name], counts)]
  return programs


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('jsonl', help='the file the plugin wrote ($SUITE_PROFILE)')
  p.add_argument('--programs', type=int, default=0,
                 help='also list the N programs that took the most compile seconds')
  p.add_argument('--waits', type=int, default=0,
                 help='also list the N tests with the most wall time spent on no CPU')
  args = p.parse_args()
  if args.waits:
    with open(args.jsonl, encoding='utf-8') as f:
      rows = sorted(map(json.loads, f), key=lambda r: -_waiting(r))
    print('| test | wall s | cpu s | children s | waiting s |\n|---|---|---|---|---|')
    for r in rows[:args.waits]:
      print(f'| {r["test"]} | {r["wall"]:.1f} | {r.get("cpu", 0):.1f} | '
            f'{r.get("children_cpu", 0):.1f} | {_waiting(r):.1f} |')
    print()
  if args.programs:
    print('| program | compiles | s | cache loads | s |\n|---|---|---|---|---|')
    programs = sorted(by_program(args.jsonl).items(), key=lambda kv: -kv[1][1])
    for name, (n, seconds, loads, load_s) in programs[:args.programs]:
      print(f'| {name} | {n} | {seconds:.0f} | {loads} | {load_s:.0f} |')
    print()
  modules = by_module(args.jsonl)
  print('| module | tests | ' + ' | '.join(f'{c} s' for c in COLUMNS) + ' |')
  print('|---' * (len(COLUMNS) + 2) + '|')
  for name, s in sorted(modules.items(), key=lambda kv: -kv[1]['wall']):
    print(f'| {name} | {s["tests"]} | ' + ' | '.join(f'{s[c]:.0f}' for c in COLUMNS) + ' |')


if __name__ == '__main__':
  main()
