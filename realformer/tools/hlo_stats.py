"""What a compiled program does per step, read from its optimized HLO text.

    stats = hlo_stats.analyze(compiled.as_text())
    stats.matmul_flops        # dot and convolution FLOPs, loop bodies times their trip counts
    stats.collectives         # {'all-gather': Collective(count, bytes), ...}, per step

XLA's own `compiled.cost_analysis()['flops']` counts a while loop's body once, so a program
with scanned layers (nn.scan) or gradient accumulation (lax.scan over microbatches) is
undercounted by the trip counts; the FSDP all-gathers inside a scanned layer run once per
layer, not once. This walks the module from ENTRY, multiplying every computation by the
number of times it runs: a while body by its trip count (the backend's known_trip_count
where the HLO states it, else from the loop condition's compare of the counter with a
constant, the counter's start in the loop's initial tuple and its step in the body; where
start or step cannot be read, jax's 0 and 1 are assumed and the loop is counted in
assumed_trip_counts), a fusion, call or async wrapper by its caller's.

Counted:
  dot          2 * prod(result dims) * prod(lhs contracting dims); likewise a GPU's cuBLAS
               call (custom_call_target __cublas$gemm, __cublas$lt$matmul...: XLA:GPU
               rewrites most dots into them), its result the tuple's first array and its
               contracting dims those of its gemm_backend_config
  A custom-call kernel that states its FLOPs (a Pallas TPU kernel's cost estimate: the
  flash attention kernels state their products over the real lengths, recomputation
  included) is counted at those. Others (cuDNN fused attention, Pallas/Triton kernels)
  state none: counted apart, as opaque_kernels (executions per step), so that a ratio
  against the model's FLOPs reads low where they run.
  convolution  2 * (result batch x feature elements) * (window taps that land on real
               input elements, per output position) * (rhs input features). TPUs
               lower matmuls to convolutions and write a batched matmul's batch
               dimensions as spatial ones whose window covers a dilated input: one
               real tap per output, as XLA's cost analysis counts it.
  A contraction with a boolean (one-hot) operand is a row selection (rows.take_rows), which
  flops_per_example leaves out: counted apart, as selection_flops.
  collectives  all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute,
               including their async -start forms (-done halves are not counted, and the
               copies of one op that share a channel_id, TPU's start / continuation / done
               fusions, count once);
               bytes are the larger of the operands and the result (the full buffer: an
               all-gather's result, a reduce-scatter's operand), summed over executions.
  across slices (DCN)  in a multi-slice TPU program, the sends that carry a collective's
               share between slices (the data-center network; XLA:TPU lowers them to host
               transfers of its megascale runtime), with the bytes they send.
Element-wise work, reductions and data movement are not FLOPs here, like
train_lib.flops_per_example, which this is compared with.
"""

import dataclasses
import re
from typing import Dict, List, Optional, Tuple

import numpy as np

DTYPE_BYTES = {
    'pred': 1, 's4': 1, 'u4': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1,
    'f8e4m3b11fnuz': 1, 'f8e4m3fnuz': 1, 'f8e5m2fnuz': 1, 'f8e3m4': 1, 'f8e4m3': 1,
    'bf16': 2, 'f16': 2, 's16': 2, 'u16': 2,
    'f32': 4, 's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8, 'c64': 8, 'c128': 16,
}
COLLECTIVES = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all',
               'collective-permute')
# A multi-slice TPU program's traffic between slices: XLA:TPU lowers the part of a collective
# that crosses the data-center network to sends and receives through the host
# (is_host_transfer, handled by its megascale runtime); the sends are counted under this kind.
ACROSS_SLICES = 'across slices (DCN)'
_MEGASCALE = 'xla_megascale_runtime'

