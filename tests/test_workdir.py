"""A workdir is never damaged by a second run or a changed config; preemption exits
"not finished"; short runs warm up for a fraction of the run."""

import errno
import fcntl
import itertools
import json
import os
import logging
import signal
import socket
import subprocess
import sys
import time

import jax
import ml_collections
import pytest

import train
from configs import pretrain
from realformer import cli
from realformer.train import checkpoints
from realformer.train import pretraining
from realformer.train import train_lib
from realformer.train import workdir as workdir_lib
from realformer.train.run_dir import RunDir
from tests.conftest import cpu_xla_flags
from tests.gcs_server import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _wait_for(proc, condition, every: float = 0.02, timeout: float = 240):
  """Polls `condition` while `proc` runs; fails with its stderr if it exits or times out."""
  deadline = time.time() + timeout
  while not condition():
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
    time.sleep(every)


def tiny_config(**train_overrides):
  c = pretrain.get_config('postln,tiny')
  c.unlock()
  c.data.sources = 'synthetic'
  c.model.num_layers, c.model.hidden_size, c.model.num_heads, c.model.mlp_dim = 1, 32, 2, 64
  c.model.vocab_size, c.model.max_len = 100, 32
  c.data.max_seq_length, c.data.max_predictions_per_seq = 32, 5
  c.train.batch_size, c.train.num_steps, c.train.eval_steps = 4, 2, 0
  c.train.log_every_steps = c.train.checkpoint_every_steps = 1
  for k, v in train_overrides.items():
    c.train[k] = v
  return c


def run(config, workdir):
  return train.train_and_evaluate(config, str(workdir), devices=jax.devices()[:1])


def test_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path, caplog,
                                                                monkeypatch):
  with workdir_lib.Lock(str(tmp_path)):
    with pytest.raises(workdir_lib.WorkdirInUseError,
                       match=f'in use by pid {os.getpid()} on {socket.gethostname()}'):
      workdir_lib.Lock(str(tmp_path)).__enter__()
  assert (tmp_path / '.lock').read_text() == ''  # released
  # A record left by a process that died on this host (its flock went with it).
  (tmp_path / '.lock').write_text(json.dumps({'host': socket.gethostname(), 'pid': 999999,
                                              'since': 'earlier'}))
  with workdir_lib.Lock(str(tmp_path)):
    assert json.loads((tmp_path / '.lock').read_text())['pid'] == os.getpid()
  assert 'taking over the lock of pid 999999' in caplog.text
  # Another host's record: that run may be alive on a filesystem without flock.
  (tmp_path / '.lock').write_text(json.dumps({'host': 'other-host', 'pid': 1, 'since': 'x'}))
  with pytest.raises(workdir_lib.WorkdirInUseError, match='delete .*/.lock'):
    workdir_lib.Lock(str(tmp_path)).__enter__()
  # SLURM: a requeued job (a node failed) takes over its earlier start's lock on any node;
  # the same start (another step of the job running at once) or another job does not.
  (tmp_path / '.lock').write_text(json.dumps({'host': 'other-host', 'pid': 1, 'since': 'x',
                                              'slurm_job': '77', 'slurm_restart': 0}))
  monkeypatch.setenv('SLURM_JOB_ID', '77')
  for restart, job in (('0', '77'), ('1', '78')):
    monkeypatch.setenv('SLURM_RESTART_COUNT', restart)
    monkeypatch.setenv('SLURM_JOB_ID', job)
    with pytest.raises(workdir_lib.WorkdirInUseError, match='delete .*/.lock'):
      workdir_lib.Lock(str(tmp_path)).__enter__()
  monkeypatch.setenv('SLURM_JOB_ID', '77')
  monkeypatch.setenv('SLURM_RESTART_COUNT', '1')
  with workdir_lib.Lock(str(tmp_path)):
    record = json.loads((tmp_path / '.lock').read_text())
    assert (record['slurm_job'], record['slurm_restart']) == ('77', 1)
  assert 'taking over the lock of pid 1 on other-host' in caplog.text
  (tmp_path / '.lock').write_text('')


