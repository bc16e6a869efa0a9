"""Where a run's files live: a local folder, or a Cloud Storage URL (gs://bucket/path).

Paths go through etils.epath. For gs:// it uses gcsfs, not TensorFlow's tf.io.gfile (which
epath would pick whenever TensorFlow is installed: that would import TensorFlow into every run
and ignore STORAGE_EMULATOR_HOST, so nothing could test it): EPATH_USE_TF defaults to false
here, before any gs:// path is touched. Orbax writes checkpoints to gs:// natively (its
commit-file protocol, no renames) and reads the same environment: see docs/launching.md.

Object storage has no append and no rename: an object is written whole, atomically. So a
file that grows while a run goes (metrics.jsonl, TensorBoard events, machine.jsonl) is a
`GrowingFile`: on gs:// it is kept in a local spool and the whole object is rewritten from it
(at most every `upload_every` seconds, and on flush(force=True) and close), so a reader sees
a complete prefix of it, never a torn line; and a small file replaced whole (config.json,
time_spent.json) is written in one request (`write_text`), not written beside and renamed.
Listings are never cached (gcsfs would keep them for the life of the process).
"""

import base64
import fcntl
import glob
import hashlib
import json
import logging
import os
import tempfile
import time
from typing import Iterable, List, Tuple, Union

import fsspec.config
from etils import epath

os.environ.setdefault('EPATH_USE_TF', 'false')
# gcsfs caches directory listings for the life of the process, so a file another host (or
# process) wrote since would stay invisible: runs coordinate through listings (prepared
# data, checkpoints, local copies), so every listing asks the bucket.
fsspec.config.conf.setdefault('gcs', {}).setdefault('use_listings_cache', False)


class _WithoutTraceback(logging.Filter):
  """gcsfs logs each request that ran out of retries with its traceback, then raises the same
  error, which the program reports (in one line): the log keeps the message only."""

  def filter(self, record):
    record.exc_info, record.exc_text = None, None
    return True


logging.getLogger('gcsfs').addFilter(_WithoutTraceback())


def is_url(path) -> bool:
  return '://' in os.fspath(path)


def join(base, *names: str) -> str:
  """`base`/`names`... as a string: a URL joined with '/', a local path by os.path.join."""
  base = os.fspath(base)
  if is_url(base):
    return '/'.join([base.rstrip('/')] + [n.strip('/') for n in names])
  return os.path.join(base, *names)


def path(p) -> epath.Path:
  """A local path made absolute (~ expanded), or a URL as given."""
  p = os.fspath(p)
  return epath.Path(p if is_url(p) else os.path.abspath(os.path.expanduser(p)))


# Where the exception types of the storage clients come from (gcsfs over aiohttp for files,
# google-cloud-storage for the lock object, google-auth for credentials).
_CLIENT_MODULES = ('aiohttp', 'gcsfs', 'google.api_core', 'google.auth', 'google.cloud',
                   'requests', 'urllib3')


