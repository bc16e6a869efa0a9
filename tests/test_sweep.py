"""Sweeps: expansion, naming, skip-finished and resume, launch scripts, summaries; and one
real two-run sweep of train.py."""

import argparse
import errno
import fcntl
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import textwrap
from unittest import mock

import pytest

import sweep as sweep_cli
from realformer import storage
from realformer.tools import sweep
from realformer.train.run_dir import RunDir
from tests.gcs_server import gcs  # pylint: disable=unused-import

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE_PROGRAM = textwrap.dedent('''
    """Stands in for train.py: records its calls, fails once when asked, writes metrics."""
    import json, os, sys
    args = dict(a.split('=', 1) for a in sys.argv[1:] if a.startswith('--config.'))
    workdir = sys.argv[sys.argv.index('--workdir') + 1]
    with open(os.path.join(workdir, 'calls.txt'), 'a') as f:
      f.write('call\\n')
    if args.get('--config.fail_once') == 'True' and not os.path.exists(
        os.path.join(workdir, 'failed_before')):
      open(os.path.join(workdir, 'failed_before'), 'w').close()
      os.makedirs(os.path.join(workdir, 'checkpoints', '5'))  # a step saved before it failed
      open(os.path.join(workdir, 'checkpoints', '5', 'commit_success.txt'), 'w').close()
      sys.exit(3)
    lr, seed = float(args['--config.optimizer.learning_rate']), int(args['--config.seed'])
    with open(os.path.join(workdir, 'metrics.jsonl'), 'a') as f:
      f.write(json.dumps({'step': 1, 'split': 'eval', 'mlm_accuracy': 0.5}) + '\\n')
      f.write(json.dumps({'step': 2, 'split': 'eval', 'mlm_accuracy': lr * 1000 + seed}) + '\\n')
''')


def test_expansion_product_zip_fixed_and_seeds(tmp_path):
  runs = sweep.expand(['model.variant=postln,realformer', 'optimizer.learning_rate=1e-4,2e-4'],
                      ['train.num_steps=10'], seeds=3)
  assert len(runs) == 12
  assert runs[0] == {'model.variant': 'postln', 'optimizer.learning_rate': 1e-4,
                     'train.num_steps': 10, 'seed': 0}
  assert {r['seed'] for r in runs} == {0, 1, 2}
  h = sweep.Hyper
  zipped = h.zip(h.sweep('a', [1, 2]), h.sweep('b', ['x', 'y']))
  assert zipped == [{'a': 1, 'b': 'x'}, {'a': 2, 'b': 'y'}]
  with pytest.raises(ValueError, match='equal length'):
    h.zip(h.sweep('a', [1, 2]), h.sweep('b', [1]))
  sweep_file = tmp_path / 'hyper.py'
  sweep_file.write_text(textwrap.dedent('''
      def get_hyper(h):
        return h.product([h.sweep('model.variant', ['preln', 'realformer']),
                          h.zip(h.sweep('optimizer.learning_rate', [1e-4, 2e-4]),
                                h.sweep('optimizer.warmup_steps', [10, 5])),
                          h.fixed('train.num_steps', 7)])
  '''))
  runs = sweep.expand(seeds=2, sweep_file=str(sweep_file))
  assert len(runs) == 2 * 2 * 2
  assert all((r['optimizer.learning_rate'], r['optimizer.warmup_steps']) in ((1e-4, 10),
                                                                            (2e-4, 5))
             for r in runs)
  with pytest.raises(ValueError, match='key=value'):
    sweep.expand(['model.variant'])
  with pytest.raises(ValueError, match=r'seed is not a --sweep/--set key: --seeds N runs N '
                     r'seeds of each setting \(0, 1, ...\)'):
    sweep.expand(fixed=['seed=5'])
  for body, what in (('pass', 'NoneType'), ("return {'a': 1}", 'dict')):
    sweep_file.write_text(f'def get_hyper(h):\n  {body}\n')
    with pytest.raises(ValueError, match=f'get_hyper\\(h\\) returned {what}, not a list of '
                       'runs'):
      sweep.expand(sweep_file=str(sweep_file))
  # A value of a text field that reads as a number: the run passes its text.
  runs = sweep.expand(fixed=['data.hf_rows_per_document=100'])
  sweep.check_keys('configs/pretrain.py:postln,tiny', runs)


def test_names_are_stable_safe_and_distinct():
  run = {'seed': 1, 'optimizer.learning_rate': 0.0002, 'model.variant': 'realformer'}
  assert sweep.run_name(run) == 'model.variant=realformer,optimizer.learning_rate=0.0002,seed=1'
  assert sweep.run_name(dict(reversed(list(run.items())))) == sweep.run_name(run)
  odd = sweep.run_name({'data.sources': 'files:/data/*.txt;embedded', 'seed': 0})
  assert '/' not in odd and '*' not in odd and ';' not in odd and ' ' not in odd
  runs = sweep.expand(['optimizer.learning_rate=1e-4,1e-3'], seeds=2)
  assert len({sweep.run_name(r) for r in runs}) == 4
  with pytest.raises(ValueError, match=r'repeats a run \(optimizer.learning_rate=0.001,seed=0 '
                     'twice: two values of a --sweep key that read the same'):
    sweep.expand(['optimizer.learning_rate=1e-3,0.001'])
  with pytest.raises(ValueError, match="would share the folder 'data.sources=files__d_a_.txt"):
    sweep.expand(['data.sources=files:/d/a*.txt,files:/d/a?.txt'])


def test_run_skips_finished_resumes_failed_and_summarizes(tmp_path, capsys):
  program = tmp_path / 'fake_train.py'
  program.write_text(FAKE_PROGRAM)
  root = tmp_path / 'sweep'
  args = ['run', '--root', str(root), '--program', str(program), '--config', 'cfg',
          '--sweep', 'optimizer.learning_rate=1e-4,2e-4', '--seeds', '3']
  assert sweep_cli.main(args + ['--set', 'fail_once=True']) == 1  # every run fails once
  names = sorted(os.listdir(root))
  assert 'optimizer.learning_rate=0.0001,seed=2' in names  # named by what varies
  assert len(names) == 6 and not any(sweep.is_done(root / n) for n in names)
  assert 'resumes from' not in capsys.readouterr().out
  assert sweep_cli.main(args + ['--set', 'fail_once=True']) == 0  # resumed: all finish
  said = capsys.readouterr().out
  assert said.count(': resumes from step 5: ') == 6
  assert said.count(f'  (output: {root}/optimizer.learning_rate=') == 6
  assert sweep_cli.main(args + ['--set', 'fail_once=True']) == 0  # finished: all skipped
  for n in names:
    assert (root / n / 'calls.txt').read_text().count('call') == 2
    assert json.loads((root / n / RunDir.OVERRIDES).read_text())['fail_once'] is True

  assert sweep_cli.main(['summarize', '--root', str(root), '--metrics',
                         'eval/mlm_accuracy']) == 0
  # A metric no finished run logged (a misspelling; pretraining's defaults of fine-tuning
  # runs): one line naming those they did, not a table of empty cells.
  for metrics in ('eval/mlm_acc', 'eval/loss,dev_rte/accuracy'):
    with pytest.raises(ValueError, match=f'--metrics {metrics}: no finished run logged it; '
                                         'they log eval/mlm_accuracy, eval/step$'):
      sweep_cli.main(['summarize', '--root', str(root), '--metrics', metrics])
  assert sweep_cli.main(['summarize', '--root', str(root)]) == 0  # a default of the three
  # A folder that holds no sweep (a run of it, a typo): one line, nothing written there.
  for other in (root / names[0], tmp_path / 'nowhere'):
    with pytest.raises((ValueError, FileNotFoundError), match=f'--root {other} (holds no runs '
                       'of a sweep|is not a folder)'):
      sweep_cli.main(['summarize', '--root', str(other)])
    assert not (other / 'summary.md').exists()
  summary = (root / 'summary.md').read_text()  # (the defaults no run logged: no columns)
  assert 'eval/mlm_accuracy mean' in summary and 'eval/nsp_accuracy' not in summary
  header, table = sweep.summarize(sweep.collect(str(root), ['eval/mlm_accuracy']),
                                  ['eval/mlm_accuracy'])
  assert header[:2] == ['optimizer.learning_rate', 'n']  # fixed keys are not columns
  assert header[-1] == 'unfinished' and all(row[-1] == 0 for row in table)
  by_lr = {row[0]: row for row in table}
  vals = [0.1, 1.1, 2.1]  # lr * 1000 + seed for lr = 1e-4, seeds 0..2 (the last record)
  row = by_lr['0.0001']
  assert row[1] == 3
  assert row[2:7] == pytest.approx([statistics.mean(vals), 1.1, statistics.stdev(vals), 0.1,
                                    2.1])
  assert by_lr['0.0002'][3] == pytest.approx(1.2)
  assert (root / 'summary.md').read_text().startswith('| optimizer.learning_rate |')
  assert (root / 'summary.csv').read_text().splitlines()[0].startswith('optimizer.')
  # An unfinished seed is left out of the statistics, and counted.
  (root / 'optimizer.learning_rate=0.0001,seed=2' / RunDir.DONE).unlink()
  header, table = sweep.summarize(sweep.collect(str(root), ['eval/mlm_accuracy']),
                                  ['eval/mlm_accuracy'])
  row = {row[0]: row for row in table}['0.0001']
  assert row[1] == 2 and row[2] == pytest.approx(0.6) and row[-1] == 1
  # One finished seed a setting: a column of each metric's value, not five copies of it.
  header, table = sweep.summarize([r for r in sweep.collect(str(root), ['eval/mlm_accuracy'])
                                   if r['run']['seed'] == 0], ['eval/mlm_accuracy'])
  assert header == ['optimizer.learning_rate', 'n', 'eval/mlm_accuracy', 'best', 'unfinished']
  assert {row[0]: row[2] for row in table} == pytest.approx({'0.0001': 0.1, '0.0002': 0.2})
  assert {row[0]: row[3] for row in table} == {'0.0001': '', '0.0002': 'best'}  # (the highest)


def test_final_metrics_merge_the_lines_of_the_last_step(tmp_path):
  """A flush between two writes of one step writes two lines: both summarized."""
  from realformer.train import metrics_jsonl  # pylint: disable=g-import-not-at-top
  writer = metrics_jsonl.JsonlWriter(tmp_path / RunDir.METRICS, start_step=0)
  writer.write_scalars(5, {'eval/mlm_accuracy': 0.1})
  writer.write_scalars(10, {'eval/mlm_accuracy': 0.5, 'eval/loss': 2.0})
  writer.flush()
  writer.write_scalars(10, {'eval/mlm_loss': 1.9})
  writer.close()
  assert sweep.final_metrics(str(tmp_path)) == {'eval/step': 10, 'eval/mlm_accuracy': 0.5,
                                                'eval/loss': 2.0, 'eval/mlm_loss': 1.9}


