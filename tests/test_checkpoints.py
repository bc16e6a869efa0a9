"""Checkpoints: exact resume after SIGTERM and after SIGKILL, half-written steps never
restored, two processes training and resuming together, params-only partial restore and
clear errors for a checkpoint that does not match the model."""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import flax.linen as nn
import jax
import numpy as np
import pytest

import train
from realformer import models
from realformer.train import checkpoints
from realformer.train import machine
from realformer.train import pretraining
from realformer.train import train_lib
from realformer.train.run_dir import RunDir
from tests.conftest import cpu_xla_flags
from tests.gcs_server import free_port
from tests.test_train import REPO, losses, tiny_config

NUM_STEPS = 8
DEVICES = 2  # data parallel over 2 devices: cheaper to compile than 8, still sharded

# Runs train.train_and_evaluate(tiny_config(**overrides)) in a fresh process. With
# kill_after=k it SIGKILLs itself right after step k, once checkpoint `kill_when` is final.
_CHILD = r'''
import json, os, signal, sys, time
sys.path.insert(0, {repo!r})
args = json.loads({args!r})
import train
from realformer.train import distributed
from realformer.train import train_lib
from tests.test_train import tiny_config
if args.get('num_processes'):
  distributed.maybe_initialize(args['coordinator'], args['num_processes'],
                               args['process_id'])
  if args.get('sigterm_at_start') == args['process_id']:  # before restoring and compiling
    os.kill(os.getpid(), signal.SIGTERM)
if args.get('kill_after'):
  make_step = train_lib.make_train_step
  def killing_make_step(*a, **kw):
    step_fn, count = make_step(*a, **kw), [0]
    def step(state, batch, *rest):
      out = step_fn(state, batch, *rest)
      count[0] += 1
      if count[0] == args['kill_after']:
        marker = os.path.join(args['workdir'], 'checkpoints', str(args['kill_when']),
                              'commit_success.txt')
        while not os.path.exists(marker):
          time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
      return out
    return step
  train_lib.make_train_step = killing_make_step
summary = train.train_and_evaluate(tiny_config(**args['train']), args['workdir'])
if 'preempted' in summary:  # (train.py's main exits with the not-finished status here)
  print('preempted: saved step', summary['preempted'])
'''