_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([0-9,]*)\]')
_HEADER = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$')
_NAME = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*')
_CALLEE_ATTRS = re.compile(r'\b(calls|to_apply|body|condition|true_computation|'
                           r'false_computation)=%?([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_DIMS = lambda name: re.compile(name + r'=\{([0-9,]*)\}')


@dataclasses.dataclass
class Instruction:
  name: str
  type_text: str            # the result type: 'bf16[8,128]{1,0}' or a tuple '(f32[], ...)'
  opcode: str
  operands: List[str]       # operand names
  attrs: str                # everything after the operand list
  root: bool = False        # the computation's ROOT


@dataclasses.dataclass
class Collective:
  count: int = 0            # executions per step
  bytes: float = 0.0        # bytes per step (see the module docstring)


@dataclasses.dataclass
class HloStats:
  matmul_flops: float       # dots and convolutions, row selections excluded
  selection_flops: float    # contractions with a one-hot (boolean) operand
  collectives: Dict[str, Collective]
  unknown_trip_counts: int  # while loops whose trip count could not be read (counted once)
  assumed_trip_counts: int = 0  # bound read, start and step taken as jax's 0 and 1
  opaque_kernels: int = 0   # custom-call kernels whose FLOPs are not counted, per step
  kernels: int = 0          # custom-call kernels (Pallas, cuDNN) run per step, all of them


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at text[start] ('(' or '{')."""
  pairs = {'(': ')', '{': '}', '[': ']'}
  stack = []
  for i in range(start, len(text)):
    c = text[i]
    if c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return i + 1
  return len(text)


def _parse_instruction(line: str) -> Optional[Instruction]:
  m = _NAME.match(line)
  if not m:
    return None
  rest = line[m.end():]
  if rest.startswith('('):
    end = _balanced(rest, 0)
    type_text, rest = rest[:end], rest[end:].lstrip()
  else:
    type_text, _, rest = rest.partition(' ')
  op = re.match(r'([\w\-]+)\(', rest)
  if not op:
    return None
  end = _balanced(rest, op.end() - 1)
  operand_text, attrs = rest[op.end():end - 1], rest[end:]
  operands = re.findall(r'%?([\w.\-]+)\s*(?:,|$)', _strip_types(operand_text))
  return Instruction(m.group(1), type_text, op.group(1), operands, attrs,
                     line.lstrip().startswith('ROOT '))


def _strip_types(operand_text: str) -> str:
  """'bf16[8,4]{1,0} %a, f32[] %b' -> '%a, %b' (CPU HLO prints operand types; TPU not)."""
  out, i = [], 0
  while i < len(operand_text):
    c = operand_text[i]
    if c in '([{':
      i = _balanced(operand_text, i)
      continue
    out.append(c)
    i += 1
  return re.sub(r'\b[a-z][a-z0-9]*\s+(?=%)', '', ''.join(out))


def parse_module(text: str) -> Tuple[Dict[str, List[Instruction]], Optional[str]]:
  """HLO module text -> ({computation name: instructions}, entry computation name)."""
  computations, entry, current = {}, None, None
  for line in text.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m:
        current = m.group(2)
        computations[current] = []
        if m.group(1):
          entry = current
      continue
    if line.strip() == '}':
      current = None
      continue
    inst = _parse_instruction(line)
    if inst is not None:
      computations[current].append(inst)
  return computations, entry


def _arrays(type_text: str) -> List[Tuple[str, Tuple[int, ...]]]:
  """Every array type in a (possibly tuple) type: [(dtype, dims), ...]; layouts ignored."""
  without_layouts = re.sub(r'\{[^{}]*\}', '', type_text)
  return [(d, tuple(int(x) for x in dims.split(',') if x))
          for d, dims in _ARRAY.findall(without_layouts) if d in DTYPE_BYTES]


def type_bytes(type_text: str) -> int:
  total = 0
  for dtype, dims in _arrays(type_text):
    n = 1
    for x in dims:
      n *= x
    total += n * DTYPE_BYTES[dtype]
  return total


def _prod(xs) -> int:
  n = 1
  for x in xs:
    n *= x
  return n


def _dims_attr(attrs: str, name: str) -> List[int]:
  m = _DIMS(name).search(attrs)
  return [int(x) for x in m.group(1).split(',') if x] if m else []


def _shape(types: Dict[str, str], name: str) -> Tuple[int, ...]:
  arrays = _arrays(types.get(name, ''))
  return arrays[0][1] if arrays else ()


def _window(attrs: str, spatial: int) -> Dict[str, list]:
  """A convolution's window attribute per spatial dimension, with XLA's defaults."""
  w = {'size': [1] * spatial, 'stride': [1] * spatial, 'pad': [(0, 0)] * spatial,
       'lhs_dilate': [1] * spatial, 'rhs_dilate': [1] * spatial}
  m = re.search(r'window=\{([^}]*)\}', attrs)
  for key, value in re.findall(r'(\w+)=([0-9_x\-]+)', m.group(1) if m else ''):
    parts = value.split('x')
    if key == 'pad':
      w['pad'] = [tuple(int(v) for v in p.split('_')) for p in parts]
    elif key in w:
      w[key] = [int(v) for v in parts]
  return w


def _valid_taps(out: int, size: int, n: int, stride: int, pad_low: int, lhs_dilate: int,
                rhs_dilate: int) -> int:
  """(output position, window tap) pairs of one spatial dimension that land on a real input
  element (not padding, not a hole of lhs dilation). TPUs write the batch dimensions of a
  batched matmul as such spatial dimensions (window = size = lhs_dilate): one tap each."""
  p = (np.arange(out)[:, None] * stride + np.arange(size)[None, :] * rhs_dilate - pad_low)
  valid = (p >= 0) & (p <= (n - 1) * lhs_dilate) & (p % lhs_dilate == 0)
  return int(valid.sum())


_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
# Kernels of their own: cuDNN's (fused attention, __cudnn$fmha...), Pallas's on GPU (Triton:
# __gpu$xla.gpu.triton; Mosaic GPU) and on TPU (tpu_custom_call).
_OPAQUE_TARGETS = re.compile(r'__cudnn\$|triton|mosaic|tpu_custom_call')
# A Pallas TPU kernel's cost estimate, in its backend config (escaped quotes in the text;
# its keys in any order: jax writes them sorted, the compiled text flops first).
_STATED_FLOPS = re.compile(r'cost_estimate\\?"\s*:\s*\{[^}]*?\\?"flops\\?"\s*:\s*\\?"?(\d+)')


def _custom_target(inst: Instruction) -> str:
  m = _CUSTOM_TARGET.search(inst.attrs) if inst.opcode == 'custom-call' else None
  return m.group(1) if m else ''


def _stated_flops(inst: Instruction) -> Optional[float]:
  """The FLOPs a custom-call kernel states in its backend config (a Pallas TPU kernel's cost
  estimate), or None."""
  if inst.opcode != 'custom-call':
    return None
  m = _STATED_FLOPS.search(inst.attrs)
  return float(m.group(1)) if m else None


def is_kernel(inst: Instruction) -> bool:
  """A custom-call kernel: Pallas (Mosaic on TPUs, Triton on GPUs) or cuDNN's."""
  return bool(_OPAQUE_TARGETS.search(_custom_target(inst)))


def is_opaque_kernel(inst: Instruction) -> bool:
  """A custom-call kernel whose FLOPs the HLO does not state (see the module docstring)."""
  return is_kernel(inst) and _stated_flops(inst) is None


def matmul_flops(inst: Instruction, types: Dict[str, str]) -> float:
  """FLOPs of one dot, convolution or cuBLAS call, or those a kernel states (0 for anything
  else)."""
  stated = _stated_flops(inst)
  if stated is not None:
    return stated
  out = _arrays(inst.type_text)
  gemm = _custom_target(inst).startswith('__cublas$')
  if inst.opcode not in ('dot', 'convolution') and not gemm or not out or not inst.operands:
    return 0.0
  out_shape = out[0][1]
  lhs = _shape(types, inst.operands[0])
  if gemm:
    dims = _GEMM_CONTRACTING.search(inst.attrs)
    contracting = [int(i) for i in re.findall(r'\d+', dims.group(1))] if dims else []
    if not contracting or max(contracting) >= len(lhs):
      return 0.0
    return 2.0 * _prod(out_shape) * _prod(lhs[i] for i in contracting)
  if inst.opcode == 'dot':
    contracting = _dims_attr(inst.attrs, 'lhs_contracting_dims')
    return 2.0 * _prod(out_shape) * _prod(lhs[i] for i in contracting)
  labels = re.search(r'dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)', inst.attrs)
  if not labels or len(inst.operands) < 2:
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  rhs = _shape(types, inst.operands[1])
  if len(rhs) != len(rhs_l) or len(lhs) != len(lhs_l) or len(out_shape) != len(out_l):
    return 0.0
  spatial = sum(c.isdigit() for c in out_l)
  w = _window(inst.attrs, spatial)
  taps = 1
  for d in range(spatial):
    taps *= _valid_taps(out_shape[out_l.index(str(d))], rhs[rhs_l.index(str(d))],
                        lhs[lhs_l.index(str(d))], w['stride'][d], w['pad'][d][0],
                        w['lhs_dilate'][d], w['rhs_dilate'][d])
  # Each output element sums rhs 'i' input features (already per feature group) over its
  # window taps; with batch_group_count, output features are split over batch groups and
  # the result's batch is the lhs batch / groups: still rhs 'i' x taps products each.
  other = _prod(n for n, l in zip(out_shape, out_l) if not l.isdigit())  # batch x features
  return 2.0 * other * taps * rhs[rhs_l.index('i')]


def _cost_of(computations, name: str, depth: int = 0) -> float:
  """Matmul FLOPs of one computation and what it calls (loops once): to pick a branch."""
  if depth > 20:
    return 0.0
  insts = computations.get(name, [])
  types = {i.name: i.type_text for i in insts}
  total = sum(matmul_flops(i, types) for i in insts)
  for i in insts:
    for _, callee in _CALLEE_ATTRS.findall(i.attrs):
      total += _cost_of(computations, callee, depth + 1)
  return total


def _is_selection(inst: Instruction, types: Dict[str, str]) -> bool:
  """A contraction with a boolean operand: a one-hot row selection (rows.take_rows)."""
  return any(_arrays(types.get(o, ''))[:1] and _arrays(types[o])[0][0] == 'pred'
             for o in inst.operands[:2])


def analyze(text: str) -> HloStats:
  """Matmul FLOPs and collectives per execution of the module (see the module docstring)."""
  computations, entry = parse_module(text)
  if entry is None:
    raise ValueError('no ENTRY computation in the HLO text: pass compiled.as_text()')
  walk = _Walk(computations, _scalar_constants(text))
  walk.visit(entry, 1.0)
  collectives = {}
  for kind, times, nbytes in walk.seen.values():
    c = collectives.setdefault(kind, Collective())
    c.count += int(times)
    c.bytes += times * nbytes
  return HloStats(walk.flops, walk.selection, collectives, walk.unknown, walk.assumed,
                  int(walk.opaque), int(walk.kernels))


def _scalar_constants(text: str) -> Dict[str, int]:
  """name -> value of every integer scalar constant (kept inside the operand list)."""
  constants = {}
  for line in text.splitlines():
    m = re.match(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[a-z0-9]+\[\]\S*\s+constant\((-?\d+)\)',
                 line)
    if m:
      constants[m.group(1)] = int(m.group(2))
  return constants


class _Walk:
  """The walk from ENTRY: each computation visited with the number of times it runs,
  adding up matmul FLOPs (selection FLOPs apart) and collectives; `unknown` and `assumed`
  count the while loops whose trip count could not be read or had to assume jax's start
  and step."""

  def __init__(self, computations, constants: Dict[str, int]):
    self.computations, self.constants = computations, constants
    self.flops, self.selection, self.unknown, self.assumed = 0.0, 0.0, 0, 0
    self.opaque, self.kernels = 0.0, 0.0
    # One entry per collective: TPU splits an async collective into a start fusion, a
    # continuation and a done fusion, each holding a copy of the op with the same channel_id.
    self.seen = {}

  def visit(self, name: str, times: float, scope: Optional[str] = None) -> None:
    """Counts computation `name`, run `times` times per step. `scope` is the computation
    whose collectives it holds copies of: the caller's for a fusion or async wrapper (TPU's
    start / continuation / done fusions of one collective), its own for ENTRY, a loop
    body, a called computation or a branch."""
    scope = name if scope is None else scope
    insts = self.computations.get(name, [])
    types = {i.name: i.type_text for i in insts}
    by_name = {i.name: i for i in insts}
    for inst in insts:
      f = times * matmul_flops(inst, types)
      self.opaque += times * is_opaque_kernel(inst)
      self.kernels += times * is_kernel(inst)
      if f and _is_selection(inst, types):
        self.selection += f
      else:
        self.flops += f
      self._collective(inst, types, times, scope)
      if inst.opcode in ('async-update', 'async-done'):
        continue  # the wrapped computation runs once, counted at async-start
      for attr, callee in _CALLEE_ATTRS.findall(inst.attrs):
        if attr == 'condition' or (attr == 'to_apply' and inst.opcode != 'call'):
          continue  # loop conditions and reducers do no matmuls or collectives
        if attr in ('true_computation', 'false_computation'):
          continue  # a boolean conditional's branches: below, as an indexed one's
        factor = 1
        if inst.opcode == 'while' and attr == 'body':
          n, guessed = self.trip_count(inst, by_name)
          self.unknown += n is None
          self.assumed += guessed and n is not None
          factor = 1 if n is None else n
        wrapped = inst.opcode == 'fusion' or inst.opcode.startswith('async-')
        self.visit(callee, times * factor, scope if wrapped else None)
      pair = [c for a, c in _CALLEE_ATTRS.findall(inst.attrs)
              if a in ('true_computation', 'false_computation')]
      for group in _BRANCHES.findall(inst.attrs) + ([','.join(pair)] if pair else []):
        # A conditional runs one branch: counted as its costliest (an upper bound).
        branches = re.findall(r'%?([\w.\-]+)', group)
        costs = [_cost_of(self.computations, b) for b in branches]
        if costs:
          self.visit(branches[costs.index(max(costs))], times)

  def _collective(self, inst: Instruction, types: Dict[str, str], times: float,
                  scope: str) -> None:
    if inst.opcode == 'send' and _MEGASCALE in inst.attrs:  # (the data: its first operand)
      self.seen[('op', len(self.seen), inst.name)] = (
          ACROSS_SLICES, times, type_bytes(types.get(inst.operands[0], '')))
      return
    kind = next((c for c in COLLECTIVES if inst.opcode in (c, c + '-start')), None)
    if kind is None:
      return
    operand_bytes = sum(type_bytes(types.get(o, '')) for o in inst.operands)
    result_bytes = type_bytes(inst.type_text)
    if inst.opcode.endswith('-start'):  # the result tuple repeats the operands
      result_bytes -= operand_bytes
    channel = re.search(r'\bchannel_id=(\d+)', inst.attrs)
    # Two collectives of one id in two computations are two: XLA:TPU numbers channels per
    # computation, and a loop body it clones (a peeled loop: two whiles, each running its
    # copy of the body's all-reduce under one id; seen for a multi-slice step with gradient
    # accumulation) keeps the ids. The copies of one op in the fusions its computation calls
    # (start / continuation / done) are one, by what they move (layouts aside). (A start
    # and its done in two computations, which no compile here has shown, would count twice.)
    moved = re.sub(r'\{[^}]*\}', '', ' '.join(types.get(o, '') for o in inst.operands))
    key = (('channel', scope, channel.group(1), kind, moved) if channel else
           ('op', len(self.seen), inst.name))
    times_seen = self.seen.get(key, (kind, 0.0, 0))[1]
    self.seen[key] = (kind, max(times, times_seen), max(operand_bytes, result_bytes))

  def value(self, insts_by_name, name, depth=0) -> Optional[int]:
    """The integer a scalar instruction holds, through copies and converts."""
    if name in self.constants:
      return self.constants[name]
    inst = insts_by_name.get(name)
    if inst is None or depth > 8 or inst.opcode not in ('copy', 'convert', 'bitcast'):
      return None
    return self.value(insts_by_name, inst.operands[0], depth + 1)

  def tuple_index(self, insts_by_name, name, depth=0) -> Optional[int]:
    """k when `name` is get-tuple-element(param, index=k), through copies."""
    inst = insts_by_name.get(name)
    if inst is None or depth > 8:
      return None
    if inst.opcode == 'get-tuple-element':
      m = re.search(r'\bindex=(\d+)', inst.attrs)
      return int(m.group(1)) if m else None
    if inst.opcode in ('copy', 'convert', 'bitcast'):
      return self.tuple_index(insts_by_name, inst.operands[0], depth + 1)
    return None

  def trip_count(self, inst: Instruction, caller) -> Tuple[Optional[int], bool]:
    """(trip count or None, whether start and step had to be assumed) of a while loop."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.attrs)
    if m:
      return int(m.group(1)), False
    cond = re.search(r'\bcondition=%?([\w.\-]+)', inst.attrs)
    cond_insts = self.computations.get(cond.group(1), []) if cond else []
    by_name = {i.name: i for i in cond_insts}
    compare = next((i for i in reversed(cond_insts) if i.root and i.opcode == 'compare'),
                   None)
    if compare is None or len(compare.operands) != 2:
      return None, False
    direction = re.search(r'direction=(\w+)', compare.attrs)
    direction = direction.group(1) if direction else ''
    a, b = compare.operands
    k, bound = self.tuple_index(by_name, a), self.value(by_name, b)
    if k is None or bound is None:  # the constant first: N > i is i < N
      k, bound = self.tuple_index(by_name, b), self.value(by_name, a)
      direction = {'GT': 'LT', 'GE': 'LE', 'LT': 'GT', 'LE': 'GE'}.get(direction, '')
    if k is None or bound is None or direction not in ('LT', 'LE', 'GT', 'GE'):
      return None, False
    start, step = self._start(inst, caller, k), self._step(inst, k)
    assumed = start is None or step is None
    start = 0 if start is None else start  # jax's scan and fori_loop: from 0, by 1
    step = (1 if direction in ('LT', 'LE') else -1) if step is None else step
    if step == 0:
      return None, False
    end = bound + (1 if direction == 'LE' else -1 if direction == 'GE' else 0)
    n = -(-(end - start) // step) if step > 0 else -(-(start - end) // -step)
    return max(0, n), assumed

  def _start(self, inst: Instruction, caller, k: int) -> Optional[int]:
    """The loop counter's start: operand k of the loop's initial tuple."""
    init = caller.get(inst.operands[0]) if inst.operands else None
    while init is not None and init.opcode == 'copy':
      init = caller.get(init.operands[0])
    if init is not None and init.opcode == 'tuple' and k < len(init.operands):
      return self.value(caller, init.operands[k])
    return None

  def _step(self, inst: Instruction, k: int) -> Optional[int]:
    """The loop counter's step: the body's update of tuple element k (an add or subtract
    of a constant)."""
    body = re.search(r'\bbody=%?([\w.\-]+)', inst.attrs)
    body_insts = self.computations.get(body.group(1), []) if body else []
    by_name = {i.name: i for i in body_insts}
    root = next((i for i in body_insts if i.root), None)
    if root is None or root.opcode != 'tuple' or k >= len(root.operands):
      return None
    update = by_name.get(root.operands[k])
    if update is None or update.opcode not in ('add', 'subtract'):
      return None
    x, y = update.operands[:2]
    c = self.value(by_name, y) if self.tuple_index(by_name, x) == k else (
        self.value(by_name, x) if update.opcode == 'add' and
        self.tuple_index(by_name, y) == k else None)
    if c is None:
      return None
    return c if update.opcode == 'add' else -c
