"""Train state, optimizer, sharded init, train/eval steps, the Program that bundles them,
and FLOP counts.

The pieces are independent of the head and the loss, so every task builds its Program with
them (make_program; the pretraining objective's is realformer/train/pretraining.py's):

    tx = make_optimizer(config.optimizer, spec)
    schedule = make_schedule(config.optimizer, num_steps)
    state, shardings = create_train_state(model, tx, batch_shapes, mesh, seed)
    step = make_train_step(loss_fn, tx, mesh=mesh, shardings=shardings,
                           metrics_cls=..., totals_fn=..., grad_accum_steps=k)
    rates, rng = LearningRates(schedule), dropout_key(seed, mesh)
    state, metrics = step(state, global_batch, rates(i), rng)  # i: the host's step count

The step's learning rate and dropout key are its arguments, not constants compiled into it:
its program depends on shapes, the model and the optimizer's form only, so the runs of a
grid over learning rates, schedules, epochs and seeds load one compiled program from the
persistent cache (realformer/train/compile_cache.py) instead of compiling one each (only
LearningRates' small table of the schedule is their own).

`loss_fn(params, microbatch, rng, totals) -> (loss, {name: clu Metric})` (rng None means
evaluation: no dropout). `totals` is `totals_fn(whole_batch)`, the normalizers of the WHOLE
step's batch, so the microbatch losses add up to the loss of one big batch and accumulation
over k microbatches gives the same gradient as one batch of k times the size.
"""

import dataclasses
import math
from typing import Any, Callable, Dict, Optional, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from realformer import config_checks
from realformer.config_checks import warmup_steps
from realformer.layers import rows as rows_lib
from realformer.model.spec import EncoderSpec, resolve
from realformer.train import compile_cache
from realformer.train import metrics as metrics_lib
from realformer.train import partitioning
from synthesizer import synthetic


@flax.struct.dataclass
class TrainState:
  """step: completed updates (int32 scalar); params: unboxed model params; opt_state: optax."""
  step: jax.Array
  params: Any
  opt_state: Any

  def to_checkpoint(self) -> dict:
    return {'step': self.step, 'params': self.params, 'opt_state': self.opt_state}

  @classmethod
  def from_checkpoint(cls, tree: dict) -> 'TrainState':
    return cls(step=tree['step'], params=tree['params'], opt_state=tree['opt_state'])


# --------------------------------------------------------------------------------------
# Optimizer.
# --------------------------------------------------------------------------------------

def param_names(path) -> Tuple[str, ...]:
  """Dict keys along a pytree path (ignores box attributes and optax wrappers)."""
  return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def decay_mask(params) -> Any:
  """True where AdamW's (and LAMB's) weight decay applies: not LayerNorm parameters, not
  biases. Decided by name: a parameter is decayed unless its name ends in 'bias' or a module
  on its path has 'layer_norm' in its name, so a new parameter that should not be (a gate, a
  scale, an identity-initialised mix) is named accordingly or added here."""
  def decays(path, _):
    names = param_names(path)
    return not (names[-1].endswith('bias') or any('layer_norm' in n for n in names))
  return jax.tree_util.tree_map_with_path(decays, params)


def fixed_params_fn(spec: EncoderSpec, untrained: Optional[Callable[[Any], bool]] = None
                    ) -> Optional[Callable[[Any], Any]]:
  """params -> bool tree of parameters that must never change, or None when none are: those
  each logit component declares fixed under `spec` (LogitComponent.fixed_params; e.g. the
  fixed-random Synthesizer's table, variant synth_random_fixed), and those `untrained`
  names. The model stops the components' gradient, and the optimizer must also leave them
  alone (weight decay alone would otherwise shrink them)."""
  fixed = {synthetic.module_name(c): synthetic.component(c).fixed_params(spec)
           for c in spec.attention if c != 'dot'}
  fixed = {module: names for module, names in fixed.items() if names}
  if not fixed and untrained is None:
    return None
  def is_fixed(path) -> bool:  # a parameter the component created itself (self.param)
    names = param_names(path)
    return (len(names) > 1 and names[-1] in fixed.get(names[-2], ())) or bool(
        untrained and untrained(path))
  return lambda params: jax.tree_util.tree_map_with_path(lambda path, _: is_fixed(path), params)


