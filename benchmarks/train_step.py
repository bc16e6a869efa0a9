r"""Times the pretraining train step (and the forward pass) of every variant, side by side with
HF transformers' BertForPreTraining in PyTorch on the same configuration and batch.

  python benchmarks/train_step.py --sizes base --batch 8 --seq_len 128 --peer hf
  python benchmarks/train_step.py --sizes small --seq_len 512 --batch 4 --peer none \
      --variants postln,realformer,synth_dense,synth_random,synth_factorized_dense,\
synth_factorized_random,synth_dense_vanilla,synth_random_vanilla
  python benchmarks/train_step.py --sizes base --seq_len 512 --dtype bfloat16 --fused cudnn \
      --variants postln,realformer --peer none                           # on a GPU
  python benchmarks/train_step.py --sizes small --prng threefry2x32,unsafe_rbg --peer none
  python benchmarks/train_step.py --sizes base --dtype bfloat16 --dense_impl auto,flax
  python benchmarks/train_step.py --sizes base --last_layer predicted,all

`--dense_impl auto,flax` builds each variant once per dense implementation (realformer/layers/dense.py:
on CPU, auto is the custom-VJP CpuDense and flax is nn.Dense). With --dtype bfloat16 the HF
peer runs under torch.autocast(bfloat16), PyTorch's mixed precision.

`--last_layer predicted,all` builds each variant with the last layer computing only [CLS] and
the masked positions (the default) and with every row (as HF's BertForPreTraining does); the
FLOPs of each are the ones it performs (train_lib.flops_per_example).

`--prng` builds each variant once per PRNG implementation for its dropout masks (threefry is
JAX's default, and realformer.layers.dropout draws four 16-bit uniforms per threefry block; rbg /
unsafe_rbg: XLA's CPU partitioner generates their whole global mask on every device). train.py gets
another with the environment variable JAX_DEFAULT_PRNG_IMPL. On a GPU in bfloat16, `--fused auto`
trains threefry's builds through the flash kernel and the others through the plain path: add
`--fused off` to compare the generators alone.

A step is the full update: forward, backward, global-norm clipping and AdamW (BERT's
settings), with dropout 0.1 on both sides, MLM loss at max_predictions masked positions
and NSP, on one batch that both sides get (pretraining.SyntheticData's batch: its tokens,
segments, masked positions and padding, lengths from T/2 to T, so that both attend under a
padding mask). The input pipeline is excluded (one fixed batch; benchmarks/input_pipeline.py
measures it). All contenders are compiled first, then stepped in turn, round after round, so
that the machine's noise falls on all of them alike (each timed call follows one untimed
call of the same contender: see run_rounds); the table gives medians and each
contender's median per-round ratio to the first one (and to HF). FLOPs are the ones each
contender performs, counted by realformer.train.train_lib.flops_per_example (attention included;
HF's: every row of the last layer and its decoder at all T positions); MFU is against the
device's peak where known, and on CPU against the 2048^3 matmul rate measured in the same
run in the run's dtype (bfloat16: bf16 operands, float32 accumulation, as our dense layers).

On a CPU-only install the script first sets glibc's malloc to keep freed memory, as train.py
and finetune.py do (realformer/train/host_memory.py): both frameworks run in this one process, so
both get it. `REALFORMER_MALLOC=default python benchmarks/train_step.py ...` measures glibc's
defaults, under which every step page-faults its temporaries in afresh.
"""

import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

from configs import pretrain
from benchmarks import machine
from realformer import models
from realformer.train import host_memory
from realformer.train import metrics as metrics_lib
from realformer.train import partitioning
from realformer.train import pretraining
from realformer.train import train_lib


def matmul_rate_jax(dtype='float32', n=2048, repeats=5) -> float:
  """FLOP/s of an n^3 matmul in `dtype` with float32 accumulation (our dense layers' dot)."""
  a = jnp.ones((n, n), dtype)
  f = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
  f(a).block_until_ready()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    f(a).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * n ** 3 / statistics.median(times)


