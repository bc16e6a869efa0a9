"""train.py --compile_for: the step compiled ahead of time for TPU slices (libtpu, no TPU),
hlo_stats' FLOP and collective counts, the batch search, and the one-line errors."""

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import types

import jax
import ml_collections
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import NamedSharding, PartitionSpec

from configs import pretrain
from realformer import models
from realformer.layers.dense import uses_cpu_dense
from realformer.model.spec import resolve
from realformer.tools import hlo_stats
from realformer.tools import launch
from realformer.train import partitioning

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_LIBTPU = importlib.util.find_spec('libtpu') is not None
# CI installs requirements-tpu.txt and sets REALFORMER_REQUIRE_LIBTPU=1: never skipped there.
needs_libtpu = pytest.mark.skipif(
    not HAVE_LIBTPU and not os.environ.get('REALFORMER_REQUIRE_LIBTPU'),
    reason='pip install -r requirements-tpu.txt')


@contextlib.contextmanager
def bypassing_the_runs_compilation_cache():
  """The compile-only TPU devices cannot load a cached program (jax warns and compiles
  again), so compiles for them bypass the run's cache (conftest), as the launch check does
  outside the tests."""
  saved = jax.config.jax_compilation_cache_dir
  jax.config.update('jax_compilation_cache_dir', None)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update('jax_compilation_cache_dir', saved)
    compilation_cache.reset_cache()


@pytest.fixture(autouse=True, scope='module')
def without_the_runs_compilation_cache():
  with bypassing_the_runs_compilation_cache():
    yield


def tiny(variant='postln', **overrides):
  c = pretrain.get_config(f'{variant},tiny').copy_and_resolve_references()
  c.data.sources = 'synthetic'
  c.data.max_seq_length, c.data.max_predictions_per_seq = 64, 10
  c.model.max_len = 64
  c.model.dtype = 'bfloat16'
  for k, v in overrides.items():
    section, name = k.split('__')
    c[section][name] = v
  return c


# --------------------------------------------------------------------------------------
# hlo_stats on programs whose FLOPs and collectives are known.
# --------------------------------------------------------------------------------------

def _scanned_mlp(w, x):
  def body(h, wi):
    return jnp.tanh(h @ wi), None
  y, _ = jax.lax.scan(body, x, w)
  return jnp.sum(y ** 2)


def test_hlo_stats_counts_scanned_matmuls_times_their_trip_count():
  layers, b, d = 5, 16, 32
  w = jax.ShapeDtypeStruct((layers, d, d), jnp.float32)
  x = jax.ShapeDtypeStruct((b, d), jnp.float32)
  compiled = jax.jit(jax.grad(_scanned_mlp)).lower(w, x).compile()
  stats = hlo_stats.analyze(compiled.as_text())
  # forward h @ w, backward dh (layers 1..L-1 need it; XLA may keep layer 0's) and dw.
  per_matmul = 2 * b * d * d
  assert stats.unknown_trip_counts == 0
  assert stats.matmul_flops in (3 * layers * per_matmul, (3 * layers - 1) * per_matmul)
  xla = compiled.cost_analysis()
  xla = xla[0] if isinstance(xla, (list, tuple)) else xla
  assert xla['flops'] < stats.matmul_flops / 2  # XLA counts the loop body once


def test_hlo_stats_convolution_flops_match_xla_on_an_unlooped_program():
  # Strided, padded, dilated and grouped convolutions: XLA's cost analysis counts them
  # exactly when there is no loop; the walker must agree.
  lhs = jax.ShapeDtypeStruct((2, 8, 13, 11), jnp.float32)   # N C H W
  rhs = jax.ShapeDtypeStruct((12, 4, 3, 2), jnp.float32)    # O I/groups H W
  def f(a, k):
    return jax.lax.conv_general_dilated(a, k, window_strides=(2, 1), padding=((1, 2), (0, 1)),
                                        lhs_dilation=(1, 2), rhs_dilation=(2, 1),
                                        feature_group_count=2)
  compiled = jax.jit(f).lower(lhs, rhs).compile()
  stats = hlo_stats.analyze(compiled.as_text())
  xla = compiled.cost_analysis()
  xla = xla[0] if isinstance(xla, (list, tuple)) else xla
  assert stats.matmul_flops == pytest.approx(xla['flops'], rel=0.02)


