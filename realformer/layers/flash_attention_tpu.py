"""Flash attention with BERT's attention dropout inside the kernel, for TPUs (Pallas Mosaic).

The contract of realformer.layers.flash_attention (the Triton kernels for GPUs), the same
inputs and outputs:

    own    = Q K^T / sqrt(d) + term            (term: [B or 1, H, Tq, Tk], or none;
                                                without Q and K: the term alone)
    P      = softmax(own * scale + key_bias)
    out    = (where(keep, P / P(keep), 0) in V's dtype) V
    scores = own, in scores_dtype, where asked (RealFormer's carried scores)

with gradients to Q, K, V and the term (the incoming gradient of `scores` included), and the
mask `realformer.layers.dropout.keep_mask(key, rate, [B, H, Tq, Tk])` bit for bit: element
(b, h, q, k) keeps the 16-bit word k % 4 of threefry-2x32(key, row, k // 4), with
row = (b * H + h) * Tq + q. On a TPU the forward kernel draws a tile's blocks where the tile
is used, each block once for its four keys, in integer arithmetic on int32 (threefry's bits
are the same), and keeps each block's four keep bits for the backward kernels (`_nibbles`,
`_packed` eight blocks to an int32 at tiles of 256 and 512 keys: a bit a key, B * H * Tq *
Tk / 8 bytes at lengths padded to whole tiles; four at 128 and 384), which read them
instead of drawing the mask again: threefry's 20 rounds were most of each kernel's
schedule. Nothing else [B, H, Tq, Tk] is kept for the backward.

Three kernels, each over tiles of `block` queries x `block` keys (a multiple of 128, the
lanes, up to 512: tile_for), `group` heads a grid step (heads_per_step): the forward
(online softmax over the key tiles, FlashAttention-2's algorithm), dK/dV (a key tile
against every query tile: with a term it also writes the logits' gradient tile, which is
the term's gradient and what dQ reads), and dQ (a query tile against every key
tile: from that gradient, or, without a term, from the probabilities rebuilt). The row
statistics (max and log-sum, apart, as on the GPU: a row whose keys are all padding keeps
1 / Tk) are stored lane-dense, [B, H, 1, Tq].

Inputs as the GPU kernel's: q [B, Tq, H, D]; k, v [B, Tk, H, D]; key_bias [B, Tk] float32
(a constant: no gradient); any lengths (padded to whole tiles inside). No sharding rule:
flash_attention_on_mesh in realformer.layers.flash_attention calls it per shard.
"""

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from realformer.layers.flash_attention import (BLOCK_PADDING, RESIDUALS_NAME, Constants,
                                               Operands, dlogits_dtype_of, finite_key_bias,
                                               finite_max, operand_slots, round_up,
                                               threefry2x32)

_LANES = 128
MAX_TILE = 512  # queries and keys of a tile (VMEM holds a few [512, 512] float32 arrays)
# What the blocks of one grid step of the dK/dV kernel (the largest: q, k, v, dO, dK, dV and,
# with a term, the term, the scores' gradient and the logits' gradient), double-buffered,
# may take of VMEM (heads_per_step); the kernel's own [block, block] temporaries take about
# as much again. Compiled by libtpu 0.0.48.1, 16 heads of 64 at length 128 in one step with
# a float32 carry: 9.0 MiB of blocks (bfloat16 q, k, v) compiles for v5e, v5p and v6e
# (64-128 MiB of VMEM a core) but takes 16.86 MiB of v4's 16 MiB, where 8 heads (4.5 MiB)
# fit; 12.0 MiB (float32 throughout) runs out on v5p too (tests/test_flash_variants.py).
STEP_VMEM_BYTES = 9 * 2 ** 20
SMALL_VMEM_STEP_BYTES = 8 * 2 ** 20  # where a core has 16 MiB of VMEM (v4), or is unknown
_TRANS_B = (((1,), (1,)), ((), ()))  # x y^T
_TRANS_A = (((0,), (0,)), ((), ()))  # x^T y


