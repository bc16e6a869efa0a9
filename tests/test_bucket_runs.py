"""Runs that live in a Cloud Storage bucket (the loopback GCS server of tests/gcs_server.py,
its objects in a folder so that it can be stopped and started again):

  a. pretraining with its workdir and its prepared data in gs:// logs the losses of the same
     run on local disk; data prepared into the bucket by 2 workers on 2 hosts holds the same
     instances as a local preparation by one; the attention analysis and a sweep read and
     write there;
  b. kill -9 while a checkpoint is being written, then the same command: the cut step is never
     restored and the resumed run matches an uninterrupted one;
  c. a second run on a gs:// workdir that a run holds is refused with one line; SIGTERM
     saves and deletes the lock object;
  d. fine-tuning from a gs:// pretraining workdir into a gs:// workdir, reading GLUE from the
     bucket, writes results and predictions there, the same as on local disk;
  e. the server stopped mid-run: the run stops with one line naming the storage error, and
     the same command resumes once the server is back, as if nothing had happened;
  f. the programs of b and e open connections to 127.0.0.1 only (Python's socket audit
     events: gcsfs and google-cloud-storage; tensorstore's own connections go to
     TENSORSTORE_GCS_HTTP_URL, which realformer.storage sets to the same server), and
     credential discovery asks no metadata server.
"""

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from unittest import mock

import jax
import numpy as np
import pytest

import analyze
import sweep as sweep_cli
import train
from data import pipeline
from data import prepare
from data import tokenizer as tokenizer_lib
from realformer import cli
from realformer import storage
from realformer.tools import sweep
from realformer.train import checkpoints
from realformer.train import compile_cache
from realformer.train import metrics_jsonl
from realformer.train import trainer
from realformer.train import workdir as workdir_lib
from realformer.train.run_dir import RunDir
from tests import test_compile_cache
from tests import test_finetune
from tests import test_pipeline
from tests import test_sweep
from tests.conftest import cpu_xla_flags
from tests.gcs_server import GcsServer
from tests.test_train import REPO, tiny_config, trained
from tests.gcs_server import free_port

DEVICES = 2
NUM_STEPS = 12


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  """One server for the module (gcsfs and tensorstore keep their endpoint per process)."""
  srv = GcsServer(str(tmp_path_factory.mktemp('gcs_objects')))
  srv.start()
  with pytest.MonkeyPatch.context() as mp:
    for key, value in srv.env.items():
      mp.setenv(key, value)
    yield srv
  srv.stop()


def _run(config, workdir):
  """On DEVICES devices: the runs the children's (DEVICES devices, or DEVICES processes of
  one) are compared with. Runs whose sharding is not the point train on one (`trained`)."""
  return train.train_and_evaluate(config, str(workdir), devices=jax.devices()[:DEVICES])


def _losses(workdir):
  records = metrics_jsonl.read_jsonl(f'{workdir}/metrics.jsonl')
  return {s: r['loss'] for s, r in sorted(records.items())}


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """An uninterrupted run on local disk (dropout on: a resume must redraw the same masks)."""
  workdir = tmp_path_factory.mktemp('local')
  _run(tiny_config(num_steps=NUM_STEPS, checkpoint_every_steps=3), workdir)
  return _losses(workdir)


def _assert_same(got, want):
  assert got == want  # the same steps, bit-identical losses


# A training program in a fresh process, as train.py runs it (cli.run_main: errors as one
# line). It records every host it resolves or connects to (f). step_seconds slows each
# step; pause_at=k stops before step k until the file `resume` exists (having written the
# file `paused`); kill_in_save=k SIGKILLs it once step k's checkpoint has begun to reach the
# bucket (objects there, before its commit file).
_CHILD = r'''
import json, os, signal, sys, time
sys.path.insert(0, {repo!r})
args = json.loads({args!r})

def audit(event, a, seen=set()):
  if event == 'socket.connect' and isinstance(a[1], tuple):
    where = f'{{a[1][0]}} {{a[1][1]}}'
  elif event == 'socket.getaddrinfo':
    where = f'{{a[0]}} {{a[1]}}'
  else:
    return
  if where not in seen:
    seen.add(where)
    with open(args['hosts'], 'a') as f:
      f.write(where + '\n')
sys.addaudithook(audit)

import train
from realformer import cli
from realformer.train import checkpoints, train_lib
from tests.test_train import tiny_config
if args.get('num_processes'):
  from realformer.train import distributed
  distributed.maybe_initialize(args['coordinator'], args['num_processes'], args['process_id'])
if args.get('step_seconds') or args.get('pause_at'):
  make_step = train_lib.make_train_step
  def slow_make_step(*a, **kw):
    step_fn, count = make_step(*a, **kw), [0]
    def step(state, batch, *rest):
      count[0] += 1
      if count[0] == args.get('pause_at'):
        open(args['paused'], 'w').close()
        while not os.path.exists(args['resume']):
          time.sleep(0.05)
        if args.get('storage_seconds_after_pause'):  # the test stopped the server meanwhile
          from realformer import storage
          storage.REQUEST_SECONDS = args['storage_seconds_after_pause']
      time.sleep(args.get('step_seconds', 0))
      return step_fn(state, batch, *rest)
    return step
  train_lib.make_train_step = slow_make_step
if args.get('kill_in_save'):
  from google.cloud import storage as gcs
  bucket, _, prefix = args['workdir'][len('gs://'):].partition('/')
  save = checkpoints.save
  def killing_save(manager, step, *a, **kw):
    out = save(manager, step, *a, **kw)
    if step == args['kill_in_save']:
      listing = gcs.Client().bucket(bucket)
      while not list(listing.list_blobs(prefix=f'{{prefix}}/checkpoints/{{step}}/')):
        pass
      os.kill(os.getpid(), signal.SIGKILL)
    return out
  checkpoints.save = killing_save
cli.run_main(train.train_and_evaluate, tiny_config(**args['train']), args['workdir'])
'''


