"""The encoder family and its heads.

    model = models.build(config.model)                  # encoder + MLM + NSP heads
    out = model.apply(variables, batch, deterministic=True, capture_attention=True)
    out.hidden      [B, T, D]   final hidden states
    out.attention   tuple of [B, H, T, T] attention probabilities, one per layer (if asked)

`batch` holds int32 [B, T] arrays input_ids, segment_ids, attention_mask (1 = real token),
and for pretraining masked_lm_positions [B, P]. Variants differ only where their papers do:
the block layout (Post-LN / Pre-LN) here, the attention logits in realformer/model/attention.py.
"""

import functools
from typing import Any, Optional, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from realformer.layers import dropout as dropout_lib
from realformer.layers import flash_attention as flash_lib
from realformer.layers.dense import dense
from realformer.layers.rows import last_layer_rows, positions_of_last_layer, take_rows
from realformer.model import attention as attn_lib
from realformer.model import blocks
from realformer.model.spec import EncoderSpec, resolve


@flax.struct.dataclass
class EncoderOutput:
  hidden: jax.Array                              # [B, T, D] ([B, S, D] given output_rows)
  pooled: jax.Array                              # [B, D] tanh(W h_[CLS]), BERT's pooler
  attention: Optional[Tuple[jax.Array, ...]] = None  # per layer [B, H, T, T]


@flax.struct.dataclass
class PretrainingOutput:
  hidden: jax.Array
  pooled: jax.Array
  mlm_logits: jax.Array                          # [B, P, V] float32 (P = T if no positions)
  nsp_logits: Optional[jax.Array]                # [B, 2] float32 (None: MLM alone)
  attention: Optional[Tuple[jax.Array, ...]] = None


def layer_norm(spec: EncoderSpec, name: str):
  """LayerNorm computed in float32 (the policy for every dtype), its variance in two passes
  (mean of squared deviations, as BERT's tf.nn.moments and PyTorch compute it): flax's
  default E[x^2] - E[x]^2 cancels catastrophically when a row's mean is large against its
  spread. On TPUs it keeps only its input for the backward pass and recomputes its
  float32 work there (recomputes_elementwise)."""
  cls = _RECOMPUTED_LAYER_NORM if recomputes_elementwise(spec) else nn.LayerNorm
  return cls(epsilon=spec.layer_norm_eps, dtype=jnp.float32, param_dtype=jnp.float32,
             use_fast_variance=False, name=name,
             scale_init=nn.with_logical_partitioning(nn.initializers.ones, ('embed',)),
             bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)))


_RECOMPUTED_LAYER_NORM = nn.remat(nn.LayerNorm)


def recomputes_elementwise(spec: EncoderSpec) -> bool:
  """Whether the LayerNorms and the MLP's GELU are rematerialised (jax.checkpoint around each,
  the same operations, so the same values and gradients bit for bit) and the hidden
  dropout's masks drawn again in the backward pass from their keys. On TPUs, where what they
  would keep otherwise (a LayerNorm's float32 centred and normalised copies of its input,
  GELU's intermediates, a byte of mask an element) is most of a layer's memory once the
  fused attention keeps nothing [B, H, T, T], and the recomputation is element-wise work
  beside the matrix units. Not under a remat policy (model.remat_policy), which decides what
  each layer keeps: its recomputed forward computes them again already. Not on GPUs, whose
  step time is dominated by such element-wise work and the threefry draws, nor on the CPU."""
  return spec.target_platform == 'tpu' and spec.remat_policy == 'none'


def hidden_dropout(spec: EncoderSpec) -> dropout_lib.Dropout:
  """BERT's dropout of the hidden states (embeddings, sublayer outputs); its mask drawn again
  in the backward pass where recomputes_elementwise."""
  return dropout_lib.Dropout(spec.dropout_rate, redraw=recomputes_elementwise(spec))


def gelu(spec: EncoderSpec, x):
  """GELU in the MLP and the MLM head: model.gelu 'erf' is the exact x * Phi(x) (HF's BERT and
  Google's released BERT checkpoints); 'tanh' is the approximation that google-research/bert
  (since February 2019) and the official RealFormer code compute. Rematerialised where
  recomputes_elementwise."""
  fn = functools.partial(nn.gelu, approximate=spec.gelu == 'tanh')
  return jax.checkpoint(fn)(x) if recomputes_elementwise(spec) else fn(x)


def _embed(num, features, axes, spec, name):
  init = nn.initializers.normal(spec.initializer_range)
  return nn.Embed(num, features, dtype=spec.dtype, param_dtype=jnp.float32, name=name,
                  embedding_init=nn.with_logical_partitioning(init, axes))