def _warmed_up(peak: float, warmup: int, after: optax.Schedule) -> optax.Schedule:
  """A linear rise from 0 to `peak` over `warmup` steps, then `after` (from the warm-up's
  end)."""
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def _bert_schedule(peak: float, warmup: int, num_steps: int) -> optax.Schedule:
  warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
  decay = optax.linear_schedule(peak, 0.0, max(num_steps, 1))  # counted from step 0
  return lambda step: jnp.where(step < warmup, warm(step), decay(step))


# optimizer.schedule -> (peak, warm-up steps, num_steps) -> the schedule (make_schedule says
# each); config_checks.SCHEDULES names the same.
SCHEDULES = {
    'linear': lambda peak, warmup, num_steps: _warmed_up(
        peak, warmup, optax.linear_schedule(peak, 0.0, max(num_steps - warmup, 1))),
    'bert': _bert_schedule,
    'cosine': lambda peak, warmup, num_steps: _warmed_up(
        peak, warmup, optax.cosine_decay_schedule(peak, max(num_steps - warmup, 1))),
    'constant': lambda peak, warmup, num_steps: _warmed_up(
        peak, warmup, optax.constant_schedule(peak)),
}


def make_schedule(opt_config, num_steps: int) -> optax.Schedule:
  """step -> learning rate, evaluated on the host (LearningRates); the train step takes the
  value as an argument. Over the warm-up (warmup_steps(opt_config, num_steps)) every schedule
  rises linearly from 0 to the peak; then
    linear:   linear decay from the peak to 0 at num_steps (transformers'
              get_linear_schedule_with_warmup);
    bert:     BERT's optimization.py: peak * (1 - step / num_steps), the decay counted from
              step 0, so that it resumes at peak * (1 - warmup / num_steps);
    cosine:   cosine decay from the peak to 0 at num_steps;
    constant: the peak."""
  config_checks.check_optimizer(opt_config)  # a schedule of config_checks.SCHEDULES
  return SCHEDULES[opt_config.schedule](float(opt_config.learning_rate),
                                        warmup_steps(opt_config, num_steps), num_steps)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax.clip_by_global_norm's transformation, g * min(1, max_norm / ||g||), as a multiply.

  optax writes the clip as select(||g|| < max_norm, g, g / ||g|| * max_norm). XLA will not
  duplicate that divide into AdamW's two moment updates, so the clipped gradient is written
  out and read back, two extra passes over every parameter; a scalar multiply is fused into
  the moment updates instead (benchmarks/optimizer.py times both; BENCHMARKS.md). The values are
  optax's up to one rounding (t * (m / n) rather than t / n * m); the state is optax's
  (empty), so checkpoints are interchangeable. A NaN norm gives NaN updates, as optax's does.
  """
  def update_fn(updates, state, params=None):
    del params
    scale = jnp.minimum(1.0, max_norm / optax.tree.norm(updates))
    return jax.tree.map(lambda t: t * scale.astype(t.dtype), updates), state
  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def scale_by_layer_trust_ratio() -> optax.GradientTransformation:
  """LAMB's trust ratio: each layer's tensor's update u scaled by ||w|| / ||u|| (1 where
  either norm is 0), as optax.scale_by_trust_ratio does per array, except that a tensor of
  nn.scan's stacked layers ('layers' in its path, the layers on axis 0) takes one ratio per
  layer, so a scanned encoder trains as an unscanned one does."""
  def update_fn(updates, state, params):
    def scale(path, u, w):
      axes = tuple(range(1, u.ndim)) if 'layers' in param_names(path) else None
      norm = lambda x: jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=axes,
                                        keepdims=axes is not None))
      w_norm, u_norm = norm(w), norm(u)
      ratio = jnp.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
      return u * ratio.astype(u.dtype)
    return jax.tree_util.tree_map_with_path(scale, updates, params), state
  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def lamb(schedule: optax.Schedule, b1: float, b2: float, eps: float, weight_decay: float
         ) -> optax.GradientTransformation:
  """LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76
  minutes", Algorithm 2, as TensorFlow Addons' LAMB computes it, exclude_from_layer_
  adaptation defaulting to exclude_from_weight_decay; ALBERT's lamb_optimizer.py omits the
  bias correction): Adam's
  bias-corrected step m^ / (sqrt(v^) + eps), plus weight_decay * w where decay_mask decays,
  each such tensor's step then scaled by its layer's trust ratio (scale_by_layer_trust_ratio);
  LayerNorm parameters and biases take Adam's step with neither."""
  return optax.chain(
      optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
      optax.add_decayed_weights(weight_decay, decay_mask),
      optax.masked(scale_by_layer_trust_ratio(), decay_mask),
      optax.scale_by_learning_rate(schedule))


