"""Flash attention with BERT's attention dropout inside the kernel (Pallas, Triton on GPUs).

Computes what the plain path in realformer/model/attention.py computes for plain dot-product
attention in training:

    P   = softmax(Q K^T / sqrt(d) + bias)            (bias: 0 for real keys, NEG_INF padding)
    out = (where(keep, P / P(keep), 0) in Q's dtype) V

without writing the [B, H, Tq, Tk] scores or probabilities to memory: each program holds a
block of queries, runs over the keys with an online softmax, and the backward pass rebuilds
P block by block from the row max and log-sum (FlashAttention-2's algorithm, Dao 2023, with
delta = rowsum(dO * O), which holds with dropout too). The mask is drawn once, in the
forward kernel, and kept for the backward as one uint8 per threefry block (4 bits of keys:
B * H * Tq * Tk / 4 bytes, 50 MB a layer at 64 x 512 in BERT-base): threefry's 20 rounds of
integer work per block would cost more than the matmuls if each backward kernel drew the
mask again.

The mask is `realformer.layers.dropout.keep_mask(key, rate, [B, H, Tq, Tk])` bit for bit:
element (b, h, q, k) keeps the 16-bit word k % 4 of threefry-2x32(key, row, k // 4), with
row = (b * H + h) * Tq + q, computed inside the kernel. So with the same dropout key this
kernel drops the same entries as the plain path, and the two differ only by rounding (the
online softmax, and P rounded to Q's dtype before its normalisation). To draw each threefry
block once for its four keys, the key axis is read as [Tk / 4, 4]: a program's column block
holds `block_c` threefry blocks and their 4 * block_c keys, four dots of `block_c` keys each.

On a GPU these are Triton kernels; on a CPU they run in Pallas's interpreter (for tests, slow).
Inputs: q [B, Tq, H, D], k and v [B, Tk, H, D] (any lengths: padded to whole blocks inside),
key_bias [B, Tk] float32. No sharding rule: under a mesh, call it per shard (see
realformer/model/attention.py) with the shard's global batch and head offsets.
"""

import dataclasses
import functools
import math
from typing import Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from realformer.layers import dropout as dropout_lib

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA  # threefry's key-schedule constant


def threefry2x32(k0, k1, x0, x1) -> Tuple[jax.Array, jax.Array]:
  """Threefry-2x32 (20 rounds, Salmon et al. 2011) on uint32 arrays: what
  jax.extend.random.threefry2x32_p computes, in plain integer ops a kernel can run."""
  def rotl(x, r):
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))

  ks = (k0, k1, k0 ^ k1 ^ np.uint32(_PARITY))
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for group in range(5):
    for r in _ROTATIONS[group % 2]:
      x0 = x0 + x1
      x1 = rotl(x1, r) ^ x0
    x0 = x0 + ks[(group + 1) % 3]
    x1 = x1 + ks[(group + 2) % 3] + np.uint32(group + 1)
  return x0, x1


def _keep_words(seed_ref, rows, cols, threshold):
  """The four keep masks [len(rows), len(cols)] of keys 4 * cols + i, i = 0..3."""
  b1, b2 = threefry2x32(seed_ref[0], seed_ref[1], rows[:, None], cols[None, :])
  t = np.uint32(threshold)
  return ((b1 & np.uint32(0xFFFF)) >= t, (b1 >> np.uint32(16)) >= t,
          (b2 & np.uint32(0xFFFF)) >= t, (b2 >> np.uint32(16)) >= t)


@dataclasses.dataclass(frozen=True)
class _Dims:
  """Static sizes and the dropout constants, shared by the three kernels."""
  batch: int
  q_len: int
  heads: int
  head_dim: int
  k_len: int
  block_q: int  # the kernel's tile: queries a step
  block_c: int  # and threefry blocks (4 keys each) a step
  rate: float
  mask_q_len: int  # Tq before padding: the mask's rows count it

  @property
  def groups(self) -> int:  # threefry blocks per mask row
    return self.k_len // 4

  @property
  def sm_scale(self) -> float:
    return 1.0 / math.sqrt(self.head_dim)

  @property
  def threshold(self) -> int:  # keep_mask's: drop where the 16-bit word is below
    return dropout_lib.keep_threshold(self.rate)

  @property
  def keep_scale(self) -> float:
    return dropout_lib.keep_scale(self.rate)

  @property
  def dropout(self) -> bool:
    return self.threshold > 0

  def row_base(self, offsets_ref):
    """The mask row of this program's (b, h) and query 0: (b * H + h) * Tq, global."""
    b = pl.program_id(0) + offsets_ref[0]
    h = pl.program_id(1) + offsets_ref[1]
    return (b * offsets_ref[2] + h) * self.mask_q_len

  def drop(self, x, keep):
    """where(keep, x / P(keep), 0): the plain path's inverted dropout, in float32."""
    if keep is None:
      return x
    return jnp.where(keep, x * self.keep_scale, 0.0)

  def tiled(self, tiling: 'Tiling') -> '_Dims':
    return dataclasses.replace(self, block_q=tiling.block_q, block_c=tiling.block_c)


