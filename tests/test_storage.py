"""Checkpoints on Cloud Storage (a GCS server on 127.0.0.1: tests/gcs_server.py): Orbax
commits a step with its commit file, never by a rename; a step cut short (no commit file) is
never restored; a model's worth of arrays round-trips; params-only checkpoints and config.json
round-trip through gs://. And the server itself keeps Cloud Storage's generation
preconditions, which tensorstore and a lock object rely on."""

import errno
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from realformer.train import checkpoints
from realformer import storage
from realformer.train import workdir
from realformer.train.run_dir import RunDir
from tests.gcs_server import gcs  # pylint: disable=unused-import


def _state(step):
  return {'step': step, 'params': {'w': jnp.arange(6.0).reshape(2, 3) * step,
                                   'b': jnp.ones((3,), jnp.float32)}}


def _abstract():
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.asarray(x).dtype),
                      _state(1))


def test_a_step_is_committed_by_its_commit_file_and_restored(gcs):
  run = f'{gcs}/committed'
  manager = checkpoints.make_manager(run, item_names=('state',))
  checkpoints.save(manager, 1, _state(1), force=True)
  manager.wait_until_finished()
  step_dir = storage.path(run) / 'checkpoints' / '1'
  names = sorted(p.name for p in step_dir.iterdir())
  assert checkpoints.COMMIT_FILE in names and 'state' in names
  assert not any('tmp' in p.name for p in (storage.path(run) / 'checkpoints').iterdir())
  assert checkpoints.has_complete_step(run)
  assert checkpoints.latest_complete_step(manager) == 1
  restored, _ = checkpoints.restore(manager, 1, _abstract())
  np.testing.assert_array_equal(restored['params']['w'], _state(1)['params']['w'])
  manager.close()


def test_a_step_cut_short_is_never_restored(gcs):
  run = f'{gcs}/cut'
  manager = checkpoints.make_manager(run, item_names=('state',))
  for step in (1, 2):
    checkpoints.save(manager, step, _state(step), force=True)
    manager.wait_until_finished()
  manager.close()
  # Step 2 as a kill during its write leaves it on object storage: objects, no commit file.
  (storage.path(run) / 'checkpoints' / '2' / checkpoints.COMMIT_FILE).unlink()
  manager = checkpoints.make_manager(run, item_names=('state',))
  assert checkpoints.latest_complete_step(manager) == 1
  assert not (storage.path(run) / 'checkpoints' / '2').exists()  # deleted, not restored
  restored, _ = checkpoints.restore(manager, 1, _abstract())
  np.testing.assert_array_equal(restored['params']['w'], _state(1)['params']['w'])
  manager.close()


def test_params_and_config_round_trip_through_a_bucket(gcs):
  run = f'{gcs}/imported'
  config = ml_collections.ConfigDict({'model': {'hidden_size': 3}})
  step_dir = checkpoints.save_params(run, _state(7)['params'], config, step=7)
  assert step_dir == f'{run}/checkpoints/7'
  assert checkpoints.read_pretraining_config(run)['model'] == {'hidden_size': 3}
  for path in (run, f'{run}/checkpoints', step_dir):
    assert checkpoints.resolve_step_dir(path) == step_dir
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          _state(7)['params'])
  params, missing = checkpoints.restore_params(run, abstract)
  assert missing == []
  np.testing.assert_array_equal(params['w'], _state(7)['params']['w'])
  with pytest.raises(FileNotFoundError, match='nothing_here does not exist; pass a workdir'):
    checkpoints.resolve_step_dir(f'{gcs}/nothing_here')


def test_a_save_of_many_arrays_round_trips(gcs):
  """Orbax's OCDBT store rewrites its manifest under generation preconditions as a save
  grows: a model's worth of arrays (here 120) must survive that against the server."""
  run = f'{gcs}/many'
  tree = {'step': 3, 'params': {f'layer_{i}': {'kernel': jnp.full((8, 8), float(i)),
                                               'bias': jnp.arange(8.0) + i}
                                for i in range(60)}}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.asarray(x).dtype),
                          tree)
  manager = checkpoints.make_manager(run, item_names=('state',))
  checkpoints.save(manager, 3, tree, force=True)
  manager.wait_until_finished()
  restored, _ = checkpoints.restore(manager, 3, abstract)
  for i in (0, 31, 59):
    np.testing.assert_array_equal(restored['params'][f'layer_{i}']['kernel'], float(i))
  manager.close()


def test_the_server_keeps_generation_preconditions(gcs):
  from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
  from google.cloud import storage as gcs_client  # pylint: disable=g-import-not-at-top
  bucket = gcs_client.Client().bucket(gcs[len('gs://'):])
  blob = bucket.blob('preconditions/.lock')
  blob.upload_from_string('first', if_generation_match=0)  # create only if absent
  first = blob.generation
  with pytest.raises(exceptions.PreconditionFailed):
    bucket.blob('preconditions/.lock').upload_from_string('second', if_generation_match=0)
  blob.upload_from_string('refreshed', if_generation_match=first)
  assert blob.generation != first
  with pytest.raises(exceptions.PreconditionFailed):  # a stale holder cannot delete it
    bucket.blob('preconditions/.lock').delete(if_generation_match=first)
  assert bucket.blob('preconditions/.lock').download_as_text() == 'refreshed'
  blob.delete(if_generation_match=blob.generation)
  assert not bucket.blob('preconditions/.lock').exists()


# ---- The lock object of a run directory on Cloud Storage (storage.Lease).

def _lock_blob(url):
  from google.cloud import storage as gcs_client  # pylint: disable=g-import-not-at-top
  bucket, _, name = url[len('gs://'):].partition('/')
  return gcs_client.Client().bucket(bucket).blob(f'{name}/{RunDir.LOCK}')


def _plant_holder(url, **record):
  """A lock object as another run would have left it."""
  holder = {'host': 'elsewhere', 'pid': 1, 'program': 'train.py', 'since': 'then',
            'lease_seconds': storage.LEASE_SECONDS, **record}
  _lock_blob(url).upload_from_string(json.dumps(holder), if_generation_match=0)