def test_a_fine_tuning_sweep_summarizes_its_dev_metrics_by_default(tmp_path):
  """Without --metrics, runs that log no pretraining evaluation (finetune.py's) are summarised
  by their last dev evaluation: every <dev split>/<metric> but the step (pretraining's MLM
  defaults were refused there, naming a --metrics flag not given)."""
  program = tmp_path / 'fake_finetune.py'
  program.write_text(textwrap.dedent('''
      import json, os, sys
      args = dict(a.split('=', 1) for a in sys.argv[1:] if a.startswith('--config.'))
      lr = float(args['--config.optimizer.learning_rate'])
      workdir = sys.argv[sys.argv.index('--workdir') + 1]
      with open(os.path.join(workdir, 'metrics.jsonl'), 'a') as f:
        for step, split, record in ((1, 'train', {'loss': 0.7}), (1, 'dev_rte', {'accuracy': 0.1}),
                                    (2, 'dev_rte', {'accuracy': lr * 1e5})):
          f.write(json.dumps(dict(step=step, split=split, **record)) + '\\n')
  '''))
  root = tmp_path / 'sweep'
  assert sweep_cli.main(['run', '--root', str(root), '--program', str(program), '--config',
                         'cfg', '--sweep', 'optimizer.learning_rate=1e-5,3e-5']) == 0
  assert sweep_cli.main(['summarize', '--root', str(root)]) == 0
  header, *rows = (root / 'summary.csv').read_text().splitlines()
  assert header == 'optimizer.learning_rate,n,dev_rte/accuracy,best,unfinished'
  assert [r.split(',')[2] for r in rows] == ['1.0', '3.0']  # the last evaluation's
  # No run finished yet: its columns all the same (the unfinished ones counted).
  for run in root.iterdir():
    if run.is_dir():
      (run / RunDir.DONE).unlink()
  assert sweep_cli.main(['summarize', '--root', str(root)]) == 0
  assert (root / 'summary.csv').read_text().splitlines()[0] == (
      'optimizer.learning_rate,n,dev_rte/accuracy,unfinished')
  # A root that also holds a pretraining run: the columns of both.
  pretraining = root / 'model.variant=postln,seed=0'
  pretraining.mkdir()
  (pretraining / RunDir.OVERRIDES).write_text('{"model.variant": "postln", "seed": 0}')
  (pretraining / 'metrics.jsonl').write_text(
      '{"step": 2, "split": "eval", "mlm_accuracy": 0.3}\n')
  assert list(sweep.collect(str(root))[0]['metrics']) == list(
      sweep.PRETRAINING_METRICS) + ['dev_rte/accuracy']
  # Finished runs that logged neither evaluation: one line naming what they did log.
  shutil.rmtree(pretraining)
  for run in root.iterdir():
    if run.is_dir():
      (run / 'metrics.jsonl').write_text('{"step": 1, "split": "train", "loss": 0.7}\n')
      (run / RunDir.DONE).write_text('')
  with pytest.raises(ValueError, match=r'^no finished run logged the default metrics \(eval/'
                     r'.*\); they log train/loss, train/step: name those to summarise with '
                     r'--metrics$'):
    sweep_cli.main(['summarize', '--root', str(root)])


def test_runs_start_in_the_repository_and_a_wider_sweep_keeps_finished_runs(
    tmp_path, monkeypatch):
  """From another directory, with a relative --root (the program and config paths are the
  repository's); adding a value to an axis that had one renames nothing already run."""
  program = tmp_path / 'fake_train.py'
  program.write_text(FAKE_PROGRAM + 'assert os.getcwd() == %r\n' % REPO)
  monkeypatch.chdir(tmp_path)
  args = ['run', '--root', 'sweep', '--program', str(program), '--config', 'cfg',
          '--sweep', 'model.variant=postln,preln', '--set', 'optimizer.learning_rate=1e-4']
  assert sweep_cli.main(args) == 0
  assert sorted(os.listdir(tmp_path / 'sweep')) == ['model.variant=postln,seed=0',
                                                    'model.variant=preln,seed=0']
  wider = args[:-2] + ['--sweep', 'optimizer.learning_rate=1e-4,2e-4']
  assert sweep_cli.main(wider) == 0
  folders = sorted(os.listdir(tmp_path / 'sweep'))
  assert len(folders) == 4 and 'model.variant=postln,seed=0' in folders
  for name in folders:  # each run ran once
    assert (tmp_path / 'sweep' / name / 'calls.txt').read_text().count('call') == 1
  rows = sweep.collect('sweep', ['eval/mlm_accuracy'])
  assert len(rows) == 4 and all(r['done'] for r in rows)


def test_a_directory_holding_another_run_is_never_reused(tmp_path, capsys):
  # A second sweep into the same root with another --set: the key it adds names its runs
  # (folder_names), so they get folders of their own, the first sweep's left as they are.
  program = tmp_path / 'fake_train.py'
  program.write_text(FAKE_PROGRAM)
  root = tmp_path / 'sweep'
  args = ['run', '--root', str(root), '--program', str(program), '--config', 'cfg',
          '--sweep', 'optimizer.learning_rate=1e-4,2e-4']
  assert sweep_cli.main(args + ['--set', 'train.num_steps=2']) == 0
  capsys.readouterr()
  assert sweep_cli.main(args + ['--set', 'train.num_steps=3']) == 0
  assert sorted(os.listdir(root)) == [
      'optimizer.learning_rate=0.0001,seed=0',
      'optimizer.learning_rate=0.0001,train.num_steps=3,seed=0',
      'optimizer.learning_rate=0.0002,seed=0',
      'optimizer.learning_rate=0.0002,train.num_steps=3,seed=0']
  for name in os.listdir(root):
    assert (root / name / 'calls.txt').read_text().count('call') == 1
    assert json.loads((root / name / RunDir.OVERRIDES).read_text())['train.num_steps'] == (
        3 if 'num_steps' in name else 2)
  # A grid's axes always name its runs, so a one-value grid does not collide.
  runs = sweep.expand(['num_epochs=2'], ['batch_size=16'])
  assert sweep.run_names(runs) == ['seed=0']
  assert sweep.run_names(runs, always=['batch_size', 'num_epochs']) == [
      'batch_size=16,num_epochs=2,seed=0']


def test_finished_by_metrics_and_runs_held_by_another_sweep_are_skipped(tmp_path):
  program = tmp_path / 'fake_train.py'
  program.write_text(FAKE_PROGRAM)
  root = tmp_path / 'sweep'
  runs = sweep.expand(['optimizer.learning_rate=1e-4,2e-4,3e-4'], ['train.num_steps=2'])
  names = sweep.run_names(runs)
  for name in names:
    (root / name).mkdir(parents=True)
  # Finished without a DONE marker (the sweep was killed after train.py ended): a complete
  # checkpoint at step 2. Its log alone at step 2 is not enough (the last evaluation and
  # save come after it).
  (root / names[0] / 'metrics.jsonl').write_text('{"step": 2, "split": "train"}\n{"ste')
  assert not sweep.is_done(root / names[0], runs[0])
  (root / names[0] / 'checkpoints' / '2').mkdir(parents=True)
  (root / names[0] / 'checkpoints' / '2' / 'commit_success.txt').write_text('')
  # Held by another sweep process on this host: its flock (here this test's own).
  held = os.open(root / names[1] / RunDir.SWEEP_LOCK, os.O_RDWR | os.O_CREAT)
  fcntl.flock(held, fcntl.LOCK_EX)
  os.write(held, f'{socket.gethostname()} {os.getppid()}'.encode())
  # A lock left by a process that died, its pid since another live process's (the pytest
  # runner's parent): taken over, its flock being free.
  (root / names[2] / RunDir.SWEEP_LOCK).write_text(f'{socket.gethostname()} {os.getppid()}')
  said = []
  codes = sweep.run_all(runs, root=str(root), program=str(program), config='cfg',
                        echo=said.append)
  os.close(held)
  assert codes == {names[0]: 0, names[1]: sweep.RUNNING_ELSEWHERE, names[2]: 0}
  assert f'[2/3] {names[1]}: another sweep process is running it, skipped' in said
  assert not (root / names[0] / 'calls.txt').exists()
  assert not (root / names[1] / 'calls.txt').exists()
  assert (root / names[1] / RunDir.SWEEP_LOCK).exists()  # not ours: left alone
  assert (root / names[2] / 'calls.txt').exists() and sweep.is_done(root / names[2])
  assert not (root / names[2] / RunDir.SWEEP_LOCK).exists()  # released after the run
  # Counted within a larger call (a grid's second task): its place among all, its label.
  said = []
  sweep.run_all(runs[2:], root=str(root), program=str(program), config='cfg',
                echo=said.append, counted=(4, 7), label='wnli/')
  assert said == [f'[5/7] wnli/{names[2]}: finished, skipped']


def test_a_run_another_sweep_process_finished_meanwhile_is_finished(tmp_path, capsys,
                                                                    monkeypatch):
  """Two sweep processes on one root: a run the other held when this one looked, and that
  it finished before this one ended, counts as finished (exit 0, not 'run by another')."""
  program = tmp_path / 'fake_train.py'
  program.write_text(FAKE_PROGRAM)
  root = tmp_path / 'sweep'

  def run_all(runs, root, **_):
    (tmp_path / 'sweep' / 'seed=0').mkdir(parents=True)
    (tmp_path / 'sweep' / 'seed=0' / RunDir.DONE).write_text('')
    return {'seed=0': sweep.RUNNING_ELSEWHERE, 'seed=1': sweep.RUNNING_ELSEWHERE}
  monkeypatch.setattr(sweep, 'run_all', run_all)
  assert sweep_cli.main(['run', '--root', str(root), '--program', str(program),
                         '--config', 'cfg', '--seeds', '2']) == 1
  assert '1/2 runs finished; run by another sweep process: seed=1' in capsys.readouterr().out


