"""The encoder's dense layer, and its bfloat16 matmul for CPUs with bf16 matrix units.

    layer = dense(features, ('embed', 'mlp'), spec, 'intermediate')   # nn.Dense, BERT's init

Every projection of every variant (Q, K, V, output, MLP, pooler, heads, synthesizers) goes
through `dense`, so `model.matmul` picks the matmul of all of them:

  xla        lax.dot_general, as nn.Dense does. Right for GPUs and TPUs, whose compilers take
             the transposed operands of the backward pass as they come.
  row_major  for bfloat16 on CPU. XLA:CPU sends a bf16 x bf16 -> f32 dot to YNNPACK's
             bf16 kernels (AMX / AVX512-BF16: 1.3-1.8 TFLOP/s on a 2-core Sapphire Rapids,
             against 0.3 for float32) only when both operands are row-major and the
             contraction is [M, K] x [K, N]. Autodiff's backward dots, dx = g W^T and
             dW = x^T g, are not: XLA upcasts them to float32, and a bf16 Dense ran no
             faster than a float32 one. Here a custom VJP does all three matmuls in that
             form, with float32 accumulation, and materialises the transposed operand
             (W^T [N, K], x^T [K, M]) as a row-major copy first. The copy passes through an
             optimization barrier, flattened: otherwise XLA folds the transpose back into
             the dot as a column-major layout and upcasts again.
  auto       row_major where it pays (CPU backend and dtype bfloat16), else xla.

The values are the same up to float32 summation order: both paths multiply the same bf16
operands and accumulate in float32 (tests/test_dense.py).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

def uses_row_major(matmul: str, dtype) -> bool:
  """Whether `model.matmul` resolves to the row-major bf16 path for this dtype and backend."""
  if matmul == 'auto':
    return jax.default_backend() == 'cpu' and jnp.dtype(dtype) == jnp.bfloat16
  return matmul == 'row_major'


def _row_major_transpose(a: jax.Array) -> jax.Array:
  """[M, K] -> [K, M] as a row-major copy that XLA cannot fold into the consuming dot."""
  m, k = a.shape
  return lax.optimization_barrier(a.T.reshape(-1)).reshape(k, m)


def _dot(a, b, dtype):
  return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype)


@jax.custom_vjp
def row_major_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [M, K] @ w [K, N], float32 accumulation, result in x's dtype."""
  return _dot(x, w, x.dtype)


def _matmul_fwd(x, w):
  return row_major_matmul(x, w), (x, w)


def _matmul_bwd(residuals, g):
  x, w = residuals
  dx = _dot(g, _row_major_transpose(w), x.dtype)   # [M, N] x [N, K]
  dw = _dot(_row_major_transpose(x), g, w.dtype)   # [K, M] x [M, N]
  return dx, dw


row_major_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def row_major_dot_general(x, kernel, dimension_numbers, precision=None,
                          preferred_element_type=None):
  """nn.Dense's dot_general ([..., K] x [K, N]) through row_major_matmul."""
  del precision, preferred_element_type  # bf16 operands, float32 accumulation, always
  (lhs_contract, rhs_contract), batch = dimension_numbers
  if lhs_contract != (x.ndim - 1,) or rhs_contract != (0,) or batch != ((), ()):
    raise ValueError(f'row_major_dot_general takes [..., K] x [K, N]; got dimension numbers '
                     f'{dimension_numbers}')
  y = row_major_matmul(x.reshape(-1, x.shape[-1]), kernel)
  return y.reshape(x.shape[:-1] + kernel.shape[1:])


def dense(features: int, axes, spec, name: str) -> nn.Dense:
  """nn.Dense with BERT's init, logical axis names on kernel and bias, and spec's matmul."""
  init = nn.initializers.normal(spec.initializer_range)
  extra = {}
  if uses_row_major(spec.matmul, spec.dtype):
    extra['dot_general'] = row_major_dot_general
  return nn.Dense(features, dtype=spec.dtype, param_dtype=jnp.float32, name=name,
                  kernel_init=nn.with_logical_partitioning(init, axes),
                  bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[-1:]),
                  **extra)
