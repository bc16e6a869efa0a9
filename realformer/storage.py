"""Where a run's files live: a local folder, or a Cloud Storage URL (gs://bucket/path).

Paths go through etils.epath. For gs:// it uses gcsfs, not TensorFlow's tf.io.gfile (which
epath would pick whenever TensorFlow is installed: that would import TensorFlow into every run
and ignore STORAGE_EMULATOR_HOST, so nothing could test it): EPATH_USE_TF defaults to false
here, before any gs:// path is touched. Orbax writes checkpoints to gs:// natively (its
commit-file protocol, no renames) through tensorstore, which reads its endpoint from
TENSORSTORE_GCS_HTTP_URL, not from STORAGE_EMULATOR_HOST (gcsfs, google-cloud-storage): a run
pointed at a Cloud Storage emulator through the latter gets the former set to the same
(`same_endpoint`), so that no file goes elsewhere. (STORAGE_EMULATOR_HOST is for emulators:
google-cloud-storage sends no credentials to it.)

Object storage has no append and no rename: an object is written whole, atomically. So a
file that grows while a run goes (metrics.jsonl, TensorBoard events, machine.jsonl) is a
`GrowingFile`: on gs:// it is kept in a local spool whose new bytes are appended to the
object by Cloud Storage's compose (at most every `upload_every` seconds, and on
flush(force=True) and close), so a reader sees a complete prefix of it, never a torn line;
and a small file replaced whole (config.json,
time_spent.json) is written in one request (`write_text`), not written beside and renamed.
Listings are never cached (gcsfs would keep them for the life of the process).
"""

import base64
import datetime
import errno
import fcntl
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from typing import Iterable, Iterator, List, Optional, Tuple, Union

from absl import logging as absl_logging
from etils import epath

os.environ.setdefault('EPATH_USE_TF', 'false')
# gcsfs caches directory listings for the life of the process, so a file another host (or
# process) wrote since would stay invisible: runs coordinate through listings (prepared
# data, checkpoints, local copies), so every listing asks the bucket. (fsspec is needed only
# for URLs: an environment without it runs on local paths.)
try:
  import fsspec.config  # pylint: disable=g-import-not-at-top
  fsspec.config.conf.setdefault('gcs', {}).setdefault('use_listings_cache', False)
except ImportError:
  pass


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
  if is_url(p):
    same_endpoint()
    return epath.Path(p)
  return epath.Path(os.path.abspath(os.path.expanduser(p)))


def is_file(p) -> bool:
  """Whether `p` is a file. On gs:// a storage that does not answer raises, where epath's
  is_file answers False (gcsfs takes any error for absence): a check that decides what to
  write or delete must not read an outage as "not there"."""
  return _kind(p) == 'file' if is_url(p) else path(p).is_file()


def is_dir(p) -> bool:
  """Whether `p` is a folder (on gs://, objects under the prefix), raising as is_file does."""
  return _kind(p) == 'directory' if is_url(p) else path(p).is_dir()


def _kind(url) -> Optional[str]:
  url = os.fspath(url)
  same_endpoint()
  try:
    return _fs(url).info(url)['type']
  except FileNotFoundError:
    return None


_TENSORSTORE_URL = 'TENSORSTORE_GCS_HTTP_URL'
_GCS_URL = 'https://storage.googleapis.com'  # every client's endpoint when none is set
# The TENSORSTORE_GCS_HTTP_URL that same_endpoint() set (in this process or the one that
# started it: the environment goes to child processes with it), if any.
_DERIVED = 'REALFORMER_DERIVED_TENSORSTORE_URL'


def same_endpoint() -> None:
  """Points tensorstore (Orbax's arrays) at the Cloud Storage endpoint that
  STORAGE_EMULATOR_HOST names for the other clients, by setting TENSORSTORE_GCS_HTTP_URL (and
  follows the variable when it changes, or removes what it set); raises a one-line ValueError
  when the user set both to different endpoints, or only tensorstore's to another than Cloud
  Storage's own: a run's arrays would be written to another service than its other files."""
  host = os.environ.get('STORAGE_EMULATOR_HOST', '').rstrip('/')
  url = host if not host or '://' in host else f'http://{host}'
  given = os.environ.get(_TENSORSTORE_URL)
  if given is None or given == os.environ.get(_DERIVED):
    if url:
      os.environ[_TENSORSTORE_URL] = os.environ[_DERIVED] = url
    elif given is not None:
      del os.environ[_TENSORSTORE_URL], os.environ[_DERIVED]
  elif given.rstrip('/') != (url or _GCS_URL):
    raise ValueError(f'{_TENSORSTORE_URL}={given} but STORAGE_EMULATOR_HOST='
                     f'{host or "(unset)"}: the checkpoints\' arrays would go to another '
                     'Cloud Storage endpoint than the other files; set both to the same '
                     f'endpoint, or unset {_TENSORSTORE_URL}')


