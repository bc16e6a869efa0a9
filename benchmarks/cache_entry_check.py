r"""What compile_cache.WholeEntries' read check costs a start: one more decompression of
each program it loads.

  python benchmarks/cache_entry_check.py [FOLDER]

FOLDER is a compilation cache's machine subfolder (default: this machine's under the default
cache, ~/.cache/realformer/xla/<backend>-<hash>, as the default job fills it). For every
entry: its size stored and decompressed, and the median of `--repeats` decompressions
(jax's own decompress_executable, what the check runs); then the entries' total, which is
what a start that loads all of them adds.
"""

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import machine  # pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
from jax._src import compilation_cache as jax_cache  # pylint: disable=g-import-not-at-top,wrong-import-position

from realformer.train import compile_cache  # pylint: disable=g-import-not-at-top,wrong-import-position


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('folder', nargs='?', default=None)
  parser.add_argument('--repeats', type=int, default=9)
  args = parser.parse_args()
  folder = args.folder or compile_cache.folder()
  names = sorted(n for n in os.listdir(folder) if n.endswith('-cache'))
  if not names:
    raise SystemExit(f'no entries in {folder}: run the default job (python train.py) first')
  total_mb = total_ms = 0.0
  print('| entry | stored MB | program MB | check ms |\n|---|---|---|---|')
  for name in names:
    with open(os.path.join(folder, name), 'rb') as f:
      stored = f.read()
    seconds = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      program = jax_cache.decompress_executable(stored)
      seconds.append(time.perf_counter() - start)
    mb, ms = len(program) / 2**20, statistics.median(seconds) * 1e3
    total_mb, total_ms = total_mb + mb, total_ms + ms
    print(f'| {name.split("-")[0]} | {len(stored) / 2**20:.2f} | {mb:.2f} | {ms:.1f} |')
  print(f'| all {len(names)} | | {total_mb:.2f} | {total_ms:.1f} |')
  print(f'{total_ms / total_mb:.1f} ms per MB of program')


if __name__ == '__main__':
  main()