def test_a_lock_object_admits_one_run_and_is_released(gcs):
  url = f'{gcs}/locked'
  with workdir.Lock(url, 'train.py'):
    held = json.loads(_lock_blob(url).download_as_text())
    assert held['host'] == socket.gethostname() and held['pid'] == os.getpid()
    with pytest.raises(workdir.WorkdirInUseError,
                       match=rf'in use by pid {os.getpid()} on .*delete {url}/\.lock'):
      with workdir.Lock(url, 'train.py'):
        pass
  assert not _lock_blob(url).exists()  # released: the next run takes it at once
  with workdir.Lock(url, 'train.py'):
    assert _lock_blob(url).exists()


def test_a_dead_holder_is_taken_over_and_a_live_one_is_not(gcs, monkeypatch, caplog):
  # On this host, a process that no longer exists: taken over at once.
  gone = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'],
                        capture_output=True, text=True, check=True)
  url = f'{gcs}/gone'
  _plant_holder(url, host=socket.gethostname(), pid=int(gone.stdout))
  with caplog.at_level('WARNING'):
    with workdir.Lock(url, 'train.py'):
      assert json.loads(_lock_blob(url).download_as_text())['pid'] == os.getpid()
  assert 'that process is gone' in caplog.text
  # The same pid alive in another pid namespace (another container on this host): live.
  url = f'{gcs}/container'
  _plant_holder(url, host=socket.gethostname(), pid=os.getpid(), pid_ns='pid:[1]')
  with pytest.raises(workdir.WorkdirInUseError, match='in use by'):
    with workdir.Lock(url, 'train.py'):
      pass
  # A pid that is gone here, of another machine with this hostname (a cloned VM): live.
  url = f'{gcs}/clone'
  _plant_holder(url, host=socket.gethostname(), pid=int(gone.stdout), boot_id='another-boot')
  with pytest.raises(workdir.WorkdirInUseError, match='in use by'):
    with workdir.Lock(url, 'train.py'):
      pass
  # On another host: refused while its lease runs, whatever this host's clock says (the
  # lease's age is measured on the service's clock) ...
  url = f'{gcs}/elsewhere'
  _plant_holder(url)
  skewed = time.time() + storage.LEASE_SECONDS + 3600
  monkeypatch.setattr(storage.time, 'time', lambda: skewed)
  with pytest.raises(workdir.WorkdirInUseError,
                     match=r'on elsewhere.*wait \d+ s for its lease'):
    with workdir.Lock(url, 'train.py'):
      pass
  monkeypatch.undo()
  # ... and taken over once it has expired (a holder whose lease was one second).
  url = f'{gcs}/expired'
  _plant_holder(url, lease_seconds=1)
  time.sleep(2)
  caplog.clear()
  with caplog.at_level('WARNING'):
    with workdir.Lock(url, 'train.py'):
      pass
  assert 'its lease expired' in caplog.text
  assert [b.name for b in _lock_blob(url).bucket.list_blobs() if '.clock-' in b.name] == []


def test_the_lease_is_refreshed_and_a_lost_one_stops_the_run(gcs, monkeypatch):
  monkeypatch.setattr(storage, 'REFRESH_SECONDS', 0.2)
  url = f'{gcs}/refreshed'
  run = RunDir(url)
  with run.hold('train.py', ml_collections.ConfigDict({'seed': 0})):
    first = _lock_blob(url)
    first.reload()
    deadline = time.time() + 30
    second = _lock_blob(url)
    second.reload()
    while second.generation == first.generation:  # until a refresh rewrites it
      assert time.time() < deadline
      time.sleep(0.1)
      second.reload()
    assert 'renewed' in second.download_as_text()
    run.check_held()
    # Another run takes the lock over (as after a lease that could not be refreshed).
    second.delete()
    _plant_holder(url)
    while run._lock.lost is None:  # pylint: disable=protected-access
      assert time.time() < deadline
      time.sleep(0.1)
    with pytest.raises(workdir.WorkdirInUseError, match='taken over by another run'):
      run.check_held()
  assert json.loads(_lock_blob(url).download_as_text())['host'] == 'elsewhere'  # not deleted


def test_a_write_whose_reply_was_lost_is_recognised_as_the_holders_own(gcs):
  """The retry of a create whose reply was lost fails its precondition against the
  holder's own object: the nonce shows it is ours, so the take succeeds."""
  url = f'{gcs}/retried/.lock'
  lease = storage.Lease(url, storage.holder_record('train.py'))
  from google.cloud import storage as gcs_client  # pylint: disable=g-import-not-at-top
  bucket, _, name = url[len('gs://'):].partition('/')
  gcs_client.Client().bucket(bucket).blob(name).upload_from_string(
      json.dumps(lease.record), if_generation_match=0)  # "the first try", reply lost
  lease.take()
  assert lease.generation is not None and lease.lost is None
  lease.release()
  assert not gcs_client.Client().bucket(bucket).blob(name).exists()


def test_a_refresh_recognised_late_credits_the_lease_from_the_write_that_landed(
    gcs, monkeypatch):
  """A refresh that lands but whose reply is lost, refreshes that fail, then one that
  fails its precondition on the landed write (the nonce: ours): the lease counts from when
  the landed write was sent (the service stamped it then), not from the late attempt, so
  the holder never thinks its lease younger than other hosts see it."""
  monkeypatch.setattr(storage, 'REFRESH_SECONDS', 0.05)
  sent = []

  class Blob:
    def __init__(self, real):
      self._real = real

    def __getattr__(self, name):
      return getattr(self._real, name)

    def upload_from_string(self, *args, **kwargs):
      sent.append(storage.lease_clock())
      if len(sent) == 1:  # lands; the reply is lost
        self._real.upload_from_string(*args, **kwargs)
        raise ConnectionError('reply lost')
      if len(sent) == 4:  # through: its precondition fails on the first one's object
        return self._real.upload_from_string(*args, **kwargs)
      raise ConnectionError('network down')

  class Flaky(storage.Lease):
    def _blob(self):
      return Blob(super()._blob()) if self._thread is not None else super()._blob()

  lease = Flaky(f'{gcs}/late/.lock', storage.holder_record('train.py')).take()
  taken = lease.generation
  deadline = time.time() + 30
  while lease.generation == taken:
    assert time.time() < deadline
    time.sleep(0.02)
  credited = lease._refreshed  # pylint: disable=protected-access
  assert len(sent) >= 4 and credited <= sent[0] < sent[1] < sent[3]
  lease.release()