def child(args, devices=DEVICES):
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS=cpu_xla_flags(devices))
  code = _CHILD.format(repo=REPO, args=json.dumps(args))
  return subprocess.Popen([sys.executable, '-c', code], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run(config, workdir):
  return train.train_and_evaluate(config, str(workdir), devices=jax.devices()[:DEVICES])


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """An uninterrupted run of NUM_STEPS steps (dropout on: resume must redraw the masks)."""
  workdir = tmp_path_factory.mktemp('reference')
  summary = run(tiny_config(num_steps=NUM_STEPS, eval_steps=1), workdir)
  got = losses(workdir)
  assert sorted(got) == list(range(1, NUM_STEPS + 1))
  assert losses(workdir, 'eval', 'mlm_accuracy') == {NUM_STEPS: summary['eval']['mlm_accuracy']}
  return workdir, got


def assert_same_losses(workdir, want, rtol=1e-6):
  got = losses(workdir)
  assert sorted(got) == sorted(want)
  np.testing.assert_allclose([got[s] for s in sorted(want)], [want[s] for s in sorted(want)],
                             rtol=rtol)


def test_sigterm_saves_current_step_and_resume_is_exact(tmp_path, reference, monkeypatch):
  make_step = train_lib.make_train_step

  def terminating_make_step(*a, **kw):
    step_fn, count = make_step(*a, **kw), [0]

    def step(state, batch, *rest):
      count[0] += 1
      if count[0] == 3:
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's preemption notice
      return step_fn(state, batch, *rest)
    return step

  monkeypatch.setattr(train_lib, 'make_train_step', terminating_make_step)
  assert run(tiny_config(num_steps=NUM_STEPS), tmp_path)['preempted'] == 3  # not finished
  assert checkpoints.latest_complete_step(checkpoints.make_manager(str(tmp_path))) == 3
  assert max(losses(tmp_path)) == 3
  monkeypatch.setattr(train_lib, 'make_train_step', make_step)
  run(tiny_config(num_steps=NUM_STEPS), tmp_path)
  assert_same_losses(tmp_path, reference[1])
  # Each start appended the machine it ran on (a resumed run lists every machine).
  starts = [json.loads(l) for l in open(tmp_path / RunDir.MACHINE)]
  assert len(starts) == 2 and all(s['cpu'] == machine.cpu() for s in starts), starts
  assert starts[0]['jax'] == jax.__version__ and starts[0]['devices'] == jax.device_count()


def _truncate_largest(folder):
  path = max((p for p in folder.rglob('*') if p.is_file()), key=lambda p: p.stat().st_size)
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


@pytest.mark.parametrize('damage', [
    lambda step: _truncate_largest(step / 'state'),  # bit rot, a copy cut short
    lambda step: shutil.rmtree(step / 'data'),  # a file deleted by hand
    lambda step: (step / 'state' / '_METADATA').unlink()])
def test_a_damaged_checkpoint_is_one_line_naming_the_step_to_resume_from(reference, tmp_path,
                                                                       damage):
  """A complete checkpoint (committed) that cannot be read back stops the resume in one line
  naming it and the older step a resume takes once it is moved aside; nothing is deleted."""
  workdir = tmp_path / 'w'
  shutil.copytree(reference[0], workdir)
  shutil.copytree(workdir / 'checkpoints' / str(NUM_STEPS), workdir / 'checkpoints' / '4')
  damage(workdir / 'checkpoints' / str(NUM_STEPS))
  with pytest.raises(ValueError, match=rf'^checkpoint {workdir}/checkpoints/{NUM_STEPS} cannot '
                     r'be read back \(\w+: .+\): a file of it is damaged or missing .*move that '
                     rf'folder out of checkpoints/ \(to {workdir}/unreadable-{NUM_STEPS}, say\) '
                     r'to resume from step 4$'):
    run(tiny_config(num_steps=NUM_STEPS, eval_steps=1), workdir)
  assert checkpoints.complete_steps(workdir) == [4, NUM_STEPS]  # (all kept)


def test_a_restore_that_runs_out_of_memory_is_not_called_damage(tmp_path):
  """Memory that runs out while a checkpoint is restored keeps its own error: no other step
  would fit better, and the checkpoint is sound."""
  for e in (RuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB'),
            MemoryError(), KeyboardInterrupt()):
    assert checkpoints.unreadable(str(tmp_path), 8, e) is e
  assert 'cannot be read back (KeyError: ' in str(
      checkpoints.unreadable(str(tmp_path), 8, KeyError('Item "data" was not found')))


def test_a_save_that_failed_in_the_background_stops_the_run_at_the_next_log(tmp_path,
                                                                          monkeypatch):
  """A checkpoint's save fails after the step went on (a disk that filled): the run stops at
  its next logged step, not at its next save (2000 steps on, say, all of them lost)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  failed = []

  def check_for_errors(manager):
    if manager.latest_step() is not None:  # (the save of step 2 has run)
      failed.append(True)
      raise ValueError('RESOURCE_EXHAUSTED: [OS error 28: No space left on device]')
  monkeypatch.setattr(ocp.CheckpointManager, 'check_for_errors', check_for_errors)
  config = tiny_config(num_steps=6, checkpoint_every_steps=2)
  config.train.log_every_steps = 1
  with pytest.raises(ValueError, match='No space left on device'):
    run(config, tmp_path / 'w')
  assert failed and max(losses(tmp_path / 'w')) == 2  # stopped at step 3's log, not at 4


def test_sigkill_then_resume_is_exact_and_half_written_steps_are_ignored(tmp_path, reference):
  proc = child({'workdir': str(tmp_path), 'kill_after': 5, 'kill_when': 3,
                'train': {'num_steps': NUM_STEPS, 'checkpoint_every_steps': 3}})
  out = proc.communicate(timeout=300)[0]
  assert proc.returncode == -signal.SIGKILL, out[-3000:]
  ckpt = tmp_path / 'checkpoints'
  assert sorted(os.listdir(ckpt)) == ['3']
  # What a crash mid-save leaves: orbax's tmp directory, and a step directory without the
  # commit marker (e.g. a partial copy). Neither may be restored.
  for name in ('6.orbax-checkpoint-tmp-1234', '7'):
    os.makedirs(ckpt / name / 'state')
    (ckpt / name / 'state' / 'garbage').write_text('half written')
  before = losses(tmp_path)
  assert sorted(before) == [1, 2, 3, 4]  # killed inside step 5, after its checkpoint at 3
  with open(tmp_path / 'metrics.jsonl') as f:
    lines_before = len(f.readlines())
  run(tiny_config(num_steps=NUM_STEPS, checkpoint_every_steps=3), tmp_path)
  with open(tmp_path / 'metrics.jsonl') as f:
    start, *resumed = [json.loads(line) for line in f.readlines()[lines_before:]]
  assert start == {'step': 3, 'split': 'start'}  # restarted after step 3, not 6 or 7
  assert min(r['step'] for r in resumed) == 4
  assert_same_losses(tmp_path, reference[1])
  assert sorted(os.listdir(ckpt)) == ['3', '6', '8']


def test_two_processes_train_checkpoint_and_resume_together(tmp_path, reference):
  """Two CPU processes with one device each (gloo collectives) = the 2-device reference,
  through a preemption: a resumed run whose process 0 gets SIGTERM before its loop (while
  it restores and compiles; jax's preemption notifier owns the signal) saves at its first
  step on both processes and exits with the not-finished status, and the next launch goes
  on from there."""
  def launch(num_steps, **args):
    port = free_port()
    procs = [child({'workdir': str(tmp_path), 'coordinator': f'localhost:{port}',
                    'num_processes': 2, 'process_id': i, **args,
                    'train': {'num_steps': num_steps, 'checkpoint_every_steps': 2}},
                   devices=DEVICES // 2)
             for i in range(2)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outs):
      assert p.returncode == 0, out[-3000:]
    return outs

  launch(4)
  assert sorted(losses(tmp_path)) == [1, 2, 3, 4]
  for out in launch(NUM_STEPS, sigterm_at_start=0):  # resumes from step 4, stops after 5
    assert 'preempted: saved step 5' in out, out[-3000:]
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2', '4', '5']
  launch(NUM_STEPS)  # resumes from step 5
  assert_same_losses(tmp_path, reference[1], rtol=2e-5)
  assert '8' in os.listdir(tmp_path / 'checkpoints')


def two_processes(script: str, workdir, returncodes=(0, 0)) -> list:
  """The outputs of `script` (formatted with repo, coordinator, pid and workdir) run as
  processes 0 and 1 of one job, one CPU device each; they must exit with `returncodes`
  within 2 minutes (a process left waiting in a collective for the other fails the test)."""
  port = free_port()
  procs = [subprocess.Popen(
      [sys.executable, '-c', script.format(repo=REPO, coordinator=f'localhost:{port}',
                                           pid=pid, workdir=str(workdir))],
      cwd=REPO, env=dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=cpu_xla_flags(1)),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
  try:
    outs = [p.communicate(timeout=120)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, out, code in zip(procs, outs, returncodes):
    assert p.returncode == code, out[-3000:]
  return outs


_LISTING = r'''
import sys
sys.path.insert(0, {repo!r})
from realformer.train import checkpoints, distributed
distributed.maybe_initialize({coordinator!r}, 2, {pid})
if {pid} == 1:  # this host lists the folder before step 4 is committed
  complete = checkpoints.is_complete
  checkpoints.is_complete = lambda d: complete(d) and not str(d).endswith('4')
print('resolved', checkpoints.resolve_step_dir({workdir!r}))
'''


def test_every_process_reads_the_step_process_0_found(tmp_path):
  """An init checkpoint of a run still training: a step committed between two hosts'
  listings is the newest for one only; both read process 0's (a mix of steps across the
  shards would go unnoticed)."""
  for step in (2, 4):
    os.makedirs(tmp_path / 'checkpoints' / str(step))
    (tmp_path / 'checkpoints' / str(step) / checkpoints.COMMIT_FILE).write_text('')
  for out in two_processes(_LISTING, tmp_path):
    assert f'resolved {tmp_path / "checkpoints" / "4"}' in out, out[-3000:]


_ONE_HOSTS_DISK = r'''
import sys
sys.path.insert(0, {repo!r})
from etils import epath
from realformer.train import checkpoints, distributed
distributed.maybe_initialize({coordinator!r}, 2, {pid})
if {pid} == 1:  # the folder is on the other host's own disk
  checkpoints.storage.path = lambda p: epath.Path('/nonexistent' + str(p))
try:
  checkpoints.resolve_step_dir({workdir!r})
except FileNotFoundError as e:
  print('error', e)
'''


def test_a_checkpoint_one_process_cannot_read_is_an_error_on_every_process(tmp_path):
  """An init checkpoint in a folder of one host's own disk: every process says so in one
  line (the others waited for the one that did not see it at the step's agreement, until
  jax's coordination service gave up)."""
  os.makedirs(tmp_path / 'checkpoints' / '2')
  (tmp_path / 'checkpoints' / '2' / checkpoints.COMMIT_FILE).write_text('')
  for out in two_processes(_ONE_HOSTS_DISK, tmp_path):
    assert (f'error checkpoint {tmp_path} is not the same folder on every process (none on '
            "process 1 of 2: a folder on one host's own disk?); put it where every host reads "
            'it' in out), out[-3000:]


_PROCESS_ZERO_FAILS = r'''
import sys
sys.path.insert(0, {repo!r})
from realformer import storage
from realformer.train import checkpoints, distributed, machine, metrics, metrics_jsonl
from realformer.train.run_dir import RunDir
distributed.maybe_initialize({coordinator!r}, 2, {pid})
run = RunDir({workdir!r})
def refused(*args, **kwargs):
  raise OSError('no space left on the device')
tensorboard, flush = metrics.TensorBoardWriter, metrics_jsonl.JsonlWriter.flush
if {pid} == 0:  # every write of process 0's fails (a full disk, a bucket that stopped answering)
  storage.write_text = machine.record = metrics.TensorBoardWriter = refused
  type(run.path()).rmtree = type(run.path()).unlink = refused
for what, action in [
    ('json', lambda: run.write_json('results.json', dict(a=1))),
    ('machine', run.record_machine),
    ('open', lambda: run.metric_writer(0)),
    ('remove', lambda: run.remove('best')),
    ('marker', lambda: checkpoints.delete_step(checkpoints.make_manager({workdir!r}), 3))]:
  try:
    action()
  except Exception as e:
    print(what, 'error', type(e).__name__, e)
if {pid} == 0:  # the logs open, then their upload with a checkpoint fails
  metrics.TensorBoardWriter = tensorboard
  metrics_jsonl.JsonlWriter.flush = lambda self, force=False: (refused() if force else
                                                                flush(self, force))
writer = run.metric_writer(0)
writer.write_scalars(1, dict(loss=1.0))
try:
  writer.flush(force=True)
except Exception as e:
  print('flush error', type(e).__name__, e)
print('all done')
'''


def test_a_write_that_fails_on_process_0_stops_every_process_in_one_line(tmp_path):
  """The run's small files, its logs, a clean-up and a checkpoint's marker: process 0 writes
  them, and when its write fails every process raises, process 0 its own error and the others
  a line naming what it failed to do (they ran on into the next step's collective and waited
  there for ever)."""
  os.makedirs(tmp_path / 'best')
  os.makedirs(tmp_path / 'checkpoints' / '3')
  (tmp_path / 'checkpoints' / '3' / checkpoints.COMMIT_FILE).write_text('')
  zero, one = two_processes(_PROCESS_ZERO_FAILS, tmp_path)
  for out in (zero, one):
    assert 'all done' in out, out[-3000:]
  refused = 'error OSError no space left on the device'
  for what, done in [('json', f'write {tmp_path}/results.json'),
                     ('machine', f'write {tmp_path}/machine.jsonl'),
                     ('open', f'open the logs of {tmp_path}'),
                     ('remove', f'remove {tmp_path}/best'),
                     ('marker', f'delete {tmp_path}/checkpoints/3/{checkpoints.COMMIT_FILE}'),
                     ('flush', f'write the logs of {tmp_path}')]:
    assert f'{what} {refused}' in zero, (what, zero[-3000:])
    assert (f'{what} error ProcessFailed process 0 failed to {done}; its log says why'
            in one), (what, one[-3000:])


_ONE_HOST_FAILS = r'''
import sys
sys.path.insert(0, {repo!r})
from realformer.train import distributed
distributed.maybe_initialize({coordinator!r}, 2, {pid})
def read():
  if {pid} == 1:  # a file of the other host's disk
    raise FileNotFoundError('no such file: vocab.txt')
try:
  distributed.on_every_process(read, 'read the vocabulary')
except Exception as e:
  print('error', type(e).__name__, e)
print('value', distributed.on_every_process(lambda: {pid} + 1, 'count'))
try:
  distributed.same_on_every_process(lambda: 7 + {pid}, 'the data', 'give every host the same')
except ValueError as e:
  print('differs:', e)
distributed.same_on_every_process(lambda: 2 ** 32 - 1, 'a checksum', 'of 32 bits')
print('as process 0 has it:', distributed.read_on_process_zero(lambda: ['best', {pid}, 'é'],
                                                                'read it'))
import os, time
marker = os.path.join({workdir!r}, 'downloaded')
def download():  # into a folder both share, then each reads it
  time.sleep(0.5)
  open(marker, 'w').close()
distributed.on_process_zero(download, 'download glue/rte')
print('found', distributed.on_every_process(lambda: os.path.exists(marker), 'read it'))
def offline():
  raise ConnectionError('no network')
try:
  distributed.on_process_zero(offline, 'download glue/rte')
except Exception as e:
  print('error', type(e).__name__, e)
print('all done')
'''


def test_work_each_host_does_alone_fails_or_differs_on_every_process_in_one_line(tmp_path):
  """What each host reads for itself: where it fails on one, every process raises (that one
  its own error, the others naming it), and where the hosts read different things, all say
  so; none waits for ever at the next collective. What process 0 found, every process
  takes. A download process 0 makes first is there for every host's read that follows."""
  zero, one = two_processes(_ONE_HOST_FAILS, tmp_path)
  assert 'error ProcessFailed process 1 failed to read the vocabulary; its log says why' in zero
  assert 'error FileNotFoundError no such file: vocab.txt' in one
  assert 'error ConnectionError no network' in zero
  assert 'error ProcessFailed process 0 failed to download glue/rte; its log says why' in one
  for out, value in ((zero, 1), (one, 2)):
    assert f'value {value}' in out and 'all done' in out, out[-3000:]
    assert "as process 0 has it: ['best', 0, 'é']" in out, out[-3000:]
    assert 'found True' in out, out[-3000:]  # process 0's download was done before 1 began
    assert ('differs: the data differs between processes (process 1 of 2 read other than '
            'process 0); give every host the same') in out, out[-3000:]


_OWN_DISKS = r'''
import os, sys
sys.path.insert(0, {repo!r})
from realformer.train import distributed, workdir
distributed.maybe_initialize({coordinator!r}, 2, {pid})
workdir.SHARED_FILE_SECONDS = 1  # (a shared file system's cache: a minute)
folder = os.path.join({workdir!r}, 'host{pid}', 'run')  # one --workdir, on each host's own disk
try:
  with workdir.Lock(folder):
    print('held')
except ValueError as e:
  print('error', e)
'''


def test_a_workdir_on_each_hosts_own_disk_is_refused_on_every_process(tmp_path):
  """A local --workdir that is not shared (a path on each host's disk) is a folder per host,
  whose checkpoints would each hold a part of every step: every process refuses it in one
  line (also where the other host's folder holds the lock file of an earlier run of its
  own), and process 0 leaves no folder behind."""
  os.makedirs(tmp_path / 'host0')
  os.makedirs(tmp_path / 'host1' / 'run')
  (tmp_path / 'host1' / 'run' / RunDir.LOCK).write_text('')
  for out in two_processes(_OWN_DISKS, tmp_path):
    assert 'held' not in out, out[-3000:]
    assert re.search(r"error --workdir \S+/run is not one folder for every process \(process 1 "
                     r"of 2 did not see the lock process 0 took there in 1 s: a folder on each "
                     r"host's own disk\?\); give a folder they share: a gs:// bucket or a "
                     r'shared file system', out), out[-3000:]
  assert os.listdir(tmp_path / 'host0') == []


_NODE_LOST = r'''
import os, sys
sys.path.insert(0, {repo!r})
import numpy as np
from realformer import cli
from realformer.train import distributed
def main():
  distributed.maybe_initialize({coordinator!r}, 2, {pid})
  import jax, jax.numpy as jnp
  distributed.gathered({pid})
  if {pid} == 1:  # its node is lost
    os._exit(3)
  mesh = jax.make_mesh((2,), ('x',))
  x = jax.make_array_from_process_local_data(jax.NamedSharding(mesh, jax.P('x')),
                                             np.ones((1,), np.float32))
  jax.jit(jnp.sum)(x).block_until_ready()  # a collective with a process that is gone
cli.run_main(main)
'''


def test_a_process_whose_peer_is_lost_stops_in_one_line_at_once(tmp_path):
  """Another process of the job stopped (a node lost): the collective that fails is one line
  naming what happened and the way on, and the process exits at once (jax's shutdown barrier
  waited about 100 s for the lost process, then aborted with a C++ stack)."""
  start = time.time()
  zero, _ = two_processes(_NODE_LOST, tmp_path, returncodes=(1, 3))
  errors = [l for l in zero.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and re.fullmatch(
      r'error: a collective of this job failed \(.*Connection (closed|reset) by peer.*\): '
      r'another process stopped or cannot be reached \(its log, or its node\'s, says why\); '
      r'run the same command to resume from the last complete checkpoint', errors[0]), \
      zero[-3000:]
  assert 'Traceback' not in zero and time.time() - start < 60


def test_params_only_partial_restore_and_mismatch_errors(reference, tmp_path):
  workdir = str(reference[0])
  config = tiny_config()
  step_dir = checkpoints.resolve_step_dir(workdir)
  assert step_dir.endswith(os.path.join('checkpoints', str(NUM_STEPS)))
  # The encoder alone, into a fine-tuning model's encoder.
  cls_model = models.build(config.model, head='classification', num_labels=3)
  batch = next(pretraining.SyntheticData(
      vocab_size=120, seq_len=min(32, config.model.max_len), num_predictions=5,
      global_batch_size=2, seed=0))
  boxed = jax.eval_shape(lambda: cls_model.init(jax.random.PRNGKey(0), batch))
  abstract = nn.unbox(boxed)
  encoder, missing = checkpoints.restore_params(workdir, abstract['params']['encoder'],
                                                subtree=('encoder',))
  assert not missing
  # model.init's own abstract tree (flax's boxed leaves) restores the same (it was refused:
  # the boxes' paths end in .value, none of which the checkpoint holds).
  same, missing = checkpoints.restore_params(workdir, boxed['params']['encoder'],
                                             subtree=('encoder',))
  assert not missing
  jax.tree.map(np.testing.assert_array_equal, same, encoder)
  # Against Orbax's own reading of the step's state, with no target (not our restore again).
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  stored = ocp.StandardCheckpointer().restore(os.path.join(step_dir, 'state'))
  kernel = encoder['layers_0']['attention']['query']['kernel']
  np.testing.assert_array_equal(
      kernel, stored['params']['encoder']['layers_0']['attention']['query']['kernel'])
  assert kernel.shape == (32, 32) and np.abs(np.asarray(kernel)).max() > 0
  # A model the checkpoint does not fit: the error names the parameter.
  config.model.hidden_size = 64
  wide = models.build(config.model, head='encoder')
  wide_params = nn.unbox(jax.eval_shape(lambda: wide.init(jax.random.PRNGKey(0), batch)))
  with pytest.raises(ValueError, match=r'params/encoder/\S+ has shape \S*32\S* in the '
                                       r'checkpoint but \S*64\S* in the model'):
    checkpoints.restore_params(workdir, wide_params['params'], subtree=('encoder',))
  with pytest.raises(FileNotFoundError, match='does not exist'):
    checkpoints.restore_params(workdir + '_nope', wide_params['params'])
  # An encoder parameter of the checkpoint that the model has no place for (a model of another
  # config: here one layer fewer) is refused, where a partial restore would drop it silently.
  config.model.hidden_size, config.model.num_layers = 32, 1
  short = models.build(config.model, head='encoder')
  short_params = nn.unbox(jax.eval_shape(lambda: short.init(jax.random.PRNGKey(0), batch)))
  with pytest.raises(ValueError, match=r'it holds params/encoder/layers_1/\S+, which the '
                                       r'model has no place for \(\d+ such\); use the'):
    checkpoints.restore_params(workdir, short_params['params'], subtree=('encoder',))
  # A mixture's weights where the code now declares the component a bias: said so.
  config.model.num_layers = 2
  encoder = models.build(config.model, head='encoder')
  params = jax.tree.map(np.asarray, nn.unbox(encoder.init(jax.random.PRNGKey(0), batch)))
  params['params']['layers_0']['attention']['mixture_logits'] = np.zeros(2, np.float32)
  checkpoints.save_params(str(tmp_path / 'mixed'), {'encoder': params['params']}, config)
  abstract_encoder = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                  nn.unbox(jax.eval_shape(lambda: encoder.init(
                                      jax.random.PRNGKey(0), batch)))['params'])
  with pytest.raises(ValueError, match=r'holds params/encoder/layers_0/attention/mixture_logits'
                                       r'.*now declared `mixed = False`'):
    checkpoints.restore_params(str(tmp_path / 'mixed'), abstract_encoder, subtree=('encoder',))
  # ... but where a component's own parameters are left over too, the config lacks it: no hint
  params['params']['layers_0']['attention']['synth_dense'] = {'b': np.zeros(2, np.float32)}
  checkpoints.save_params(str(tmp_path / 'dense'), {'encoder': params['params']}, config)
  with pytest.raises(ValueError, match=r'mixture_logits, which the model has no place for '
                                       r'\(2 such\); use the config.json') as e:
    checkpoints.restore_params(str(tmp_path / 'dense'), abstract_encoder, subtree=('encoder',))
  assert 'mixed = False' not in str(e.value)


def test_init_from_params_only_checkpoint_then_mismatch(tmp_path, reference, caplog):
  """An encoder-only checkpoint (as interop imports write) initializes a pretraining run:
  the encoder comes from it, the MLM/NSP heads keep their fresh initialization; resuming
  that run with another model shape is refused (workdir.check_resume_config), and a
  checkpoint of another shape is an error naming the parameter."""
  config = tiny_config()
  encoder = checkpoints.restore_params(str(reference[0]), _abstract_params(config)['encoder'],
                                       subtree=('encoder',))[0]
  step_dir = checkpoints.save_params(str(tmp_path / 'imported'), {'encoder': encoder}, config)
  assert sorted(os.listdir(step_dir)) == ['_CHECKPOINT_METADATA', 'commit_success.txt', 'state']
  params, missing = checkpoints.restore_params(str(tmp_path / 'imported'),
                                               _abstract_params(config))
  assert missing and all(m.startswith(('params/mlm_head', 'params/nsp_head')) for m in missing)
  assert params['mlm_head']['output_bias'] is None
  config = tiny_config(num_steps=1, init_checkpoint=str(tmp_path / 'imported'))
  config.optimizer.learning_rate = 0.0  # the saved params are the initial ones
  run(config, tmp_path / 'run')
  got = checkpoints.restore_params(str(tmp_path / 'run'), _abstract_params(config))[0]
  for a, b in zip(jax.tree.leaves(got['encoder']), jax.tree.leaves(encoder)):
    np.testing.assert_array_equal(a, b)
  assert np.abs(got['mlm_head']['transform']['kernel']).max() > 0  # fresh, not zeros
  # Resumed with another init checkpoint (never read: the run's own checkpoint is), or
  # none: config.json keeps the one that began the run.
  for other in (str(tmp_path / 'elsewhere'), ''):
    config.train.init_checkpoint, config.train.num_steps = other, config.train.num_steps + 1
    with caplog.at_level(logging.INFO):
      run(config, tmp_path / 'run')
    stored = json.loads((tmp_path / 'run' / 'config.json').read_text())
    assert stored['train']['init_checkpoint'] == str(tmp_path / 'imported')
    assert f"train.init_checkpoint={other!r} is not read on a resume" in caplog.text
  config = tiny_config(num_steps=2)
  config.model.mlp_dim = 128
  # Resuming under another model is refused before the checkpoint is touched ...
  with pytest.raises(ValueError, match=r'another config \(2 fields\): model.mlp_dim: 64 -> 128'):
    run(config, tmp_path / 'run')
  # ... and a checkpoint that does not fit the model names the parameter and the sizes.
  config = tiny_config(num_steps=1, init_checkpoint=str(tmp_path / 'imported'))
  config.model.mlp_dim = 128
  with pytest.raises(ValueError, match=r'of other sizes than this run\'s \(params/encoder/'
                                       r'layers_0/mlp/intermediate/\w+ has shape \S*64\S* in '
                                       r'the checkpoint but \S*128.*: --config.model.mlp_dim=64'):
    run(config, tmp_path / 'run2')
  # A run not finished (still training, or stopped) as the init checkpoint: its newest step,
  # named, and a warning that its run has not reached its end.
  unfinished = tmp_path / 'unfinished'
  shutil.copytree(reference[0], unfinished)
  stored = json.loads((unfinished / 'config.json').read_text())
  stored['train']['num_steps'] = 20
  (unfinished / 'config.json').write_text(json.dumps(stored))
  with caplog.at_level(logging.INFO):
    run(tiny_config(num_steps=1, init_checkpoint=str(unfinished)), tmp_path / 'run3')
  assert f'initialized params from {unfinished}/checkpoints/{NUM_STEPS}' in caplog.text
  assert (f"{unfinished} is at step {NUM_STEPS} of its run's 20: a run not finished"
          in caplog.text)
  # A head of the checkpoint that the model has not (NSP's, for RoBERTa's objective): said.
  roberta = tiny_config(num_steps=1, init_checkpoint=str(reference[0]))
  roberta.objective = 'mlm'
  with caplog.at_level(logging.INFO):
    run(roberta, tmp_path / 'run4')
  assert f'not used from {reference[0]}/checkpoints/{NUM_STEPS}: nsp_head' in caplog.text
  # Not said of a fine-tuned encoder (best/, final/: a fine-tuning's step), a time-budgeted
  # run, or a step folder of another name.
  from realformer.train import trainer  # pylint: disable=g-import-not-at-top
  caplog.clear()
  for change in ({'finetuned': {'task': 'rte'}},
                 {'train': dict(stored['train'], time_budget_minutes=5)}):
    (unfinished / 'config.json').write_text(json.dumps(dict(stored, **change)))
    trainer._say_if_unfinished(str(unfinished), str(NUM_STEPS))  # pylint: disable=protected-access
  trainer._say_if_unfinished(str(unfinished), 'bert_base')  # pylint: disable=protected-access
  assert 'not finished' not in caplog.text
  # Given as its checkpoints/ folder, the run's config.json is found above it; a step's
  # folder was chosen (an earlier step of a finished run, say): nothing to say.
  (unfinished / 'config.json').write_text(json.dumps(stored))
  trainer._say_if_unfinished(  # pylint: disable=protected-access
      str(unfinished / 'checkpoints' / str(NUM_STEPS)), str(NUM_STEPS))
  assert 'not finished' not in caplog.text
  trainer._say_if_unfinished(  # pylint: disable=protected-access
      str(unfinished / 'checkpoints'), str(NUM_STEPS))
  assert "of its run's 20: a run not finished" in caplog.text


def test_a_second_phase_checks_its_init_checkpoint_before_its_data(reference, tmp_path,
                                                                   caplog):
  """A fresh run's train.init_checkpoint (BERT's second phase, at a longer length) is
  checked before the corpus is prepared: a path that is not there, a position table the
  longer length does not fit (said as such), another tokenizer (an error) or another
  variant (a warning); the layers scanned where they were not pass. A step folder of it names its run's config for fine-tuning too."""
  from realformer.train import pretraining  # pylint: disable=g-import-not-at-top
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  missing = tiny_config(num_steps=1, init_checkpoint=str(tmp_path / 'nope'))
  missing.data.sources, missing.model.vocab_size = 'embedded', 0
  with pytest.raises(FileNotFoundError, match='nope does not exist'):
    run(missing, tmp_path / 'run')
  assert not (tmp_path / 'run').exists()  # nothing prepared, no workdir left
  config = tiny_config(num_steps=1, init_checkpoint=str(reference[0]))
  longer = config.copy_and_resolve_references()
  longer.model.max_len = 64
  with pytest.raises(ValueError, match=r'has 32 positions, this model 64 \(model.max_len\): a '
                                       r'position table does not grow; train the first run '
                                       r'with --config.model.max_len=64'):
    pretraining.check_init_checkpoint(longer, _abstract_params(longer))
  other = tmp_path / 'other.model'  # another tokenizer file (its bytes differ)
  other.write_bytes(open(tokenizer_lib.EMBEDDED_TOKENIZER, 'rb').read() + b'\0')
  retokenized = config.copy_and_resolve_references()
  retokenized.data.tokenizer = str(other)
  with pytest.raises(ValueError, match=rf'was trained with the tokenizer embedded, this run '
                                       rf'reads {other} .*; set data.tokenizer='):
    pretraining.check_init_checkpoint(retokenized, _abstract_params(retokenized))
  realformer = tiny_config('realformer', num_steps=1, init_checkpoint=str(reference[0]))
  with caplog.at_level(logging.WARNING):
    pretraining.check_init_checkpoint(realformer, _abstract_params(realformer))
  assert (f'{reference[0]} was trained as postln; this run is realformer: its weights start '
          'another variant') in caplog.text
  scanned = config.copy_and_resolve_references()  # its layers' layout: either restores
  scanned.model.scan_layers = True
  pretraining.check_init_checkpoint(scanned, _abstract_params(scanned))
  stored = json.loads((reference[0] / 'config.json').read_text())
  for folder in (reference[0] / 'checkpoints', reference[0] / 'checkpoints' / str(NUM_STEPS)):
    assert checkpoints.read_pretraining_config(str(folder)) == stored
  # Another model's sizes: the overrides that give this run the run's that wrote it.
  wider = config.copy_and_resolve_references()
  wider.model.hidden_size, wider.model.num_layers = 64, 3
  with pytest.raises(ValueError, match=r'holds a model of other sizes than this run\'s \(.*\); '
                     r'give this run those of the run that wrote it: --config.model.num_layers=2 '
                     r'--config.model.hidden_size=32$'):
    pretraining.check_init_checkpoint(wider, _abstract_params(wider))
  wider.model.max_len = 16  # (its table of 32 is the one to take: named with the sizes)
  with pytest.raises(ValueError, match=r'other sizes than this run\'s \(\S.+\); give this run '
                     r'those of the run that wrote it: --config.model.num_layers=2 '
                     r'--config.model.hidden_size=32 --config.model.max_len=32$'):
    pretraining.check_init_checkpoint(wider, _abstract_params(wider))
  shorter = config.copy_and_resolve_references()  # the table alone: its own message
  shorter.model.max_len = 16
  with pytest.raises(ValueError, match=r'has 32 positions, this model 16 \(model.max_len\): '
                                       r'set --config.model.max_len=32'):
    pretraining.check_init_checkpoint(shorter, _abstract_params(shorter))
  # Weights of another codebase, given where a workdir of ours is wanted: import them first.
  hf, tf1 = tmp_path / 'hf', tmp_path / 'tf1'
  hf.mkdir()
  (hf / 'config.json').write_text(json.dumps({'model_type': 'bert', 'hidden_size': 32}))
  tf1.mkdir()
  (tf1 / 'bert_model.ckpt.index').write_bytes(b'')
  (tf1 / 'bert_model.ckpt.data-00000-of-00001').write_bytes(b'')
  # (a TF1 checkpoint as import-tf1 --ckpt takes it: its folder, prefix, .index or .data)
  for folder, how in ((hf, f'import-hf --src {hf} --out WORKDIR'), (tf1, 'import-tf1'),
                      (tf1 / 'bert_model.ckpt', 'import-tf1'),
                      (tf1 / 'bert_model.ckpt.index', 'import-tf1'),
                      (tf1 / 'bert_model.ckpt.data-00000-of-00001', 'import-tf1')):
    kind = 'Hugging Face' if folder == hf else 'TF1'
    for read in (checkpoints.resolve_step_dir,  # (train.py's init_checkpoint)
                 checkpoints.read_pretraining_config):  # (finetune.py's)
      with pytest.raises((FileNotFoundError, ValueError), match=f'{folder} is a {kind} '
                         f'checkpoint, not a workdir of ours: import it first .*{how}'):
        read(str(folder))
  with pytest.raises(FileNotFoundError, match='checkpoint .*nothing does not exist'):
    checkpoints.resolve_step_dir(str(tmp_path / 'nothing'))
  for name in ('checkpoints/run1', 'checkpoints'):  # runs whose own folders have those names
    (tmp_path / name).mkdir(parents=True, exist_ok=True)
    (tmp_path / name / 'config.json').write_text(json.dumps(dict(stored, seed=5)))
    assert checkpoints.read_pretraining_config(str(tmp_path / name))['seed'] == 5


def test_the_layers_restore_scanned_from_unrolled_and_unrolled_from_scanned(reference,
                                                                          tmp_path):
  """model.scan_layers stacks the layers' parameters ('layers' [L, ...]); unrolled they are
  layers_0 ... layers_{L-1}. Params restore from either layout into either (a fine-tuning
  that scans an unrolled pretraining's layers, a second phase that stops scanning them):
  the same values, the same outputs, sharded as the target asks (the layer axis
  unsharded)."""
  unrolled = tiny_config()
  scanned = tiny_config()
  scanned.model.scan_layers = True
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('x',))

  def sharded(abstract):  # the last axis of each matrix (and stacked vector) split over 'x'
    def place(x):
      spec = [None] * x.ndim
      if x.ndim >= 2 and x.shape[-1] % 2 == 0:
        spec[-1] = 'x'
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
          mesh, jax.sharding.PartitionSpec(*spec)))
    return jax.tree.map(place, abstract)

  workdir = str(reference[0])
  want, missing = checkpoints.restore_params(workdir, _abstract_params(unrolled))
  assert not missing
  got, missing = checkpoints.restore_params(
      workdir, sharded(_abstract_params(scanned)))
  assert not missing and 'layers_0' not in got['encoder']
  for i in range(unrolled.model.num_layers):
    for a, b in zip(jax.tree.leaves(got['encoder']['layers']),
                    jax.tree.leaves(want['encoder'][f'layers_{i}'])):
      np.testing.assert_array_equal(np.asarray(a)[i], b)
  kernel = got['encoder']['layers']['mlp']['intermediate']['kernel']
  assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, None, 'x')
  assert got['mlm_head']['transform']['kernel'].sharding.spec[-1] == 'x'
  batch = next(pretraining.SyntheticData(vocab_size=120, seq_len=32, num_predictions=5,
                                         global_batch_size=2, seed=1))
  outputs = [models.build(c.model).apply({'params': p}, batch)
             for c, p in ((unrolled, want), (scanned, got))]
  for a, b in zip(jax.tree.leaves(outputs[0]), jax.tree.leaves(outputs[1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  # ... and back: the scanned params, written, restore unrolled (and the encoder alone).
  checkpoints.save_params(str(tmp_path / 'scanned'), jax.device_get(got), scanned)
  back, missing = checkpoints.restore_params(
      str(tmp_path / 'scanned'), sharded(_abstract_params(unrolled)['encoder']),
      subtree=('encoder',))
  assert not missing and 'layers' not in back
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(want['encoder'])):
    np.testing.assert_array_equal(a, b)
  assert back['layers_1']['mlp']['intermediate']['kernel'].sharding.spec == jax.sharding.PartitionSpec(
      None, 'x')


def _abstract_params(config):
  model = models.build(config.model)
  batch = next(pretraining.SyntheticData(
      vocab_size=120, seq_len=min(32, config.model.max_len), num_predictions=5,
      global_batch_size=2, seed=0))
  return nn.unbox(jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), batch)))['params']