def scale_by_adam_without_bias_correction(b1: float, b2: float, eps: float
                                          ) -> optax.GradientTransformation:
  """Adam's step m / (sqrt(v) + eps) from moments that are not bias-corrected, as
  google-research/bert's AdamWeightDecayOptimizer takes it (optax's scale_by_adam always
  corrects them); the state is scale_by_adam's (count, mu, nu)."""
  def init_fn(params):
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32),
                                  mu=optax.tree.zeros_like(params),
                                  nu=optax.tree.zeros_like(params))

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
    step = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
    return step, optax.ScaleByAdamState(count=optax.safe_increment(state.count), mu=mu, nu=nu)
  return optax.GradientTransformation(init_fn, update_fn)


def bert_adamw(schedule: optax.Schedule, b1: float, b2: float, eps: float, weight_decay: float
               ) -> optax.GradientTransformation:
  """google-research/bert's AdamWeightDecayOptimizer (optimization.py): Adam's step from
  moments without bias correction, plus weight_decay * w where decay_mask decays, times the
  learning rate. With optimizer.schedule=bert it is BERT's optimization, step for step; its
  early steps are larger than AdamW's (docs/design.md)."""
  return optax.chain(scale_by_adam_without_bias_correction(b1, b2, eps),
                     optax.add_decayed_weights(weight_decay, decay_mask),
                     optax.scale_by_learning_rate(schedule))


# optimizer.name -> (schedule, config.optimizer) -> the optimizer, which reads its own fields
# of config.optimizer and whose last transformation scales by the schedule's rate:
# make_optimizer builds it at a rate of 1 and the train step applies the rate
# (apply_learning_rate), the same to the bit only then (a test holds every entry to it). A
# new optimizer is an entry here and its name in config_checks.OPTIMIZERS (docs/design.md,
# "Adding an optimizer").
OPTIMIZERS = {
    'adamw': lambda schedule, o: optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps,
                                             weight_decay=o.weight_decay, mask=decay_mask),
    'bert_adamw': lambda schedule, o: bert_adamw(schedule, o.b1, o.b2, o.eps, o.weight_decay),
    'lamb': lambda schedule, o: lamb(schedule, o.b1, o.b2, o.eps, o.weight_decay)}


def _unit_learning_rate(count):
  del count
  return jnp.ones((), jnp.float32)


def make_optimizer(opt_config, spec: EncoderSpec,
                   untrained: Optional[Callable[[Any], bool]] = None
                   ) -> optax.GradientTransformation:
  """The optimizer of every program, at a learning rate of 1: AdamW (adamw: PyTorch's, Adam's
  moments bias-corrected), BERT's own AdamWeightDecayOptimizer (bert_adamw: not corrected)
  or LAMB (lamb; large-batch pretraining) after global-norm clipping, weight decay masked by path
  (decay_mask), and the encoder's fixed parameters (fixed_params_fn(spec)) never updated, so
  neither pretraining nor fine-tuning moves them, nor those `untrained` (a param path ->
  bool) names (a parameter no loss reaches, which weight decay alone would shrink). The train step multiplies its updates by
  the step's learning rate (apply_learning_rate): the optimizer's last transformation is the
  learning rate's scale, so that is the optimizer at that rate, to the bit (the sign flip by
  a rate of 1 is exact). Its state is what optax's schedule-driven optimizer keeps (a count),
  so checkpoints are unchanged.

  opt_config: config.optimizer (name, schedule, b1, b2, eps, weight_decay, clip_norm; the
  learning rate and its schedule are make_schedule's). spec: the encoder's resolved spec.
  Works on boxed (nn.Partitioned) or plain param trees whose fixed parameters may sit under
  any prefix (e.g. 'encoder').
  """
  config_checks.check_optimizer(opt_config)
  frozen = fixed_params_fn(spec, untrained)
  parts = []
  if opt_config.clip_norm and opt_config.clip_norm > 0:
    parts.append(clip_by_global_norm(float(opt_config.clip_norm)))
  parts.append(OPTIMIZERS[opt_config.get('name', 'adamw')](_unit_learning_rate, opt_config))
  tx = optax.chain(*parts)
  if frozen is not None:
    labels = lambda params: jax.tree.map(lambda f: 'frozen' if f else 'trained',
                                         frozen(params))
    tx = optax.multi_transform({'trained': tx, 'frozen': optax.set_to_zero()}, labels)
  return tx


