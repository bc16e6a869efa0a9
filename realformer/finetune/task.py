"""What fine-tuning gives the trainer: the part every kind of task shares.

A `FinetuneTask` is a trainer.Task over a pretrained encoder with a task head:

  params      the encoder from `config.init_checkpoint` (a pretraining run directory, or a
              fine-tuning run's best/ or final/; only the encoder is read, and a checkpoint
              that lacks a parameter is an error naming it), the head fresh; with
              `from_scratch=True` everything fresh, the architecture from a pretraining
              config file such as configs/pretrain.py:postln,tiny;
  batches     epochs of the training features, shuffled by (seed, epoch), each batch padded
              to one of a few length buckets chosen from the data (data/buckets.py) and
              compiled while training runs (compile_in_background) or before the first
              step; a batch's examples from one bucket, or any (group_by_length=False);
              `length_buckets=0` pads to max_seq_length;
  evaluation  the dev sets at the end of every epoch, batched within buckets as well;
              the best epoch's params kept in <run>/best (keep_best);
  a finished run  writes the test predictions and <run>/results.json, and keeps its params in
              <run>/final without the optimizer state (unless keep_optimizer_state).

A kind of task (tasks/glue.py, tasks/squad.py, tasks/tsv.py; registry.py finds them) is a
subclass that declares its own config fields (`configure`), loads and featurizes its data,
and says what the head (and its FLOPs), loss, metrics and prediction files are.
"""

import abc
from concurrent import futures
import copy
import dataclasses
import os
import time
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from clu import metrics as clu_metrics

from data import buckets as buckets_lib
from data import tokenizer as tokenizer_lib
from realformer import cli
from realformer import config_checks
from realformer.model.encoder import EncoderOutput
from realformer.model.spec import resolve
from realformer.train import checkpoints
from realformer.train import compile_cache
from realformer.train import distributed
from realformer.train import metrics as metrics_lib
from realformer.train import partitioning
from realformer.train import train_lib
from realformer.train import trainer
from realformer.train import workdir as workdir_lib
from realformer.train.run_dir import RunDir


@flax.struct.dataclass
class FinetuneMetrics(clu_metrics.Collection):
  loss: clu_metrics.Average
  learning_rate: clu_metrics.LastValue
  grad_norm: clu_metrics.Average


def trained_length_known(path: str) -> bool:
  """Whether the checkpoint at `path` was trained here (step > 0: train.py's pretraining, or
  a fine-tuning's best/ or final/), so that its config.json's data.max_seq_length is the
  length its positions were trained to; an import's params are at step 0 and the length
  they were pretrained at is not known."""
  return int(os.path.basename(checkpoints.resolve_step_dir(path))) > 0


def gpu_kernels_off_gpus(model):
  """The pretraining's model config, its GPU attention kernel (model.fused_attention=flash
  or cudnn) replaced by auto where the fine-tuning runs on another platform: how the
  pretraining ran, not what it computed."""
  kernel = model.get('fused_attention', 'auto')
  if kernel not in ('flash', 'cudnn') or jax.default_backend() == 'gpu':
    return model
  logging.info('model.fused_attention=%s was the pretraining\'s GPU kernel; auto on %s',
               kernel, jax.default_backend())
  model = ml_collections.ConfigDict(model)
  model.fused_attention = 'auto'
  return model


def hf_architecture_of(cls) -> str:
  """The HF class the kind's head exports as: declared by the class that defines its
  `build` ('' for none: a subclass that builds a head of its own does not inherit its
  parent's)."""
  owner = next(c for c in cls.__mro__ if 'build' in vars(c))
  return vars(owner).get('hf_architecture') or ''


def computed_as(model, overrides) -> ml_collections.ConfigDict:
  """The pretraining's model config with the fine-tuning's config.model fields that are set
  (how the encoder computes: dtype, dropout, kernels, remat; '' or None: as pretrained)."""
  given = {k: v for k, v in (overrides or {}).items() if v not in ('', None)}
  if not given:
    return model
  model = ml_collections.ConfigDict(model)
  for k, v in given.items():
    model[k] = v
  return model


def pretrained_config(path: str, config=None) -> ml_collections.ConfigDict:
  """The pretraining config: a run directory's config.json, or, for a random-init baseline
  (from_scratch=True), a pretraining config file such as configs/pretrain.py:postln,tiny,
  with config.tokenizer (or that config's data.tokenizer) giving the vocabulary."""
  if not path:
    raise ValueError('config.init_checkpoint is empty: name the pretraining workdir (its '
                     'config.json gives the architecture and the tokenizer)')
  if path.partition(':')[0].endswith('.py'):
    if config is None or not config.from_scratch:
      raise ValueError(f'config.init_checkpoint={path!r} is a config file, which holds no '
                       f'weights: set config.from_scratch=True for a random-init baseline, '
                       f'or name a pretraining workdir')
    pre = cli.load_config(path).copy_and_resolve_references()
    if config.get('tokenizer'):
      pre.data.tokenizer = config.tokenizer
    pre.model.vocab_size = tokenizer_lib.load_for_config(pre.data).vocab_size
    return pre
  return ml_collections.ConfigDict(checkpoints.read_pretraining_config(path))


