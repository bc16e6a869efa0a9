"""Device mesh and logical-axis rules: model code names axes, these rules map them to a mesh.

Parameters carry logical names (vocab, embed, mlp, joined_kv, heads, ...); activations are
constrained with (batch, length, embed). A priority-ordered rule list (t5x style) maps each
logical name to mesh axes; the first rule whose mesh axes are still free wins.
Mesh axes: data (pure data parallel), fsdp (data parallel + parameters sharded over it),
tensor (Megatron-style model parallel over heads and the MLP).
"""

import contextlib
import math
from typing import Iterator, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ('data', 'fsdp', 'tensor')

# (logical axis, mesh axis or axes or None), in priority order.
LOGICAL_AXIS_RULES: Tuple[Tuple[str, object], ...] = (
    ('batch', ('data', 'fsdp')),
    ('vocab', 'tensor'),
    ('mlp', 'tensor'),
    ('joined_kv', 'tensor'),
    ('heads', 'tensor'),
    ('embed', 'fsdp'),
    ('length', None),
    ('synth_len', 'fsdp'),  # the Random synthesizers' [H, max_len, ...] tables
    ('synth_len', None),
    ('kv', None),
    ('layers', None),
)


@contextlib.contextmanager
def traced_on(mesh: Mesh) -> Iterator[None]:
  """The context a program over `mesh` is traced in: the mesh, and LOGICAL_AXIS_RULES, which
  map the model's axis names onto it (what a layer decides from its heads' axis, such as
  whether a fused kernel runs, is decided here as in the step)."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    yield


def mesh_shape(mesh_config, num_devices: int) -> Tuple[int, ...]:
  """Resolve the -1 in config.mesh (data, fsdp, tensor) against the device count."""
  sizes = [int(mesh_config[a]) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f'config.mesh {dict(zip(MESH_AXES, sizes))}: at most one axis may be -1')
  bad = [f'{a}={s}' for a, s in zip(MESH_AXES, sizes) if s == 0 or s < -1]
  if bad:
    raise ValueError(f'config.mesh.{bad[0]}: give a positive size, or -1 for the devices the '
                     'other axes leave')
  known = int(np.prod([s for s in sizes if s != -1]))
  if num_devices % known:
    raise ValueError(f'config.mesh {dict(zip(MESH_AXES, sizes))} does not divide the '
                     f'{num_devices} devices; ' + (
                         'make the product of the others divide it' if -1 in sizes else
                         f'make the product of the axes {num_devices} (or set one axis to '
                         '-1 for the devices the others leave)'))
  sizes = [num_devices // known if s == -1 else s for s in sizes]
  if int(np.prod(sizes)) != num_devices:
    raise ValueError(f'config.mesh {dict(zip(MESH_AXES, sizes))} uses {int(np.prod(sizes))} '
                     f'of {num_devices} devices; set one axis to -1 or match the count')
  return tuple(sizes)


def make_mesh(mesh_config, devices: Sequence[jax.Device] = None) -> Mesh:
  """The (data, fsdp, tensor) mesh of config.mesh over `devices` (default: all), laid along
  a TPU slice's physical axes where jax can (jax.make_mesh). A shape that jax cannot lay that
  way (fsdp=8 on a v5p 4x4x4 cube: no product of the cube's sides is 8 along one axis) is laid
  across them (mesh_utils' allow_split_physical_axes), with a warning: its rings cross more
  links than one along an axis would.

  Devices of several TPU slices (a multi-slice job: slices joined by the data-center
  network, DCN, far slower than the chips' links within a slice) are laid as data x (the
  mesh within a slice): the data axis spans the slices, each slice holding data / slices of
  it and the whole fsdp and tensor axes, so that only the data-parallel gradient reduction
  crosses the DCN, once a step. config.mesh.data must then be a multiple of the slices (-1
  is, where fsdp x tensor divides a slice's chips)."""
  from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
  devices = list(devices if devices is not None else jax.devices())
  shape = mesh_shape(mesh_config, len(devices))
  axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  slices = slice_count(devices)
  if slices > 1:
    return Mesh(_multi_slice_grid(shape, devices, slices), MESH_AXES, axis_types=axis_types)
  try:
    return jax.make_mesh(shape, MESH_AXES, devices=devices, axis_types=axis_types)
  except NotImplementedError:
    _warn_split(shape, devices)
    try:
      grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except NotImplementedError as e:
      raise ValueError(f'config.mesh {dict(zip(MESH_AXES, shape))} cannot be laid over the '
                       f'{len(devices)} {devices[0].device_kind} devices ({e}); make each axis '
                       'a product of the slice\'s sides') from None
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


def slice_count(devices) -> int:
  """The TPU slices `devices` span: 1 for one slice, and for GPUs and CPUs, whose devices
  have a slice_index too (XLA gives each host of a multi-node job its own: a GPU cluster's
  nodes are not slices joined by a data-center network, and any mesh may span them)."""
  devices = list(devices)
  if not devices or getattr(devices[0], 'platform', '') != 'tpu':
    return 1
  return len({getattr(d, 'slice_index', 0) for d in devices})


def _warn_split(shape, devices, where: str = '') -> None:
  logging.warning('mesh %s does not follow the physical axes of the %d %s devices%s: laid '
                  'across them (each collective crosses more links; a mesh whose sizes are '
                  'products of the slice\'s sides does not)', dict(zip(MESH_AXES, shape)),
                  len(devices), devices[0].device_kind, where)


def _multi_slice_grid(shape, devices, slices: int) -> np.ndarray:
  """make_mesh's device grid over `slices` TPU slices: the data axis across them."""
  from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
  data, fsdp, tensor = shape
  if data % slices:
    per_slice = len(devices) // slices
    within = math.gcd(tensor, per_slice)
    fits = f'; e.g. data={slices}, fsdp={per_slice // within}' + (
        f', tensor={within}' if within != tensor else '')
    raise ValueError(
        f'config.mesh {dict(zip(MESH_AXES, shape))} over {slices} TPU slices: the data axis '
        f'is the one that spans the slices (fsdp and tensor stay within one, off the '
        f'data-center network), so config.mesh.data must be a multiple of {slices}{fits}')
  within, across = (data // slices, fsdp, tensor), (slices, 1, 1)
  try:
    return mesh_utils.create_hybrid_device_mesh(within, across, devices)
  except NotImplementedError:
    _warn_split(within, devices[:len(devices) // slices], ' of a slice')
    return mesh_utils.create_hybrid_device_mesh(within, across, devices,
                                                allow_split_physical_axes=True)


# The setting a logical axis always measures, for the one-line error of a mesh axis that does
# not divide it (check_divides); other axes (embed, mlp, ... measure more than one) are named
# by the parameter's dimension.
AXIS_SIZES = {'vocab': 'the padded model.vocab_size', 'heads': 'model.num_heads',
              'synth_len': 'model.max_len'}


def check_divides(boxed_params, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> None:
  """Every parameter splits evenly over the mesh axes its logical axes map to (jax refuses
  an uneven split); else a one-line error naming the setting, the parameter and the fix,
  before anything compiles. A new parameter needs no rule here: its logical axes say it."""
  leaves = jax.tree_util.tree_leaves_with_path(
      boxed_params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  for path, leaf in leaves:
    if not isinstance(leaf, nn.LogicallyPartitioned):
      continue
    uneven = uneven_split(leaf, mesh, rules)
    if uneven:
      dim, name, axes, split = uneven
      size = leaf.value.shape[dim]
      setting = '*'.join(f'mesh.{a}' for a in axes)
      where = '/'.join(str(getattr(k, 'key', k)) for k in path)
      measure = f'{AXIS_SIZES[name]}={size}' if name in AXIS_SIZES else f'{size}'
      raise ValueError(f'{setting}={split} does not divide {measure}, along which {where} is '
                       f'split ({name}, its dimension {dim}); choose a {setting} that '
                       f'divides {size}')


def uneven_split(leaf: nn.LogicallyPartitioned, mesh: Mesh, rules=LOGICAL_AXIS_RULES
                 ) -> Optional[Tuple[int, str, Tuple[str, ...], int]]:
  """The first dimension of a boxed array that its logical axes' mesh axes do not split
  evenly, as (dimension, logical name, mesh axes, their size); None where every one splits."""
  shape = leaf.value.shape
  mesh_axes = nn.logical_to_mesh_axes(leaf.names, rules)
  for dim, (name, axes, size) in enumerate(zip(leaf.names, mesh_axes, shape)):
    axes = tuple(a for a in (axes if isinstance(axes, tuple) else (axes,)) if a)
    split = int(np.prod([mesh.shape[a] for a in axes]))
    if size % split:
      return (dim, name, axes, split)
  return None


def check_heads(spec, mesh: Mesh) -> None:
  """The tensor axis splits attention by head. A synthesizer's weights split by head (every
  one's outputs are heads-major) need mesh.tensor to divide model.num_heads: a one-line
  error, before anything compiles. So does the flash kernel (whole heads per device).
  Dot-product attention otherwise runs with heads cut across devices, at the cost of a
  resharding in every layer: a warning. (A parameter that a mesh axis does not divide:
  check_divides.)"""
  tensor, heads = mesh.shape['tensor'], spec.num_heads
  synthesizers = [c for c in spec.attention if c != 'dot']
  if heads % tensor == 0:
    return
  if synthesizers:
    raise ValueError(f'mesh.tensor={tensor} does not divide model.num_heads={heads}, and the '
                     'synthesizer\'s weights are split over tensor by head; choose a '
                     f'mesh.tensor that divides {heads}')
  if spec.flash_asked:
    raise ValueError(f'mesh.tensor={tensor} does not divide model.num_heads={heads}, and '
                     'model.fused_attention=flash runs whole heads on each device; choose a '
                     f'mesh.tensor that divides {heads}')
  logging.warning('mesh.tensor=%d does not divide model.num_heads=%d: heads are cut across '
                  'devices, which costs a resharding in every attention layer; choose a '
                  'mesh.tensor that divides %d', tensor, heads, heads)


def logical_to_sharding(tree, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
  """A tree of nn.Partitioned / LogicallyPartitioned metadata (or PartitionSpecs of logical
  names) -> NamedSharding per leaf."""
  specs = nn.get_partition_spec(tree)
  return nn.logical_to_mesh_sharding(specs, mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis over data and fsdp; the rest replicated."""
  return NamedSharding(mesh, PartitionSpec(('data', 'fsdp')))


def data_parallel_size(mesh: Mesh) -> int:
  return mesh.shape['data'] * mesh.shape['fsdp']