def fault(e: BaseException):
  """The exception in `e`'s chain that says object storage failed (the service unreachable
  or refusing: a connection error, an HTTP error of a storage client, a tensorstore GCS
  error), or None."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    module = type(e).__module__ or ''
    if (isinstance(e, (ConnectionError, TimeoutError)) or module.startswith(_CLIENT_MODULES)
        or (isinstance(e, ValueError) and 'gs://' in str(e) and any(
            code in str(e) for code in ('UNAVAILABLE', 'DEADLINE_EXCEEDED', 'CURL',
                                        'Connection')))):
      return e
    e = e.__cause__ or e.__context__
  return None


MOUNTS = '/proc/mounts'


def refuse_gcsfuse(p, what: str) -> None:
  """Raises ValueError when the local path `p` lies on a gcsfuse mount (fuse.gcsfuse in
  /proc/mounts): there a directory rename, by which a local checkpoint or a preparation is
  committed, fails or copies object by object (not atomic), and flock is not shared between
  hosts. The message names the gs:// URL to give instead (`what`: the setting, e.g.
  --workdir)."""
  if is_url(p):
    return
  full = os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(p))))
  try:
    with open(MOUNTS) as f:
      mounts = [line.split()[:3] for line in f if len(line.split()) >= 3]
  except OSError:
    return
  best = None
  for device, point, kind in mounts:
    point = point.replace('\\040', ' ')
    if full == point or full.startswith(point.rstrip('/') + '/'):
      if best is None or len(point) > len(best[1]):
        best = (device, point, kind)
  if best is not None and best[2] == 'fuse.gcsfuse':
    device, point, _ = best
    rel = os.path.relpath(full, point)
    url = f'gs://{device}' + ('' if rel == '.' else f'/{rel}')
    raise ValueError(f'{what} {os.fspath(p)} is on a gcsfuse mount of the bucket {device} '
                     f'({point}), where renames are not atomic and locks are not shared '
                     f'between hosts; give the bucket itself instead: {url}')


def write_text(p, text: str) -> epath.Path:
  """Replaces the file at `p` whole, so that no reader sees part of it: on a local disk
  written beside and renamed, on object storage one upload (objects are replaced
  atomically)."""
  p = path(p)
  p.parent.mkdir(parents=True, exist_ok=True)
  if is_url(p):
    p.write_text(text)
  else:
    tmp = p.parent / (p.name + '.tmp')
    tmp.write_text(text)
    tmp.replace(p)
  return p


def _fs(url: str):
  import fsspec  # pylint: disable=g-import-not-at-top
  return fsspec.core.url_to_fs(url)[0]


def glob_files(pattern: str) -> List[Tuple[str, int]]:
  """(path, bytes) of the files that the glob `pattern` matches (a local pattern, ~ expanded,
  or a gs:// URL pattern), sorted by path."""
  if is_url(pattern):
    scheme = pattern.split('://', 1)[0]
    found = _fs(pattern).glob(pattern, detail=True)
    return sorted((f'{scheme}://{name}', int(info['size'])) for name, info in found.items()
                  if info['type'] == 'file')
  return sorted((p, os.path.getsize(p)) for p in glob.glob(os.path.expanduser(pattern))
                if os.path.isfile(p))


def open_binary(p):
  """A file or an object, opened for reading bytes (an object is read in buffered ranges)."""
  return path(p).open('rb') if is_url(p) else open(os.path.expanduser(os.fspath(p)), 'rb')


def upload(local: str, url: str) -> None:
  """Copies the local file to the object `url` (streamed, not read into memory)."""
  _fs(url).put_file(local, url)


def cache_dir(kind: str) -> str:
  """This host's folder for local copies of `kind` (REALFORMER_CACHE, else
  ~/.cache/realformer)."""
  root = os.environ.get('REALFORMER_CACHE') or os.path.join(os.path.expanduser('~'), '.cache',
                                                            'realformer')
  return os.path.join(root, kind)


def cache_key(url: str) -> str:
  return hashlib.sha256(url.rstrip('/').encode()).hexdigest()[:16]


def local_copy(url: str, names: Iterable[str], kind: str = 'prepared') -> str:
  """A local folder holding the objects <url>/<name> for `names`, for readers that need
  files (array_record). Each file is checked against the bucket's listing: a file whose
  object changed (size, MD5, generation) since it was copied is copied again, and a copy
  whose size or MD5 differs from the object's is an error. The processes of one host share
  the folder (an flock); downloads land under a temporary name, renamed once checked."""
  url = url.rstrip('/')
  fs, local = _fs(url), os.path.join(cache_dir(kind), cache_key(url))
  os.makedirs(local, exist_ok=True)
  listed = {os.path.basename(e['name'].rstrip('/')): e for e in fs.ls(url, detail=True)}
  with open(os.path.join(local, '.lock'), 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    manifest_path = os.path.join(local, '.manifest.json')
    manifest = {}
    if os.path.isfile(manifest_path):
      with open(manifest_path) as f:
        manifest = json.load(f)
    for name in names:
      if name not in listed:
        raise FileNotFoundError(f'{url}/{name} does not exist')
      entry = listed[name]
      want = {'size': int(entry['size']), 'md5': entry.get('md5Hash'),
              'generation': entry.get('generation')}
      target = os.path.join(local, name)
      if (manifest.get(name) == want and os.path.isfile(target) and
          os.path.getsize(target) == want['size']):
        continue
      partial = target + '.partial'
      fs.get_file(f'{url}/{name}', partial)
      got = _md5(partial)
      if os.path.getsize(partial) != want['size'] or (want['md5'] and got != want['md5']):
        os.unlink(partial)
        raise OSError(f'the copy of {url}/{name} differs from the object (size or MD5); '
                      'was it rewritten meanwhile? run again')
      os.replace(partial, target)
      manifest[name] = want
      with open(manifest_path + '.tmp', 'w') as f:
        json.dump(manifest, f)
      os.replace(manifest_path + '.tmp', manifest_path)
  return local


def _md5(local: str) -> str:
  digest = hashlib.md5()
  with open(local, 'rb') as f:
    for chunk in iter(lambda: f.read(1 << 20), b''):
      digest.update(chunk)
  return base64.b64encode(digest.digest()).decode()


def copy_tree(local_dir: str, dest) -> None:
  """Copies the files under the local folder `local_dir` to the folder or URL `dest`."""
  dest = path(dest)
  for root, _, files in os.walk(local_dir):
    for name in files:
      target = dest.joinpath(os.path.relpath(os.path.join(root, name), local_dir))
      target.parent.mkdir(parents=True, exist_ok=True)
      with open(os.path.join(root, name), 'rb') as f:
        target.write_bytes(f.read())


class GrowingFile:
  """A file that a run appends to, on a local disk or in a bucket.

  Local: the file opened for appending; flush() flushes it. URL: a local spool that starts as
  a copy of the object (a resumed run appends to what it wrote before), and the object
  rewritten from the whole spool on flush() when `upload_every` seconds have passed since the
  last upload, on flush(force=True), and on close(). A storage error from an upload
  propagates (the spool keeps every byte; the next upload sends them).
  """

  def __init__(self, p, binary: bool = False, upload_every: float = 30.0):
    self.path, self.upload_every = path(p), upload_every
    self._mode = 'b' if binary else ''
    if not is_url(self.path):
      self.path.parent.mkdir(parents=True, exist_ok=True)
      self._file = open(self.path, 'a' + self._mode)
      return
    fd, self._spool = tempfile.mkstemp(prefix='realformer-', suffix='-' + self.path.name)
    with os.fdopen(fd, 'wb') as f:
      if self.path.exists():
        f.write(self.path.read_bytes())
    self._file = open(self._spool, 'a' + self._mode)
    self._uploaded = time.monotonic()

  def write(self, data: Union[str, bytes]) -> None:
    self._file.write(data)

  def flush(self, force: bool = False) -> None:
    self._file.flush()
    if is_url(self.path) and (force or time.monotonic() - self._uploaded >= self.upload_every):
      with open(self._spool, 'rb') as f:
        self.path.write_bytes(f.read())
      self._uploaded = time.monotonic()

  def close(self) -> None:
    if self._file.closed:
      return
    try:
      self.flush(force=True)
    finally:
      self._file.close()
    if is_url(self.path):  # uploaded (else the spool stays, and the error names the object)
      os.unlink(self._spool)
