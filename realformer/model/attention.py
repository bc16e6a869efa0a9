"""One self-attention path for every encoder family; variants differ only in the logits.

    logits = sum_c w_c * logits_c            (components c: dot, dense, random, ...;
                                              w = softmax of learned mixture weights over
                                              spec.mixture, or 1: a single mixed component,
                                              or one declared not `mixed`, a logit bias)
    RealFormer (residual_attention):         cur = logits + prev    (prev = 0 at layer 0)
                                             logits = cur / (l + 1) if running_mean else cur
    probs = dropout(softmax(logits + mask))  (mask: 0 for real keys, NEG_INF for padding)
    out   = W_o (probs @ V)

Given `rows` [B, S] (the last layer of pretraining: [CLS] and the masked positions, the only
rows the losses read), only those query rows are computed: keys and values still come from
every token, and each variant's logits are its full logits' rows (RealFormer's carried
scores included), so the selected outputs equal the full layer's (under attention dropout,
in distribution: the mask of the pruned [B, H, S, T] probabilities is drawn for its own
rows, not the full layer's).

The RealFormer scores passed to the next layer are `cur`: the running sum of the layers'
own scaled scores, without mask, mean division or dropout (official realformer.py). The
vanilla component is Q K^T / sqrt(d_head), scaled before anything is added.
"""

import functools
import math
from typing import Optional

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp

from realformer.layers import dropout as dropout_lib
from realformer.layers import flash_attention as flash_lib
from realformer.layers import flash_attention_tpu as flash_tpu_lib
from realformer.layers.dense import dense
from realformer.layers.rows import gather_rows, take_rows
from realformer.model import blocks
from realformer.model.spec import EncoderSpec
from synthesizer import synthetic

# Finite, so a row with every key masked gives a uniform distribution, never NaN.
NEG_INF = -1e9


def mask_bias(attention_mask: jax.Array) -> jax.Array:
  """[B, T] (1 = real token) -> additive float32 bias [B, 1, 1, T]."""
  real = attention_mask.astype(bool)[:, None, None, :]
  return jnp.where(real, 0.0, NEG_INF).astype(jnp.float32)


def in_dtype(bias: jax.Array, dtype) -> jax.Array:
  """`bias` cast to `dtype`, NEG_INF kept finite there (float16's range ends at 65504, where
  -1e9 would become -inf and a row with every key masked would give NaN)."""
  return jnp.maximum(bias, -0.5 * jnp.finfo(dtype).max).astype(dtype)


def _use_flash(spec: EncoderSpec, deterministic: bool, capture: bool, rows) -> bool:
  """Whether a flash kernel (realformer.layers.flash_attention on GPUs, flash_attention_tpu
  on TPUs) computes this layer: in training, with attention dropout, for logits that are a
  dot product plus additive terms or those terms alone (spec.flash_fusable: every variant,
  the pure Synthesizers included), where asked (`flash`) or under `auto`: on TPUs for every
  such variant but in float16 (Mosaic has no float16 tiles), with threefry dropout keys and
  whole heads on each device (flash_attention.whole_heads_here), on GPUs for plain
  dot-product attention in bfloat16 where the kernel runs (flash_attention.runs_here):
  where it was timed faster than the plain path (float16, untimed and without loss
  scaling, keeps the plain path unless asked). Without attention dropout `flash` is
  `auto`. Not for the pruned last layer (its few query rows): the plain path computes that
  one."""
  if capture or rows is not None or deterministic:
    return False
  if spec.flash_asked:
    return True
  if (spec.fused_attention != 'auto' or not spec.flash_fusable
      or spec.attention_dropout_rate <= 0):
    return False
  if spec.target_platform == 'tpu':  # (Mosaic has no float16 tiles)
    return spec.dtype != jnp.float16 and flash_lib.whole_heads_here(spec.num_heads)
  return (spec.plain_dot_product and spec.target_platform == 'gpu'
          and spec.dtype == jnp.bfloat16
          and flash_lib.runs_here(spec.num_heads, spec.head_dim))