def step_vmem_bytes() -> int:
  """STEP_VMEM_BYTES for the TPU the kernels are traced for (a shard_map's mesh's, or the
  default device's: pltpu.get_tpu_info), SMALL_VMEM_STEP_BYTES where its cores have 16 MiB
  of VMEM or it is not a TPU (Pallas's interpreter)."""
  try:
    capacity = pltpu.get_tpu_info().vmem_capacity_bytes
  except (ValueError, NotImplementedError):  # not a TPU
    return SMALL_VMEM_STEP_BYTES
  return STEP_VMEM_BYTES if capacity > 16 * 2 ** 20 else SMALL_VMEM_STEP_BYTES


@dataclasses.dataclass(frozen=True)
class _Dims(Constants):
  """Static sizes, the dropout constants and which logits the kernels compute."""
  q_len: int  # padded
  k_len: int  # padded
  head_dim: int
  block: int
  rate: float
  mask_q_len: int  # Tq before padding: the mask's rows count it
  k_real: int  # Tk before padding
  term_batch: int = 0  # 0 (no term), 1 (shared by the batch) or B
  scores: bool = False
  scaled: bool = False
  dot: bool = True  # q k^T in own; False: the term alone (q and k stay in HBM, unread)
  group: int = 1  # heads a grid step computes, one after the other (heads_per_step)


def _nibbles(d: _Dims, seed_ref, offsets_ref, b, h, q_tile, k_tile):
  """The tile's threefry blocks at query tile q_tile, key tile k_tile of sequence b (local),
  head h (local), each drawn once for its four keys, as their keep bits: int32
  [block / 4, block], bit w of an element set where keep_mask keeps key 4c + w (word w of
  threefry-2x32(key, row, c) at or above the threshold). Lane quarter a holds row quarter a:
  element (r, a * block / 4 + c) is query row a * block / 4 + r of the tile, block c of its
  key tile."""
  rows_q, n = d.block // 4, d.block
  base = ((b + offsets_ref[0]) * offsets_ref[2] + h + offsets_ref[1]) * d.mask_q_len
  shape = (rows_q, n)
  lane = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  quarter, column = lane // rows_q, lane % rows_q
  rows = (base + q_tile * d.block + quarter * rows_q
          + jax.lax.broadcasted_iota(jnp.int32, shape, 0))
  b1, b2 = threefry2x32(seed_ref[0], seed_ref[1], rows, k_tile * rows_q + column)
  words = (b1 & 0xFFFF, jax.lax.shift_right_logical(b1, 16), b2 & 0xFFFF,
           jax.lax.shift_right_logical(b2, 16))
  return sum((word >= d.threshold).astype(jnp.int32) << w for w, word in enumerate(words))


def _packing(d: _Dims) -> int:
  """How many rows of a tile's _nibbles one int32 holds (4 bits each): 8 where the packed
  rows stay whole sublanes (tiles of 256 and 512 keys), else 4."""
  rows_q = d.block // 4
  return 8 if rows_q % 64 == 0 else 4


def _packed(d: _Dims, nibbles):
  """[block / 4, block] nibbles -> int32 [block / 4 / p, block] (p = _packing): row r holds
  rows r + s * block / 4 / p at bits 4s."""
  n = nibbles.shape[0] // _packing(d)
  return functools.reduce(jnp.bitwise_or, (nibbles[s * n:(s + 1) * n] << 4 * s
                                           for s in range(_packing(d))))


def _unpacked(d: _Dims, packed):
  """_packed's inverse."""
  return jnp.concatenate([jax.lax.shift_right_logical(packed, 4 * s) & 15
                          for s in range(_packing(d))], axis=0)