# Where the exception types of the storage clients come from (gcsfs over aiohttp for files,
# google-cloud-storage for the lock object, google-auth for credentials).
_CLIENT_MODULES = ('aiohttp', 'gcsfs', 'google.api_core', 'google.auth', 'google.cloud',
                   'google.resumable_media', 'requests', 'urllib3')
# How gcsfs words a refusal it raises as a bare OSError.
_REFUSALS = ('Forbidden', 'Unauthorized')
# The host an HTTP client's error names (requests and urllib3: host='...'; aiohttp: host
# ...:443), and the hosts that are object storage's: Google's APIs (storage, OAuth, and the
# token URI of older service-account keys), the metadata server that gives a VM its
# credentials, loopback, and the endpoints STORAGE_EMULATOR_HOST and TENSORSTORE_GCS_HTTP_URL
# name (an emulator's).
_ERROR_HOST = re.compile(r"\bhost[= ]'?([A-Za-z0-9.-]+)")
_STORAGE_HOSTS = re.compile(r'(^|\.)googleapis\.com$|(^|\.)google\.internal$|'
                            r'^accounts\.google\.com$|^169\.254\.169\.254$|^127\.|^localhost$')


def _another_service(e: BaseException) -> bool:
  """Whether the client error `e` names a host other than object storage's: a download of
  tfds's, the Hugging Face hub (which use the same HTTP clients)."""
  named = _ERROR_HOST.search(str(e))
  if named is None or _STORAGE_HOSTS.search(named.group(1)):
    return False
  endpoints = (os.environ.get(v, '') for v in ('STORAGE_EMULATOR_HOST', _TENSORSTORE_URL))
  return not any(named.group(1) == re.sub(r'^\w+://|[:/].*$', '', url) for url in endpoints
                 if url)