def _child(server, tmp_path, devices=DEVICES, **args):
  args.setdefault('hosts', str(tmp_path / 'hosts.txt'))
  env = dict(os.environ, **server.env, JAX_PLATFORMS='cpu',
             XLA_FLAGS=cpu_xla_flags(devices))
  return subprocess.Popen([sys.executable, '-c', _CHILD.format(repo=REPO,
                                                               args=json.dumps(args))],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def _assert_loopback_only(hosts_file, server, *ports):
  """Every connection went to the server or to `ports` on 127.0.0.1 (a metadata server asked
  for credentials would be another port: GCE_METADATA_HOST is a closed loopback port)."""
  places = {tuple(line.split()) for line in open(hosts_file).read().splitlines()}
  allowed = {(host, str(port)) for host in ('127.0.0.1', 'localhost')
             for port in (server.port,) + ports}
  assert places and places <= allowed, places


@pytest.fixture(scope='module')
def bucket_run(server, tmp_path_factory):
  """A pretraining run on the embedded corpus with its workdir and prepared data in the
  bucket, and the same run on local disk: (url, local folder, the bucket run's summary)."""
  config = tiny_config(num_steps=4, eval_steps=1, eval_every_steps=2)
  config.data.sources = 'embedded'
  config.data.max_predictions_per_seq = 5
  config.model.vocab_size = 0  # from the tokenizer
  local = tmp_path_factory.mktemp('a_local')
  trained(config, local)
  url = f'{server.root}/a'
  return url, local, trained(config, url)


def test_a_pretraining_run_in_a_bucket_logs_the_losses_of_a_local_run(bucket_run):
  url, local, summary = bucket_run
  _assert_same(_losses(url), _losses(local))
  local_eval = metrics_jsonl.read_jsonl(local / 'metrics.jsonl', 'eval')[4]
  assert summary['eval']['mlm_loss'] == pytest.approx(local_eval['mlm_loss'], rel=1e-6)
  names = {p.name for p in storage.path(url).iterdir()}
  assert {'config.json', 'machine.jsonl', 'metrics.jsonl', 'checkpoints', 'data'} <= names
  assert any(n.startswith('events.out.tfevents.') for n in names)
  assert '.lock' not in names  # released
  assert (storage.path(url) / 'data' / prepare.METADATA).exists()  # prepared into the bucket
  assert checkpoints.has_complete_step(url)


def test_the_attention_analysis_reads_a_bucket_run_and_writes_its_report_there(
    server, bucket_run, capsys):
  url = bucket_run[0]
  out = f'{server.root}/attention'
  analyze.main(['--workdir', url, '--out', out, '--num_examples', '8'])
  assert '| postln |' in capsys.readouterr().out
  names = {p.name for p in storage.path(out).iterdir()}
  assert names == {'attention.json', 'attention.md', 'attention_entropy.png',
                   'attention_entropy_heads.png', 'attention_js.png'}
  numbers = json.loads((storage.path(out) / 'attention.json').read_text())
  assert len(numbers['postln']['entropy_mean']) == 2  # one per layer


def test_a_sweep_rooted_in_a_bucket_runs_resumes_and_summarizes_there(server, monkeypatch):
  """The real train.py run by sweep.py (the local root's machinery: tests/test_sweep.py's
  fake programs), here rooted in a bucket."""
  monkeypatch.setenv('XLA_FLAGS', cpu_xla_flags(1))  # the sweep's train.py on one device
  root = f'{server.root}/sweep'
  args = ['run', '--root', root, '--config',
          os.path.join(REPO, 'configs', 'pretrain.py') + ':postln,tiny',
          '--program', os.path.join(REPO, 'train.py'),
          '--sweep', 'model.variant=realformer', '--seeds', '1']
  for item in test_sweep.TINY:
    args += ['--set', item]
  run = storage.path(root) / 'model.variant=realformer,seed=0'
  assert sweep_cli.main(args) == 0, (run / 'log.txt').read_text()
  assert {'DONE', 'log.txt', RunDir.OVERRIDES, 'config.json'} <= {p.name for p in run.iterdir()}
  assert RunDir.SWEEP_LOCK not in {p.name for p in run.iterdir()}  # the lease object is released
  assert json.loads((run / 'config.json').read_text())['model']['variant'] == 'realformer'
  rows = sweep.collect(root, ['eval/mlm_accuracy', 'eval/loss'])
  assert len(rows) == 1 and rows[0]['done'] and math.isfinite(rows[0]['metrics']['eval/loss'])
  assert sweep_cli.main(args) == 0  # finished: skipped
  assert sweep_cli.main(['summarize', '--root', root, '--metrics', 'eval/loss']) == 0
  assert (storage.path(root) / 'summary.md').read_text().startswith('| n |')


def test_a_sweep_runs_log_reaches_the_bucket_while_it_is_quiet_and_past_a_failed_upload(
    server, tmp_path, monkeypatch, capfd):
  """A run's log in a bucket: what the run printed reaches the object while it prints
  nothing more (a long compile, a hung collective: the lines someone debugging it needs);
  an upload that fails is said and its lines go with the next, and the run goes on; and
  what cannot be uploaded at the end is kept in the sweep's own output."""
  from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(sweep, 'LOG_UPLOAD_SECONDS', 0.2)
  upload, failures = storage.GrowingFile._upload, []  # pylint: disable=protected-access

  def failing_once(self):
    if not failures:
      failures.append(True)
      raise exceptions.ServiceUnavailable('the bucket is busy')
    upload(self)
  monkeypatch.setattr(storage.GrowingFile, '_upload', failing_once)
  go = tmp_path / 'go'
  program = tmp_path / 'quiet.py'
  program.write_text(f'import os, time\nprint("first", flush=True)\n'
                     f'deadline = time.time() + 60\n'
                     f'while not os.path.exists({str(go)!r}) and time.time() < deadline:\n'
                     f'  time.sleep(0.05)\nprint("last", flush=True)\n')
  url = f'{server.root}/quiet/log.txt'
  result = []
  thread = threading.Thread(target=lambda: result.append(
      sweep._call_logged([sys.executable, str(program)], url)))  # pylint: disable=protected-access
  thread.start()
  seen, deadline = '', time.time() + 30
  while 'first' not in seen and time.time() < deadline:
    time.sleep(0.1)
    with contextlib.suppress(FileNotFoundError):
      seen = storage.path(url).read_text()
  go.write_text('')
  thread.join(60)
  assert seen == 'first\n' and failures and result == [(0, False)]
  assert storage.path(url).read_text() == 'first\nlast\n'
  assert f'sweep: uploading {url} failed (503 the bucket is busy)' in capfd.readouterr().err
  # The last upload fails for good: the bytes the object lacks go to the sweep's output.
  def failing(_):
    raise exceptions.ServiceUnavailable('gone')
  monkeypatch.setattr(storage.GrowingFile, '_upload', failing)
  go.unlink()
  program.write_text('print("one more")\n')
  assert sweep._call_logged([sys.executable, str(program)], url) == (0, False)  # pylint: disable=protected-access
  assert (f'sweep: the last 9 bytes of {url} could not be uploaded (503 gone); they follow:\n'
          'one more\n') in capfd.readouterr().err
  assert storage.path(url).read_text() == 'first\nlast\n'


def test_data_prepared_into_a_bucket_by_workers_on_hosts_matches_a_local_preparation(
    server, tmp_path, corpus, monkeypatch):
  """... and each host's copy holds the files of its share only (three hosts here)."""
  config = test_pipeline.tiny_config(corpus, document_window=2, records_per_file=20)
  one = prepare.prepare(config, str(tmp_path / 'one'))
  config.data.prepare_workers = 2
  url = f'{server.root}/prepared'
  assert prepare.prepare(config, url, process_index=1, process_count=2) is None  # host 1
  # A gatherer whose lease lapsed (a host suspended past it) writes nothing more.
  with mock.patch.object(storage.Lease, 'lost', 'the lock could not be refreshed'):
    with pytest.raises(cli.UserError, match='the lock could not be refreshed; this '
                       'preparation of .*/prepared stopped before writing again'):
      prepare.prepare(config, url, process_index=0, process_count=2)
  assert not storage.path(url).exists()
  hosts = prepare.prepare(config, url, process_index=0, process_count=2)  # host 0 gathers
  assert hosts['workers'] == 4 and hosts['counts'] == one['counts']
  assert not storage.path(f'{url}.tmp').exists()  # the workers' objects are gone
  names = [prepare.METADATA] + [os.path.basename(p) for split in prepare.SPLITS
                                for p in prepare.shard_paths(url, split,
                                                             hosts['files'][split])]
  local = storage.local_copy(url, names)
  assert test_pipeline._records(local, hosts) == test_pipeline._records(
      str(tmp_path / 'one'), one)
  # The copy is checked against the bucket: a changed object is copied again.
  copy = os.path.join(local, names[1])
  first = open(copy, 'rb').read()
  storage.path(f'{url}/{names[1]}').write_bytes(b'changed')
  storage.local_copy(url, names)
  assert open(copy, 'rb').read() == b'changed' != first
  storage.path(f'{url}/{names[1]}').write_bytes(first)
  config.data.prepared_dir = url
  monkeypatch.setattr(jax, 'process_count', lambda: 3)
  shares = []
  for index in range(3):
    monkeypatch.setattr(jax, 'process_index', lambda index=index: index)
    monkeypatch.setenv('REALFORMER_CACHE', str(tmp_path / f'host{index}'))
    local = pipeline.ensure_prepared(config, str(tmp_path / 'unused'))
    share = {os.path.basename(p) for split in prepare.SPLITS
             for i, p in enumerate(prepare.shard_paths(url, split, hosts['files'][split]))
             if i in pipeline.host_files(hosts, split, index, 3)}
    assert set(os.listdir(local)) - {'.lock', '.manifest.json'} == {prepare.METADATA} | share
    shares.append(share)
    tok = tokenizer_lib.Tokenizer.load(tokenizer_lib.EMBEDDED_TOKENIZER)
    assert len(next(pipeline.make_pretraining_iterator(
        config.data, tok, local, global_batch_size=6, seed=0, process_index=index,
        process_count=3))['input_ids']) == 2
  assert max(map(len, shares)) < len(names) - 2  # (records past the last full share: no host)


def test_a_diverged_run_in_a_bucket_keeps_its_log_up_to_the_divergence(server):
  """The log's last lines wait in the local spool between uploads: a run stopped by a
  non-finite loss uploads them on its way out (the losses before a divergence)."""
  url = f'{server.root}/diverged'
  c = tiny_config(num_steps=30, checkpoint_every_steps=1000)
  c.optimizer.learning_rate, c.optimizer.clip_norm = 1e12, 0.0
  with pytest.raises(trainer.NonFiniteLossError) as e:
    trained(c, url)
  bad_step = int(str(e.value).split(' at step ')[1].split(';')[0])
  logged = metrics_jsonl.read_jsonl(f'{url}/metrics.jsonl')
  assert bad_step > 1 and sorted(logged) == list(range(1, bad_step))


def test_a_failed_save_in_a_bucket_keeps_the_log_up_to_the_failure(server, monkeypatch):
  """A checkpoint's save fails in the background (a bucket that refused the write) and
  the run stops at its next log; waiting for the saves on the way out raises the failure
  again (as orbax's wait_until_finished does), and the log's last lines are uploaded
  all the same."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  full = ValueError('RESOURCE_EXHAUSTED: the bucket refused the write')
  failed, waited = [], ocp.CheckpointManager.wait_until_finished

  def check_for_errors(manager):  # found at step 4's log: step 3's line is not uploaded
    if manager.latest_step() is not None:  # (the save of step 2 has run)
      failed.append(True)
      if len(failed) > 1:
        raise full

  def wait_until_finished(manager):
    waited(manager)
    if len(failed) > 1:
      raise full
  monkeypatch.setattr(ocp.CheckpointManager, 'check_for_errors', check_for_errors)
  monkeypatch.setattr(ocp.CheckpointManager, 'wait_until_finished', wait_until_finished)
  url = f'{server.root}/failed_save'
  c = tiny_config(num_steps=6, checkpoint_every_steps=2)
  c.train.log_every_steps = 1
  with pytest.raises(ValueError, match='the bucket refused the write'):
    trained(c, url)
  assert sorted(metrics_jsonl.read_jsonl(f'{url}/metrics.jsonl')) == [1, 2, 3]


@pytest.mark.parametrize('then', ['the check', 'another error'])
def test_a_run_that_lost_its_lock_leaves_the_new_holders_log_alone(server, monkeypatch, then):
  """Once another run holds the workdir, the run that lost its lease stops without writing:
  its log's last lines are not uploaded over the new holder's log, whether the run learns
  of it from its check or stops first for another reason (a divergence, a fault)."""
  url = f'{server.root}/lost_{then.split()[0]}'
  theirs = '{"step": 0, "split": "start"}\n{"step": 1, "split": "train", "loss": 9.0}\n'
  original, calls = RunDir.check_held, []

  def check_held(run):
    calls.append(run)
    if len(calls) == 3:  # at the third log: the lease is gone, another run has logged
      storage.write_text(f'{url}/metrics.jsonl', theirs)
      monkeypatch.setattr(workdir_lib.Lock, 'lost', property(lambda _: 'taken over'))
      if then == 'another error':
        raise FloatingPointError('the loss diverged')
    original(run)
  monkeypatch.setattr(RunDir, 'check_held', check_held)
  error = (workdir_lib.WorkdirInUseError, 'taken over; this run stopped') if then == (
      'the check') else (FloatingPointError, 'the loss diverged')
  with pytest.raises(error[0], match=error[1]):
    trained(tiny_config(num_steps=6, checkpoint_every_steps=1000), url)
  assert storage.path(f'{url}/metrics.jsonl').read_text() == theirs


def test_a_lock_lost_during_an_evaluation_stops_the_run_before_it_writes(server, monkeypatch):
  """A lease lost while the run evaluated (a long evaluation): its results are not written
  (the log's upload would replace the new holder's log)."""
  from realformer.train import pretraining as pretraining_task  # pylint: disable=g-import-not-at-top
  url = f'{server.root}/lost_in_eval'
  theirs = '{"step": 0, "split": "start"}\n'
  evaluate = pretraining_task.PretrainingTask.evaluate
  upload_at_once = storage.GrowingFile.__init__

  def taken_over(self, params, step):
    results = evaluate(self, params, step)
    storage.write_text(f'{url}/metrics.jsonl', theirs)
    monkeypatch.setattr(workdir_lib.Lock, 'lost', property(lambda _: 'taken over'))
    return results
  monkeypatch.setattr(pretraining_task.PretrainingTask, 'evaluate', taken_over)
  monkeypatch.setattr(storage.GrowingFile, '__init__',
                      lambda self, p, binary=False, upload_every=30.0: upload_at_once(
                          self, p, binary, upload_every=0.0))
  with pytest.raises(workdir_lib.WorkdirInUseError, match='taken over; this run stopped'):
    trained(tiny_config(num_steps=6, eval_every_steps=3, eval_steps=1, log_every_steps=100,
                        checkpoint_every_steps=1000), url)
  assert storage.path(f'{url}/metrics.jsonl').read_text() == theirs


@pytest.mark.parametrize('where', ['bucket', 'local'])
@pytest.mark.parametrize('lost_at, committed', [(4, False), (6, False), (6, True)])
def test_a_save_begun_before_the_lock_was_lost_is_never_committed(
    server, tmp_path, monkeypatch, where, lost_at, committed):
  """The lease runs out after a save's lock check, while the save is in flight: the step is
  not committed into the workdir that another run may now hold, and the older step it would
  have replaced (keep 1) stays. Lost after its last save was committed, a run writes nothing
  more (its last log lines are not uploaded over the new holder's)."""
  url = f'{server.root}/fenced_{lost_at}_{committed}' if where == 'bucket' else str(
      tmp_path / 'w')
  original, managers = checkpoints.save, []

  def lose():
    monkeypatch.setattr(workdir_lib.Lock, 'lost', property(lambda _: 'taken over'))

  def save(manager, step, *args, **kwargs):
    managers.append(manager)
    if step != lost_at:
      return original(manager, step, *args, **kwargs)
    manager.wait_until_finished()  # (the earlier step's save was committed before)
    if not committed:  # past _save's check_held: the lease is lost from here on
      lose()
    saved = original(manager, step, *args, **kwargs)
    if committed:
      manager.wait_until_finished()
      lose()
    return saved
  monkeypatch.setattr(checkpoints, 'save', save)
  config = tiny_config(num_steps=6, checkpoint_every_steps=2, keep_checkpoints=1)
  with pytest.raises(workdir_lib.WorkdirInUseError, match='taken over; this run stopped'):
    trained(config, url)
  with contextlib.suppress(workdir_lib.WorkdirInUseError):  # the fence's own error
    managers[-1].wait_until_finished()  # what the process would have done, had it lived on
  assert checkpoints.complete_steps(url) == [lost_at if committed else lost_at - 2]


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  return test_pipeline.corpus.__wrapped__(tmp_path_factory)


def test_b_a_kill_during_a_checkpoint_write_resumes_exactly(server, tmp_path, reference):
  url = f'{server.root}/b'
  proc = _child(server, tmp_path, workdir=url, kill_in_save=6,
                train={'num_steps': NUM_STEPS, 'checkpoint_every_steps': 3})
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == -signal.SIGKILL, err[-3000:]
  cut = storage.path(url) / 'checkpoints' / '6'
  assert cut.exists() and not (cut / checkpoints.COMMIT_FILE).exists()  # cut short
  before = _losses(url)
  assert max(before) >= 3
  lines_before = len((storage.path(url) / 'metrics.jsonl').read_text().splitlines())
  _run(tiny_config(num_steps=NUM_STEPS, checkpoint_every_steps=3), url)
  start, *resumed = [json.loads(line) for line in (
      storage.path(url) / 'metrics.jsonl').read_text().splitlines()[lines_before:]]
  assert start == {'step': 3, 'split': 'start'}  # from step 3, not the cut 6
  assert min(r['step'] for r in resumed) == 4
  _assert_same(_losses(url), reference)
  _assert_loopback_only(tmp_path / 'hosts.txt', server)


def test_c_a_second_run_on_a_held_bucket_workdir_is_refused_in_one_line(server, tmp_path):
  from realformer.train import workdir  # pylint: disable=g-import-not-at-top
  url = f'{server.root}/c'
  with workdir.Lock(url, 'train.py'):
    out = subprocess.run([sys.executable, 'train.py', '--workdir', url,
                          '--config.data.sources=synthetic'], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, **server.env))
  assert out.returncode == 1
  errors = [l for l in out.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and 'Traceback' not in out.stderr, out.stderr
  assert errors[0].startswith(f'error: {url} is in use by pid {os.getpid()} on '), errors
  assert f'delete {url}/.lock' in errors[0]


def test_d_fine_tuning_from_and_into_a_bucket(server, tmp_path):
  pretrained = f'{server.root}/d_pretrained'
  test_finetune.save_tiny_encoder(pretrained, 'postln', num_layers=2, num_heads=2, step=10)
  glue_url = f'{server.root}/glue'
  storage.copy_tree(os.path.join(test_finetune.GLUE_DIR, 'RTE'), f'{glue_url}/RTE')
  local = str(tmp_path / 'local')
  want = test_finetune.run(test_finetune.ft_config('rte', pretrained,
                                                    data_dir=test_finetune.GLUE_DIR), local)
  url = f'{server.root}/d_finetuned'
  got = test_finetune.run(test_finetune.ft_config('rte', pretrained, data_dir=glue_url), url)
  assert got['dev'] == want['dev']
  run = storage.path(url)
  results = json.loads((run / 'results.json').read_text())
  assert results['dev'] == want['dev']
  assert ((run / 'predictions' / 'RTE.tsv').read_text() ==
          open(os.path.join(local, 'predictions', 'RTE.tsv')).read())
  assert '.lock' not in {p.name for p in run.iterdir()}
  assert (run / 'metrics.jsonl').read_text().count('"split": "dev_rte"') == 2


def test_e_the_server_stopped_mid_run_stops_it_in_one_line_and_it_resumes(server, tmp_path,
                                                                         reference):
  url = f'{server.root}/e'
  paused, resume = tmp_path / 'paused', tmp_path / 'resume'
  # (once the server is stopped, the child's requests fail within 2 s instead of the run's
  # 10: its first failure and its last attempt to delete what it wrote each wait that long)
  proc = _child(server, tmp_path, workdir=url, pause_at=5, paused=str(paused),
                resume=str(resume), storage_seconds_after_pause=2,
                train={'num_steps': NUM_STEPS, 'checkpoint_every_steps': 3})
  marker = storage.path(url) / 'checkpoints' / '3' / checkpoints.COMMIT_FILE
  deadline = time.time() + 240
  while not (paused.exists() and marker.exists()):  # between the saves of steps 3 and 6
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.1)
  server.stop()
  resume.touch()
  try:
    _, err = proc.communicate(timeout=240)
  finally:
    server.start()
  assert proc.returncode == 1, err[-3000:]
  lines = err.strip().splitlines()
  assert lines[-1].startswith('error: storage failed (') and '127.0.0.1' in lines[-1], err
  assert 'run the same command again' in lines[-1]
  assert "Traceback" not in err, err[-3000:]
  # Everything committed is there: checkpoint 3 (at least) and the logs up to it.
  assert checkpoints.has_complete_step(url) and max(_losses(url)) >= 3
  proc = _child(server, tmp_path, workdir=url,
                train={'num_steps': NUM_STEPS, 'checkpoint_every_steps': 3})
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  assert 'taking over the lock' in err  # the stopped run could not delete its lock object
  _assert_same(_losses(url), reference)
  _assert_loopback_only(tmp_path / 'hosts.txt', server)


def test_a_compilation_cache_in_a_bucket_is_loaded_by_the_next_start(server, tmp_path):
  cache = f'{server.root}/xla'
  loaded, written = test_compile_cache._counts(test_compile_cache._train(tmp_path / 'a', cache))
  assert written > 0
  assert [p.name for p in storage.path(cache).iterdir()] == [
      compile_cache.fingerprint(compile_cache.machine_facts())]
  second = test_compile_cache._train(tmp_path / 'b', cache)
  assert test_compile_cache._counts(second) == (loaded + written, 0)
  assert test_compile_cache._losses(tmp_path / 'b') == test_compile_cache._losses(tmp_path / 'a')


def test_interop_reads_and_writes_buckets(server, tmp_path):
  """A TF1 checkpoint in the bucket imported into a gs:// workdir, exported from there to an
  HF folder in the bucket, and that imported back: the weights of the same import on disk."""
  from realformer.tools import interop  # pylint: disable=g-import-not-at-top
  from tests import test_interop  # pylint: disable=g-import-not-at-top
  local = tmp_path / 'tf1'
  local.mkdir()
  prefix = test_interop._write_tf1(str(local / 'bert_model.ckpt'),
                                   test_interop._tf1_tensors(test_interop.TINY_BERT))
  (local / 'bert_config.json').write_text(json.dumps(test_interop.TINY_BERT))
  vocab = test_interop._tiny_vocab(local / 'vocab.txt')
  interop.import_tf1(prefix, str(local / 'bert_config.json'), vocab, str(tmp_path / 'on_disk'),
                     variant='postln')
  want, _ = test_interop._restore_all(str(tmp_path / 'on_disk'))

  bucket = f'{server.root}/interop'
  storage.copy_tree(str(local), f'{bucket}/tf1')
  workdir = f'{bucket}/imported'
  interop.import_tf1(f'{bucket}/tf1/bert_model.ckpt', f'{bucket}/tf1/bert_config.json',
                     f'{bucket}/tf1/vocab.txt', workdir, variant='postln')
  got, cfg = test_interop._restore_all(workdir)
  assert cfg.data.tokenizer == f'{workdir}/vocab.txt'
  interop.export_hf(workdir, f'{bucket}/hf')
  assert {'config.json', 'model.safetensors', 'vocab.txt'} <= {
      p.name for p in storage.path(f'{bucket}/hf').iterdir()}
  interop.import_hf(f'{bucket}/hf', str(tmp_path / 'back'))
  back, _ = test_interop._restore_all(str(tmp_path / 'back'))
  for tree in (got, back):
    a, b = test_interop._flat(want), test_interop._flat(tree)
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  with pytest.raises(ValueError, match='exists and is not empty'):
    interop.import_tf1(f'{bucket}/tf1/bert_model.ckpt', f'{bucket}/tf1/bert_config.json',
                       f'{bucket}/tf1/vocab.txt', workdir, variant='postln')


def test_study_reports_read_and_write_a_bucket_root(server, tmp_path):
  """The study's report steps on a gs:// root: learning curves, a stability cell and the
  --record copy read runs in the bucket and write their figures there."""
  import argparse  # pylint: disable=g-import-not-at-top
  import study  # pylint: disable=g-import-not-at-top
  root = f'{server.root}/study'
  runs = [{'model.variant': v, 'seed': 0} for v in ('postln', 'realformer')]
  names = sweep.run_names(runs)
  for name in names:
    lines = [json.dumps({'step': s, 'split': 'train', 'loss': 9.0 - s / 10}) for s in (10, 20)]
    lines += [json.dumps({'step': 20, 'split': 'eval', 'mlm_accuracy': 0.2})]
    storage.write_text(f'{root}/compare/{name}/metrics.jsonl', '\n'.join(lines) + '\n')
    storage.write_text(f'{root}/compare/{name}/{RunDir.OVERRIDES}', '{}')
    storage.write_text(f'{root}/compare/{name}/{RunDir.DONE}', '')
    storage.write_text(f'{root}/compare/{name}/checkpoints/20/x.json', '{}')
  study.curves(f'{root}/compare', runs, names, f'{root}/compare/learning_curves.png')
  assert storage.path(f'{root}/compare/learning_curves.png').stat().length > 1000
  cell = study.stability_cell(f'{root}/compare/{names[0]}')
  assert cell['status'] == 'ok' and cell['final'] == 7.0
  kept = tmp_path / 'kept'
  study.record(argparse.Namespace(root=root, record=str(kept)), f'{root}/compare')
  got = sorted(str(p.relative_to(kept)) for p in kept.rglob('*') if p.is_file())
  assert 'compare/learning_curves.png' in got and not any('checkpoints' in g for g in got)
  assert f'compare/{names[0]}/metrics.jsonl' in got
  era = study.era_task(root)  # the fine-tuning task and corpus, written into the bucket
  assert storage.path(f'{era}/pretraining_corpus.txt').stat().length > 1000
  assert storage.path(f'{era}/SST-2/dev.tsv').exists()


def test_sigterm_saves_and_releases_the_lock_object(server, tmp_path):
  """A preempted run in a bucket: SIGTERM mid-run saves that step and deletes its lock
  object, so the rerun (on any host) takes the workdir at once."""
  url = f'{server.root}/sigterm'
  paused, resume = tmp_path / 'paused', tmp_path / 'resume'
  proc = _child(server, tmp_path, workdir=url, pause_at=4, paused=str(paused),
                resume=str(resume), train={'num_steps': NUM_STEPS, 'checkpoint_every_steps': 100})
  deadline = time.time() + 240
  while not paused.exists():
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.1)
  assert (storage.path(url) / '.lock').exists()
  proc.send_signal(signal.SIGTERM)
  resume.touch()
  _, err = proc.communicate(timeout=240)
  assert proc.returncode == 0, err[-3000:]  # the child returns the summary: preempted
  assert not (storage.path(url) / '.lock').exists()
  assert checkpoints.latest_complete_step(checkpoints.make_manager(url, read_only=True)) == 4