def matmul_rate_torch(dtype='float32', n=2048, repeats=5) -> float:
  import torch  # pylint: disable=g-import-not-at-top
  a = torch.ones(n, n, dtype=getattr(torch, dtype))
  a @ a
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    a @ a
    times.append(time.perf_counter() - t)
  return 2 * n ** 3 / statistics.median(times)


def step_args(seq_len: int, batch: int, dtype: str = 'bfloat16') -> argparse.Namespace:
  """This script's arguments for one shape, BERT's masked positions, the other defaults (for
  the programs that build contenders without its command line: device_suite, profile_step)."""
  return argparse.Namespace(
      vocab_size=30522, dtype=dtype, seq_len=seq_len, batch=batch,
      predictions=max(1, round(seq_len * 20 / 128)), remat='none', scan=False, fused='auto',
      forward=False, forward_only=False, threads=torch_threads())


def torch_threads() -> int:
  """HF's torch threads: OMP_NUM_THREADS where it is set (a core shared with other work, as
  in the tests, where a second thread spin-waits for a busy core: 2.5x slower steps), else
  every core, as XLA's CPU client uses."""
  return int(os.environ.get('OMP_NUM_THREADS') or 0) or os.cpu_count()


def make_config(variant, size, args):
  c = pretrain.get_config(f'{variant},{size}')
  c.unlock()
  c.model.vocab_size = args.vocab_size
  c.model.dtype = args.dtype
  c.model.max_len = max(c.model.max_len, args.seq_len)
  c.model.remat_policy = args.remat
  c.model.scan_layers = args.scan
  c.model.fused_attention = args.fused
  c.data.max_seq_length = args.seq_len
  c.data.max_predictions_per_seq = args.predictions
  c.train.batch_size = args.batch
  return c


class Ours:
  """Our jitted train step (train_lib.make_train_step) on a one-device mesh."""

  def __init__(self, variant, size, args, prng='threefry2x32', dense_impl='auto',
               last_layer='predicted', overrides=None, label='', first_step=True):
    """`overrides`: further model config values, named in the contender's name by `label`;
    first_step=False compiles without running (no step's temporaries held yet)."""
    self.name = (f'ours {variant}' + (f' [{prng}]' if prng != 'threefry2x32' else '')
                 + (f' [dense {dense_impl}]' if dense_impl != 'auto' else '')
                 + (f' [last layer {last_layer}]' if last_layer != 'predicted' else '')
                 + (f' [{label}]' if label else ''))
    jax.config.update('jax_default_prng_impl', prng)  # captured by the step at trace time
    config = make_config(variant, size, args)
    config.model.dense_impl = dense_impl
    config.model.last_layer = last_layer
    config.model.update(overrides or {})
    self.config = config
    mesh = partitioning.make_mesh(config.mesh, jax.devices()[:1])
    jax.set_mesh(mesh)
    model = models.build(config.model)
    spec = model.spec
    data = pretraining.SyntheticData(
        vocab_size=config.model.vocab_size, seq_len=args.seq_len,
        num_predictions=args.predictions, global_batch_size=args.batch, seed=0)
    self.batch = train_lib.global_batch(next(data), mesh)
    tx = train_lib.make_optimizer(config.optimizer, spec)
    abstract = pretraining.abstract_batch(args.batch, args.seq_len, args.predictions)
    t = time.perf_counter()
    self.state, shardings = train_lib.create_train_state(model, tx, abstract, mesh, 0)
    loss_fn = pretraining.loss_fn(model)
    self.step_fn = train_lib.make_train_step(
        loss_fn, tx, mesh=mesh, shardings=shardings,
        metrics_cls=metrics_lib.PretrainingTrainMetrics, totals_fn=pretraining.totals)
    # The step's learning rate and dropout key (its arguments; the peak is as costly as any).
    self.rate = np.float32(config.optimizer.learning_rate)
    self.rng = train_lib.dropout_key(0, mesh)
    self.eval_fn = train_lib.make_eval_step(
        train_lib.loss_metrics(loss_fn, metrics_lib.PretrainingEvalMetrics,
                               pretraining.totals), mesh=mesh,
        params_sharding=shardings.params)
    compiled = self.step_fn.lower(self.state, self.batch, self.rate, self.rng).compile()
    self.memory = compiled.memory_analysis()
    if first_step and not args.forward_only:
      self.step()
    if args.forward or args.forward_only:
      self.forward()
    self.compile_s = time.perf_counter() - t
    jax.config.update('jax_default_prng_impl', 'threefry2x32')
    self.flops = train_lib.flops_per_example(config.model, args.seq_len,
                                             args.predictions) * args.batch
    self.params = sum(x.size for x in jax.tree.leaves(self.state.params))

  def step(self, n=1):
    """`n` steps back to back; returns when the last has run."""
    for _ in range(n):
      self.state, m = self.step_fn(self.state, self.batch, self.rate, self.rng)
    jax.block_until_ready(m)

  def forward(self):
    jax.block_until_ready(self.eval_fn(self.state.params, self.batch))

  def peak_bytes(self):
    """The compiled train step's footprint (arguments, outputs and temporaries, less what
    the outputs alias): the device's own peak counter spans every contender of the process."""
    m = self.memory
    if m:
      return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
              - m.alias_size_in_bytes)
    return (jax.devices()[0].memory_stats() or {}).get('peak_bytes_in_use')