def test_runs_of_two_configs_in_one_root_are_summarized_apart():
  """A root given two --config (a preset's argument changed): their runs are grouped apart,
  a command column first, never averaged as one setting."""
  rows = [{'run': {'model.variant': variant, 'seed': seed}, 'done': True, 'diverged': False,
           'command': f'train.py configs/pretrain.py:{config}', 'metrics': {'m': value}}
          for variant, config, seed, value in (('postln', 'postln,tiny', 0, 0.1),
                                               ('postln', 'postln,tiny,runlocal', 0, 0.3),
                                               ('preln', 'postln,tiny,runlocal', 0, 0.5))]
  # A run of before command.json (none recorded) goes with the root's one command.
  old = dict(rows[0], command='', run={'model.variant': 'postln', 'seed': 1},
             metrics={'m': 0.2})
  assert sweep.summarize([rows[0], old], ['m']) == (
      ['n', 'm mean', 'm median', 'm std', 'm min', 'm max', 'unfinished'],
      [[2, 0.15000000000000002, 0.15000000000000002, pytest.approx(0.0707, abs=1e-4), 0.1,
        0.2, 0]])
  header, table = sweep.summarize(rows, ['m'])
  assert header == ['command', 'model.variant', 'n', 'm', 'best', 'unfinished']
  assert table == [['train.py configs/pretrain.py:postln,tiny', 'postln', 1, 0.1, '', 0],
                   ['train.py configs/pretrain.py:postln,tiny,runlocal', 'postln', 1, 0.3, '',
                    0],
                   ['train.py configs/pretrain.py:postln,tiny,runlocal', 'preln', 1, 0.5, 'best',
                    0]]
  # A loss is best at its lowest; settings that share the best are each marked tied.
  lossy = [dict(r, metrics={'eval/mlm_loss': v}) for r, v in zip(rows, (2.0, 1.0, 1.0))]
  header, table = sweep.summarize(lossy, ['eval/mlm_loss'])
  assert [row[header.index('best')] for row in table] == ['', 'best (tied)', 'best (tied)']


@pytest.mark.filterwarnings('ignore:.*found in sys.modules:RuntimeWarning')  # (runpy's)
def test_the_library_run_as_a_program_names_the_program():
  import runpy  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit, match=r'run them with `python sweep.py run\|print\|summarize'):
    runpy.run_module('realformer.tools.sweep', run_name='__main__')


def test_values_are_read_as_their_fields_types():
  """A text field keeps the text as given (not a number made of it); a bool field, also one
  whose default is None, takes true/false only; None has no command-line text."""
  config = 'configs/pretrain.py:postln,tiny'
  types = sweep.field_types(config)
  (run,) = sweep.expand([], ['data.tokenizer=1e3', 'data.weights=007',
                             'optimizer.learning_rate=1e-4', 'train.num_steps=3'], types=types)
  assert run == {'data.tokenizer': '1e3', 'data.weights': '007',
                 'optimizer.learning_rate': 1e-4, 'train.num_steps': 3, 'seed': 0}
  assert {'--config.data.tokenizer=1e3', '--config.data.weights=007',
          '--config.optimizer.learning_rate=0.0001'} <= set(sweep.command('p', config, 'w', run))
  with pytest.raises(ValueError, match="model.residual_attention: 'yes' is not true or false"):
    sweep.expand(['model.residual_attention=yes'], types=types)
  assert [r['model.residual_attention'] for r in sweep.expand(
      ['model.residual_attention=true,0'], types=types)] == [True, False]
  # An int field's whole number in scientific notation is that int; None is no value to give
  # (its default is had by leaving the key out), said as such.
  assert [r['train.num_steps'] for r in sweep.expand(
      ['train.num_steps=1e3,1.5e1,20.0'], types=types)] == [1000, 15, 20]
  with pytest.raises(ValueError, match=r'data.seed=None does not fit the field \(int, now '
                     r'None\); leave the key out of the run'):
    sweep.check_keys(config, sweep.expand([], ['data.seed=None'], types=types))
  with pytest.raises(ValueError, match=r'model.attention=1: model.attention=.1.: expected'):
    sweep.check_keys(config, sweep.expand(['model.attention=1,dot'], types=types))
  with pytest.raises(ValueError, match=r'model.block=None does not fit the field \(str, now '
                     r'None\); leave the key out of the run'):
    sweep.check_keys(config, [{'model.block': None, 'seed': 0}])
  with pytest.raises(ValueError, match=r'model.residual_attention=2 does not fit the field '
                     r'\(bool'):
    sweep.check_keys(config, [{'model.residual_attention': 2, 'seed': 0}])


def test_runs_recorded_before_values_were_typed_are_the_same_runs(tmp_path):
  """A text field's number-like value was recorded as a number (1) before values were read
  as their fields' types ('1'): the same command line, so the same run and folder."""
  types = sweep.field_types('configs/pretrain.py:postln,tiny')
  runs = sweep.expand(['data.hf_rows_per_document=1,100'], types=types)
  assert [r['data.hf_rows_per_document'] for r in runs] == ['1', '100']
  root = tmp_path / 'root'
  for run, name in zip(runs, ['old_a', 'old_b']):
    (root / name).mkdir(parents=True)
    recorded = dict(run, **{'data.hf_rows_per_document': int(run['data.hf_rows_per_document'])})
    (root / name / RunDir.OVERRIDES).write_text(json.dumps(recorded))
  assert sweep.folder_names(str(root), runs) == ['old_a', 'old_b']
  assert sweep.other_run(str(root / 'old_a'), runs[0]) == []
  assert sweep.other_run(str(root / 'old_a'), runs[1]) == [
      "data.hf_rows_per_document 1 (asked '100')"]


def test_a_sweep_extended_in_its_root_with_another_set_gets_folders_of_its_own(tmp_path):
  """The root records a run; the same point with another --set is another run, named by the
  key that --set adds, never sent to the first run's folder (which holds other overrides)."""
  first = {'optimizer.learning_rate': 0.001, 'seed': 0}
  (tmp_path / 'optimizer.learning_rate=0.001,seed=0').mkdir()
  (tmp_path / 'optimizer.learning_rate=0.001,seed=0' / RunDir.OVERRIDES).write_text(
      json.dumps(first))
  again = dict(first, **{'data.max_seq_length': 64})
  assert sweep.folder_names(str(tmp_path), [again, first], ('optimizer.learning_rate',)) == [
      'data.max_seq_length=64,optimizer.learning_rate=0.001,seed=0',
      'optimizer.learning_rate=0.001,seed=0']
  script = sweep.launch_script([again], root=str(tmp_path), program='train.py',
                               config='configs/pretrain.py:postln,tiny', target='local',
                               always=('optimizer.learning_rate',))
  assert 'data.max_seq_length=64,optimizer.learning_rate=0.001,seed=0' in script
  # A name made of the differing keys that another run's folder holds too: made unique.
  (tmp_path / 'data.max_seq_length=64,optimizer.learning_rate=0.001,seed=0' / RunDir.DONE
   ).write_text('')
  third = dict(again, **{'model.num_layers': 4})
  (name,) = sweep.folder_names(str(tmp_path), [third], ('optimizer.learning_rate',))
  assert re.fullmatch(r'data.max_seq_length=64,model.num_layers=4,optimizer.learning_rate='
                      r'0.001,seed=0', name), name
  (tmp_path / name).mkdir()
  (tmp_path / name / RunDir.OVERRIDES).write_text(json.dumps(dict(third, extra=1)))
  (tmp_path / name / RunDir.DONE).write_text('')
  (again_name,) = sweep.folder_names(str(tmp_path), [third], ('optimizer.learning_rate',))
  assert again_name.startswith(name + '-') and again_name != name


def test_a_failed_runs_folder_goes_to_new_settings_once(tmp_path):
  """A folder whose run failed before its first checkpoint (its log.txt written after its
  overrides.json) is given to the next settings; once they are recorded there (a printed
  run, queued or running elsewhere), the old log no longer makes it free."""
  folder = tmp_path / 'seed=0'
  folder.mkdir()
  (folder / RunDir.OVERRIDES).write_text(json.dumps({'train.num_steps': 5, 'seed': 0}))
  (folder / RunDir.LOG).write_text('error: data.sources=nowhere matches no file\n')
  assert sweep.holds_nothing(str(folder))
  stopped = (folder / RunDir.LOG).read_text()
  (folder / RunDir.LOG).write_text(stopped + 'not finished: stopped by SIGTERM or Ctrl-C '
                                   'outside the training loop (...) (exit status 75)\n')
  assert not sweep.holds_nothing(str(folder))  # stopped to be resumed: a requeued job's
  (folder / RunDir.LOG).write_text(stopped)
  args = dict(root=str(tmp_path), program='train.py', config='configs/pretrain.py:postln,tiny',
              target='local')
  first = sweep.launch_script([{'train.num_steps': 1000, 'seed': 0}], **args)
  assert f'--workdir {folder} ' in first
  assert json.loads((folder / RunDir.OVERRIDES).read_text())['train.num_steps'] == 1000
  os.utime(folder / RunDir.LOG, (1, 1))  # (older than the overrides the print recorded)
  assert not sweep.holds_nothing(str(folder))
  second = sweep.launch_script([{'train.num_steps': 2000, 'seed': 0}], **args)
  assert f'--workdir {folder} ' not in second and 'train.num_steps=2000,seed=0' in second
  assert json.loads((folder / RunDir.OVERRIDES).read_text())['train.num_steps'] == 1000


def test_seeds_sharing_prepared_data_need_its_own_seed():
  """--seeds N with one data.prepared_dir: its preparation takes the run's seed, so seeds 1
  and on would be refused by its fingerprint, each after starting: one line before any run,
  naming data.seed, which makes the data one for every seed."""
  config = 'configs/pretrain.py:postln,tiny'
  types = sweep.field_types(config)
  runs = sweep.expand([], ['data.prepared_dir=/shared/data'], seeds=2, types=types)
  with pytest.raises(ValueError, match=r'the runs of several seeds share '
                     r'data.prepared_dir=/shared/data, .*--set data.seed=0'):
    sweep.check_keys(config, runs)
  sweep.check_keys(config, sweep.expand([], ['data.prepared_dir=/shared/data', 'data.seed=0'],
                                        seeds=2, types=types))
  sweep.check_keys(config, sweep.expand([], [], seeds=2, types=types))  # each its own data
  # Seeds whose preparations take one seed all the same may share it.
  sweep.check_keys(config, [{'data.prepared_dir': '/shared/data', 'seed': 0},
                            {'data.prepared_dir': '/shared/data', 'data.seed': 0, 'seed': 1}])
  # Objectives whose instances differ cannot share one prepared corpus either.
  with pytest.raises(ValueError, match=r'runs of objectives whose instances differ '
                     r'\(full_sentences, pairs\) share data.prepared_dir=/shared/data'):
    sweep.check_keys(config, sweep.expand(['objective=mlm,mlm_nsp'],
                                          ['data.prepared_dir=/shared/data', 'data.seed=0'],
                                          types=types))