def apply_learning_rate(updates, learning_rate: jax.Array):
  """make_optimizer's updates (at a learning rate of 1) at `learning_rate` (a scalar)."""
  return jax.tree.map(lambda u: u * learning_rate.astype(u.dtype), updates)


class LearningRates:
  """step -> the schedule's learning rate for the update that starts at `step`, an np.float32
  for the train step's argument: the schedule's own jnp operations, compiled for blocks of
  BLOCK steps at a time on the run's devices (every process computes the same blocks at the
  same steps), the values the step computed when the schedule was compiled into it. Only the
  first step of each block waits for the device. That small program ('jit_learning_rates', a
  tenth of a second) holds the schedule's constants: the one program a run of another
  learning rate or length compiles anew."""
  BLOCK = 4096

  def __init__(self, schedule: optax.Schedule):
    def learning_rates(steps):
      return jax.vmap(schedule)(steps)
    self._values = jax.jit(learning_rates)
    self._block, self._table = None, None

  def __call__(self, step: int) -> np.float32:
    block, i = divmod(int(step), self.BLOCK)
    if block != self._block:
      steps = np.arange(block * self.BLOCK, (block + 1) * self.BLOCK, dtype=np.int32)
      self._block, self._table = block, np.asarray(self._values(steps), np.float32)
    return self._table[i]


def dropout_key(seed: int, mesh) -> jax.Array:
  """PRNGKey(seed), replicated over the mesh: the train step's dropout key argument (every
  process makes the same)."""
  key = np.asarray(jax.random.PRNGKey(seed))
  return jax.make_array_from_callback(key.shape, NamedSharding(mesh, PartitionSpec()),
                                      lambda index: key[index])


def abstract_step_arguments(mesh) -> Tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
  """The train step's learning rate and dropout key as the trainer passes them, shapes and
  shardings (dropout_key's replicated key), to lower the step ahead of time: the program is
  then the one the trainer runs, and its compilation-cache entry the run's. (A key without
  its sharding lowers to another program.)"""
  replicated = NamedSharding(mesh, PartitionSpec())
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  return (jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated),
          jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated))


# --------------------------------------------------------------------------------------
# Sharded initialization.
# --------------------------------------------------------------------------------------

def _init_batch(batch_shapes, mesh):
  """Zeros shaped like the batch, with one row per data-parallel shard (init only needs
  the shapes of the features; a full batch would waste activation memory)."""
  rows = partitioning.data_parallel_size(mesh)
  return {k: jnp.zeros((rows,) + tuple(v.shape[1:]), v.dtype)
          for k, v in batch_shapes.items()}


def tree_shardings(boxed_tree, mesh):
  """NamedSharding per leaf: from the logical names of boxed (nn.Partitioned) leaves,
  replicated for plain leaves; empty nodes (optax's MaskedNode) stay empty."""
  replicated = NamedSharding(mesh, PartitionSpec())
  is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)

  def sharding(x):
    if not is_box(x):
      return replicated
    if not jax.tree.leaves(x.unbox()):  # a box around optax's MaskedNode
      return x.unbox()
    if (len(x.unbox().shape) != len(x.names) or  # an optimizer's state of another shape than
        partitioning.uneven_split(x, mesh)):      # its parameter's (Adafactor's factored
      return replicated                           # moments, placeholders), in its box
    return partitioning.logical_to_sharding(x, mesh)
  return jax.tree.map(sharding, boxed_tree, is_leaf=is_box)