@dataclasses.dataclass(frozen=True)
class Tiling:
  """One kernel's tiles: `block_q` queries and 4 x `block_c` keys a step (powers of 2; on a
  GPU at least 16 each, Triton's smallest dot), and Triton's warps and pipeline stages."""
  block_q: int
  block_c: int
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ('block_q', 'block_c'):
      n = getattr(self, name)
      if n < 1 or n & (n - 1):
        raise ValueError(f'flash attention tiling: {name}={n} is not a power of 2; Triton '
                         'tiles are powers of 2 (16, 32, 64, ...)')


@dataclasses.dataclass(frozen=True)
class Tilings:
  """The three kernels' tiles: forward, dK and dV, dQ. The mask and the row statistics do not
  depend on them: any tilings compute the same values, up to the order of the sums."""
  forward: Tiling
  dkv: Tiling
  dq: Tiling

  @classmethod
  def same(cls, block_q: int, block_c: int) -> 'Tilings':
    """Every kernel at one block size (the interpreter's tests)."""
    return cls(*(Tiling(block_q, block_c),) * 3)

  @property
  def block_q(self) -> int:  # the queries are padded to a multiple of it
    return max(t.block_q for t in (self.forward, self.dkv, self.dq))

  @property
  def block_c(self) -> int:  # and the keys to one of 4 x it
    return max(t.block_c for t in (self.forward, self.dkv, self.dq))


def _iota(start, size):
  return start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)


def _nibbles(keeps):
  """Four keep masks -> one uint8 per threefry block, bit i for key 4c + i."""
  return sum(k.astype(jnp.int32) << i for i, k in enumerate(keeps)).astype(jnp.uint8)


def _unpack(nibbles):
  """uint8 [rows, block_c] -> the four keep masks."""
  n = nibbles.astype(jnp.int32)
  return tuple(((n >> i) & 1) == 1 for i in range(4))


