r"""A run's log in a bucket: appending by compose against rewriting the object whole.

  python benchmarks/growing_file.py --records 3000 --flush_every 10

Writes `--records` metrics.jsonl-sized lines (about 490 bytes, as a pretraining run's train
record) to a storage.GrowingFile on gs:// on the tests' GCS server (tests/gcs_server.py: the
emulator in memory on 127.0.0.1), forcing an upload every `--flush_every` lines, as a run that
logs every 100 steps and uploads every 30 s would after that many log records. Two arms on the
same lines: `compose` (each upload after the first sends only the new bytes and composes
them onto the object: three requests, the part's upload, the compose and the part's delete)
and `whole` (every upload rewrites the object from the spool, the
previous behaviour: COMPOSE_LIMIT 0). Reports the uploads, all requests, the bytes sent and
the seconds.
The seconds measure this code path against a single-threaded Python server on the same
machine, not Cloud Storage; the bytes are what any server would receive.
"""

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from google.cloud.storage import Blob  # pylint: disable=g-import-not-at-top,wrong-import-position

from benchmarks import machine  # pylint: disable=g-import-not-at-top,wrong-import-position
from realformer import storage  # pylint: disable=g-import-not-at-top,wrong-import-position
from tests.gcs_server import gcs_server  # pylint: disable=g-import-not-at-top,wrong-import-position


def record(step: int) -> str:
  """A train record of about the size pretraining logs."""
  names = ('loss', 'mlm_loss', 'nsp_loss', 'mlm_accuracy', 'nsp_accuracy', 'learning_rate',
           'grad_norm', 'steps_per_sec', 'examples_per_sec', 'tokens_per_sec',
           'tflops_per_device', 'mfu')
  return json.dumps({'step': step, 'split': 'train',
                     **{n: 1.2345678901 * (i + 1) / step for i, n in enumerate(names)}}) + '\n'


def run(url: str, records: int, flush_every: int, compose_limit: int) -> dict:
  sent, other = [], []
  upload, compose, delete = Blob.upload_from_file, Blob.compose, Blob.delete

  def counted(self, file_obj, *args, size=None, **kwargs):
    sent.append(size)
    return upload(self, file_obj, *args, size=size, **kwargs)

  def request(real):
    def call(*args, **kwargs):
      other.append(real.__name__)
      return real(*args, **kwargs)
    return call

  Blob.upload_from_file, Blob.compose, Blob.delete = counted, request(compose), request(delete)
  limit, storage.GrowingFile.COMPOSE_LIMIT = storage.GrowingFile.COMPOSE_LIMIT, compose_limit
  try:
    t = time.perf_counter()
    f = storage.GrowingFile(url, upload_every=3600.0)
    for step in range(1, records + 1):
      f.write(record(step * 100))
      if step % flush_every == 0:
        f.flush(force=True)
    f.close()
    seconds = time.perf_counter() - t
  finally:
    Blob.upload_from_file, Blob.compose, Blob.delete = upload, compose, delete
    storage.GrowingFile.COMPOSE_LIMIT = limit
  size = len(storage.path(url).read_bytes())
  return {'uploads': len(sent), 'requests': len(sent) + len(other), 'bytes_sent': sum(sent),
          'seconds': seconds, 'size': size}


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--records', type=int, default=3000)
  p.add_argument('--flush_every', type=int, default=10)
  args = p.parse_args()
  print(machine.describe())
  with gcs_server() as bucket:
    arms = {'compose': run(f'{bucket}/compose/metrics.jsonl', args.records, args.flush_every,
                           storage.GrowingFile.COMPOSE_LIMIT),
            'whole': run(f'{bucket}/whole/metrics.jsonl', args.records, args.flush_every, 0)}
  assert arms['compose']['size'] == arms['whole']['size']
  print(f'{args.records} records, an upload every {args.flush_every}; the file ends at '
        f'{arms["whole"]["size"] / 2**20:.2f} MiB')
  print('| arm | uploads | requests (uploads, composes, deletes) | MiB sent | seconds |\n'
        '|---|---|---|---|---|')
  for name, r in arms.items():
    print(f'| {name} | {r["uploads"]} | {r["requests"]} | {r["bytes_sent"] / 2**20:.2f} | '
          f'{r["seconds"]:.1f} |')


if __name__ == '__main__':
  main()