_PROCESS_ZERO = r"""
import sys, time
sys.path.insert(0, {repo!r})
import ml_collections
import orbax.checkpoint as ocp
from realformer import storage
from realformer.train import checkpoints, distributed
distributed.maybe_initialize({coordinator!r}, 2, {pid})
uncommitted = storage.path({workdir!r}) / 'checkpoints' / '5'
if {pid} == 0:  # a slow clean-up, which the other process must not list midway
  remove = checkpoints._remove_uncommitted
  checkpoints._remove_uncommitted = lambda folder: (time.sleep(2), remove(folder))
else:
  made = ocp.CheckpointManager
  def listing(*a, **kw):
    print('listed with the uncommitted step:', uncommitted.exists())
    return made(*a, **kw)
  ocp.CheckpointManager = listing
manager = checkpoints.make_manager({workdir!r})
print('steps', list(manager.all_steps()))
manager.close()
if {pid} == 0:
  def refused(*args):
    raise OSError('the bucket refused the write')
  storage.write_text = refused
try:
  checkpoints.write_config({workdir!r}, ml_collections.ConfigDict(dict(a=1)))
except Exception as e:
  print('error', type(e).__name__, e)
"""


def test_process_zeros_clean_up_and_write_are_waited_for_and_fail_on_every_process(
    server, tmp_path):
  """Several processes: the others list the checkpoints only once process 0 has deleted the
  uncommitted steps, and a write of process 0 that fails (config.json) stops them all in one
  line, none waiting at the next collective for a process that has stopped."""
  url = f'{server.root}/process_zero'
  folder = storage.path(url) / 'checkpoints'
  storage.write_text(folder / '3' / checkpoints.COMMIT_FILE, '')
  storage.write_text(folder / '5' / 'state' / 'part', 'cut short')
  port = free_port()
  procs = [subprocess.Popen(
      [sys.executable, '-c', _PROCESS_ZERO.format(repo=REPO, coordinator=f'localhost:{port}',
                                                  pid=pid, workdir=url)],
      cwd=REPO, env=dict(os.environ, **server.env, JAX_PLATFORMS='cpu',
                         XLA_FLAGS=cpu_xla_flags(1)),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
  outs = [p.communicate(timeout=120)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
    assert 'steps [3]' in out, out[-3000:]
  assert 'listed with the uncommitted step: False' in outs[1], outs[1][-3000:]
  assert 'error OSError the bucket refused the write' in outs[0], outs[0][-3000:]
  assert (f'error ProcessFailed process 0 failed to write {url}/config.json; its log says '
          'why') in outs[1], outs[1][-3000:]


def test_two_processes_train_and_resume_a_run_in_a_bucket(server, tmp_path, reference):
  """As the hosts of a pod: two processes (one device each) share a gs:// workdir (process 0
  holds the lock object, all write their checkpoint shards there), stop after 6 steps and
  resume to the end: the losses of the one-process, two-device run on local disk."""
  url = f'{server.root}/two_processes'
  coordinators = []

  def launch(num_steps):
    port = free_port()
    coordinators.append(port)
    procs = [_child(server, tmp_path, devices=1, workdir=url, coordinator=f'localhost:{port}',
                    num_processes=2, process_id=i,
                    train={'num_steps': num_steps, 'checkpoint_every_steps': 3})
             for i in range(2)]
    outs = [p.communicate(timeout=400)[1] for p in procs]
    for p, err in zip(procs, outs):
      assert p.returncode == 0, err[-3000:]

  launch(6)
  assert sorted(_losses(url)) == list(range(1, 7))
  launch(NUM_STEPS)
  got = _losses(url)
  assert sorted(got) == sorted(reference)
  np.testing.assert_allclose([got[s] for s in sorted(reference)],
                             [reference[s] for s in sorted(reference)], rtol=2e-5)
  assert '.lock' not in {p.name for p in storage.path(url).iterdir()}
  _assert_loopback_only(tmp_path / 'hosts.txt', server, *coordinators)