class Embeddings(nn.Module):
  spec: EncoderSpec

  @nn.compact
  def __call__(self, input_ids, segment_ids, deterministic=True):
    s = self.spec
    t = input_ids.shape[1]
    words = _embed(s.padded_vocab_size, s.hidden_size, ('vocab', 'embed'), s, 'word_embeddings')
    # The words are gathered from the float32 table and cast afterwards (the same values as
    # casting first): the gather's gradient is a scatter-add into the table, which in
    # bfloat16 would sum a frequent token's thousands of rows in bfloat16 and, on a GPU,
    # run as a compare-and-swap loop; in float32 it is exact to float32 and a native atomic.
    x = jnp.take(words.embedding, input_ids, axis=0).astype(s.dtype)
    # Positions and token types are looked up without a gather: the rows of a gather's
    # gradient are summed by a scatter-add, and with every sequence hitting the same 512
    # (or 2) rows that scatter serialises on its atomics (on a GPU, most of a BERT-base
    # step). A slice and a select give the same values, and a reduction as their gradient.
    positions = _embed(s.max_len, s.hidden_size, (None, 'embed'), s, 'position_embeddings')
    x = x + positions.embedding[:t].astype(s.dtype)[None]
    types = _embed(s.type_vocab_size, s.hidden_size, (None, 'embed'), s,
                   'token_type_embeddings')
    table = types.embedding.astype(s.dtype)
    segments = segment_ids[..., None]
    x = x + functools.reduce(jnp.add, (jnp.where(segments == k, table[k], 0).astype(s.dtype)
                                       for k in range(s.type_vocab_size)))
    x = layer_norm(s, 'layer_norm')(x).astype(s.dtype)
    return hidden_dropout(s)(x, deterministic=deterministic)


class Mlp(nn.Module):
  spec: EncoderSpec

  @nn.compact
  def __call__(self, x):
    s = self.spec
    h = dense(s.mlp_dim, ('embed', 'mlp'), s, 'intermediate',
              gain=blocks.init_gain(s, 'intermediate'))(x)
    h = gelu(s, h)
    return dense(s.hidden_size, ('mlp', 'embed'), s, 'output',
                 gain=blocks.init_gain(s, 'output'))(h)


class _Parts:
  """The parts that a block joins (realformer/model/blocks.py) in one call of Block, made
  in its scope: the attention module at once (named 'attention'), the others when the block
  first asks for them."""

  def __init__(self, block: 'Block', bias, scores, layer_index, rows):
    self.spec, self._deterministic = block.spec, block.deterministic
    self._capture = block.capture_attention
    self._attention = attn_lib.SelfAttention(block.spec, name='attention')
    self._bias, self._layer_index, self._rows = bias, layer_index, rows
    self.scores, self.probs = scores, None  # RealFormer's carry out; captured probabilities

  def attention(self, h):
    a, self.scores, self.probs = self._attention(
        h, self._bias, self.scores, self._layer_index, self._rows,
        deterministic=self._deterministic, capture_attention=self._capture)
    return a

  def residual(self, y):
    return y if self._rows is None else take_rows(y, self._rows)

  def mlp(self, h):
    return Mlp(self.spec, name='mlp')(h)

  def norm(self, name: str, y):
    return layer_norm(self.spec, name)(y).astype(self.spec.dtype)

  def dropout(self, y):
    return hidden_dropout(self.spec)(y, deterministic=self._deterministic)


class Block(nn.Module):
  """One encoder layer: its block (model.block, realformer/model/blocks.py) joining the
  parts (_Parts). carry = (x [B,T,D], residual scores [B,H,T,T] or None).

  rows [B, S]: compute only those rows of the output (x becomes [B, S, D]); keys and values
  still come from every token, so the rows equal the full layer's. None: every row.
  """
  spec: EncoderSpec
  deterministic: bool = True
  capture_attention: bool = False

  @nn.compact
  def __call__(self, carry, layer_index, bias, rows=None):
    x, scores = carry
    x = nn.with_logical_constraint(x, ('batch', 'length', 'embed'))
    parts = _Parts(self, bias, scores, layer_index, rows)
    x = blocks.get(self.spec.block).layer(parts, x)
    return (x, parts.scores), parts.probs


# model.remat_policy: what each layer keeps for its backward pass (the rest is recomputed
# there). `full` keeps the layer's input alone; `dots` the matmuls' outputs; `dots_no_batch`
# those without batch dimensions (not the attention's); `dots_flash` the matmuls' outputs,
# the flash kernels' outputs and softmax statistics and the dropout masks, so that only
# element-wise work (LayerNorm, GELU, softmax, biases, sums) runs again: no flash kernel's
# forward and no mask's threefry draw (`dots` runs both again).
_REMAT_POLICIES = {
    'full': None,
    'dots': jax.checkpoint_policies.checkpoint_dots,
    'dots_no_batch': jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    'dots_flash': jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots,
        jax.checkpoint_policies.save_only_these_names(flash_lib.RESIDUALS_NAME,
                                                      dropout_lib.MASKS_NAME)),
}


