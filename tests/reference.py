"""An independent NumPy (float64) reference of every encoder variant, written from the
definitions in docs/design.md and the papers, not from the Flax code. Parameters are read from a
Flax parameter tree (unrolled layers) and cast to float64."""

import math

import numpy as np
from scipy.special import erf

NEG = -1e9


def _f64(tree):
  if isinstance(tree, dict):
    return {k: _f64(v) for k, v in tree.items()}
  return np.asarray(getattr(tree, 'value', tree), dtype=np.float64)


def layer_norm(x, p, eps):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * p['scale'] + p['bias']


def linear(x, p):
  return x @ p['kernel'] + p['bias']


def gelu(x, form='erf'):
  """x * Phi(x) (erf), or the approximation of Hendrycks & Gimpel with tanh."""
  if form == 'tanh':
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
  return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def softmax(z):
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def split_heads(y, h):
  b, t, d = y.shape
  return y.reshape(b, t, h, d // h).transpose(0, 2, 1, 3)  # [B, H, T, dh]


# The float64 formulas of attention-logit components of one's own: name -> f(params, x, spec)
# -> logits [B or 1, H, T, T] (params: the component's, {} if it has none; x [B, T, D]).
# A component's test adds its own, written from its definition, not from its Flax code.
COMPONENTS = {}


def synth_logits(name, p, x, spec):
  """Logits [B or 1, H, T, T] of one synthesizer, straight from the paper's definitions (or
  a component of one's own, from COMPONENTS)."""
  if name in COMPONENTS:
    return COMPONENTS[name](p, x, spec)
  b, t, _ = x.shape
  h, L = spec.num_heads, spec.max_len
  if name == 'dense':  # F(X_i) = W2 relu(W1 X_i + b1) + b2, one row of L logits per token/head
    f = linear(np.maximum(linear(x, p['hidden']), 0.0), p['logits'])  # [B, T, H*L]
    f = f.reshape(b, t, h, L).transpose(0, 2, 1, 3)
    return f[..., :t]
  if name == 'random':
    return p['random_logits'][None, :, :t, :t]
  if name == 'factorized_dense':
    a_dim, b_dim = spec.factorized_ab
    fa = linear(x, p['factor_a']).reshape(b, t, h, a_dim)
    fb = linear(x, p['factor_b']).reshape(b, t, h, b_dim)
    out = np.zeros((b, h, t, t))
    for j in range(t):  # H_A tiles A (column j uses A[j mod a]); H_B repeats B (B[j div a])
      out[:, :, :, j] = (fa[..., j % a_dim] * fb[..., j // a_dim]).transpose(0, 2, 1)
    return out
  if name == 'factorized_random':
    r1, r2 = p['random_factor_1'][:, :t], p['random_factor_2'][:, :t]
    return np.einsum('hik,hjk->hij', r1, r2)[None]
  raise ValueError(f'no float64 reference for the component {name!r}: add its formula to '
                   'tests/reference.py COMPONENTS')


def _post_ln(x, attend, mlp, ln):
  x = ln('attention_layer_norm', x + attend(x))
  return ln('mlp_layer_norm', x + mlp(x))


def _pre_ln(x, attend, mlp, ln):
  x = x + attend(ln('attention_layer_norm', x))
  return x + mlp(ln('mlp_layer_norm', x))


# model.block -> (layer(x, attend, mlp, ln) -> x, whether a LayerNorm follows the last
# layer): attend(y) is the layer's self-attention of y [B, T, D], mlp(y) its feed-forward,
# ln(name, y) its LayerNorm of that name. A block of one's own adds its formula here
# (written from its definition, not from realformer/model/blocks.py).
BLOCKS = {'post_ln': (_post_ln, False), 'pre_ln': (_pre_ln, True)}


def encoder(params, spec, input_ids, segment_ids, attention_mask):
  """Returns (hidden [B,T,D], probs per layer, own dot scores per layer, carried scores)."""
  assert spec.block in BLOCKS, (
      f'no reference for block {spec.block!r}: give its formula to tests/reference.py BLOCKS')
  layer, final_layer_norm = BLOCKS[spec.block]
  p = _f64(params)
  emb = p['embeddings']
  t = input_ids.shape[1]
  x = (emb['word_embeddings']['embedding'][input_ids]
       + emb['position_embeddings']['embedding'][:t][None]
       + emb['token_type_embeddings']['embedding'][segment_ids])
  x = layer_norm(x, emb['layer_norm'], spec.layer_norm_eps)
  bias = np.where(attention_mask[:, None, None, :] > 0, 0.0, NEG)
  h = spec.num_heads
  prev = None
  all_probs, all_own, all_carry = [], [], []
  for l in range(spec.num_layers):
    lp = p[f'layers_{l}']
    ap = lp['attention']

    def attend(y, l=l, ap=ap):
      nonlocal prev
      # The mixture's components weighted by the softmax of its logits, in spec.mixture's
      # order; the others (biases of the logits, or a single component) added as they are.
      weights = dict(zip(spec.mixture, softmax(ap['mixture_logits']))) if spec.mixture else {}
      logits, own = 0.0, None
      for name in spec.attention:
        if name == 'dot':
          q, k = split_heads(linear(y, ap['query']), h), split_heads(linear(y, ap['key']), h)
          own = q @ k.transpose(0, 1, 3, 2) / math.sqrt(spec.head_dim)
          comp = own
        else:
          comp = synth_logits(name, ap.get(f'synth_{name}', {}), y, spec)
        logits = logits + weights.get(name, 1.0) * comp
      all_own.append(own)
      if spec.residual_attention:
        cur = logits if prev is None else logits + prev
        prev = cur
        all_carry.append(cur)
        logits = cur / (l + 1) if spec.running_mean else cur
      probs = softmax(logits + bias)
      all_probs.append(probs)
      v = split_heads(linear(y, ap['value']), h)
      ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(y.shape)
      return linear(ctx, ap['out'])

    mlp = lambda z, lp=lp: linear(gelu(linear(z, lp['mlp']['intermediate']), spec.gelu),
                                  lp['mlp']['output'])
    ln = lambda name, z, lp=lp: layer_norm(z, lp[name], spec.layer_norm_eps)
    x = layer(x, attend, mlp, ln)
  if final_layer_norm:
    x = layer_norm(x, p['final_layer_norm'], spec.layer_norm_eps)
  return x, all_probs, all_own, all_carry


def pooled(params, hidden):
  p = _f64(params)
  return np.tanh(linear(hidden[:, 0], p['pooler']))


def mlm_logits(params, spec, hidden, positions):
  """BERT's MLM head at the masked positions, decoder tied to the word embeddings."""
  p = _f64(params)
  hp = np.take_along_axis(hidden, positions[..., None], axis=1)
  m = p['mlm_head']
  z = layer_norm(gelu(linear(hp, m['transform']), spec.gelu), m['layer_norm'], spec.layer_norm_eps)
  table = p['encoder']['embeddings']['word_embeddings']['embedding']
  logits = z @ table.T + m['output_bias']
  logits[..., spec.vocab_size:] = NEG
  return logits
