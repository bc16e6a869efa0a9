r"""Prepared data in a bucket: what each host copies to its disk before training.

  python benchmarks/host_share.py --hosts 1 4 16 --records_per_file 2048

Prepares the default pretraining corpus (configs/pretrain.py, the embedded speeches) into a
bucket on the tests' GCS server (tests/gcs_server.py: the emulator on 127.0.0.1), then, for
each host count, makes every host's local copy as a start of train.py does
(data.pipeline.ensure_prepared, each host with its own cache folder): the files that hold
the host's share of the records. The `whole` row is every file, what each host copied before
metadata.json counted each file's records. Reports the largest and the total MiB copied and
the median seconds per host. The seconds measure this code path against a single-threaded
Python server on the same machine, not Cloud Storage; the bytes are what any server sends.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from unittest import mock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

from benchmarks import machine  # pylint: disable=g-import-not-at-top,wrong-import-position
from configs import pretrain  # pylint: disable=g-import-not-at-top,wrong-import-position
from data import pipeline  # pylint: disable=g-import-not-at-top,wrong-import-position
from data import prepare  # pylint: disable=g-import-not-at-top,wrong-import-position
from realformer import storage  # pylint: disable=g-import-not-at-top,wrong-import-position
from tests.gcs_server import gcs_server  # pylint: disable=g-import-not-at-top,wrong-import-position


def _copied(folder: str) -> int:
  return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
             if not n.startswith('.'))


def host_copies(config, hosts: int, scratch: str):
  """(bytes, seconds) of each host's copy, hosts in a row on this machine."""
  out = []
  for index in range(hosts):
    os.environ['REALFORMER_CACHE'] = os.path.join(scratch, f'{hosts}-{index}')
    with mock.patch.object(jax, 'process_index', lambda index=index: index), \
        mock.patch.object(jax, 'process_count', lambda: hosts):
      t = time.perf_counter()
      folder = pipeline.ensure_prepared(config, scratch)
      out.append((_copied(folder), time.perf_counter() - t))
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--hosts', type=int, nargs='+', default=[1, 4, 16])
  p.add_argument('--records_per_file', type=int, default=2048)
  args = p.parse_args()
  print(machine.describe())
  config = pretrain.get_config()
  config.data.records_per_file = args.records_per_file
  with gcs_server() as bucket, tempfile.TemporaryDirectory() as scratch:
    config.data.prepared_dir = f'{bucket}/prepared'
    metadata = prepare.prepare(config, config.data.prepared_dir)
    names = [prepare.METADATA] + [os.path.basename(q) for split in prepare.SPLITS for q in
                                  prepare.shard_paths(config.data.prepared_dir, split,
                                                      metadata['files'][split])]
    os.environ['REALFORMER_CACHE'] = os.path.join(scratch, 'whole')
    t = time.perf_counter()
    whole = _copied(storage.local_copy(config.data.prepared_dir, names)), time.perf_counter() - t
    print(f'{metadata["counts"]["train"]} training records in {metadata["files"]["train"]} '
          f'files of up to {args.records_per_file} records ({whole[0] / 2**20:.1f} MiB with '
          'the eval split)')
    print('| hosts | MiB copied by the largest share | MiB copied, all hosts | '
          's per host (median) |\n|---|---|---|---|')
    mib = whole[0] / 2**20
    print(f'| whole (each host; before) | {mib:.1f} | {mib:.1f} x hosts | {whole[1]:.2f} |')
    for hosts in args.hosts:
      copies = host_copies(config, hosts, scratch)
      print(f'| {hosts} | {max(b for b, _ in copies) / 2**20:.1f} | '
            f'{sum(b for b, _ in copies) / 2**20:.1f} | '
            f'{statistics.median(s for _, s in copies):.2f} |')


if __name__ == '__main__':
  main()