def test_a_key_set_twice_is_an_error_not_a_silently_dropped_grid_point():
  with pytest.raises(ValueError, match='optimizer.learning_rate is set by two of the lists'):
    sweep.expand(['optimizer.learning_rate=1e-4', 'optimizer.learning_rate=2e-4'])
  with pytest.raises(ValueError, match='train.num_steps is set by two'):
    sweep.expand(['train.num_steps=2,3'], ['train.num_steps=4'])


def test_a_sweep_extends_one_value_at_a_time_and_another_config_never_takes_its_runs(
    tmp_path, capsys):
  """Every --sweep key names the runs, so a value added by a later sweep of one value gets a
  folder of its own; a sweep of another --config (or program) into the root is refused, not
  skipped as finished (the folder names leave the config out)."""
  program = tmp_path / 'fake_train.py'
  program.write_text(FAKE_PROGRAM)
  root = str(tmp_path / 'sweep')
  args = ['--root', root, '--program', str(program)]
  for key in ('optimizer.learning_rate=1e-4', 'config.optimizer.learning_rate=2e-4'):
    assert sweep_cli.main(['run'] + args + ['--config', 'cfg', '--sweep', key]) == 0
  assert sorted(os.listdir(root)) == ['optimizer.learning_rate=0.0001,seed=0',
                                      'optimizer.learning_rate=0.0002,seed=0']
  capsys.readouterr()
  other = args + ['--config', 'cfg2', '--sweep', 'optimizer.learning_rate=1e-4']
  assert sweep_cli.main(['run'] + other) == 1
  assert ("holds a run with other overrides (--config 'cfg' (asked 'cfg2')); left alone"
          in capsys.readouterr().out)
  with pytest.raises(ValueError, match=r"1 of the runs would go into folders .*--config 'cfg' "
                                       r"\(asked 'cfg2'\)"):
    sweep_cli.main(['print'] + other)
  for name in os.listdir(root):
    assert (tmp_path / 'sweep' / name / 'calls.txt').read_text().count('call') == 1
  # a config file's path as given, relative to the repository or absolute, is one config
  assert sweep.program_and_config('train.py', 'configs/pretrain.py:postln,tiny') == (
      sweep.program_and_config(os.path.join(REPO, 'train.py'),
                               os.path.join(REPO, 'configs/pretrain.py') + ':postln,tiny'))


def test_a_printed_script_never_sends_a_run_into_the_folder_of_another(tmp_path, capsys):
  """`print` with another --set into a root whose folders hold the first --set's runs (the
  names leave out the --set values) sends them to folders of their own: the printed command
  never resumes another run in place."""
  program = tmp_path / 'fake_train.py'
  program.write_text(FAKE_PROGRAM)
  root = str(tmp_path / 'sweep')
  args = ['--root', root, '--program', str(program), '--config', 'cfg',
          '--sweep', 'optimizer.learning_rate=1e-4,2e-4']
  assert sweep_cli.main(['run'] + args + ['--set', 'train.num_steps=2']) == 0
  capsys.readouterr()
  assert sweep_cli.main(['print', '--target', 'local'] + args +
                        ['--set', 'train.num_steps=2']) == 0
  assert capsys.readouterr().out.count(': finished, not launched') == 2  # (as run skips them)
  capsys.readouterr()
  assert sweep_cli.main(['print', '--target', 'local'] + args +
                        ['--set', 'train.num_steps=3']) == 0  # folders of its own
  assert capsys.readouterr().out.count('train.num_steps=3,seed=0 ') == 2


def test_a_time_budgeted_run_is_finished_when_its_last_checkpoint_spent_the_budget(tmp_path):
  """A run under train.time_budget_minutes stops before train.num_steps: finished when the
  time record of its newest complete checkpoint reaches the budget (the override, else its
  config.json), not while a checkpoint below it is the newest."""
  run = {'train.time_budget_minutes': 0.5, 'seed': 0}
  workdir = tmp_path / 'budgeted'
  (workdir / 'checkpoints').mkdir(parents=True)
  (workdir / 'config.json').write_text(json.dumps({'train': {'num_steps': 100_000,
                                                             'time_budget_minutes': 0.5}}))
  for step in (40, 87):
    (workdir / 'checkpoints' / str(step)).mkdir()
    (workdir / 'checkpoints' / str(step) / 'commit_success.txt').write_text('')
  (workdir / 'time_spent.json').write_text(json.dumps({'40': 12.5, '87': 29.9}))
  assert not sweep.is_done(workdir, run) and not sweep.is_done(workdir)
  (workdir / 'time_spent.json').write_text(json.dumps({'40': 12.5, '87': 30.0}))
  assert sweep.is_done(workdir, run) and sweep.is_done(workdir)
  assert not sweep.is_done(workdir, {'train.time_budget_minutes': 1.0})  # a longer budget


def test_launch_scripts_for_tpu_and_slurm(capsys, tmp_path, gcs, monkeypatch):
  monkeypatch.chdir(tmp_path)
  args = ['--config', 'configs/pretrain.py:realformer,base',
          '--sweep', 'model.variant=postln,realformer', '--seeds', '2']
  sweep_cli.main(['print', '--target', 'tpu', '--root', f'{gcs}/printed'] + args)
  tpu = capsys.readouterr().out.splitlines()
  cmds = [l for l in tpu if l.startswith('gcloud')]
  assert len(cmds) == 4 and all('--worker=all' in c and 'cd ~/realformer && .venv/bin/python '
                                 'train.py' in c for c in cmds)  # (venv.sh's, as documented)
  assert ': "${TPU:?set TPU to the name of the TPU VM first}"' in tpu  # (unset: it stops)
  assert any('model.variant=realformer,seed=1' in c for c in cmds)
  assert len(sweep.collect(f'{gcs}/printed', ['eval/loss'])) == 4  # the runs are recorded
  with pytest.raises(ValueError, match='is a local folder, which each TPU worker would have a '
                     'copy of; give a gs:// URL'):
    sweep_cli.main(['print', '--target', 'tpu', '--root', str(tmp_path / 'tpu')] + args)
  # Several slices: every worker of every node of the queued resource, all at once.
  sweep_cli.main(['print', '--target', 'multislice', '--root', f'{gcs}/printed'] + args)
  multi = capsys.readouterr().out.splitlines()
  cmds = [l for l in multi if l.startswith('gcloud')]
  assert len(cmds) == 4 and all(c.startswith(
      'gcloud compute tpus queued-resources ssh $QR --zone $ZONE --node=all --worker=all '
      '--batch-size=$WORKERS --command ') and '.venv/bin/python train.py' in c for c in cmds)
  assert ': "${WORKERS:?set WORKERS to the workers of all its slices first}"' in multi
  assert ': "${QR:?set QR to the name of the queued resource first}"' in multi
  sweep_cli.main(['print', '--target', 'slurm', '--root', str(tmp_path / 'slurm')] + args)
  printed = capsys.readouterr()
  slurm = [l for l in printed.out.splitlines() if l.startswith('sbatch')]
  assert len(slurm) == 4 and all('srun python train.py' in l for l in slurm)
  assert all('--signal=TERM@120 --requeue' in l and 'scontrol requeue' in l for l in slurm)
  assert all(f'--output={tmp_path}/slurm/' in l and '/log.txt ' in l for l in slurm)
  assert all(f'--chdir={REPO} ' in l for l in slurm)  # (where the config file's path holds)
  assert 'is node-local on most clusters' in printed.err  # (a root in /tmp)
  # Runs the script started (no DONE marker) are summarised once they finished: their
  # checkpoint at train.num_steps (from config.json), or a fine-tuning run's results.json.
  names = sorted(os.listdir(tmp_path / 'slurm'))
  for i, name in enumerate(names):
    run = tmp_path / 'slurm' / name
    (run / 'metrics.jsonl').write_text('{"step": 9, "split": "eval", "loss": 1.5}\n')
    if i == 0:
      (run / 'results.json').write_text('{}')
    elif i < 3:
      (run / 'config.json').write_text('{"train": {"num_steps": 9}}')
      (run / 'checkpoints' / str(10 - i)).mkdir(parents=True)  # 9, then 8
      (run / 'checkpoints' / str(10 - i) / 'commit_success.txt').write_text('')
  done = {sweep.run_name(r['run']): r['done'] for r in sweep.collect(str(tmp_path / 'slurm'),
                                                                      ['eval/loss'])}
  assert [done[n] for n in names] == [True, True, False, False]  # checkpoint 8 is not 9
  # Printed again: the finished runs and a diverged one are left out, as `run` skips them.
  (tmp_path / 'slurm' / names[3] / 'diverged.json').write_text('{}')
  sweep_cli.main(['print', '--target', 'slurm', '--root', str(tmp_path / 'slurm')] + args)
  again = capsys.readouterr().out.splitlines()
  assert [l for l in again if l.startswith('sbatch')] == [slurm[2]]
  assert again[1].endswith('(3 finished or diverged, left out)')
  assert [l for l in again if l.endswith('not launched')] == [
      f'# {names[0]}: finished, not launched', f'# {names[1]}: finished, not launched',
      f'# {names[3]}: diverged, not launched']
  sweep_cli.main(['print', '--target', 'local', '--root', 'rel'] + args)
  local = capsys.readouterr().out.splitlines()
  assert local[3] == f'cd {REPO}' and f'--workdir {tmp_path}/rel/' in local[4]


TINY = ['train.num_steps=3', 'train.batch_size=8', 'train.log_every_steps=1',
        'train.eval_every_steps=3', 'train.eval_steps=1', 'train.checkpoint_every_steps=3',
        'optimizer.warmup_steps=1', 'data.max_seq_length=32', 'data.max_predictions_per_seq=5',
        'model.num_layers=2', 'model.hidden_size=32', 'model.num_heads=2', 'model.mlp_dim=64',
        'model.max_len=32']