def state_shardings(model: nn.Module, tx: optax.GradientTransformation, batch_shapes,
                    mesh) -> Tuple[TrainState, TrainState]:
  """(abstract TrainState of ShapeDtypeStructs, TrainState of NamedShardings).

  Shapes come from jax.eval_shape (nothing is allocated); shardings from the params'
  logical axis names and partitioning.LOGICAL_AXIS_RULES. Optimizer moments mirror the
  params' sharding; scalars (counts, step), and state that the parameter's split does not
  fit (a factored moment of fewer axes, a placeholder), are replicated. A mesh.tensor that
  does not divide the heads is refused or warned about first (partitioning.check_heads).
  """
  partitioning.check_heads(model.spec, mesh)
  with partitioning.traced_on(mesh):
    boxed = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), _init_batch(batch_shapes, mesh))['params'])
    boxed_opt = jax.eval_shape(tx.init, boxed)
  partitioning.check_divides(boxed, mesh)
  replicated = NamedSharding(mesh, PartitionSpec())
  shardings = TrainState(step=replicated, params=tree_shardings(boxed, mesh),
                         opt_state=tree_shardings(boxed_opt, mesh))
  abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
                        params=nn.unbox(boxed), opt_state=nn.unbox(boxed_opt))
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  return abstract, shardings


def create_train_state(model: nn.Module, tx: optax.GradientTransformation, batch_shapes,
                       mesh, seed: int, params=None) -> Tuple[TrainState, TrainState]:
  """Initialize params and optimizer directly into their shardings: (state, shardings).

  batch_shapes: a dict of arrays or ShapeDtypeStructs with the per-step batch's shapes.
  params: None, or the model's unboxed params tree with arrays where they are known
  (restored from a checkpoint, in the shardings the state gets) and None where they are to
  be drawn: the state holds copies of those arrays and the seeded init's values elsewhere
  (the values a whole init gives there), and its program computes only the draws it keeps
  (XLA drops the others).
  """
  _, shardings = state_shardings(model, tx, batch_shapes, mesh)

  def init(rng, known):
    drawn = nn.unbox(model.init(rng, _init_batch(batch_shapes, mesh))['params'])
    params = drawn if known is None else jax.tree.map(
        lambda k, d: d if k is None else k, known, drawn, is_leaf=lambda x: x is None)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  with partitioning.traced_on(mesh), compile_cache.kept():  # (a grid's next run loads it)
    state = jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(seed), params)
  return state, shardings


# --------------------------------------------------------------------------------------
# Train and eval steps.
# --------------------------------------------------------------------------------------

def split_microbatches(batch, k: int, mesh):
  """[B, ...] -> [k, B/k, ...]; microbatch i holds rows i, k+i, 2k+i, ... so that each
  device's rows stay on that device (no resharding), and the union is the whole batch."""
  spec = NamedSharding(mesh, PartitionSpec(None, ('data', 'fsdp')))

  def split(x):
    y = x.reshape((x.shape[0] // k, k) + x.shape[1:]).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(y, spec)
  return jax.tree.map(split, batch)


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, *, mesh,
                    shardings: TrainState, metrics_cls, totals_fn: Callable,
                    grad_accum_steps: int = 1) -> Callable:
  """A jitted (state, batch, learning_rate, rng) -> (state, metrics) with the state donated.

  tx: make_optimizer's (at a learning rate of 1); learning_rate: this update's rate, a
  float32 scalar (LearningRates(schedule)(step), or a time budget's); rng: the run's dropout
  key (dropout_key(seed, mesh)). Both are arguments so that one compiled program serves every
  learning rate, schedule and seed.

  loss_fn(params, microbatch, rng, totals) -> (loss, {name: clu Metric}); totals_fn(batch)
  gives the whole batch's normalizers (see the module docstring). metrics_cls: a clu
  Collection whose fields are loss, grad_norm (Average), learning_rate (LastValue) and the
  names loss_fn returns; the step merges loss_fn's metrics over the microbatches.
  The batch is a dict of global arrays sharded over (data, fsdp) on axis 0. Dropout keys
  are fold_in(fold_in(rng, step), microbatch), so a resumed run draws the same masks.
  A non-finite loss or gradient norm is left to the caller, which checks every step's before
  it saves or evaluates (trainer.Trainer._check_finite); a select over the state here made
  XLA copy both Adam moments every step (it cannot update them in place under the select).
  """
  k = int(grad_accum_steps)

  def step_fn(state: TrainState, batch, learning_rate, rng):
    with nn.logical_axis_rules(partitioning.LOGICAL_AXIS_RULES):
      totals = totals_fn(batch)
      step_key = jax.random.fold_in(rng, state.step)
      grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
      if k == 1:
        (loss, stats), grads = grad_fn(state.params, batch, jax.random.fold_in(step_key, 0),
                                       totals)
      else:
        micro = split_microbatches(batch, k, mesh)

        # The running gradient sum lives in the params' sharding (FSDP keeps it sharded).
        like_params = lambda t: jax.lax.with_sharding_constraint(t, shardings.params)

        def body(carry, xs):
          grads_sum, loss_sum = carry
          i, mb = xs
          (l, st), g = grad_fn(state.params, mb, jax.random.fold_in(step_key, i), totals)
          return (like_params(jax.tree.map(jnp.add, grads_sum, like_params(g))),
                  loss_sum + l), st

        zeros = like_params(jax.tree.map(jnp.zeros_like, state.params))
        (grads, loss), stacked = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)),
                                              (jnp.arange(k), micro))
        stats = jax.tree.map(lambda x: x[0], stacked)
        for i in range(1, k):
          stats = {n: m.merge(jax.tree.map(lambda x: x[i], stacked[n]))
                   for n, m in stats.items()}
      grad_norm = optax.tree.norm(grads)
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, apply_learning_rate(updates, learning_rate))
      new = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
      out = metrics_lib.collection(
          metrics_cls, loss=metrics_lib.average(loss, 1.0),
                        grad_norm=metrics_lib.average(grad_norm, 1.0),
                        learning_rate=metrics_lib.last_value(learning_rate),
                        **stats)
      return new, out

  data = partitioning.batch_sharding(mesh)
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.jit(step_fn, in_shardings=(shardings, data, replicated, replicated),
                 out_shardings=(shardings, replicated), donate_argnums=(0,))