def _digest(features: Sequence[Dict[str, np.ndarray]]) -> int:
  """A checksum of feature sets: every array's name, shape and values (token ids, labels)."""
  digest = 0
  for f in features:
    for key in sorted(f):
      array = np.ascontiguousarray(f[key])
      digest = zlib.crc32(f'{key}{array.shape}{array.dtype}'.encode(), digest)
      digest = zlib.crc32(array.tobytes() if array.dtype != object else
                          repr(array.tolist()).encode(), digest)
  return digest


# ------------------------------------------------------------------------------ buckets

def length_buckets(config, task, run: RunDir, resuming: bool,
                   mid_epoch: bool = False) -> Tuple[int, ...]:
  """The compiled sequence lengths: chosen from the training lengths alone, so that the
  training batches do not depend on the dev or test files (a longer dev or test example gets
  a length of its own for evaluation: eval_lengths); (max_seq_length,) when
  config.length_buckets is 0. Random batches (group_by_length False) choose them from their
  own longest examples (data/buckets.py). Stored in the run directory with the settings that
  chose them: a resumed run with the same bucket settings (length_buckets, group_by_length,
  bucket_multiple, bucket_compile_seconds, bucket_flops_per_second) keeps them, whatever dev
  or test files changed. A change of a setting takes effect at an epoch's start; in
  mid-epoch it is an error where it would change the epoch's batches (grouped batches are
  drawn from their buckets; random batches are the same whatever lengths pad them, so only
  their padding changes). A checksum of the training examples is stored beside them: a
  resume whose training examples differ (the file, its tokenization, tfds's copy changed) is
  an error (it would train on other batches without a word)."""
  settings = {'length_buckets': int(config.length_buckets),
              'group_by_length': bool(config.group_by_length),
              'bucket_multiple': int(config.bucket_multiple),
              'bucket_compile_seconds': float(config.bucket_compile_seconds),
              'bucket_flops_per_second': float(config.bucket_flops_per_second)}
  stored, stored_settings = None, None
  saved = (distributed.read_on_process_zero(lambda: run.read_json(RunDir.LENGTH_BUCKETS),
                                            f'read {run.path(RunDir.LENGTH_BUCKETS)}')
           if resuming else None)
  train_digest = _digest([task.train])
  began = saved.get('train_digest') if isinstance(saved, dict) else None  # (older: none)
  if began is not None and began != train_digest:
    raise ValueError(f'{task.name}\'s training examples are not those this run began with '
                     f'(their checksum in {run.path(RunDir.LENGTH_BUCKETS)}): its train file, '
                     'their tokenization or tfds\'s copy changed; resume with the data as it '
                     'was, or train afresh in another --workdir')
  if isinstance(saved, list):  # written before the settings were stored with them
    stored = tuple(saved)
  elif saved is not None:
    stored, stored_settings = tuple(saved['lengths']), saved['settings']
  # Settings unknown (an older file: none, or fewer of them): kept to finish an epoch,
  # chosen again at the next.
  known = (stored_settings is not None
           and all(settings.get(k) == v for k, v in stored_settings.items()))
  same = stored_settings == settings or (mid_epoch and (stored_settings is None or known))
  # (An older file's lone max_seq_length may be padded training's, length_buckets=0: chosen
  # again; with its settings stored, a plan of one length is kept like any other.)
  legacy_padded = stored_settings is None and stored == (config.max_seq_length,)
  kept = bool(config.length_buckets and stored and same and not legacy_padded)
  if not config.length_buckets:
    chosen = (config.max_seq_length,)
  else:
    chosen = stored if kept else _choose_buckets(config, task)
  stored_grouped = (stored_settings or {}).get('group_by_length', True)  # (older: grouped)
  if mid_epoch and stored is not None and (_plan_of(stored, stored_grouped) !=
                                           _plan_of(chosen, settings['group_by_length'])):
    raise ValueError(f'this run stopped in mid-epoch with length buckets {list(stored)}'
                     f'{f" ({stored_settings})" if stored_settings else ""}; resume with '
                     f'the bucket settings as they were, and change them once the epoch is '
                     f'over')
  run.write_json(RunDir.LENGTH_BUCKETS, {  # kept: the settings that chose them, as known
      'lengths': list(chosen), 'settings': stored_settings if kept else settings,
      'train_digest': train_digest})
  return chosen


def _plan_of(lengths: Tuple[int, ...], grouped: bool):
  """What decides an epoch's batches (data/buckets.train_batches): random batches are the
  same whatever lengths pad them, and grouped ones of a single length are those; grouped
  ones of several are drawn from their lengths."""
  return ('grouped', tuple(lengths)) if grouped and len(lengths) > 1 else 'random'