def test_hlo_stats_valid_taps_against_brute_force():
  rng = np.random.default_rng(0)
  for _ in range(50):
    n, size = rng.integers(1, 9), rng.integers(1, 6)
    stride, ld, rd = rng.integers(1, 4), rng.integers(1, 4), rng.integers(1, 3)
    lo, hi = rng.integers(0, 3), rng.integers(0, 3)
    span = (n - 1) * ld + 1 + lo + hi
    out = max(0, (span - ((size - 1) * rd + 1)) // stride + 1)
    brute = sum(1 for o in range(out) for j in range(size)
                if 0 <= o * stride + j * rd - lo <= (n - 1) * ld
                and (o * stride + j * rd - lo) % ld == 0)
    assert hlo_stats._valid_taps(out, size, n, stride, lo, ld, rd) == brute


HAND_WRITTEN = '''HloModule m

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(10)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8] get-tuple-element(%p), index=1
  %w = f32[8,8] constant({...})
  %d = f32[4,8] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %two = s32[] constant(2)
  %next = s32[] add(%i, %two)
  ROOT %t = (s32[], f32[4,8]) tuple(%next, %d)
}

ENTRY %main (x: f32[4,8], g: f32[6,6,6,7], k: f32[3,2,7,12]) -> f32[4,8] {
  %x = f32[4,8] parameter(0)
  %g = f32[6,6,6,7] parameter(1)
  %k = f32[3,2,7,12] parameter(2)
  %c = f32[3,4,5,12] CONVOLUTION
  %start = s32[] constant(3)
  %init = (s32[], f32[4,8]) tuple(%start, %x)
  %loop = (s32[], f32[4,8]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[4,8] get-tuple-element(%loop), index=1
}
'''.replace('CONVOLUTION', 'convolution(%g, %k), window={size=3x2}, '
            'dim_labels=b01f_01io->b01f, batch_group_count=2')


def test_hlo_stats_reads_start_and_step_and_batch_groups_from_hand_written_hlo():
  stats = hlo_stats.analyze(HAND_WRITTEN)
  # The loop runs i = 3, 5, 7, 9: 4 times. The batch-grouped convolution: 3*4*5*12
  # outputs, each 7 input features x 3x2 taps (XLA: C/fgc * O * N/bgc * taps).
  assert (stats.unknown_trip_counts, stats.assumed_trip_counts) == (0, 0)
  assert stats.matmul_flops == 4 * 2 * 4 * 8 * 8 + 2 * (3 * 4 * 5 * 12) * 7 * 6
  with pytest.raises(ValueError, match='ENTRY'):
    hlo_stats.analyze('HloModule empty')


# Two all-reduces of one channel id in two computations (XLA:TPU numbers channels per
# computation), and a boolean conditional with a dot in each branch.
CHANNELS_AND_BRANCHES = '''HloModule m

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %r = f32[4,8]{1,0} all-reduce(%x), channel_id=1, replica_groups={}, to_apply=%sum
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4,8]) tuple(%next, %r)
}

%small (x: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8] parameter(0)
  %w = f32[8,8] constant({...})
  ROOT %d = f32[4,8] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%large (x: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8] parameter(0)
  %w = f32[8,8] constant({...})
  %d = f32[4,8] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %e = f32[4,8] dot(%d, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[4,8], v: f32[6], c: pred[]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %v = f32[6]{0} parameter(1)
  %c = pred[] parameter(2)
  %s = f32[6]{0} all-reduce(%v), channel_id=1, replica_groups={}, to_apply=%sum
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]) tuple(%zero, %x)
  %loop = (s32[], f32[4,8]) while(%init), condition=%cond, body=%body
  %y = f32[4,8] get-tuple-element(%loop), index=1
  ROOT %out = f32[4,8] conditional(%c, %y, %y), true_computation=%small, false_computation=%large
}
'''


def test_hlo_stats_tells_collectives_of_one_channel_apart_and_counts_one_branch():
  stats = hlo_stats.analyze(CHANNELS_AND_BRANCHES)
  reduce = stats.collectives['all-reduce']
  assert reduce.count == 4 + 1 and reduce.bytes == 4 * 4 * 8 * 4 + 6 * 4
  assert stats.matmul_flops == 2 * (2 * 4 * 8 * 8)  # the costlier branch, once


# A scanned layer's forward and backward loops (3 trips each), each gathering the same
# weight under channel id 1 (XLA:TPU numbers channels per computation), the backward one as
# TPU writes an async collective: a start fusion and a done fusion, each holding a copy.
TWO_LOOPS_ONE_CHANNEL = '''HloModule m

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%fwd (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %g = f32[16,8]{1,0} all-gather(%x), channel_id=1, replica_groups={}, dimensions={0}
  %s = f32[4,8]{1,0} slice(%g), slice={[0:4], [0:8]}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4,8]) tuple(%next, %s)
}

%start (x: f32[4,8]) -> f32[16,8] {
  %x = f32[4,8]{1,0} parameter(0)
  ROOT %g = f32[16,8]{1,0} all-gather(%x), channel_id=1, replica_groups={}, dimensions={0}
}

%done (x: f32[4,8]) -> f32[16,8] {
  %x = f32[4,8]{1,0} parameter(0)
  ROOT %g = f32[16,8]{1,0} all-gather(%x), channel_id=1, replica_groups={}, dimensions={0}
}

%bwd (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %a = f32[16,8]{1,0} fusion(%x), kind=kCustom, calls=%start
  %g = f32[16,8]{1,0} fusion(%x), kind=kCustom, calls=%done
  %s = f32[4,8]{1,0} slice(%g), slice={[0:4], [0:8]}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4,8]) tuple(%next, %s)
}

ENTRY %main (x: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]) tuple(%zero, %x)
  %forward = (s32[], f32[4,8]) while(%init), condition=%cond, body=%fwd
  %y = f32[4,8] get-tuple-element(%forward), index=1
  %init2 = (s32[], f32[4,8]) tuple(%zero, %y)
  %backward = (s32[], f32[4,8]) while(%init2), condition=%cond, body=%bwd
  ROOT %out = f32[4,8] get-tuple-element(%backward), index=1
}
'''


def test_hlo_stats_counts_one_channel_in_two_loops_twice_and_its_copies_once():
  gather = hlo_stats.analyze(TWO_LOOPS_ONE_CHANNEL).collectives['all-gather']
  assert gather.count == 3 + 3 and gather.bytes == 6 * 16 * 8 * 4
  # A multi-slice program's sends across the slices (in the forward loop, and a host
  # transfer of another runtime, which is not one).
  send = ('  %tok = token[] after-all()\n  %snd = (f32[4,8], u32[], token[]) send(%x, %tok), '
          'channel_id=7, is_host_transfer=true, frontend_attributes={'
          '_xla_host_transfer_handler_name="HANDLER"}\n  %one = s32[] constant(1)\n')
  with_send = lambda handler: TWO_LOOPS_ONE_CHANNEL.replace(
      '  %one = s32[] constant(1)\n', send.replace('HANDLER', handler), 1)
  dcn = hlo_stats.analyze(with_send('xla_megascale_runtime')).collectives[
      hlo_stats.ACROSS_SLICES]
  assert (dcn.count, dcn.bytes) == (3, 3 * 4 * 8 * 4)
  text = with_send('other')
  assert hlo_stats.ACROSS_SLICES not in hlo_stats.analyze(text).collectives


# XLA:GPU's optimized HLO: dots rewritten into cuBLAS calls (a batched one in a loop of 3, as
# a scanned layer's attention scores), and a cuDNN fused-attention kernel, whose FLOPs the
# HLO does not state.
GPU_HAND_WRITTEN = r'''HloModule jit_step

%body (p: (s32[], bf16[2,4,16,64])) -> (s32[], bf16[2,4,16,64]) {
  %p = (s32[], bf16[2,4,16,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %q = bf16[2,4,16,64]{3,2,1,0} get-tuple-element(%p), index=1
  %s = (bf16[2,4,16,16]{3,2,1,0}, s8[4194304]{0}) custom-call(bf16[2,4,16,64]{3,2,1,0} %q, bf16[2,4,16,64]{3,2,1,0} %q), custom_call_target="__cublas$gemm", backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["3"],"rhs_contracting_dimensions":["3"],"lhs_batch_dimensions":["0","1"],"rhs_batch_dimensions":["0","1"]},"epilogue":"DEFAULT"}}
  %f = (bf16[2,4,16,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{}}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %o = bf16[2,4,16,64]{3,2,1,0} get-tuple-element(%f), index=0
  ROOT %t = (s32[], bf16[2,4,16,64]) tuple(%next, %o)
}

%cond (p: (s32[], bf16[2,4,16,64])) -> pred[] {
  %p = (s32[], bf16[2,4,16,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: bf16[64,768], w: bf16[768,3072], q: bf16[2,4,16,64]) -> bf16[64,3072] {
  %x = bf16[64,768]{1,0} parameter(0)
  %w = bf16[768,3072]{1,0} parameter(1)
  %q = bf16[2,4,16,64]{3,2,1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[2,4,16,64]) tuple(%zero, %q)
  %loop = (s32[], bf16[2,4,16,64]) while(%init), condition=%cond, body=%body
  %mm = (bf16[64,3072]{1,0}, s8[4194304]{0}) custom-call(bf16[64,768]{1,0} %x, bf16[768,3072]{1,0} %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}
  ROOT %out = bf16[64,3072]{1,0} get-tuple-element(%mm), index=0
}
'''


def test_hlo_stats_counts_cublas_calls_and_counts_opaque_kernels_apart():
  stats = hlo_stats.analyze(GPU_HAND_WRITTEN)
  assert stats.matmul_flops == 2 * 64 * 3072 * 768 + 3 * 2 * (2 * 4 * 16 * 16) * 64
  assert stats.opaque_kernels == 3  # the fused attention, once per loop trip
  report = launch.Report(batch_size=8, fits=True, model_flops=1.0,
                         opaque_kernels=stats.opaque_kernels)
  assert '(3 runs of custom kernels, such as cuDNN or Pallas attention' in launch.format_report(
      tiny(), launch.tpu_target('v5e:2x2'), report)


# A Pallas TPU kernel as the compiled text writes it: its cost estimate in the backend config.
TPU_KERNEL_LINE = (
    '  %k = bf16[2,2,128,64]{3,2,1,0} custom-call(%a), custom_call_target="tpu_custom_call", '
    'backend_config={"custom_call_config": {"body": "TUxJUgA=", "cost_estimate":{"flops":'
    '"25165824","transcendentals":"65536","bytes_accessed":"334876"}}}')


def test_hlo_stats_counts_the_flops_a_tpu_kernel_states():
  text = ('HloModule m\n\nENTRY %main (a: bf16[2,2,128,64]) -> bf16[2,2,128,64] {\n'
          '  %a = bf16[2,2,128,64]{3,2,1,0} parameter(0)\n' + TPU_KERNEL_LINE.replace(
              '  %k', '  ROOT %k') + '\n}\n')
  stats = hlo_stats.analyze(text)
  assert stats.matmul_flops == 25165824 and stats.opaque_kernels == 0
  as_jax_writes_it = text.replace(  # (its keys sorted, escaped)
      '{"flops":"25165824","transcendentals":"65536","bytes_accessed":"334876"}',
      r'{\n\"bytes_accessed\":334876,\n\"flops\":25165824,\n\"transcendentals\":65536\n}')
  assert '"flops"' not in as_jax_writes_it
  assert hlo_stats.analyze(as_jax_writes_it).matmul_flops == 25165824
  unstated = hlo_stats.analyze(text.replace('"cost_estimate"', '"other"'))
  assert unstated.matmul_flops == 0 and unstated.opaque_kernels == 1


def test_hlo_stats_counts_collectives_in_loops():
  mesh = jax.make_mesh((4,), ('fsdp',), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,))
  layers, b, d = 3, 16, 64
  grad = jax.jit(jax.grad(_scanned_mlp),
                 in_shardings=(NamedSharding(mesh, PartitionSpec(None, 'fsdp')),
                               NamedSharding(mesh, PartitionSpec('fsdp'))))
  w = jax.ShapeDtypeStruct((layers, d, d), jnp.float32)
  x = jax.ShapeDtypeStruct((b, d), jnp.float32)
  stats = hlo_stats.analyze(grad.lower(w, x).compile().as_text())
  gathers = stats.collectives['all-gather']
  # FSDP: every layer's weight is gathered in the forward and again in the backward pass.
  assert gathers.count >= 2 * layers and gathers.count % layers == 0
  assert gathers.bytes >= 2 * layers * d * d * 4