def make_eval_step(fn: Callable, *, mesh, params_sharding) -> Callable:
  """A jitted (params, batch) -> fn(params, batch), its outputs whole on every process: the
  evaluation of every task (pretraining's loss_metrics, fine-tuning's head outputs)."""
  def eval_fn(params, batch):
    with nn.logical_axis_rules(partitioning.LOGICAL_AXIS_RULES):
      return fn(params, batch)

  return jax.jit(eval_fn, in_shardings=(params_sharding, partitioning.batch_sharding(mesh)),
                 out_shardings=NamedSharding(mesh, PartitionSpec()))


def loss_metrics(loss_fn: Callable, metrics_cls, totals_fn: Callable, *, microbatches: int = 1,
                 mesh=None) -> Callable:
  """(params, batch) -> metrics_cls of loss_fn's sums, deterministic (no dropout);
  metrics_cls derives the loss from them (make_eval_step's fn). With `microbatches` (the
  train step's grad_accum_steps; `mesh` then too) the batch is evaluated in that many
  microbatches one after the other, as the train step takes it, and their sums merged:
  a batch that needs accumulation to train does not need the whole batch's activations at
  once to be evaluated."""
  def one(params, batch):
    _, stats = loss_fn(params, batch, None, totals_fn(batch))
    return metrics_lib.collection(metrics_cls, **stats)

  def fn(params, batch):
    if microbatches == 1:
      return one(params, batch)
    micro = split_microbatches(batch, microbatches, mesh)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(
        one, params, jax.tree.map(lambda x: x[0], micro)))  # (sums of nothing yet)
    merged, _ = jax.lax.scan(lambda sums, mb: (sums.merge(one(params, mb)), None), zeros, micro)
    return merged
  return fn


def global_batch(batch: Dict[str, np.ndarray], mesh, whole: bool = False
                 ) -> Dict[str, jax.Array]:
  """Host arrays -> global arrays sharded over (data, fsdp) on axis 0 (multi-host safe):
  `batch` holds this host's rows of the global batch (its rows / process count; the
  pretraining stream), or with whole=True every row (each host holding the same global
  batch; fine-tuning), of which each device takes its own."""
  sharding = partitioning.batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(
      sharding, np.asarray(v), np.shape(v) if whole else None) for k, v in batch.items()}


