"""The encoder's dense layer, with a custom-VJP version for XLA:CPU.

    layer = dense(features, ('embed', 'mlp'), spec, 'intermediate')   # BERT's init, axis names

Every projection of every variant (Q, K, V, output, MLP, pooler, heads, synthesizers) goes
through `dense`, so `model.dense_impl` picks the implementation of all of them:

  flax   flax.linen.Dense: lax.dot_general, then the bias. Right for GPUs and TPUs, whose
         compilers take autodiff's backward pass as it comes.
  cpu    CpuDense: the same parameters (kernel [K, N], bias [N], float32) and the same
         function, y = x W + b, through one custom VJP written for XLA:CPU, on [M, K] rows
         (M = every leading axis):
           - the bias is added to the float32 accumulator before the cast to `dtype`, and
             its gradient is a column sum of the 2-D cotangent (autodiff's sum over the
             leading axes of [B, T, N] becomes reduce-window trees on XLA:CPU, many
             times slower).
           - in bfloat16, all three matmuls (y = x W, dx = g W^T, dW = x^T g) are
             [M, K] x [K, N] dots with float32 accumulation. XLA:CPU runs only that form on
             YNNPACK's bf16 kernels (AMX / AVX512-BF16); autodiff's transposed backward dots
             are upcast to float32. The transposed operand (W^T, x^T) is materialised row-major
             first, flattened through an optimization barrier: otherwise XLA folds the
             transpose back into the dot as a column-major layout and upcasts again.
  auto   cpu when the program is compiled for a CPU (spec.target_platform), else flax.

The values are the plain dense layer's up to float32 summation order (and, in bfloat16, the
bias added before rounding rather than after): tests/test_dense.py checks both against
float64 NumPy and against each other; BENCHMARKS.md has the timings.
"""

from typing import Any, Callable, Optional

import flax.linen as nn
from flax.linen import dtypes
import jax
import jax.numpy as jnp
from jax import lax


def uses_cpu_dense(spec) -> bool:
  """Whether `spec.dense_impl` resolves to CpuDense on the target platform (spec.platform,
  else this process's backend: a TPU compile from a CPU host gets nn.Dense)."""
  return spec.dense_impl == 'cpu' or (spec.dense_impl == 'auto' and
                                      spec.target_platform == 'cpu')


def _row_major_transpose(a: jax.Array) -> jax.Array:
  """[M, K] -> [K, M] as a row-major copy that XLA cannot fold into the consuming dot."""
  m, k = a.shape
  return lax.optimization_barrier(a.T.reshape(-1)).reshape(k, m)


def _dot(a, b, dtype):
  return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype)


@jax.custom_vjp
def affine(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
  """x [M, K] @ w [K, N] + b [N] (float32), float32 accumulation, result in x's dtype."""
  return (jnp.dot(x, w, preferred_element_type=jnp.float32) + b).astype(x.dtype)


def _affine_fwd(x, w, b):
  return affine(x, w, b), (x, w)


def _affine_bwd(residuals, g):
  x, w = residuals
  if x.dtype == jnp.bfloat16:  # every dot [M, K] x [K, N]: YNNPACK's bf16 kernels
    dx = _dot(g, _row_major_transpose(w), x.dtype)   # [M, N] x [N, K]
    dw = _dot(_row_major_transpose(x), g, w.dtype)   # [K, M] x [M, N]
  else:  # float32: XLA's own dots are as fast as any layout here
    dx, dw = _dot(g, w.T, x.dtype), _dot(x.T, g, w.dtype)
  return dx, dw, jnp.sum(g.astype(jnp.float32), axis=0)


affine.defvjp(_affine_fwd, _affine_bwd)


class CpuDense(nn.Module):
  """nn.Dense's parameters and function through `affine` (float32 parameters); with
  `columns`, of the columns it keeps alone."""
  features: int
  dtype: Any
  kernel_init: Callable
  bias_init: Callable
  columns: Optional[Callable] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kernel, bias = _parameters(self, x.shape[-1])
    y = affine(x.reshape(-1, x.shape[-1]).astype(self.dtype), kernel.astype(self.dtype), bias)
    return y.reshape(x.shape[:-1] + bias.shape)


class ColumnsDense(nn.Module):
  """nn.Dense's parameters and function (its dtype promotion, dot and bias), of the columns
  `columns` keeps alone."""
  features: int
  dtype: Any
  kernel_init: Callable
  bias_init: Callable
  columns: Callable

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x, kernel, bias = dtypes.promote_dtype(x, *_parameters(self, x.shape[-1]),
                                           dtype=self.dtype)
    y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    return y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


def _parameters(layer, inputs: int):
  """A dense layer's float32 kernel [inputs, features] and bias [features] (nn.Dense's names
  and initialisers), cut to the columns it computes."""
  kernel = layer.param('kernel', layer.kernel_init, (inputs, layer.features), jnp.float32)
  bias = layer.param('bias', layer.bias_init, (layer.features,), jnp.float32)
  if layer.columns is None:
    return kernel, bias
  return layer.columns(kernel), layer.columns(bias)


def dense(features: int, axes, spec, name: str, gain: float = 1.0,
          columns: Optional[Callable] = None) -> nn.Module:
  """A dense layer with BERT's init (its kernel N(0, (gain * initializer_range)^2): a block
  that scales some projections' initialisation, as DeepNet's, passes its gain), logical
  axis names on kernel and bias, spec's impl.

  columns: a function of a parameter's last axis (the kernel [K, features], the bias
  [features]) to the columns the layer computes, applied to the parameters before the
  matmul: a layer whose output would be cut afterwards computes only what is kept (the
  Dense Synthesizer's logits for max_len keys, of which a sequence uses its length's). The
  parameters stay whole ([K, features]), and the columns left out take no gradient."""
  kernel_init = nn.with_logical_partitioning(
      nn.initializers.normal(gain * spec.initializer_range), axes)
  bias_init = nn.with_logical_partitioning(nn.initializers.zeros, axes[-1:])
  if uses_cpu_dense(spec):
    return CpuDense(features, spec.dtype, kernel_init, bias_init, columns, name=name)
  if columns is not None:
    return ColumnsDense(features, spec.dtype, kernel_init, bias_init, columns, name=name)
  return nn.Dense(features, dtype=spec.dtype, param_dtype=jnp.float32, name=name,
                  kernel_init=kernel_init, bias_init=bias_init)
