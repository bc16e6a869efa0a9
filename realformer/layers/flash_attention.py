"""Flash attention with BERT's attention dropout inside the kernel (Pallas, Triton on GPUs).

Computes what the plain path in realformer/model/attention.py computes in training for every
variant, whose logits are a dot product plus additive terms, or the terms alone:

    own    = Q K^T / sqrt(d) + term               (term: [B or 1, H, Tq, Tk], or none;
                                                   without Q and K: the term alone)
    P      = softmax(own * scale + bias)          (bias: 0 for real keys, NEG_INF padding)
    out    = (where(keep, P / P(keep), 0) in V's dtype) V
    scores = own, where asked                     (RealFormer's carried scores)

with gradients to Q, K, V and the term (the incoming gradient of `scores` included): plain
attention has no term; RealFormer's term is the previous layer's scores and its running mean
the scale; a Synthesizer mixture's term is its other components' weighted logits, a pure
Synthesizer's its logits, with no Q and K (docs/design.md).
realformer/layers/flash_attention_tpu.py is the same contract for TPUs.
It never writes the probabilities to memory (nor the scores, unless asked): each program holds a
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
online softmax, and P rounded to V's dtype before its normalisation). To draw each threefry
block once for its four keys, the key axis is read as [Tk / 4, 4]: a program's column block
holds `block_c` threefry blocks and their 4 * block_c keys, four dots of `block_c` keys each.

On a GPU these are Triton kernels; on a CPU they run in Pallas's interpreter (for tests, slow).
Inputs: q [B, Tq, H, D], k and v [B, Tk, H, D] (any lengths: padded to whole blocks inside),
key_bias [B, Tk] float32 (the padding mask: a constant, given no gradient). No sharding
rule: under a mesh, call it per shard (see realformer/model/attention.py) with the shard's
global batch and head offsets.
"""

import contextlib
import dataclasses
import functools
import math
from typing import NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from realformer.layers import dropout as dropout_lib

# The name of what a kernel's forward keeps for its backward (the attention output, the
# softmax statistics and the mask's bits): a remat policy that saves it
# (model.remat_policy='dots_flash') runs no kernel's forward again in the backward pass.
RESIDUALS_NAME = 'flash_attention_residuals'

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA  # threefry's key-schedule constant


def threefry2x32(k0, k1, x0, x1) -> Tuple[jax.Array, jax.Array]:
  """Threefry-2x32 (20 rounds, Salmon et al. 2011) on uint32 or int32 arrays (the same bits):
  what jax.extend.random.threefry2x32_p computes, in plain integer ops a kernel can run
  (Triton's uint32, Mosaic's int32; the right shifts are logical either way)."""
  dtype = x0.dtype
  const = lambda v: np.array(np.uint32(v)).astype(dtype)  # the same bits in int32

  def rotl(x, r):
    return (x << const(r)) | jax.lax.shift_right_logical(x, const(32 - r))

  ks = (k0, k1, k0 ^ k1 ^ const(_PARITY))
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for group in range(5):
    for r in _ROTATIONS[group % 2]:
      x0 = x0 + x1
      x1 = rotl(x1, r) ^ x0
    x0 = x0 + ks[(group + 1) % 3]
    x1 = x1 + ks[(group + 2) % 3] + const(group + 1)
  return x0, x1


def _keep_words(seed_ref, rows, cols, threshold):
  """The four keep masks [len(rows), len(cols)] of keys 4 * cols + i, i = 0..3."""
  b1, b2 = threefry2x32(seed_ref[0], seed_ref[1], rows[:, None], cols[None, :])
  t = np.uint32(threshold)
  return ((b1 & np.uint32(0xFFFF)) >= t, (b1 >> np.uint32(16)) >= t,
          (b2 & np.uint32(0xFFFF)) >= t, (b2 >> np.uint32(16)) >= t)


class Constants:
  """What both kernels derive from a dataclass's `head_dim`, dropout `rate`, `term_batch`
  and `scores`."""
  head_dim: int
  rate: float
  term_batch: int
  scores: bool

  @property
  def dlogits(self) -> bool:
    """Whether the dK/dV kernel writes the gradient of the logits (the term's, or that of
    the written scores: dQ is then computed from it)."""
    return bool(self.term_batch or self.scores)

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


@dataclasses.dataclass(frozen=True)
class _Dims(Constants):
  """Static sizes, the dropout constants and which logits the kernels compute, shared by
  every kernel."""
  batch: int
  q_len: int  # padded to whole tiles
  heads: int
  head_dim: int
  k_len: int  # padded to whole tiles
  block_q: int  # the kernel's tile: queries a step
  block_c: int  # and threefry blocks (4 keys each) a step
  rate: float
  mask_q_len: int  # Tq before padding: the mask's rows count it
  term_batch: int = 0  # the additive term's batch: 0 (no term), 1 (shared) or `batch`
  scores: bool = False  # write own + term (RealFormer's carry) and take its gradient
  scaled: bool = False  # multiply own + term by the scalar logit scale
  dot: bool = True  # q k^T in own; False: the term alone (q and k are not read)

  @property
  def groups(self) -> int:  # threefry blocks per mask row
    return self.k_len // 4

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

  def logits(self, q, k, term, scale_ref):
    """(own, the logits before the key bias) of one quarter [rows, block_c], float32:
    own = q k^T / sqrt(d) + term (the term alone without the dot product: q and k None);
    the logits are own * scale where scaled."""
    own = None if q is None else plgpu.dot(q, k, trans_b=True) * self.sm_scale
    if term is not None:
      term = term.astype(jnp.float32)
      own = term if own is None else own + term
    return own, (own * scale_ref[0] if self.scaled else own)

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


