"""benchmarks/device_suite.py --smoke in the project's environment, which pins the GPU image's
versions (benchmarks/device_image.txt): the train-step part (Post-LN, its flash-kernel contender
and the HF peer) and the fine-tuning race run at tiny sizes, fill suite.json and suite.md, and
import nothing the image lacks but the wheels that travel to it."""

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time

import pytest

from tests.conftest import cpu_xla_flags
from tests.test_interop import needs_minilm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Written into a folder on the PYTHONPATH of the suite's processes: each one lists, as it
# exits, the files of the modules it imported.
_IMPORT_AUDIT = """
import atexit, os, sys
def _write_imported_files():
  with open(os.path.join(os.environ['IMPORT_AUDIT_DIR'], f'{os.getpid()}.txt'), 'w') as f:
    f.write('\\n'.join(getattr(m, '__file__', None) or '' for m in list(sys.modules.values())))
atexit.register(_write_imported_files)
"""


def _name(distribution: str) -> str:
  return re.sub(r'[-_.]+', '-', distribution).lower()


def _image() -> dict[str, str]:
  """benchmarks/device_image.txt: the image's distributions -> their version ('' if unread)."""
  with open(os.path.join(REPO, 'benchmarks', 'device_image.txt'), encoding='utf-8') as f:
    lines = [line.split('#')[0].strip() for line in f]
  return {_name(n): v for n, _, v in (line.partition('==') for line in lines if line)}


def _distributions_of(files: set[str]) -> set[str]:
  """The installed distributions that hold these module files (the standard library's and
  the repository's own hold none): by the top-level name under site-packages, and where
  several distributions share it (a namespace package such as google), by their files."""
  sites = {os.path.realpath(sysconfig.get_paths()[k]) for k in ('purelib', 'platlib')}
  tops = importlib.metadata.packages_distributions()
  owners, shared = set(), {}
  for f in map(os.path.realpath, files):
    site = next((d for d in sites if f.startswith(d + os.sep)), None)
    if site is None:
      continue
    names = tops.get(os.path.relpath(f, site).split(os.sep)[0].split('.')[0], [])
    if len(names) == 1:
      owners.add(_name(names[0]))
    elif names:
      shared.setdefault(tuple(sorted(set(names))), set()).add(f)
  for names, held in shared.items():
    for name in names:
      dist = importlib.metadata.distribution(name)
      if held & {os.path.realpath(dist.locate_file(p)) for p in dist.files or ()}:
        owners.add(_name(name))
  return owners