def test_a_holder_that_cannot_refresh_counts_its_lease_as_lost(gcs, monkeypatch):
  """Also one whose machine slept past the lease: its clock (CLOCK_BOOTTIME on Linux)
  counts the sleep, which time.monotonic does not."""
  if hasattr(time, 'CLOCK_BOOTTIME'):
    assert storage._BOOTTIME == time.CLOCK_BOOTTIME  # pylint: disable=protected-access
  lease = storage.Lease(f'{gcs}/cut_off/.lock', storage.holder_record('train.py')).take()
  assert lease.lost is None
  later = storage.lease_clock() + storage.LEASE_SECONDS
  monkeypatch.setattr(storage, 'lease_clock', lambda: later)
  assert 'could not be refreshed' in lease.lost
  monkeypatch.undo()
  lease.release()


def test_a_refresh_that_fails_after_the_release_says_nothing(gcs, monkeypatch, caplog):
  """A refresh waiting on a storage that went away while the run stopped fails after the
  release: it logs nothing, so the run's one-line error stays the last line it prints."""
  monkeypatch.setattr(storage, 'REFRESH_SECONDS', 0.05)
  url = f'{gcs}/stopping/.lock'
  lease = storage.Lease(url, storage.holder_record('train.py')).take()
  blob, in_flight, stopping = lease._blob, threading.Event(), threading.Event()

  class Unanswered:  # the lock object, whose refresh hangs until the run stops, then fails
    def __getattr__(self, name):
      return getattr(blob(), name)

    def upload_from_string(self, *args, **kwargs):
      del args, kwargs
      in_flight.set()
      stopping.wait(30)
      raise ConnectionError('Connection refused')
  monkeypatch.setattr(lease, '_blob', Unanswered)
  assert in_flight.wait(30)
  caplog.set_level('WARNING', logger='absl')
  threading.Timer(0.5, stopping.set).start()  # the request fails while release() waits
  lease.release()
  lease._thread.join(30)  # pylint: disable=protected-access
  assert not lease._thread.is_alive() and caplog.text == ''  # pylint: disable=protected-access
  assert not blob().exists()  # released: the refresh gave the object back in time


@pytest.mark.parametrize('url,expected', [
    ('gs://bucket', r'give a folder inside the bucket \(e.g. gs://bucket/runs/bert\), not'),
    ('gs://bucket/', 'not the bucket itself'),
    ('gs://bucket/run#2', r'# in a gs:// path is read as URL syntax \(the checkpoints would '
                          r'be written elsewhere\)'),
    ('gs://bucket/a?b/run', r'\? in a gs:// path'),
    ('gs://bucket/runs/*', r'\* in a gs:// path'),
    ('gs://bucket/runs/../bert', r"'..' in a gs:// path names no folder in a bucket"),
    ('gs://bucket/./bert', r"'.' in a gs:// path"),
    ('gs://bucket/runs//bert', '// in a gs:// path names no folder in a bucket'),
    ('gs:/bucket/run', 'a gs:// URL has two slashes; give gs://bucket/run for the bucket, or '
                       r'\./gs:/bucket/run for a local folder'),
    ('gs:bucket/run', 'give gs://bucket/run for the bucket'),
    ('s3://bucket/run', 'object storage is supported for gs://')])
def test_a_url_that_cannot_hold_a_run_is_refused_before_anything_is_written(url, expected):
  """tensorstore ends a gs:// path at # or ?, so a run's arrays would land in another
  folder than its other files; a bucket itself would put the temporary and lock objects
  beside it into other buckets."""
  with pytest.raises(ValueError, match=f"--workdir '?{re.escape(url)}.*{expected}"):
    RunDir(url)
  from data import prepare  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match='the prepared data folder'):
    prepare.prepare(ml_collections.ConfigDict({'data': {}}), url)
  storage.check_location('gs://bucket/runs/bert-base_v2.1', '--workdir')  # fine
  storage.check_location('gs://bucket/runs/bert/', '--workdir')  # a trailing slash too


def test_tensorstore_writes_to_the_endpoint_that_the_other_clients_use(monkeypatch):
  """Orbax's arrays go through tensorstore, which reads TENSORSTORE_GCS_HTTP_URL, not the
  STORAGE_EMULATOR_HOST that gcsfs and google-cloud-storage read: set from it (and following
  it), or refused in one line where a user set them apart."""
  monkeypatch.delenv('TENSORSTORE_GCS_HTTP_URL', raising=False)
  monkeypatch.delenv('REALFORMER_DERIVED_TENSORSTORE_URL', raising=False)
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', '127.0.0.1:4443')
  storage.path('gs://bucket/run')
  assert os.environ['TENSORSTORE_GCS_HTTP_URL'] == 'http://127.0.0.1:4443'
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', 'http://127.0.0.1:5555/')
  storage.check_location('gs://bucket/run', '--workdir')
  assert os.environ['TENSORSTORE_GCS_HTTP_URL'] == 'http://127.0.0.1:5555'
  monkeypatch.delenv('STORAGE_EMULATOR_HOST')
  storage.path('gs://bucket/run')  # Cloud Storage itself, for every client
  assert 'TENSORSTORE_GCS_HTTP_URL' not in os.environ
  storage.path('/tmp/run')  # local paths leave the environment alone
  # A child process of one that derived it gets both variables, and follows them the same.
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', '127.0.0.1:4443')
  storage.path('gs://bucket/run')
  child = subprocess.run([sys.executable, '-c', 'import os; from realformer import storage; '
                          'storage.path("gs://b/r"); print(os.environ.get('
                          '"TENSORSTORE_GCS_HTTP_URL"))'], capture_output=True, text=True,
                         env=dict(os.environ, STORAGE_EMULATOR_HOST=""),
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         check=True)
  assert child.stdout.strip() == 'None'  # the emulator unset there: what was derived goes
  monkeypatch.delenv('STORAGE_EMULATOR_HOST')
  storage.path('gs://bucket/run')
  for emulator, tensorstore in (('127.0.0.1:4443', 'http://10.0.0.1:80'),
                                (None, 'http://127.0.0.1:4443')):
    if emulator:
      monkeypatch.setenv('STORAGE_EMULATOR_HOST', emulator)
    else:
      monkeypatch.delenv('STORAGE_EMULATOR_HOST')
    monkeypatch.setenv('TENSORSTORE_GCS_HTTP_URL', tensorstore)
    with pytest.raises(ValueError, match=f'TENSORSTORE_GCS_HTTP_URL={re.escape(tensorstore)} '
                       f'but STORAGE_EMULATOR_HOST={emulator or "[(]unset[)]"}: the '
                       "checkpoints' arrays would go to another Cloud Storage endpoint"):
      RunDir('gs://bucket/run')
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', 'http://127.0.0.1:4443')
  storage.check_location('gs://bucket/run', '--workdir')  # the user's, the same: kept
  monkeypatch.delenv('STORAGE_EMULATOR_HOST')  # Cloud Storage itself, named: the same service
  monkeypatch.setenv('TENSORSTORE_GCS_HTTP_URL', 'https://storage.googleapis.com/')
  storage.check_location('gs://bucket/run', '--workdir')
  assert os.environ['TENSORSTORE_GCS_HTTP_URL'] == 'https://storage.googleapis.com/'