def test_a_step_killed_while_being_deleted_never_looks_complete(tmp_path, monkeypatch):
  """delete_step removes the commit marker before the files: a kill in the middle (here the
  deletion itself never runs) leaves a step that is incomplete, which the next start deletes
  instead of restoring."""
  manager = checkpoints.make_manager(str(tmp_path), keep=None, item_names=('state',))
  for step in (1, 2):
    checkpoints.save(manager, step, {'step': step, 'params': {'w': np.ones(3)}}, force=True)
  manager.wait_until_finished()
  monkeypatch.setattr(type(manager), 'delete', lambda self, step: None)  # killed here
  checkpoints.delete_step(manager, 2)
  monkeypatch.undo()
  assert os.path.isdir(tmp_path / 'checkpoints' / '2')  # its files are still there
  assert checkpoints.latest_complete_step(manager) == 1
  assert manager.all_steps() == [1]  # the half-deleted step is gone
  checkpoints.delete_step(manager, 1)
  assert not checkpoints.has_complete_step(str(tmp_path))
  manager.close()


def test_saves_leave_jaxs_preemption_count_to_the_training_loop(tmp_path, monkeypatch):
  """jax's preemption sync agrees on a stop by the number of checks each process made
  (workdir.StopSignal counts the loop's); orbax's manager would report each save's step
  number to it too, which a resumed run's count could then never meet."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  reported = []
  monkeypatch.setattr(multihost_utils, 'reached_preemption_sync_point',
                      lambda step: reported.append(step) or False)
  manager = checkpoints.make_manager(str(tmp_path), item_names=('state',))
  checkpoints.save(manager, 7, {'step': 7, 'params': {'w': np.ones(3)}}, force=True)
  manager.wait_until_finished()
  manager.close()
  assert reported == []


def test_an_error_right_after_a_save_began_still_commits_it(tmp_path, monkeypatch):
  """A run that fails (a read error, say) while its last checkpoint is being written waits for
  that checkpoint before it lets go of the workdir: the next start resumes from it."""
  from realformer.train import trainer  # pylint: disable=g-import-not-at-top
  log = trainer.Trainer._log

  def failing_log(self, step, *args, **kwargs):
    if step == 5:
      raise OSError('reading the next shard failed')
    return log(self, step, *args, **kwargs)
  monkeypatch.setattr(trainer.Trainer, '_log', failing_log)
  config = tiny_config(num_steps=NUM_STEPS, checkpoint_every_steps=2, keep_checkpoints=1)
  with pytest.raises(OSError, match='reading the next shard failed'):
    run(config, tmp_path)
  assert checkpoints.complete_steps(str(tmp_path)) == [4]
