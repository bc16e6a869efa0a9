"""A Cloud Storage server for the tests: gcp-storage-emulator (the GCS JSON API, objects in
memory) with object generations and preconditions (tests/gcs_emulator.py) on 127.0.0.1, and
the environment that points every client at it and at nothing else: gcsfs (etils.epath)
through STORAGE_EMULATOR_HOST, tensorstore (Orbax's arrays) through TENSORSTORE_GCS_HTTP_URL
and a test token, google-cloud-storage anonymously; the metadata server that credential
discovery would ask is a closed loopback port."""

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest

BUCKET = 'realformer-test'


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def gcs_server():
  """Yields gs://<bucket> served on a fresh loopback port; the server stops on exit."""
  port = _free_port()
  proc = subprocess.Popen(
      [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    'gcs_emulator.py'), '--port', str(port), '--bucket', BUCKET],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  url = f'http://127.0.0.1:{port}'
  env = {'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url,
         'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'test', 'EPATH_USE_TF': 'false',
         'FSSPEC_GCS': '{"token": "anon"}', 'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',
         'GCE_METADATA_HOST': '127.0.0.1:9', 'GCE_METADATA_IP': '127.0.0.1:9'}
  try:
    deadline = time.time() + 30
    while True:
      try:
        socket.create_connection(('127.0.0.1', port), timeout=1).close()
        break
      except OSError:
        if proc.poll() is not None or time.time() > deadline:
          raise RuntimeError('the GCS test server did not start (pip install '
                             'gcp-storage-emulator)') from None
        time.sleep(0.2)
    with pytest.MonkeyPatch.context() as mp:
      for key, value in env.items():
        mp.setenv(key, value)
      yield f'gs://{BUCKET}'
  finally:
    proc.kill()
    proc.wait()


@pytest.fixture(scope='module')
def gcs():
  with gcs_server() as root:
    yield root