class Encoder(nn.Module):
  """Embeddings, the layer stack (unrolled or nn.scan), Pre-LN's final LayerNorm, pooler.

  output_rows [B, S]: return hidden [B, S, D], the final hidden states at those positions
  (hidden[b, s] = full hidden[b, output_rows[b, s]] for positions in [0, T)). With
  model.last_layer='predicted' the last layer then computes only those rows and [CLS] (the
  pooler's), padded to a multiple of 8 (rows.last_layer_rows), unless the layers are scanned
  or attention is captured, where the rows are picked from the full output.
  """
  spec: EncoderSpec

  @nn.compact
  def __call__(self, batch, *, deterministic=True, capture_attention=False, output_rows=None):
    s = self.spec
    input_ids = batch['input_ids']
    b, t = input_ids.shape
    if t > s.max_len:
      raise ValueError(f'sequence length {t} exceeds model.max_len={s.max_len}; shorten '
                       f'data.max_seq_length or raise model.max_len')
    segment_ids = batch.get('segment_ids', jnp.zeros_like(input_ids))
    mask = batch.get('attention_mask', jnp.ones_like(input_ids))
    bias = attn_lib.mask_bias(mask)
    x = Embeddings(s, name='embeddings')(input_ids, segment_ids, deterministic)
    # RealFormer's carried scores: none into the first layer, except where the layers are
    # scanned (one program for all: the first reads a carry of zeros).
    scores = (jnp.zeros((b, s.num_heads, t, t), s.residual_dtype)
              if s.residual_attention and s.scan_layers else None)

    rows = None  # the last layer's rows, when it computes only some: [CLS], output_rows, filler
    if (output_rows is not None and s.last_layer == 'predicted' and not s.scan_layers
        and not capture_attention):
      rows = last_layer_rows(output_rows, t)
    block = Block
    if s.remat_policy != 'none':
      block = nn.remat(Block, policy=_REMAT_POLICIES[s.remat_policy],
                       prevent_cse=not s.scan_layers)
    if s.scan_layers:
      stack = nn.scan(block, variable_axes={'params': 0}, split_rngs={'params': True,
                      'dropout': True}, in_axes=(0, nn.broadcast), length=s.num_layers,
                      metadata_params={nn.PARTITION_NAME: 'layers'})
      (x, scores), probs = stack(s, deterministic, capture_attention, name='layers')(
          (x, scores), jnp.arange(s.num_layers), bias)
      probs = tuple(probs) if capture_attention else None  # [L, B, H, T, T] -> per layer
    else:
      probs = []
      for i in range(s.num_layers):
        (x, scores), p = block(s, deterministic, capture_attention, name=f'layers_{i}')(
            (x, scores), i, bias, rows if i == s.num_layers - 1 else None)
        probs.append(p)
      probs = tuple(probs) if capture_attention else None
    if blocks.get(s.block).final_layer_norm:
      x = layer_norm(s, 'final_layer_norm')(x).astype(s.dtype)
    pooled = jnp.tanh(dense(s.hidden_size, ('embed', 'mlp'), s, 'pooler')(x[:, 0]))
    if rows is not None:
      x = positions_of_last_layer(x, output_rows.shape[1])
    elif output_rows is not None:
      x = take_rows(x, output_rows)
    return EncoderOutput(hidden=x, pooled=pooled, attention=probs)


class MlmHead(nn.Module):
  """Dense + GELU + LayerNorm, decoder tied to the word embeddings, output bias."""
  spec: EncoderSpec

  @nn.compact
  def __call__(self, hidden, word_embeddings):
    s = self.spec
    h = dense(s.hidden_size, ('embed', 'mlp'), s, 'transform')(hidden)
    h = layer_norm(s, 'layer_norm')(gelu(s, h)).astype(s.dtype)
    # FSDP's all-gather of the tied table, made explicit: left to the partitioner (table
    # sharded over fsdp, rows over data x fsdp) the backward pass came out wrong on
    # data x fsdp x tensor meshes with two rows per batch shard.
    word_embeddings = nn.with_logical_constraint(word_embeddings, ('vocab', None))
    logits = jnp.einsum('bpd,vd->bpv', h, word_embeddings.astype(s.dtype),
                        preferred_element_type=jnp.float32)
    bias = self.param('output_bias', nn.with_logical_partitioning(nn.initializers.zeros,
                      ('vocab',)), (s.padded_vocab_size,), jnp.float32)
    logits = logits.astype(jnp.float32) + bias
    if s.padded_vocab_size != s.vocab_size:  # padding ids can never be predicted
      real = jnp.arange(s.padded_vocab_size) < s.vocab_size
      logits = jnp.where(real, logits, attn_lib.NEG_INF)
    return logits


