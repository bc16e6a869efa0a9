"""Synthetic attention logits (Tay et al. 2020, arXiv 2005.00743), one module per variant.

Each module maps the layer input x [B, T, D] to logits [B or 1, H, T, T] in float32, before
the padding mask (added by the shared attention path for every variant). Given `rows`
[B, S], only those query rows are made: logits [B, H, S, T], row s being row rows[b, s] of
the full matrix (the last layer of pretraining, whose loss reads only [CLS] and the masked
positions). Lengths beyond `max_len` are an error: the synthesized matrices have exactly
max_len rows and columns and are sliced to the sequence length, never wrapped.

  Dense:             B_i = F(X_i) = W2 relu(W1 X_i + b1) + b2, W1: D->D, W2: D->H*max_len
                     (per head in W2; F is applied to each token independently; a
                     sequence of T tokens computes only the first T of each head's max_len
                     outputs, the rest of W2 and b2 left out of the matmul).
  Random:            B = R, a [H, max_len, max_len] parameter (trainable, or fixed at init).
  Factorized Dense:  A_i = W_A X_i in R^{H x a}, B_i = W_B X_i in R^{H x b}, a * b = max_len;
                     C_i = tile(A_i, b) * repeat(B_i, a): C_i[j*a + m] = A_i[m] B_i[j], the
                     flattened outer product of the two factors.
  Factorized Random: R = R1 R2^T, R1, R2 of shape [H, max_len, k].

Each is a LogitComponent, registered by name (`@register('dense')`): `model.attention`
names components joined by '+' (and 'dot', the scaled dot product, which the attention
layer computes itself), the presets in realformer/model/spec.py name them, and nothing else
does. A component declares, beside its maths, what the rest of the code needs to know of
it: its parameters' logical axes (given where they are created: the partitioning rules map
them to the mesh), its FLOPs, its fixed parameters, and whether the fused attention may add
its logits as a term. A new component is one more class: here, or in a file of its own,
synthesizer/<name>.py, which `component(name)` imports when a config first names it (so
every program, and a fine-tuning of a checkpoint trained with it, finds it).
"""

import functools
import importlib
import pkgutil
from typing import Any, ClassVar, Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from realformer.layers.dense import dense
from realformer.layers.rows import gather_rows, take_rows


def _check_length(length: int, max_len: int, name: str):
  if length > max_len:
    raise ValueError(f'sequence length {length} exceeds model.max_len={max_len} of the '
                     f'{name} synthesizer; shorten the input or raise model.max_len')


class LogitComponent(nn.Module):
  """An attention-logit component: the layer input x [B, T, D] (and `rows`) -> float32 logits
  [B or 1, H, S, T], before the padding mask. Its declarations:

    mixed             whether its logits join the learned mixture of `model.attention`'s
                      components (the Synthesizer paper's: weights w = softmax of learned
                      logits, one per mixed component and the dot product, summing to 1);
                      False adds them with weight 1, as a bias of the logits (a relative
                      position bias, ALiBi's distance penalty) is added;
    fusable           whether the flash kernels may take its logits as an additive term
                      (of the dot product's, or the logits alone where there is none:
                      realformer/model/attention.py, spec.flash_fusable); a component whose
                      logits do not simply add sets it False, and its variants run the
                      plain path;
    flops(spec, rows, length)   forward matmul FLOPs of one example in a layer computing
                      `rows` query rows over `length` keys (train_lib.flops_per_example adds
                      them, so the logged MFU counts the component);
    fixed_params(spec)  the names of its parameters (made by its own self.param) that never
                      train under `spec`: it stops their gradient itself, and the optimizer
                      leaves them alone (no update, no weight decay:
                      train_lib.fixed_params_fn);
    check(spec)       one-line errors for settings it cannot take (spec.resolve calls it).

  Its parameters' sharding follows the logical axis names they are created with
  (nn.with_logical_partitioning, layers.dense.dense; realformer/train/partitioning.py's rules
  map them to the mesh, and a mesh axis that does not divide its dimension is a one-line
  error naming the parameter). A component without parameters (a constant of the shapes)
  needs none of @nn.compact."""
  spec: Any  # the EncoderSpec (realformer/model/spec.py)
  mixed: ClassVar[bool] = True
  fusable: ClassVar[bool] = True

  @staticmethod
  def flops(spec, rows: int, length: int) -> float:
    del spec, rows, length
    return 0

  @staticmethod
  def fixed_params(spec) -> Tuple[str, ...]:
    del spec
    return ()

  @staticmethod
  def check(spec) -> None:
    del spec


