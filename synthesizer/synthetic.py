"""Synthetic attention logits (Tay et al. 2020, arXiv 2005.00743), one module per variant.

Each module maps the layer input x [B, T, D] to logits [B or 1, H, T, T] in float32, before
the padding mask (added by the shared attention path for every variant). Given `rows`
[B, S], only those query rows are made: logits [B, H, S, T], row s being row rows[b, s] of
the full matrix (the last layer of pretraining, whose loss reads only [CLS] and the masked
positions). Lengths beyond `max_len` are an error: the synthesized matrices have exactly
max_len rows and columns and are sliced to the sequence length, never wrapped.

  Dense:             B_i = F(X_i) = W2 relu(W1 X_i + b1) + b2, W1: D->D, W2: D->H*max_len
                     (per head in W2; F is applied to each token independently).
  Random:            B = R, a [H, max_len, max_len] parameter (trainable, or fixed at init).
  Factorized Dense:  A_i = W_A X_i in R^{H x a}, B_i = W_B X_i in R^{H x b}, a * b = max_len;
                     C_i = tile(A_i, b) * repeat(B_i, a): C_i[j*a + m] = A_i[m] B_i[j], the
                     flattened outer product of the two factors.
  Factorized Random: R = R1 R2^T, R1, R2 of shape [H, max_len, k].
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from realformer.layers.dense import dense
from realformer.layers.rows import gather_rows, take_rows


def _check_length(length: int, max_len: int, name: str):
  if length > max_len:
    raise ValueError(f'sequence length {length} exceeds model.max_len={max_len} of the '
                     f'{name} synthesizer; shorten the input or raise model.max_len')


class DenseSynthesizer(nn.Module):
  spec: 'EncoderSpec'

  @nn.compact
  def __call__(self, x, rows=None):
    s = self.spec
    b, t, _ = x.shape
    _check_length(t, s.max_len, 'dense')
    x = x if rows is None else take_rows(x, rows)  # F sees each query token alone
    h = nn.relu(dense(s.hidden_size, ('embed', 'mlp'), s, 'hidden')(x))
    # Heads-major output ('joined_kv', like the query projection): tensor parallelism gives
    # each device its own heads' logits, as it gives each its own heads of Q K^T.
    logits = dense(s.num_heads * s.max_len, ('embed', 'joined_kv'), s, 'logits')(h)
    logits = logits.reshape(b, x.shape[1], s.num_heads, s.max_len)[..., :t]  # [B, Tq, H, Tk]
    return jnp.transpose(logits, (0, 2, 1, 3)).astype(jnp.float32)  # [B, H, Tq, Tk]


class RandomSynthesizer(nn.Module):
  spec: 'EncoderSpec'

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


class FactorizedDenseSynthesizer(nn.Module):
  spec: 'EncoderSpec'

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


class FactorizedRandomSynthesizer(nn.Module):
  spec: 'EncoderSpec'

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


SYNTHESIZERS = {
    'dense': DenseSynthesizer,
    'random': RandomSynthesizer,
    'factorized_dense': FactorizedDenseSynthesizer,
    'factorized_random': FactorizedRandomSynthesizer,
}