def test_the_pins_are_the_gpu_images_versions():
  pins = {}
  with open(os.path.join(REPO, 'requirements.txt'), encoding='utf-8') as f:
    for line in f:
      name, _, version = line.split('#')[0].strip().partition('==')
      if version:
        pins[_name(name)] = version
  image = _image()
  shared = {n for n in pins if image.get(n)}
  assert {'jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'numpy'} <= shared
  assert {n: pins[n] for n in shared} == {n: image[n] for n in shared}


@needs_minilm
def test_smoke_measures_the_contenders_and_the_finetuning_race(tmp_path):
  audit = tmp_path / 'audit'
  (audit / 'path').mkdir(parents=True)
  (audit / 'path' / 'sitecustomize.py').write_text(_IMPORT_AUDIT)
  env = dict(os.environ, XLA_FLAGS=cpu_xla_flags(1),  # one device, as on the lent machine
             IMPORT_AUDIT_DIR=str(audit),
             PYTHONPATH=os.pathsep.join([str(audit / 'path')] +
                                        os.environ.get('PYTHONPATH', '').split(os.pathsep)))
  env.pop('REALFORMER_MINILM_DIR', None)
  proc = subprocess.run(
      [sys.executable, 'benchmarks/device_suite.py', '--smoke', '--parts',
       'env,start,step128,finetune',
       '--variants', 'postln', '--out', str(tmp_path / 'out'),
       '--scratch', str(tmp_path / 'scratch')],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(tmp_path / 'out' / 'suite.json') as f:
    suite = json.load(f)
  assert {part: r['status'] for part, r in suite.items()} == {
      'env': 'ok', 'start': 'ok', 'step128': 'ok', 'finetune': 'ok'}
  assert suite['env']['data']['matmul_bf16_flops'] > 0 and suite['env']['data']['versions']
  starts = {r['arm']: r for r in suite['start']['data']['rows']}
  assert list(starts) == ['cold', 'warm', 'resume']
  for r in starts.values():
    assert 0 < r['compile'] < r['first_step'] < r['whole']
  # (a resume restores its state: it loads the step, not the init)
  assert starts['cold']['loaded'] == 0 < starts['resume']['loaded'] <= starts['warm']['loaded']
  rows = suite['step128']['data']['rows']
  assert [r['contender'] for r in rows] == [
      'ours postln', 'HF BertForPreTraining (torch, autocast bfloat16)',
      'ours postln [fused_attention=flash, dropout in the kernel]']
  for r in rows:
    assert r['step_s'] > 0 and r['tokens_per_s'] == 4 * 32 / r['step_s']
    assert isinstance(r['timed_beside_compiles'], list)
    if r['contender'].startswith('ours'):  # where its step's time goes, from a trace
      assert r['kernels']['device_ms_per_step'] > 0 and len(r['kernels']['kernels']) == 10
    else:
      assert r['kernels'] is None
  arms = {r['arm']: r for r in suite['finetune']['data']['rows']}
  assert list(arms) == ['hf', 'ours', 'ours_warm', 'hf_warm']
  for r in arms.values():
    assert len(r['epoch_seconds']) == 1 and 0 <= r['accuracy'] <= 1 and r['wall_s'] > 0
  with open(tmp_path / 'out' / 'suite.md') as f:
    md = f.read()
  assert '| ours postln [fused_attention=flash, dropout in the kernel] |' in md and '| hf |' in md
  assert '| throughput vs HF |' in md and '| 1.00x |' in md  # HF's own row
  assert '| cache | the first step alone s |' in md and '| resume |' in md
  assert '- the race, cold (whole process, HF / ours): ' in md
  assert '- the race, warm (whole process, HF / ours): ' in md
  assert "Where ours postln [fused_attention=flash, dropout in the kernel]'s step goes (" in md
  # What the image would lack: every process of the suite (the parts, the contenders, the
  # fine-tuning runs, the HF peer) imported only the image's distributions and the carried ones.
  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import device_suite  # pylint: disable=g-import-not-at-top
  reports = list(audit.glob('*.txt'))
  assert len(reports) >= 4
  files = {f for r in reports for f in r.read_text().splitlines() if f.endswith('.py')}
  imported = _distributions_of(files)
  assert {'jax', 'flax', 'torch', 'transformers', 'ml-collections'} <= imported
  # (torch imports dill and optree where they are installed, as here for datasets and keras,
  # and goes without them on the image)
  allowed = set(_image()) | {_name(n) for n in device_suite.CARRIED_WHEELS} | {'dill', 'optree'}
  assert imported - allowed == set()


def test_an_unknown_part_or_variant_is_refused_in_one_line():
  for argv, expected in (
      (['--parts', 'step1024'], '--parts step1024: unknown; choose from env, start, step512, '
                                'step128, finetune'),
      (['--variants', 'postln,realformr'], '--variants realformr: unknown; choose from postln, '
                                           'realformer, preln, synth_random_vanilla')):
    proc = subprocess.run([sys.executable, 'benchmarks/device_suite.py'] + argv,
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == expected


def test_extras_race_hf_with_its_length_grouped_sampler_and_ours_scanned_last():
  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import device_suite  # pylint: disable=g-import-not-at-top
  assert device_suite.race_arms(True, False) == ['hf', 'ours', 'ours_warm', 'hf_warm']
  assert device_suite.race_arms(True, True) == ['hf', 'ours', 'ours_warm', 'hf_warm',
                                                'hf_grouped', 'ours_scanned']
  # no torch: no HF arm
  assert device_suite.race_arms(False, True) == ['ours', 'ours_warm', 'ours_scanned']
  walls = dict(hf=15.0, ours=12.0, ours_warm=6.0, hf_warm=15.0, hf_grouped=9.0,
               ours_scanned=10.0)
  md = device_suite.markdown({'finetune': dict(status='ok', seconds=60, cap_s=110, data=dict(
      rows=[dict(arm=arm, epoch_seconds=[1.0], wall_s=w, accuracy=0.9)
            for arm, w in walls.items()]))})
  assert '| hf_grouped | 1.00 | 9.0 | 0.900 |' in md
  for name, ratio in (('cold', '1.25'), ('warm', '2.50'), ('cold, HF length-grouped', '0.75'),
                      ('warm, HF length-grouped', '1.50'),
                      ('cold, our layers scanned', '1.50')):
    assert f'- the race, {name} (whole process, HF / ours): {ratio}x' in md
  # A step row timed while others still compiled says so (the smoke's rows say none).
  row = dict(contender='ours postln', step_s=0.1, tokens_per_s=1.0, tflops=1.0, mfu=None,
             compile_s=3.0, memory_gib=None, kernels=None, timed_beside_compiles=[2, 3])
  md = device_suite.markdown({'step128': dict(status='ok', seconds=3, cap_s=130, data=dict(
      size='base', seq_len=128, batch=4, dtype='bfloat16', timing='t', compiled_at_once=6,
      rows=[row]))})
  assert 'up to 6 contenders compiled at once' in md
  assert 'may read slow): ours postln (contenders 2, 3).' in md


def test_each_variant_is_timed_fused_and_plain_at_512_and_variants_narrow_it():
  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import device_suite  # pylint: disable=g-import-not-at-top
  names = lambda entries: [e[1] + (f' [{e[3]}]' if e[3] else '') if e[0] == 'ours' else 'HF'
                           for e in entries]
  plain = "fused_attention=off, the plain path's dropout"
  everything = names(device_suite._contenders('step512', 'gpu'))
  # timed in this order: what the goals read first (a part cut short loses the last); all
  # of them compile at once on the GPU's host (16 cores), so nine, not more
  assert everything == ['postln', 'HF', f'postln [{plain}]', 'realformer [flash kernel]',
                        'realformer [bf16 carry, flash kernel]',
                        'synth_random_vanilla [flash kernel]', f'realformer [{plain}]',
                        f'synth_random_vanilla [{plain}]', 'postln [scanned layers]']
  assert names(device_suite._contenders('step128', 'gpu')) == everything[:6]
  extras = names(device_suite._contenders('step512', 'gpu', extras=True))
  assert extras == everything + [f'realformer [bf16 carry, {plain}]', 'preln',
                                 'synth_random [flash kernel]', f'synth_random [{plain}]',
                                 'postln [fused_attention=cudnn, no attention dropout]',
                                 'postln [fused_attention=off, no attention dropout]',
                                 'postln [scanned layers, remat_policy=dots_flash]',
                                 'postln [xla_gpu_enable_triton_gemm=false]']
  assert names(device_suite._contenders('step512', 'gpu', 'postln', extras=True)) == (
      everything[:3] + everything[-1:] + extras[-4:])
  # the cuBLAS contender's process gets its flag in XLA_FLAGS, the others the suite's own
  cublas = device_suite._contenders('step512', 'gpu', extras=True)[-1]
  assert device_suite.contender_env(cublas)['XLA_FLAGS'].split()[-1] == (
      '--xla_gpu_enable_triton_gemm=false')
  assert device_suite.contender_env(device_suite._contenders('step512', 'gpu')[0]) is None
  on_cpu = names(device_suite._contenders('step512', 'cpu', 'postln', extras=True))
  assert on_cpu[2:5] == ['postln [fused_attention=flash, dropout in the kernel]',
                         'postln [scanned layers]',
                         'postln [fused_attention=xla, no attention dropout]']
  assert names(device_suite._contenders('step128', 'cpu', 'realformer')) == [
      'HF', 'realformer [flash kernel]', 'realformer [bf16 carry, flash kernel]']


def test_a_contender_is_timed_only_once_no_live_contender_is_compiling(tmp_path):
  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import device_suite  # pylint: disable=g-import-not-at-top
  dead = subprocess.Popen([sys.executable, '-c', 'pass'])
  dead.wait()
  (tmp_path / 'step512.0.compiling').write_text(str(dead.pid))  # died while compiling
  device_suite._wait_for_compiles(str(tmp_path), 'step512', time.time() + 120)  # at once
  live = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(2)'])
  threading.Thread(target=live.wait).start()  # reaped when it ends, as the part reaps its own
  (tmp_path / 'step512.1.compiling').write_text(str(live.pid))
  (tmp_path / 'step128.0.compiling').write_text(str(os.getpid()))  # another part's: ignored
  t = time.perf_counter()
  device_suite._wait_for_compiles(str(tmp_path), 'step512', time.time() + 120)
  assert live.poll() is not None and time.perf_counter() - t > 1
  hung = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])
  (tmp_path / 'step512.2.compiling').write_text(str(hung.pid))
  t = time.perf_counter()
  device_suite._wait_for_compiles(str(tmp_path), 'step512', time.time() + 1)  # not forever
  assert hung.poll() is None and 1 <= time.perf_counter() - t < 10
  hung.kill()
  hung.wait()


def test_pack_never_packs_its_own_copy_over_itself(tmp_path, monkeypatch):
  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import device_suite  # pylint: disable=g-import-not-at-top
  (tmp_path / 'minilm').mkdir()
  (tmp_path / 'minilm' / 'config.json').write_text('{}')
  monkeypatch.setattr(device_suite, 'CARRY', str(tmp_path))
  monkeypatch.setenv('REALFORMER_MINILM_DIR', str(tmp_path / 'minilm'))
  with pytest.raises(SystemExit, match='the packed copy itself'):
    device_suite.pack()
  assert (tmp_path / 'minilm' / 'config.json').exists()  # and nothing was downloaded
  assert sorted(os.listdir(tmp_path)) == ['minilm']


def _step128_part(device_suite, tmp_path, started) -> dict:
  """The step128 part run here into tmp_path/out (its contenders' processes, `started`, stopped
  after it), and its step128.json."""
  (tmp_path / 'out').mkdir()
  try:
    device_suite._step_part(str(tmp_path / 'out'), 'step128', True, str(tmp_path / 'scratch'),
                            argparse.Namespace(variants='', extras=False, cap_s=0.0))
  finally:
    for proc in started:
      proc.kill()
      proc.wait()
  with open(tmp_path / 'out' / 'step128.json') as f:
    return json.load(f)


def test_a_contender_never_timed_is_reported_not_dropped(tmp_path, monkeypatch):
  """A contender still compiling (or hung) when its turn runs out gets a note, and the part
  is then 'partly failed', not 'ok' with a row silently missing."""
  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import device_suite  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(device_suite, 'cap_s', lambda part, smoke: 4)
  monkeypatch.setattr(device_suite, 'TIMING_RESERVE_S', (4, 0))  # its turn passes 1 s after
  monkeypatch.setattr(device_suite, '_contenders',
                      lambda part, platform, variants='', extras=False: [
                          ('ours', 'postln', {}, ''), ('hf',)])
  started, real_popen = [], subprocess.Popen

  def never_timed(cmd, **kwargs):
    del cmd, kwargs
    started.append(real_popen([sys.executable, '-c', 'import time; time.sleep(60)']))
    return started[-1]

  monkeypatch.setattr(device_suite.subprocess, 'Popen', never_timed)
  data = _step128_part(device_suite, tmp_path, started)
  assert data['rows'] == [] and len(data['notes']) == 2
  assert all("failed: still compiling 4 s before the part's cap" in n for n in data['notes'])


def test_a_contender_compiled_in_time_is_timed_whenever_its_turn_comes(tmp_path, monkeypatch):
  """Contenders compiled before the compile deadline (4 s before the cap of 8 s), whose turns
  come one after another past it, are each timed, not passed over for the part's clock."""
  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import device_suite  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(device_suite, 'cap_s', lambda part, smoke: 8)
  monkeypatch.setattr(device_suite, 'TIMING_RESERVE_S', (4, 0))
  monkeypatch.setattr(device_suite.os, 'cpu_count', lambda: 6)  # all compile at once
  monkeypatch.setattr(device_suite, '_contenders',
                      lambda part, platform, variants='', extras=False: [
                          ('ours', 'postln', {}, ''), ('ours', 'realformer', {}, ''), ('hf',)])
  scratch, real_popen, started = tmp_path / 'scratch', subprocess.Popen, []  # (the part's)
  contender = textwrap.dedent('''
      import json, os, sys, time
      scratch, k = sys.argv[1], int(sys.argv[2])
      time.sleep(1.0 + 0.3 * k)  # compiling, done before the deadline
      os.remove(os.path.join(scratch, f'step128.{k}.compiling'))
      while open(os.path.join(scratch, 'step128.turn')).read().strip() != str(k):
        time.sleep(0.05)
      time.sleep(1.5)  # its timing: the last turn ends past the deadline
      with open(os.path.join(scratch, f'step128.{k}.json'), 'w') as f:
        json.dump({'row': {'contender': str(k)}, 'timed': True, 'done': True}, f)
      ''')

  def compiled_late(cmd, **kwargs):
    del kwargs
    k = cmd[cmd.index('--contender') + 1].split(':')[1]
    started.append(real_popen([sys.executable, '-c', contender, str(scratch), k]))
    return started[-1]

  monkeypatch.setattr(device_suite.subprocess, 'Popen', compiled_late)
  data = _step128_part(device_suite, tmp_path, started)
  assert [r['contender'] for r in data['rows']] == ['0', '1', '2'] and not data['notes'], data


def test_every_smoke_contender_of_both_step_parts_traces_its_gradient():
  """What the smoke run above does not build (the other variants, carries and attention
  implementations of both train-step parts, as --smoke on a CPU picks them): each one's model
  config is valid and its loss's gradient traces, at the smoke's shapes."""
  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  import device_suite  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import train_step  # pylint: disable=g-import-not-at-top
  from realformer import models  # pylint: disable=g-import-not-at-top
  from realformer.train import pretraining  # pylint: disable=g-import-not-at-top
  s = device_suite.sizes(smoke=True)
  traced = set()
  for part in ('step512', 'step128'):
    args = train_step.step_args(*s[part])
    for entry in device_suite._contenders(part, 'cpu', extras=True):
      if entry[0] == 'hf':
        continue
      _, variant, overrides, _ = entry
      overrides = dict(overrides)
      args.fused = overrides.pop('fused', 'auto')
      config = train_step.make_config(variant, s['size'], args)
      config.model.update(overrides)
      model = models.build(config.model)
      batch = pretraining.abstract_batch(args.batch, args.seq_len, args.predictions)
      inputs = {k: batch[k] for k in ('input_ids', 'segment_ids', 'attention_mask')}
      params = jax.eval_shape(model.init, jax.random.PRNGKey(0), inputs)['params']
      totals = {'mlm_weight': 1.0, 'examples': float(args.batch)}
      loss_fn = pretraining.loss_fn(model)
      grads = jax.eval_shape(jax.grad(lambda p, b: loss_fn(p, b, jax.random.PRNGKey(1),
                                                           totals)[0]), params, batch)
      assert jax.tree.structure(grads) == jax.tree.structure(params)
      traced.add((part, variant, args.fused, tuple(sorted(overrides.items()))))
  assert len(traced) == 21, sorted(traced)  # 15 at 512 (with the extras), 6 at 128