SYNTHESIZERS: Dict[str, type] = {}


def register(name: str):
  """Class decorator: the LogitComponent that `model.attention` names `name`."""
  def add(cls):
    if not issubclass(cls, LogitComponent):
      raise TypeError(f'{cls.__name__} is not a LogitComponent')
    known = SYNTHESIZERS.get(name)
    if (name == 'dot' or not name.isidentifier() or (known is not None and (
        known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__))):
      raise ValueError(f'the logit component name {name!r} is taken or is not a Python '
                       'identifier (model.attention joins names with "+")')
    SYNTHESIZERS[name] = cls
    return cls
  return add


def component(name: str) -> Optional[type]:
  """The LogitComponent named `name`: registered here, or by synthesizer/<name>.py (imported
  on first use); None if there is none (this module, and a file that defines no
  LogitComponent, are none). A file of that name that fails to import, or that defines a
  component but registers none as `name`, is a one-line ValueError naming the fix."""
  if name not in SYNTHESIZERS and name.isidentifier() and name != 'dot':
    try:
      module = importlib.import_module(f'{__package__}.{name}')
    except Exception as e:  # pylint: disable=broad-except
      if isinstance(e, ModuleNotFoundError) and e.name == f'{__package__}.{name}':
        return None  # no such file
      raise ValueError(f'{__package__}/{name}.py failed to import ({type(e).__name__}: {e}); '
                       'fix the file (--verbose_errors shows the traceback)') from e
    own = [v for v in vars(module).values() if isinstance(v, type)
           and issubclass(v, LogitComponent) and v.__module__ == module.__name__]
    if name not in SYNTHESIZERS and (module.__name__ == __name__ or not own):
      return None
    if name not in SYNTHESIZERS:
      raise ValueError(f'{__package__}/{name}.py registers no logit component as {name!r}; '
                       f"decorate its LogitComponent with @register('{name}')")
  return SYNTHESIZERS.get(name)


def known_names() -> Tuple[str, ...]:
  """The registered components, then the files synthesizer/<name>.py not imported yet (but
  for helpers whose name starts with _): what an error about an unknown name lists."""
  package = importlib.import_module(__package__)
  files = [m.name for m in pkgutil.iter_modules(package.__path__)
           if not m.name.startswith('_') and f'{__package__}.{m.name}' != __name__]
  return tuple(dict.fromkeys(list(SYNTHESIZERS) + sorted(files)))


@functools.lru_cache(maxsize=None)
def trains(name: str, spec) -> bool:
  """Whether component `name` has parameters that train under `spec` (any parameter its
  init makes, less its fixed_params): whether its logits take a gradient."""
  module = component(name)(spec)
  x = jax.ShapeDtypeStruct((1, min(spec.max_len, 8), spec.hidden_size), jnp.float32)
  made = jax.eval_shape(lambda x: module.init(jax.random.PRNGKey(0), x), x).get('params', {})
  return bool(set(made) - set(component(name).fixed_params(spec)))


def module_name(name: str) -> str:
  """The name of a component's submodule in the attention layer (its parameters' path)."""
  return f'synth_{name}'


@register('dense')
class DenseSynthesizer(LogitComponent):
  @staticmethod
  def flops(spec, rows, length):
    d = spec.hidden_size
    return 2 * rows * d * d + 2 * rows * d * spec.num_heads * length  # (t of max_len columns)

  @nn.compact
  def __call__(self, x, rows=None):
    s = self.spec
    b, t, _ = x.shape
    _check_length(t, s.max_len, 'dense')
    x = x if rows is None else take_rows(x, rows)  # F sees each query token alone
    h = nn.relu(dense(s.hidden_size, ('embed', 'mlp'), s, 'hidden')(x))
    # Heads-major output ('joined_kv', like the query projection): tensor parallelism gives
    # each device its own heads' logits, as it gives each its own heads of Q K^T.
    # Of each head's max_len columns only the sequence's first t are computed (W2 and b2
    # cut before the matmul: the same logits as cutting its output).
    keys = lambda w: w.reshape(w.shape[:-1] + (s.num_heads, s.max_len))[..., :t].reshape(
        w.shape[:-1] + (s.num_heads * t,))
    logits = dense(s.num_heads * s.max_len, ('embed', 'joined_kv'), s, 'logits',
                   columns=keys)(h)
    logits = logits.reshape(b, x.shape[1], s.num_heads, t)  # [B, Tq, H, Tk]
    return jnp.transpose(logits, (0, 2, 1, 3)).astype(jnp.float32)  # [B, H, Tq, Tk]


