"""Encoder blocks (`model.block`): how one layer joins its self-attention and MLP with their
LayerNorms, dropout and residual connections. A block is a function registered here under
its name, which `model.block` (or a preset of realformer/model/spec.py) names:

  @register('post_ln')
  def post_ln(layer, x):  # BERT: LN(x + Sublayer(x))
    x = layer.norm('attention_layer_norm', layer.residual(x) + layer.dropout(layer.attention(x)))
    return layer.norm('mlp_layer_norm', x + layer.dropout(layer.mlp(x)))

`x` is the layer's input [B, T, D]; `layer` (encoder._Parts, made by encoder.Block) gives
the parts, each made where the block first calls it (the attention at once):
  layer.attention(h)   the self-attention of h [B, T, D] (its mask, RealFormer's carried
                       scores and a logit component's terms taken care of): [B, S, D], S
                       the rows the layer outputs (all T, or the pruned last layer's)
  layer.residual(y)    y [B, T, D] at those rows (the residual of the attention's output)
  layer.mlp(h)         the feed-forward sublayer (Dense, GELU, Dense)
  layer.norm(name, y)  LayerNorm `name` of y in the model's dtype; its parameters are named
                       so in the checkpoint (BERT's: attention_layer_norm, mlp_layer_norm)
  layer.dropout(y)     BERT's dropout of the hidden states
  layer.spec           the EncoderSpec (num_layers, hidden_size, ...)
The parts draw their parameters and dropout masks in the order the block first calls them,
so a block's checkpoint and its dropout are fixed by its function. Each is called once a
layer: a second mlp or norm of one name is flax's error of a name taken, a second attention
would share its weights and add RealFormer's carried scores twice.

`register` also declares what the rest of the encoder reads: `final_layer_norm`, a LayerNorm
after the last layer (Pre-LN's); `init_gains(spec) -> {projection: gain}`, a factor on the
standard deviation of the initial kernels of the projections it names (query, key, value,
out, intermediate, output; DeepNet's scales value, out and the MLP's). The float64 reference
of the tests (tests/reference.py BLOCKS) needs the block's formula too; nothing else lists
blocks.
"""

import dataclasses
from typing import Callable, Dict, Optional

Layer = object  # encoder._Parts, as above (not imported: the model imports this module)


@dataclasses.dataclass(frozen=True)
class BlockDef:
  """A registered block: its layer function and what the encoder reads of it."""
  layer: Callable
  final_layer_norm: bool = False
  init_gains: Optional[Callable[..., Dict[str, float]]] = None


BLOCKS: Dict[str, BlockDef] = {}
PROJECTIONS = ('query', 'key', 'value', 'out', 'intermediate', 'output')


def get(name: str) -> BlockDef:
  """The block registered as `name`; another name is a one-line ValueError listing them."""
  if name not in BLOCKS:
    raise ValueError(f'model.block={name!r}; choose one of {", ".join(BLOCKS)} (or one of '
                     'your own: realformer/model/blocks.py)')
  return BLOCKS[name]


def register(name: str, *, final_layer_norm: bool = False,
             init_gains: Optional[Callable[..., Dict[str, float]]] = None):
  """Function decorator: the block that `model.block` names `name`."""
  def add(layer):
    known = BLOCKS.get(name)
    if not name.isidentifier() or (known is not None and (
        known.layer.__module__, known.layer.__qualname__) != (layer.__module__,
                                                              layer.__qualname__)):
      raise ValueError(f'the block name {name!r} is taken or is not a Python identifier')
    BLOCKS[name] = BlockDef(layer, final_layer_norm, init_gains)
    return layer
  return add


def init_gain(spec, projection: str) -> float:
  """The factor on the initial spread of `projection`'s kernel (one of PROJECTIONS) that
  spec.block declares; a gain declared for another name is a one-line ValueError."""
  gains = get(spec.block).init_gains
  declared = gains(spec) if gains else {}
  unknown = sorted(set(declared) - set(PROJECTIONS))
  if unknown:
    raise ValueError(f'block {spec.block!r} declares an init gain for {unknown[0]!r}; name '
                     f'one of {", ".join(PROJECTIONS)}')
  return float(declared.get(projection, 1.0))


@register('post_ln')
def post_ln(layer: Layer, x):
  """BERT's: LN(x + Sublayer(x)), after each sublayer."""
  x = layer.norm('attention_layer_norm',
                 layer.residual(x) + layer.dropout(layer.attention(x)))
  return layer.norm('mlp_layer_norm', x + layer.dropout(layer.mlp(x)))


@register('pre_ln', final_layer_norm=True)
def pre_ln(layer: Layer, x):
  """Xiong et al.'s: x + Sublayer(LN(x)), and a LayerNorm after the last layer."""
  x = layer.residual(x) + layer.dropout(layer.attention(layer.norm('attention_layer_norm', x)))
  return x + layer.dropout(layer.mlp(layer.norm('mlp_layer_norm', x)))