def test_a_local_write_that_fails_leaves_the_old_file_and_no_partial_one(tmp_path,
                                                                          monkeypatch):
  """write_text replaces a file whole; a write that fails (a full disk) leaves the old file
  and no temporary beside it taking the space."""
  target = tmp_path / 'config.json'
  storage.write_text(target, 'old')

  def full(_):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(storage.os, 'fsync', full)
  with pytest.raises(OSError, match='No space left on device'):
    storage.write_text(target, 'new')
  assert os.listdir(tmp_path) == ['config.json'] and target.read_text() == 'old'


def test_is_file_and_is_dir_in_a_bucket_and_on_disk(gcs, tmp_path):
  """storage.is_file / is_dir (which, unlike gcsfs's isdir, raise when the storage does not
  answer) answer as epath does where it answers."""
  storage.write_text(f'{gcs}/folder/a.txt', 'a')
  (tmp_path / 'folder').mkdir()
  (tmp_path / 'folder' / 'a.txt').write_text('a')
  for root in (gcs, str(tmp_path)):
    assert storage.is_file(f'{root}/folder/a.txt') and not storage.is_dir(f'{root}/folder/a.txt')
    assert storage.is_dir(f'{root}/folder') and not storage.is_file(f'{root}/folder')
    assert not storage.is_file(f'{root}/none') and not storage.is_dir(f'{root}/none')


def test_a_preparation_held_by_another_gatherer_too_long_is_one_line_naming_it(gcs,
                                                                              monkeypatch):
  """A gatherer that waited its time for another's lease on <out_dir>.lock stops with one
  line (a user error, not a traceback) that names the prepared folder, not its parent."""
  from realformer import cli  # pylint: disable=g-import-not-at-top
  from data import prepare  # pylint: disable=g-import-not-at-top
  out_dir = f'{gcs}/prepared/shards'
  other = storage.Lease(f'{out_dir}.lock', storage.holder_record('data.prepare'))
  other.take()
  try:
    monkeypatch.setattr(storage, 'LEASE_SECONDS', 0.2)  # (the wait, not the holder's lease)
    monkeypatch.setattr(prepare, 'POLL_SECONDS', 0.05)
    with pytest.raises(cli.UserError, match=f'^{re.escape(out_dir)} is in use by pid '):
      prepare._gather_objects(  # pylint: disable=protected-access
          None, None, '', out_dir, 1, True, 0.0)
  finally:
    other.release()


def test_a_bucket_folder_holding_other_objects_is_not_taken_for_prepared_data(gcs):
  from data import prepare  # pylint: disable=g-import-not-at-top
  folder = f'{gcs}/shared'
  storage.write_text(f'{folder}/{prepare.METADATA}', '{}')
  storage.write_text(f'{folder}/train-00000-of-00001', '')
  prepare.refuse_other_files(folder)  # a preparation's own objects
  # and the placeholder object that a folder made in the console holds
  storage.gcs_blob(storage.gcs_client(folder), f'{folder}/').upload_from_string(b'')
  prepare.refuse_other_files(folder)
  prepare.refuse_other_files(f'{folder}/')
  storage.write_text(f'{folder}/results.csv', 'kept')
  with pytest.raises(ValueError, match='shared holds 1 files that are not prepared data'):
    prepare.refuse_other_files(folder)
  prepare.refuse_other_files(f'{gcs}/nothing-yet')


def test_a_run_directory_on_a_gcsfuse_mount_is_refused_naming_the_bucket(tmp_path, monkeypatch):
  """/proc/mounts as a host with a gcsfuse mount shows it (no test can mount one): the
  workdir, the prepared data, an import's output and the study's era task on the mount
  are refused, naming the gs:// URL; other
  folders, and a folder under a nested local mount, are not."""
  mounts = tmp_path / 'mounts'
  mounts.write_text(f'/dev/sda1 / ext4 rw 0 0\n'
                    f'my-bucket {tmp_path}/gcs fuse.gcsfuse rw,nosuid,nodev 0 0\n'
                    f'tmpfs {tmp_path}/gcs/scratch tmpfs rw 0 0\n')
  monkeypatch.setattr(storage, 'MOUNTS', str(mounts))
  with pytest.raises(ValueError, match=rf'--workdir {tmp_path}/gcs/runs/a is on a gcsfuse '
                                       r'mount of the bucket my-bucket .*instead: '
                                       r'gs://my-bucket/runs/a$'):
    RunDir(tmp_path / 'gcs' / 'runs' / 'a')
  with pytest.raises(ValueError, match=r'instead: gs://my-bucket/data$'):
    from data import prepare  # pylint: disable=g-import-not-at-top
    prepare.prepare(ml_collections.ConfigDict({'data': {}}), str(tmp_path / 'gcs' / 'data'))
  with pytest.raises(ValueError, match=r'--out .* instead: gs://my-bucket/bert$'):
    from realformer.tools import interop  # pylint: disable=g-import-not-at-top
    interop._new_out(str(tmp_path / 'gcs' / 'bert'))  # an import's output folder
  with pytest.raises(ValueError, match=r'--root .* instead: gs://my-bucket/study/era$'):
    import study  # pylint: disable=g-import-not-at-top
    study.era_task(str(tmp_path / 'gcs' / 'study'))
  assert not (tmp_path / 'gcs').exists()  # nothing written there
  RunDir(tmp_path / 'local')
  RunDir(tmp_path / 'gcs' / 'scratch' / 'run')


