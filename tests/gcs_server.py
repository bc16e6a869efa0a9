"""A Cloud Storage server for the tests: gcp-storage-emulator (the GCS JSON API, objects in
memory) with object generations and preconditions (tests/gcs_emulator.py) on 127.0.0.1, and
the environment that points every client at it and at nothing else: gcsfs (etils.epath) and
google-cloud-storage (anonymously) through STORAGE_EMULATOR_HOST, tensorstore (Orbax's arrays)
through the TENSORSTORE_GCS_HTTP_URL that realformer.storage derives from it (as a user's run
gets it) and a test token; the metadata server that credential discovery would ask is a closed
loopback port."""

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest

BUCKET = 'realformer-test'


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class GcsServer:
  """The server as a process on a fixed loopback port: start() and stop() (a restart keeps the
  objects when they live in `data_dir`, else they are lost with the process)."""

  def __init__(self, data_dir: str = ''):
    self.port, self.data_dir, self._proc = free_port(), data_dir, None
    self.root = f'gs://{BUCKET}'
    url = f'http://127.0.0.1:{self.port}'
    self.env = {'STORAGE_EMULATOR_HOST': url,
                'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'test', 'EPATH_USE_TF': 'false',
                'FSSPEC_GCS': '{"token": "anon"}', 'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',
                'GCE_METADATA_HOST': '127.0.0.1:9', 'GCE_METADATA_IP': '127.0.0.1:9'}

  def start(self):
    self._proc = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      'gcs_emulator.py'), '--port', str(self.port),
         '--bucket', BUCKET, '--data_dir', self.data_dir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while True:
      try:
        socket.create_connection(('127.0.0.1', self.port), timeout=1).close()
        return
      except OSError:
        if self._proc.poll() is not None or time.time() > deadline:
          self.stop()
          raise RuntimeError('the GCS test server did not start (pip install '
                             'gcp-storage-emulator)') from None
        time.sleep(0.2)

  def stop(self):
    if self._proc is not None:
      self._proc.kill()
      self._proc.wait()
      self._proc = None


@contextlib.contextmanager
def gcs_server(data_dir: str = ''):
  """Yields gs://<bucket> served on a fresh loopback port, with the environment pointing
  every client at it; the server stops on exit."""
  server = GcsServer(data_dir)
  server.start()
  try:
    with pytest.MonkeyPatch.context() as mp:
      for key, value in server.env.items():
        mp.setenv(key, value)
      yield server.root
  finally:
    server.stop()


@pytest.fixture(scope='module')
def gcs():
  with gcs_server() as root:
    yield root