def chain(e: Optional[BaseException]) -> Iterator[BaseException]:
  """`e` and the errors it was raised from, as Python prints them: its cause, else its
  context unless `raise ... from None` suppressed it (so an error this code raised in place
  of a library's is never read as that library's)."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)


def fault(e: BaseException):
  """The exception in `e`'s chain that says object storage failed, or None: an error raised by
  a storage client (gcsfs and the aiohttp under it, google-cloud-storage, google-auth), a
  refusal that gcsfs raises as a bare OSError ('Forbidden: ...'), or a tensorstore error on
  a gs:// path; not one of those clients' errors that names another host (a dataset's
  download). The chain is followed as Python prints it (a context suppressed by
  `raise ... from None` is not: `chain`), so an error of this code's own is never taken for
  one."""
  for e in chain(e):
    module = type(e).__module__ or ''
    text = str(e)
    if ((module.startswith(_CLIENT_MODULES) and not _another_service(e)) or
        (type(e) is OSError and e.errno is None and text.startswith(_REFUSALS)) or
        (isinstance(e, ValueError) and 'gs://' in text and any(
            code in text for code in ('UNAVAILABLE', 'DEADLINE_EXCEEDED', 'CURL',
                                      'PERMISSION_DENIED')))):
      return e
  return None


_UPLOAD_TO_BUCKET = re.compile(r'/upload/storage/v1/b/([^/?]+)/o')


def missing_bucket(e: BaseException) -> Optional[str]:
  """The bucket of a write that storage answered 'not found' (only a missing bucket, or one
  these credentials cannot see, gives that on a write), from `e`'s chain; else None. gcsfs
  raises it as a FileNotFoundError holding the upload's URL, google-cloud-storage as
  NotFound."""
  for e in chain(e):
    if isinstance(e, FileNotFoundError) or type(e).__name__ == 'NotFound':
      found = _UPLOAD_TO_BUCKET.search(str(e))
      if found:
        return found.group(1)
  return None


def refused(e: BaseException) -> bool:
  """A storage fault that is a refusal of access (not an outage)."""
  text = str(e)
  return text.startswith(_REFUSALS) or 'PERMISSION_DENIED' in text or any(
      name in type(e).__name__ for name in ('Forbidden', 'Unauthorized'))


MOUNTS = '/proc/mounts'


# Characters that the storage clients read as URL syntax in a gs:// path, not as part of a
# name: tensorstore (the checkpoints' arrays) ends the path at # or ?, so a run's arrays would
# go to another folder than its other files; gcsfs globs *, [ and ] and chains URLs at ::.
URL_SYNTAX = ('#', '?', '*', '[', ']', '::')


def check_location(p, what: str) -> None:
  """One-line ValueErrors for a folder that a run, a preparation or an import writes, before
  anything is written: a URL other than gs://, a bucket itself (the temporary and lock
  objects beside the folder would name other buckets), URL syntax in a gs:// path
  (URL_SYNTAX) or a ., .. or empty name in it, a local path that is a mistyped gs:// URL
  (gs:/bucket/run), a local path on a gcsfuse mount (refuse_gcsfuse), or Cloud Storage
  endpoints that disagree (same_endpoint).
  `what` names the setting, e.g. --workdir."""
  text = os.fspath(p)
  if not is_url(text):
    if text.startswith('gs:'):  # gs:/bucket/run, gs:bucket/run: a local folder named gs:
      raise ValueError(f'{what} {text}: a gs:// URL has two slashes; give gs://'
                       f'{text[3:].lstrip("/")} for the bucket, or ./{text} for a local folder')
    refuse_gcsfuse(text, what)
    return
  if not text.startswith('gs://'):
    raise ValueError(f'{what} {text!r}: object storage is supported for gs:// (Cloud Storage) '
                     'URLs; give a gs:// URL or a local folder')
  same_endpoint()
  bucket, _, prefix = text[len('gs://'):].partition('/')
  if not prefix.strip('/'):
    raise ValueError(f'{what} {text}: give a folder inside the bucket (e.g. gs://{bucket}/'
                     'runs/bert), not the bucket itself')
  found = [c for c in URL_SYNTAX if c in prefix]
  if found:
    raise ValueError(f'{what} {text}: {" ".join(found)} in a gs:// path is read as URL syntax '
                     '(the checkpoints would be written elsewhere); name the folder without it')
  dots = [part for part in prefix.split('/') if part in ('.', '..')]
  if dots:  # object names keep them, while some clients resolve them: files in two places
    raise ValueError(f'{what} {text}: {dots[0]!r} in a gs:// path names no folder in a '
                     'bucket; give the path without it')
  if '' in prefix.rstrip('/').split('/'):  # likewise an empty name between two slashes
    raise ValueError(f'{what} {text}: // in a gs:// path names no folder in a bucket; give '
                     'the path with single slashes')


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


def write_bytes(p, data: bytes) -> epath.Path:
  """Replaces the file at `p` whole, so that no reader sees part of it: on a local disk
  written beside, flushed to the disk and renamed (a power cut leaves the old file or the
  new one, never an empty one), on object storage one upload (objects are replaced
  atomically)."""
  p = path(p)
  p.parent.mkdir(parents=True, exist_ok=True)
  if is_url(p):
    p.write_bytes(data)
  else:  # (a temporary name of this write's own: another thread's may be under way)
    tmp = p.parent / f'{p.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}'
    try:
      with open(tmp, 'wb') as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
      tmp.replace(p)
    except BaseException:  # (a full disk: not a partial file left taking its space)
      tmp.unlink(missing_ok=True)
      raise
  return p


def write_text(p, text: str) -> epath.Path:
  """write_bytes of `text` in UTF-8."""
  return write_bytes(p, text.encode('utf-8'))


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


def walk(root):
  """os.walk for a folder or a gs:// URL: (folder, subfolder names, file names) from the top
  down, folders as strings of the same kind as `root`; pruning the subfolder names in place
  skips them."""
  root = os.fspath(root)
  if not is_url(root):
    yield from os.walk(root)
    return
  scheme = root.split('://', 1)[0]
  for folder, dirnames, filenames in _fs(root).walk(root, topdown=True):
    yield f'{scheme}://{folder}', dirnames, filenames


def clock(beside: str) -> float:
  """Now, by the clock that stamps the files beside `beside` (the storage service's for
  gs://, a network file system's server's for a shared disk), read off a probe written and
  deleted there (<beside>.clock-<nonce>, as a lock object <beside>.lock is named): what to
  compare the times of files that other hosts write there with, whatever this host's clock
  says. A local folder to hold it is made if it is not there."""
  beside = os.fspath(beside).rstrip('/')
  if not is_url(beside):
    beside = os.fspath(path(beside))
    os.makedirs(os.path.dirname(beside), exist_ok=True)
  probe = f'{beside}.clock-{uuid.uuid4().hex}'
  write_text(probe, '')
  try:
    return mtime(probe)
  finally:
    try:
      path(probe).unlink()
    except FileNotFoundError:
      pass


def mtime(p) -> float:
  """When the file or object was last written (seconds since the epoch, to the microsecond
  for objects, as the service records it); FileNotFoundError if it does not exist."""
  p = os.fspath(p)
  if is_url(p):
    updated = _fs(p).info(p)['updated']
    return datetime.datetime.fromisoformat(updated.replace('Z', '+00:00')).timestamp()
  return os.path.getmtime(os.path.expanduser(p))


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
  whose size or MD5 differs from the object's is an error (a composite object has no MD5: a
  parallel upload's, a log's appends; its CRC32C is checked instead). The processes of one
  host share the folder (an flock); downloads land under a temporary name, renamed once
  checked."""
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
      if not want['md5'] and entry.get('crc32c'):
        want['crc32c'] = entry['crc32c']
      target = os.path.join(local, name)
      if (manifest.get(name) == want and os.path.isfile(target) and
          os.path.getsize(target) == want['size']):
        continue
      partial = target + '.partial'
      fs.get_file(f'{url}/{name}', partial)
      if os.path.getsize(partial) != want['size'] or (
          _md5(partial) != want['md5'] if want['md5'] else
          'crc32c' in want and _crc32c(partial) != want['crc32c']):
        os.unlink(partial)
        raise OSError(f'the copy of {url}/{name} differs from the object (size or checksum); '
                      'was it rewritten meanwhile? run again')
      os.replace(partial, target)
      manifest[name] = want
      with open(manifest_path + '.tmp', 'w') as f:
        json.dump(manifest, f)
      os.replace(manifest_path + '.tmp', manifest_path)
  return local


def _checksum(local: str, digest) -> str:
  """A local file's `digest` (hashlib's or google_crc32c's) in base64, as an object listing
  gives its md5Hash and crc32c."""
  with open(local, 'rb') as f:
    for chunk in iter(lambda: f.read(1 << 20), b''):
      digest.update(chunk)
  return base64.b64encode(digest.digest()).decode()


def _md5(local: str) -> str:
  return _checksum(local, hashlib.md5())


def _crc32c(local: str) -> str:
  import google_crc32c  # pylint: disable=g-import-not-at-top
  return _checksum(local, google_crc32c.Checksum())


def copy_tree(local_dir: str, dest) -> None:
  """Copies the files under the local folder `local_dir` to the folder or URL `dest`, each
  streamed (an exported model's weights are not read into memory whole)."""
  dest = path(dest)
  for root, _, files in os.walk(local_dir):
    for name in files:
      source = os.path.join(root, name)
      target = dest.joinpath(os.path.relpath(source, local_dir))
      target.parent.mkdir(parents=True, exist_ok=True)
      if is_url(target):
        upload(source, os.fspath(target))
      else:
        shutil.copyfile(source, target)


# ---- Cloud Storage's own client (google-cloud-storage), for what gcsfs does not offer:
# preconditions on writes and compose.

# How long one request to the service may take, its retries included ($REALFORMER_STORAGE_SECONDS;
# the tests, whose server is on 127.0.0.1, give up sooner when they stop it).
REQUEST_SECONDS = float(os.environ.get('REALFORMER_STORAGE_SECONDS', 30))

def gcs_client(url: str):
  """A google-cloud-storage client for the gs:// URL `url` (ValueError: no credentials)."""
  from google.cloud import storage as gcs  # pylint: disable=g-import-not-at-top
  try:
    return gcs.Client()
  except Exception as e:  # pylint: disable=broad-except  (google.auth's many errors)
    raise ValueError(f'cannot reach Cloud Storage for {url}: {short(e)}; give the machine '
                     'credentials (a VM\'s service account, or gcloud auth '
                     'application-default login)') from None


def gcs_blob(client, url: str):
  """The Blob of a gs:// URL (not fetched: a fresh object with no properties)."""
  bucket, _, name = url[len('gs://'):].partition('/')
  return client.bucket(bucket).blob(name)


def _bounded_retry():
  """The client's retries of a failed request, all of them within REQUEST_SECONDS."""
  from google.cloud.storage import retry  # pylint: disable=g-import-not-at-top
  return retry.DEFAULT_RETRY.with_timeout(REQUEST_SECONDS)


def short(e: BaseException) -> str:
  return ' '.join(str(e).split())[:300] or type(e).__name__


class GrowingFile:
  """A file that a run appends to, on a local disk or in a bucket.

  Local: the file opened for appending; flush() flushes it. gs:// URL: a local spool (an
  unnamed temporary file, gone with the process however it ends) that starts as a copy of
  the object (a resumed run appends to what it wrote before), whose new
  bytes reach the object on flush() when `upload_every` seconds have passed since the last
  upload, on flush(force=True), and on close(). An upload sends only the bytes the object
  lacks: they go to a temporary object beside it, which Cloud Storage's compose appends to
  the object (atomically, under the precondition that the object is the generation this
  file wrote last). The first upload of each start, one after COMPOSE_LIMIT appends, and
  one whose compose finds the object changed (a retried compose that had landed) or gone
  rewrite the object whole from the spool instead, so the object is always a copy of the spool's
  prefix. A storage error from an upload propagates (the spool keeps every byte; the next
  upload sends them). One thread writes and flushes a GrowingFile. A process killed between
  an append's upload and the part's delete, or a delete that fails, leaves a small
  `.append-<hex>` object beside the file (never part of it).
  """

  # Appends before the object is rewritten whole (Cloud Storage counts a composite
  # object's components and limits them).
  COMPOSE_LIMIT = 1000

  def __init__(self, p, binary: bool = False, upload_every: float = 30.0):
    self.path, self.upload_every = path(p), upload_every
    self._mode = 'b' if binary else ''
    if not is_url(self.path):
      self.path.parent.mkdir(parents=True, exist_ok=True)
      self._file = open(self.path, 'a' + self._mode)
      return
    self._client = gcs_client(os.fspath(self.path))
    # Anonymous (no name on disk): nothing is left behind however the process ends.
    self._file = tempfile.TemporaryFile()
    blob = gcs_blob(self._client, os.fspath(self.path))
    if blob.exists(timeout=REQUEST_SECONDS, retry=_bounded_retry()):
      self._file.write(blob.download_as_bytes(timeout=REQUEST_SECONDS, retry=_bounded_retry()))
    self._uploaded = time.monotonic()
    # What the object holds: the spool's first `_sent` bytes, at `_generation`, after
    # `_appends` composes (None: not written by this start, so the next upload is whole).
    self._sent, self._generation, self._appends = self._file.tell(), None, 0

  def write(self, data: Union[str, bytes]) -> None:
    if is_url(self.path) and isinstance(data, str):
      data = data.encode('utf-8')  # (the spool is binary)
    self._file.write(data)

  def flush(self, force: bool = False) -> None:
    self._file.flush()
    if is_url(self.path) and (force or time.monotonic() - self._uploaded >= self.upload_every):
      self._upload()
      self._uploaded = time.monotonic()

  def _upload(self) -> None:
    size = self._file.tell()  # (flushed: the spool's end)
    tail = os.pread(self._file.fileno(), size - self._sent, self._sent)
    if self._generation is not None and not tail:
      return
    if self._generation is None or self._appends >= self.COMPOSE_LIMIT or not self._append(tail):
      self._file.seek(0)
      try:
        blob = gcs_blob(self._client, os.fspath(self.path))
        blob.upload_from_file(self._file, size=size, timeout=REQUEST_SECONDS,
                              retry=_bounded_retry())
      finally:
        self._file.seek(0, os.SEEK_END)
      self._generation, self._appends = blob.generation, 0
    self._sent = size

  def _append(self, tail: bytes) -> bool:
    """Appends `tail` to the object by compose; False: the object is not the generation this
    file wrote last, or is gone (nothing appended)."""
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    # Fresh blobs: a compose sends its destination's properties, and a checksum left from an
    # earlier request would be checked against the composed object. The part's name holds
    # neither the file's name nor 'tfevents', so no reader of the folder (TensorBoard, a
    # glob of the file's name) takes it for the file.
    blob = gcs_blob(self._client, os.fspath(self.path))
    part = gcs_blob(self._client,
                    join(os.fspath(self.path.parent), f'.append-{uuid.uuid4().hex}'))
    settled = False  # every request succeeded or was refused on a precondition
    try:
      try:
        part.upload_from_string(tail, if_generation_match=0, timeout=REQUEST_SECONDS,
                                retry=_bounded_retry())
      except exceptions.PreconditionFailed:
        pass  # a retry of our own upload, whose reply was lost: the name is new to this write
      # The object as this file wrote it last, then the part (the generations pinned).
      blob.compose([blob, part], if_generation_match=self._generation,
                   if_source_generation_match=[self._generation, None],
                   timeout=REQUEST_SECONDS, retry=_bounded_retry())
      settled = True
    except (exceptions.PreconditionFailed, exceptions.NotFound):
      settled = True
      return False  # the object changed, or is gone (a retry after a lost reply, a user)
    finally:
      try:
        # After a request that failed (the storage error propagates), one attempt, not
        # another REQUEST_SECONDS of retries: a part it cannot delete stays, harmless.
        part.delete(timeout=REQUEST_SECONDS, retry=_bounded_retry() if settled else None)
      except exceptions.NotFound:
        pass  # its upload never landed
      except Exception as e:  # pylint: disable=broad-except  (a small object left: harmless)
        absl_logging.warning('could not delete %s: %s', part.name, short(e))
    self._generation, self._appends = blob.generation, self._appends + 1
    return True

  def unsent(self) -> bytes:
    """What was written that the object does not hold yet (b'' for a local file)."""
    if not is_url(self.path) or self._file.closed:
      return b''
    self._file.flush()
    return os.pread(self._file.fileno(), self._file.tell() - self._sent, self._sent)

  def close(self) -> None:
    """Flushes (uploads) and closes; an upload that fails leaves the file open (its error
    propagates), so that calling close() again sends what is left."""
    if self._file.closed:
      return
    self.flush(force=True)
    self._file.close()


# ---- A lock file on a local (or network) disk.

def lock_file(p: str, wait: bool, fix: str) -> Optional[int]:
  """An flock on the file `p` (made if absent; open for writing, as a network file system's
  flock, a byte-range lock there, needs): the descriptor holding it (closing it lets go),
  or None where another process holds it and not `wait`. A holder may remove the file as it
  lets go: a lock taken on a removed file is taken again on the new one. A file system
  without flocks is a one-line ValueError ending in `fix`."""
  while True:
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError as e:
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
        return None
      raise ValueError(f'{os.path.dirname(os.path.abspath(p))} is on a file system that '
                       f'cannot lock files ({os.strerror(e.errno)}); {fix}') from None
    try:
      same = os.fstat(fd).st_ino == os.stat(p).st_ino
    except FileNotFoundError:
      same = False
    if same:
      return fd
    os.close(fd)  # its holder removed it meanwhile: take the new one


# ---- A lock object with a lease (the lock of a run directory or a preparation in a bucket).

class HeldError(Exception):
  """The lock object is held by another live process (the message names it and the fix)."""


# How long a lock object stays valid without a refresh, and how often its holder refreshes
# it. A holder that dies on another host (a preempted VM) frees the lock this long after its
# last refresh; on the same host (and pid
# namespace) a holder that is gone is detected at once.
LEASE_SECONDS = 300.0
REFRESH_SECONDS = 60.0


def lease_clock() -> float:
  """Seconds on a clock that goes on while the machine sleeps (Linux's CLOCK_BOOTTIME;
  time.monotonic elsewhere): a holder suspended past its lease sees it as lost when it
  wakes, where time.monotonic, which stops with the machine, would show it young."""
  return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


_BOOTTIME = getattr(time, 'CLOCK_BOOTTIME', None)


def holder_record(program: str) -> dict:
  """Who holds a lock: host, pid (with the process's start time, pid namespace and the
  machine's boot id, so that a reused pid, a process of another container or of another
  machine of the same hostname, a cloned VM, is never taken for this one), program and
  start time; under SLURM the job's id and restart count (a requeued job may start on
  another node: workdir.Lock takes over its earlier run's lock)."""
  record = {'host': socket.gethostname(), 'pid': os.getpid(),
            'pid_start': _process_start(os.getpid()), 'pid_ns': _pid_namespace(),
            'boot_id': _boot_id(), 'program': program, 'since': _now()}
  if os.environ.get('SLURM_JOB_ID'):
    record.update(slurm_job=os.environ['SLURM_JOB_ID'],
                  slurm_restart=int(os.environ.get('SLURM_RESTART_COUNT') or 0))
  return record


def describe_holder(holder: dict) -> str:
  if not holder.get('pid'):  # the lock is taken, its record not written yet
    return 'another run that is starting'
  return (f'pid {holder.get("pid")} on {holder.get("host")} (since {holder.get("since")}, '
          f'{holder.get("program", "a run")})')


def _now() -> str:
  return datetime.datetime.now().isoformat(timespec='seconds')


def _process_start(pid) -> Optional[int]:
  """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22); None:
  no such process (or no /proc)."""
  try:
    with open(f'/proc/{int(pid)}/stat') as f:
      return int(f.read().rpartition(')')[2].split()[19])
  except (OSError, ValueError, IndexError):
    return None


def _pid_namespace() -> Optional[str]:
  try:
    return os.readlink('/proc/self/ns/pid')
  except OSError:
    return None


def _boot_id() -> Optional[str]:
  """This boot of this machine (the kernel's random id; machines and reboots differ)."""
  try:
    with open('/proc/sys/kernel/random/boot_id') as f:
      return f.read().strip()
  except OSError:
    return None


def holder_gone(holder: dict) -> bool:
  """The holder ran on this host (this boot of it), in this pid namespace, and its process
  no longer exists."""
  if (holder.get('host') != socket.gethostname() or not os.path.isdir('/proc/self') or
      holder.get('pid_ns', _pid_namespace()) != _pid_namespace() or
      holder.get('boot_id', _boot_id()) != _boot_id()):
    return False
  start = _process_start(holder.get('pid', -1))
  return start is None or (holder.get('pid_start') is not None and
                           start != holder['pid_start'])


class Lease:
  """A lock object on Cloud Storage (`url`, e.g. gs://bucket/run/.lock), created only if
  absent (the precondition ifGenerationMatch=0, which the service decides atomically) and
  holding `record` (holder_record) with a nonce of this take and the lease's length. The
  holder rewrites it every REFRESH_SECONDS under ifGenerationMatch=<its generation>; a
  record that the service has not seen updated for lease_seconds (its `updated` time against
  the service's own clock, not this host's) belongs to a holder that is gone and is taken
  over, as is one
  left on this host by a process that no longer exists. A write whose reply was lost and
  whose retry then fails its precondition is recognised by the nonce. Released by deleting
  it under the same precondition, so a holder whose lease was taken over never deletes its
  successor's lock. `lost` says why the lock is no longer this holder's: taken over (seen
  by a refresh), or not refreshed for lease_seconds - 2 * REFRESH_SECONDS (so a holder that
  was cut off stops writing before anyone may take over). `guards`: the folder it locks, as
  messages name it (default: the one holding the lock object)."""

  def __init__(self, url: str, record: dict, guards: Optional[str] = None):
    if not url.startswith('gs://'):
      raise ValueError(f'{url}: object storage is supported for gs:// (Cloud Storage) URLs; '
                       'give a gs:// URL or a local folder')
    self.url, self.guards = url, guards or url.rpartition('/')[0]
    self.record = dict(record, lease_seconds=LEASE_SECONDS, nonce=uuid.uuid4().hex)
    self._bucket, _, self._name = url[len('gs://'):].partition('/')
    self.generation, self._lost = None, None
    self._refreshed = None  # lease_clock() of the last write the service confirmed
    # _io: one request on the object at a time (a refresh, a release); reentrant, for a
    # release from a signal handler that interrupted one.
    self._stop, self._io = threading.Event(), threading.RLock()
    self._thread = None

  @property
  def lost(self) -> Optional[str]:
    if self._lost:
      return self._lost
    if self._refreshed is not None:
      idle = lease_clock() - self._refreshed
      if idle > LEASE_SECONDS - 2 * REFRESH_SECONDS:
        return (f'the lock {self.url} could not be refreshed for {idle:.0f} s, so another '
                'run may have taken it over')
    return None

  def _blob(self):
    if not hasattr(self, '_client'):
      self._client = gcs_client(self.url)
    return gcs_blob(self._client, self.url)

  def _mine(self, **request):
    """The object if it holds this take's record (a write of ours whose reply was lost)."""
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    request = dict({'timeout': REQUEST_SECONDS}, **request)
    held = self._blob().bucket.get_blob(self._name, **request)
    if held is None:
      return None
    try:
      text = held.download_as_text(if_generation_match=held.generation, **request)
    except (exceptions.PreconditionFailed, exceptions.NotFound):
      return None
    try:
      return held if json.loads(text).get('nonce') == self.record['nonce'] else None
    except ValueError:
      return None

  def _service_now(self) -> float:
    """The storage service's clock, read off a probe object it stamps (created and deleted
    beside the lock): a lease's age is the difference of two of the service's timestamps,
    whatever this host's clock says."""
    probe = self._blob().bucket.blob(f'{self._name}.clock-{self.record["nonce"]}')
    probe.upload_from_string(b'', timeout=REQUEST_SECONDS)
    try:
      probe.delete(timeout=REQUEST_SECONDS)
    except Exception as e:  # pylint: disable=broad-except  (an empty object left: harmless)
      absl_logging.warning('could not delete %s/%s: %s', self._bucket, probe.name, short(e))
    return probe.time_created.timestamp()

  def take(self) -> 'Lease':
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    for _ in range(5):  # a lock released or taken over meanwhile: look again
      # The lease is credited from before the create: its client retries can take minutes.
      blob, sent = self._blob(), lease_clock()
      try:
        blob.upload_from_string(json.dumps(self.record), if_generation_match=0,
                                content_type='application/json', timeout=REQUEST_SECONDS)
        self.generation = blob.generation
        break
      except exceptions.PreconditionFailed:
        mine = self._mine()
        if mine is not None:
          self.generation = mine.generation
          break
      held = blob.bucket.get_blob(self._name, timeout=REQUEST_SECONDS)
      if held is None:
        continue
      try:
        holder = json.loads(held.download_as_text(if_generation_match=held.generation,
                                                  timeout=REQUEST_SECONDS))
      except (ValueError, exceptions.PreconditionFailed, exceptions.NotFound):
        holder = {'pid': '?', 'host': '?', 'since': '?', 'program': 'unreadable lock record'}
      lease = float(holder.get('lease_seconds', LEASE_SECONDS))
      gone = holder_gone(holder)
      age = 0.0 if gone else self._service_now() - held.updated.timestamp()
      if gone:
        why = 'that process is gone'
      elif age > lease:
        why = f'its lease expired {age - lease:.0f} s ago'
      else:
        raise HeldError(
            f'{self.guards} is in use by {describe_holder(holder)}, its lease '
            f'renewed {age:.0f} s ago; wait for it to finish or stop it, or use another '
            f'folder; if it is no longer running, delete {self.url} (or wait '
            f'{lease - age:.0f} s for its lease to expire)')
      absl_logging.warning('taking over the lock of %s in %s: %s', describe_holder(holder),
                      self.url, why)
      try:
        held.delete(if_generation_match=held.generation, timeout=REQUEST_SECONDS)
      except (exceptions.PreconditionFailed, exceptions.NotFound):
        pass  # refreshed or released meanwhile: look again
    else:
      raise HeldError(f'could not take {self.url}: others keep taking it; stop them or use '
                      'another folder')
    self._refreshed = sent
    self._thread = threading.Thread(target=self._refresh, name='lock-lease', daemon=True)
    self._thread.start()
    return self

  def _refresh(self):
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    # Retries end within one request's time, so the lease's age is never credited late.
    bounded = _bounded_retry()
    unanswered = None  # when the first refresh since the last confirmed one was sent
    while not self._stop.wait(REFRESH_SECONDS):
      with self._io:
        if self._stop.is_set():
          return
        blob, sent = self._blob(), lease_clock()
        unanswered = sent if unanswered is None else unanswered
        try:
          blob.upload_from_string(json.dumps(dict(self.record, renewed=_now())),
                                  if_generation_match=self.generation,
                                  content_type='application/json', timeout=REQUEST_SECONDS,
                                  retry=bounded)
          self.generation, self._refreshed, unanswered = blob.generation, sent, None
        except (exceptions.PreconditionFailed, exceptions.NotFound):
          try:
            mine = self._mine(retry=bounded)
          except Exception as e:  # pylint: disable=broad-except  (the next refresh looks again)
            if self._stop.is_set():
              return  # released meanwhile (release() said what becomes of the lock)
            absl_logging.warning('could not refresh the lock %s: %s', self.url, short(e))
            continue
          if mine is not None:  # a write of ours whose reply was lost: the service stamped
            # it after the first unanswered refresh was sent, perhaps long before this one
            self.generation, self._refreshed, unanswered = mine.generation, unanswered, None
            continue
          self._lost = (f'the lock {self.url} was taken over by another run (this run\'s '
                        'lease was not refreshed in time)')
          absl_logging.error('%s; this run stops before it writes again', self._lost)
          return
        except Exception as e:  # pylint: disable=broad-except  (the next refresh tries again)
          if self._stop.is_set():  # released while this refresh waited on the storage: the
            return  # run is stopping (its error, if any, stays the last line it prints)
          absl_logging.warning('could not refresh the lock %s: %s', self.url, short(e))

  def release(self):
    """Deletes the object (one try of each request: a storage that does not answer must not
    hold up the run's own error, nor a preempted run's exit). If a refresh is in flight for
    more than 10 s, the lock is left to expire."""
    self._stop.set()
    if not self._io.acquire(timeout=10):  # a refresh in flight
      absl_logging.warning('could not release the lock %s now; the next run takes it over '
                           'once its lease expires', self.url)
      return
    try:
      if self.generation is None or self._lost:
        return
      from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
      once = {'timeout': 10, 'retry': None}
      try:
        try:
          self._blob().delete(if_generation_match=self.generation, **once)
        except exceptions.PreconditionFailed:
          mine = self._mine(**once)  # a refresh whose reply was lost
          if mine is not None:
            mine.delete(if_generation_match=mine.generation, **once)
      except exceptions.NotFound:
        pass
      except Exception as e:  # pylint: disable=broad-except  (never hide the run's own error)
        absl_logging.warning('could not release the lock %s: %s; the next run takes it over '
                             'once its lease expires', self.url, short(e))
      self.generation = None
    finally:
      self._io.release()