def _flash_kernel(spec: EncoderSpec):
  """(the flash kernel for the target platform, whether Pallas interprets it): Mosaic on
  TPUs, Triton on GPUs, Triton's in Pallas's interpreter on a CPU (tests)."""
  if spec.target_platform == 'tpu':
    return flash_tpu_lib.flash_attention, False
  if spec.target_platform == 'cpu':
    _said_interpreted()
  return flash_lib.flash_attention, spec.target_platform == 'cpu'


@functools.cache
def _said_interpreted() -> None:
  logging.warning('model.fused_attention=flash on a CPU runs the GPU kernel in Pallas\'s '
                  'interpreter (for tests: far slower than the plain path); auto or off '
                  'trains with the plain path here')


def _use_fused(spec: EncoderSpec, deterministic: bool, capture: bool) -> Optional[str]:
  """Implementation for jax.nn.dot_product_attention, or None for the plain path."""
  if (spec.fused_attention == 'off' or not spec.plain_dot_product or capture
      or (not deterministic and spec.attention_dropout_rate > 0)):
    return None
  if spec.fused_attention in ('auto', 'flash'):
    on_gpu = spec.target_platform == 'gpu'
    return 'cudnn' if on_gpu and spec.dtype in (jnp.bfloat16, jnp.float16) else None
  return spec.fused_attention  # 'xla' or 'cudnn', as asked


def paths(spec: EncoderSpec) -> str:
  """Which path computes a full layer's attention in training and in evaluation, as a run's
  log says it (in training the pruned last layer takes the plain path; asked-for
  probabilities always do): e.g. 'training flash (Mosaic), evaluation plain'."""
  def path(training: bool) -> str:
    if _use_flash(spec, not training, False, None):
      on = spec.target_platform
      return ('flash (Mosaic)' if on == 'tpu' else
              'flash (Triton' + (', interpreted)' if on == 'cpu' else ')'))
    fused = _use_fused(spec, not training, False)
    return f'jax.nn.dot_product_attention ({fused})' if fused else 'plain'
  return f'training {path(True)}, evaluation {path(False)}'