def test_a_growing_file_in_a_bucket_appends_only_its_new_bytes(gcs, monkeypatch, tmp_path):
  """The first upload of a start is whole; after it each upload sends only the new bytes and
  composes them onto the object; an object changed meanwhile, and the COMPOSE_LIMIT-th
  append, are rewritten whole from the spool; a resumed run continues the object. The
  spool has no name in the temporary folder: a process killed at any point leaves nothing
  there."""
  from google.cloud.storage import Blob  # pylint: disable=g-import-not-at-top
  spools = tmp_path / 'tmp'
  spools.mkdir()
  monkeypatch.setattr(tempfile, 'tempdir', str(spools))
  sent = []  # ('whole' | 'part', bytes) of each upload
  upload = Blob.upload_from_file

  def spy(self, file_obj, *args, size=None, **kwargs):
    sent.append(('part' if '.append-' in self.name else 'whole', size))
    return upload(self, file_obj, *args, size=size, **kwargs)

  monkeypatch.setattr(Blob, 'upload_from_file', spy)
  monkeypatch.setattr(storage.GrowingFile, 'COMPOSE_LIMIT', 2)
  url = f'{gcs}/growing/metrics.jsonl'
  lines = [f'{{"step": {i}}}\n' for i in range(7)]
  f = storage.GrowingFile(url, upload_every=3600.0)
  f.write(lines[0])
  f.flush()  # within the upload interval: kept in the spool
  assert not storage.path(url).exists() and not sent
  assert list(spools.iterdir()) == []  # (the line is in the spool)
  f.flush(force=True)  # as with each checkpoint
  f.write(lines[1])
  f.flush(force=True)
  f.flush(force=True)  # nothing new: nothing sent
  assert storage.path(url).read_text() == ''.join(lines[:2])
  assert sent == [('whole', len(lines[0])), ('part', len(lines[1]))]
  storage.path(url).write_text('changed by another writer\n')
  f.write(lines[2])
  f.flush(force=True)  # its compose refused: rewritten whole from the spool
  assert storage.path(url).read_text() == ''.join(lines[:3])
  assert sent[-2:] == [('part', len(lines[2])), ('whole', len(''.join(lines[:3])))]
  for line in lines[3:5]:
    f.write(line)
    f.flush(force=True)
  f.write(lines[5])
  f.close()  # the third append since the rewrite: whole again
  assert sent[-3:] == [('part', len(lines[3])), ('part', len(lines[4])),
                       ('whole', len(''.join(lines[:6])))]
  assert storage.path(url).read_text() == ''.join(lines[:6])
  assert [p.name for p in storage.path(url).parent.iterdir()] == ['metrics.jsonl']
  again = storage.GrowingFile(url, upload_every=0.0)  # a resumed run appends to it
  again.write(lines[6])
  again.flush()
  assert storage.path(url).read_text() == ''.join(lines)
  assert sent[-1] == ('whole', len(''.join(lines)))
  assert list(spools.iterdir()) == []  # (its spool open)
  again.close()


def test_a_growing_file_whose_last_upload_failed_sends_it_at_the_next_close(gcs, monkeypatch):
  from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
  from google.cloud.storage import Blob  # pylint: disable=g-import-not-at-top
  url = f'{gcs}/closing/metrics.jsonl'
  f = storage.GrowingFile(url, upload_every=3600.0)
  f.write('{"step": 0}\n')
  def unavailable(*args, **kwargs):
    raise exceptions.ServiceUnavailable('as the service would answer')

  with monkeypatch.context() as m:
    m.setattr(Blob, 'upload_from_file', unavailable)
    with pytest.raises(exceptions.ServiceUnavailable):
      f.close()  # the file stays open, its spool whole
  assert not storage.path(url).exists()
  f.write('{"step": 1}\n')
  f.close()
  assert storage.path(url).read_text() == '{"step": 0}\n{"step": 1}\n'


def test_a_growing_file_whose_append_failed_deletes_its_part_in_one_attempt(gcs, monkeypatch):
  """After a failed request the part's delete is one attempt, not another REQUEST_SECONDS of
  retries before the storage error reaches the run (a stopped service: seconds sooner to the
  one-line error); after an answered one it keeps its retries. The bytes go at the next
  upload."""
  from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
  from google.cloud.storage import Blob  # pylint: disable=g-import-not-at-top
  delete = Blob.delete
  retries = []

  def recording_delete(self, *args, **kwargs):
    retries.append(kwargs.get('retry'))
    return delete(self, *args, **kwargs)

  def unavailable(self, *args, **kwargs):
    raise exceptions.ServiceUnavailable('as the service would answer')

  monkeypatch.setattr(Blob, 'delete', recording_delete)
  url = f'{gcs}/failing/metrics.jsonl'
  lines = [f'{{"step": {i}}}\n' for i in range(3)]
  f = storage.GrowingFile(url, upload_every=3600.0)
  f.write(lines[0])
  f.flush(force=True)  # whole: no part
  f.write(lines[1])
  with monkeypatch.context() as m:
    m.setattr(Blob, 'compose', unavailable)  # after the part has landed
    with pytest.raises(exceptions.ServiceUnavailable):
      f.flush(force=True)
  assert retries == [None]
  assert [p.name for p in storage.path(url).parent.iterdir()] == ['metrics.jsonl']  # deleted
  assert storage.path(url).read_text() == lines[0]
  f.write(lines[2])
  f.flush(force=True)  # what the failed append lacked, and the new line
  assert storage.path(url).read_text() == ''.join(lines)
  assert len(retries) == 2 and retries[1] is not None  # an answered append: retried deletes
  f.close()