class BertForPretraining(nn.Module):
  """Encoder + MLM head (only at masked_lm_positions when given) + NSP classifier (none with
  next_sentence=False: RoBERTa's MLM alone, config.objective=mlm; the pooler then trains on
  nothing and the optimizer leaves it at its init, for fine-tuning to train).

  full_hidden=False (the pretraining loss): out.hidden holds only the masked positions'
  rows, [B, P, D], and with model.last_layer='predicted' the last layer computes only those
  rows and [CLS]: the same logits without dropout (with it, the masks are drawn over the
  computed rows: the same distribution, other draws), and so fewer FLOPs
  (train_lib.flops_per_example counts them). The default keeps the public contract,
  out.hidden [B, T, D].
  """
  spec: EncoderSpec
  next_sentence: bool = True

  @nn.compact
  def __call__(self, batch, *, deterministic=True, capture_attention=False, full_hidden=True):
    s = self.spec
    enc = Encoder(s, name='encoder')
    positions = batch.get('masked_lm_positions')
    out = enc(batch, deterministic=deterministic, capture_attention=capture_attention,
              output_rows=None if full_hidden else positions)
    hidden = out.hidden
    if positions is not None and full_hidden:
      hidden = take_rows(hidden, positions)  # BERT's gather_indexes
    table = enc.variables['params']['embeddings']['word_embeddings']['embedding']
    table = nn.meta.unbox(table)
    mlm_logits = MlmHead(s, name='mlm_head')(hidden, table)
    nsp_logits = None
    if self.next_sentence:
      nsp_logits = dense(2, ('mlp', None), s, 'nsp_head')(out.pooled).astype(jnp.float32)
    return PretrainingOutput(hidden=out.hidden, pooled=out.pooled, mlm_logits=mlm_logits,
                             nsp_logits=nsp_logits, attention=out.attention)


class BertForSequenceClassification(nn.Module):
  """Encoder + dropout + linear on the pooled [CLS] (num_labels=1: regression, e.g. STS-B)."""
  spec: EncoderSpec
  num_labels: int = 2

  @nn.compact
  def __call__(self, batch, *, deterministic=True, capture_attention=False):
    s = self.spec
    out = Encoder(s, name='encoder')(batch, deterministic=deterministic,
                                     capture_attention=capture_attention)
    pooled = hidden_dropout(s)(out.pooled, deterministic=deterministic)
    logits = dense(self.num_labels, ('mlp', None), s, 'classifier')(pooled)
    return out, logits.astype(jnp.float32)


class BertForQuestionAnswering(nn.Module):
  """Encoder + span head: start and end logits per token, padding masked out."""
  spec: EncoderSpec

  @nn.compact
  def __call__(self, batch, *, deterministic=True, capture_attention=False):
    s = self.spec
    out = Encoder(s, name='encoder')(batch, deterministic=deterministic,
                                     capture_attention=capture_attention)
    logits = dense(2, ('embed', None), s, 'span_head')(out.hidden).astype(jnp.float32)
    mask = batch.get('attention_mask', jnp.ones_like(batch['input_ids'])).astype(bool)
    logits = jnp.where(mask[..., None], logits, attn_lib.NEG_INF)
    return out, logits[..., 0], logits[..., 1]


class BertForTokenClassification(nn.Module):
  """Encoder + dropout + linear on every token (named-entity tags: logits [B, T, num_labels],
  read at each word's first piece), as transformers' BertForTokenClassification."""
  spec: EncoderSpec
  num_labels: int = 2

  @nn.compact
  def __call__(self, batch, *, deterministic=True, capture_attention=False):
    s = self.spec
    out = Encoder(s, name='encoder')(batch, deterministic=deterministic,
                                     capture_attention=capture_attention)
    hidden = hidden_dropout(s)(out.hidden, deterministic=deterministic)
    logits = dense(self.num_labels, ('embed', None), s, 'token_classifier')(hidden)
    return out, logits.astype(jnp.float32)


HEADS = {
    'pretraining': BertForPretraining,
    'encoder': Encoder,
    'classification': BertForSequenceClassification,
    'span': BertForQuestionAnswering,
    'token_classification': BertForTokenClassification,
}


def build(model_config: Any, head: str = 'pretraining', **kwargs) -> nn.Module:
  """config.model -> a flax.linen Module (the encoder with the named head)."""
  if head not in HEADS:
    raise ValueError(f'unknown head {head!r}; choose one of {", ".join(HEADS)}')
  spec = model_config if isinstance(model_config, EncoderSpec) else resolve(model_config)
  return HEADS[head](spec, **kwargs)