class Operands(NamedTuple):
  """What the kernels take, padded to whole tiles (kernel_inputs): q [B, Tq, H, D]; k, v
  [B, Tk, H, D]; key_bias [B, Tk] float32; term [B or 1, H, Tq, Tk] or None; scalars float32
  [1] (the logit scale); seed [3] (the threefry key, 0: uint32 here, its bits as int32 for
  the TPU kernels); offsets int32 [3]."""
  q: jax.Array
  k: jax.Array
  v: jax.Array
  key_bias: jax.Array
  term: Optional[jax.Array]
  scalars: jax.Array
  seed: jax.Array
  offsets: jax.Array


def _iota(start, size):
  return start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)


def _nibbles(keeps):
  """Four keep masks -> one uint8 per threefry block, bit i for key 4c + i."""
  return sum(k.astype(jnp.int32) << i for i, k in enumerate(keeps)).astype(jnp.uint8)


def _unpack(nibbles):
  """uint8 [rows, block_c] -> the four keep masks."""
  n = nibbles.astype(jnp.int32)
  return tuple(((n >> i) & 1) == 1 for i in range(4))


def _forward_kernel(seed_ref, offsets_ref, scale_ref, q_ref, k_ref, v_ref, bias_ref, *refs,
                    d):
  """One query block against every key: the online softmax; with dropout, the mask is drawn
  here (threefry) and written as nibbles for the backward kernels; with `d.scores`, own +
  term is written too."""
  refs = list(refs)
  term_ref = refs.pop(0) if d.term_batch else None
  o_ref, m_ref, log_l_ref = refs[:3]
  mask_ref = refs[3] if d.dropout else None
  scores_ref = refs[-1] if d.scores else None
  q_start = pl.program_id(2) * d.block_q
  q = q_ref[...] if d.dot else None
  rows = (d.row_base(offsets_ref) + _iota(q_start, d.block_q)).astype(jnp.uint32)

  def body(j, carry):
    m, l, acc = carry
    c = pl.ds(j * d.block_c, d.block_c)
    keeps = (None,) * 4
    if d.dropout:
      cols = _iota(j * d.block_c, d.block_c).astype(jnp.uint32)
      keeps = _keep_words(seed_ref, rows, cols, d.threshold)
      mask_ref[:, c] = _nibbles(keeps)
    s = []
    for i in range(4):
      own, logits = d.logits(q, k_ref[c, i, :] if d.dot else None,
                             None if term_ref is None else term_ref[:, c, i], scale_ref)
      if scores_ref is not None:
        scores_ref[:, c, i] = own.astype(scores_ref.dtype)
      s.append(logits + bias_ref[c, i][None, :])
    m_new = jnp.maximum(m, functools.reduce(jnp.maximum, [x.max(axis=1) for x in s]))
    shift = finite_max(m_new)
    alpha = jnp.exp(m - shift)
    p = [jnp.exp(x - shift[:, None]) for x in s]
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