def test_a_growing_file_recovers_from_lost_replies_and_a_deleted_object(gcs, monkeypatch):
  """A part upload and a compose that landed but whose replies were lost (the client's retry
  then fails its precondition), and the object deleted by someone (Cloud Storage answers the
  compose of a missing source with 404): the object still ends as the spool's bytes,
  nothing doubled, no part left beside it."""
  from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
  from google.cloud.storage import Blob  # pylint: disable=g-import-not-at-top
  upload, compose = Blob.upload_from_string, Blob.compose
  calls = []

  def then_raise(real, error):
    def call(self, *args, **kwargs):
      calls.append(real and real.__name__)
      if real is not None:
        real(self, *args, **kwargs)  # it lands; the reply is lost
      raise error('as the service would answer')
    return call

  url = f'{gcs}/recovering/metrics.jsonl'
  lines = [f'{{"step": {i}}}\n' for i in range(4)]
  f = storage.GrowingFile(url, upload_every=3600.0)
  f.write(lines[0])
  f.flush(force=True)
  with monkeypatch.context() as m:
    m.setattr(Blob, 'upload_from_string', then_raise(upload, exceptions.PreconditionFailed))
    f.write(lines[1])
    f.flush(force=True)  # the part is ours: composed
  assert storage.path(url).read_text() == ''.join(lines[:2])
  with monkeypatch.context() as m:
    m.setattr(Blob, 'compose', then_raise(compose, exceptions.PreconditionFailed))
    f.write(lines[2])
    f.flush(force=True)  # its compose seen as refused: rewritten whole, not appended twice
  assert storage.path(url).read_text() == ''.join(lines[:3])
  storage.path(url).unlink()
  with monkeypatch.context() as m:
    m.setattr(Blob, 'compose', then_raise(None, exceptions.NotFound))
    f.write(lines[3])
    f.flush(force=True)  # the object is gone: rewritten whole
  assert calls == ['upload_from_string', 'compose', None]
  f.close()
  assert storage.path(url).read_text() == ''.join(lines)
  assert [p.name for p in storage.path(url).parent.iterdir()] == ['metrics.jsonl']


def test_a_tokenizer_in_a_bucket_is_read_through_a_checked_local_copy(gcs):
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  local = tokenizer_lib.Tokenizer.load(tokenizer_lib.EMBEDDED_TOKENIZER)
  url = f'{gcs}/tokenizers/{os.path.basename(tokenizer_lib.EMBEDDED_TOKENIZER)}'
  with open(tokenizer_lib.EMBEDDED_TOKENIZER, 'rb') as f:
    storage.path(url).write_bytes(f.read())
  remote = tokenizer_lib.Tokenizer.load(url)
  assert remote.vocab_size == local.vocab_size
  assert remote.encode('the residual attention') == local.encode('the residual attention')
  with pytest.raises(FileNotFoundError, match='not found'):
    tokenizer_lib.Tokenizer.load(f'{gcs}/tokenizers/missing.model')
  # A WordPiece vocab.txt comes with the tokenizer_config.json beside it (its casing), and a
  # run directory in a bucket keeps both beside its config.json (checkpoints.keep_tokenizer).
  pieces = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', 'Hello', 'hello', 'world']
  for name, text in (('vocab.txt', '\n'.join(pieces) + '\n'),
                     ('tokenizer_config.json', '{"do_lower_case": false}')):
    storage.path(f'{gcs}/cased/{name}').write_text(text)
  cased = tokenizer_lib.Tokenizer.load(f'{gcs}/cased/vocab.txt')
  assert cased.encode('Hello hello') == [5, 6]
  config = ml_collections.ConfigDict({'data': {'tokenizer': f'{gcs}/cased/vocab.txt'}})
  checkpoints.write_config(f'{gcs}/run', config)
  kept = checkpoints.kept_tokenizer(f'{gcs}/run', config.data.tokenizer)
  assert kept == f'{gcs}/run/vocab.txt'
  assert tokenizer_lib.Tokenizer.load(kept).encode('Hello hello') == [5, 6]
  storage.path(f'{gcs}/cased/tokenizer_config.json').unlink()  # (now lower-cased)
  assert tokenizer_lib.Tokenizer.load(f'{gcs}/cased/vocab.txt').encode('Hello') == [6]


def test_a_copy_of_a_composite_object_is_checked_by_its_crc32c(gcs, monkeypatch):
  """A composite object (a parallel upload's, a log's appends) has no MD5 in the listing:
  local_copy checks its CRC32C, so a download that differs is an error, not a silent copy."""
  url = f'{gcs}/composite'
  for name in ('a', 'b'):
    storage.path(f'{url}/{name}').write_bytes(b'0123456789' * 100)
  real, checked = storage._fs(url), []

  class WithoutMd5:  # the listing of composite objects
    corrupt = False

    def ls(self, path, detail=True):
      return [{k: v for k, v in e.items() if k != 'md5Hash'}
              for e in real.ls(path, detail=detail)]

    def get_file(self, src, dst):
      real.get_file(src, dst)
      if self.corrupt:  # a byte changed on the way, the size the same
        data = bytearray(open(dst, 'rb').read())
        data[7] ^= 1
        open(dst, 'wb').write(bytes(data))

  fs = WithoutMd5()
  crc32c = storage._crc32c
  monkeypatch.setattr(storage, '_fs', lambda u: fs)
  monkeypatch.setattr(storage, '_crc32c', lambda p: checked.append(p) or crc32c(p))
  local = storage.local_copy(url, ['a'], kind='composite')
  assert open(os.path.join(local, 'a'), 'rb').read() == b'0123456789' * 100 and checked
  fs.corrupt = True
  with pytest.raises(OSError, match=r'copy of .*/composite/b differs from the object \(size or '
                     r'checksum\)'):
    storage.local_copy(url, ['b'], kind='composite')
  assert not os.path.exists(os.path.join(local, 'b'))