class SelfAttention(nn.Module):
  """Multi-head self-attention whose logits come from `spec.attention` components."""
  spec: EncoderSpec

  def _heads(self, x, name):
    s = self.spec
    y = dense(s.hidden_size, ('embed', 'joined_kv'), s, name,
              gain=blocks.init_gain(s, name))(x)
    return y.reshape(x.shape[:2] + (s.num_heads, s.head_dim))  # [B, T, H, dh]

  def _mixture_weights(self):
    """{component: its weight}: the softmax of the learnable mixture logits (equal at init),
    one per component of spec.mixture, summing to 1; {} without a mixture."""
    names = self.spec.mixture
    if not names:
      return {}
    mix = self.param('mixture_logits', nn.with_logical_partitioning(
        nn.initializers.zeros, (None,)), (len(names),), jnp.float32)
    return dict(zip(names, jax.nn.softmax(mix)))

  def _synthesized(self, x, rows, weights):
    """The sum of the non-dot components' logits ([B or 1, H, S, T] float32), each mixed
    one weighted, or None if there are none."""
    s, term = self.spec, None
    for name in s.attention:
      if name != 'dot':
        c = synthetic.component(name)(s, name=synthetic.module_name(name))(x, rows)
        c = weights[name] * c if name in weights else c
        term = c if term is None else term + c
    return term

  def _term(self, x, rows, weights, residual_scores):
    """What both paths add to the dot product's (weighted) logits: the other components'
    weighted logits and RealFormer's previous scores, on the query rows `rows` (None: all),
    [B or 1, H, S, T], or None where there is nothing. The plain path adds it itself, the
    flash kernel as its additive term: a change to a variant's logits is made here (and,
    for the dot product's weight and the running mean's scale, in both paths below)."""
    term = self._synthesized(x, rows, weights)
    if self.spec.residual_attention and residual_scores is not None:
      prev = residual_scores if rows is None else gather_rows(residual_scores, rows, axis=2)
      term = prev if term is None else term + prev
    return term

  def _output(self, ctx, xq):
    s = self.spec
    return dense(s.hidden_size, ('joined_kv', 'embed'), s, 'out',
                 gain=blocks.init_gain(s, 'out'))(ctx.reshape(xq.shape))

  @nn.compact
  def __call__(self, x, bias, residual_scores=None, layer_index=0, rows=None, *,
               deterministic=True, capture_attention=False):
    """x [B, T, D]; bias [B, 1, 1, T]; residual_scores [B, H, T, T] (model.residual_dtype) or None;
    rows [B, S] query rows to compute, or None for all (S = T below).

    Returns (output [B, S, D], scores to carry or None, probabilities [B, H, S, T] or None).
    """
    s = self.spec
    xq = x if rows is None else take_rows(x, rows)
    value = self._heads(x, 'value')
    if _use_flash(s, deterministic, capture_attention, rows):
      return self._flash(x, xq, value, bias, residual_scores, layer_index)
    fused = _use_fused(s, deterministic, capture_attention)
    if fused is not None:  # a kernel computes the whole attention
      query, key = self._heads(xq, 'query'), self._heads(x, 'key')
      if fused == 'cudnn':  # cuDNN takes a bias of [B|1, N|1, Tq, Tk], not one on Tq
        bias = jnp.broadcast_to(bias, (*bias.shape[:2], query.shape[1], bias.shape[-1]))
      ctx = jax.nn.dot_product_attention(query, key, value, bias=in_dtype(bias, s.dtype),
                                         implementation=fused)
      return self._output(ctx, xq), None, None

    weights = self._mixture_weights()
    logits = self._term(x, rows, weights, residual_scores)
    if 'dot' in s.attention:
      query, key = self._heads(xq, 'query'), self._heads(x, 'key')
      own = jnp.einsum('bqhd,bkhd->bhqk', query, key,
                       preferred_element_type=jnp.float32) / math.sqrt(s.head_dim)
      if 'dot' in weights:
        own = weights['dot'] * own
      logits = own if logits is None else own + logits

    carry = None
    if s.residual_attention:
      # The running sum: unmasked, undivided, before dropout; stored in residual_dtype
      # (float32 by default; bfloat16 halves the [B, H, T, T] tensor kept per layer).
      carry = logits.astype(s.residual_dtype)
      if s.running_mean:
        logits = logits / (jnp.asarray(layer_index, jnp.float32) + 1.0)
    probs = jax.nn.softmax(logits + bias, axis=-1)  # float32
    dropped = dropout_lib.Dropout(s.attention_dropout_rate)(probs, deterministic=deterministic)
    ctx = jnp.einsum('bhqk,bkhd->bqhd', dropped.astype(s.dtype), value)
    return self._output(ctx, xq), carry, (probs if capture_attention else None)

  def _flash(self, x, xq, value, bias, residual_scores, layer_index):
    """The layer through a flash kernel (_flash_kernel: realformer.layers.flash_attention's
    on GPUs, flash_attention_tpu's on TPUs): the dot product's weight folded
    into the queries, every other component's weighted logits (and RealFormer's previous
    scores) as the kernel's additive term (the logits themselves for a pure Synthesizer:
    no queries or keys), the running mean as its logit scale; the kernel writes RealFormer's
    carried scores itself. The same dropout mask as the plain path."""
    s = self.spec
    query = key = None
    if 'dot' in s.attention:
      query, key = self._heads(xq, 'query'), self._heads(x, 'key')
    weights = self._mixture_weights()
    term = self._term(x, None, weights, residual_scores)  # (RealFormer's first layer: none)
    if 'dot' in weights:  # w * (q k^T) = (w q) k^T
      w = weights['dot']
      query = (query.astype(jnp.float32) * w).astype(query.dtype)
    scores_dtype = logit_scale = None
    if s.residual_attention:
      scores_dtype = s.residual_dtype
      if s.running_mean:
        logit_scale = 1.0 / (jnp.asarray(layer_index, jnp.float32) + 1.0)
    rate = s.attention_dropout_rate
    # The key the plain path's Dropout would draw its mask from: the same mask.
    seed = dropout_lib.Dropout(rate).threefry_key()
    kernel, interpret = _flash_kernel(s)
    result = flash_lib.flash_attention_on_mesh(
        query, key, value, bias[:, 0, 0, :], term=term, logit_scale=logit_scale,
        scores_dtype=scores_dtype, dropout_rate=rate, dropout_key=seed, interpret=interpret,
        kernel=kernel)
    ctx, carry = result if scores_dtype is not None else (result, None)
    return self._output(ctx, xq), carry, None