@pytest.mark.filterwarnings('error::UserWarning')  # (matplotlib's: a legend of nothing)
def test_study_plan_and_learning_curves(tmp_path, capsys, gcs):
  import study  # pylint: disable=g-import-not-at-top
  # A bucket root (the loopback server: planning reads R/budget.json there).
  assert study.main(['--root', f'{gcs}/study', '--seeds', '3', '--print_only']) == 0
  printed = capsys.readouterr()
  lines = [l for l in printed.out.splitlines() if l.startswith('python train.py')]
  assert len(lines) == 5 * 3  # five variants, three seeds, one budget
  assert (f'no budget.json in {gcs}/study (study.py budget writes it there): --steps 150, '
          '--layers 4, --seq_len 64, --batch 32, --learning_rate 0.002 by default'
          ) in printed.err  # (not in the printed script)
  # A spread whose ends print alike is one number, as a single value's (not '1.00 (1.00-1.00)').
  assert study.spread([1.0004, 0.9996], 2) == study.spread([1.0], 2) == '1.00'
  assert study.spread([0.9, 1.0], 2) == '0.95 (0.90-1.00)' and study.spread([None]) == '-'
  assert all('--config.train.num_steps=150' in l and '--config.model.num_layers=4' in l
             for l in lines)
  assert sum('--config.model.variant=synth_dense_vanilla' in l for l in lines) == 3
  assert not any('objective' in l for l in lines)  # BERT's: the runs of earlier studies
  # A study of RoBERTa's objective: every run of it, in a root of its own.
  assert study.main(['--root', str(tmp_path / 'roberta'), '--seeds', '1', '--print_only',
                     '--objective', 'mlm', '--corpus', 'embedded']) == 0
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith('python train.py')]
  assert len(lines) == 5 and all('--config.objective=mlm' in l for l in lines)
  runs = [{'model.variant': v, 'seed': s} for v in ('postln', 'realformer') for s in (0, 1)]
  names = sweep.run_names(runs)
  for i, (run, name) in enumerate(zip(runs, names)):
    (tmp_path / name).mkdir()
    with open(tmp_path / name / 'metrics.jsonl', 'w') as f:
      for step in (10, 20, 30)[:2 + i % 2]:  # seeds ending at different steps (equal time)
        f.write(json.dumps({'step': step, 'split': 'train', 'loss': 5.0 - step / 10}) + '\n')
        f.write(json.dumps({'step': step, 'split': 'eval', 'mlm_accuracy': step / 100}) + '\n')
  study.curves(str(tmp_path), runs, names, str(tmp_path / 'curves.png'))
  assert (tmp_path / 'curves.png').stat().st_size > 1000


def test_study_stability_grid_plan_cells_and_report(tmp_path, capsys, gcs):
  import study  # pylint: disable=g-import-not-at-top
  assert study.main(['stability', '--root', f'{gcs}/study', '--print_only']) == 0
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith('python train.py')]
  assert len(lines) == 3 * (9 + 4)  # variants x (rates + those up to 4e-3 with warm-up)
  assert all('--config.model.num_layers=12' in l and '--config.train.num_steps=300' in l
             for l in lines)
  assert study.main(['--root', f'{gcs}/wall', '--minutes', '20', '--print_only']) == 0
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith('python train.py')]
  assert all('--config.train.time_budget_minutes=20' in l and
             '--config.optimizer.warmup_steps=-1' in l for l in lines)
  # Cells: a finished run, one whose loss rose, one stopped by a nan loss, one never run.
  cells = {}
  for name, losses, log in (('ok', [9.0, 7.0], ''), ('rose', [9.0, 9.5], ''),
                            ('nan', [9.0], 'NonFiniteLossError: loss became nan at step 37; '
                                           'the last good checkpoint ...'), ('missing', None, '')):
    workdir = tmp_path / name
    workdir.mkdir()
    if losses:
      with open(workdir / 'metrics.jsonl', 'w') as f:
        for step, loss in enumerate(losses):
          f.write(json.dumps({'step': 10 * (step + 1), 'split': 'train', 'loss': loss}) + '\n')
    (workdir / 'log.txt').write_text(log)
    if name in ('ok', 'rose'):
      (workdir / RunDir.DONE).write_text('')
    assert sweep.mark_diverged(str(workdir)) == (name == 'nan')
    cells[name] = study.stability_cell(str(workdir))
  assert [cells[n]['status'] for n in ('ok', 'rose', 'nan', 'missing')] == [
      'ok', 'rose', 'diverged', 'missing']
  assert cells['nan']['step'] == 37 and cells['ok']['final'] == 7.0
  # A marker belongs to the run its folder records: a grid of another model size (config) or
  # other settings that reaches the folder neither skips its own run nor reports the marker.
  nan_run = {'model.variant': 'postln', 'optimizer.learning_rate': 2e-3}
  (tmp_path / 'nan' / RunDir.OVERRIDES).write_text(json.dumps(nan_run))
  (tmp_path / 'nan' / RunDir.COMMAND).write_text(json.dumps(
      sweep.program_and_config('train.py', 'configs/pretrain.py:postln,tiny')))
  small = 'configs/pretrain.py:postln,small'
  assert study.stability_cell(str(tmp_path / 'nan'), nan_run)['status'] == 'diverged'
  assert study.stability_cell(str(tmp_path / 'nan'), nan_run, small)['status'] == 'missing'
  assert not sweep.is_diverged(str(tmp_path / 'nan'), dict(nan_run, seed=1))
  grid = tmp_path / 'grid'  # the marked run in the folder its overrides name
  grid.mkdir()
  shutil.copytree(tmp_path / 'nan', grid / sweep.run_names([nan_run])[0])
  tiny = sweep.program_and_config('train.py', 'configs/pretrain.py:postln,tiny')
  assert sweep.diverged(str(grid), [nan_run], (), tiny) == [True]
  assert sweep.diverged(str(grid), [nan_run], (), sweep.program_and_config(
      'train.py', small)) == [False]  # another size's grid: not its run
  assert sweep.diverged(str(grid), [dict(nan_run, seed=1)], ()) == [False]
  # run_all's refusal of such a folder is a failure, and never marks the other run's log
  (tmp_path / 'ok' / 'log.txt').write_text('loss became nan at step 3')
  assert sweep.failed_or_diverged(str(tmp_path), {
      'ok': sweep.OTHER_RUN, 'nan': 0, 'missing': sweep.RUNNING_ELSEWHERE}) == (['ok'], [])
  assert not (tmp_path / 'ok' / RunDir.DIVERGED).exists()
  assert sweep.failed_or_diverged(str(tmp_path), {'ok': 1}) == ([], ['ok'])
  (tmp_path / 'ok' / RunDir.DIVERGED).unlink()
  # A first logged window that spiked (20 nats) is no start: a random model's loss is.
  spike = tmp_path / 'spike'
  spike.mkdir()
  (spike / 'metrics.jsonl').write_text(''.join(
      json.dumps({'step': s, 'split': 'train', 'loss': v}) + '\n'
      for s, v in ((10, 20.0), (20, 12.0), (30, 10.0))))
  (spike / 'config.json').write_text(json.dumps({'model': {'vocab_size': 8000}}))
  (spike / RunDir.DONE).write_text('')
  cell = study.stability_cell(str(spike))
  assert cell['start'] == pytest.approx(math.log(8000) + math.log(2))  # 9.68 < 10.0
  (spike / 'config.json').write_text(json.dumps({'model': {'vocab_size': 8000},
                                                 'objective': 'mlm'}))  # no NSP head
  assert study.stability_cell(str(spike))['chance'] == pytest.approx(math.log(8000))
  (spike / 'config.json').write_text(json.dumps({'model': {'vocab_size': 8000}}))
  assert cell['status'] == 'rose' and cell['peak'] == 20.0
  grid = {('postln', 1e-3, 0, 0): cells['ok'], ('postln', 2e-3, 0, 0): cells['nan'],
          ('realformer', 1e-3, 0, 0): cells['rose'], ('realformer', 2e-3, 0, 0): cells['missing']}
  table = study.stability_report(grid, ['postln', 'realformer'], [1e-3, 2e-3], [0],
                                 str(tmp_path), settings='40 steps of 8 sequences')
  assert table.startswith('40 steps of 8 sequences; each cell the last logged train loss: '
                          '"(rose)" above its start')
  assert '| postln | 0 | 7.000 | NaN at 37 |' in table
  assert '| realformer | 0 | 9.500 (rose) | (not run) |' in table
  assert (tmp_path / 'stability.png').stat().st_size > 1000
  # Several seeds: a row for each (the figure draws the first).
  grid.update({('postln', 1e-3, 0, 1): cells['rose'], ('postln', 2e-3, 0, 1): cells['ok']})
  table = study.stability_report(grid, ['postln'], [1e-3, 2e-3], [0], str(tmp_path),
                                 seeds=[0, 1])
  assert '| variant | warm-up steps | seed | lr 0.001 | lr 0.002 |' in table
  assert '| postln | 0 | 0 | 7.000 | NaN at 37 |' in table
  assert '| postln | 0 | 1 | 9.500 (rose) | 7.000 |' in table


def test_study_record_keeps_what_the_reports_read_and_no_checkpoints(tmp_path):
  import study  # pylint: disable=g-import-not-at-top
  root, kept = tmp_path / 'R', tmp_path / 'kept'
  run = root / 'compare' / 'model.variant=postln,seed=0'
  for path, text in ((run / 'metrics.jsonl', '{}'), (run / 'overrides.json', '{}'),
                     (run / 'config.json', '{}'), (run / RunDir.DONE, ''),
                     (run / 'machine.jsonl', '{}'),
                     (run / 'log.txt', 'log'), (run / 'checkpoints' / '1000' / 'x.json', '{}'),
                     (run / 'data' / 'metadata.json', '{}'),
                     (root / 'compare' / 'claims.md', '| table |'),
                     (root / 'compare' / 'attention' / 'attention_entropy.png', 'png'),
                     (root / study.BUDGET_FILE, '{"steps": 1000}')):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  args = argparse.Namespace(root=str(root), record=str(kept))
  study.record(args, str(root / 'compare'))
  got = sorted(str(p.relative_to(kept)) for p in kept.rglob('*') if p.is_file())
  assert got == ['budget.json', 'compare/attention/attention_entropy.png', 'compare/claims.md',
                 *(f'compare/model.variant=postln,seed=0/{n}' for n in
                   (RunDir.DONE, 'config.json', 'machine.jsonl', 'metrics.jsonl',
                    'overrides.json'))], got
  study.record(argparse.Namespace(root=str(root), record=None), str(root / 'compare'))  # off
  # A run judged finished by its checkpoint (no DONE: its sweep was killed as it ended),
  # which the record leaves out: the record marks it DONE, so its report reads it.
  cut = root / 'compare' / 'model.variant=preln,seed=0'
  (cut / 'checkpoints' / '1000').mkdir(parents=True)
  (cut / 'checkpoints' / '1000' / 'commit_success.txt').write_text('')
  (cut / 'overrides.json').write_text(json.dumps({'train.num_steps': 1000}))
  (cut / 'metrics.jsonl').write_text('{}')
  study.record(args, str(root / 'compare'))
  assert (kept / 'compare' / cut.name / RunDir.DONE).exists()
  assert study.finished(str(kept / 'compare' / cut.name))
  # A study of other settings into the same record (the docs' own, say): refused, whole.
  (cut / 'overrides.json').write_text(json.dumps({'train.num_steps': 20}))
  (cut / 'metrics.jsonl').write_text('{"other": 1}')
  with pytest.raises(ValueError, match=r'--record .*preln,seed=0 holds a run of other '
                     r'settings \(train.num_steps 1000 \(asked 20\)\)'):
    study.record(args, str(root / 'compare'))
  assert (kept / 'compare' / cut.name / 'metrics.jsonl').read_text() == '{}'