def test_a_fine_tuning_grid_rooted_in_a_bucket_summarizes_there(gcs):
  """finetune_grid --root gs://...: the finished runs' results read from the bucket, the
  best setting marked, results.csv and results.md written there."""
  from tests import test_finetune  # pylint: disable=g-import-not-at-top
  test_finetune.check_grid_summary(f'{gcs}/grid')


def test_a_vocabulary_is_learned_from_files_in_a_bucket(gcs, tmp_path, capsys):
  """python -m data.tokenizer --input gs://...: the same pieces as from the same files on disk;
  a missing object is the one-line error of a missing file."""
  import gzip  # pylint: disable=g-import-not-at-top
  import itertools  # pylint: disable=g-import-not-at-top
  from data import sources  # pylint: disable=g-import-not-at-top
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  docs = itertools.islice(sources.iter_documents('embedded'), 100, 104)
  lines = [s for doc in docs for s in doc][:300]
  files = {'a.txt.gz': gzip.compress(('\n'.join(lines[:150]) + '\n').encode()),
           'b.txt': ('\n'.join(lines[150:]) + '\n').encode()}
  for name, data in files.items():
    (tmp_path / name).write_bytes(data)
    storage.path(f'{gcs}/vocab_input/{name}').write_bytes(data)
  for where, prefix in ((str(tmp_path), 'local'), (f'{gcs}/vocab_input', 'bucket')):
    tokenizer_lib.main(['--input', f'{where}/a.txt.gz', f'{where}/b.txt', '--model_prefix',
                        str(tmp_path / prefix), '--vocab_size', '500'])
  local, bucket = (tokenizer_lib.Tokenizer.load(str(tmp_path / f'{prefix}.model'))
                   for prefix in ('local', 'bucket'))
  assert ([local.id_to_piece(i) for i in range(local.vocab_size)] ==
          [bucket.id_to_piece(i) for i in range(bucket.vocab_size)])
  with pytest.raises(SystemExit) as exit_info:
    tokenizer_lib.main(['--input', f'{gcs}/vocab_input/none.txt', '--model_prefix', 'x'])
  assert exit_info.value.code == 1
  assert f'input files not found: {gcs}/vocab_input/none.txt' in capsys.readouterr().err


def test_a_corpus_in_a_bucket_reads_as_the_same_files_on_disk(gcs, tmp_path):
  """files:<glob> on gs://: the same documents (a gzip file among them), the same signature
  (names and sizes), and the same one-line error for a glob that matches nothing."""
  import gzip  # pylint: disable=g-import-not-at-top
  from data import sources  # pylint: disable=g-import-not-at-top
  texts = {'a.txt': 'One sentence.\nTwo.\n\nAnother document.\n',
           'b.txt.gz': gzip.compress(b'Zipped line one.\nZipped two.\n\nLast doc.\n')}
  for name, text in texts.items():
    data = text if isinstance(text, bytes) else text.encode()
    (tmp_path / name).write_bytes(data)
    storage.path(f'{gcs}/corpus/{name}').write_bytes(data)
  local, remote = f'files:{tmp_path}/*.txt*', f'files:{gcs}/corpus/*.txt*'
  assert list(sources.iter_documents(remote)) == list(sources.iter_documents(local))
  assert len(list(sources.iter_documents(remote))) == 4
  assert sources.files_signature(remote) == sources.files_signature(local) is not None
  with pytest.raises(FileNotFoundError, match=rf'files:{gcs}/corpus/\*.md matches no file'):
    list(sources.iter_documents(f'files:{gcs}/corpus/*.md'))


def test_storage_faults_are_told_from_this_codes_own_errors(monkeypatch):
  import aiohttp  # pylint: disable=g-import-not-at-top
  from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
  down = aiohttp.ClientConnectionError('Cannot connect to host 127.0.0.1:9')
  assert storage.fault(down) is down
  try:
    try:
      raise down
    except aiohttp.ClientConnectionError as e:
      raise RuntimeError('the save failed') from e
  except RuntimeError as wrapped:
    assert storage.fault(wrapped) is down
  forbidden = OSError('Forbidden: gs://bucket/run/metrics.jsonl')
  assert storage.fault(forbidden) is forbidden and storage.refused(forbidden)
  assert storage.refused(exceptions.Forbidden('no access'))
  for own in (BrokenPipeError(), ConnectionResetError(), TimeoutError('workers'),
              OSError(28, 'No space left on device'), ValueError('bad config')):
    assert storage.fault(own) is None, own
  # The same HTTP clients fetch datasets (tfds's downloads, the Hugging Face hub): their
  # errors name another host, and the one-line error wrapping them is what the user reads.
  import requests  # pylint: disable=g-import-not-at-top
  pool = "HTTPSConnectionPool(host='{}', port=443): Max retries exceeded"
  for host, is_storage in (('dl.fbaipublicfiles.com', False), ('huggingface.co', False),
                           ('storage.googleapis.com', True), ('oauth2.googleapis.com', True),
                           ('accounts.google.com', True), ('metadata.google.internal', True),
                           ('127.0.0.1', True)):
    try:
      try:
        raise requests.ConnectionError(pool.format(host))
      except requests.ConnectionError as e:
        raise ValueError('tfds could not load glue/rte; without network, pass ...') from e
    except ValueError as wrapped:
      assert (storage.fault(wrapped) is not None) == is_storage, host
  other = aiohttp.ClientConnectionError('Cannot connect to host huggingface.co:443 ssl:default')
  assert storage.fault(other) is None
  emulator = aiohttp.ClientConnectionError('Cannot connect to host fake-gcs:4443 ssl:default')
  assert storage.fault(emulator) is None  # (no emulator set: another service)
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', 'http://fake-gcs:4443')
  assert storage.fault(emulator) is emulator
  try:  # a bug of ours raised while handling a storage error, the context suppressed
    try:
      raise down
    except aiohttp.ClientConnectionError:
      raise KeyError('bug') from None
  except KeyError as bug:
    assert storage.fault(bug) is None