# --------------------------------------------------------------------------------------
# Compiling for TPU slices.
# --------------------------------------------------------------------------------------

def test_backend_choices_follow_the_target_platform():
  cfg = tiny().model
  assert uses_cpu_dense(resolve(cfg))                 # this host: the CPU dense layer
  assert not uses_cpu_dense(resolve(cfg, platform='tpu'))
  from realformer.model import attention
  assert attention._use_fused(resolve(cfg, platform='gpu'), True, False) == 'cudnn'
  assert attention._use_fused(resolve(cfg, platform='tpu'), True, False) is None
  with pytest.raises(ValueError, match='platform'):
    resolve(cfg, platform='ipu')


# Compiled for v5e:2x2 with their bytes, collectives and FLOPs judged; every variant's FLOPs
# are judged on that slice too: these here, the others by test_every_kind_of_attention_...
# Post-LN in float32 (the configs' default dtype: the Mosaic kernels in float32), the others
# in bfloat16.
# RealFormer's step takes 16 microbatches of a batch of 2048: train.py evaluates the batch in
# the same microbatches, so its evaluation step is the smaller program (taken whole, it was
# the larger, and decided the verdict).
V5E_TINY = [
    ('postln', {'model__dtype': 'float32'}),
    ('realformer', {'mesh__fsdp': 4, 'mesh__data': 1, 'model__scan_layers': True,
                    'train__grad_accum_steps': 16, 'train__batch_size': 2048}),
    ('synth_dense_vanilla', {'mesh__fsdp': 2, 'mesh__data': 2, 'model__remat_policy': 'none'}),
]


def test_the_report_names_an_attention_that_overrides_the_variants():
  """A variant whose attention fields are overridden reports what it computes, not only
  the preset's name; a preset as it is reports its name alone; RoBERTa's objective is named."""
  target = launch.Target('v5e:2x2', 'tpu', [None] * 4, 1, 'TPU v5 lite', None)
  mixed = tiny('postln', model__attention='random+dot', model__residual_attention=True)
  assert launch.describe(mixed, target).startswith(
      'postln (attention random+dot with residual scores, post_ln), 2 layers x 128 on v5e:2x2 '
      '(4 x TPU v5 lite); mesh data=4 fsdp=1 tensor=1; ')
  assert launch.describe(tiny('synth_random_vanilla'), target).startswith(
      'synth_random_vanilla, 2 layers')
  roberta = tiny('realformer')
  roberta.objective = 'mlm'  # and an objective other than BERT's
  assert launch.describe(roberta, target).startswith('realformer (mlm), 2 layers')