@register('random')
class RandomSynthesizer(LogitComponent):
  # (flops: none counted; the table is batch-independent)

  @staticmethod
  def fixed_params(spec):
    return () if spec.synth_random_trainable else ('random_logits',)

  @nn.compact
  def __call__(self, x, rows=None):
    s = self.spec
    t = x.shape[1]
    _check_length(t, s.max_len, 'random')
    init = nn.with_logical_partitioning(nn.initializers.normal(s.synth_random_init_std),
                                        ('heads', 'synth_len', None))
    r = self.param('random_logits', init, (s.num_heads, s.max_len, s.max_len), jnp.float32)
    if not s.synth_random_trainable:
      r = jax.lax.stop_gradient(r)  # fixed: the optimizer also leaves it alone (see train)
    r = r[:, :t, :t]
    return r[None] if rows is None else gather_rows(r, rows, axis=1, batched=False)


@register('factorized_dense')
class FactorizedDenseSynthesizer(LogitComponent):
  @staticmethod
  def check(spec):
    spec.factorized_ab  # pylint: disable=pointless-statement  (a * b must be max_len)

  @staticmethod
  def flops(spec, rows, length):
    a, b = spec.factorized_ab
    return 2 * rows * spec.hidden_size * spec.num_heads * (a + b)

  @nn.compact
  def __call__(self, x, rows=None):
    s = self.spec
    b, t, _ = x.shape
    _check_length(t, s.max_len, 'factorized dense')
    fa, fb = s.factorized_ab
    h = s.num_heads
    x = x if rows is None else take_rows(x, rows)
    q = x.shape[1]
    a = dense(h * fa, ('embed', 'joined_kv'), s, 'factor_a')(x).reshape(b, q, h, 1, fa)
    c = dense(h * fb, ('embed', 'joined_kv'), s, 'factor_b')(x).reshape(b, q, h, fb, 1)
    logits = (a * c).reshape(b, q, h, fa * fb)[..., :t]  # index j*a + m = A[m] * B[j]
    return jnp.transpose(logits, (0, 2, 1, 3)).astype(jnp.float32)


@register('factorized_random')
class FactorizedRandomSynthesizer(LogitComponent):
  # (flops: none counted; R1 R2^T is batch-independent but for a pruned last layer's rows)

  @staticmethod
  def check(spec):
    if spec.synth_factorized_rank < 1:  # (0 would make every logit 0: uniform attention)
      raise ValueError(f'model.synth_factorized_rank={spec.synth_factorized_rank}: give a '
                       'positive rank (the paper: 8)')

  @staticmethod
  def fixed_params(spec):
    return () if spec.synth_random_trainable else ('random_factor_1', 'random_factor_2')

  @nn.compact
  def __call__(self, x, rows=None):
    s = self.spec
    t = x.shape[1]
    _check_length(t, s.max_len, 'factorized random')
    init = nn.with_logical_partitioning(nn.initializers.normal(s.synth_random_init_std),
                                        ('heads', 'synth_len', None))
    shape = (s.num_heads, s.max_len, s.synth_factorized_rank)
    r1 = self.param('random_factor_1', init, shape, jnp.float32)[:, :t]
    r2 = self.param('random_factor_2', init, shape, jnp.float32)[:, :t]
    if not s.synth_random_trainable:
      r1, r2 = jax.lax.stop_gradient(r1), jax.lax.stop_gradient(r2)
    if rows is None:
      return jnp.einsum('hqk,hsk->hqs', r1, r2)[None]
    r1 = gather_rows(r1, rows, axis=1, batched=False)  # [B, H, S, k]
    return jnp.einsum('bhqk,hsk->bhqs', r1, r2)