# --------------------------------------------------------------------------------------
# A program: what the trainer trains (pretraining's is also compiled ahead of time by launch.py).
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Program:
  """Everything the trainer needs of a model on a mesh, built before anything is allocated
  (make_program)."""
  model: nn.Module
  tx: optax.GradientTransformation  # at a learning rate of 1 (make_optimizer)
  schedule: optax.Schedule          # step -> learning rate (the step takes it: LearningRates)
  peak_learning_rate: float
  mesh: jax.sharding.Mesh
  seed: int                         # of the init and of the dropout masks
  batch_shapes: dict                # ShapeDtypeStructs of one step's global batch
  abstract: TrainState              # ShapeDtypeStructs with their shardings
  shardings: TrainState
  # Jitted (state, batch, learning_rate, rng) -> (state, metrics) (make_train_step); a task
  # may put an object called the same way in its place (fine-tuning's programs per length).
  train_step: Callable
  eval_step: Callable               # jitted (params, batch) -> outputs (make_eval_step)
  flops_per_example: Callable[[int], float]  # training FLOPs of one example of T tokens

  def init(self, params=None) -> TrainState:
    """The seeded init, made in its shardings; `params`: the arrays already known, None
    where the init draws (create_train_state)."""
    state, _ = create_train_state(self.model, self.tx, self.batch_shapes, self.mesh,
                                  self.seed, params)
    return state

  def dropout_key(self) -> jax.Array:
    return dropout_key(self.seed, self.mesh)


def make_program(model: nn.Module, opt_config, num_steps: int, mesh, seed: int,
                 batch_shapes: dict, *, loss_fn: Callable, metrics_cls, eval_fn: Callable,
                 flops_per_example: Callable[[int], float], totals_fn: Callable,
                 grad_accum_steps: int = 1, untrained=None) -> Program:
  """The Program of `model` (built on model.spec) trained on `loss_fn` with
  config.optimizer `opt_config` for `num_steps` steps; eval_fn(params, batch) -> the
  evaluation's outputs (make_eval_step). untrained: a param path -> whether the optimizer
  leaves that parameter as it is (make_optimizer)."""
  tx = make_optimizer(opt_config, model.spec, untrained)
  abstract, shardings = state_shardings(model, tx, batch_shapes, mesh)
  return Program(
      model=model, tx=tx, schedule=make_schedule(opt_config, num_steps),
      peak_learning_rate=float(opt_config.learning_rate), mesh=mesh, seed=int(seed),
      batch_shapes=batch_shapes, abstract=abstract, shardings=shardings,
      train_step=make_train_step(loss_fn, tx, mesh=mesh, shardings=shardings,
                                 metrics_cls=metrics_cls, totals_fn=totals_fn,
                                 grad_accum_steps=grad_accum_steps),
      eval_step=make_eval_step(eval_fn, mesh=mesh, params_sharding=shardings.params),
      flops_per_example=flops_per_example)


# --------------------------------------------------------------------------------------
# Checks made before anything compiles.
# --------------------------------------------------------------------------------------