@needs_libtpu
def test_two_slices_lay_the_data_axis_across_them_and_compile():
  """Two v5e:2x2 slices (a multi-slice job, joined by the data-center network): the data
  axis spans the slices and fsdp stays within one; a data axis that cannot span them is
  one line; the step compiles for the eight chips."""
  target = launch.tpu_target('2xv5e:2x2')
  assert (len(target.devices), target.num_hosts, target.platform) == (8, 2, 'tpu')
  for data, fsdp in ((2, 4), (4, 2), (8, 1)):
    mesh = partitioning.make_mesh(tiny('postln', mesh__data=data, mesh__fsdp=fsdp).mesh,
                                  target.devices)
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert mesh.devices.shape == (data, fsdp, 1)
    assert (slices == (np.arange(data) // (data // 2))[:, None, None]).all()
  with pytest.raises(launch.LaunchError, match=r"^config.mesh \{'data': 1, 'fsdp': 8, 'tensor': "
                     r"1\} over 2 TPU slices: .* must be a multiple of 2; e.g. data=2, fsdp=4 "
                     r"\(the target 2xv5e:2x2 has 8 chips\)$"):
    launch.compile_step(tiny('postln', mesh__data=1, mesh__fsdp=8), target)
  with pytest.raises(ValueError, match=r'multiple of 2; e.g. data=2, fsdp=1, tensor=4$'):
    partitioning.make_mesh(tiny('postln', mesh__data=1, mesh__tensor=8).mesh, target.devices)
  config = tiny('postln', mesh__data=2, mesh__fsdp=4, train__batch_size=16)
  report, compiled = launch.compile_step(config, target)
  assert compiled is not None and report.fits and report.flop_ratio == pytest.approx(1.0, abs=0.05)
  text = launch.format_report(config, target, report)
  assert '(8 x TPU v5 lite, 2 hosts, 2 slices); mesh data=2 fsdp=4 tensor=1' in text
  # The gradients' reduction over data crosses the slices: XLA's sends through the host.
  dcn = report.collectives[hlo_stats.ACROSS_SLICES]
  assert dcn['count'] > 0 and dcn['bytes'] > 0 and '  across slices (DCN) ' in text
  one_slice = launch.tpu_target('v5e:2x2')
  assert hlo_stats.ACROSS_SLICES not in launch.compile_step(
      tiny('postln', mesh__data=1, mesh__fsdp=4, train__batch_size=8), one_slice)[0].collectives
  with pytest.raises(launch.LaunchError, match='give at least one slice'):
    launch.tpu_target('0xv5e:2x2')
  # Two GPU nodes' devices (XLA numbers each host's slice_index apart) are one "slice": any
  # mesh may span them.
  nodes = [types.SimpleNamespace(platform='gpu', slice_index=i // 8) for i in range(16)]
  assert partitioning.slice_count(nodes) == 1
  assert partitioning.slice_count(target.devices) == 2


@needs_libtpu
@pytest.mark.parametrize('variant,overrides', V5E_TINY)
def test_tiny_compiles_for_v5e_2x2(variant, overrides):
  config = tiny(variant, **overrides)
  target = launch.tpu_target('v5e:2x2')
  assert (len(target.devices), target.num_hosts, target.platform) == (4, 1, 'tpu')
  report, compiled = launch.compile_step(config, target)
  assert compiled is not None and report.fits
  # Attention under dropout through the Mosaic flash kernels (auto on TPUs), forward and
  # backward, their FLOPs counted from their cost estimates.
  text = compiled.as_text()
  for kernel in ('flash_attention_tpu_forward', 'flash_attention_tpu_dkv',
                 'flash_attention_tpu_dq'):
    assert kernel in text, kernel
  assert report.opaque_kernels == 0
  assert report.attention == 'training flash (Mosaic), evaluation plain'
  assert 0 < report.total_bytes < target.hbm_bytes
  assert report.temp_bytes > 0 and report.argument_bytes >= report.state_bytes > 0
  # Parameters and both Adam moments in float32, sharded over fsdp (replicated over data).
  spec = resolve(config.model, platform='tpu')
  params = jax.eval_shape(models.build(spec).init, jax.random.PRNGKey(0), {
      k: jnp.zeros((1, 64), jnp.int32) for k in ('input_ids', 'segment_ids',
                                                  'attention_mask')})['params']
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  fsdp = config.mesh.fsdp
  assert 3 * n * 4 / fsdp * 0.95 < report.state_bytes < 3 * n * 4 / fsdp * 1.2 + 4096
  # The compiled matmuls equal the model's FLOPs (loops counted with their trip counts).
  assert report.flop_ratio == pytest.approx(1.0, abs=0.05), report
  assert report.collectives.get('all-reduce') or report.collectives.get('reduce-scatter')
  if fsdp > 1:
    assert report.collectives['all-gather']['count'] > 0
  text = launch.format_report(config, target, report)
  assert 'verdict: fits' in text and 'TPU v5 lite' in text
  assert report.eval_total_bytes > 0  # (the tiny configs evaluate)
  # The kernels' runs per step, as the report says: forward, dK/dV and dQ of each layer but
  # the pruned last (unrolled), or of both scanned layers in each of 16 microbatches.
  runs = {'postln': 3, 'realformer': 16 * 2 * 3, 'synth_dense_vanilla': 3}[variant]
  assert report.kernels == runs and f'custom kernels: {runs} runs per step' in text
  if variant == 'realformer':  # (16 microbatches of 2048: see V5E_TINY)
    assert 0 < report.eval_total_bytes < report.total_bytes
    _the_verdict_covers_the_evaluation_step(config, target, report)


def _the_verdict_covers_the_evaluation_step(config, target, report):
  """An evaluation step larger than the train step (a task's own) decides the verdict."""
  assert 'evaluation step, total' in launch.format_report(config, target, report)
  report.eval_total_bytes = 2 * report.total_bytes
  between = (report.total_bytes + report.eval_total_bytes) // 2
  assert not launch.judge(report, between)
  report.hbm_bytes, report.fits = between, False
  assert ('verdict: does not fit: the evaluation step (set train.eval_steps=0, raise '
          'train.grad_accum_steps or a slice of more chips with the state sharded over them '
          '(mesh.fsdp))') in launch.format_report(config, target, report)  # (fsdp spans the
  # slice; remat would not help the evaluation)
  report.eval_total_bytes = 0  # train.eval_steps=0: only the train step counts
  assert launch.judge(report, between)


@needs_libtpu
def test_a_tpu_target_leaves_the_environment_as_it_found_it(monkeypatch):
  """The TPU VM description libtpu reads as it loads is set for that moment only: the
  programs this process starts (a sweep's runs, a test's commands) do not inherit another
  slice's accelerator type; a value the user gave is used and kept."""
  for name in ('TPU_ACCELERATOR_TYPE', 'TPU_WORKER_HOSTNAMES', 'ALLOW_MULTIPLE_LIBTPU_LOAD'):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv('TPU_WORKER_HOSTNAMES', '127.0.0.1')  # (not what the code would set)
  assert len(launch.tpu_target('v5p:2x2x1').devices) == 4
  assert 'TPU_ACCELERATOR_TYPE' not in os.environ
  assert 'ALLOW_MULTIPLE_LIBTPU_LOAD' not in os.environ
  assert os.environ['TPU_WORKER_HOSTNAMES'] == '127.0.0.1'


@needs_libtpu
def test_multi_host_slice_compiles_from_one_process():
  config = tiny('realformer', mesh__fsdp=4, mesh__data=-1, model__scan_layers=True)
  config.train.batch_size = 64
  target = launch.tpu_target('v5p:4x4x4')
  assert (len(target.devices), target.num_hosts) == (64, 16)
  report, _ = launch.compile_step(config, target)
  assert report.fits and report.flop_ratio == pytest.approx(1.0, abs=0.05)


@needs_libtpu
def test_a_mesh_across_the_slices_physical_axes_is_laid_with_a_warning(caplog):
  """fsdp=8 x data=8 on a v5p 4x4x4 cube: no side product is 8 along one axis, which
  jax.make_mesh refuses (NotImplementedError, a traceback); the mesh is laid across the
  axes, every chip once, and the log says what that costs."""
  devices = launch.tpu_target('v5p:4x4x4').devices
  for shape, warned in (((8, 8, 1), True), ((4, 16, 1), False)):
    caplog.clear()
    mesh = partitioning.make_mesh(ml_collections.ConfigDict(
        dict(zip(partitioning.MESH_AXES, shape))), devices)
    assert tuple(mesh.shape.values()) == shape and len(set(mesh.devices.flat)) == 64
    assert ('does not follow the physical axes' in caplog.text) == warned


@needs_libtpu
def test_a_program_too_big_for_hbm_is_refused_not_crashed():
  """The compiler's refusal is the report's verdict and train.py's exit status
  (EXIT_DOES_NOT_FIT: a script can check a config before it books a slice)."""
  config = tiny(model__scan_layers=True)  # scanned: the compiler refuses sooner
  config.train.batch_size = 1 << 16
  lines = []
  result = launch.run(config, 'v5e:2x2', log=lines.append)
  report = result['report']
  assert not report['fits'] and 'HBM' in report['refusal']
  assert report['refused_temp_bytes'] > 16 * launch.GiB
  assert launch.exit_status(result) == launch.EXIT_DOES_NOT_FIT
  assert lines[0] == 'compiling the train step and the evaluation step for v5e:2x2 (4 chips) ...'
  assert 'does not fit: the compiler refused' in lines[1]
  assert lines[1].endswith(  # and the fixes
      f'verdict: does not fit ({launch.memory_fixes(config, launch.tpu_target("v5e:2x2"))})')
  assert 'shard the state further (mesh.fsdp)' in lines[1]
  assert launch.exit_status({'report': dict(report, fits=True)}) == 0
  assert launch.exit_status({'report': dict(report, hbm_bytes=None)}) == 0  # no limit known


def test_the_fixes_shard_further_only_where_fsdp_does_not_span_the_slice():
  """Sharding the state further is a fix where the fsdp axis leaves chips out; where it spans
  the slice (one chip, or mesh.fsdp=-1), a slice of more chips is."""
  slice_of = lambda n: types.SimpleNamespace(devices=list(range(n)))
  config = tiny()
  config.mesh.data, config.mesh.fsdp = 1, -1
  for n in (1, 4):
    assert launch.shard_fixes(config, slice_of(n)).startswith(
        'a slice of more chips with the state sharded over them (mesh.fsdp)')
  config.mesh.fsdp, config.mesh.tensor = 4, 2  # (the tensor axis splits the matrices too)
  assert launch.shard_fixes(config, slice_of(8)).startswith('a slice of more chips')
  config.mesh.tensor = 1
  config.mesh.data = -1
  config.mesh.fsdp = 1
  assert launch.shard_fixes(config, slice_of(4)).startswith('shard the state further')
  assert launch.memory_fixes(config, slice_of(4)).startswith('lower train.batch_size')
  # Two slices of 4: each holds the whole state, so fsdp=4 spans what it can.
  slices = types.SimpleNamespace(devices=[
      types.SimpleNamespace(platform='tpu', slice_index=i // 4) for i in range(8)])
  config.mesh.data, config.mesh.fsdp = 2, 4
  assert launch.shard_fixes(config, slices).startswith('a slice of more chips')
  config.mesh.data, config.mesh.fsdp = 4, 2
  assert launch.shard_fixes(config, slices).startswith('shard the state further')


def test_find_max_batch_search_lands_on_the_boundary(monkeypatch):
  # An affine memory model with a kink, standing in for compiles.
  hbm = 100 * launch.GiB
  def fake_compile(config, target, b=None, **_):
    b = b or config.train.batch_size
    total = int((2 + 0.37 * b + (0.05 * (b - 150) if b > 150 else 0)) * launch.GiB)
    if total > 3 * hbm:
      return launch.Report(batch_size=b, fits=False, refusal='Ran out of memory on HBM',
                           refused_temp_bytes=total - 2 * launch.GiB), None
    return launch.Report(batch_size=b, fits=total <= hbm, total_bytes=total,
                         temp_bytes=total - 2 * launch.GiB), object()
  monkeypatch.setattr(launch, 'compile_step', fake_compile)
  target = launch.Target('fake', 'tpu', jax.devices()[:4], 1, 'fake', hbm)
  config = tiny()
  for start in (4, 32, 1024):
    config.train.batch_size = start
    tried = launch.find_max_batch(config, target, log=lambda *_: None)
    best = max(r.batch_size for r in tried if r.fits)
    fails = min(r.batch_size for r in tried if not r.fits)
    truth = max(b for b in range(4, 4000, 4) if fake_compile(None, None, b)[0].fits)
    assert (best, fails) == (truth, truth + 4)
    assert len(tried) <= 10
  # Memory exactly affine in the batch: the line's crossing, rounded down, is the answer,
  # and the next unit up confirms it (from any start: a guess at the largest batch that
  # fitted is moved one unit up, not dropped for a doubling).
  for slope, start in ((0.37, 4), (0.37, 1024), (0.0093, 32), (2.9, 8)):
    affine = lambda config, target, b=None, slope=slope, **_: (lambda total: (launch.Report(
        batch_size=b or config.train.batch_size, fits=total <= hbm, total_bytes=total,
        temp_bytes=total - 2 * launch.GiB), object()))(
            int((2 + slope * (b or config.train.batch_size)) * launch.GiB))
    monkeypatch.setattr(launch, 'compile_step', affine)
    config.train.batch_size = start
    tried = launch.find_max_batch(config, target, log=lambda *_: None)
    summary = launch.search_summary(tried, 4)
    assert summary['converged'] and len(tried) <= 4, [r.batch_size for r in tried]
  # Near the limit the TPU compiler squeezes a program to fit (it rematerialises): memory
  # stops following the line, and a step a unit above the largest fit fits too (a v5p
  # search crawled up so, then doubled past the limit). Here programs up to `over` GiB past
  # HBM on the line fit, reported just under it; a search may start inside that band. A
  # search of the narrow band ends within the command's default 12 compiles, of the wide
  # one within 16 (the search before took 14, and did not find the wide one's end in 30).
  gib = hbm / launch.GiB
  for slope, over, start in ((0.0093, 1.5, 32), (0.0093, 1.5, 4000), (0.0093, 1.5, 10400),
                             (0.0093, 4, 32), (0.0093, 4, 10600), (0.037, 1.5, 8),
                             (0.37, 1.5, 4)):
    def squeezed(config, target, b=None, slope=slope, over=over, **_):
      b = b or config.train.batch_size
      line = 2 + slope * b
      total = gib - 0.3 if gib - 0.3 < line <= gib + over else line
      return launch.Report(batch_size=b, fits=total <= gib, total_bytes=int(total * launch.GiB),
                           state_bytes=2 * launch.GiB,
                           temp_bytes=int((total - 2) * launch.GiB)), object()
    monkeypatch.setattr(launch, 'compile_step', squeezed)
    config.train.batch_size = start
    tried = launch.find_max_batch(config, target, log=lambda *_: None,
                                  max_compiles=12 if over < 2 else 16)
    truth = max(b for b in range(4, 40000, 4) if squeezed(None, None, b)[0].fits)
    summary = launch.search_summary(tried, 4)
    assert (summary['max_batch'], summary['converged']) == (truth, True), (
        slope, over, start, [r.batch_size for r in tried])
  monkeypatch.setattr(launch, 'compile_step', fake_compile)
  # The command's --max_compiles bounds the search (and says how to go on).
  monkeypatch.setattr(launch, 'target_for', lambda name: target)
  monkeypatch.setattr(launch, 'format_report', lambda *a: '')
  lines = []
  config.train.batch_size = 4
  result = launch.run(config, 'fake', max_batch=True, max_compiles=3, log=lines.append)
  assert len(result['search']) == 3 and not result['converged']
  assert 'raise --max_compiles' in lines[-1]
  with pytest.raises(launch.LaunchError, match='--max_compiles=0'):
    launch.run(config, 'fake', max_batch=True, max_compiles=0)
  # Nothing tried fits: it says whether smaller batches were left untried.
  config.train.batch_size = 4000
  for compiles, last in ((3, 'the search stopped after 3 compiles before reaching 4: raise '
                             '--max_compiles'),
                         (12, 'no batch fits, not even 4: shard the state further')):
    monkeypatch.setattr(launch, 'compile_step', lambda c, t, b=None, **_: (launch.Report(
        batch_size=b or c.train.batch_size, fits=False, total_bytes=hbm + launch.GiB,
        temp_bytes=hbm), None))  # none fits
    lines.clear()
    launch.run(config, 'fake', max_batch=True, max_compiles=compiles, log=lines.append)
    assert last in lines[-1], lines
  # A guess whose train step fits and whose evaluation step does not says which.
  monkeypatch.setattr(launch, 'compile_step', lambda c, t, b=None, **_: (launch.Report(
      batch_size=b or c.train.batch_size, fits=False, total_bytes=hbm // 2,
      eval_total_bytes=hbm + 1), None))
  lines.clear()
  launch.run(config, 'fake', max_batch=True, max_compiles=2, log=lines.append)
  assert '  batch 4000: 50.00 GiB per chip, its evaluation step does not fit' in lines, lines


# --------------------------------------------------------------------------------------
# The command and its errors.
# --------------------------------------------------------------------------------------

def test_gpu_targets_are_named_or_refused_in_one_line(monkeypatch):
  """A GPU target is <gpu>[:<per host>|:<hosts>x<per host>]; without jax's CUDA plugin the
  error names the install (the compile itself: test_a_gpu_step_compiles_without_a_gpu)."""
  with pytest.raises(launch.LaunchError, match=r"give h100, h100:<GPUs> \(one host\) or "
                                               r"h100:<hosts>x<GPUs per host>"):
    launch.target_for('h100:x8')
  with pytest.raises(launch.LaunchError, match='at least one host and one GPU'):
    launch.target_for('a100:0x8')
  monkeypatch.setitem(sys.modules, 'jax_cuda13_plugin', None)  # (an import then fails)
  with pytest.raises(launch.LaunchError, match=r'needs jax\'s CUDA plugin, which is not '
                                               r'installed: pip install "jax\[cuda13\]'):
    launch.target_for('h200:8')
  with pytest.raises(launch.LaunchError, match=r"'b200' is neither a TPU generation \(v4, .*\) "
                                               r"nor a GPU \(h100, h200, a100, a100-40gb\); .* "
                                               r"GPUs as <gpu>\[:<per host>"):
    launch.target_for('b200:8')


@pytest.mark.skipif(importlib.util.find_spec('jax_cuda13_plugin') is None and
                    not os.environ.get('REALFORMER_REQUIRE_CUDA_PLUGIN'),
                    reason='pip install "jax[cuda13]==0.11.2" (about 4 GB; not in CI)')
def test_a_gpu_step_compiles_without_a_gpu(tmp_path):
  """The launch check for two H100s on one host, in a fresh process (jax's CUDA plugin,
  compiling without a device): RealFormer's float32 step through the flash kernel, the
  Triton kernels compiled for compute capability 9 (their tiles within its shared memory:
  float32 with a term asked 270 KiB of its 227 before default_tilings knew the device), its
  memory judged against jax's default 75% of the card."""
  out = tmp_path / 'launch.json'
  proc = subprocess.run(
      [sys.executable, 'train.py', '--config', 'configs/pretrain.py:realformer,tiny',
       '--compile_for', 'h100:2', '--config.data.sources=synthetic',
       '--config.model.fused_attention=flash', '--config.train.batch_size=4',
       '--config.mesh.data=2', f'--launch_json={out}'],
      cwd=REPO, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'on h100:2 (2 x NVIDIA H100 80GB HBM3)' in proc.stdout
  result = json.loads(out.read_text())
  assert result['device_kind'] == 'NVIDIA H100 80GB HBM3' and result['chips'] == 2
  report = result['report']
  assert report['fits'] and report['hbm_bytes'] == int(0.75 * (81559 << 20))
  # the forward, dQ and dK/dV kernels of the first layer (the pruned last one is plain)
  assert report['opaque_kernels'] == 3


def test_errors_are_one_line_and_name_the_fix(monkeypatch):
  with pytest.raises(launch.LaunchError, match="'v9' is neither a TPU generation"):
    launch.tpu_target('v9:2x2')
  with pytest.raises(launch.LaunchError, match='AxB'):
    launch.tpu_target('v5e:2by2')
  # A slice of the wrong dimensions for its generation (which libtpu compiles all the same),
  # and Cloud TPU's type names: said in the form a slice is named.
  with pytest.raises(launch.LaunchError, match=r"'v5e:2x2x2': v5e slices are AxB, not 2x2x2 "
                     r'\(e.g. v5e:2x2\)'):
    launch.tpu_target('v5e:2x2x2')
  with pytest.raises(launch.LaunchError, match=r"v5p slices are AxBxC, not 2x2 \(e.g. "
                     r'v5p:2x2x1\)'):
    launch.tpu_target('v5p:2x2')
  # Shapes libtpu compiles (v5p:4x4x5 is 80 chips on 20 hosts) but Cloud TPU never creates.
  for name, why in (('v5p:4x4x5', r'v5p slices are 2x2x1, 2x2x2, 2x2x4, 2x4x4, then AxBxC '
                                  r'with A <= B <= C, each a multiple of 4, up to 8960 chips'),
                    ('v4:16x16x20', 'v4 slices are .* each a multiple of 4 up to 16, up to '
                                    '4096 chips'),
                    ('v4:4x4x64', 'v4 slices are'),
                    ('v5e:3x5', 'v5e slices are 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16$'),
                    ('v6e:16x32', 'v6e slices are 1x1, '),
                    ('v5e:4x2', 'Cloud TPU writes this slice v5e:2x4$'),
                    ('v5p:8x4x4', 'Cloud TPU writes this slice v5p:4x4x8$'),
                    ('v4:1x2x2', 'Cloud TPU writes this slice v4:2x2x1$')):
    with pytest.raises(launch.LaunchError, match=f"^--compile_for='{name}': no such slice: {why}"):
      launch.tpu_target(name)
  for name in ('v4:2x4x4', 'v5p:4x4x12', 'v5p:16x20x28', 'v6e:16x16'):
    assert launch._not_offered(name[:name.index(':')],  # pylint: disable=protected-access
                               [int(n) for n in name.split(':')[1].split('x')]) is None, name
  # A kernel out of on-chip memory is not the batch's refusal (no batch would fit): said so.
  oom = 'RESOURCE_EXHAUSTED: Ran out of memory in memory space {} while allocating {}'
  assert launch._out_of_memory(RuntimeError(oom.format('hbm', 'temps'))).startswith(  # pylint: disable=protected-access
      'RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm')
  with pytest.raises(launch.LaunchError, match=r'a kernel asks more on-chip memory than the '
                     r'device has \(.*vmem.*\): its tiling, not the batch; '
                     r'--config.model.fused_attention=off compiles \(and trains\) without '
                     r'the kernels meanwhile'):
    launch._out_of_memory(RuntimeError(oom.format('vmem', 'dkv')))  # pylint: disable=protected-access
  for cloud, slice_ in (('v4-32', 'v4:2x2x4'), ('v5litepod-8', 'v5e:2x4'), ('v5e-16', 'v5e:4x4'),
                        ('v5p-128', 'v5p:4x4x4'), ('v6e-32', 'v6e:4x8')):
    with pytest.raises(launch.LaunchError, match=f"'{cloud}' is a Cloud TPU type .*e.g. "
                       f'{slice_} '):
      launch.tpu_target(cloud)
  with pytest.raises(launch.LaunchError, match="'v5e-16' is a Cloud TPU type"):
    launch.target_for('V5E-16')  # any case
  assert launch.target_for('LOCAL').name == 'local'
  with pytest.raises(launch.LaunchError, match="'2xv5e-16' is a Cloud TPU type .*e.g. "
                     '2xv5e:4x4 '):
    launch.tpu_target('2xv5e-16')
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, 'find_spec',
                      lambda name, *a: None if name == 'libtpu' else real(name, *a))
  with pytest.raises(launch.LaunchError, match='requirements-tpu.txt'):
    launch.tpu_target('v5e:2x2')


@needs_libtpu
def test_hosts_of_v5e_slices_are_the_vms_google_sells():
  """Up to 8 chips a v5e slice is one VM (1x1 is one chip, not an indivisible layout); past
  that, 4-chip VMs. The one-chip slice compiles: a matmul stands for the train step, whose
  own compiles are judged on v5e:2x2 above."""
  for name, chips, hosts in (('v5e:1x1', 1, 1), ('v5e:2x4', 8, 1), ('v5e:4x4', 16, 4)):
    target = launch.tpu_target(name)
    assert (len(target.devices), target.num_hosts) == (chips, hosts), name
  mesh = jax.sharding.Mesh(np.array(launch.tpu_target('v5e:1x1').devices), ('x',))
  x = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
  compiled = jax.jit(lambda a: (a @ a).sum()).lower(x).compile()
  assert compiled.cost_analysis()['flops'] >= 2 * 256 ** 3


@needs_libtpu
def test_slice_errors(monkeypatch):
  target = launch.tpu_target('v5e:2x2')
  config = tiny(mesh__fsdp=3)
  with pytest.raises(launch.LaunchError, match='does not divide.*v5e:2x2 has 4 chips'):
    launch.compile_step(config, target)
  config = tiny()
  config.train.batch_size = 30
  with pytest.raises(ValueError, match='multiple of 4'):
    launch.compile_step(config, target)


def test_compile_for_local_measures_steps():
  config = tiny(mesh__fsdp=2, mesh__data=-1)
  config.model.dtype = 'float32'
  result = launch.run(config, 'local', measure_steps=2, log=lambda *_: None)
  assert result['report']['fits'] and result['measured']['step_seconds'] > 0
  assert result['report']['flop_ratio'] == pytest.approx(1.0, abs=0.05)


def test_a_step_that_does_not_fit_is_not_run(monkeypatch):
  """--compile_for local on an accelerator: a step over the device's memory is reported,
  not run into an out-of-memory traceback. Its report has both steps' memory; a batch
  search's guess whose train step does not fit skips the evaluation step's compile."""
  local = launch.local_target()  # a device of 1 MiB
  monkeypatch.setattr(launch, 'local_target',
                      lambda: dataclasses.replace(local, hbm_bytes=1 << 20))
  monkeypatch.setattr(launch, 'measure', lambda *_: pytest.fail('measured'))
  lines = []
  result = launch.run(tiny(), 'local', measure_steps=2, log=lines.append)
  assert 'measured' not in result and lines[-1].startswith('not measured: the train step does')
  assert result['report']['eval_total_bytes'] > 0
  report, _ = launch.compile_step(tiny(), launch.local_target(), eval_if_step_fits=True)
  assert not report.fits and report.total_bytes > 0 and report.eval_total_bytes == 0
  report, _ = launch.compile_step(tiny(), local, eval_if_step_fits=True)  # (no limit: fits)
  assert report.fits and report.eval_total_bytes > 0


@needs_libtpu
def test_command_line_error_is_one_line():
  env = dict(os.environ, JAX_PLATFORMS='')
  proc = subprocess.run(
      [sys.executable, 'train.py', '--compile_for', 'v5e:2x2', '--config.mesh.fsdp=3',
       '--config.data.sources=synthetic'],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  errors = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and 'v5e:2x2 has 4 chips' in errors[0], proc.stderr[-2000:]
  assert 'Traceback' not in proc.stderr


# One variant of each kind of attention that test_tiny_compiles_for_v5e_2x2 does not compile:
# a random table mixed with dot products, factorized random and factorized dense tables.
# Each variant's matmuls are counted exactly in its jaxpr (tests/test_last_layer.py): Pre-LN's
# are Post-LN's, the pure Synthesizers' their mixtures' but for the dot product.
@pytest.mark.parametrize('variant', [
    'synth_random_vanilla', 'synth_factorized_random', 'synth_factorized_dense'] + (
        [] if HAVE_LIBTPU else [v for v, _ in V5E_TINY]))
def test_every_kind_of_attention_compiles_to_its_model_flops(variant):
  # For a v5e:2x2 slice where libtpu is installed (always in CI), else for this host's CPU
  # devices (the same program, up to the platform's choices): compiled matmuls within 5% of
  # flops_per_example, scanned with accumulation, on a data x fsdp mesh.
  config = tiny(variant, mesh__fsdp=2, mesh__data=-1, model__scan_layers=True,
                train__grad_accum_steps=2, train__eval_steps=0)  # the train step alone
  config.model.dtype = 'float32'
  target = launch.tpu_target('v5e:2x2') if HAVE_LIBTPU else launch.local_target()
  report, _ = launch.compile_step(config, target)
  assert report.fits or not HAVE_LIBTPU
  assert report.flop_ratio == pytest.approx(1.0, abs=0.05), (variant, report.flop_ratio)
  # The report names the attention's path: the Mosaic kernels on a TPU for every variant (a
  # pure Synthesizer's logits the term alone), the plain path elsewhere.
  kernel = 'flash (Mosaic)' if HAVE_LIBTPU else 'plain'
  assert report.attention == f'training {kernel}, evaluation plain', report.attention
  assert ('custom kernels: none' in launch.format_report(config, target, report)) == (
      not HAVE_LIBTPU)


@needs_libtpu
def test_ctrl_c_stops_a_batch_search_at_once(tmp_path):
  """Ctrl-C during --find_max_batch's compiles: `stopped by Ctrl-C`, status 130, at once or
  when the compile in progress returns (a KeyboardInterrupt raised in a callback of XLA's
  compiler was swallowed there and the search compiled on for more than ten minutes).
  BERT-small's compiles take seconds here: the one the signal lands in returns soon (a
  base model's took 5 to 32 s, as the signal came before or inside its first compile)."""
  import signal  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  log = tmp_path / 'stderr.txt'
  # (Ctrl-C's default restored first: a test run in the background inherits it ignored)
  with open(log, 'w') as err:
    proc = subprocess.Popen(
        [sys.executable, '-c', 'import os, signal, sys; signal.signal(signal.SIGINT, '
         'signal.SIG_DFL); os.execv(sys.executable, [sys.executable] + sys.argv[1:])',
         'train.py', '--config=configs/pretrain.py:postln,small', '--compile_for=v5e:2x2',
         '--find_max_batch'], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True)
  try:
    deadline = time.time() + 120
    while 'model.vocab_size' not in log.read_text():  # configured: compiling comes next
      assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
      time.sleep(0.1)
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    sent = time.time()
    proc.wait(timeout=240)
  finally:
    if proc.poll() is None:
      proc.kill()
  text = log.read_text()
  assert proc.returncode == 130 and time.time() - sent < 180, text[-3000:]
  assert text.strip().splitlines()[-1] == 'stopped by Ctrl-C' and 'Traceback' not in text


@needs_libtpu
def test_bfloat16_with_remat_compiles_from_the_command_line(tmp_path):
  """XLA:TPU's compiler overflowed the default 8 MiB stack on bfloat16 with remat 'full' (a
  segmentation fault, status -11): --compile_for re-runs itself with an unlimited stack."""
  env = {k: v for k, v in os.environ.items()  # (the compiler's default effort)
         if k not in (launch.STACK_ENV, 'JAX_OPTIMIZATION_LEVEL')}
  env['JAX_COMPILATION_CACHE_DIR'] = str(tmp_path / 'jax_cache')  # as a user may set it
  proc = subprocess.run(
      [sys.executable, 'train.py', '--compile_for', 'v5e:2x2', '--config.model.dtype=bfloat16',
       '--config.model.remat_policy=full', '--config.model.scan_layers=True',
       '--config.data.sources=synthetic', '--config.data.max_seq_length=64',
       '--config.model.max_len=64', '--config.data.max_predictions_per_seq=10'],
      cwd=REPO, capture_output=True, text=True, timeout=500, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'verdict: fits' in proc.stdout and 'remat full recomputes' in proc.stdout, proc.stdout
  # No start-up noise before the report: no TensorFlow banner (nothing imports it), no
  # libtpu complaint about the TPU VM description a CPU host lacks (launch.tpu_target
  # gives one), no cache warning (a compile-only target uses no compilation cache, also
  # where jax's own environment variable names one: it wrote nothing there).
  for noise in ('TensorFlow', 'oneDNN', 'INVALID_ARGUMENT', 'TPU_ACCELERATOR_TYPE',
                'persistent compilation cache'):
    assert noise not in proc.stderr, (noise, proc.stderr[-3000:])
  assert not (tmp_path / 'jax_cache').exists() or not any((tmp_path / 'jax_cache').iterdir())