def test_study_orderings_pair_seeds_and_reports_read_only_their_own_runs(tmp_path):
  """An ordering judges the seeds both sides ran (each seed has its own held-out data); a
  folder that holds a run of other settings (an earlier study at another budget) is not
  read as this one's; a run that an earlier, narrower sweep named is found in its folder."""
  import study  # pylint: disable=g-import-not-at-top
  assert study.ordering({'a': {0: 0.146}, 'b': {1: 0.140}}, 'a', 'b') == (
      'undecided (no seed run by both a and b)')
  # a's seed 3 (lowest) has no partner: the three paired seeds decide.
  assert study.ordering({'a': {0: 0.3, 1: 0.31, 2: 0.32, 3: 0.1},
                         'b': {0: 0.2, 1: 0.21, 2: 0.22}}, 'a', 'b') == (
      'held (a ahead on 3 of 3 paired seeds)')
  # Fewer than three paired seeds decide nothing (a clean split of two is one chance in six).
  assert study.ordering({'a': {0: 0.3, 1: 0.31, 2: 0.1}, 'b': {0: 0.2, 1: 0.21}}, 'a', 'b') == (
      'undecided (a ahead on 2 of 2 paired seeds; a verdict needs 3)')
  run = {'model.variant': 'postln', 'train.num_steps': 400, 'seed': 0}
  _write_run(tmp_path / 'seed=0', 400, 0.2, 0.08)  # named when only the seed varied
  (tmp_path / 'seed=0' / RunDir.OVERRIDES).write_text(json.dumps(run))
  runs = [run, dict(run, **{'model.variant': 'preln'})]
  names = study.folders(str(tmp_path), runs)
  assert names == ['seed=0', 'model.variant=preln,seed=0']
  assert study.finished(str(tmp_path / names[0]), runs[0])
  other = dict(run, **{'train.num_steps': 1000})
  assert not study.finished(str(tmp_path / names[0]), other)  # done, but not this run
  # A run of another model size (which only the config file's argument names) is not
  # this study's either.
  (tmp_path / names[0] / RunDir.COMMAND).write_text(json.dumps(sweep.program_and_config(
      'train.py', 'configs/pretrain.py:postln,small')))
  tiny = study.pretraining_config(argparse.Namespace(size='tiny'))
  assert not study.finished(str(tmp_path / names[0]), runs[0], tiny)
  assert study.finished(str(tmp_path / names[0]), runs[0],
                        study.pretraining_config(argparse.Namespace(size='small')))