def test_a_lock_held_before_its_record_or_a_file_system_without_locks(tmp_path, monkeypatch):
  """A run whose lock is taken but its record not yet written is 'starting', not 'pid None';
  a file system that cannot lock (NFS without lockd, a noflock mount) is its own one-line
  error, not "in use"."""
  with open(tmp_path / '.lock', 'w') as held:
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with pytest.raises(workdir_lib.WorkdirInUseError,
                       match='in use by another run that is starting; wait'):
      workdir_lib.Lock(str(tmp_path)).__enter__()

  def no_locks(fd, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
  monkeypatch.setattr(workdir_lib.fcntl, 'flock', no_locks)
  with pytest.raises(ValueError, match='on a file system that cannot lock files .*; use a '
                     'folder on a local disk, or a gs:// bucket'):
    workdir_lib.Lock(str(tmp_path / 'nfs')).__enter__()
  assert not (tmp_path / 'nfs').exists()  # the folder it made is gone again


def test_a_run_without_a_checkpoint_may_be_restarted_with_another_config(tmp_path):
  earlier = pretraining.resolved_config(tiny_config())
  earlier.model.variant = 'preln'  # an earlier start that stopped before its first checkpoint
  (tmp_path / 'config.json').write_text(earlier.to_json_best_effort())
  run(tiny_config(), tmp_path)
  assert json.loads((tmp_path / 'config.json').read_text())['model']['variant'] == 'postln'


def test_a_vocab_size_the_tokenizer_replaces_is_said(caplog):
  config = tiny_config()
  config.data.sources = 'embedded'  # the shipped corpus and its 8,000-piece tokenizer
  config.model.vocab_size = 30522
  with caplog.at_level(logging.INFO):
    assert pretraining.resolved_config(config).model.vocab_size == 8000
  assert ("model.vocab_size=8000: the tokenizer's (data.tokenizer), in place of the config's "
          '30522' in caplog.text)


@pytest.mark.parametrize('text', ['[1, 2]', '{"model": {"variant": "postln"', '"text"'])
def test_a_config_json_that_is_no_config_object(tmp_path, text):
  (tmp_path / 'config.json').write_text(text)
  assert workdir_lib.check_resume_config(str(tmp_path), tiny_config(), False) == []
  with pytest.raises(ValueError, match='is not readable JSON.*holds checkpoints'):
    workdir_lib.check_resume_config(str(tmp_path), tiny_config(), True)


def test_a_field_added_since_a_run_began_stands_for_its_old_default(tmp_path):
  """A config.json written before optimizer.name (model.gelu) existed was an AdamW (erf GELU)
  run: resuming it with LAMB (tanh) is refused by name, with AdamW (erf) it resumes."""
  old = json.loads(tiny_config().to_json_best_effort())
  del old['optimizer']['name'], old['model']['gelu']
  (tmp_path / 'config.json').write_text(json.dumps(old))
  assert workdir_lib.check_resume_config(str(tmp_path), tiny_config(), True) == []
  lamb = tiny_config()
  lamb.optimizer.name = 'lamb'
  with pytest.raises(ValueError, match="1 field\\): optimizer.name: 'adamw' -> 'lamb'; resume"):
    workdir_lib.check_resume_config(str(tmp_path), lamb, True)
  tanh = tiny_config()
  tanh.model.gelu = 'tanh'
  with pytest.raises(ValueError, match="1 field\\): model.gelu: 'erf' -> 'tanh'; resume"):
    workdir_lib.check_resume_config(str(tmp_path), tanh, True)


def test_configs_run_gives_a_run_the_config_it_was_started_with(tmp_path):
  """configs/run.py:<workdir> (or its config.json) is the config in the run's config.json, as
  its program's config file types it: a pretraining and a fine-tuning run's come back equal;
  a field added since the run began takes the value such runs computed (ADDED_DEFAULTS), a
  field the config no longer has, a file that is no run's config and a missing one are one
  line each; a refused resume names it."""
  from configs import finetune as finetune_configs  # pylint: disable=g-import-not-at-top
  stored = tiny_config()
  stored.model.variant, stored.optimizer.name = 'realformer', 'lamb'
  stored.model.block = 'post_ln'
  tuned = finetune_configs.get_config('squad/v2.0')
  tuned.seed, tuned.init_checkpoint = 3, '/runs/rf'
  for name, config in (('pretraining', stored), ('finetuning', tuned)):
    (tmp_path / name).mkdir()
    (tmp_path / name / 'config.json').write_text(config.to_json_best_effort())
    for given in (tmp_path / name, tmp_path / name / 'config.json'):
      again = cli.load_config(f'configs/run.py:{given}')
      assert again.to_json_best_effort() == config.to_json_best_effort(), name
  old = json.loads(stored.to_json_best_effort())
  del old['optimizer']['name'], old['model']['gelu']  # (a run of before these fields)
  (tmp_path / 'old').mkdir()
  (tmp_path / 'old' / 'config.json').write_text(json.dumps(old))
  again = cli.load_config(f'configs/run.py:{tmp_path / "old"}')
  assert (again.optimizer.name, again.model.gelu) == ('adamw', 'erf')
  assert again.model.variant == 'realformer' and again.train.batch_size == 4
  old['model']['talking_heads'] = True  # (a field of a fork, or one removed since)
  (tmp_path / 'old' / 'config.json').write_text(json.dumps(old))
  with pytest.raises(ValueError, match=r'config.json holds 1 field this pretraining config has '
                                       r'not \(model.talking_heads\); give train.py its config'):
    cli.load_config(f'configs/run.py:{tmp_path / "old"}')
  (tmp_path / 'old' / 'config.json').write_text('{"text": 1}')
  with pytest.raises(ValueError, match='is not the config of a train.py or finetune.py run'):
    cli.load_config(f'configs/run.py:{tmp_path / "old"}')
  with pytest.raises(ValueError, match=r'nowhere/config.json not found; give configs/run.py '
                                       r'the workdir of a run'):
    cli.load_config(f'configs/run.py:{tmp_path / "nowhere"}')
  other = tiny_config()
  other.model.mlp_dim *= 2
  with pytest.raises(ValueError, match=rf'resume with the stored values \(--config '
                                       rf'configs/run.py:{tmp_path / "pretraining"}\)'):
    workdir_lib.check_resume_config(str(tmp_path / 'pretraining'), other, True)


def test_a_preset_field_spelled_out_is_the_preset(tmp_path):
  """A resume that gives a preset's own value (model.block=pre_ln on a Pre-LN run,
  residual_attention on RealFormer's) names the same encoder: it resumes; another value is
  refused, named by what each config computes."""
  stored = tiny_config()
  stored.model.variant = 'preln'
  (tmp_path / 'config.json').write_text(stored.to_json_best_effort())
  spelled = tiny_config()
  spelled.model.variant, spelled.model.block = 'preln', 'pre_ln'
  assert workdir_lib.check_resume_config(str(tmp_path), spelled, True) == []
  spelled.model.residual_attention = False  # (postln's and preln's preset value too)
  assert workdir_lib.check_resume_config(str(tmp_path), spelled, True) == []
  other = tiny_config()
  other.model.variant, other.model.block = 'preln', 'post_ln'
  with pytest.raises(ValueError, match="1 field\\): model.block: 'pre_ln' -> 'post_ln'; resume"):
    workdir_lib.check_resume_config(str(tmp_path), other, True)


def test_grain_worker_count_is_fixed_for_a_run_and_its_read_threads_are_not(tmp_path):
  """grain's saved iterator state holds each worker's position, so data.worker_count must
  stay; data.read_threads only changes how fast records are read."""
  (tmp_path / 'config.json').write_text(tiny_config().to_json_best_effort())
  faster = tiny_config()
  faster.data.read_threads = 7
  assert workdir_lib.check_resume_config(str(tmp_path), faster, True) == ['data.read_threads']
  relaid = tiny_config()  # the prepared files' layout, and where TFDS keeps its data
  relaid.data.records_per_file, relaid.data.tfds_data_dir = 3, '/elsewhere'
  assert workdir_lib.check_resume_config(str(tmp_path), relaid, True) == [
      'data.records_per_file', 'data.tfds_data_dir']
  workers = tiny_config()
  workers.data.worker_count = 2
  with pytest.raises(ValueError, match=r'data.worker_count: 0 -> 2; resume'):
    workdir_lib.check_resume_config(str(tmp_path), workers, True)
  # Another run from these weights is named where it could load them: not at other sizes.
  faster = tiny_config()
  faster.optimizer.learning_rate = 0.5
  with pytest.raises(ValueError, match=rf'start a new --workdir \(with --config.train.'
                                       rf'init_checkpoint={tmp_path} to begin from its '
                                       r'weights\)$'):
    workdir_lib.check_resume_config(str(tmp_path), faster, True)
  wider = tiny_config()
  wider.model.mlp_dim *= 2
  with pytest.raises(ValueError, match=r'or start a new --workdir$'):
    workdir_lib.check_resume_config(str(tmp_path), wider, True)


def test_fine_tuning_settings_of_how_it_runs_may_change_on_resume(tmp_path):
  """What compiles when and which lengths the coming epochs pad to; a change of the bucket
  settings in mid-epoch is refused by finetune/task.length_buckets itself."""
  from configs import finetune as finetune_configs  # pylint: disable=g-import-not-at-top
  config = finetune_configs.get_config('glue/rte')
  (tmp_path / 'config.json').write_text(config.to_json_best_effort())
  changed = finetune_configs.get_config('glue/rte')
  changed.compile_in_background = not config.compile_in_background
  changed.bucket_compile_seconds = 1.0
  changed.bucket_flops_per_second = 1e12
  assert sorted(workdir_lib.check_resume_config(str(tmp_path), changed, True)) == [
      'bucket_compile_seconds', 'bucket_flops_per_second', 'compile_in_background']
  changed.max_seq_length = 64
  with pytest.raises(ValueError, match='max_seq_length: 128 -> 64'):
    workdir_lib.check_resume_config(str(tmp_path), changed, True)
  # How the encoder computes (config.model): kernels and remat may change, its dtype and
  # dropout may not; a run begun before config.model existed computed as pretrained.
  (tmp_path / 'config.json').write_text(config.to_json_best_effort())
  kernels = finetune_configs.get_config('glue/rte')
  kernels.model.fused_attention, kernels.model.remat_policy = 'off', 'full'
  assert workdir_lib.check_resume_config(str(tmp_path), kernels, True) == [
      'model.fused_attention', 'model.remat_policy']
  old = json.loads(config.to_json_best_effort())
  del old['model']
  (tmp_path / 'config.json').write_text(json.dumps(old))
  assert workdir_lib.check_resume_config(str(tmp_path), config, True) == []
  for key, value in (('dtype', 'bfloat16'), ('attention_dropout_rate', 0.0)):
    other = finetune_configs.get_config('glue/rte')
    other.model[key] = value
    with pytest.raises(ValueError, match=f'model.{key}: .* -> {value!r}; resume'):
      workdir_lib.check_resume_config(str(tmp_path), other, True)


def test_a_pretraining_folder_is_not_taken_over_by_fine_tuning(tmp_path):
  """The other direction: finetune.py in a pretraining run's folder (its config.json shares
  the model.* names of fine-tuning's config.model) is another program's run, with a
  checkpoint or without (a run stopped before its first save)."""
  from configs import finetune as finetune_configs  # pylint: disable=g-import-not-at-top
  (tmp_path / 'config.json').write_text(tiny_config().to_json_best_effort())
  for task in ('glue/rte', 'squad/v1.1'):
    for has_checkpoint in (False, True):
      with pytest.raises(ValueError, match=(
          rf"^{tmp_path} is a pretraining run \(its config.json is train.py's\), not a "
          rf'fine-tuning run; use another --workdir \(to fine-tune it: '
          rf"--config.init_checkpoint={tmp_path} and a --workdir of the fine-tuning run's "
          r'own\)$')):
        workdir_lib.check_resume_config(str(tmp_path), finetune_configs.get_config(task),
                                        has_checkpoint)
  # The reverse: train.py in a fine-tuning run's folder.
  (tmp_path / 'config.json').write_text(finetune_configs.get_config('glue/rte')
                                        .to_json_best_effort())
  with pytest.raises(ValueError, match=rf"^{tmp_path} is a fine-tuning run \(its config.json "
                     r"is finetune.py's\), not a pretraining run; use another --workdir$"):
    workdir_lib.check_resume_config(str(tmp_path), tiny_config(), False)


def test_a_finished_fine_tuning_run_is_not_taken_over_by_pretraining(tmp_path):
  """A finished fine-tuning run keeps no checkpoint in checkpoints/ (its params are in
  best/ and final/): train.py must still see that the folder is another program's."""
  (tmp_path / 'config.json').write_text(json.dumps({'task': 'rte', 'batch_size': 8}))
  (tmp_path / 'final').mkdir()
  with pytest.raises(ValueError, match="is another program's run"):
    run(tiny_config(), tmp_path)
  assert sorted(set(os.listdir(tmp_path)) - {RunDir.LOCK}) == ['config.json', 'final']
  assert json.loads((tmp_path / 'config.json').read_text())['task'] == 'rte'


def test_warmup_as_a_fraction_of_the_run():
  opt = ml_collections.ConfigDict({'warmup_steps': -1, 'warmup_fraction': 0.1})
  assert train_lib.warmup_steps(opt, 5) == 0 and train_lib.warmup_steps(opt, 300) == 30
  opt.warmup_steps = 10
  with pytest.raises(ValueError, match='warmup_steps=10 must lie.*set it to -1'):
    train_lib.warmup_steps(opt, 5)
  opt.warmup_fraction = 7.0  # a mistake even where warmup_steps, not it, sets the warm-up
  with pytest.raises(ValueError, match=r'warmup_fraction=7.0 must lie in \[0, 1\]'):
    train_lib.warmup_steps(opt, 300)
  assert pretrain.get_config('postln,tiny').optimizer.warmup_steps == -1
  assert pretrain.get_config('postln,tiny,runlocal').optimizer.warmup_steps == -1


def test_command_line_second_run_refused_and_preemption_exits_not_finished(commands, tmp_path):
  env = dict(os.environ, XLA_FLAGS=cpu_xla_flags(1))
  args = [sys.executable, 'train.py', f'--workdir={tmp_path}', '--config.data.sources=synthetic',
          '--config.model.num_layers=1', '--config.model.hidden_size=32',
          '--config.model.mlp_dim=64', '--config.model.vocab_size=100',
          '--config.data.max_seq_length=32', '--config.data.max_predictions_per_seq=5',
          '--config.train.batch_size=4', '--config.train.num_steps=100000',
          '--config.train.log_every_steps=1', '--config.train.eval_steps=0',
          '--config.train.checkpoint_every_steps=100000']
  # (Ctrl-C's default restored first: a test run in the background inherits it ignored)
  interactive = [sys.executable, '-c', 'import os, signal, sys; signal.signal(signal.SIGINT, '
                 'signal.SIG_DFL); os.execv(sys.executable, [sys.executable] + sys.argv[1:])']
  first = subprocess.Popen(interactive + args[1:], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
  try:
    metrics = tmp_path / 'metrics.jsonl'
    _wait_for(first, lambda: metrics.exists() and metrics.read_text().strip(), every=0.5)
    second = commands.run(args[1:], env=env)  # refused before it trains
    assert second.returncode == 1
    errors = [l for l in second.stderr.splitlines() if l.startswith('error:')]
    assert len(errors) == 1 and f'in use by pid {first.pid}' in errors[0], second.stderr[-3000:]
    assert 'Traceback' not in second.stderr
    first.send_signal(signal.SIGINT)  # Ctrl-C, as a scheduler's SIGTERM (test_checkpoints)
    _, err = first.communicate(timeout=240)
    assert first.returncode == workdir_lib.EXIT_NOT_FINISHED, err[-3000:]
    assert 'not finished: stopped by SIGTERM or Ctrl-C after saving step' in err
    assert checkpoints.has_complete_step(str(tmp_path))
  finally:
    if first.poll() is None:
      first.kill()


def test_ctrl_c_outside_a_training_loop_is_one_line():
  """A program stopped by Ctrl-C where nothing saves (a launch check, a tool): one line and
  the shell's status for SIGINT, not a traceback."""
  code = ('import signal, sys, time\n'
          f'sys.path.insert(0, {REPO!r})\n'
          'signal.signal(signal.SIGINT, signal.default_int_handler)  # (as at a terminal)\n'
          'from realformer import cli\n'
          'def main():\n'
          '  print("ready", flush=True)\n'
          '  time.sleep(60)\n'
          'cli.run_main(main)\n')
  proc = subprocess.Popen([sys.executable, '-c', code], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, JAX_PLATFORMS='cpu'))
  try:
    assert proc.stdout.readline().strip() == 'ready'
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == cli.EXIT_INTERRUPTED, err[-3000:]
  assert err.strip().splitlines()[-1] == 'stopped by Ctrl-C' and 'Traceback' not in err


def test_sigterm_before_the_training_loop_exits_not_finished(tmp_path):
  """Preparing or compiling: a SIGTERM stops the run at once with the not-finished status
  (a scheduler requeues it), not the default 143 that a supervising loop reads as final."""
  env = dict(os.environ, XLA_FLAGS=cpu_xla_flags(1))
  proc = subprocess.Popen(
      [sys.executable, 'train.py', f'--workdir={tmp_path}', '--config.data.sources=synthetic',
       '--config.model.num_layers=1', '--config.model.hidden_size=32',
       '--config.model.mlp_dim=64', '--config.model.vocab_size=100',
       '--config.data.max_seq_length=32', '--config.data.max_predictions_per_seq=5',
       '--config.train.batch_size=4', '--config.train.num_steps=100000'],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    _wait_for(proc, (tmp_path / RunDir.LOCK).exists)  # the run has begun its setup
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == workdir_lib.EXIT_NOT_FINISHED, err[-3000:]
  assert 'not finished: stopped by SIGTERM or Ctrl-C' in err and 'Traceback' not in err
  # Released as on a clean exit: the requeued run takes the workdir without a warning.
  assert (tmp_path / RunDir.LOCK).read_text() == ''


@pytest.mark.parametrize('program,override,expected', [
    ('train.py', '--config.train.num_stepz=5',
     "error: unknown config key 'train.num_stepz' (did you mean 'train.num_steps'?)"),
    ('train.py', '--config.train.num_steps=abc',
     "error: flag --config.train.num_steps=abc: invalid literal for int() with base 10: 'abc'"),
    ('finetune.py', '--config.batch_sise=3',
     "error: unknown config key 'batch_sise' (did you mean 'batch_size'?)"),
])
def test_config_mistakes_are_one_line(tmp_path, program, override, expected):
  proc = subprocess.run([sys.executable, program, f'--workdir={tmp_path / "run"}', override],
                        cwd=REPO, capture_output=True, text=True, timeout=240)
  lines = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith(expected), proc.stderr
  assert 'Traceback' not in proc.stderr
  assert not os.listdir(tmp_path)  # nothing written, the workdir not even made


def test_a_run_keeps_its_tokenizer_so_a_moved_import_loses_nothing(commands, tmp_path):
  """A run keeps a copy of its data.tokenizer's files beside config.json (here a cased
  WordPiece vocab.txt and its tokenizer_config.json, as an import's folder holds them), so
  that after that folder is moved the same command resumes the run, another path to the
  same files does too, and the workdir's readers (fine-tuning, export-hf) take the copy with
  its casing. (A continued-pretraining trial's run could be neither resumed nor
  fine-tuned once the import's folder was gone.)"""
  from data import sources  # pylint: disable=g-import-not-at-top
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from realformer.tools import interop  # pylint: disable=g-import-not-at-top
  docs = list(itertools.islice(sources.iter_documents('embedded'), 6))
  corpus = tmp_path / 'corpus.txt'
  corpus.write_text(''.join('\n'.join(d) + '\n\n' for d in docs))
  imported = tmp_path / 'import'
  tokenizer_lib.train_wordpiece(str(corpus), str(imported), 300, lowercase=False)
  assert json.loads((imported / 'tokenizer_config.json').read_text())['do_lower_case'] is False
  run = tmp_path / 'run'
  args = ['train.py', f'--workdir={run}', '--config=configs/pretrain.py:postln,tiny,runlocal',
          f'--config.data.sources=files:{corpus}', '--config.model.num_layers=1',
          '--config.model.hidden_size=32', '--config.model.num_heads=2',
          '--config.model.mlp_dim=64', '--config.train.eval_steps=0']
  env = dict(os.environ, XLA_FLAGS=cpu_xla_flags(1))
  given = [f'--config.data.tokenizer={imported / "vocab.txt"}']
  proc = commands.run(args + given + ['--config.train.num_steps=2'], env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name in ('vocab.txt', 'tokenizer_config.json'):
    assert (run / name).read_bytes() == (imported / name).read_bytes()
  moved = tmp_path / 'moved'
  imported.rename(moved)
  for steps, tokenizer in ((3, imported), (4, moved), (5, imported)):  # gone, elsewhere, gone
    proc = commands.run(args + [f'--config.data.tokenizer={tokenizer / "vocab.txt"}',
                                f'--config.train.num_steps={steps}'], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f'resuming from step {steps - 1}' in proc.stderr, proc.stderr[-3000:]
    assert ('reading the run\'s copy of it' in proc.stderr) == (tokenizer == imported)
  stored = checkpoints.read_pretraining_config(str(run))
  assert stored['data']['tokenizer'] == str(run / 'vocab.txt')
  tokenizer = tokenizer_lib.load_for_config(ml_collections.ConfigDict(stored['data']))
  assert tokenizer.encode('Congress') != tokenizer.encode('congress')  # cased, as trained
  interop.export_hf(str(run), str(tmp_path / 'hf'))
  assert json.loads((tmp_path / 'hf' / 'tokenizer_config.json').read_text())[
      'do_lower_case'] is False
  # Where neither is there, fine-tuning says what to put back, and where (it said to set a
  # pretraining field that fine-tuning has not).
  (run / 'vocab.txt').unlink()
  data = tmp_path / 'tsv'
  data.mkdir()
  for split in ('train', 'dev'):
    (data / f'{split}.tsv').write_text('text\tlabel\na b\t0\nc d\t1\n')
  proc = commands.run(['finetune.py', '--config=configs/finetune.py:tsv/t',
                       f'--config.init_checkpoint={run}', f'--config.data_dir={data}',
                       f'--workdir={tmp_path / "ft"}'], env=env)
  errors = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
  assert errors[0].startswith(f'error: the tokenizer of config.init_checkpoint={run}, '
                              f'{run / "vocab.txt"}, is not there'), errors[0]


def test_the_kept_tokenizer_stands_for_the_runs_own_vocabulary_alone(tmp_path):
  """What the copy may not do: keep another vocabulary's casing file beside a new one; lend a
  file a failed start left to a fresh start whose path is not there; let a resume go on
  with a vocabulary retrained at the stored path, or given another path to such files; and
  final/ (checkpoints.save_params) keeps one as best/ does. (A review's findings.)"""
  from realformer.train import trainer  # pylint: disable=g-import-not-at-top
  from realformer.train.run_dir import RunDir  # pylint: disable=g-import-not-at-top

  def vocab(folder, pieces, cased=None):
    folder.mkdir()
    (folder / 'vocab.txt').write_text('\n'.join(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']
                                                + pieces) + '\n')
    if cased is not None:
      (folder / 'tokenizer_config.json').write_text(json.dumps({'do_lower_case': not cased}))
    return ml_collections.ConfigDict({'data': {'tokenizer': str(folder / 'vocab.txt')}})

  a, b = vocab(tmp_path / 'a', ['Hello', 'hello'], cased=True), vocab(tmp_path / 'b', ['hi'])
  run = tmp_path / 'run'
  checkpoints.write_config(str(run), a)
  assert (run / 'tokenizer_config.json').read_text() == '{"do_lower_case": false}'
  checkpoints.write_config(str(run), b)  # (a start in the folder a failed start left)
  assert (run / 'vocab.txt').read_text().endswith('hi\n')
  assert not (run / 'tokenizer_config.json').exists()
  typo = ml_collections.ConfigDict({'data': {'tokenizer': str(tmp_path / 'typo' / 'vocab.txt')}})
  assert trainer._with_kept_tokenizer(typo, RunDir(str(run))) is typo  # no checkpoint there
  checkpoints.save_params(str(tmp_path / 'final'), {'w': jax.numpy.zeros(2)}, a)
  assert sorted(os.listdir(tmp_path / 'final')) == ['checkpoints', 'config.json',
                                                    'tokenizer_config.json', 'vocab.txt']
  # A resume: the stored path retrained, or another path to those files, is refused; the
  # run's own files by another path are the same run.
  checkpoints.write_config(str(run), a)
  vocab(tmp_path / 'own', ['Hello', 'hello'], cased=True)
  (tmp_path / 'a' / 'vocab.txt').write_text((tmp_path / 'a' / 'vocab.txt').read_text() + 'x\n')
  with pytest.raises(ValueError, match=r"data.tokenizer .*a/vocab.txt holds other files than "
                                       r"the run's copy of it, .*run/vocab.txt"):
    workdir_lib.check_resume_config(str(run), a, True)
  retrained = vocab(tmp_path / 'c', ['Hello', 'hello', 'x'], cased=True)
  with pytest.raises(ValueError, match=r'another config \(1 field\): data.tokenizer'):
    workdir_lib.check_resume_config(str(run), retrained, True)
  own = ml_collections.ConfigDict({'data': {'tokenizer': str(tmp_path / 'own' / 'vocab.txt')}})
  assert workdir_lib.check_resume_config(str(run), own, True) == []


@pytest.mark.parametrize('program,ask,doc', [('train.py', '-h', 'Pretrain a BERT-style'),
                                              ('finetune.py', '--help', 'Fine-tune a')])
def test_help_lists_the_flags_and_exits_0(program, ask, doc):
  proc = subprocess.run([sys.executable, program, ask], cwd=REPO, capture_output=True,
                        text=True, timeout=240)
  assert proc.returncode == 0, proc.stderr[-3000:]  # (absl's own --help exits 1)
  assert proc.stdout.startswith(doc), proc.stdout[:200]  # the program's docstring, then flags
  assert '--workdir:' in proc.stdout and '--config:' in proc.stdout and not proc.stderr


def test_a_resume_on_another_number_of_hosts_is_refused_in_one_line(commands, tmp_path):
  """Each host reads its own share of the prepared records, so the position two hosts saved
  says nothing about where one host stands: one line naming both counts and the ways on,
  before anything is restored; the checkpoint is left as it was."""
  args = ['train.py', f'--workdir={tmp_path}', '--config=configs/pretrain.py:postln,tiny,runlocal',
          '--config.model.num_layers=1', '--config.model.hidden_size=32',
          '--config.model.num_heads=2', '--config.model.mlp_dim=64',
          '--config.train.eval_steps=0', '--config.train.log_every_steps=1']
  env = dict(os.environ, XLA_FLAGS=cpu_xla_flags(1))
  proc = commands.run(args + ['--config.train.num_steps=2'], env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  data = tmp_path / 'checkpoints' / '2' / 'data'
  saved = data / 'process_0-of-1.json'  # grain's: one file per host
  for i in range(2):  # as two hosts would have left it
    (data / f'process_{i}-of-2.json').write_text(saved.read_text())
  saved.unlink()
  proc = commands.run(args + ['--config.train.num_steps=4'], env=env)
  errors = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
  assert ('holds the input position of 2 training processes and this start has 1' in errors[0]
          and 'resume it on 2' in errors[0])
  assert f'--config.train.init_checkpoint={tmp_path / "checkpoints" / "2"}' in errors[0]
  assert sorted(p.name for p in data.glob('process_*')) == ['process_0-of-2.json',
                                                           'process_1-of-2.json']
  assert 'Traceback' not in proc.stderr


def test_a_resume_prints_no_warning_but_a_moved_learning_rate(commands, tmp_path):
  args = [sys.executable, 'train.py', f'--workdir={tmp_path}', '--config.data.sources=synthetic',
          '--config.model.num_layers=1', '--config.model.hidden_size=32',
          '--config.model.mlp_dim=64', '--config.model.vocab_size=100',
          '--config.data.max_seq_length=32', '--config.data.max_predictions_per_seq=5',
          '--config.train.batch_size=4', '--config.train.eval_steps=0',
          '--config.train.checkpoint_every_steps=1']
  env = dict(os.environ, XLA_FLAGS=cpu_xla_flags(1))
  proc = commands.run(args[1:] + ['--config.train.num_steps=2'], env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The resume from `python` itself: a warning printed while the libraries import counts.
  proc = subprocess.run(args + ['--config.train.num_steps=3'], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stderr[-3000:]
  warnings = [l for l in proc.stderr.splitlines() if l[:1] in 'WE' and l[1:2].isdigit()]
  # The one warning: a longer run moves the learning rate where it resumes (linear decay to
  # 0 at step 2 of 2, then at step 2 of 3 a third of the peak).
  assert 'resuming from' in proc.stderr and len(warnings) == 1, warnings
  assert ('resumed at step 2 with train.num_steps 2 -> 3: the learning rate there moves from '
          '0 to 0.000333') in warnings[0]
  # What may change on resume does, and is logged; what may not is refused, config.json kept.
  assert 'resuming with train.num_steps changed: 2 -> 3' in proc.stderr
  stored = (tmp_path / 'config.json').read_text()
  assert json.loads(stored)['train']['num_steps'] == 3
  proc = commands.run(args[1:] + ['--config.train.num_steps=4',
                                  '--config.model.variant=realformer'], env=env)
  errors = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
  assert "model.variant: 'postln' -> 'realformer'" in errors[0] and 'new --workdir' in errors[0]
  assert (tmp_path / 'config.json').read_text() == stored
  proc = commands.run(args[1:] + ['--config.train.num_steps=4', '--config.model.hidden_size=64',
                                  '--config.model.num_heads=4'], env=env)
  errors = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
  assert ('another config (2 fields): model.hidden_size: 32 -> 64, model.num_heads: 2 -> 4'
          in errors[0])
  assert (tmp_path / 'config.json').read_text() == stored
  proc = commands.run(args[1:] + ['--config.data.max_seq_length=16'], env=env)
  errors = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
  assert errors[0].endswith('(a second phase at another length: a new --workdir with '
                            f'--config.train.init_checkpoint={tmp_path})'), errors[0]
  # The record of a run that died on this host (kill -9: its flock went with it).
  (tmp_path / RunDir.LOCK).write_text(json.dumps(
      {'host': socket.gethostname(), 'pid': 999999, 'since': 'earlier', 'program': 'train.py'}))
  proc = commands.run(args[1:] + ['--config.train.num_steps=3'], env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'taking over the lock of pid 999999' in proc.stderr
  # Nothing left to train: said as such (not "resuming"), and where the run is.
  assert ('the run finished at step 3 (' in proc.stderr and 'nothing is left to train (a '
          'larger train.num_steps trains it further)' in proc.stderr), proc.stderr[-3000:]
  assert 'resuming from' not in proc.stderr
  assert (f"done at step 3; the run (checkpoints, metrics.jsonl, TensorBoard's events) is in "
          f'{tmp_path}') in proc.stderr
  # A run is not shortened past its checkpoint; a workdir whose config.json is gone does
  # not say what its checkpoints are (it resumed as whatever model was asked for).
  def refused(steps):
    proc = commands.run(args[1:] + [f'--config.train.num_steps={steps}'], env=env)
    errors = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    return errors[0]
  assert 'checkpoint at step 3, past train.num_steps=2; give train.num_steps >= 3' in refused(2)
  assert (tmp_path / 'config.json').read_text() == stored
  os.remove(tmp_path / 'config.json')
  assert 'holds checkpoints but no config.json' in refused(4)
  assert not (tmp_path / 'config.json').exists()


# (argv, the error line's text) of every program's user errors; {tmp} is the test's folder,
# which holds a file `a_file`.
ONE_LINE_ERRORS = [
    (['sweep.py', 'run', '--root', '{tmp}/s', '--config', 'configs/pretrain.py:postln,tiny',
      '--sweep', 'model.varient=postln'], 'model.varient is not a field'),
    (['-m', 'realformer.tools.finetune_grid', '--tasks', 'rte', '--root', '{tmp}/g',
      '--init_checkpoint', '{tmp}/none'], 'is not a train.py or import workdir'),
    (['-m', 'realformer.tools.finetune_grid', '--tasks', 'rte', '--root', '{tmp}/g'],
     '--init_checkpoint is required: the train.py or import workdir whose encoder the grid '
     'fine-tunes (or --set from_scratch=True)'),
    (['-m', 'data.prepare', '--config', 'configs/pretrain.py:postln,tiny', '--out_dir',
      '{tmp}/p', '--config.data.sources=files:{tmp}/none*'], 'matches no file'),
    (['analyze.py', '--workdir', '{tmp}/none', '--out', '{tmp}/a'], 'does not exist'),
    (['-m', 'realformer.tools.interop', 'import-hf', '--src', '{tmp}/none', '--out', '{tmp}/x'],
     'none not found: pass the folder of an HF BERT checkpoint'),
    (['study.py', '--root', '{tmp}/st', '--seeds', '0'], 'need at least one seed'),
    (['finetune.py', '--workdir', '{tmp}/ft'], 'config.init_checkpoint is empty'),
    (['finetune.py', '--workdir', '{tmp}/ft', '--config.init_checkpoint={tmp}/none'],
     'config.json'),
    (['train.py', '--workdir', '{tmp}/w', '--config', 'configs/nope.py:postln,tiny'],
     "cannot load the --config file: No such file or directory: 'configs/nope.py'"),
    (['train.py', '--workdir', '{tmp}/w', '--config', 'configs/finetune.py:glue/rte'],
     '--config is a fine-tuning config: run it with finetune.py, or give train.py a '
     'pretraining config (configs/pretrain.py:<variant>,<size>)'),
    (['finetune.py', '--workdir', '{tmp}/w', '--config', 'configs/pretrain.py:postln,tiny'],
     '--config is a pretraining config: run it with train.py, or give finetune.py a '
     'fine-tuning config (configs/finetune.py:<kind>/<task>)'),
    (['train.py', '--compile_for', 'v5e:2x2', '--measure_steps', '3'],
     '--measure_steps is not read with --compile_for=v5e:2x2: the step is compiled for it'),
    (['sweep.py', 'run', '--root', '{tmp}/s', '--program', 'finetune.py'],
     '--config is a pretraining config: run it with train.py'),
    (['sweep.py', 'print', '--root', '{tmp}/s', '--program', 'finetune'],
     '--program finetune: no such file'),
    (['train.py', '--workdir', '{tmp}/w', '--config', 'configs/pretrain.py:foo,tiny'],
     "unknown variant 'foo'; choose one of postln"),
    (['train.py'], '--workdir is required'),
    (['train.py', '--workdir', '{tmp}/w', '--config.train.num_steps=5',
      '--config.optimizer.warmup_steps=30'],
     'optimizer.warmup_steps=30 must lie in [0, train.num_steps=5]'),
    (['-m', 'data.tokenizer', '--input', '{tmp}/none.txt'],
     '--model_prefix is required'),
    (['train.py', '--workdir', '{tmp}/w', '--max_compiles=3'],
     '--max_compiles needs --compile_for'),
    (['train.py', '--workdir', '{tmp}/w', '--measure_steps=3'],
     '--measure_steps needs --compile_for'),
    (['train.py', '--workdir', '{tmp}/w', '--config.optimizer.schedule=cosin'], 'cosin'),
    (['train.py', '--workdir', '{tmp}/w', '--config.optimizer.name=lars'],
     "optimizer.name='lars'; choose adamw, bert_adamw or lamb"),
    (['finetune.py', '--workdir', '{tmp}/ft', '--config.init_checkpoint={tmp}/none',
      '--config.optimizer.name=lars'], "optimizer.name='lars'; choose adamw, bert_adamw or lamb"),
    (['train.py', '--workdir', '{tmp}/w', '--config.data.sources=files:{tmp}/none*'],
     'matches no file'),
    (['finetune.py'], '--workdir is required'),
    (['train.py', '--workdir', '{tmp}/w', '--config.train.batch_size=-4'],
     'train.batch_size=-4: give a positive number'),
    (['train.py', '--workdir', '{tmp}/w', '--config.train.log_every_steps=0'],
     'train.log_every_steps=0: give a positive number of steps'),
    (['train.py', '--workdir', '{tmp}/w', '--config.train.num_steps=-3'],
     'train.num_steps=-3: give a positive number of steps'),
    (['train.py', '--workdir', '{tmp}/w', '--config.train.keep_checkpoints=0'],
     'train.keep_checkpoints=0: keep at least 1'),
    (['train.py', '--workdir', '{tmp}/w', '--config.train.eval_steps=-3'],
     'train.eval_steps=-3: give the evaluation\'s number of batches (0 turns evaluation off)'),
    (['train.py', '--workdir', '{tmp}/w', '--config.train.grad_accum_steps=-2'],
     'train.grad_accum_steps=-2: give a positive number of microbatches'),
    (['finetune.py', '--workdir', '{tmp}/ft', '--config.log_every_steps=0'],
     'config.log_every_steps=0: give a positive number'),
    (['study.py', '--root', '{tmp}/st', '--seeds', 'abc'], "flag --seeds=abc: invalid literal for int()"),
    (['study.py', 'compare', '--root', '{tmp}/st', '--variants', 'postln,foo', '--print_only'],
     "unknown variant 'foo'"),
    (['study.py', '--root', '{tmp}/st', '--size', 'huge', '--print_only'], "--size 'huge'"),
    (['study.py', 'compare', '--root', '{tmp}/st', '--report_only'],
     'no finished run under'),  # --report_only ran the whole study
    (['study.py', 'stability', '--root', '{tmp}/st', '--learning_rates', '1e-3,fast',
      '--print_only'], "--learning_rates '1e-3,fast': give comma-separated numbers"),
    (['study.py', 'compare', '--root', '{tmp}/st', '--steps', '-5', '--print_only'],
     '--steps=-5: give a positive number'),
    (['sweep.py', 'run', '--root', '{tmp}/s', '--config', 'configs/pretrain.py:postln,tiny',
      '--set', 'train.num_steps=-5'], 'train.num_steps=-5: give a positive number'),
    (['-m', 'data.prepare', '--config', 'configs/pretrain.py:postln,tiny'],
     '--out_dir is required'),
    (['-m', 'data.prepare', '--config', 'configs/pretrain.py:postln,tiny', '--out_dir',
      '{tmp}/a_file'], 'a_file is a file; the prepared data needs a folder'),
    (['-m', 'data.prepare', '--config', 'configs/pretrain.py:postln,tiny', '--out_dir',
      '{tmp}/p', '--config.data.sources=files:{tmp}'], 'it is a folder: give its files'),
    (['analyze.py', '--workdir', '{tmp}', '--out', '{tmp}/a_file'], 'a_file is a file'),
    (['-m', 'realformer.tools.interop', 'import-hf', '--src', '{tmp}/a_file', '--out', '{tmp}/x'],
     'a_file is a file: pass the folder of an HF BERT checkpoint'),
    (['train.py', '--workdir', '{tmp}/a_file/w', '--config.data.sources=synthetic'],
     'cannot be a folder: it or a folder above it is a file'),
    (['analyze.py', '--out', '{tmp}/a'], '--workdir is required'),
    (['finetune.py', '--workdir', '{tmp}/f', '--config.bucket_multiple=0'],
     'config.bucket_multiple=0: give a positive number'),
    (['finetune.py', '--workdir', '{tmp}/f', '--config.length_buckets=-2'],
     'config.length_buckets=-2: give the number of compiled lengths'),
    (['finetune.py', '--workdir', '{tmp}/f', '--config.bucket_compile_seconds=-1'],
     'config.bucket_compile_seconds=-1.0: give a number >= 0'),
    (['train.py', '--workdir', 's3://bucket/run', '--config.data.sources=synthetic'],
     "--workdir 's3://bucket/run': object storage is supported for gs:// (Cloud Storage) "
     'URLs; give a gs:// URL or a local folder'),
    (['train.py', '--workdir', 'gs://bucket/run', '--config.data.sources=synthetic'],
     'cannot reach Cloud Storage for gs://bucket/run/.lock: '),
    (['sweep.py', 'print', '--root', '{tmp}/s', '--config', 'configs/pretrain.py:postln,tiny',
      '--set', 'train.num_steps=abc'], "train.num_steps='abc' does not fit the field (int"),
    (['train.py', '--workdir', '{tmp}/t', '--config.data.max_seq_length=0'],
     'data.max_seq_length=0: give at least 5 tokens ([CLS] A [SEP] B [SEP])'),
    (['train.py', '--workdir', '{tmp}/t', '--config.model.num_layers=0'],
     'model.num_layers=0: give a positive number'),
    (['train.py', '--workdir', '{tmp}/t', '--config.optimizer.learning_rate=-1'],
     'optimizer.learning_rate=-1.0: give a rate >= 0'),
    (['train.py', '--workdir', '{tmp}/t', 'config.train.num_steps=5'],
     "unexpected arguments ['config.train.num_steps=5']; settings go in --config.*"),
    (['finetune.py', '--workdir', '{tmp}/f', 'config.optimizer.learning_rate=1e-3'],
     "unexpected arguments ['config.optimizer.learning_rate=1e-3']; settings go in --config.*"),
    (['finetune.py', '--workdir', '{tmp}/f', '--config.max_seq_length=-4'],
     'config.max_seq_length=-4: give at least 5 tokens'),
    (['-m', 'data.tokenizer', '--input', '{tmp}/a_file', '--model_prefix', '{tmp}/m',
      '--vocab_size', '-5'], 'flag --vocab_size=-5: -5 is not a positive integer'),
    (['analyze.py', '--workdir', '{tmp}', '--out', '{tmp}/o', '--num_examples', '0'],
     'flag --num_examples=0: 0 is not a positive integer'),
    (['train.py', '--config.train.num_steps=20', '--config', 'configs/pretrain.py:postln,tiny',
      '--workdir', '{tmp}/r'], 'Found --config.train.num_steps=20 in argv before a value for '
     '--config was specified; give --config <file> before its --config.<key> overrides'),
]


@pytest.mark.parametrize('argv,expected', ONE_LINE_ERRORS)
def test_every_entry_point_reports_user_errors_in_one_line(commands, tmp_path, argv, expected):
  argv = [a.format(tmp=tmp_path) for a in argv]
  expected = expected.format(tmp=tmp_path)
  (tmp_path / 'a_file').write_text('in the way\n')
  proc = commands.run(argv)
  assert_one_line_error(proc.returncode, proc.stderr, expected)
  assert os.listdir(tmp_path) == ['a_file']  # nothing half-made left behind


def test_every_program_reports_its_first_user_error_from_python_itself(tmp_path):
  """The cases above run forked from an interpreter that has imported the libraries (the
  commands fixture); the first case of each program also runs from `python` itself, all side
  by side, so that what happens as a program imports (a failure, a warning, a traceback) is
  seen too."""
  firsts = {}
  for argv, expected in ONE_LINE_ERRORS:
    firsts.setdefault(tuple(argv[:2]) if argv[0] == '-m' else argv[0], (argv, expected))
  runs = []
  for i, (argv, expected) in enumerate(firsts.values()):
    folder = tmp_path / str(i)
    folder.mkdir()
    (folder / 'a_file').write_text('in the way\n')
    runs.append((folder, expected.format(tmp=folder), subprocess.Popen(
        [sys.executable] + [a.format(tmp=folder) for a in argv], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
  assert len(runs) >= 9  # train, finetune, sweep, study, analyze and four python -m tools
  for folder, expected, proc in runs:
    _, err = proc.communicate(timeout=240)
    assert_one_line_error(proc.returncode, err, expected)
    assert os.listdir(folder) == ['a_file']


def test_an_error_no_raise_made_names_where_it_came_from(tmp_path, capsys):
  """A ValueError that Python or a library made (an unpacking in a task file of one's own)
  is one line that also names its file and line, in this repository where it passed
  through; an error raised on purpose is its message alone (it names the fix)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from realformer import cli  # pylint: disable=g-import-not-at-top
  mine = tmp_path / 'mine.py'
  mine.write_text("def read(line):\n  text, label = line.split('\\t')\n  return text\n")
  sys.path.insert(0, str(tmp_path))
  try:
    import mine as mine_module  # pylint: disable=g-import-not-at-top,import-error
  finally:
    sys.path.remove(str(tmp_path))
  with pytest.raises(SystemExit):
    cli.run_main(lambda: mine_module.read('no tab'))
  assert capsys.readouterr().err.strip() == (
      f'error: not enough values to unpack (expected 2, got 1) (ValueError at {mine}, line 2; '
      '--verbose_errors shows the traceback)')
  with pytest.raises(SystemExit):  # a library's refusal: the line that called it
    cli.run_main(lambda: np.reshape(np.zeros(3), 2))
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: cannot reshape array of size 3 into shape (2,) (ValueError at '
                        'tests/test_workdir.py, line '), err

  def on_purpose():
    raise ValueError('data.thing=3: give a positive number')
  with pytest.raises(SystemExit):
    cli.run_main(on_purpose)
  assert capsys.readouterr().err.strip() == 'error: data.thing=3: give a positive number'
  unread = {}  # a function whose lines have no source to read (exec's): its message alone
  exec(compile("def unread():\n  raise ValueError('on purpose, from exec')\n", '<mine>',  # pylint: disable=exec-used
               'exec'), unread)
  with pytest.raises(SystemExit):
    cli.run_main(unread['unread'])
  assert capsys.readouterr().err.strip() == 'error: on purpose, from exec'
  with pytest.raises(SystemExit):  # the system's refusal of a path: its path and fix
    cli.run_main(lambda: open(tmp_path / 'no' / 'x', encoding='utf-8'))
  assert capsys.readouterr().err.strip() == (
      f"error: No such file or directory: '{tmp_path}/no/x'; check the path")


def test_entry_points_without_absl_app_drop_orbax_restore_warning():
  """study.py, analyze.py, sweep.py read checkpoints outside absl's app.run: cli.run_main
  quiets orbax's missing-_CHECKPOINT_METADATA warning there too, and only that one."""
  import logging  # pylint: disable=g-import-not-at-top
  from realformer import cli  # pylint: disable=g-import-not-at-top
  cli.run_main(lambda: None)
  cli.run_main(lambda: None)  # installed once
  absl_logger = logging.getLogger('absl')
  assert sum(isinstance(f, cli.QuietLibraries) for f in absl_logger.filters) == 1

  def record(msg, path='/site-packages/orbax/checkpoint/x.py'):
    return logging.LogRecord('absl', logging.WARNING, path, 1, msg, None, None)

  assert not absl_logger.filter(record('Metadata file does not exist: /w/checkpoints/3'))
  assert absl_logger.filter(record('Something else went wrong'))
  assert absl_logger.filter(record('Metadata file does not exist', path='/work/train.py'))



def test_the_tools_take_absl_flags_like_the_training_programs(tmp_path, capsys):
  """One flag system for every program: `--flag value` and `--flag=value`, repeated flags,
  `--[no]switch`, `--flagfile`, positional words where a tool takes them, `--help`."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from realformer import cli  # pylint: disable=g-import-not-at-top

  def define(f):
    flags.DEFINE_string('root', None, 'the root', flag_values=f, required=True)
    flags.DEFINE_multi_string('set', [], 'k=v', flag_values=f)
    flags.DEFINE_boolean('print_only', True, 'print', flag_values=f)
    flags.DEFINE_integer('seeds', 1, 'seeds', flag_values=f)

  (tmp_path / 'saved.flags').write_text('--seeds=4\n--set=a=1,2\n')
  args, words = cli.parse_tool_flags(
      define, ['first', '--root', 'R', f'--flagfile={tmp_path}/saved.flags', '--set', 'b=3',
               '--noprint_only', 'second', 'third'],
      prog='tool', doc='A tool.', positional=('part', '*more'))
  assert (args.root, args.set, args.print_only, args.seeds) == ('R', ['a=1,2', 'b=3'], False, 4)
  assert words == {'part': 'first', '*more': ['second', 'third']}
  args, words = cli.parse_tool_flags(define, ['--root=R'], prog='tool', doc='', positional=('p',))
  assert words == {} and args.set == [] and args.print_only  # defaults, fresh each call
  with pytest.raises(SystemExit) as stop:
    cli.parse_tool_flags(define, ['--help'], prog='tool', doc='A tool.', positional=('part',))
  assert stop.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith('usage: tool [part] [flags]\n\nA tool.') and '--seeds: seeds' in out
  for argv, expected in ((['--root', 'R', 'stray'], "unexpected argument 'stray'"),
                         (['--seeds', '2'], '--root is required (see tool --help)'),
                         (['--root', 'R', '--sets', 'x'], "Unknown command line flag 'sets'")):
    with pytest.raises(SystemExit) as stop:
      cli.parse_tool_flags(define, argv, prog='tool', doc='')
    assert stop.value.code == 1 and expected in capsys.readouterr().err


def test_data_tokenizer_takes_its_inputs_after_one_flag_or_repeated(tmp_path):
  text = tmp_path / 'a.txt'
  text.write_text(''.join(f'sentence number {i} with some words.\n' for i in range(200)))
  (tmp_path / 'b.txt').write_text(text.read_text())
  for name, inputs in (('spaced', ['--input', str(text), str(tmp_path / 'b.txt')]),
                       ('repeated', ['--input', str(text), '--input', str(tmp_path / 'b.txt')])):
    proc = subprocess.run(
        [sys.executable, '-m', 'data.tokenizer', *inputs, '--model_type', 'wordpiece',
         '--vocab_size', '60', '--model_prefix', str(tmp_path / name)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "'sentences': 400" in proc.stdout, proc.stdout


def test_a_full_disk_is_one_line_however_the_library_that_wrote_says_it(capsys):
  """No room for a write: a prepared shard's array_record error (a RuntimeError), a
  checkpoint's tensorstore error (a ValueError wrapped by orbax), the system's own ENOSPC:
  one line with the fix, exit status 1 (a traceback of 44 lines before, a resume trial);
  so is a prepared shard that reads back damaged."""
  import errno  # pylint: disable=g-import-not-at-top
  from realformer import cli  # pylint: disable=g-import-not-at-top

  def orbax_wrapped():
    try:
      raise ValueError('RESOURCE_EXHAUSTED: Error writing local file "/w/checkpoints/40/state/'
                       'd/x": [OS error 28: No space left on device]')
    except ValueError as e:
      raise Exception('Checkpointer failed') from e  # pylint: disable=broad-exception-raised
  for fail, says in (
      (RuntimeError('write() failed: No space left on device; writing /w/data.tmp/train'),
       'RuntimeError: write() failed: No space left on device; writing /w/data.tmp/train'),
      (OSError(errno.ENOSPC, 'No space left on device'), 'OSError: [Errno 28] No space left'),
      (None, 'ValueError: RESOURCE_EXHAUSTED: Error writing local file')):
    def main(fail=fail):
      if fail is None:
        orbax_wrapped()
      raise fail
    with pytest.raises(SystemExit) as stop:
      cli.run_main(main)
    assert stop.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f'error: the disk is full ({says}') and '\n' not in err, err
    assert err.endswith('free space or choose another disk, then run the same command again: '
                        'what was committed before it (a checkpoint, prepared data) is kept')

  def damaged():  # a prepared shard that reads back damaged (cut short, bit rot)
    raise RuntimeError('Corrupted Riegeli/records file: chunk header hash mismatch\nat byte 0')
  with pytest.raises(SystemExit):
    cli.run_main(damaged)
  assert capsys.readouterr().err.strip() == (
      'error: a prepared data file is damaged (RuntimeError: Corrupted Riegeli/records file: '
      'chunk header hash mismatch); delete the prepared data (the run\'s data/ folder, or '
      'data.prepared_dir) and run the same command again: it prepares the data anew and resumes')


def test_a_workdir_of_the_wrong_kind_is_one_line_and_left_intact(commands, tmp_path):
  """A fine-tuning run's folder where a pretraining workdir belongs (analyze, fine-tune,
  export), an export into a train.py workdir, an import into a non-empty folder."""
  ft = tmp_path / 'ft'
  ft.mkdir()
  (ft / 'config.json').write_text(json.dumps({'benchmark': 'glue', 'task': 'sst2'}))
  run_dir = tmp_path / 'run'
  (run_dir / 'checkpoints').mkdir(parents=True)
  (run_dir / 'config.json').write_text('{}')
  afile = tmp_path / 'afile'
  afile.write_text('not a folder')
  cases = [
      (['train.py', '--workdir', afile, '--config.data.sources=synthetic'],
       'cannot be a folder: it or a folder above it is a file'),
      (['-m', 'realformer.tools.interop', 'export-hf', '--workdir', run_dir, '--out', afile],
       'is a file; export to a new or empty directory'),
      (['analyze.py', '--workdir', ft, '--out', tmp_path / 'a'], 'is a fine-tuning run'),
      (['finetune.py', '--workdir', tmp_path / 'f2', f'--config.init_checkpoint={ft}'],
       'is a fine-tuning run'),
      (['-m', 'realformer.tools.interop', 'export-hf', '--workdir', ft, '--out', tmp_path / 'hf'],
       'is a fine-tuning run'),
      (['-m', 'realformer.tools.interop', 'export-hf', '--workdir', ft, '--out', run_dir],
       'is a workdir of this project'),
      (['-m', 'realformer.tools.interop', 'import-hf', '--src', ft, '--out', run_dir],
       'exists and is not an empty directory'),
  ]
  expect_one_line_errors(commands, cases)
  assert sorted(os.listdir(tmp_path)) == ['afile', 'ft', 'run']
  assert sorted(os.listdir(run_dir)) == ['checkpoints', 'config.json']
  assert json.loads((ft / 'config.json').read_text())['task'] == 'sst2'


def test_data_file_mistakes_through_the_command_line(commands, tmp_path):
  """A malformed GLUE row (finetune.py) and a corpus of undecodable lines (train.py): one
  line naming the file (and line) or the undecodable lines, and no workdir left behind."""
  rte = tmp_path / 'glue' / 'RTE'
  rte.mkdir(parents=True)
  (rte / 'train.tsv').write_text('index\tsentence1\tsentence2\tlabel\n'
                                 '0\tA man.\tA person.\tentailment\n1\tcut short\n')
  (rte / 'dev.tsv').write_text('index\tsentence1\tsentence2\tlabel\n'
                               '0\tA dog.\tA cat.\tnot_entailment\n')
  lines = [f'Le caf\xe9 num\xe9ro {i} est ferm\xe9.' for i in range(40)]
  latin1 = '\n\n'.join('\n'.join(lines[i:i + 4]) for i in range(0, 40, 4)).encode('latin-1')
  (tmp_path / 'latin1.txt').write_bytes(latin1)
  # Mostly undecodable: preparation keeps the few UTF-8 documents, and the split that is
  # too small for a batch says why (it once said only "the train split has 1 examples").
  (tmp_path / 'mostly_latin1.txt').write_bytes(
      b'The union is strong.\nWe shall prevail.\nPeace is near.\n\nThe economy grows.\n'
      b'Taxes fall.\nJobs rise.\n\n' + latin1)
  cases = [
      (['finetune.py', '--workdir', tmp_path / 'ft', '--config', 'configs/finetune.py:glue/rte',
        '--config.init_checkpoint=configs/pretrain.py:postln,tiny', '--config.from_scratch=True',
        f'--config.data_dir={tmp_path}/glue'],
       'RTE/train.tsv:3: 2 columns where 4 are expected'),
      (['train.py', '--workdir', tmp_path / 'tr',
        f'--config.data.sources=files:{tmp_path}/latin1.txt'], "'non_utf8_lines': 40"),
      (['train.py', '--workdir', tmp_path / 'tr2',
        f'--config.data.sources=files:{tmp_path}/mostly_latin1.txt'],
       'fewer than one batch of 32 per process (40 lines of the corpus were not UTF-8 and '
       'were skipped: convert the files to UTF-8'),
  ]
  expect_one_line_errors(commands, cases)
  # The one workdir left holds only the complete prepared data (reused after a fix of the
  # batch size, or deleted as the message says), no config.json and no checkpoint.
  assert sorted(os.listdir(tmp_path)) == ['glue', 'latin1.txt', 'mostly_latin1.txt', 'tr2']
  assert sorted(os.listdir(tmp_path / 'tr2')) == ['.lock', 'data']


def test_a_preloaded_command_is_what_python_gives(commands, tmp_path):
  """The `commands` fixture (tests/preloaded.py) against `python` itself: the same exit
  status, output and files for a program that prints, writes, exits in each way Python
  knows, starts a thread, reads its argv, __file__, path and environment, and sees its own
  devices."""
  program = tmp_path / 'program.py'
  program.write_text(
      'import atexit, os, sys, threading, time\n'
      'atexit.register(lambda: print("atexit ran", flush=True))\n'
      'print(sys.argv, __file__, sys.path[0] == os.path.dirname(__file__))\n'
      'print(os.getcwd(), os.environ.get("MARK"), file=sys.stderr)\n'
      'how = sys.argv[1]\n'
      'if how == "devices":\n'
      '  import jax\n'
      '  print(len(jax.devices()))\n'
      'open(os.path.join(sys.argv[2], how), "w").write(how)\n'
      'if how == "raise":\n'
      '  raise KeyError("x")\n'
      'if how == "message":\n'
      '  sys.exit("stopped: a message")\n'
      'if how == "code":\n'
      '  sys.exit(3)\n'
      'if how == "interrupt":\n'
      '  raise KeyboardInterrupt\n'
      'if how == "thread":\n'
      '  threading.Thread(target=lambda: (time.sleep(0.2), print("joined"))).start()\n')
  env = dict(os.environ, MARK='m', XLA_FLAGS=cpu_xla_flags(3))
  for how in ('normal', 'raise', 'message', 'code', 'interrupt', 'thread', 'devices'):
    runs = []
    for kind in ('out_python', 'out_preloaded'):
      out = tmp_path / kind
      out.mkdir(exist_ok=True)
      argv = [program.name, how, str(out)]  # as python takes it: relative to cwd
      if kind == 'out_python':
        proc = subprocess.run([sys.executable] + argv, cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
      else:
        proc = commands.run(argv, cwd=tmp_path, env=env)
      runs.append((proc.returncode, proc.stdout.replace(kind, 'K'),
                   proc.stderr.replace(kind, 'K'), (out / how).read_text()))
    assert runs[0] == runs[1], (how, runs)
  assert runs[0][1].endswith('3\natexit ran\n')  # jax found the command's 3 devices
  # (a -m module runs as `python -m` runs it)
  proc = commands.run(['-m', 'data.tokenizer', '--input', str(program)])
  assert proc.returncode == 1 and proc.stderr.startswith('error: --model_prefix is required')


def expect_one_line_errors(commands, cases):
  """Runs every (argv, expected): each exits 1 with one `error:` line holding `expected`,
  and no traceback."""
  for argv, expected in cases:
    proc = commands.run(argv)
    assert_one_line_error(proc.returncode, proc.stderr, expected)


def assert_one_line_error(returncode: int, stderr: str, expected: str) -> None:
  """Exit status 1, one line holding `error:` and `expected`, no traceback."""
  errors = [l for l in stderr.splitlines() if 'error:' in l]
  assert returncode == 1 and len(errors) == 1 and expected in errors[0], stderr[-3000:]
  assert 'Traceback' not in stderr


def test_a_config_file_that_fails_to_load_is_one_line(commands, tmp_path):
  """The --config file is the user's own code: a syntax error, an exception in get_config
  (a field the locked config lacks and a name a module lacks are the file's mistakes at its
  line, not unknown keys of the command line), no get_config at all, or a folder given."""
  (tmp_path / 'broken.py').write_text('def get_config(:\n  pass\n')
  (tmp_path / 'raising.py').write_text('def get_config():\n  return 1 / 0\n')
  (tmp_path / 'empty.py').write_text('x = 1\n')
  (tmp_path / 'misspelt.py').write_text('from configs import pretrain\ndef get_config():\n'
                                        '  c = pretrain.get_config("postln,tiny")\n'
                                        '  c.model.max_lne = 5\n  return c\n')
  (tmp_path / 'no_name.py').write_text('import math\ndef get_config():\n  return math.sqr(4)\n')
  for name, expected in (('broken.py', 'broken.py, line 1): SyntaxError: invalid syntax'),
                         ('raising.py', 'raising.py, line 2): ZeroDivisionError'),
                         ('misspelt.py', "misspelt.py, line 4): the config has no field "
                                         "'max_lne' (did you mean 'max_len'?); fix the file"),
                         ('no_name.py', "no_name.py, line 3): AttributeError: module 'math' "
                                        "has no attribute 'sqr'; fix the file"),
                         ('empty.py', 'defines no get_config()'),
                         ('', 'cannot load the --config file: Is a directory')):
    proc = commands.run(['train.py', f'--workdir={tmp_path}/w', f'--config={tmp_path / name}'])
    # One error line and nothing else of ours (TensorFlow's import may log its own banner,
    # depending on the CPU).
    errors = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr
    assert expected in errors[0] and 'Traceback' not in proc.stderr, proc.stderr
    assert not (tmp_path / 'w').exists()


def _glue_rte(folder, rows: int, malformed_at: int = 0, test: bool = False):
  """An RTE folder of made-up pairs (train and dev; test.tsv with `test`); with
  malformed_at, a row cut short at that line of train.tsv."""
  import random  # pylint: disable=g-import-not-at-top
  rng = random.Random(0)
  words = 'the union state nation people congress war peace law trade money year'.split()

  def pair(i):
    s = [' '.join(rng.choice(words) for _ in range(rng.randint(3, 12))) + '.' for _ in (0, 1)]
    return f'{i}\t{s[0]}\t{s[1]}\t{rng.choice(["entailment", "not_entailment"])}'

  folder.mkdir(parents=True)
  header = 'index\tsentence1\tsentence2\tlabel'
  train = [header] + [pair(i) for i in range(rows)]
  if malformed_at:
    train.insert(malformed_at - 1, f'{rows}\tcut short')
  (folder / 'train.tsv').write_text('\n'.join(train) + '\n')
  (folder / 'dev.tsv').write_text('\n'.join([header] + [pair(i) for i in range(20)]) + '\n')
  if test:
    (folder / 'test.tsv').write_text('\n'.join(
        ['index\tsentence1\tsentence2'] + [pair(i).rpartition('\t')[0] for i in range(12)])
                                     + '\n')


def test_finetune_command_line_lock_preemption_resume_and_malformed_rows(commands, tmp_path):
  """finetune.py as a user runs it: a held workdir is refused naming the holder; a skipped
  malformed row is counted; SIGTERM saves and exits 'not finished' (75); a resume under
  another config is refused with config.json kept; the plain resume finishes with no
  warning and none of orbax's lines."""
  _glue_rte(tmp_path / 'glue' / 'RTE', rows=400, malformed_at=6)
  workdir = tmp_path / 'ft'
  args = [sys.executable, 'finetune.py', f'--workdir={workdir}',
          '--config=configs/finetune.py:glue/rte',
          '--config.init_checkpoint=configs/pretrain.py:postln,tiny',
          '--config.from_scratch=True', f'--config.data_dir={tmp_path}/glue',
          '--config.batch_size=8', '--config.num_epochs=2', '--config.length_buckets=1',
          '--config.max_seq_length=32', '--config.log_every_steps=1',
          '--config.skip_malformed_rows=True']
  env = dict(os.environ, XLA_FLAGS=cpu_xla_flags(1))  # the command line, not sharding

  def one_error(proc):
    errors = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr
    return errors[0]

  # (The refusals, before anything trains, from the preloaded interpreter: the first start,
  # the preempted one and the resume are `python` itself.)
  with workdir_lib.Lock(str(workdir), 'a test'):
    held = commands.run(args[1:], env=env)
  assert f'in use by pid {os.getpid()} on {socket.gethostname()}' in one_error(held)
  # (Ctrl-C's default restored first: a test run in the background inherits it ignored)
  interactive = [sys.executable, '-c', 'import os, signal, sys; signal.signal(signal.SIGINT, '
                 'signal.SIG_DFL); os.execv(sys.executable, [sys.executable] + sys.argv[1:])']
  first = subprocess.Popen(interactive + args[1:], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
  try:
    metrics = workdir / 'metrics.jsonl'
    _wait_for(first, lambda: metrics.exists() and metrics.read_text().strip())  # training began
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=240)
  finally:
    if first.poll() is None:
      first.kill()
  assert first.returncode == workdir_lib.EXIT_NOT_FINISHED, err[-3000:]
  assert 'not finished: stopped by SIGTERM or Ctrl-C after saving step' in err
  assert 'skipped 1 malformed rows' in err and 'RTE/train.tsv (lines 6)' in err
  stored = (workdir / 'config.json').read_text()
  other = commands.run(args[1:] + ['--config.optimizer.learning_rate=1e-3'], env=env)
  assert ('holds a checkpoint of another config (1 field): optimizer.learning_rate'
          in one_error(other))
  assert (workdir / 'config.json').read_text() == stored
  resumed = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'resuming from step' in resumed.stderr
  warnings = [l for l in resumed.stderr.splitlines()
              if l[:1] in 'WE' and l[1:2].isdigit() and 'malformed rows' not in l]
  assert not warnings, warnings
  assert 'orbax' not in resumed.stderr and 'checkpoint_manager.py' not in resumed.stderr
  assert json.loads((workdir / 'results.json').read_text())['dev']['rte']['accuracy'] >= 0


def test_finetune_data_and_checkpoint_mistakes_through_the_command_line(commands, tmp_path):
  """A task folder that is not there, a CoLA row cut short (it was an IndexError), a bad
  label, and a checkpoint its config.json no longer describes: one line each, no workdir."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from realformer import models  # pylint: disable=g-import-not-at-top
  cola = tmp_path / 'glue' / 'CoLA'
  cola.mkdir(parents=True)
  (cola / 'train.tsv').write_text('gj04\t1\t\tGood.\ngj04\t0\n')
  bad_label = tmp_path / 'glue2' / 'CoLA'
  bad_label.mkdir(parents=True)
  (bad_label / 'train.tsv').write_text('gj04\t1\t\tGood.\ngj04\tmaybe\t\tBad.\n')
  (tmp_path / 'empty').mkdir()
  _glue_rte(tmp_path / 'rte' / 'RTE', rows=40)
  config = pretrain.get_config('postln,tiny')
  config.unlock()
  config.model.num_layers, config.model.hidden_size, config.model.mlp_dim = 1, 32, 64
  batch = {k: np.zeros((1, 8), np.int32) for k in ('input_ids', 'segment_ids',
                                                   'attention_mask')}
  params = nn.unbox(models.build(config.model).init(jax.random.PRNGKey(0), batch)['params'])
  pretrained = tmp_path / 'pretrained'
  checkpoints.save_params(str(pretrained), params, config, step=1)
  stored = json.loads((pretrained / 'config.json').read_text())
  stored['model']['hidden_size'] = 48  # the config no longer describes the checkpoint
  (pretrained / 'config.json').write_text(json.dumps(stored))
  scratch = ['--config.init_checkpoint=configs/pretrain.py:postln,tiny',
             '--config.from_scratch=True']
  cases = [
      (['finetune.py', '--workdir', tmp_path / 'w1', '--config=configs/finetune.py:glue/rte',
        f'--config.data_dir={tmp_path}/empty'] + scratch,
       'RTE/train.tsv not found; set config.data_dir'),
      (['finetune.py', '--workdir', tmp_path / 'w2', '--config=configs/finetune.py:glue/cola',
        f'--config.data_dir={tmp_path}/glue'] + scratch,
       'CoLA/train.tsv:2: 2 columns where 4 are expected'),
      (['finetune.py', '--workdir', tmp_path / 'w3', '--config=configs/finetune.py:glue/cola',
        f'--config.data_dir={tmp_path}/glue2'] + scratch,
       "CoLA/train.tsv:2: CoLA: label 'maybe'"),
      (['finetune.py', '--workdir', tmp_path / 'w4', '--config=configs/finetune.py:glue/rte',
        f'--config.init_checkpoint={pretrained}', f'--config.data_dir={tmp_path}/rte',
        '--config.batch_size=8'], 'has shape (32,) in the checkpoint but (48,) in the model'),
  ]
  expect_one_line_errors(commands, cases)
  assert sorted(os.listdir(tmp_path)) == ['empty', 'glue', 'glue2', 'pretrained', 'rte']


def test_every_process_of_a_multi_host_run_stops_when_the_workdir_is_held(tmp_path):
  """Two processes (gloo collectives stand in for hosts): process 0 cannot take the lock, and
  both stop with one line instead of process 1 running on to wait at the first collective."""
  port = free_port()
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS=cpu_xla_flags(1))
  with workdir_lib.Lock(str(tmp_path), 'a test'):
    procs = [subprocess.Popen(
        [sys.executable, 'train.py', f'--workdir={tmp_path}', '--config.data.sources=synthetic',
         f'--coordinator_address=localhost:{port}', '--num_processes=2', f'--process_id={i}'],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
      errs = [p.communicate(timeout=240)[1] for p in procs]
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
  for proc, err, expected in zip(procs, errs, (f'in use by pid {os.getpid()}',
                                               'process 0 could not take the lock of')):
    errors = [l for l in err.splitlines() if l.startswith('error:')]
    assert proc.returncode == 1 and len(errors) == 1 and expected in errors[0], err[-3000:]
  assert not (tmp_path / 'config.json').exists()


def test_finetune_on_two_processes_is_one_run(tmp_path):
  """finetune.py on two processes with one device each (gloo collectives stand in for two
  hosts) is the run of one process with two devices: the same length buckets, dev metrics
  and test predictions, and the files written once (by process 0)."""
  _glue_rte(tmp_path / 'glue' / 'RTE', rows=96, test=True)
  args = ['--config=configs/finetune.py:glue/rte',
          '--config.init_checkpoint=configs/pretrain.py:postln,tiny',
          '--config.from_scratch=True', f'--config.data_dir={tmp_path}/glue',
          '--config.batch_size=8', '--config.eval_batch_size=8', '--config.num_epochs=2',
          '--config.log_every_steps=4']
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  one = subprocess.Popen(
      [sys.executable, 'finetune.py', f'--workdir={tmp_path}/one'] + args, cwd=REPO,
      env=dict(env, XLA_FLAGS=cpu_xla_flags(2)),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  port = free_port()
  two = [subprocess.Popen(
      [sys.executable, 'finetune.py', f'--workdir={tmp_path}/two', f'--process_id={i}',
       f'--coordinator_address=localhost:{port}', '--num_processes=2'] + args, cwd=REPO,
      env=dict(env, XLA_FLAGS=cpu_xla_flags(1)),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    for proc in [one] + two:
      _, err = proc.communicate(timeout=400)
      assert proc.returncode == 0, err[-3000:]
  finally:
    for proc in [one] + two:
      if proc.poll() is None:
        proc.kill()
  a, b = tmp_path / 'one', tmp_path / 'two'
  results = [json.loads((d / 'results.json').read_text()) for d in (a, b)]
  assert results[0]['step'] == results[1]['step'] == 24
  assert results[1]['dev']['rte']['accuracy'] == pytest.approx(
      results[0]['dev']['rte']['accuracy'])
  assert (b / 'predictions' / 'RTE.tsv').read_text() == (a / 'predictions' / 'RTE.tsv'
                                                         ).read_text()
  assert json.loads((b / 'length_buckets.json').read_text()) == json.loads(
      (a / 'length_buckets.json').read_text())
  steps = lambda d: [json.loads(l)['step'] for l in (d / 'metrics.jsonl').read_text().splitlines()]
  assert steps(b) == steps(a)  # one line per step and split: process 0's alone


def test_hosts_whose_copies_of_the_task_or_configs_differ_stop_in_one_line(tmp_path):
  """Each host reads the task's files for itself: one whose copy lacks test.tsv (it would
  compile other evaluation lengths and predict a split the others do not, and both would
  wait for ever at the first collective that differs) stops both before anything is
  written; so does a config that differs between hosts (another command line)."""
  _glue_rte(tmp_path / 'full' / 'glue' / 'RTE', rows=32, test=True)
  _glue_rte(tmp_path / 'partial' / 'glue' / 'RTE', rows=32)
  data_differs = ("error: rte's data differs between processes (process 1 of 2 read other "
                  'than process 0); give every host the same files (a copy of each, or a '
                  'folder they share)')
  config_differs = ('error: the config differs between processes (process 1 of 2 read other '
                    'than process 0); give every host the same command line, files and '
                    'environment')
  # (one command line, each host's own copy of the data: a home folder of its own; then
  # each its own command line)
  for data_dirs, want in ((('~/glue',) * 2, data_differs),
                          ((f'{tmp_path}/full/glue', f'{tmp_path}/partial/glue'),
                           config_differs)):
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, 'finetune.py', f'--workdir={tmp_path}/run', f'--process_id={i}',
         f'--coordinator_address=localhost:{port}', '--num_processes=2',
         '--config=configs/finetune.py:glue/rte', '--config.from_scratch=True',
         '--config.init_checkpoint=configs/pretrain.py:postln,tiny',
         f'--config.data_dir={data_dirs[i]}', '--config.batch_size=8'], cwd=REPO,
        env=dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=cpu_xla_flags(1),
                 HOME=str(tmp_path / home)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i, home in enumerate(('full', 'partial'))]
    try:
      errs = [proc.communicate(timeout=120)[1] for proc in procs]
    finally:
      for proc in procs:
        proc.kill()
    for proc, err in zip(procs, errs):
      errors = [l for l in err.splitlines() if l.startswith('error:')]
      assert proc.returncode == 1 and errors == [want], err[-3000:]
    assert not (tmp_path / 'run' / 'config.json').exists()


def _config_keys(config) -> set:
  return set(workdir_lib.flatten(json.loads(config.to_json_best_effort())))


def test_a_new_config_field_says_what_runs_before_it_meant():
  """Every field of the configs is in tests/data/config_keys.json. A field added to a config
  fails this until it is recorded there, after deciding what a stored config without it
  stood for: a resume compares it with workdir.ADDED_DEFAULTS's value (an unlisted one is
  taken as given, so a field that changes what a run computes belongs there), or it is
  RESUMABLE."""
  from configs import finetune as finetune_configs  # pylint: disable=g-import-not-at-top
  with open(os.path.join(os.path.dirname(__file__), 'data', 'config_keys.json')) as f:
    recorded = {k: set(v) for k, v in json.load(f).items()}
  import pkgutil  # pylint: disable=g-import-not-at-top
  from realformer.finetune import registry  # pylint: disable=g-import-not-at-top
  from realformer.finetune import tasks  # pylint: disable=g-import-not-at-top
  files = [m.name for m in pkgutil.iter_modules(tasks.__path__) if not m.name.startswith('_')]
  # (every kind of the repository's files; not one a test registers in its own file)
  kinds = {kind: (registry.get(kind).names() or ('x',))[-1] for kind in files}
  assert {'glue', 'squad', 'tsv'} <= set(kinds)
  now = {'configs/pretrain.py': _config_keys(tiny_config()),
         'configs/finetune.py': set().union(*(  # each kind of realformer/finetune/tasks/
             _config_keys(finetune_configs.get_config(f'{kind}/{name}'))
             for kind, name in kinds.items()))}
  for name, keys in now.items():
    assert keys - recorded[name] == set(), (
        f'{name} has new fields: give each a workdir.ADDED_DEFAULTS entry (or a RESUMABLE '
        'one), then add them to tests/data/config_keys.json (a new kind\'s own fields, which '
        'no earlier run has: only list them there)')
    assert recorded[name] - keys == set(), f'{name} lost fields: remove them from the record'
  for key in workdir_lib.ADDED_DEFAULTS:
    assert key in now['configs/pretrain.py'] | now['configs/finetune.py'], key
  assert set(workdir_lib.ADDED_FINETUNE_DEFAULTS) <= now['configs/finetune.py']


def test_an_unknown_key_without_its_section_is_pointed_to_it(monkeypatch):
  """A field given without its section, or misspelt where ml_collections has no guess (at
  the top level): the --config file's keys that end so, or the closest; from the command
  line's --config, else the program's default."""
  from realformer import cli  # pylint: disable=g-import-not-at-top
  one_line = cli._one_line  # pylint: disable=protected-access
  monkeypatch.setattr(sys, 'argv', ['finetune.py', '--config.warmup_fraction=0.5'])
  assert "unknown config key 'warmup_fraction' (did you mean 'optimizer.warmup_fraction'?)" in (
      one_line(KeyError("'warmup_fraction'"), 'configs/finetune.py'))
  monkeypatch.setattr(sys, 'argv', ['train.py', '--config', 'configs/pretrain.py:postln,tiny',
                                    '--config.trian.num_steps=3'])
  assert "unknown config key 'trian' (did you mean 'train'?)" in one_line(KeyError("'trian'"))
  monkeypatch.setattr(sys, 'argv', ['train.py', '--config.nothing_like_it=1'])
  assert one_line(KeyError("'nothing_like_it'"), 'configs/pretrain.py:postln,tiny') == (
      "unknown config key 'nothing_like_it'; check its spelling against the config file")


def test_an_unknown_key_is_named_by_the_one_override_that_ends_in_it(monkeypatch):
  """The dotted path where exactly one --config.<path> override ends in the key
  ml_collections names; two that end so (train.batch_size and data.batch_size): the key."""
  from realformer import cli  # pylint: disable=g-import-not-at-top
  # (as the config flag's override raises it: test_config_mistakes_are_one_line's command)
  error = KeyError('\'num_stepz\'\nDid you mean "num_steps" instead of "num_stepz"?')
  monkeypatch.setattr(sys, 'argv', ['train.py', '--config.train.num_stepz=5'])
  assert "unknown config key 'train.num_stepz' (did you mean 'train.num_steps'?)" in (
      cli._one_line(error))  # pylint: disable=protected-access
  monkeypatch.setattr(sys, 'argv', ['train.py', '--config.train.num_stepz=5',
                                    '--config.data.num_stepz=5'])
  assert "unknown config key 'num_stepz' (did you mean 'num_steps'?)" in (
      cli._one_line(error))  # pylint: disable=protected-access