def _longest_eval(task) -> int:
  """The longest example of the splits that are only evaluated (dev, test)."""
  return max((int(buckets_lib.lengths_of(f).max(initial=0)) for f in task.eval_features()),
             default=0)


def eval_lengths(config, task, buckets: Tuple[int, ...]) -> Tuple[int, ...]:
  """The lengths evaluation and predictions compile: the training buckets, and one more
  when a dev or test example is longer than the longest of them."""
  longest = _longest_eval(task)
  if longest <= max(buckets):
    return buckets
  extra = min(config.max_seq_length, -(-longest // config.bucket_multiple) *
              config.bucket_multiple)
  logging.info('a dev/test example of %d tokens is longer than the training\'s length '
               'buckets %s: evaluation and predictions also compile length %d', longest,
               list(buckets), extra)
  return tuple(buckets) + (extra,)


def compile_cost_in_tokens(config, flops_per_example: Callable[[int], float]
                           ) -> Tuple[float, float]:
  """(seconds per padded token, padded tokens one more compiled length is worth).

  A length costs config.bucket_compile_seconds of compiling (its train step and its
  prediction program; every host compiles at once); a padded token costs the training FLOPs
  of one token at max_seq_length (the task's flops_per_example) at the run's rate,
  config.bucket_flops_per_second: 0 = 40% of the devices' peak where
  metrics.PEAK_FLOPS_PER_DEVICE knows it (the job's devices share the batch: on 8 GPUs a
  padded token costs an eighth of one GPU's time), else 1e11 (the order of a few CPU cores).
  Both are estimates, fixed by the config, the device kind and count, so the plan (and with it
  the run's batches) does not depend on a timing."""
  rate = config.bucket_flops_per_second
  if not rate:
    peak = metrics_lib.peak_flops_per_device(jax.devices()[0])
    rate = 0.4 * peak * jax.device_count() if peak else 1e11
  per_token = flops_per_example(config.max_seq_length) / (config.max_seq_length * rate)
  return per_token, config.bucket_compile_seconds / per_token


def _choose_buckets(config, task) -> Tuple[int, ...]:
  lengths = buckets_lib.lengths_of(task.train)
  per_token, tokens_per_compile = (compile_cost_in_tokens(config, task.flops_per_example)
                                   if config.bucket_compile_seconds else (0.0, 0.0))
  epochs = config.num_epochs
  if config.group_by_length:  # each example padded to its bucket, every epoch
    longest, sample, repeats = None, lengths, epochs
  else:  # each random batch padded to fit its longest: the run's batches, batch_size rows each
    longest = buckets_lib.batch_longest(lengths, config.batch_size, config.seed, epochs)
    sample, repeats = longest, config.batch_size  # (an example in no batch needs no length)
  chosen = buckets_lib.choose_lengths(sample, config.length_buckets, config.bucket_multiple,
                                      config.max_seq_length, repeats=repeats,
                                      tokens_per_compile=tokens_per_compile)
  padded = buckets_lib.padded_tokens(sample, chosen) * repeats
  logging.info('%s. Chosen for %d epoch%s: %.3g padded tokens (~%.0f s of training at ~%.2g s '
               'a token) against ~%g s of compiling each length (config.length_buckets=%d '
               'lengths at most, 0: every batch padded to max_seq_length; '
               'config.bucket_compile_seconds=0 pads least; config.group_by_length=%s)',
               buckets_lib.describe(lengths, chosen, config.max_seq_length, longest), epochs,
               's' if epochs != 1 else '', padded,
               padded * per_token, per_token, config.bucket_compile_seconds,
               config.length_buckets, config.group_by_length)
  return chosen


class Programs:
  """`step` compiled for a batch of each length, called as `step` is: a call runs the program
  of its batch's length.

  With a `compiler` (an executor), its thread compiles them in the order given while the run
  goes on, and a call waits only for its own length's program: the first step starts after
  one compilation, and on a GPU or TPU the host compiles the rest while the device trains.
  Without, every length is compiled here, before the first step. The programs are the same
  either way. `args` are the step's arguments before the batch, `after` those after it
  (abstract values, for lowering)."""

  def __init__(self, step, args, batch_of_length, lengths, name: str, mesh,
               compiler: Optional[futures.Executor], after: Tuple[Any, ...] = ()):
    began = []  # when the first of them began compiling (queued behind others, not before)
    loaded = []  # the lengths whose program came from the compilation cache

    def compile_one(length):
      if not began:
        began.append(time.time())
      # (kept however fast they compile: the next run of a grid loads them)
      with jax.set_mesh(mesh), compile_cache.kept() as cache:  # (the mesh is per thread)
        program = step.lower(*args, batch_of_length(length), *after).compile()
      if cache['hits']:
        loaded.append(length)
      return program

    def log(done=None):
      if done is None or (not done.cancelled() and done.exception() is None):
        how = ('loaded from the compilation cache' if len(loaded) == len(lengths) else
               'compiled' + (f' ({len(loaded)} loaded from the compilation cache)'
                             if loaded else ''))
        logging.info('the %s for %d length%s (%s): %s in %.1f s%s', name, len(lengths),
                     's' if len(lengths) > 1 else '', ', '.join(map(str, lengths)), how,
                     time.time() - began[0], ', while the run went on' if compiler else '')

    self._programs, self._waited = {}, 0.0
    for length in lengths:
      if compiler:
        self._programs[length] = compiler.submit(compile_one, length)
      else:
        self._programs[length] = futures.Future()
        self._programs[length].set_result(compile_one(length))
    if compiler:
      self._programs[lengths[-1]].add_done_callback(log)
    else:
      log()

  def __call__(self, first, batch, *rest):
    program = self._programs[batch['input_ids'].shape[1]]
    if not program.done():
      start = time.time()
      program.result()
      self._waited += time.time() - start
    return program.result()(first, batch, *rest)

  def waited(self) -> float:
    """Seconds that calls spent waiting for their program to compile since the last
    waited() (the trainer leaves them out of the throughput)."""
    seconds, self._waited = self._waited, 0.0
    return seconds


def run_model(predict, params, features, *, batch_size: int, buckets, mesh,
              token_outputs: bool, input_keys: Sequence[str] = buckets_lib.SEQUENCE_KEYS,
              sequence_keys: Sequence[str] = buckets_lib.SEQUENCE_KEYS
              ) -> Tuple[np.ndarray, ...]:
  """`predict`'s outputs for every row of `features` (given their `input_keys`, those of
  `sequence_keys` cut to each batch's length), in order: batches within each length
  bucket; per-token outputs ([B, length, ...]) padded back to max_seq_length with -inf."""
  n, max_len = features['input_ids'].shape
  lengths = buckets_lib.lengths_of(features)
  outs = None
  for length, idx, valid in buckets_lib.eval_batches(lengths, buckets, batch_size):
    inputs = {k: features[k] for k in input_keys}
    out = predict(params, train_lib.global_batch(
        buckets_lib.take(inputs, idx, length, sequence_keys), mesh, whole=True))
    out = [np.asarray(o)[valid] for o in out]
    if token_outputs:
      out = [np.pad(o, [(0, 0), (0, max_len - length)] + [(0, 0)] * (o.ndim - 2),
                    constant_values=-np.inf) for o in out]
    if outs is None:
      outs = [np.empty((n,) + o.shape[1:], o.dtype) for o in out]
    for full, o in zip(outs, out):
      full[idx[valid]] = o
  return tuple(outs)


# ------------------------------------------------------------------------------ the task

class FinetuneTask(trainer.Task, abc.ABC):
  """A fine-tuning run of configs/finetune.py's `config` on `mesh` (see the module
  docstring). Subclasses implement the methods marked abstract below and set `name` and
  `train` (the training features: dict of [N, max_seq_length] arrays + labels) in `load`.
  Its own bookkeeping is name-mangled (self.__predict, ...): a subclass's helpers may take
  any name (a `_predict` of its own shadowed the prediction programs once)."""
  command = 'finetune.py'
  token_outputs = False  # whether the head's outputs are per token (SQuAD's spans)
  # The transformers class that holds the encoder and this kind's head, for export-hf (best/
  # and final/ record it; one of interop.HF_ARCHITECTURES', whose heads are named as GLUE's
  # classifier and SQuAD's span_head); None: a head of one's own, whose export takes the
  # encoder alone. Declared by the class that defines `build`: a subclass with a head of its
  # own declares none by inheriting it (hf_architecture_of).
  hf_architecture: Optional[str] = None
  # The training features cut to a batch's bucket length with the inputs (a task with labels
  # per token, [N, max_seq_length], adds their key).
  sequence_keys = buckets_lib.SEQUENCE_KEYS
  # The features the model reads (evaluation gives it these alone; training the whole
  # batch): a model with an input of its own (a tagger's word-start mask) adds it here,
  # and to sequence_keys where it is per token.
  input_keys = buckets_lib.SEQUENCE_KEYS
  needs_final_results = True  # the predictions and results.json of a rerun
  train: Dict[str, np.ndarray]

  def __init__(self, config, mesh, run: RunDir):
    self.config, self.mesh, self.run_dir = config, mesh, run
    # What each host reads for itself (with several processes all go on, or none does), and
    # the same on each.
    pre, tokenizer = distributed.on_every_process(
        self.__pretrained, 'read the checkpoint\'s config and vocabulary')
    distributed.on_process_zero(self.download, f'download {config.task}\'s data')
    distributed.on_every_process(lambda: self.load(tokenizer), f'read {config.task}\'s data')
    distributed.same_on_every_process(
        lambda: _digest([self.train, *self.eval_features()]), f'{self.name}\'s data',
        'give every host the same files (a copy of each, or a folder they share)')
    self.params_config = self.__params_config(pre)
    self.__check_features(pre)
    num_train = len(self.train['input_ids'])
    self.steps_per_epoch = num_train // config.batch_size
    if self.steps_per_epoch == 0:
      raise ValueError(f'{num_train} training examples are fewer than one batch of '
                       f'{config.batch_size}; lower config.batch_size')
    self.cadence = trainer.make_cadence(config, self.steps_per_epoch)
    self.spec = resolve(computed_as(gpu_kernels_off_gpus(pre.model), config.get('model')),
                        platform=mesh.devices.flat[0].platform)
    self.program = self.__program(self.build(self.spec))
    if not config.from_scratch:
      self.init_checkpoint = trainer.InitCheckpoint(config.init_checkpoint, ('encoder',),
                                                    allow_missing=False)
    self.lengths = buckets_lib.lengths_of(self.train)
    self.__compiler: Optional[futures.Executor] = None  # prepare() starts it
    self.__predict: Optional[Programs] = None

  @property
  def nonfinite_hint(self) -> str:
    half = jnp.dtype(self.spec.dtype) != jnp.float32  # (the pretrained dtype, or the set one)
    return ('lower config.optimizer.learning_rate' + (', ' if half else ' or ') + 'raise '
            'config.optimizer.warmup_fraction'
            + (' or train in float32 (config.model.dtype)' if half else ''))

  def __params_config(self, pre) -> ml_collections.ConfigDict:
    """The config best/ and final/ carry, encoders another run can start from: the
    pretraining's, with data.max_seq_length the length their positions have been trained to
    (the pretraining's, or the longest training example's where it is longer: the padding
    of a batch trains no position; an import's is not known, so all) and what the
    fine-tuning was (`finetuned`). A warning where config.max_seq_length reaches past the
    pretrained positions."""
    config = self.config
    trained = int(pre.data.get('max_seq_length', pre.model.max_len))
    known = not config.from_scratch and trained_length_known(config.init_checkpoint)
    if config.max_seq_length > trained and known:
      synthesized = [c for c in resolve(pre.model.copy_and_resolve_references()).attention
                     if c != 'dot']
      logging.warning('max_seq_length=%d is longer than the pretraining sequences (%d): '
                      'positions %d-%d were never trained (their position embeddings%s have '
                      'had no gradient); lower config.max_seq_length to %d or pretrain at '
                      'the longer length', config.max_seq_length, trained, trained,
                      config.max_seq_length - 1,
                      f', and the {"+".join(synthesized)} synthesizer\'s logits for them,'
                      if synthesized else '', trained)
    longest = int(buckets_lib.lengths_of(self.train).max(initial=0))
    params_config = pre.copy_and_resolve_references()
    scan = (config.get('model') or {}).get('scan_layers')
    if scan is not None:  # (the layout its params are written in)
      params_config.model.scan_layers = scan
    params_config.data.max_seq_length = (
        longest if config.from_scratch else
        max(trained, longest) if known else pre.model.max_len)
    with params_config.unlocked():
      params_config.finetuned = {'kind': config.benchmark, 'task': config.task,
                                 'hf_architecture': hf_architecture_of(type(self))}
      params_config.finetuned.labels = list(self.label_names())
    return params_config

  def __check_features(self, pre) -> None:
    """One-line errors for features the run cannot take: more token types than the
    checkpoint has, (with length buckets) training features per token left out of
    sequence_keys, or a set it evaluates or predicts that holds no example (found before
    an epoch is trained, not at its end)."""
    config = self.config
    sizes = [len(f['input_ids']) for f in self.eval_features()]
    if 0 in sizes:
      raise ValueError(f'{self.name}: set {sizes.index(0) + 1} of the {len(sizes)} that '
                       f'{type(self).__name__}.eval_features() returns (the dev and test '
                       'sets it evaluates or predicts) holds no example; is its file empty? '
                       'give it one, or leave the set out')
    config_checks.check_segments(int(self.train['segment_ids'].max()) + 1,
                                 pre.model.type_vocab_size, f'{self.name}\'s text pairs',
                                 'fine-tune a checkpoint with two token types')
    if config.length_buckets:
      per_token = sorted(k for k, v in self.train.items() if v.ndim >= 2 and v.shape[1] ==
                         config.max_seq_length and k not in self.sequence_keys)
      if per_token:
        name = type(self).__name__
        raise ValueError(f'{name}: the training features {per_token} hold values per token '
                         f'([N, max_seq_length={config.max_seq_length}, ...]) but are not in '
                         'its sequence_keys, which length buckets cut with the inputs; add '
                         f'them (sequence_keys = {self.sequence_keys} + {tuple(per_token)})')

  def __program(self, model) -> train_lib.Program:
    """The run's program: `model` (build's) trained on loss_fn, evaluated through its head's
    outputs (all but the encoder's)."""
    config = self.config

    def eval_fn(params, batch):
      out = model.apply({'params': params}, batch)
      if not (isinstance(out, tuple) and out and isinstance(out[0], EncoderOutput)):
        what = ('an array' if hasattr(out, 'shape') else
                f'a tuple whose first item is {type(out[0]).__name__}'
                if isinstance(out, tuple) and out else type(out).__name__)
        raise ValueError(f'{type(self).__name__}.build: its model returns {what}; a '
                         'fine-tuning model returns (the encoder\'s output, *the head\'s '
                         'outputs), as models.build\'s heads do')
      return out[1:]
    return train_lib.make_program(
        model, config.optimizer, self.cadence.num_steps, self.mesh, config.seed,
        {k: jax.ShapeDtypeStruct((config.batch_size,) + v.shape[1:], v.dtype)
         for k, v in self.train.items()},
        loss_fn=self.loss_fn(model), metrics_cls=FinetuneMetrics,
        totals_fn=self.totals, eval_fn=eval_fn, flops_per_example=self.flops_per_example)

  def __pretrained(self):
    """(the pretraining config, its tokenizer), checked against the task's settings."""
    config = self.config
    pre = pretrained_config(config.init_checkpoint, config)
    if config.max_seq_length > pre.model.max_len:
      raise ValueError(f'max_seq_length={config.max_seq_length} exceeds the pretrained '
                       f'model\'s positions ({pre.model.max_len}); lower '
                       f'config.max_seq_length')
    try:
      tokenizer = tokenizer_lib.load_for_config(pre.data)
    except FileNotFoundError:
      if config.init_checkpoint.partition(':')[0].endswith('.py'):
        raise
      raise FileNotFoundError(
          f'the tokenizer of config.init_checkpoint={config.init_checkpoint}, '
          f'{pre.data.tokenizer}, is not there (the run keeps no copy of it beside its '
          'config.json); put it back, or copy its files there (a vocab.txt with its '
          'tokenizer_config.json, or the sentencepiece .model)') from None
    if tokenizer.vocab_size != pre.model.vocab_size:
      raise ValueError(f'tokenizer {tokenizer.path} has {tokenizer.vocab_size} pieces but the '
                       f'checkpoint was trained with {pre.model.vocab_size}')
    return pre, tokenizer

  # ---- What each kind supplies.

  kind: str = ''  # set by registry.register: configs/finetune.py:<kind>/<name>

  @classmethod
  def configure(cls, config: ml_collections.ConfigDict, name: str) -> None:
    """Adds the kind's own fields to `config` (configs/finetune.py's common fields, unlocked)
    and sets its defaults; raises ValueError for a task `name` the kind does not have."""

  def download(self) -> None:
    """Fetches, before any host loads, what `load` would download into a folder the hosts
    may share and prepare there at once (tfds's preparation of the task's datasets, for an
    empty config.data_dir: several at once collide at their last rename): run by process 0
    alone, then every host loads (a host whose folder is its own fetches its own copy as it
    loads). Nothing by default (files of one's own; Hugging Face's cache takes its turns
    itself)."""

  @classmethod
  def names(cls) -> Tuple[str, ...]:
    """The task names of the kind (the grid's `--tasks <kind>` runs them all); () where
    any name goes (a task of the user's own)."""
    return ()

  # Whether a name outside names() is a task of the user's own too (NER: conll2003, or
  # tags of one's own under any name); names() is then what `--tasks <kind>` runs.
  takes_any_name = False

  @classmethod
  def checked_config(cls, config, mesh):
    """One-line errors for settings that would fail after the run directory was written
    (a kind extends it: its override calls this first, then reads its own fields),
    beginning with a config that lacks fields of its kind (its config.benchmark overridden
    to another kind's); returns `config`. Sweeps and grids also
    call it for each run before any starts, in a process without an accelerator backend and
    over a one-device jax.sharding.AbstractMesh: read only `mesh.shape` (no devices, no
    jax.process_count())."""
    probe = copy.deepcopy(config)
    probe.unlock()
    fields = set(workdir_lib.flatten(probe.to_dict()))
    cls.configure(probe, config.task)
    lacking = sorted(set(workdir_lib.flatten(probe.to_dict())) - fields)
    if lacking:
      raise ValueError(f'config.benchmark={config.benchmark}: this config lacks the fields of '
                       f'that kind ({", ".join(lacking)}); choose the kind with the config '
                       f'arg, configs/finetune.py:{config.benchmark}/<name>, not an override')
    config_checks.check_optimizer(config.optimizer)
    config_checks.check_seq_length(config.max_seq_length, 'config.max_seq_length')
    for name in ('batch_size', 'eval_batch_size', 'log_every_steps', 'num_epochs',
                 'bucket_multiple'):
      if config[name] <= 0:
        raise ValueError(f'config.{name}={config[name]}: give a positive number')
    for name in ('bucket_compile_seconds', 'bucket_flops_per_second'):
      if config[name] < 0:
        raise ValueError(f'config.{name}={config[name]}: give a number >= 0')
    if config.length_buckets < 0:
      raise ValueError(f'config.length_buckets={config.length_buckets}: give the number of '
                       'compiled lengths (0 pads every batch to max_seq_length)')
    dp = partitioning.data_parallel_size(mesh)
    if config.batch_size % dp or config.eval_batch_size % dp:
      raise ValueError(f'batch_size={config.batch_size} and eval_batch_size='
                       f'{config.eval_batch_size} must be multiples of the data-parallel size '
                       f'{dp} (mesh.data * mesh.fsdp)')
    return config

  @abc.abstractmethod
  def load(self, tokenizer) -> None:
    """Reads and featurizes the splits; sets self.name and self.train."""

  @abc.abstractmethod
  def build(self, spec):
    """The encoder with this task's head (models.build)."""

  @abc.abstractmethod
  def head_flops(self, length: int) -> float:
    """Forward FLOPs of the head for one example of `length` tokens (matmuls, 2 a
    multiply-add, as train_lib.flops_per_example counts; the encoder's are counted apart)."""

  @abc.abstractmethod
  def loss_fn(self, model) -> Callable:
    """(params, batch, rng, totals) -> (the batch's summed loss over its normaliser in
    `totals` (the whole step's: totals(batch)), {})."""

  @staticmethod
  def totals(batch) -> Dict[str, jax.Array]:
    """What a step's loss is normalised by, over the whole step's batch: its examples (a
    kind whose loss is per labelled token returns the count a batch holds on average,
    as ner.py does: a batch's own count would weigh a token of a length bucket of short
    examples several times one of long ones)."""
    return {'examples': jnp.asarray(batch['input_ids'].shape[0], jnp.float32)}

  @abc.abstractmethod
  def eval_features(self) -> List[Dict[str, np.ndarray]]:
    """Every feature set that is only evaluated or predicted (their lengths matter too)."""

  @abc.abstractmethod
  def evaluate_outputs(self, outputs) -> Dict[str, Dict[str, float]]:
    """{dev set name: metrics}, from outputs(features) -> the head's outputs per row."""

  def evaluate_tests(self, outputs) -> Dict[str, Dict[str, float]]:
    """{test set name: metrics} of the test sets whose labels are public (CoNLL-2003's),
    scored beside dev at every evaluation (logged as test_<name>, in results.json's and
    best/'s `test`); they pick nothing. None by default (GLUE's and SQuAD's are hidden)."""
    del outputs
    return {}

  @abc.abstractmethod
  def write_predictions(self, outputs, results, out_dir) -> None:
    """The prediction files: every process computes them and calls
    distributed.on_process_zero to have process 0 write them (with several processes a
    collective, so that a write that fails stops every process). Called by `finish` right
    after the final evaluation (`results`: its results), so what that evaluation kept
    (SQuAD's answers) is the final params' too."""

  @abc.abstractmethod
  def dev_headline(self, dev: Dict[str, Dict[str, float]]) -> float:
    """The task's headline dev metric (higher is better)."""

  def headline_metric(self) -> str:
    """The name of dev_headline's metric, as results.json and the grid's table give it."""
    return 'headline'

  def label_names(self) -> Sequence[str]:
    """The names of a classifier's outputs in id order, after `load` (best/ and final/
    record them: an HF export's id2label); () where the head has none."""
    return ()

  def flops_per_example(self, length: int) -> float:
    """Training FLOPs of one example padded to `length`: the encoder over every row, and
    the head."""
    return (train_lib.encoder_training_flops(self.spec, length) +
            train_lib.training_flops(self.head_flops(length)))

  # ---- trainer.Task.

  def prepare(self, start_step: int) -> None:
    """The length buckets, and the program's train step compiled for each (while the run
    goes on: one thread compiles the train step's lengths in the order the run needs them,
    then the prediction's)."""
    c = self.config
    self.buckets = length_buckets(c, self, self.run_dir, resuming=start_step > 0,
                                  mid_epoch=start_step % self.steps_per_epoch != 0)
    self.eval_buckets = eval_lengths(c, self, self.buckets)
    self.__start_step = start_step
    self.__compiler = (futures.ThreadPoolExecutor(1, thread_name_prefix='compile')
                      if c.compile_in_background and jax.process_count() == 1 else None)
    self.__predict = None
    if start_step < self.cadence.num_steps:
      program = self.program
      self.program = dataclasses.replace(program, train_step=Programs(
          program.train_step, (program.abstract,),
          self.__batch_of(c.batch_size, self.train), self.__lengths_by_first_use(),
          'train step', self.mesh, self.__compiler,
          after=train_lib.abstract_step_arguments(self.mesh)))
      self.__prediction()  # queued behind the train step's lengths

  def __prediction(self) -> Programs:
    """The program's eval step (the head's outputs) compiled for each evaluated length."""
    if self.__predict is None:
      self.__predict = Programs(
          self.program.eval_step, (self.program.abstract.params,),
          self.__batch_of(self.config.eval_batch_size, self.input_keys),
          self.eval_buckets, 'prediction', self.mesh, self.__compiler)
    return self.__predict

  def close(self) -> None:
    if self.__compiler is not None:  # a run that stops early leaves compilations queued
      self.__compiler.shutdown(wait=False, cancel_futures=True)  # (one running finishes)

  def __batch_of(self, batch_size, keys):
    """length -> the abstract batch of that length."""
    sharding = partitioning.batch_sharding(self.mesh)
    return lambda length: {
        k: jax.ShapeDtypeStruct((batch_size,) + ((length,) + self.train[k].shape[2:]
                                                 if k in self.sequence_keys
                                                 else self.train[k].shape[1:]),
                                self.train[k].dtype, sharding=sharding) for k in keys}

  def __lengths_by_first_use(self) -> List[int]:
    """The bucket lengths in the order the run's next steps need them."""
    spe, start = self.steps_per_epoch, self.__start_step
    plan = buckets_lib.train_batches(self.lengths, self.buckets, self.config.batch_size,
                                     self.config.seed, start // spe,
                                     self.config.group_by_length)
    order = [length for length, _ in plan[start % spe:]] + list(self.buckets)
    return list(dict.fromkeys(order))

  def batches(self, start_step: int):
    spe, bs = self.steps_per_epoch, self.config.batch_size
    for epoch in range(start_step // spe, self.config.num_epochs):
      plan = buckets_lib.train_batches(self.lengths, self.buckets, bs, self.config.seed, epoch,
                                       self.config.group_by_length)
      for i in range(start_step - epoch * spe if epoch == start_step // spe else 0, spe):
        length, idx = plan[i]
        cost = trainer.StepCost(examples=len(idx), length=length,
                                real_tokens=int(self.lengths[idx].sum()))
        yield train_lib.global_batch(buckets_lib.take(self.train, idx, length,
                                                      self.sequence_keys), self.mesh,
                                     whole=True), cost

  def predictor(self, params):
    """The function `outputs` that evaluate_outputs and write_predictions take: features ->
    the head's outputs for every row, under `params`."""
    return lambda features: run_model(self.__prediction(), params, features, mesh=self.mesh,
                                      buckets=self.eval_buckets,
                                      batch_size=self.config.eval_batch_size,
                                      token_outputs=self.token_outputs,
                                      input_keys=self.input_keys,
                                      sequence_keys=self.sequence_keys)

  def evaluate(self, params, step: int) -> trainer.Results:
    # metrics.jsonl lines {"step": s, "split": "dev_<set>", "accuracy": ...} (test_<set>)
    outputs = self.predictor(params)
    return {**{f'dev_{name}': values for name, values in self.evaluate_outputs(outputs).items()},
            **{f'test_{name}': values for name, values in self.evaluate_tests(outputs).items()}}

  @staticmethod
  def dev_results(results: trainer.Results) -> Dict[str, Dict[str, float]]:
    return {split[len('dev_'):]: values for split, values in results.items()
            if split.startswith('dev_')}

  @staticmethod
  def test_results(results: trainer.Results) -> Dict[str, Dict[str, float]]:
    return {split[len('test_'):]: values for split, values in results.items()
            if split.startswith('test_')}

  def headline(self, results: trainer.Results) -> float:
    return self.dev_headline(self.dev_results(results))

  def best_record(self, step: int, results: trainer.Results) -> dict:
    test = self.test_results(results)
    return {'epoch': step // self.steps_per_epoch, 'dev': self.dev_results(results),
            **({'test': test} if test else {})}

  def record_headline(self, record: dict) -> float:
    """From the record's dev metrics (STS-B's headline was Pearson before it was Spearman)."""
    try:
      return self.dev_headline(record['dev'])
    except (KeyError, TypeError):
      return record['headline']

  def finish(self, params, step, results, run: RunDir, best: Optional[dict]) -> dict:
    dev = self.dev_results(results)
    self.write_predictions(self.predictor(params), dev, str(run.path(RunDir.PREDICTIONS)))
    test = self.test_results(results)
    summary = {'task': self.name, 'step': step, 'dev': dev, **({'test': test} if test else {}),
               'headline': self.dev_headline(dev), 'headline_metric': self.headline_metric(),
               'best': best}
    run.write_json(RunDir.RESULTS, summary, indent=2)
    return summary