def _write_run(workdir, steps, accuracy, baseline, rate=10.0, pairs=True):
  """A finished pretraining run's metrics.jsonl (train records with steps/s, a final eval;
  `pairs`: with the NSP head's metrics)."""
  workdir.mkdir(parents=True, exist_ok=True)
  with open(workdir / 'metrics.jsonl', 'w') as f:
    for step in range(steps // 4, steps + 1, steps // 4):
      f.write(json.dumps({'step': step, 'split': 'train', 'loss': 7.0,
                          'steps_per_sec': 1.0 if step == steps // 4 else rate}) + '\n')
    f.write(json.dumps({'step': steps, 'split': 'eval', 'mlm_accuracy': accuracy,
                        'mlm_majority_accuracy': baseline, 'mlm_loss': 6.0,
                        **({'nsp_accuracy': 0.6, 'nsp_majority_accuracy': 0.5} if pairs
                           else {})}) + '\n')
  (workdir / RunDir.DONE).write_text('')


def test_study_budget_search_stops_at_the_cheapest_passing_budget(tmp_path, capsys,
                                                                  monkeypatch):
  import study  # pylint: disable=g-import-not-at-top
  assert study.main(['budget', '--root', str(tmp_path), '--print_only', '--budget_layers',
                     '2,4', '--budget_steps', '500,1000']) == 0
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith('python train.py')]
  order = [(re.search(r'num_layers=(\d+)', l).group(1), re.search(r'num_steps=(\d+)',
                                                                   l).group(1)) for l in lines]
  assert order == [('2', '500'), ('4', '500'), ('2', '1000'), ('4', '1000')]  # cost, steps
  with pytest.raises(ValueError, match='--budget_layers=4,x: give comma-separated positive whole'):
    study.main(['budget', '--root', str(tmp_path), '--print_only', '--budget_layers', '4,x'])
  ran = []

  def fake_run_all(runs, *, root, always, **_):  # accuracy grows with layers x steps
    name = sweep.folder_names(root, runs, always)[0]
    layers, steps = runs[0]['model.num_layers'], runs[0]['train.num_steps']
    ran.append((layers, steps))
    _write_run(tmp_path / 'budget' / name, steps, 0.05 + layers * steps / 40000, 0.07)
    (tmp_path / 'budget' / name / RunDir.OVERRIDES).write_text(json.dumps(runs[0]))
    return {name: 0}

  monkeypatch.setattr(study.sweep, 'run_all', fake_run_all)
  args = ['budget', '--root', str(tmp_path), '--budget_layers', '2,4', '--budget_steps',
          '500,1000', '--corpus', 'embedded']
  assert study.main(args) == 0  # 2x500: 0.075, 4x500: 0.1, 2x1000: 0.1, 4x1000: 0.15, ...
  assert ran == [(2, 500), (4, 500), (2, 1000), (4, 1000)]
  chosen = json.loads((tmp_path / 'budget.json').read_text())
  assert (chosen['layers'], chosen['steps']) == (4, 1000)
  assert chosen['evidence']['ratio'] == pytest.approx(0.15 / 0.07)
  assert '| 4 | 64 | 1000 | postln | 0.1500 | 0.0700 | 2.14 **chosen** |' in (
      tmp_path / 'budget' / 'budget.md').read_text()
  # compare takes its budget from there; a flag wins. The budget holds for the corpus it
  # was found on: compare on another is refused.
  with pytest.raises(ValueError, match=r'budget.json was searched with --corpus embedded '
                                       r'\(given era\)'):
    study.main(['--root', str(tmp_path), '--print_only'])
  # ... and for BERT's objective, also a budget recorded before --objective existed.
  old = {k: v for k, v in chosen.items() if k != 'objective'}
  (tmp_path / 'budget.json').write_text(json.dumps(old))
  with pytest.raises(ValueError, match=r'--objective mlm_nsp \(given mlm\)'):
    study.main(['--root', str(tmp_path), '--print_only', '--corpus', 'embedded',
                '--objective', 'mlm'])
  chosen['corpus'] = 'era'  # (as if found on the era corpus: the launches read R/era)
  (tmp_path / 'budget.json').write_text(json.dumps(chosen))
  capsys.readouterr()
  assert study.main(['--root', str(tmp_path), '--print_only']) == 0
  out = capsys.readouterr().out
  assert f"sotu.write_era_task({str(tmp_path / 'era')!r})" in out  # the launches read it
  lines = [l for l in out.splitlines() if l.startswith('python train.py')]
  assert len(lines) == 15 and all('--config.train.num_steps=1000' in l and
                                  '--config.model.num_layers=4' in l for l in lines)
  # Another budget into the root those runs were printed for: folders of its own, named by
  # the steps that differ, never the first runs' (resumed in place).
  assert study.main(['--root', str(tmp_path), '--print_only', '--steps', '300']) == 0
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith('python train.py')]
  assert len(lines) == 15 and all(',train.num_steps=300,seed=' in l and
                                  '--config.train.num_steps=300' in l for l in lines)
  # Nothing reaches the target: exit 1, no budget written.
  (tmp_path / 'budget.json').unlink()
  assert study.main(args + ['--target_ratio', '5']) == 1
  assert not (tmp_path / 'budget.json').exists()
  # A candidate that diverges: running it again would repeat it, and the study says so.

  def diverging_run_all(runs, *, root, always, **_):
    name = sweep.folder_names(root, runs, always)[0]
    os.makedirs(os.path.join(root, name))
    with open(os.path.join(root, name, RunDir.LOG), 'w') as f:
      f.write('loss became nan at step 7\n')
    return {name: 1}

  monkeypatch.setattr(study.sweep, 'run_all', diverging_run_all)
  capsys.readouterr()
  assert study.main(args + ['--root', str(tmp_path / 'other')]) == 1
  out = capsys.readouterr().out
  assert 'diverged (its loss became nan/inf' in out and 'lower --learning_rate' in out


def test_study_claims_orderings_equal_time_and_finetune_report(tmp_path):
  import study  # pylint: disable=g-import-not-at-top
  args = argparse.Namespace(root=str(tmp_path), variants='postln,preln,realformer', seeds=3,
                            steps=400, layers=4, seq_len=64, batch=32, learning_rate=2e-3,
                            corpus='embedded', eval_steps=16, eval_fraction=0.03, minutes=0,
                            print_only=False, reference='postln', ft_learning_rate=3e-4,
                            ft_batch=16, ft_epochs=10, size='tiny')
  runs, names, root = study.compare_runs(args)
  accuracy = {'postln': [0.20, 0.21, 0.22], 'preln': [0.19, 0.215, 0.23],
              'realformer': [0.23, 0.24, 0.25]}
  for run, name in zip(runs, names):
    _write_run(tmp_path / 'compare' / name, 400, accuracy[run['model.variant']][run['seed']],
               0.08, rate=8.0 if run['model.variant'] == 'postln' else 10.0)
  report = study.claims_report(args, runs, names, root, 0.0)
  assert '| realformer | 3 | 400 | 0.2400 (0.2300-0.2500) | 3.00 (2.88-3.12) |' in report
  assert '- realformer > postln: held (realformer ahead on 3 of 3 paired seeds)' in report
  assert '- postln > preln: undecided (postln ahead on 1 of 3 paired seeds)' in report
  assert 'objective mlm_nsp; 4 layers' in report and '| NSP accuracy | steps/s |' in report
  assert "Majority baseline on the held-out batches: 0.0800, NSP's 0.5000 (per seed" in report
  # RoBERTa's MLM alone logs no pair task: no such column (it raised a KeyError).
  mlm = argparse.Namespace(**dict(vars(args), objective='mlm', root=str(tmp_path / 'mlm')))
  mlm_runs, mlm_names, mlm_root = study.compare_runs(mlm)
  for run, name in zip(mlm_runs, mlm_names):
    _write_run(tmp_path / 'mlm' / 'compare' / name, 400, 0.2, 0.08, pairs=False)
  mlm_report = study.claims_report(mlm, mlm_runs, mlm_names, mlm_root, 0.0)
  assert 'objective mlm; 4 layers' in mlm_report and 'NSP' not in mlm_report
  assert '| held-out MLM loss | steps/s |' in mlm_report
  # Equal time: postln's median steady rate is 8 steps/s, so 400 steps are 50 s.
  assert study.equal_minutes(args) == pytest.approx(round(50 / 60, 2))
  assert study.ordering({'a': {0: 0.1, 1: 0.1, 2: 0.1}, 'b': {0: 0.2, 1: 0.2, 2: 0.2}},
                        'a', 'b').startswith('reversed')
  scores = {'pretrained': {'postln': {0: 0.80, 1: 0.82}, 'realformer': {0: 0.84, 1: 0.85}},
            'scratch': {'postln': {0: 0.70, 1: 0.74}, 'realformer': {0: 0.71, 1: None}}}
  report = study.finetune_report(argparse.Namespace(**dict(vars(args),
                                                           variants='postln,realformer')),
                                 scores)
  assert '| postln | 2 | 0.8100 (0.8000-0.8200) | 0.7200 (0.7000-0.7400) | ' \
         '0.0900 (0.0800-0.1000) | - |' in report
  assert '| realformer | 2 | 0.8450 (0.8400-0.8500) | 0.7100 | 0.1300 | - |' in report
  assert ('- realformer > postln: undecided (realformer ahead on 2 of 2 paired seeds; a '
          'verdict needs 3)') in report
  assert '- postln: pretrained > random init: undecided (pretrained ahead on 2 of 2' in report
  assert report.startswith('era task dev accuracy (396 sentences), lr ')  # (no baseline known)
  report = study.finetune_report(argparse.Namespace(**dict(vars(args),
                                                           variants='postln,realformer')),
                                 dict(scores, majority=0.505))
  assert report.startswith('era task dev accuracy (396 sentences; always predicting the '
                           'majority label: 0.5050), lr ')
  (tmp_path / 'ft').mkdir()  # read from a run's results.json; None where not recorded
  (tmp_path / 'ft' / 'results.json').write_text(json.dumps(
      {'headline': 0.8, 'dev': {'sst2': {'accuracy': 0.8, 'majority_accuracy': 0.505,
                                         'f1': 0.8, 'majority_f1': 0.671}}}))
  from realformer.tools import finetune_grid  # pylint: disable=g-import-not-at-top
  assert finetune_grid.dev_majority(str(tmp_path / 'ft')) == 0.505
  assert finetune_grid.dev_majority(str(tmp_path / 'ft'), 'sst2', 'f1') == 0.671
  assert finetune_grid.dev_majority(str(tmp_path / 'ft'), 'sst2', 'mcc') is None
  assert finetune_grid.dev_majority(str(tmp_path / 'ft'), 'sst2') == 0.505
  assert finetune_grid.dev_majority(str(tmp_path / 'ft'), 'tsv/sst2') == 0.505
  (tmp_path / 'ft' / 'results.json').write_text(json.dumps({'headline': 0.8}))
  assert finetune_grid.dev_majority(str(tmp_path / 'ft')) is None


def test_study_attention_over_seeds_tests_the_claimed_orderings(tmp_path, monkeypatch):
  import study  # pylint: disable=g-import-not-at-top
  runs = [{'model.variant': v, 'seed': s} for v in ('postln', 'preln', 'realformer')
          for s in (0, 1)]
  names = sweep.run_names(runs)
  entropy = {'postln': (3.0, 3.2), 'preln': (2.5, 2.9), 'realformer': (2.6, 2.7)}

  def fake_analyze(workdir):
    run = runs[names.index(os.path.basename(workdir))]
    e = entropy[run['model.variant']][run['seed']]
    return {'entropy_mean': [e + 0.1, e - 0.1], 'js_adjacent': [e / 100],
            'js_all_pairs': [[0.0, e / 100], [e / 100, 0.0]]}

  monkeypatch.setattr(study.analysis, 'analyze_run', fake_analyze)
  table = study.attention_over_seeds(str(tmp_path), runs, names, dict.fromkeys(names, 0))
  assert '| realformer | 2 | 2.6500 (2.6000-2.7000) | 2.5500 (2.5000-2.6000) |' in table
  assert ('- entropy: realformer < postln: undecided (realformer below on 2 of 2 paired seeds; '
          'a verdict needs 3)') in table
  assert '- entropy: realformer < preln: undecided (realformer below on 1 of 2' in table
  stored = json.loads((tmp_path / 'attention_seeds.json').read_text())['preln']['1']
  assert stored['js_adjacent'] == stored['js_all_pairs'] == pytest.approx(0.029)
  assert '- JS over all layer pairs: realformer < postln: undecided (realformer below on 2' in table


def test_sweep_values_are_checked_against_their_fields_as_the_command_line_reads_them():
  config = 'configs/pretrain.py:postln,tiny'
  for fine in ({'model.scan_layers': 0}, {'model.scan_layers': True},
               {'model.variant': 'synth_dense_vanilla'}, {'optimizer.learning_rate': 3},
               {'train.num_steps': 10}):
    sweep.check_keys(config, [fine])
  for bad in ({'train.num_steps': 'abc'}, {'train.num_steps': 2.5}, {'train.num_steps': True},
              {'model.scan_layers': 2}, {'model.scan_layers': 'yes'}):
    with pytest.raises(ValueError, match='does not fit the field'):
      sweep.check_keys(config, [{'model.variant': 'postln'}, bad])
  # A text field's value as train.py would check it, before the first run starts.
  with pytest.raises(ValueError, match="the run with model.variant=foo: model.variant='foo' is unknown"):
    sweep.check_keys(config, [{'model.variant': 'postln'}, {'model.variant': 'foo'}])
  # Every run's whole config as train.py checks it: step counts, the warm-up, the masking
  # (a negative num_steps used to pass as 'finished': its last step -1 is past -5).
  for bad, message in (({'train.num_steps': -5}, 'train.num_steps=-5: give a positive'),
                       ({'data.masked_lm_prob': 2}, 'masked_lm_prob=2.0 must be in'),
                       ({'train.num_steps': 5, 'optimizer.warmup_steps': 10},
                        'warmup_steps=10 must lie'),
                       ({'train.grad_accum_steps': 3},
                        'grad_accum_steps=3 does not divide train.batch_size=')):
    with pytest.raises(ValueError, match=f'the run with .*{message}.*fix the --sweep/--set'):
      sweep.check_keys(config, [{'model.variant': 'postln'}, bad])


def test_a_config_or_sweep_file_that_fails_is_one_line_naming_file_and_line(commands, tmp_path):
  broken = tmp_path / 'broken.py'
  broken.write_text('def get_config(:\n  pass\n')
  raising = tmp_path / 'raising.py'
  raising.write_text('def get_config():\n  return 1 / 0\n')
  hyper = tmp_path / 'hyper.py'
  hyper.write_text('def get_hyper(h):\n  return h.sweep("seed", undefined)\n')
  for args, message in (
      (['--config', str(broken)], rf'{broken} failed \({broken}, line 1\): SyntaxError'),
      (['--config', str(raising)], r'line 2\): ZeroDivisionError: division by zero'),
      (['--sweep_file', str(hyper)], r'line 2\): NameError'),
      (['--sweep_file', str(tmp_path / 'none.py')], 'not found; give a Python file'),
      (['--config', 'configs/'], 'configs/ is a folder; give a config file')):
    proc = commands.run(['sweep.py', 'print', '--root', str(tmp_path / 'r'), *args])
    assert proc.returncode == 1, proc.stderr
    assert re.fullmatch(f'error: .*{message}.*\n', proc.stderr), proc.stderr


@pytest.mark.parametrize('text', ['{"seed": 0', '[0]'])
def test_a_damaged_record_of_a_run_is_one_line_naming_it_wherever_it_is_read(tmp_path, text):
  """A run's overrides.json that is not a JSON object (cut short, edited by hand): the same
  line from the sweep's folder naming, its look at a folder, and its summary."""
  root = tmp_path / 'sweep'
  (root / 'seed=0').mkdir(parents=True)
  (root / 'seed=0' / RunDir.OVERRIDES).write_text(text)
  match = (r'seed=0/overrides.json is not readable JSON \(.*\); restore it \(the run\'s '
           r'--config.<key>=<value> overrides\) or delete its folder')
  for read in (lambda: sweep.folder_names(str(root), [{'seed': 0}]),
               lambda: sweep.other_run(str(root / 'seed=0'), {'seed': 0}),
               lambda: sweep.collect(str(root))):
    with pytest.raises(ValueError, match=match):
      read()


def test_a_run_lock_admits_one_sweep_process_and_dies_with_its_holder(tmp_path):
  """The LOCK of a run is an flock held by the sweep process running it: another process
  is refused while it lives and takes it once it is gone (also killed between creating the
  file and writing its record: an empty LOCK); release removes it. A record of another
  host is respected; a file system without flocks is refused."""
  workdir = str(tmp_path / 'run')
  os.makedirs(workdir)
  holder = subprocess.Popen(
      [sys.executable, '-c', 'import sys, time\nfrom realformer.tools import sweep\n'
       f'assert sweep.acquire({workdir!r})\nprint("held", flush=True)\ntime.sleep(60)'],
      cwd=REPO, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == 'held'
    assert not sweep.acquire(workdir)
  finally:
    holder.kill()
    holder.wait()
  assert sweep.acquire(workdir)  # its process is gone, and its flock with it
  with open(os.path.join(workdir, RunDir.SWEEP_LOCK)) as f:
    assert f.read() == f'{socket.gethostname()} {os.getpid()}'
  sweep.release(workdir)
  assert not os.path.exists(os.path.join(workdir, RunDir.SWEEP_LOCK))
  open(os.path.join(workdir, RunDir.SWEEP_LOCK), 'w').close()  # a holder killed before its record
  assert sweep.acquire(workdir)
  sweep.release(workdir)
  # A record of another host's (a folder shared between hosts, which may not carry their
  # flocks) is respected, and the skip says which file to remove once that sweep is gone.
  lock = os.path.join(workdir, RunDir.SWEEP_LOCK)
  with open(lock, 'w') as f:
    f.write('another-host 12')
  assert not sweep.acquire(workdir)
  assert sweep.held_by(workdir) == (f'a sweep process on another-host is running it (remove '
                                    f"{lock} if that host's sweep is gone)")
  os.remove(lock)
  # A file system without flocks: one line, not every run skipped as held elsewhere.
  def no_locks(*_):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
  with mock.patch.object(storage.fcntl, 'flock', no_locks), pytest.raises(
      ValueError, match=f'{workdir} is on a file system that cannot lock files .*use a --root '
                        'on a local disk, or a gs:// bucket'):
    sweep.acquire(workdir)


def test_a_float_fields_whole_number_is_one_run_however_it_is_written(tmp_path):
  """'0' and '0.0' of a float field are one value (a float), on the command line and in a
  sweep file; a folder that recorded either is the same run's."""
  types = sweep.field_types('configs/pretrain.py:postln,tiny')
  with pytest.raises(ValueError, match='repeats a run'):
    sweep.expand(['optimizer.weight_decay=0,0.0'], types=types)
  (run,) = sweep.expand([], ['optimizer.weight_decay=0', 'train.num_steps=3'], types=types)
  assert run['optimizer.weight_decay'] == 0.0 and isinstance(run['optimizer.weight_decay'], float)
  assert run['train.num_steps'] == 3 and isinstance(run['train.num_steps'], int)
  sweep_file = tmp_path / 'hyper.py'
  sweep_file.write_text("def get_hyper(h):\n  return h.sweep('optimizer.weight_decay', [0, 1])\n")
  assert [r['optimizer.weight_decay'] for r in sweep.expand(sweep_file=str(sweep_file),
                                                              types=types)] == [0.0, 1.0]
  (tmp_path / 'old').mkdir()
  (tmp_path / 'old' / RunDir.OVERRIDES).write_text(json.dumps(
      {'optimizer.weight_decay': 0, 'train.num_steps': 3, 'seed': 0}))
  assert sweep.other_run(str(tmp_path / 'old'), run) == []
  assert sweep.folder_names(str(tmp_path), [run]) == ['old']


def test_h_zip_of_two_lists_of_one_key_is_an_error():
  h = sweep.Hyper
  with pytest.raises(ValueError, match='optimizer.learning_rate is set by two of the lists '
                                       'h.zip pairs'):
    h.zip(h.sweep('optimizer.learning_rate', [1e-4, 2e-4]),
          h.sweep('optimizer.learning_rate', [3e-4, 4e-4]))


def test_a_run_finished_or_taken_between_the_look_and_the_lock_is_not_started(
    tmp_path, monkeypatch):
  """run_all looks again once it holds a run's lock: another sweep process may have
  finished the run, or started one of other overrides in its folder, meanwhile."""
  program = tmp_path / 'fake_train.py'
  program.write_text(FAKE_PROGRAM)
  root = tmp_path / 'sweep'
  runs = sweep.expand(['optimizer.learning_rate=1e-4,2e-4'], ['train.num_steps=2'])
  names = sweep.run_names(runs)
  acquire = sweep.acquire

  def meanwhile(workdir):  # what another sweep did between run_all's look and its lock
    taken = acquire(workdir)
    if workdir.endswith(names[0]):
      (root / names[0] / RunDir.DONE).write_text('')
    else:
      (root / names[1] / RunDir.OVERRIDES).write_text(json.dumps(dict(runs[1], seed=7)))
    return taken
  monkeypatch.setattr(sweep, 'acquire', meanwhile)
  codes = sweep.run_all(runs, root=str(root), program=str(program), config='cfg',
                        echo=lambda _: None)
  assert codes == {names[0]: 0, names[1]: sweep.OTHER_RUN}
  for name in names:
    assert not (root / name / 'calls.txt').exists()  # neither was started
    assert not (root / name / RunDir.SWEEP_LOCK).exists()  # and both locks were let go


def test_study_reports_of_nothing_are_one_line_errors(tmp_path):
  """--report_only where no run of the part finished (a wrong --root, or options other than
  the runs'), and fine-tuning where nothing is pretrained yet: one line, not a table of
  '(not run)' that exits 0."""
  import study  # pylint: disable=g-import-not-at-top
  for part, said in (('compare', 'no finished run under'),
                     ('finetune', 'no finished fine-tuning run under'),
                     ('stability', 'no run of this grid under')):
    with pytest.raises(ValueError, match=said):
      study.main([part, '--root', str(tmp_path), '--report_only'])
  with pytest.raises(ValueError, match=f'no run under {tmp_path} is pretrained yet: run '
                     'study.py compare first'):
    study.main(['finetune', '--root', str(tmp_path), '--seeds', '1'])


WAITING_PROGRAM = textwrap.dedent('''
    """Stands in for train.py: 'error' and 'nan' fail as train.py does; 'wait' runs until
    SIGTERM, which it answers as train.py does (saved, exit 75)."""
    import os, signal, sys, time
    args = dict(a.split('=', 1) for a in sys.argv[1:] if a.startswith('--config.'))
    workdir = sys.argv[sys.argv.index('--workdir') + 1]
    mode = args['--config.mode']
    if mode == 'error':
      print('error: data.sources=nowhere matches no file; check the path', file=sys.stderr)
      sys.exit(1)
    if mode == 'nan':
      print('error: the loss became nan at step 3; lower optimizer.learning_rate', flush=True)
      sys.exit(1)
    if mode == 'ok':
      sys.exit(0)
    def saved(*_):
      open(os.path.join(workdir, 'saved'), 'a').write('saved\\n')
      print('saved at the stop', flush=True)  # (its log's last line)
      sys.exit(75)
    signal.signal(signal.SIGTERM, saved)
    open(os.path.join(workdir, 'started'), 'a').write('started\\n')
    time.sleep(60)
''')


def _wait_for(path, lines=1, seconds=30.0):
  import time  # pylint: disable=g-import-not-at-top
  end = time.time() + seconds
  while time.time() < end:
    if os.path.exists(path) and open(path).read().count('\n') >= lines:
      return
    time.sleep(0.05)
  raise AssertionError(f'{path} did not reach {lines} lines')


def test_a_stopped_sweep_stops_its_run_and_a_failed_run_says_why(tmp_path, capsys):
  """SIGTERM (or Ctrl-C) to a sweep reaches the run it is running, which saves; no other run
  starts and the sweep exits 75. A sweep killed outright takes its run with it (the run's
  parent-death signal). A failed run's own error line is shown; one whose loss became nan
  is marked diverged and not run again; one that failed before its first checkpoint gives
  its folder to the corrected settings."""
  program = tmp_path / 'waiting.py'
  program.write_text(WAITING_PROGRAM)
  root = tmp_path / 'sweep'
  args = ['run', '--root', str(root), '--program', str(program), '--config', 'cfg']
  assert sweep_cli.main(args + ['--sweep', 'mode=error,nan']) == 1
  out = capsys.readouterr().out
  assert ('exit 1: error: data.sources=nowhere matches no file; check the path; see '
          f'{root}/mode=error,seed=0/log.txt') in out
  assert ('0/2 runs finished; failed: mode=error,seed=0; diverged (nan/inf; not run again): '
          'mode=nan,seed=0') in out
  assert (root / 'mode=nan,seed=0' / RunDir.DIVERGED).exists()
  assert sweep_cli.main(args + ['--sweep', 'mode=nan']) == 0  # left out: not run again
  out = capsys.readouterr().out
  assert 'mode=nan,seed=0: diverged (nan/inf) before, not run again' in out
  assert '0/1 runs finished; diverged (nan/inf; not run again): mode=nan,seed=0' in out
  # summarize counts it apart from the unfinished runs (which a rerun would go on with)
  header, table = sweep.summarize(sweep.collect(str(root), ['eval/loss']), ['eval/loss'])
  assert header[-2:] == ['unfinished', 'diverged']
  assert sorted(row[:1] + row[-2:] for row in table) == [['error', 1, 0], ['nan', 0, 1]]
  # A run that failed before its first checkpoint holds nothing: the corrected settings
  # take its folder (the names leave out --set values); a finished one keeps its own.
  fixed = ['run', '--root', str(tmp_path / 'fixed'), '--program', str(program), '--config',
           'cfg', '--set']
  assert sweep_cli.main(fixed + ['mode=error']) == 1
  assert sweep_cli.main(fixed + ['mode=ok']) == 0
  assert capsys.readouterr().out.count(  # (said once: looked at before and after its lock)
      'takes the folder of a run that stopped before its first checkpoint') == 1
  assert json.loads((tmp_path / 'fixed' / 'seed=0' / RunDir.OVERRIDES).read_text())[
      'mode'] == 'ok'
  assert sweep_cli.main(fixed + ['mode=error']) == 1
  assert sorted(os.listdir(tmp_path / 'fixed')) == ['mode=error,seed=0', 'seed=0']
  command = [sys.executable, 'sweep.py'] + args + ['--sweep', 'mode=wait,other']
  first = root / 'mode=wait,seed=0'
  proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  _wait_for(first / 'started')
  proc.send_signal(subprocess.signal.SIGTERM)
  out = proc.communicate(timeout=60)[0]
  assert proc.returncode == 75, out
  assert 'stopped before its end (exit 75); run again to resume' in out
  # A run killed by a signal (SIGKILL; SIGTERM while it started, before its handler was
  # set): said as such, with the checkpoint it resumes from.
  why = sweep._why_failed  # pylint: disable=protected-access
  assert why(-15, str(tmp_path / 'nothing')) == (
      'stopped by SIGTERM (exit -15), before its first checkpoint; run again to resume')
  (tmp_path / 'killed' / 'checkpoints' / '20').mkdir(parents=True)
  (tmp_path / 'killed' / 'checkpoints' / '20' / 'commit_success.txt').write_text('')
  assert why(-9, str(tmp_path / 'killed')) == (
      'stopped by SIGKILL (exit -9), its last checkpoint step 20; run again to resume')
  assert 'not finished: stopped by a signal after mode=wait,seed=0' in out
  assert (first / 'saved').read_text() == 'saved\n'
  assert not (root / 'mode=other,seed=0').exists()  # never started
  proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  _wait_for(first / 'started', lines=2)
  proc.kill()
  proc.wait()
  _wait_for(first / 'saved', lines=2)  # the run went with its sweep, saving
  _wait_for(first / RunDir.LOG, lines=2)  # and its log kept the lines it wrote after
  assert (first / RunDir.LOG).read_text().count('saved at the stop') == 2