def _dkv_kernel(scale_ref, q_ref, k_ref, v_ref, bias_ref, do_ref, m_ref, log_l_ref, delta_ref,
                *refs, d):
  """One block of 4 x block_c keys against every query. dK and dV are accumulated
  transposed, [D, block_c], so that their dots' first dimension is D (64), not block_c.
  With a term or written scores (d.dlogits), the gradient of the logits before scaling
  (own + term, plus the incoming gradient of the written scores) is written block by
  block: the term's gradient, and what the dQ kernel reads."""
  refs = list(refs)
  term_ref = refs.pop(0) if d.term_batch else None
  mask_ref = refs.pop(0) if d.dropout else None
  dscores_ref = refs.pop(0) if d.scores else None
  dk_ref, dv_ref, *dterm_ref = refs
  c = pl.ds(pl.program_id(2) * d.block_c, d.block_c)
  ks = [k_ref[c, i, :] if d.dot else None for i in range(4)]
  vs = [v_ref[c, i, :] for i in range(4)]
  biases = [bias_ref[c, i] for i in range(4)]

  def body(t, carry):
    dks, dvs = carry
    rows = pl.ds(t * d.block_q, d.block_q)
    q, do = q_ref[rows, :] if d.dot else None, do_ref[rows, :]
    m, log_l, delta = m_ref[rows], log_l_ref[rows], delta_ref[rows]
    keeps = _unpack(mask_ref[rows, c]) if d.dropout else (None,) * 4
    new_dks, new_dvs = [], []
    for i in range(4):
      term = None if term_ref is None else term_ref[rows, :, i]
      _, logits = d.logits(q, ks[i], term, scale_ref)
      p = jnp.exp((logits + biases[i][None, :] - m[:, None]) - log_l[:, None])
      new_dvs.append(dvs[i] + plgpu.dot(do, d.drop(p, keeps[i]).astype(do.dtype),
                                        trans_a=True))
      dp = d.drop(plgpu.dot(do, vs[i], trans_b=True), keeps[i])
      ds = p * (dp - delta[:, None])
      if d.scaled:
        ds = ds * scale_ref[0]
      if dscores_ref is not None:
        ds = ds + dscores_ref[rows, :, i].astype(jnp.float32)
      if dterm_ref:
        dterm_ref[0][rows, :, i] = ds.astype(dterm_ref[0].dtype)
      new_dks.append(dks[i] + plgpu.dot(q, ds.astype(q.dtype), trans_a=True) if d.dot
                     else dks[i])  # (zeros without the dot product)
    return tuple(new_dks), tuple(new_dvs)

  zeros = tuple(jnp.zeros((d.head_dim, d.block_c), jnp.float32) for _ in range(4))
  dks, dvs = jax.lax.fori_loop(0, d.q_len // d.block_q, body, (zeros, zeros))
  for i in range(4):
    dk_ref[:, i, :] = (dks[i] * d.sm_scale).T.astype(dk_ref.dtype)
    dv_ref[:, i, :] = dvs[i].T.astype(dv_ref.dtype)


def _dq_kernel(scale_ref, q_ref, k_ref, v_ref, bias_ref, do_ref, m_ref, log_l_ref, delta_ref,
               *refs, d):
  """One query block against every key, where no logits' gradient is written (no term, no
  written scores): the probabilities rebuilt."""
  *mask_ref, dq_ref = refs
  q, do = q_ref[...], do_ref[...]
  m, log_l, delta = m_ref[...], log_l_ref[...], delta_ref[...]

  def body(j, dq):
    c = pl.ds(j * d.block_c, d.block_c)
    keeps = _unpack(mask_ref[0][:, c]) if d.dropout else (None,) * 4
    for i in range(4):
      k, v = k_ref[c, i, :], v_ref[c, i, :]
      _, logits = d.logits(q, k, None, scale_ref)
      p = jnp.exp((logits + bias_ref[c, i][None, :] - m[:, None]) - log_l[:, None])
      dp = d.drop(plgpu.dot(do, v, trans_b=True), keeps[i])
      ds = p * (dp - delta[:, None])
      if d.scaled:
        ds = ds * scale_ref[0]
      dq = dq + plgpu.dot(ds.astype(k.dtype), k)
    return dq

  dq = jax.lax.fori_loop(0, d.groups // d.block_c, body,
                         jnp.zeros((d.block_q, d.head_dim), jnp.float32))
  dq_ref[...] = (dq * d.sm_scale).astype(dq_ref.dtype)


def _dq_from_logits_kernel(k_ref, dlogits_ref, dq_ref, *, d):
  """One query block against every key, with a term: dQ = dlogits K / sqrt(d), from the
  gradient of the logits that the dK/dV kernel wrote (one pass over it, nothing rebuilt)."""
  def body(j, dq):
    c = pl.ds(j * d.block_c, d.block_c)
    for i in range(4):
      k = k_ref[c, i, :]
      dq = dq + plgpu.dot(dlogits_ref[:, c, i].astype(k.dtype), k)
    return dq

  dq = jax.lax.fori_loop(0, d.groups // d.block_c, body,
                         jnp.zeros((d.block_q, d.head_dim), jnp.float32))
  dq_ref[...] = (dq * d.sm_scale).astype(dq_ref.dtype)


class _Specs:
  """BlockSpecs over grid (b, h, block)."""

  def __init__(self, d: _Dims):
    self.d = d
    self.grouped = pl.BlockSpec((None, d.groups, 4, None, d.head_dim),
                                lambda b, h, i: (b, 0, 0, h, 0))
    self.q_block = pl.BlockSpec((None, d.block_q, None, d.head_dim),
                                lambda b, h, i: (b, i, h, 0))
    self.k_block = pl.BlockSpec((None, d.block_c, 4, None, d.head_dim),
                                lambda b, h, i: (b, i, 0, h, 0))
    self.bias = pl.BlockSpec((None, d.groups, 4), lambda b, h, i: (b, 0, 0))

  def full(self, n):
    return pl.BlockSpec((None, n, None, self.d.head_dim), lambda b, h, i: (b, 0, h, 0))

  @staticmethod
  def vector(n):
    return pl.BlockSpec((n,), lambda b, h, i: (0,))

  @staticmethod
  def rows(n, at):
    return pl.BlockSpec((None, None, n), lambda b, h, i: (b, h, at(i)))

  def mask(self, n, at):
    return pl.BlockSpec((None, None, n, self.d.groups), lambda b, h, i: (b, h, at(i), 0))

  @staticmethod
  def pairs(n_rows, n_groups, by_rows, shared=False):
    """A [B | 1, H, Tq, Tk / 4, 4] array's blocks: n_rows x n_groups (x 4), the grid's block
    index counting rows (by_rows) or key groups."""
    def at(b, h, i):
      return (0 if shared else b, h, i if by_rows else 0, 0 if by_rows else i, 0)
    return pl.BlockSpec((None, None, n_rows, n_groups, 4), at)


def _call(kernel, d, tiling, grid, operands, out_specs, out_shape, interpret, name,
          aliases=None):
  """pallas_call of `kernel` on d (already tiled, as the grid and specs are), with the
  tiling's warps and pipeline stages; operands: (BlockSpec, array) pairs; aliases: {operand
  index: output index} written in place."""
  params = None if interpret else plgpu.CompilerParams(num_warps=tiling.num_warps,
                                                       num_stages=tiling.num_stages)
  specs, arrays = zip(*operands)
  return pl.pallas_call(functools.partial(kernel, d=d), grid=grid,
                        in_specs=list(specs), out_specs=out_specs, out_shape=out_shape,
                        interpret=interpret, compiler_params=params, name=name,
                        input_output_aliases=aliases or {})(*arrays)


def _grouped(x):
  """[B, Tk, ...] -> [B, Tk / 4, 4, ...]: key 4c + i at [c, i] (a free reshape)."""
  return x.reshape(x.shape[0], x.shape[1] // 4, 4, *x.shape[2:])


def _paired(x):
  """[B, H, Tq, Tk] -> [B, H, Tq, Tk / 4, 4] (a free reshape)."""
  return x.reshape(*x.shape[:-1], x.shape[-1] // 4, 4)


def _forward(ops: Operands, d: _Dims, tiling: Tiling, interpret, scores_dtype=None):
  """(out, own + term or None, residuals for the backward: row max, log-sum, the mask's
  nibbles or nothing)."""
  d = d.tiled(tiling)
  sp = _Specs(d)
  by_q = lambda i: i
  operands = [(sp.vector(3), ops.seed), (sp.vector(3), ops.offsets),
              (sp.vector(1), ops.scalars), (sp.q_block, ops.q), (sp.grouped, _grouped(ops.k)),
              (sp.grouped, _grouped(ops.v)), (sp.bias, _grouped(ops.key_bias))]
  if d.term_batch:
    operands.append((sp.pairs(d.block_q, d.groups, True, d.term_batch == 1),
                     _paired(ops.term)))
  row_stats = jax.ShapeDtypeStruct((d.batch, d.heads, d.q_len), jnp.float32)
  pairs_shape = (d.batch, d.heads, d.q_len, d.groups, 4)
  out_specs = [sp.q_block, sp.rows(d.block_q, by_q), sp.rows(d.block_q, by_q)]
  out_shape = [jax.ShapeDtypeStruct(ops.q.shape, ops.q.dtype), row_stats, row_stats]
  if d.dropout:
    out_specs.append(sp.mask(d.block_q, by_q))
    out_shape.append(jax.ShapeDtypeStruct((d.batch, d.heads, d.q_len, d.groups), jnp.uint8))
  if d.scores:
    out_specs.append(sp.pairs(d.block_q, d.groups, True))
    out_shape.append(jax.ShapeDtypeStruct(pairs_shape, scores_dtype))
  out, *stats = _call(_forward_kernel, d, tiling, (d.batch, d.heads, d.q_len // d.block_q),
                      operands, out_specs, out_shape, interpret, 'flash_attention_forward')
  scores = stats.pop().reshape(pairs_shape[:3] + (d.k_len,)) if d.scores else None
  return out, scores, tuple(stats)


def _backward_args(ops: Operands, out, stats, dout):
  """What every backward kernel reads: (ops, dout, row max, log-sum, delta = rowsum(dO * O),
  the mask's nibbles or None)."""
  delta = jnp.einsum('bqhd,bqhd->bhq', out.astype(jnp.float32), dout.astype(jnp.float32))
  return ops, dout, stats[0], stats[1], delta, (stats[2] if len(stats) > 2 else None)


def _dkv(args, d: _Dims, tiling: Tiling, interpret, dscores=None):
  """(dK, dV [B, Tk / 4, 4, H, D], the gradient of own + term [B, H, Tq, Tk] or None): a
  program per 4 x block_c keys, over every query."""
  ops, dout, m, log_l, delta, mask = args
  d = d.tiled(tiling)
  sp = _Specs(d)
  whole = sp.rows(d.q_len, lambda i: 0)
  operands = [(sp.vector(1), ops.scalars), (sp.full(d.q_len), ops.q),
              (sp.grouped, _grouped(ops.k)), (sp.grouped, _grouped(ops.v)),
              (sp.bias, _grouped(ops.key_bias)), (sp.full(d.q_len), dout), (whole, m),
              (whole, log_l), (whole, delta)]
  by_keys = lambda shared=False: sp.pairs(d.q_len, d.block_c, False, shared)
  if d.term_batch:
    operands.append((by_keys(d.term_batch == 1), _paired(ops.term)))
  if d.dropout:
    operands.append((sp.mask(d.q_len, lambda i: 0), mask))
  aliases = None
  dlogits_dtype = dlogits_dtype_of(ops, dscores)
  if d.scores:
    operands.append((by_keys(), _paired(dscores)))
    if dscores.dtype == dlogits_dtype:  # written over the incoming gradient, tile by tile
      aliases = {len(operands) - 1: 2}
  out_specs = [sp.k_block, sp.k_block]
  out_shape = [jax.ShapeDtypeStruct(_grouped(x).shape, x.dtype) for x in (ops.k, ops.v)]
  if d.dlogits:
    out_specs.append(by_keys())
    out_shape.append(jax.ShapeDtypeStruct((d.batch, d.heads, d.q_len, d.groups, 4),
                                          dlogits_dtype))
  dk, dv, *dlogits = _call(_dkv_kernel, d, tiling, (d.batch, d.heads, d.groups // d.block_c),
                           operands, out_specs, out_shape, interpret, 'flash_attention_dkv',
                           aliases)
  dlogits = dlogits[0].reshape(d.batch, d.heads, d.q_len, d.k_len) if dlogits else None
  return dk, dv, dlogits


def dlogits_dtype_of(ops: Operands, dscores):
  """The dtype of the logits' gradient, where the dK/dV kernel writes it: the term's (or,
  without one, the written scores'), or q's where that is wider (dQ is read from it)."""
  if ops.term is None and dscores is None:
    return None
  return jnp.promote_types(ops.q.dtype, ops.term.dtype if ops.term is not None else
                           dscores.dtype)


def _dq(args, d: _Dims, tiling: Tiling, interpret, dlogits=None):
  """dQ [B, Tq, H, D]: a program per block_q queries, over every key; with a term or
  written scores, from the logits' gradient that _dkv returned."""
  ops, dout, m, log_l, delta, mask = args
  d = d.tiled(tiling)
  sp = _Specs(d)
  grid = (d.batch, d.heads, d.q_len // d.block_q)
  dq = jax.ShapeDtypeStruct(ops.q.shape, ops.q.dtype)
  if d.dlogits:
    return _call(_dq_from_logits_kernel, d, tiling, grid,
                 [(sp.grouped, _grouped(ops.k)),
                  (sp.pairs(d.block_q, d.groups, True), _paired(dlogits))],
                 sp.q_block, dq, interpret, 'flash_attention_dq')
  q_rows = sp.rows(d.block_q, lambda i: i)
  operands = [(sp.vector(1), ops.scalars), (sp.q_block, ops.q), (sp.grouped, _grouped(ops.k)),
              (sp.grouped, _grouped(ops.v)), (sp.bias, _grouped(ops.key_bias)),
              (sp.q_block, dout), (q_rows, m), (q_rows, log_l), (q_rows, delta)]
  if d.dropout:
    operands.append((sp.mask(d.block_q, lambda i: i), mask))
  return _call(_dq_kernel, d, tiling, grid, operands, sp.q_block, dq, interpret,
               'flash_attention_dq')


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _flash(ops: Operands, static):
  d, tilings, interpret, scores_dtype = static
  return _forward(ops, d, tilings.forward, interpret, scores_dtype)[:2]


def _flash_fwd(ops: Operands, static):
  d, tilings, interpret, scores_dtype = static
  out, scores, stats = _forward(ops, d, tilings.forward, interpret, scores_dtype)
  out, stats = checkpoint_name((out, stats), RESIDUALS_NAME)
  return (out, scores), (ops, out, stats)


def _flash_bwd(static, residuals, cotangents):
  d, tilings, interpret, _ = static
  ops, out, stats = residuals
  dout, dscores = cotangents
  args = _backward_args(ops, out, stats, dout)
  dk, dv, dlogits = _dkv(args, d, tilings.dkv, interpret, dscores)
  dq = _dq(args, d, tilings.dq, interpret, dlogits) if d.dot else jnp.zeros_like(ops.q)
  zeros = lambda x: np.zeros(x.shape, jax.dtypes.float0)
  dterm = None
  if d.term_batch:  # a term shared by the batch gets the sum of its examples' gradients
    dterm = (dlogits if d.term_batch == d.batch else
             dlogits.sum(0, keepdims=True, dtype=jnp.float32)).astype(ops.term.dtype)
  return (Operands(dq, dk.reshape(ops.k.shape), dv.reshape(ops.v.shape),
                   jnp.zeros_like(ops.key_bias), dterm, jnp.zeros_like(ops.scalars),
                   zeros(ops.seed), zeros(ops.offsets)),)


_flash.defvjp(_flash_fwd, _flash_bwd)
# One program for each static configuration (_Dims, tilings, ...): a model's layers of one
# shape trace and lower the kernels once, not once a layer, and an eagerly run model (the
# interpreter's tests) compiles each kernel once.
_flash_program = jax.jit(_flash, static_argnums=1)


# Below the scores of padding keys (NEG_INF = -1e9 in realformer.model.attention), so a row
# whose real keys are all padding still spreads evenly over those keys alone.
BLOCK_PADDING = -3e9
# The least key bias the kernels take (a smaller one, -inf included, is raised to it): the
# online softmax's running max starts at -inf, and a first block of -inf scores would make
# exp(-inf - -inf) NaN in every later block of the row. exp of it is 0 in float32.
LEAST_KEY_BIAS = -1e9


def operand_slots(q, k, v, term) -> Tuple[jax.Array, jax.Array, bool]:
  """(what the kernels' q and k slots hold, whether the logits have the dot product): q and
  k; or, both None, the logits are the term alone (the pure Synthesizers), the slots hold
  v, which the kernels then never read, and the queries are the keys' positions."""
  if (q is None) != (k is None):
    raise ValueError('flash_attention: give both q and k, or neither (the logits are then '
                     'the term alone)')
  if q is not None:
    return q, k, True
  if term is None or term.ndim != 4 or term.shape[2] != v.shape[1]:
    raise ValueError(f'flash_attention without q and k takes its logits from a term [B or 1, '
                     f'H, Tk, Tk] (Tk = {v.shape[1]}), not '
                     f'{None if term is None else term.shape}')
  return v, v, False


def finite_max(m: jax.Array) -> jax.Array:
  """The online softmax's running maximum `m` as the shift of its exponentials: 0 where it
  is still -inf (a term of -inf over a row's first block of keys masks them, as in the plain
  path; exp(-inf - -inf) would make the row NaN)."""
  return jnp.where(m == -jnp.inf, 0.0, m)


def finite_key_bias(key_bias: jax.Array) -> jax.Array:
  """`key_bias` in float32, raised to LEAST_KEY_BIAS where below it (a padding mask of -inf
  masks the same keys)."""
  return jnp.maximum(key_bias.astype(jnp.float32), LEAST_KEY_BIAS)


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _least_padding(n: int, options: Tuple[int, ...]) -> int:
  """The largest block (options: descending) that pads n by at most an eighth, else the one
  that pads it least."""
  fits = [b for b in options if round_up(n, b) - n <= n // 8]
  return fits[0] if fits else min(options, key=lambda b: (round_up(n, b), -b))


# The shared memory a thread block may use (the opt-in limit), by compute capability: it
# bounds the kernels' tiles (XLA refuses a kernel that asks more: "Shared memory size limit
# exceeded"). Found by compiling for each GPU without one (train.py --compile_for h100, a100;
# realformer/tools/launch.py).
SHARED_MEMORY = {(9, 0): 232448, (10, 0): 232448, (8, 0): 166912, (8, 7): 166912,
                 (8, 6): 101376, (8, 9): 101376, (12, 0): 101376}
HOPPER_SHARED_MEMORY = SHARED_MEMORY[9, 0]


_COMPILING_FOR: list = []  # the devices of compiling_for's compiles, innermost last


@contextlib.contextmanager
def compiling_for(devices):
  """Within: programs are lowered for `devices` (compile-only ones: the launch check's GPUs),
  which shared_memory_here reads, where jax's own devices are this host's."""
  _COMPILING_FOR.append(list(devices))
  try:
    yield
  finally:
    _COMPILING_FOR.pop()


def shared_memory_here() -> int:
  """The per-block shared memory of the GPU the program is lowered for: compiling_for's
  devices, else jax's; an unknown GPU gets the smallest of SHARED_MEMORY, a host without one
  Hopper's (the interpreter has no such limit)."""
  devices = _COMPILING_FOR[-1] if _COMPILING_FOR else jax.devices()
  gpu = next((d for d in devices if d.platform == 'gpu'), None)
  if gpu is None:
    return HOPPER_SHARED_MEMORY
  try:
    capability = tuple(int(x) for x in str(gpu.compute_capability).split('.')[:2])
  except (AttributeError, ValueError):  # not an NVIDIA capability (ROCm's 'gfx90a')
    capability = None
  return SHARED_MEMORY.get(capability, min(SHARED_MEMORY.values()))


def default_tilings(q_len: int, k_len: int, itemsize: int = 2, term: bool = False,
                    shared_memory: int = HOPPER_SHARED_MEMORY, head_dim: int = 64) -> Tilings:
  """64 queries and 4 x 32 keys a step where the lengths allow, smaller blocks where those
  would pad much (a fine-tuning bucket of 40 queries: 16 queries); the dQ kernel takes 4 x 16
  keys a step; 4 warps and 3 pipeline stages each: one tiling for both of pretraining's
  lengths, each kernel's the fastest or within 6% of the fastest of a sweep at BERT-base's
  shapes on an H200 at length 512 and 128 (benchmarks/flash_tiles.py; BENCHMARKS.md).

  Smaller where that would not fit the GPU's shared memory (itemsize: q's bytes, 4 for
  float32; term: with an additive term or written scores, whose tiles, or their
  gradient's, the kernels hold too), each choice
  compiled for a GPU of that class (SHARED_MEMORY) at lengths 128 and 512: on Hopper the
  dK/dV kernel in 2 stages for float32 with a term; on the A100's 163 KiB, 2 stages of it
  with a term, and for float32 2 stages everywhere and 32-query dK/dV blocks; below that
  (99 KiB), 2 stages and 32-query dK/dV blocks, and for float32 32-query blocks and 16-key
  blocks everywhere. The tiles grow with a row's bytes, itemsize x head_dim: bfloat16 heads
  of 128 take float32's choices at heads of 64; float32 heads of 128 on Hopper the A100's,
  below Hopper the 99 KiB class's in one stage (each compiled for an H100 and an A100, with
  and without a term: tools/launch.py's GPU targets)."""
  block_q = _least_padding(q_len, (64, 32, 16))
  block_c = _least_padding(-(-k_len // 4), (32, 16))
  tuned = Tilings(forward=Tiling(block_q, block_c, 4, 3), dkv=Tiling(block_q, block_c, 4, 3),
                  dq=Tiling(block_q, 16, 4, 3))

  def shrink(t: Tiling, q: int = 64, c: int = 32, stages: int = 3) -> Tiling:
    return Tiling(min(t.block_q, q), min(t.block_c, c), t.num_warps, min(t.num_stages, stages))
  width = itemsize * max(head_dim, 64) // 64  # a row's bytes, as q's itemsize at heads of 64
  wide = width >= 4
  if width >= 8:  # (twice float32's rows at heads of 64: the class below's tiles)
    if shared_memory < HOPPER_SHARED_MEMORY:
      least = default_tilings(q_len, k_len, 4, term, min(SHARED_MEMORY.values()))
      return Tilings(*(dataclasses.replace(t, num_stages=1)
                       for t in (least.forward, least.dkv, least.dq)))
    shared_memory = SHARED_MEMORY[8, 0]
  if shared_memory >= HOPPER_SHARED_MEMORY:
    return dataclasses.replace(tuned, dkv=shrink(tuned.dkv, stages=2)) if wide and term else tuned
  if shared_memory >= SHARED_MEMORY[8, 0]:
    if wide:
      return Tilings(forward=shrink(tuned.forward, stages=2),
                     dkv=shrink(tuned.dkv, q=32, stages=2), dq=shrink(tuned.dq, stages=2))
    return dataclasses.replace(tuned, dkv=shrink(tuned.dkv, stages=2)) if term else tuned
  c = 16 if wide else 32
  return Tilings(forward=shrink(tuned.forward, q=32 if wide else 64, c=c, stages=2),
                 dkv=shrink(tuned.dkv, q=32, c=c, stages=2),
                 dq=shrink(tuned.dq, q=32 if wide else 64, stages=2))


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_bias: jax.Array, *,
                    term=None, logit_scale=None, scores_dtype=None,
                    dropout_rate: float = 0.0, dropout_key=None, offsets=(0, 0, None),
                    interpret: bool = False, tilings: Tilings = None):
  """softmax((q k^T / sqrt(d) + term) * logit_scale + key_bias) v, with inverted dropout on
  the probabilities.

  q [B, Tq, H, D]; k, v [B, Tk, H, D]; key_bias [B, Tk] (added to every query's scores; a
  constant: no gradient; values below LEAST_KEY_BIAS, -inf included, are taken as it).
  q and k None: the logits are the term alone, [B or 1, H, Tk, Tk] (the pure Synthesizers;
  no product is computed for them).
  term: None, or an additive term of the logits [B or 1, H, Tq, Tk] (float32 or bfloat16;
  1: shared by the batch), with its gradient: RealFormer's previous scores, a Synthesizer's
  weighted logits; -inf masks a key, as in the plain path (a row whose term is -inf at every
  key is not defined: NaN in the plain path, NaN or 0 here, as the length fills the tiles
  or leaves padded keys, whose bias is finite).
  logit_scale: None (1), or a float32 scalar that multiplies the logits before the key bias
  (RealFormer's running mean, 1 / (l + 1)), a constant: no gradient.
  scores_dtype: also return own = q k^T / sqrt(d) + term in that dtype, before scale and bias
  (RealFormer's carried scores; at its first layer, without a term), whose incoming gradient
  flows into q, k and the term.
  dropout_key: a threefry key's data, uint32 [2] (dropout.threefry_key_data), needed when
  dropout_rate > 0. offsets (batch, head, total heads): where this shard's first sequence and
  head sit in the global [B, H] that the mask rows count (0, 0, H for an unsharded call).
  tilings: the kernels' tiles (default: default_tilings). Any lengths: the queries are padded
  to a multiple of the largest block_q and the keys to one of 4 x the largest block_c
  (padding keys score below every real one). Returns out [B, Tq, H, D] in q's dtype, or
  (out, scores [B, H, Tq, Tk]) with scores_dtype.
  """
  if dropout_rate > 0 and dropout_key is None:
    raise ValueError('flash_attention with dropout needs dropout_key')
  q, k, dot = operand_slots(q, k, v, term)
  tilings = tilings or default_tilings(q.shape[1], k.shape[1], q.dtype.itemsize,
                                       term is not None or scores_dtype is not None,
                                       shared_memory_here(), v.shape[-1])
  ops, d = kernel_inputs(q, k, v, key_bias, dropout_rate, dropout_key, offsets, tilings,
                         term, logit_scale, scores_dtype is not None, dot)
  out, scores = _flash_program(ops, (d, tilings, interpret, scores_dtype))
  out = out[:, :q.shape[1]]
  if scores_dtype is None:
    return out
  return out, scores[:, :, :q.shape[1], :k.shape[1]]


def kernel_inputs(q, k, v, key_bias, dropout_rate, dropout_key, offsets, tilings: Tilings,
                  term=None, logit_scale=None, scores=False,
                  dot=True) -> Tuple[Operands, _Dims]:
  """What the kernels take: q, k, v, key_bias and the term padded to whole tiles, the logit
  scale, the dropout seed, the offsets as int32 [3] (Operands), and the static _Dims
  (benchmarks/flash_tiles.py times the kernels one by one from these)."""
  q_len, k_len = q.shape[1], k.shape[1]
  pad_q = round_up(q_len, tilings.block_q) - q_len
  pad_k = round_up(k_len, 4 * tilings.block_c) - k_len
  key_bias = finite_key_bias(key_bias)
  if pad_q:
    q = jnp.pad(q, ((0, 0), (0, pad_q), (0, 0), (0, 0)))
  if pad_k:
    k, v = (jnp.pad(x, ((0, 0), (0, pad_k), (0, 0), (0, 0))) for x in (k, v))
    key_bias = jnp.pad(key_bias, ((0, 0), (0, pad_k)), constant_values=BLOCK_PADDING)
  term_batch = 0
  if term is not None:
    if term.ndim != 4 or term.shape[0] not in (1, q.shape[0]) or term.shape[1:] != (
        q.shape[2], q_len, k_len):
      raise ValueError(f'flash_attention: term {term.shape} is not [B or 1, H, Tq, Tk] = '
                       f'[{q.shape[0]} or 1, {q.shape[2]}, {q_len}, {k_len}]')
    term_batch = term.shape[0]
    if pad_q or pad_k:
      term = jnp.pad(term, ((0, 0), (0, 0), (0, pad_q), (0, pad_k)))
  d = _Dims(*q.shape, k.shape[1], tilings.block_q, tilings.block_c, float(dropout_rate), q_len,
            term_batch=term_batch, scores=bool(scores), scaled=logit_scale is not None, dot=dot)
  seed = (jnp.zeros((3,), jnp.uint32) if dropout_key is None
          else jnp.concatenate([jnp.asarray(dropout_key, jnp.uint32).reshape(2),
                                jnp.zeros((1,), jnp.uint32)]))
  batch0, head0, heads = offsets
  offsets = jnp.stack([jnp.asarray(batch0, jnp.int32), jnp.asarray(head0, jnp.int32),
                       jnp.asarray(heads if heads is not None else d.heads, jnp.int32)])
  scale = jax.lax.stop_gradient(jnp.asarray(1.0 if logit_scale is None else logit_scale,
                                            jnp.float32).reshape(1))
  return Operands(q, k, v, key_bias, term, scale, seed, offsets), d


def flash_attention_on_mesh(q: jax.Array, k: jax.Array, v: jax.Array, key_bias: jax.Array, *,
                            term=None, logit_scale=None, scores_dtype=None,
                            dropout_rate: float = 0.0, dropout_key=None,
                            interpret: bool = False, kernel=None):
  """flash_attention under the mesh in context (jax.set_mesh), if any: per shard, with the
  batch and heads split as the logical rules in context place ('batch', 'heads'), and each
  shard's offsets into the global [B, H], so a sharded run drops what an unsharded one
  would. A Pallas kernel has no sharding rule of its own: without this, XLA would gather
  the whole batch onto every device. kernel: a function of flash_attention's signature
  (default: this module's, Triton; flash_attention_tpu.flash_attention for TPUs)."""
  flash = kernel or flash_attention
  mesh = jax.sharding.get_abstract_mesh()
  kwargs = dict(dropout_rate=dropout_rate, interpret=interpret, scores_dtype=scores_dtype)
  if mesh.empty or mesh.size == 1:
    return flash(q, k, v, key_bias, term=term, logit_scale=logit_scale,
                 dropout_key=dropout_key, **kwargs)
  batch, _, heads, _ = nn.logical_to_mesh_axes(('batch', 'length', 'heads', 'kv'))
  total_heads = v.shape[2]
  head_shards = _axes_size(mesh, heads)
  if total_heads % head_shards:  # partitioning.check_heads says so before anything compiles
    raise ValueError(f'model.fused_attention=flash splits the {total_heads} heads over '
                     f'{head_shards} devices ({heads}), which does not divide them; choose a '
                     'mesh.tensor that divides model.num_heads')
  seq = P(batch, None, heads, None)
  pairs = P(batch, heads, None, None)
  key = jnp.zeros((2,), jnp.uint32) if dropout_key is None else dropout_key
  scale = jnp.asarray(1.0 if logit_scale is None else logit_scale, jnp.float32)

  def local(q, k, v, key_bias, key, term, scale):
    batch0 = jax.lax.axis_index(batch) * v.shape[0] if batch else 0
    head0 = jax.lax.axis_index(heads) * v.shape[2] if heads else 0
    return flash(q, k, v, key_bias, term=term, logit_scale=None if logit_scale is None else scale,
                 dropout_key=key, offsets=(batch0, head0, total_heads), **kwargs)

  term_spec = None
  if term is not None:  # a term shared by the batch is split by head only
    term_spec = pairs if term.shape[0] > 1 else P(None, heads, None, None)
  out_specs = seq if scores_dtype is None else (seq, pairs)
  qk_spec = None if q is None else seq  # (None: the term alone)
  return jax.shard_map(local, mesh=mesh,
                       in_specs=(qk_spec, qk_spec, seq, P(batch, None), P(), term_spec, P()),
                       out_specs=out_specs, check_vma=False)(q, k, v, key_bias, key, term,
                                                             scale)


def runs_here(num_heads: int, head_dim: int) -> bool:
  """Whether `fused_attention=auto` may take flash_attention_on_mesh (Triton) for attention of
  these heads where it is traced: heads of 32 or 64 (the sizes it was tuned at and is lowered
  for in the tests), an NVIDIA GPU of compute capability 8.0 or more where one is attached
  (Triton's floor in jax; compiling for a GPU from another host, assumed), and
  whole_heads_here."""
  if head_dim not in (32, 64) or not _triton_gpu():
    return False
  return whole_heads_here(num_heads)


def whole_heads_here(num_heads: int) -> bool:
  """Threefry dropout keys (the kernels draw threefry's mask), and whole heads on each device
  of the mesh in context, under the logical rules in context: what either kernel needs of
  where it is traced."""
  if jax.config.jax_default_prng_impl != 'threefry2x32':
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