def check_batch_layout(global_batch_size: int, grad_accum_steps: int, mesh,
                       process_count: int):
  """One-line errors for batch sizes the mesh, the hosts or the accumulation cannot split."""
  dp = partitioning.data_parallel_size(mesh)
  b, k = int(global_batch_size), int(grad_accum_steps)
  if b < 1:
    raise ValueError(f'train.batch_size={b}: give a positive number of sequences per step')
  config_checks.check_accumulation(b, k)
  unit = math.lcm(process_count, k * dp)  # (what every check below asks, at once)
  if b % process_count:
    raise ValueError(f'train.batch_size={b} does not divide over {process_count} processes '
                     f'(jax\'s, each feeding its share); make it a multiple of {unit}, which '
                     'the mesh and the accumulation divide too')
  if (b // k) % dp:
    raise ValueError(f'train.batch_size={b} / grad_accum_steps={k} = {b // k} examples per '
                     f'microbatch is not a multiple of the data-parallel size {dp} (mesh.data '
                     f'* mesh.fsdp); make train.batch_size a multiple of {unit}')
  # Each host feeds its own batch_size / process_count rows, so the hosts must hold
  # distinct rows: the tensor axis (batch replicated over it) must stay within a host.
  # (Counted from the devices' process indices, for every process, so this also works for
  # the compile-only devices of a TPU slice that is not attached.)
  rows = partitioning.batch_sharding(mesh).devices_indices_map((b,))
  per_process = {}
  for d, idx in rows.items():
    per_process.setdefault(d.process_index, set()).add(tuple(idx[0].indices(b)))
  if any(len(blocks) * (b // dp) * process_count != b for blocks in per_process.values()):
    raise ValueError(f'mesh {dict(mesh.shape)}: the tensor axis spans several processes, so '
                     f'they would share batch rows; keep mesh.tensor within one host')


# --------------------------------------------------------------------------------------
# FLOP count.
# --------------------------------------------------------------------------------------

def flops_per_example(model_config, seq_len: int, num_predictions: int,
                      next_sentence: bool = True) -> float:
  """Training FLOPs of one example (matmuls only; 2 FLOPs per multiply-add).

  With T = seq_len, P = num_predictions, D = hidden, F = mlp_dim, H = heads,
  L = layers, V = the padded vocabulary, M = max_len, and R = the rows a layer computes
  (T, or in the last layer with model.last_layer='predicted' and unscanned layers P + 1
  rounded up to a multiple of 8 where that is fewer: rows.num_last_layer_rows),
  forward FLOPs are

    per layer:  value projection (all T rows)          2 T D^2
                output projection                      2 R D^2
                query + key projections (if 'dot')     2 R D^2 + 2 T D^2
                Q K^T and probs @ V                    4 R T D   (QK^T only if 'dot': 2 R T D)
                Synthesizer components                 their own (LogitComponent.flops):
                  dense                                2 R D^2 + 2 R D H M
                  factorized dense                     2 R D H (a + b)
                MLP                                    4 R D F
    heads:      pooler + NSP (next_sentence)               2 D^2 + 4 D
                MLM transform + tied decoder (P slots) 2 P D^2 + 2 P D V

  and training = 3 x forward (the backward pass costs two forwards), less one 2 R T D a layer
  where no logit takes a gradient (a fixed random table alone: the backward pass forms the
  values' gradient but not the probabilities'). Embedding lookups,
  softmax, LayerNorm, the row selections and the random synthesizers' products (batch-
  independent but for the factorized one's rows in a pruned last layer) are not counted.
  These are the FLOPs the step performs: a last layer over every row (HF's
  BertForPreTraining) does more work for the same loss.
  """
  s = model_config if isinstance(model_config, EncoderSpec) else resolve(model_config)
  p, d = num_predictions, s.hidden_size
  pruned = s.last_layer == 'predicted' and not s.scan_layers
  last = rows_lib.num_last_layer_rows(p, seq_len) if pruned else seq_len
  heads = 2 * p * d * d + 2 * p * d * s.padded_vocab_size + (
      2 * d * d + 4 * d if next_sentence else 0)
  return encoder_training_flops(s, seq_len, last) + training_flops(heads)


def encoder_training_flops(spec: EncoderSpec, seq_len: int,
                           last_rows: Optional[int] = None) -> float:
  """Training FLOPs of the encoder's layers for one example (flops_per_example's table):
  3 x forward, less the probabilities' gradient, 2 R T D a layer, where no logit takes a
  gradient (a fixed random table alone, or with components without trainable parameters;
  a mixture's weights train, so a mixture takes one)."""
  last = seq_len if last_rows is None else last_rows
  flops = training_flops(encoder_flops(spec, seq_len, last))
  if not ('dot' in spec.attention or spec.mixture or
          any(synthetic.trains(c, spec) for c in spec.attention)):
    flops -= 2 * seq_len * spec.hidden_size * ((spec.num_layers - 1) * seq_len + last)
  return flops


def encoder_flops(spec: EncoderSpec, seq_len: int, last_rows: Optional[int] = None) -> float:
  """Forward FLOPs of the encoder's layers for one example of seq_len tokens, the last layer
  computing `last_rows` rows (default: every row); flops_per_example's table."""
  s, t = spec, seq_len
  d, f = s.hidden_size, s.mlp_dim

  def layer(r):
    flops = 2 * t * d * d + 2 * r * d * d + 2 * r * t * d + 4 * r * d * f
    if 'dot' in s.attention:
      flops += 2 * r * d * d + 2 * t * d * d + 2 * r * t * d
    for c in s.attention:  # what each Synthesizer component declares
      if c != 'dot':
        flops += synthetic.component(c).flops(s, r, t)
    return flops

  return (s.num_layers - 1) * layer(t) + layer(t if last_rows is None else last_rows)


def training_flops(forward_flops: float) -> float:
  """A training step's FLOPs from the forward pass's: the backward costs two forwards."""
  return 3.0 * forward_flops