def _forward_kernel(seed_ref, offsets_ref, q_ref, k_ref, v_ref, bias_ref, o_ref, m_ref,
                    log_l_ref, *mask_ref, d):
  """One query block against every key: the online softmax; with dropout, the mask is drawn
  here (threefry) and written as nibbles for the backward kernels."""
  q_start = pl.program_id(2) * d.block_q
  q = q_ref[...]
  rows = (d.row_base(offsets_ref) + _iota(q_start, d.block_q)).astype(jnp.uint32)

  def body(j, carry):
    m, l, acc = carry
    c = pl.ds(j * d.block_c, d.block_c)
    keeps = (None,) * 4
    if d.dropout:
      cols = _iota(j * d.block_c, d.block_c).astype(jnp.uint32)
      keeps = _keep_words(seed_ref, rows, cols, d.threshold)
      mask_ref[0][:, c] = _nibbles(keeps)
    s = [plgpu.dot(q, k_ref[c, i, :], trans_b=True) * d.sm_scale + bias_ref[c, i][None, :]
         for i in range(4)]
    m_new = jnp.maximum(m, functools.reduce(jnp.maximum, [x.max(axis=1) for x in s]))
    alpha = jnp.exp(m - m_new)
    p = [jnp.exp(x - m_new[:, None]) for x in s]
    l = alpha * l + sum(x.sum(axis=1) for x in p)
    acc = acc * alpha[:, None]
    for i in range(4):
      v = v_ref[c, i, :]
      acc = acc + plgpu.dot(d.drop(p[i], keeps[i]).astype(v.dtype), v)
    return m_new, l, acc

  init = (jnp.full((d.block_q,), -jnp.inf, jnp.float32), jnp.zeros((d.block_q,), jnp.float32),
          jnp.zeros((d.block_q, d.head_dim), jnp.float32))
  m, l, acc = jax.lax.fori_loop(0, d.groups // d.block_c, body, init)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  # m and log(l) apart: for a row whose keys are all padding m is about -1e9, where float32
  # would round m + log(l) back to m (and the backward's probabilities to 1, not 1 / Tk).
  m_ref[...] = m
  log_l_ref[...] = jnp.log(l)


def _probabilities(d, q, k, bias, m, log_l):
  """P [rows, block_c] of one quarter, rebuilt from the forward's row max and log-sum."""
  s = plgpu.dot(q, k, trans_b=True) * d.sm_scale + bias[None, :]
  return jnp.exp((s - m[:, None]) - log_l[:, None])


def _dkv_kernel(q_ref, k_ref, v_ref, bias_ref, do_ref, m_ref, log_l_ref, delta_ref, *refs, d):
  """One block of 4 x block_c keys against every query. dK and dV are accumulated
  transposed, [D, block_c], so that their dots' first dimension is D (64), not block_c."""
  *mask_ref, dk_ref, dv_ref = refs
  c = pl.ds(pl.program_id(2) * d.block_c, d.block_c)
  ks = [k_ref[c, i, :] for i in range(4)]
  vs = [v_ref[c, i, :] for i in range(4)]
  biases = [bias_ref[c, i] for i in range(4)]

  def body(t, carry):
    dks, dvs = carry
    rows = pl.ds(t * d.block_q, d.block_q)
    q, do = q_ref[rows, :], do_ref[rows, :]
    m, log_l, delta = m_ref[rows], log_l_ref[rows], delta_ref[rows]
    keeps = _unpack(mask_ref[0][rows, c]) if d.dropout else (None,) * 4
    new_dks, new_dvs = [], []
    for i in range(4):
      p = _probabilities(d, q, ks[i], biases[i], m, log_l)
      new_dvs.append(dvs[i] + plgpu.dot(do, d.drop(p, keeps[i]).astype(do.dtype),
                                        trans_a=True))
      dp = d.drop(plgpu.dot(do, vs[i], trans_b=True), keeps[i])
      ds = p * (dp - delta[:, None])
      new_dks.append(dks[i] + plgpu.dot(q, ds.astype(q.dtype), trans_a=True))
    return tuple(new_dks), tuple(new_dvs)

  zeros = tuple(jnp.zeros((d.head_dim, d.block_c), jnp.float32) for _ in range(4))
  dks, dvs = jax.lax.fori_loop(0, d.q_len // d.block_q, body, (zeros, zeros))
  for i in range(4):
    dk_ref[:, i, :] = (dks[i] * d.sm_scale).T.astype(dk_ref.dtype)
    dv_ref[:, i, :] = dvs[i].T.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, bias_ref, do_ref, m_ref, log_l_ref, delta_ref, *refs, d):
  """One query block against every key."""
  *mask_ref, dq_ref = refs
  q, do = q_ref[...], do_ref[...]
  m, log_l, delta = m_ref[...], log_l_ref[...], delta_ref[...]

  def body(j, dq):
    c = pl.ds(j * d.block_c, d.block_c)
    keeps = _unpack(mask_ref[0][:, c]) if d.dropout else (None,) * 4
    for i in range(4):
      k, v = k_ref[c, i, :], v_ref[c, i, :]
      p = _probabilities(d, q, k, bias_ref[c, i], m, log_l)
      dp = d.drop(plgpu.dot(do, v, trans_b=True), keeps[i])
      dq = dq + plgpu.dot((p * (dp - delta[:, None])).astype(k.dtype), k)
    return dq

  dq = jax.lax.fori_loop(0, d.groups // d.block_c, body,
                         jnp.zeros((d.block_q, d.head_dim), jnp.float32))
  dq_ref[...] = (dq * d.sm_scale).astype(dq_ref.dtype)


def _specs(d: _Dims):
  """BlockSpecs over grid (b, h, block)."""
  full = lambda n: pl.BlockSpec((None, n, None, d.head_dim), lambda b, h, i: (b, 0, h, 0))
  grouped = pl.BlockSpec((None, d.groups, 4, None, d.head_dim),
                         lambda b, h, i: (b, 0, 0, h, 0))
  q_block = pl.BlockSpec((None, d.block_q, None, d.head_dim), lambda b, h, i: (b, i, h, 0))
  bias = pl.BlockSpec((None, d.groups, 4), lambda b, h, i: (b, 0, 0))
  rows = lambda n, at: pl.BlockSpec((None, None, n), lambda b, h, i: (b, h, at(i)))
  mask = lambda n, at: pl.BlockSpec((None, None, n, d.groups), lambda b, h, i: (b, h, at(i), 0))
  scalars = pl.BlockSpec((3,), lambda b, h, i: (0,))
  return full, grouped, q_block, bias, rows, mask, scalars


def _call(kernel, d, tiling, grid, in_specs, out_specs, out_shape, interpret, name):
  """pallas_call of `kernel` on d (already tiled, as the grid and specs are), with the
  tiling's warps and pipeline stages."""
  params = None if interpret else plgpu.CompilerParams(num_warps=tiling.num_warps,
                                                       num_stages=tiling.num_stages)
  return pl.pallas_call(functools.partial(kernel, d=d), grid=grid,
                        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                        interpret=interpret, compiler_params=params, name=name)


def _forward(q, k, v, key_bias, seed, offsets, d: _Dims, tiling: Tiling, interpret):
  """(out, residuals for the backward: row max, log-sum, the mask's nibbles or nothing)."""
  d = d.tiled(tiling)
  _, grouped, q_block, bias, rows, mask, scalars = _specs(d)
  row_stats = jax.ShapeDtypeStruct((d.batch, d.heads, d.q_len), jnp.float32)
  out_specs = [q_block, rows(d.block_q, lambda i: i), rows(d.block_q, lambda i: i)]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), row_stats, row_stats]
  if d.dropout:
    out_specs.append(mask(d.block_q, lambda i: i))
    out_shape.append(jax.ShapeDtypeStruct((d.batch, d.heads, d.q_len, d.groups), jnp.uint8))
  out, *stats = _call(
      _forward_kernel, d, tiling, (d.batch, d.heads, d.q_len // d.block_q),
      [scalars, scalars, q_block, grouped, grouped, bias], out_specs, out_shape,
      interpret, 'flash_attention_forward')(
          seed, offsets, q, _grouped(k), _grouped(v), _grouped(key_bias))
  return out, tuple(stats)


def _grouped(x):
  """[B, Tk, ...] -> [B, Tk / 4, 4, ...]: key 4c + i at [c, i] (a free reshape)."""
  return x.reshape(x.shape[0], x.shape[1] // 4, 4, *x.shape[2:])


def _backward_args(q, k, v, key_bias, out, stats, dout):
  """The backward kernels' inputs: keys grouped in fours, delta = rowsum(dO * O)."""
  delta = jnp.einsum('bqhd,bqhd->bhq', out.astype(jnp.float32), dout.astype(jnp.float32))
  return (q, _grouped(k), _grouped(v), _grouped(key_bias), dout, stats[0], stats[1], delta,
          *stats[2:])


def _dkv(args, d: _Dims, tiling: Tiling, interpret):
  """dK, dV [B, Tk / 4, 4, H, D]: a program per 4 x block_c keys, over every query."""
  d = d.tiled(tiling)
  full, grouped, _, bias, rows, mask, _ = _specs(d)
  whole = rows(d.q_len, lambda i: 0)
  k_block = pl.BlockSpec((None, d.block_c, 4, None, d.head_dim),
                         lambda b, h, i: (b, i, 0, h, 0))
  return _call(
      _dkv_kernel, d, tiling, (d.batch, d.heads, d.groups // d.block_c),
      [full(d.q_len), grouped, grouped, bias, full(d.q_len), whole, whole, whole] +
      [mask(d.q_len, lambda i: 0)] * d.dropout,
      [k_block, k_block], [jax.ShapeDtypeStruct(args[1].shape, args[1].dtype)] * 2,
      interpret, 'flash_attention_dkv')(*args)


def _dq(args, d: _Dims, tiling: Tiling, interpret):
  """dQ [B, Tq, H, D]: a program per block_q queries, over every key."""
  d = d.tiled(tiling)
  _, grouped, q_block, bias, rows, mask, _ = _specs(d)
  q_rows = rows(d.block_q, lambda i: i)
  return _call(
      _dq_kernel, d, tiling, (d.batch, d.heads, d.q_len // d.block_q),
      [q_block, grouped, grouped, bias, q_block, q_rows, q_rows, q_rows] +
      [mask(d.block_q, lambda i: i)] * d.dropout,
      q_block, jax.ShapeDtypeStruct(args[0].shape, args[0].dtype), interpret,
      'flash_attention_dq')(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, key_bias, seed, offsets, static):
  d, tilings, interpret = static
  return _forward(q, k, v, key_bias, seed, offsets, d, tilings.forward, interpret)[0]


def _flash_fwd(q, k, v, key_bias, seed, offsets, static):
  d, tilings, interpret = static
  out, stats = _forward(q, k, v, key_bias, seed, offsets, d, tilings.forward, interpret)
  return out, (q, k, v, key_bias, seed, offsets, out, stats)


def _flash_bwd(static, residuals, dout):
  d, tilings, interpret = static
  q, k, v, key_bias, seed, offsets, out, stats = residuals
  args = _backward_args(q, k, v, key_bias, out, stats, dout)
  dk, dv = _dkv(args, d, tilings.dkv, interpret)
  dq = _dq(args, d, tilings.dq, interpret)
  no_grad = lambda x: np.zeros(x.shape, jax.dtypes.float0)
  return (dq, dk.reshape(k.shape), dv.reshape(v.shape), jnp.zeros_like(key_bias),
          no_grad(seed), no_grad(offsets))


_flash.defvjp(_flash_fwd, _flash_bwd)


# Below the scores of padding keys (NEG_INF = -1e9 in realformer.model.attention), so a row
# whose real keys are all padding still spreads evenly over those keys alone.
_BLOCK_PADDING = -3e9


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _least_padding(n: int, options: Tuple[int, ...]) -> int:
  """The largest block (options: descending) that pads n by at most an eighth, else the one
  that pads it least."""
  fits = [b for b in options if _round_up(n, b) - n <= n // 8]
  return fits[0] if fits else min(options, key=lambda b: (_round_up(n, b), -b))


def default_tilings(q_len: int, k_len: int) -> Tilings:
  """64 queries and 4 x 32 keys a step where the lengths allow, smaller blocks where those
  would pad much (a fine-tuning bucket of 40 queries: 16 queries); the dQ kernel takes 4 x 16
  keys a step; 4 warps and 3 pipeline stages each: one tiling for both of pretraining's
  lengths, each kernel's the fastest or within 6% of the fastest of a sweep at BERT-base's
  shapes on an H200 at length 512 and 128 (benchmarks/flash_tiles.py; BENCHMARKS.md)."""
  block_q = _least_padding(q_len, (64, 32, 16))
  block_c = _least_padding(-(-k_len // 4), (32, 16))
  return Tilings(forward=Tiling(block_q, block_c, 4, 3), dkv=Tiling(block_q, block_c, 4, 3),
                 dq=Tiling(block_q, 16, 4, 3))


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_bias: jax.Array, *,
                    dropout_rate: float = 0.0, dropout_key=None, offsets=(0, 0, None),
                    interpret: bool = False, tilings: Tilings = None) -> jax.Array:
  """softmax(q k^T / sqrt(d) + key_bias) v with inverted dropout on the probabilities.

  q [B, Tq, H, D]; k, v [B, Tk, H, D]; key_bias [B, Tk] (added to every query's scores);
  dropout_key: a threefry key's data, uint32 [2] (dropout.threefry_key_data), needed when
  dropout_rate > 0. offsets (batch, head, total heads): where this shard's first sequence and
  head sit in the global [B, H] that the mask rows count (0, 0, H for an unsharded call).
  tilings: the kernels' tiles (default: default_tilings). Any lengths: the queries are padded
  to a multiple of the largest block_q and the keys to one of 4 x the largest block_c
  (padding keys score below every real one). Returns [B, Tq, H, D] in q's dtype.
  """
  if dropout_rate > 0 and dropout_key is None:
    raise ValueError('flash_attention with dropout needs dropout_key')
  tilings = tilings or default_tilings(q.shape[1], k.shape[1])
  *inputs, d = kernel_inputs(q, k, v, key_bias, dropout_rate, dropout_key, offsets, tilings)
  return _flash(*inputs, (d, tilings, interpret))[:, :q.shape[1]]


def kernel_inputs(q, k, v, key_bias, dropout_rate, dropout_key, offsets, tilings: Tilings):
  """What the kernels take: q, k, v and key_bias padded to whole tiles, the dropout seed,
  the offsets as int32 [3], and the static _Dims (benchmarks/flash_tiles.py times the kernels
  one by one from these)."""
  q_len, k_len = q.shape[1], k.shape[1]
  pad_q = _round_up(q_len, tilings.block_q) - q_len
  pad_k = _round_up(k_len, 4 * tilings.block_c) - k_len
  key_bias = key_bias.astype(jnp.float32)
  if pad_q:
    q = jnp.pad(q, ((0, 0), (0, pad_q), (0, 0), (0, 0)))
  if pad_k:
    k, v = (jnp.pad(x, ((0, 0), (0, pad_k), (0, 0), (0, 0))) for x in (k, v))
    key_bias = jnp.pad(key_bias, ((0, 0), (0, pad_k)), constant_values=_BLOCK_PADDING)
  d = _Dims(*q.shape, k.shape[1], tilings.block_q, tilings.block_c, float(dropout_rate), q_len)
  seed = (jnp.zeros((3,), jnp.uint32) if dropout_key is None
          else jnp.concatenate([jnp.asarray(dropout_key, jnp.uint32).reshape(2),
                                jnp.zeros((1,), jnp.uint32)]))
  batch0, head0, heads = offsets
  offsets = jnp.stack([jnp.asarray(batch0, jnp.int32), jnp.asarray(head0, jnp.int32),
                       jnp.asarray(heads if heads is not None else d.heads, jnp.int32)])
  return q, k, v, key_bias, seed, offsets, d


def flash_attention_on_mesh(q: jax.Array, k: jax.Array, v: jax.Array, key_bias: jax.Array, *,
                            dropout_rate: float = 0.0, dropout_key=None,
                            interpret: bool = False) -> jax.Array:
  """flash_attention under the mesh in context (jax.set_mesh), if any: per shard, with the
  batch and heads split as the logical rules in context place ('batch', 'heads'), and each
  shard's offsets into the global [B, H], so a sharded run drops what an unsharded one
  would. A Pallas kernel has no sharding rule of its own: without this, XLA would gather
  the whole batch onto every device."""
  mesh = jax.sharding.get_abstract_mesh()
  kwargs = dict(dropout_rate=dropout_rate, interpret=interpret)
  if mesh.empty or mesh.size == 1:
    return flash_attention(q, k, v, key_bias, dropout_key=dropout_key, **kwargs)
  batch, _, heads, _ = nn.logical_to_mesh_axes(('batch', 'length', 'heads', 'kv'))
  total_heads = q.shape[2]
  head_shards = _axes_size(mesh, heads)
  if total_heads % head_shards:  # partitioning.check_heads says so before anything compiles
    raise ValueError(f'model.fused_attention=flash splits the {total_heads} heads over '
                     f'{head_shards} devices ({heads}), which does not divide them; choose a '
                     'mesh.tensor that divides model.num_heads')
  seq = P(batch, None, heads, None)
  key = jnp.zeros((2,), jnp.uint32) if dropout_key is None else dropout_key

  def local(q, k, v, key_bias, key):
    batch0 = jax.lax.axis_index(batch) * q.shape[0] if batch else 0
    head0 = jax.lax.axis_index(heads) * q.shape[2] if heads else 0
    return flash_attention(q, k, v, key_bias, dropout_key=key, offsets=(batch0, head0,
                                                                        total_heads), **kwargs)

  return jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, P(batch, None), P()),
                       out_specs=seq, check_vma=False)(q, k, v, key_bias, key)


def runs_here(num_heads: int, head_dim: int) -> bool:
  """Whether `fused_attention=auto` may take flash_attention_on_mesh for attention of these
  heads where it is traced: heads of 32 or 64 (the sizes it was tuned at and is lowered for
  in the tests), an NVIDIA GPU of compute capability 8.0 or more where one is attached
  (Triton's floor in jax; compiling for a GPU from another host, assumed), threefry dropout
  keys (the kernel draws threefry's mask), and whole heads on each device of the mesh in
  context, under the logical rules in context."""
  if head_dim not in (32, 64) or jax.config.jax_default_prng_impl != 'threefry2x32':
    return False
  if not _triton_gpu():
    return False
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return True
  axes = nn.logical_to_mesh_axes(('heads',))[0]
  names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  if any(name not in mesh.shape for name in names):
    return False
  return num_heads % _axes_size(mesh, axes) == 0


def _triton_gpu() -> bool:
  """The attached GPU is an NVIDIA one of compute capability 8.0 or more; True where no GPU
  is attached (a program compiled here for a GPU target), False for ROCm's (gfx...)."""
  try:
    device = jax.local_devices(backend='gpu')[0]
  except RuntimeError:
    return True
  try:
    major, minor = (int(x) for x in str(device.compute_capability).split('.')[:2])
  except (AttributeError, ValueError):
    return False
  return (major, minor) >= (8, 0)


def _axes_size(mesh, axes) -> int:
  if axes is None:
    return 1
  names = (axes,) if isinstance(axes, str) else tuple(axes)
  return int(np.prod([mesh.shape[a] for a in names]))