def _keep(d: _Dims, nibbles):
  """keep_mask's mask of the tile, bool [block, block], from its _nibbles: each 128-key vreg
  of row quarter a gathers its blocks lane by lane from the one vreg that holds them, and
  key k takes bit k % 4."""
  rows_q, n = d.block // 4, d.block
  out_lane = jax.lax.broadcasted_iota(jnp.int32, (rows_q, _LANES), 1)
  quarters = []
  for a in range(4):
    vregs = []
    for u in range(n // _LANES):
      first = a * rows_q + u * (_LANES // 4)  # the blocks of keys 128u.. of row quarter a
      start = first // _LANES * _LANES
      held = jnp.take_along_axis(nibbles[:, start:start + _LANES],
                                 first % _LANES + (out_lane >> 2), axis=1)
      vregs.append(jax.lax.shift_right_logical(held, out_lane & 3) & 1)
    quarters.append(jnp.concatenate(vregs, axis=1) if len(vregs) > 1 else vregs[0])
  return jnp.concatenate(quarters, axis=0) != 0


def _drop(d: _Dims, x, keep):
  return x if keep is None else jnp.where(keep, x * d.keep_scale, 0.0)


def _column(row):
  """[1, n] -> [n, 1] (a lane-dense row statistic against a tile's rows)."""
  n = row.shape[1]
  return jnp.transpose(jnp.broadcast_to(row, (_LANES, n)))[:, :1]


def _row(column):
  """[n, 1] -> [1, n]."""
  n = column.shape[0]
  return jnp.transpose(jnp.broadcast_to(column, (n, _LANES)))[:1, :]


def _logits(d: _Dims, q, k, term, scale_ref):
  """(own = q k^T / sqrt(d) + term, own * scale) of one tile, float32 (own = the term alone
  without the dot product: q and k None)."""
  own = None if q is None else jax.lax.dot_general(
      q, k, _TRANS_B, preferred_element_type=jnp.float32) * d.sm_scale
  if term is not None:
    term = term.astype(jnp.float32)
    own = term if own is None else own + term
  return own, (own * scale_ref[0] if d.scaled else own)


def _qk(d: _Dims, q_ref, k_ref, e):
  """Head e's q and k tiles, or (None, None) without the dot product."""
  return (q_ref[e], k_ref[e]) if d.dot else (None, None)


def _forward_kernel(seed_ref, offsets_ref, scale_ref, q_ref, k_ref, v_ref, bias_ref, *refs,
                    d: _Dims):
  refs = list(refs)
  term_ref = refs.pop(0) if d.term_batch else None
  o_ref, m_ref, log_l_ref = refs[:3]
  scores_ref = refs[3] if d.scores else None
  nibbles_ref = refs[3 + d.scores] if d.dropout else None
  m_sc, l_sc, acc_sc = refs[-3:]
  b, group, i, j = (pl.program_id(a) for a in range(4))

  @pl.when(j == 0)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  for e in range(d.group):  # each head of the step: its views are ref[e]
    own, logits = _logits(d, *_qk(d, q_ref, k_ref, e),
                          None if term_ref is None else term_ref[e], scale_ref)
    if scores_ref is not None:
      scores_ref[e] = own.astype(scores_ref.dtype)
    s = logits + bias_ref[...]
    m_prev = m_sc[e]
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    shift = finite_max(m_new)
    alpha = jnp.exp(m_prev - shift)
    p = jnp.exp(s - shift)
    l_sc[e] = alpha * l_sc[e] + p.sum(axis=1, keepdims=True)
    m_sc[e] = m_new
    keep = None
    if d.dropout:  # drawn here, kept for the backward kernels
      nibbles = _nibbles(d, seed_ref, offsets_ref, b, group * d.group + e, i, j)
      nibbles_ref[e] = _packed(d, nibbles)
      keep = _keep(d, nibbles)
    v = v_ref[e]
    acc_sc[e] = alpha * acc_sc[e] + jnp.dot(_drop(d, p, keep).astype(v.dtype), v,
                                            preferred_element_type=jnp.float32)

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    for e in range(d.group):
      l = l_sc[e]
      o_ref[e] = (acc_sc[e] / l).astype(o_ref.dtype)
      m_ref[e] = _row(m_sc[e])
      log_l_ref[e] = _row(jnp.log(l))


def _probabilities(d, q, k, term, bias, m, log_l, scale_ref):
  _, logits = _logits(d, q, k, term, scale_ref)
  return jnp.exp((logits + bias - _column(m)) - _column(log_l))


def _dkv_kernel(scale_ref, q_ref, k_ref, v_ref, bias_ref, do_ref, m_ref, log_l_ref, delta_ref,
                *refs, d: _Dims):
  refs = list(refs)
  nibbles_ref = refs.pop(0) if d.dropout else None
  term_ref = refs.pop(0) if d.term_batch else None
  dscores_ref = refs.pop(0) if d.scores else None
  dk_ref, dv_ref = refs[:2]
  dlogits_ref = refs[2] if d.dlogits else None
  dk_sc, dv_sc = refs[-2:]
  i = pl.program_id(3)  # the query tile (inner), against the step's key tile

  @pl.when(i == 0)
  def _():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  for e in range(d.group):
    (q, k), v, do = _qk(d, q_ref, k_ref, e), v_ref[e], do_ref[e]
    p = _probabilities(d, q, k, None if term_ref is None else term_ref[e], bias_ref[...],
                       m_ref[e], log_l_ref[e], scale_ref)
    keep = _keep(d, _unpacked(d, nibbles_ref[e])) if d.dropout else None
    dv_sc[e] += jax.lax.dot_general(_drop(d, p, keep).astype(do.dtype), do, _TRANS_A,
                                    preferred_element_type=jnp.float32)
    dp = _drop(d, jax.lax.dot_general(do, v, _TRANS_B, preferred_element_type=jnp.float32),
               keep)
    ds = p * (dp - _column(delta_ref[e]))
    if d.scaled:
      ds = ds * scale_ref[0]
    if dscores_ref is not None:
      ds = ds + dscores_ref[e].astype(jnp.float32)
    if dlogits_ref is not None:
      dlogits_ref[e] = ds.astype(dlogits_ref.dtype)
    if d.dot:  # (dK stays zero without the dot product)
      dk_sc[e] += jax.lax.dot_general(ds.astype(q.dtype), q, _TRANS_A,
                                      preferred_element_type=jnp.float32)

  @pl.when(i == pl.num_programs(3) - 1)
  def _():
    dk_ref[...] = (dk_sc[...] * d.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(scale_ref, q_ref, k_ref, v_ref, bias_ref, do_ref, m_ref, log_l_ref, delta_ref,
               *refs, d: _Dims):
  """Plain attention (no term): the probabilities and their gradient rebuilt."""
  refs = list(refs)
  nibbles_ref = refs.pop(0) if d.dropout else None
  dq_ref, dq_sc = refs
  j = pl.program_id(3)

  @pl.when(j == 0)
  def _():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  for e in range(d.group):
    q, k, v, do = q_ref[e], k_ref[e], v_ref[e], do_ref[e]
    p = _probabilities(d, q, k, None, bias_ref[...], m_ref[e], log_l_ref[e], scale_ref)
    keep = _keep(d, _unpacked(d, nibbles_ref[e])) if d.dropout else None
    dp = _drop(d, jax.lax.dot_general(do, v, _TRANS_B, preferred_element_type=jnp.float32),
               keep)
    ds = p * (dp - _column(delta_ref[e]))
    if d.scaled:
      ds = ds * scale_ref[0]
    dq_sc[e] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    dq_ref[...] = (dq_sc[...] * d.sm_scale).astype(dq_ref.dtype)


def _dq_from_logits_kernel(k_ref, dlogits_ref, dq_ref, dq_sc, *, d: _Dims):
  """With a term: dQ = dlogits K / sqrt(d), from the gradient the dK/dV kernel wrote."""
  j = pl.program_id(3)

  @pl.when(j == 0)
  def _():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  for e in range(d.group):
    k = k_ref[e]
    dq_sc[e] += jnp.dot(dlogits_ref[e].astype(k.dtype), k, preferred_element_type=jnp.float32)

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    dq_ref[...] = (dq_sc[...] * d.sm_scale).astype(dq_ref.dtype)


class _Specs:
  """BlockSpecs over grid (b, group of d.group heads, outer tile, inner tile); `by_q`: the
  outer tile counts queries (forward, dQ), else keys (dK/dV)."""

  def __init__(self, d: _Dims, by_q: bool):
    self.d, self.by_q = d, by_q

  def _qk(self, i, j):  # (query tile, key tile) of grid indices (outer, inner)
    return (i, j) if self.by_q else (j, i)

  def queries(self):  # [B, H, Tq, D] at the query tile
    return pl.BlockSpec((None, self.d.group, self.d.block, self.d.head_dim),
                        lambda b, h, i, j: (b, h, self._qk(i, j)[0], 0))

  def keys(self):  # [B, H, Tk, D] at the key tile
    return pl.BlockSpec((None, self.d.group, self.d.block, self.d.head_dim),
                        lambda b, h, i, j: (b, h, self._qk(i, j)[1], 0))

  def key_bias(self):  # [B, 1, Tk]
    return pl.BlockSpec((None, 1, self.d.block), lambda b, h, i, j: (b, 0, self._qk(i, j)[1]))

  def row_stats(self):  # [B, H, 1, Tq]
    return pl.BlockSpec((None, self.d.group, 1, self.d.block),
                        lambda b, h, i, j: (b, h, 0, self._qk(i, j)[0]))

  def tile(self, shared=False):  # [B or 1, H, Tq, Tk] at (query tile, key tile)
    return pl.BlockSpec((None, self.d.group, self.d.block, self.d.block),
                        lambda b, h, i, j: (0 if shared else b, h, *self._qk(i, j)))

  def nibbles(self):  # [B, H, Tq / 4 / p, Tk] at (query tile, key tile): _packed _nibbles
    return pl.BlockSpec((None, self.d.group, self.d.block // 4 // _packing(self.d),
                         self.d.block),
                        lambda b, h, i, j: (b, h, *self._qk(i, j)))

  @staticmethod
  def smem():
    return pl.BlockSpec(memory_space=pltpu.SMEM)

  @staticmethod
  def unread():  # an operand left where it is (HBM), not copied tile by tile
    return pl.BlockSpec(memory_space=pl.ANY)


def _call(kernel, d, grid, operands, out_specs, out_shape, scratch, interpret, name,
          matmuls: int, aliases=None, exps: bool = True):
  """pallas_call over grid (b, h, outer tile, inner tile: sequential); operands: (BlockSpec,
  array) pairs. Its cost estimate states `matmuls` products of the real (unpadded) query and
  key lengths, 2 Tq Tk D FLOPs each per sequence and head, and an exp per score (`exps`): what
  realformer.tools.hlo_stats counts for the kernel (padding is not the model's work)."""
  specs, arrays = zip(*operands)
  batch, heads = grid[0], grid[1] * d.group
  scores = batch * heads * d.mask_q_len * d.k_real
  nbytes = sum(x.size * x.dtype.itemsize for spec, x in operands  # (unread ones not)
               if spec.memory_space is not pl.ANY) + sum(
      math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(out_shape))
  cost = pl.CostEstimate(flops=2 * matmuls * scores * d.head_dim,
                         transcendentals=scores if exps else 0,
                         bytes_accessed=int(nbytes))
  params = pltpu.CompilerParams(
      dimension_semantics=('parallel', 'parallel', 'parallel', 'arbitrary'))
  return pl.pallas_call(functools.partial(kernel, d=d), grid=grid, in_specs=list(specs),
                        out_specs=out_specs, out_shape=out_shape, scratch_shapes=scratch,
                        compiler_params=params, interpret=interpret, name=name,
                        cost_estimate=cost, input_output_aliases=aliases or {})(*arrays)


def _common(ops, sp):
  """The leading operands of the kernels that compute probabilities (all but
  dQ-from-logits); the forward kernel reads the dropout key and offsets before them."""
  dot = sp.d.dot
  return [(sp.smem(), ops.scalars), (sp.queries() if dot else sp.unread(), ops.q),
          (sp.keys() if dot else sp.unread(), ops.k), (sp.keys(), ops.v),
          (sp.key_bias(), ops.key_bias)]


def _forward(ops, d: _Dims, interpret, scores_dtype):
  batch, heads = ops.q.shape[:2]
  sp = _Specs(d, by_q=True)
  operands = [(sp.smem(), ops.seed), (sp.smem(), ops.offsets)] + _common(ops, sp)
  if d.term_batch:
    operands.append((sp.tile(d.term_batch == 1), ops.term))
  stats = jax.ShapeDtypeStruct((batch, heads, 1, d.q_len), jnp.float32)
  out_specs = [sp.queries(), sp.row_stats(), sp.row_stats()]
  out_shape = [jax.ShapeDtypeStruct(ops.q.shape, ops.q.dtype), stats, stats]
  if d.scores:
    out_specs.append(sp.tile())
    out_shape.append(jax.ShapeDtypeStruct((batch, heads, d.q_len, d.k_len), scores_dtype))
  if d.dropout:
    out_specs.append(sp.nibbles())
    out_shape.append(jax.ShapeDtypeStruct((batch, heads, d.q_len // 4 // _packing(d), d.k_len),
                                          jnp.int32))
  scratch = [pltpu.VMEM((d.group, d.block, 1), jnp.float32),
             pltpu.VMEM((d.group, d.block, 1), jnp.float32),
             pltpu.VMEM((d.group, d.block, d.head_dim), jnp.float32)]
  grid = (batch, heads // d.group, d.q_len // d.block, d.k_len // d.block)
  out, m, log_l, *rest = _call(_forward_kernel, d, grid, operands, out_specs, out_shape,
                               scratch, interpret, 'flash_attention_tpu_forward',
                               matmuls=1 + d.dot)
  scores = rest.pop(0) if d.scores else None
  return out, scores, (m, log_l, rest[0] if d.dropout else None)


def _backward(ops, d: _Dims, interpret, out, stats, dout, dscores):
  batch, heads = ops.q.shape[:2]
  m, log_l, nibbles = stats
  delta = jnp.einsum('bhqd,bhqd->bhq', out.astype(jnp.float32),
                     dout.astype(jnp.float32))[:, :, None, :]
  grid_k = (batch, heads // d.group, d.k_len // d.block, d.q_len // d.block)
  sp = _Specs(d, by_q=False)
  operands = _common(ops, sp) + [(sp.queries(), dout), (sp.row_stats(), m),
                                 (sp.row_stats(), log_l), (sp.row_stats(), delta)]
  if d.dropout:
    operands.append((sp.nibbles(), nibbles))
  if d.term_batch:
    operands.append((sp.tile(d.term_batch == 1), ops.term))
  aliases = None
  dlogits_dtype = dlogits_dtype_of(ops, dscores)
  if d.scores:
    operands.append((sp.tile(), dscores))
    if dscores.dtype == dlogits_dtype:  # written over the incoming gradient, tile by tile
      aliases = {len(operands) - 1: 2}
  out_specs = [sp.keys(), sp.keys()]
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (ops.k, ops.v)]
  if d.dlogits:
    out_specs.append(sp.tile())
    out_shape.append(jax.ShapeDtypeStruct((batch, heads, d.q_len, d.k_len), dlogits_dtype))
  scratch = [pltpu.VMEM((d.group, d.block, d.head_dim), jnp.float32)] * 2
  dk, dv, *dlogits = _call(_dkv_kernel, d, grid_k, operands, out_specs, out_shape, scratch,
                           interpret, 'flash_attention_tpu_dkv', matmuls=2 + 2 * d.dot,
                           aliases=aliases)
  grid_q = (batch, heads // d.group, d.q_len // d.block, d.k_len // d.block)
  sp = _Specs(d, by_q=True)
  dq_shape = jax.ShapeDtypeStruct(ops.q.shape, ops.q.dtype)
  scratch = [pltpu.VMEM((d.group, d.block, d.head_dim), jnp.float32)]
  if not d.dot:
    dq = jnp.zeros(dq_shape.shape, dq_shape.dtype)
  elif d.dlogits:
    dq = _call(_dq_from_logits_kernel, d, grid_q,
               [(sp.keys(), ops.k), (sp.tile(), dlogits[0])], sp.queries(), dq_shape, scratch,
               interpret, 'flash_attention_tpu_dq', matmuls=1, exps=False)
  else:
    operands = _common(ops, sp) + [(sp.queries(), dout), (sp.row_stats(), m),
                                   (sp.row_stats(), log_l), (sp.row_stats(), delta)]
    if d.dropout:
      operands.append((sp.nibbles(), nibbles))
    dq = _call(_dq_kernel, d, grid_q, operands, sp.queries(), dq_shape, scratch, interpret,
               'flash_attention_tpu_dq', matmuls=3)
  return dq, dk, dv, (dlogits[0] if dlogits else None)


def _heads_major(x, d: _Dims):
  """[B, T, H, D] -> [B, H, T padded to whole tiles, D]."""
  return jnp.pad(jnp.swapaxes(x, 1, 2),
                 ((0, 0), (0, 0), (0, round_up(x.shape[1], d.block) - x.shape[1]), (0, 0)))


def _tokens_major(x, length):
  """[B, H, T padded, D] -> [B, length, H, D]."""
  return jnp.swapaxes(x[:, :, :length], 1, 2)


def _padded_pairs(x, d: _Dims):
  """[., H, Tq, Tk] -> padded to whole tiles."""
  if x is None or x.shape[2:] == (d.q_len, d.k_len):
    return x
  return jnp.pad(x, ((0, 0), (0, 0), (0, d.q_len - x.shape[2]), (0, d.k_len - x.shape[3])))


def _kernel_layout(ops: Operands, d: _Dims) -> Operands:
  """The operands as the kernels read them: heads-major, padded to whole tiles (without the
  dot product, q's and k's unread slots hold v's one copy, not two more of their own)."""
  bias = jnp.pad(ops.key_bias, ((0, 0), (0, d.k_len - d.k_real)),
                 constant_values=BLOCK_PADDING)[:, None, :]
  v = _heads_major(ops.v, d)
  q, k = (_heads_major(ops.q, d), _heads_major(ops.k, d)) if d.dot else (v, v)
  return ops._replace(q=q, k=k, v=v, key_bias=bias, term=_padded_pairs(ops.term, d))


# The custom VJP takes and keeps the operands in the caller's layout ([B, T, H, D], unpadded):
# its residual `out` is then the very array the output projection keeps as its input, not a
# heads-major copy of it; the backward transposes again (a pass over [B, T, H, D] arrays).
@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _flash(ops, static):
  return _flash_fwd(ops, static)[0]


def _flash_fwd(ops, static):
  d, interpret, scores_dtype = static
  out, scores, stats = _forward(_kernel_layout(ops, d), d, interpret, scores_dtype)
  out = _tokens_major(out, d.mask_q_len)
  if scores is not None:
    scores = scores[:, :, :d.mask_q_len, :d.k_real]
  out, stats = checkpoint_name((out, stats), RESIDUALS_NAME)
  return (out, scores), (ops, out, stats)


def _flash_bwd(static, residuals, cotangents):
  d, interpret, _ = static
  ops, out, stats = residuals
  dout, dscores = cotangents
  dq, dk, dv, dlogits = _backward(_kernel_layout(ops, d), d, interpret, _heads_major(out, d),
                                  stats, _heads_major(dout, d), _padded_pairs(dscores, d))
  dterm = None
  if d.term_batch:  # a term shared by the batch gets the sum of its examples' gradients
    dlogits = dlogits[:, :, :d.mask_q_len, :d.k_real]
    dterm = (dlogits if d.term_batch == ops.q.shape[0] else
             dlogits.sum(0, keepdims=True, dtype=jnp.float32)).astype(ops.term.dtype)
  zeros = lambda x: np.zeros(x.shape, jax.dtypes.float0)
  return (Operands(_tokens_major(dq, d.mask_q_len), _tokens_major(dk, d.k_real),
                   _tokens_major(dv, d.k_real), jnp.zeros_like(ops.key_bias), dterm,
                   jnp.zeros_like(ops.scalars), zeros(ops.seed), zeros(ops.offsets)),)


_flash.defvjp(_flash_fwd, _flash_bwd)
# One program for each static configuration (as flash_attention._flash_program).
_flash_program = jax.jit(_flash, static_argnums=1)


def tile_for(q_len: int, k_len: int) -> int:
  """The largest tile of at most MAX_TILE queries and keys that pads neither length more
  than whole lanes do: fewer grid steps (each costs a fixed overhead), and a tile of 512
  keys draws its dropout blocks four to a vreg (_nibbles)."""
  lengths = [round_up(n, _LANES) for n in (q_len, k_len)]
  return max(b for b in range(_LANES, MAX_TILE + 1, _LANES)
             if all(n % b == 0 for n in lengths))


def pair_bytes(q_dtype, term_dtype=None, scores_dtype=None) -> int:
  """The bytes per query-key pair of the dK/dV kernel's [B, H, Tq, Tk] blocks: the term, the
  logits' gradient (in the term's dtype, or the scores', or q's where wider) and the scores'
  gradient; 0 with neither a term nor scores."""
  if term_dtype is None and scores_dtype is None:
    return 0
  pairs = [] if term_dtype is None else [term_dtype]
  pairs += [jnp.promote_types(term_dtype or scores_dtype, q_dtype)]
  pairs += [] if scores_dtype is None else [scores_dtype]
  return sum(jnp.dtype(t).itemsize for t in pairs)


def heads_per_step(heads: int, block: int, head_dim: int = 64, itemsize: int = 2,
                   pair_bytes: int = 0, vmem_bytes: int = STEP_VMEM_BYTES) -> int:
  """The most heads (a divisor of `heads`) a grid step computes, one after the other, whose
  tiles together hold no more than one MAX_TILE x MAX_TILE tile and whose dK/dV blocks fit
  `vmem_bytes` (step_vmem_bytes()): at short lengths a step's fixed cost is shared by
  several heads. itemsize: q's; pair_bytes: the [B, H, Tq, Tk] blocks' (pair_bytes)."""
  per_head = 2 * (6 * block * head_dim * itemsize + block * block * pair_bytes)
  fits = max(1, vmem_bytes // per_head)
  return max(g for g in range(1, heads + 1) if heads % g == 0 and g <= fits
             and g * block * block <= MAX_TILE * MAX_TILE)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_bias: jax.Array, *,
                    term=None, logit_scale=None, scores_dtype=None,
                    dropout_rate: float = 0.0, dropout_key=None, offsets=(0, 0, None),
                    interpret: bool = False, block: Optional[int] = None,
                    group: Optional[int] = None):
  """realformer.layers.flash_attention.flash_attention's contract on a TPU (see there):
  returns out [B, Tq, H, D], or (out, scores [B, H, Tq, Tk]) with scores_dtype (q and k
  None: the logits are the term alone, and q's and k's tiles are never read). block: the
  tiles' queries and keys (a multiple of 128; default: tile_for(Tq, Tk)); group: the heads
  a grid step computes (a divisor of H; default: heads_per_step's for these shapes and
  dtypes)."""
  if dropout_rate > 0 and dropout_key is None:
    raise ValueError('flash_attention with dropout needs dropout_key')
  q, k, dot = operand_slots(q, k, v, term)
  block = tile_for(q.shape[1], k.shape[1]) if block is None else block
  if block % _LANES or not _LANES <= block <= MAX_TILE:
    raise ValueError(f'flash attention on a TPU: block={block}; give a multiple of 128 up to '
                     f'{MAX_TILE}')
  batch, q_len, heads, head_dim = q.shape
  k_len = k.shape[1]
  if term is not None and (term.ndim != 4 or term.shape[0] not in (1, batch)
                           or term.shape[1:] != (heads, q_len, k_len)):
    raise ValueError(f'flash_attention: term {term.shape} is not [B or 1, H, Tq, Tk] = '
                     f'[{batch} or 1, {heads}, {q_len}, {k_len}]')
  if group is None:
    group = heads_per_step(heads, block, head_dim, jnp.dtype(q.dtype).itemsize, pair_bytes(
        q.dtype, None if term is None else term.dtype, scores_dtype), step_vmem_bytes())
  if heads % group:
    raise ValueError(f'flash attention on a TPU: group={group} does not divide the {heads} '
                     'heads')
  d = _Dims(round_up(q_len, block), round_up(k_len, block), head_dim, block,
            float(dropout_rate), q_len, k_len, term_batch=0 if term is None else term.shape[0],
            scores=scores_dtype is not None, scaled=logit_scale is not None, dot=dot,
            group=group)
  key = jnp.zeros((2,), jnp.uint32) if dropout_key is None else dropout_key
  batch0, head0, total = offsets
  ops = Operands(
      q=q, k=k, v=v, key_bias=finite_key_bias(key_bias), term=term,
      scalars=jax.lax.stop_gradient(jnp.asarray(1.0 if logit_scale is None else logit_scale,
                                                jnp.float32).reshape(1)),
      seed=jnp.concatenate([jax.lax.bitcast_convert_type(
          jnp.asarray(key, jnp.uint32).reshape(2), jnp.int32), jnp.zeros((1,), jnp.int32)]),
      offsets=jnp.stack([jnp.asarray(batch0, jnp.int32), jnp.asarray(head0, jnp.int32),
                         jnp.asarray(heads if total is None else total, jnp.int32)]))
  out, scores = _flash_program(ops, (d, interpret, scores_dtype))
  return out if scores_dtype is None else (out, scores)