class HF:
  """transformers' BertForPreTraining (PyTorch) with torch.optim.AdamW.

  float32 parameters and optimizer as ours; with --dtype bfloat16 (or float16) the step runs
  under torch.autocast in that dtype, PyTorch's mixed precision: the same split as our
  model.dtype (matmuls in the low precision, softmax/LayerNorm/loss in float32). It runs on
  the GPU when jax does (attention through torch's SDPA kernels), else on the CPU.
  """

  def __init__(self, size, args, first_step=True):
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    self.torch = torch
    self.device = 'cuda' if (jax.devices()[0].platform == 'gpu'
                             and torch.cuda.is_available()) else 'cpu'
    self.autocast = None if args.dtype == 'float32' else getattr(torch, args.dtype)
    self.name = 'HF BertForPreTraining (torch' + (
        f', autocast {args.dtype})' if self.autocast else ')')
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    layers, hidden, heads, mlp = pretrain.SIZES[size]
    cfg = transformers.BertConfig(vocab_size=args.vocab_size, hidden_size=hidden,
                                  num_hidden_layers=layers, num_attention_heads=heads,
                                  intermediate_size=mlp,
                                  max_position_embeddings=max(512, args.seq_len),
                                  attn_implementation='sdpa')
    self.model = transformers.BertForPreTraining(cfg).to(self.device).train()
    self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01,
                                 eps=1e-6)
    # Ours's very batch (Ours: pretraining.SyntheticData's batches, seed 0): the same tokens,
    # segments, padding (lengths from T/2 to T, so SDPA gets the attention mask) and masked
    # positions as labels.
    batch = next(pretraining.SyntheticData(
        vocab_size=args.vocab_size, seq_len=args.seq_len, num_predictions=args.predictions,
        global_batch_size=args.batch, seed=0))
    labels = np.full(batch['input_ids'].shape, -100, np.int64)
    for i, (positions, ids, weights) in enumerate(zip(
        batch['masked_lm_positions'], batch['masked_lm_ids'], batch['masked_lm_weights'])):
      labels[i, positions[weights > 0]] = ids[weights > 0]
    as_long = lambda x: torch.tensor(np.asarray(x, np.int64))
    inputs = dict(input_ids=as_long(batch['input_ids']),
                  token_type_ids=as_long(batch['segment_ids']),
                  attention_mask=as_long(batch['attention_mask']), labels=as_long(labels),
                  next_sentence_label=as_long(batch['next_sentence_labels']))
    self.inputs = {k: v.to(self.device) for k, v in inputs.items()}
    if self.device == 'cuda':
      torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if first_step:
      self.forward() if args.forward_only else self.step()
    self.compile_s = time.perf_counter() - t0
    self.params = sum(p.numel() for p in self.model.parameters())
    self.memory = None
    # The FLOPs it performs: every row of the last layer, and the MLM decoder at all T
    # positions (BertForPreTraining scores every token and ignores the unmasked ones).
    config = make_config('postln', size, args).model
    config.last_layer, config.vocab_pad_multiple = 'all', 1  # HF's vocabulary is unpadded
    self.flops = train_lib.flops_per_example(config, args.seq_len, args.seq_len) * args.batch

  def _autocast(self):
    return self.torch.autocast(self.device, dtype=self.autocast,
                               enabled=self.autocast is not None)

  def _sync(self):
    if self.device == 'cuda':  # CUDA runs asynchronously: a timed call ends when it has run
      self.torch.cuda.synchronize()

  def step(self, n=1):
    """`n` steps back to back; returns when the last has run."""
    for _ in range(n):
      self.opt.zero_grad(set_to_none=True)
      with self._autocast():
        loss = self.model(**self.inputs).loss
      loss.backward()
      self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
      self.opt.step()
    self._sync()

  def forward(self):
    with self.torch.no_grad(), self._autocast():
      self.model(**self.inputs)
    self._sync()

  def peak_bytes(self):
    """On the GPU, the most torch's allocator held since this contender was built."""
    return self.torch.cuda.max_memory_allocated() if self.device == 'cuda' else None