def test_squad_and_glue_files_in_a_bucket_read_as_on_disk(gcs):
  from data import glue  # pylint: disable=g-import-not-at-top
  from data import squad  # pylint: disable=g-import-not-at-top
  here = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data')
  local = os.path.join(here, 'squad', 'dev-v2.0.json')
  with open(local, 'rb') as f:
    storage.path(f'{gcs}/squad/v2.0.json').write_bytes(f.read())
  assert squad.read_json(f'{gcs}/squad/v2.0.json') == squad.read_json(local)
  storage.copy_tree(os.path.join(here, 'glue', 'CoLA'), f'{gcs}/glue/CoLA')
  assert (glue.read_tsv('cola', f'{gcs}/glue', 'train') ==
          glue.read_tsv('cola', os.path.join(here, 'glue'), 'train'))


def test_a_release_interrupting_a_release_does_not_hang(gcs):
  """SIGTERM's handler releases the lock; if it lands while this thread is inside a request
  on the lock object (holding its _io), the release goes ahead instead of waiting forever."""
  lease = storage.Lease(f'{gcs}/reentrant/.lock', storage.holder_record('train.py')).take()
  with lease._io:  # pylint: disable=protected-access  (as the interrupted release holds it)
    lease.release()
  assert lease.generation is None
  assert not storage.path(f'{gcs}/reentrant/.lock').exists()


@pytest.mark.parametrize('write', ['lock', 'file'])
def test_a_bucket_that_does_not_exist_is_one_line_naming_it(gcs, write, capsys):
  """A write into a missing bucket: storage answers 'not found' (the lock object through
  google-cloud-storage, a file through gcsfs); the line names the bucket and the fix, not an
  outage to wait out or a bare URL."""
  from realformer import cli  # pylint: disable=g-import-not-at-top
  url = 'gs://no-such-bucket/run'

  def main():
    if write == 'lock':
      with workdir.Lock(url):
        pass
    else:
      storage.write_text(f'{url}/config.json', '{}')
  with pytest.raises(SystemExit):
    cli.run_main(main)
  assert capsys.readouterr().err.strip() == (
      "error: the bucket gs://no-such-bucket does not exist, or this machine's account cannot "
      'see it; create it (gcloud storage buckets create gs://no-such-bucket) or fix the URL')


def test_checkpoints_that_cannot_be_listed_are_an_error_not_none(gcs, monkeypatch):
  """A run folder without checkpoints has none; one whose listing fails (gcsfs answers
  is_dir() False while the storage does not answer) is an error, never "no checkpoint",
  which would restart a run from step 0 or drop a finished run's best params."""
  workdir = f'{gcs}/listing'
  assert checkpoints.complete_steps(workdir) == []
  root = storage.path(workdir) / RunDir.CHECKPOINTS
  monkeypatch.setattr(type(root), 'is_dir', lambda self: False)

  def down(self):
    raise OSError('Cannot connect to host 127.0.0.1')
  monkeypatch.setattr(type(root), 'iterdir', down)
  with pytest.raises(OSError, match='Cannot connect'):
    checkpoints.complete_steps(workdir)


def test_a_checkpoint_in_a_bucket_that_refuses_is_a_refusal_not_a_missing_one(gcs,
                                                                           monkeypatch):
  """A bucket this user may not read (gcsfs answers is_dir() and is_file() False for a
  refusal as for an absence): an init checkpoint or a fine-tuning's encoder there is the
  service's refusal, which the command line reports as such, not "does not exist"."""
  run = f'{gcs}/refused'
  fs = storage._fs(run)  # pylint: disable=protected-access  (fsspec's instance, cached)

  def refused(*_, **__):
    raise OSError('Forbidden: the caller does not have storage.objects.get access')
  for name in ('is_dir', 'is_file'):
    monkeypatch.setattr(type(storage.path(run)), name, lambda self: False)
  monkeypatch.setattr(fs, 'info', refused)
  for read in (checkpoints.resolve_step_dir, checkpoints.read_pretraining_config):
    with pytest.raises(OSError, match='Forbidden') as e:
      read(run)
    assert storage.fault(e.value) is not None


def test_a_restart_over_an_uncommitted_step_in_a_bucket_starts_cleanly(gcs):
  """A kill during a run's first save in a bucket leaves the step's objects without their
  commit file: the next start deletes them before its manager lists the folder (orbax's
  background clean-up could empty the folder under the listing) and finds no checkpoint."""
  for i in range(3):
    run = f'{gcs}/uncommitted{i}'
    manager = checkpoints.make_manager(run, item_names=('state',))
    checkpoints.save(manager, 5, {'step': 5, 'params': {'w': jnp.ones((2, 3))}}, force=True)
    manager.wait_until_finished()
    manager.close()
    (storage.path(run) / RunDir.CHECKPOINTS / '5' / checkpoints.COMMIT_FILE).unlink()
    manager = checkpoints.make_manager(run, item_names=('state',))
    assert checkpoints.latest_complete_step(manager) is None
    assert not (storage.path(run) / RunDir.CHECKPOINTS / '5').exists()
    manager.close()


def test_a_compilation_cache_entry_in_a_bucket_that_cannot_be_read_is_replaced(gcs):
  """An object is stored whole, but one left unreadable in the bucket (by a writer without
  compile_cache.WholeEntries, or damaged) counts as missing, and the next put replaces it
  where jax's own put would keep it."""
  from jax._src import compilation_cache as jax_cache  # pylint: disable=g-import-not-at-top
  from realformer.train import compile_cache  # pylint: disable=g-import-not-at-top
  folder = f'{gcs}/programs'
  cache = compile_cache.WholeEntries(folder, max_size=-1)
  whole = jax_cache.compress_executable(b'a program' * 100)
  storage.path(f'{folder}/k-cache').write_bytes(whole[:len(whole) // 2])
  assert cache.get('k') is None
  cache.put('k', whole)
  assert cache.get('k') == whole and storage.path(f'{folder}/k-cache').read_bytes() == whole
