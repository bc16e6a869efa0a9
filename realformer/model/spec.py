"""The encoder's resolved hyper-parameters: a frozen, hashable view of `config.model`.

`config.model.variant` names a preset (docs/design.md); the fields `block`, `attention`,
`residual_attention` and `synth_random_trainable` override it where they are not None, so
`--config.model.variant=preln` on the command line changes the whole family and
`--config.model.residual_attention=True` adds RealFormer's residual scores to any of them.
"""

import dataclasses
from typing import Any, Tuple

import jax
import jax.numpy as jnp

from realformer.model import blocks
from synthesizer import synthetic

# The presets: what each variant sets of the fields that may override it (resolve). A field
# a preset leaves out takes PRESET_DEFAULTS's value.
PRESET_DEFAULTS = dict(block='post_ln', attention='dot', residual_attention=False,
                       synth_random_trainable=True)
VARIANTS = {
    'postln': {},
    'preln': dict(block='pre_ln'),
    'realformer': dict(residual_attention=True),
    'synth_dense': dict(attention='dense'),
    'synth_random': dict(attention='random'),
    'synth_random_fixed': dict(attention='random', synth_random_trainable=False),
    'synth_factorized_dense': dict(attention='factorized_dense'),
    'synth_factorized_random': dict(attention='factorized_random'),
    'synth_dense_vanilla': dict(attention='dense+dot'),
    'synth_random_vanilla': dict(attention='random+dot'),
}
REMAT_POLICIES = ('none', 'full', 'dots', 'dots_no_batch', 'dots_flash')
FUSED_ATTENTION = ('auto', 'xla', 'cudnn', 'flash', 'off')
DENSE_IMPLS = ('auto', 'flax', 'cpu')  # realformer/layers/dense.py
LAST_LAYER = ('predicted', 'all')  # rows the last layer computes for the pretraining loss
GELUS = ('erf', 'tanh')  # GELU's exact form, or its tanh approximation
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
  multiple = max(1, int(multiple))
  return -(-vocab_size // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class EncoderSpec:
  """Everything the modules need, resolved and validated."""
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  mlp_dim: int
  max_len: int
  type_vocab_size: int = 2
  vocab_pad_multiple: int = 1
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  layer_norm_eps: float = 1e-12
  initializer_range: float = 0.02
  gelu: str = 'erf'
  block: str = 'post_ln'
  attention: Tuple[str, ...] = ('dot',)
  residual_attention: bool = False
  running_mean: bool = False
  synth_random_trainable: bool = True
  synth_random_init_std: float = 1.0
  synth_factorized_rank: int = 8
  synth_factorized_a: int = 0
  dtype: Any = jnp.float32
  scan_layers: bool = False
  remat_policy: str = 'none'
  fused_attention: str = 'auto'
  dense_impl: str = 'auto'
  last_layer: str = 'predicted'
  residual_dtype: Any = jnp.float32  # dtype of RealFormer's carried scores
  variant: str = 'postln'
  # The platform the program is compiled for ('cpu', 'gpu', 'tpu'); '' = jax's default
  # backend. Not a config key: realformer/tools/launch.py sets it when compiling for a TPU slice
  # from a CPU host, so the backend-dependent choices ('auto' dense layer and fused
  # attention) follow the target, not the compiling machine.
  platform: str = ''

  @property
  def target_platform(self) -> str:
    return self.platform or jax.default_backend()

  @property
  def plain_dot_product(self) -> bool:
    """Whether the attention is exactly softmax(Q K^T / sqrt(d_head) + mask) V: what a fused
    kernel (jax.nn.dot_product_attention) and HF's BertModel compute, so the only attention
    they may stand in for. A field that changes the attention's formula must make this
    False."""
    return self.attention == ('dot',) and not self.residual_attention

  @property
  def flash_fusable(self) -> bool:
    """Whether the logits are Q K^T / sqrt(d_head) (weighted, in a mixture) plus additive
    terms (other components' logits, RealFormer's previous scores), or those terms alone (the
    pure Synthesizers): what the flash kernels (realformer.layers.flash_attention) compute.
    Every variant but those with a component that declares itself not fusable."""
    return all(synthetic.component(c).fusable for c in self.attention if c != 'dot')

  @property
  def flash_asked(self) -> bool:
    """model.fused_attention=flash where a flash kernel would run in training: fusable
    logits under attention dropout (attention._use_flash; the checks of what that needs)."""
    return (self.fused_attention == 'flash' and self.flash_fusable
            and self.attention_dropout_rate > 0)

  @property
  def random_table(self) -> bool:
    """Whether a component keeps a random Synthesizer table, which `synth_random_trainable`
    trains or keeps fixed at its initial values."""
    fixed = dataclasses.replace(self, synth_random_trainable=False)
    return any(synthetic.component(c).fixed_params(fixed) for c in self.attention if c != 'dot')

  @property
  def name(self) -> str:
    """The variant, and what the encoder computes where its attention fields override the
    preset's (a Post-LN with `model.attention=dot+alibi` is not Post-LN; nor is a
    synth_random whose table is fixed)."""
    preset = preset_of(self.variant)
    table = self.random_table and self.synth_random_trainable != preset['synth_random_trainable']
    if ('+'.join(self.attention), self.residual_attention, self.block) == (
        preset['attention'], preset['residual_attention'], preset['block']) and not table:
      return self.variant
    return (f'{self.variant} (attention {"+".join(self.attention)}' +
            (' with residual scores' if self.residual_attention else '') +
            (f', {"trained" if self.synth_random_trainable else "fixed"} random table'
             if table else '') + f', {self.block})')

  @property
  def summary(self) -> str:
    """One line of what the encoder computes (a run's log says it at its start)."""
    biases = [c for c in self.attention if c != 'dot' and c not in self.mixture]
    notes = ([f'mixed: {"+".join(self.mixture)}'] if self.mixture else []) + (
        [f'{"+".join(biases)}: added with weight 1'] if biases and len(self.attention) > 1
        else [])
    attention = '+'.join(self.attention) + (f' ({"; ".join(notes)})' if notes else '')
    if self.random_table and not self.synth_random_trainable:
      attention += ', random table fixed'
    if self.residual_attention:
      attention += ' with residual scores' + (' (running mean)' if self.running_mean else '')
    return (f'{self.num_layers} layers x {self.hidden_size} ({self.num_heads} heads), '
            f'{self.block}, attention {attention}, {jnp.dtype(self.dtype).name}, '
            f'fused_attention {self.fused_attention}')

  @property
  def mixture(self) -> Tuple[str, ...]:
    """The components whose logits the learned mixture weights (the dot product and each
    component that declares itself `mixed`), in `attention`'s order; () for fewer than two:
    no mixture then, each component's logits added with weight 1."""
    mixed = tuple(c for c in self.attention if c == 'dot' or synthetic.component(c).mixed)
    return mixed if len(mixed) > 1 else ()

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def padded_vocab_size(self) -> int:
    return padded_vocab_size(self.vocab_size, self.vocab_pad_multiple)

  @property
  def factorized_ab(self) -> Tuple[int, int]:
    """(a, b) with a * b = max_len for Factorized Dense."""
    a = self.synth_factorized_a
    if a < 0:
      raise ValueError(f'model.synth_factorized_a={a}: give a positive divisor of '
                       f'model.max_len={self.max_len}, or 0 for the one nearest its square root')
    if not a:
      a = max(d for d in range(1, int(self.max_len ** 0.5) + 1) if self.max_len % d == 0)
    if self.max_len % a:
      raise ValueError(f'model.synth_factorized_a={a} does not divide model.max_len='
                       f'{self.max_len}; pick a divisor (a * b must equal max_len)')
    return a, self.max_len // a


PLATFORMS = ('', 'cpu', 'gpu', 'tpu')


def _dtype(key: str, value):
  if isinstance(value, str):
    if value not in DTYPES:
      raise ValueError(f'model.{key}={value!r}; choose one of {", ".join(DTYPES)}')
    return DTYPES[value]
  return value


def preset_of(variant: str) -> dict:
  """The preset's fields of `variant` (PRESET_DEFAULTS' where it names none; all of them
  for a variant that is not one)."""
  return dict(PRESET_DEFAULTS, **VARIANTS.get(variant, {}))


def preset_fields(model: dict) -> dict:
  """The preset's fields (PRESET_DEFAULTS') that a config's model section holds, as resolve
  reads them: its own value where it gives one (not None or ''), else its variant's preset's.
  So a config that spells out its preset's value (model.block=pre_ln on preln) names the
  same encoder as one that leaves it to the preset (None)."""
  preset = preset_of(model.get('variant', 'postln'))
  return {k: preset[k] if model[k] is None or model[k] == '' else model[k]
          for k in PRESET_DEFAULTS if k in model}


def resolve(cfg, platform: str = '') -> EncoderSpec:
  """`config.model` (ConfigDict or dict) -> EncoderSpec, with one-line errors for bad values.

  platform: the target platform of the compiled program ('' = jax's default backend).
  """
  if platform not in PLATFORMS:
    raise ValueError(f'platform {platform!r}; choose one of cpu, gpu, tpu')
  c = dict(cfg.to_dict() if hasattr(cfg, 'to_dict') else cfg)
  c.pop('platform', None)
  variant = c.pop('variant', 'postln')
  if variant not in VARIANTS:
    raise ValueError(f'model.variant={variant!r} is unknown; choose one of {", ".join(VARIANTS)}')
  preset = preset_fields({'variant': variant, **{k: c.pop(k, None) for k in PRESET_DEFAULTS}})
  block, attention = preset['block'], preset['attention']
  residual, trainable = preset['residual_attention'], preset['synth_random_trainable']
  components = tuple(p.strip() for p in attention.split('+') if p.strip())
  bad = [p for p in components if p != 'dot' and synthetic.component(p) is None]
  if bad or not components or len(set(components)) != len(components):
    raise ValueError(f'model.attention={attention!r}: expected distinct components joined by "+" '
                     f'from {", ".join(("dot",) + synthetic.known_names())} (or one of your own: '
                     f'synthesizer/<name>.py)')
  blocks.get(block)  # (an unknown name: one line listing the known ones)
  dtype = _dtype('dtype', c.pop('dtype', 'float32'))
  residual_dtype = c.pop('residual_dtype', 'float32')
  if residual_dtype not in ('float32', 'bfloat16', jnp.float32, jnp.bfloat16):
    raise ValueError(f'model.residual_dtype={residual_dtype!r}; choose float32 or bfloat16')
  residual_dtype = _dtype('residual_dtype', residual_dtype)
  fields = {f.name for f in dataclasses.fields(EncoderSpec)}
  unknown = sorted(set(c) - fields)
  if unknown:
    raise ValueError(f'unknown model config keys {unknown}; remove them or check their spelling')
  spec = EncoderSpec(block=block, attention=components, residual_attention=bool(residual),
                     synth_random_trainable=bool(trainable), dtype=dtype,
                     residual_dtype=residual_dtype, variant=variant, platform=platform, **c)
  # (vocab_size is not among them: a run on real data takes its tokenizer's.)
  for field in ('num_layers', 'hidden_size', 'num_heads', 'mlp_dim', 'max_len',
                'type_vocab_size'):
    if int(getattr(spec, field)) < 1:
      raise ValueError(f'model.{field}={getattr(spec, field)}: give a positive number')
  for field in ('dropout_rate', 'attention_dropout_rate'):
    if not 0 <= float(getattr(spec, field)) < 1:
      raise ValueError(f'model.{field}={getattr(spec, field)}: give a rate in [0, 1) '
                       '(BERT: 0.1)')
  for field in ('layer_norm_eps', 'initializer_range'):
    if not float(getattr(spec, field)) > 0:
      raise ValueError(f'model.{field}={getattr(spec, field)}: give a positive number '
                       '(BERT: 1e-12 and 0.02)')
  if spec.hidden_size % spec.num_heads:
    raise ValueError(f'model.hidden_size={spec.hidden_size} is not divisible by '
                     f'model.num_heads={spec.num_heads}')
  for field, choices in (('remat_policy', REMAT_POLICIES), ('fused_attention', FUSED_ATTENTION),
                         ('dense_impl', DENSE_IMPLS), ('last_layer', LAST_LAYER),
                         ('gelu', GELUS)):
    value = getattr(spec, field)
    if value not in choices:
      raise ValueError(f'model.{field}={value!r}; choose one of {", ".join(choices)}')
  if spec.fused_attention == 'cudnn' and platform not in ('', 'gpu'):
    raise ValueError(f'model.fused_attention=cudnn needs a GPU, not {platform}; use auto or xla')
  if (platform and spec.fused_attention == 'cudnn'  # (a stored config still builds anywhere)
      and spec.dtype not in (jnp.bfloat16, jnp.float16)):
    raise ValueError(f'model.fused_attention=cudnn needs model.dtype=bfloat16 or float16 '
                     f'(cuDNN\'s attention takes no {jnp.dtype(spec.dtype).name}); use auto, '
                     'which takes it where it can, or xla')
  if spec.flash_asked:
    head_dim = spec.head_dim
    if spec.target_platform == 'gpu' and (head_dim < 16 or head_dim & (head_dim - 1)):
      raise ValueError(f'model.fused_attention=flash needs a head size that is a power of 2 '
                       f'of at least 16 (Triton\'s arrays), not {head_dim} (hidden_size / '
                       'num_heads); use auto')
    if spec.target_platform == 'tpu' and spec.dtype == jnp.float16:
      raise ValueError('model.fused_attention=flash on a TPU takes bfloat16 or float32 '
                       '(Mosaic has no float16 tiles), not float16; use model.dtype=bfloat16')
  for c in components:  # each component's own checks of the settings it reads
    if c != 'dot':
      synthetic.component(c).check(spec)
  return spec