def run_rounds(contenders, what, steps, settle=1):
  """Round-robin timing; in each round every contender first takes `settle` untimed calls.

  The untimed calls matter: the first call after another framework's step pays for that
  step's aftermath (memory the other allocator released and this one must fault back in,
  thread pools waking up), about 1 s of a 3.5 s BERT-base CPU step whichever side follows.
  """
  times = {c.name: [] for c in contenders}
  for _ in range(steps):
    for c in contenders:
      for _ in range(settle):
        getattr(c, what)()
      t = time.perf_counter()
      getattr(c, what)()
      times[c.name].append(time.perf_counter() - t)
  return times


def median_ratio(a, b):
  return statistics.median(x / y for x, y in zip(a, b))


def summarize(contenders, times, fwd_times, args, rate, forward_only=False):
  """One dict per contender: medians, throughput, MFU and the per-round ratios."""
  first = contenders[0].name
  hf = next((c.name for c in contenders if c.name.startswith('HF')), None)
  tokens = args.batch * args.seq_len
  records = []
  for c in contenders:
    step = statistics.median(times[c.name])
    flops = c.flops / 3 if forward_only else c.flops
    peak = c.peak_bytes()
    records.append({
        'contender': c.name, 'params': c.params, 'step_s': step,
        'fwd_s': statistics.median(fwd_times[c.name]) if fwd_times else None,
        'tokens_per_s': tokens / step, 'tflops': flops / step / 1e12,
        'mfu': flops / step / rate if rate else None,
        'vs_first': median_ratio(times[c.name], times[first]),
        'hf_over_this': median_ratio(times[hf], times[c.name]) if hf else None,
        'compile_s': c.compile_s, 'memory_gib': peak / 2**30 if peak else None})
  return records


def table(records, forward_only=False):
  """Markdown rows of summarize()'s records (with forward_only the times are forward passes)."""
  what = 'fwd' if forward_only else 'step'
  first = records[0]['contender']
  fmt = lambda x, spec: '-' if x is None else format(x, spec)
  rows = [f'| contender | params | {what} s (median) | fwd s | tokens/s | TFLOP/s | MFU | '
          f'{what} / {first} | HF {what} / {what} | compile s | train step mem GiB |',
          '|---|---|---|---|---|---|---|---|---|---|---|']
  for r in records:
    rows.append(
        f'| {r["contender"]} | {r["params"] / 1e6:.1f}M | {r["step_s"]:.3f} | '
        f'{fmt(r["fwd_s"], ".3f")} | {r["tokens_per_s"]:,.0f} | {r["tflops"]:.3f} | '
        f'{fmt(r["mfu"], ".0%")} | {r["vs_first"]:.2f} | {fmt(r["hf_over_this"], ".2f")} | '
        f'{r["compile_s"]:.0f} | {fmt(r["memory_gib"], ".2f")} |')
  return '\n'.join(rows)


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--variants', default='postln')
  p.add_argument('--sizes', default='base')
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--seq_len', type=int, default=128)
  p.add_argument('--predictions', type=int, default=0,
                 help='masked positions per sequence (default 20 at 128, 80 at 512)')
  p.add_argument('--steps', type=int, default=5)
  p.add_argument('--dtype', default='float32')
  p.add_argument('--remat', default='none')
  p.add_argument('--scan', action='store_true')
  p.add_argument('--fused', default='auto')
  p.add_argument('--dense_impl', default='auto',
                 help='comma-separated model.dense_impl values (auto, flax, cpu); each variant '
                      'is built once per value')
  p.add_argument('--last_layer', default='predicted',
                 help='comma-separated model.last_layer values (predicted: the last layer '
                      'computes only [CLS] and the masked rows; all: every row)')
  p.add_argument('--vocab_size', type=int, default=30522)
  p.add_argument('--peer', default='hf', choices=('hf', 'none'))
  p.add_argument('--forward', action='store_true', help='also time the forward pass')
  p.add_argument('--forward_only', action='store_true',
                 help='time only the forward pass (evaluation mode, no dropout)')
  p.add_argument('--prng', default='threefry2x32',
                 help='comma-separated PRNG implementations for dropout: threefry2x32, '
                      'philox4x32, rbg, unsafe_rbg (each variant is built once per implementation)')
  p.add_argument('--threads', type=int, default=torch_threads(),
                 help="torch's threads (default: OMP_NUM_THREADS, else every core)")
  args = p.parse_args()
  # BERT's max_predictions_per_seq: 20 at length 128, 80 at 512.
  args.predictions = args.predictions or max(1, round(args.seq_len * 20 / 128))
  # As train.py does; it applies to both frameworks (same process). REALFORMER_MALLOC=default
  # keeps glibc's defaults.
  kept = host_memory.keep_freed_memory()
  device = jax.devices()[0]
  on_cpu = device.platform == 'cpu'
  print(machine.describe())
  print(f'# {" ".join(sys.argv)}')
  print(f'# host malloc: {"freed memory kept (realformer/train/host_memory.py)" if kept else "defaults"}')
  rate_jax = matmul_rate_jax(args.dtype) if on_cpu else None
  if on_cpu:
    line = f'# {args.dtype} 2048^3 matmul: jax {rate_jax / 1e9:.0f} GFLOP/s'
    if args.peer == 'hf':
      line += f', torch {matmul_rate_torch(args.dtype) / 1e9:.0f} GFLOP/s'
    print(line + ' (MFU on CPU = FLOP/s / the jax rate)')
  rate = rate_jax if on_cpu else metrics_lib.peak_flops_per_device(device)
  for size in args.sizes.split(','):
    contenders = []
    for variant in args.variants.split(','):
      for prng in args.prng.split(','):
        for impl in args.dense_impl.split(','):
          for last in args.last_layer.split(','):
            contenders.append(Ours(variant, size, args, prng, impl, last))
    if args.peer == 'hf':
      contenders.append(HF(size, args))
    print(f'\n## {size}, batch {args.batch}, length {args.seq_len}, {args.predictions} '
          f'predictions, {args.dtype}, remat {args.remat}, scan {args.scan}, '
          f'{args.steps} rounds; ru_maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB')
    if args.forward_only:
      times = run_rounds(contenders, 'forward', args.steps)
      print(table(summarize(contenders, times, None, args, rate, forward_only=True),
                  forward_only=True))
    else:
      times = run_rounds(contenders, 'step', args.steps)
      fwd = run_rounds(contenders, 'forward', args.steps) if args.forward else None
      print(table(summarize(contenders, times, fwd, args, rate)))
    del contenders


if __name__ == '__main__':
  main()
