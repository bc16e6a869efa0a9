r"""The launch table of docs/launching.md: train.py's step compiled for one slice of each TPU
generation, for sizes x variants x lengths x meshes, with the largest global batch that fits.

  python benchmarks/launch_table.py --out benchmarks/results/launch_table.jsonl \
      [--shard 0/2]                       # run two shards side by side on two cores
  python benchmarks/launch_table.py --out benchmarks/results/launch_table.jsonl \
      --markdown

Every cell is `realformer.tools.launch.find_max_batch` on the config
`configs/pretrain.py:<variant>,<size>` with bfloat16 activations, scanned layers (compile
time: an unrolled 12-layer step took ~8 minutes on 2 cores, scanned ~25 s), no remat, the
synthetic source (a 30,000-token vocabulary), 20 predictions per sequence at length 128 and
80 at 512, on a 4-chip slice (v4:2x2x1, v5e:2x2, v5p:2x2x1, v6e:2x2) with mesh data=4 or
fsdp=4. The reference batch is 128 sequences (32 per chip); the search looks for the
largest fitting multiple of 64 (16 per chip) in at most 3 compiles (each 20-40 s on 2 cores;
a refusal takes ~3 s): the reference, the batch where memory proportional to the batch
would fill HBM, and where the line through the two meets HBM. It reports the largest batch
that compiled and fitted and the smallest that did not: the answer lies between them
(`launch.py --find_max_batch` searches until they are one unit apart). Finished cells are
kept: rerunning continues (a cell takes 1-5 minutes).
Needs libtpu (requirements-tpu.txt).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SLICES = ('v5e:2x2', 'v5p:2x2x1', 'v6e:2x2', 'v4:2x2x1')
SIZES = ('base', 'large', 'xlarge')
VARIANTS = ('postln', 'realformer', 'realformer+bf16carry', 'synth_dense_vanilla')
LENGTHS = ((128, 20), (512, 80))
MESHES = ('data', 'fsdp')
REFERENCE_BATCH, MULTIPLE, MAX_COMPILES = 128, 64, 3


def cells():
  """Every cell, the most telling first (the run may be cut short and resumed): the fsdp
  mesh at length 128 on every slice, then at 512, then pure data parallelism; RealFormer's
  bfloat16 carry first on v5e and v5p, on v6e and v4 after everything else."""
  late = []
  for mesh in ('fsdp', 'data'):
    for length, preds in LENGTHS:
      for target in SLICES:
        for size in SIZES:
          for variant in VARIANTS:
            if variant.endswith('bf16carry') and mesh != 'fsdp':
              continue  # the carry's effect is the same question on either mesh
            cell = dict(target=target, size=size, variant=variant, length=length,
                        predictions=preds, mesh=mesh)
            if variant.endswith('bf16carry') and target in ('v6e:2x2', 'v4:2x2x1'):
              late.append(cell)
            else:
              yield cell
  yield from late


def key(cell):
  return '|'.join(str(cell[k]) for k in ('target', 'size', 'variant', 'length', 'mesh'))


def make_config(cell):
  from configs import pretrain
  variant = cell['variant'].split('+')[0]
  c = pretrain.get_config(f'{variant},{cell["size"]}').copy_and_resolve_references()
  c.data.sources = 'synthetic'
  c.data.max_seq_length, c.data.max_predictions_per_seq = cell['length'], cell['predictions']
  c.model.dtype, c.model.scan_layers = 'bfloat16', True
  if cell['variant'].endswith('bf16carry'):
    c.model.residual_dtype = 'bfloat16'
  c.mesh.data, c.mesh.fsdp = (-1, 1) if cell['mesh'] == 'data' else (1, -1)
  c.train.batch_size = REFERENCE_BATCH
  return c


def finished(path: str) -> set:
  """The keys of the cells already in `path`."""
  if not os.path.exists(path):
    return set()
  with open(path) as f:
    return {key(json.loads(l)['cell']) for l in f if l.strip()}


def run(args):
  from realformer.tools import launch
  done = finished(args.out)
  index, count = (int(x) for x in args.shard.split('/'))
  only = dict(kv.split('=', 1) for kv in filter(None, args.only.split(',')))
  todo = [c for i, c in enumerate(cells()) if i % count == index and key(c) not in done
          and all(str(c[k]) == v for k, v in only.items())]
  targets = {}
  for cell in todo:
    if key(cell) in finished(args.out):  # another search into the same file did it meanwhile
      continue
    start = time.time()
    if cell['target'] not in targets:
      targets[cell['target']] = launch.tpu_target(cell['target'])
    target = targets[cell['target']]
    config = make_config(cell)
    reports = launch.find_max_batch(config, target, multiple=MULTIPLE, max_compiles=MAX_COMPILES,
                                    log=lambda *_: None)
    reference = next(r for r in reports if r.batch_size == REFERENCE_BATCH)
    summary = launch.search_summary(reports, launch.batch_unit(config, target, MULTIPLE))
    best = next((r for r in reports if r.fits and r.batch_size == summary['max_batch']), None)
    line = {'cell': cell, 'hbm_gib': target.hbm_bytes / launch.GiB,
            'reference': {'batch': REFERENCE_BATCH, 'fits': reference.fits,
                          'gib': reference.total_bytes / launch.GiB,
                          'state_gib': reference.state_bytes / launch.GiB,
                          'temp_gib': reference.temp_bytes / launch.GiB,
                          'flop_ratio': reference.flop_ratio,
                          'refusal': reference.refusal},
            'max_batch': best.batch_size if best else 0,
            'max_batch_gib': best.total_bytes / launch.GiB if best else None,
            'first_failing': summary['first_failing'],
            'converged': summary['converged'],
            'compiles': len(reports), 'seconds': time.time() - start}
    with open(args.out, 'a') as f:
      f.write(json.dumps(line) + '\n')
    print(key(cell), line['reference']['fits'], f"{line['reference']['gib']:.2f}",
          line['max_batch'], f"{line['seconds']:.0f}s", flush=True)


def rejudged(r):
  """A stored cell judged against the usable HBM (launch.USABLE_HBM_GIB; the cells of
  2026-11-24 were judged against the nominal HBM of Google's tables). A compile whose total
  is above the usable figure does not fit: the reference batch becomes "no", and a largest
  batch found above it becomes the smallest known not to fit, the reference (if it fits)
  the largest known to."""
  from realformer.tools import launch
  usable = launch.USABLE_HBM_GIB[r['cell']['target'].split(':')[0]]
  r = json.loads(json.dumps(r))
  ref = r['reference']
  if ref['fits'] and ref['gib'] > usable:
    ref['fits'] = False
  if r['max_batch'] and (r['max_batch_gib'] or 0) > usable:
    r['first_failing'] = r['max_batch']
    r['max_batch'], r['max_batch_gib'] = ((ref['batch'], ref['gib']) if ref['fits'] and
                                          ref['batch'] < r['max_batch'] else (0, None))
    r['rejudged'] = True
  return r


def estimated_max(raw):
  """The largest multiple of 64 that the line through a cell's two stored compiles (the
  reference batch and the largest that fitted; memory per chip is the state, which does not
  grow with the batch, plus temporaries that grow about linearly) puts under the usable HBM,
  kept inside what the compiles showed (at least the largest that fitted, below the smallest
  that did not). None where the cell holds fewer than two compiles with a total."""
  from realformer.tools import launch
  usable = launch.USABLE_HBM_GIB[raw['cell']['target'].split(':')[0]]
  ref = raw['reference']
  points = {(ref['batch'], ref['gib'])} if ref.get('gib') else set()
  if raw['max_batch'] and raw.get('max_batch_gib'):
    points.add((raw['max_batch'], raw['max_batch_gib']))
  if len({b for b, _ in points}) < 2:
    return None
  (b1, g1), (b2, g2) = sorted(points)
  slope = (g2 - g1) / (b2 - b1)
  if slope <= 0:
    return None
  estimate = int((b1 + (usable - g1) / slope) // MULTIPLE * MULTIPLE)
  if estimate <= 0:  # both compiles above the usable HBM: the line says nothing fits
    return None
  judged = rejudged(raw)
  low = judged['max_batch'] or 0
  high = (judged['first_failing'] - MULTIPLE) if judged['first_failing'] else estimate
  return max(low, min(estimate, high))


def resolved(r) -> bool:
  """The largest batch is known to the search's unit: none fits at 64, or a bracket of 64."""
  return bool(r['first_failing']) and r['first_failing'] - (r['max_batch'] or 0) <= MULTIPLE


def _cell(r, estimate=None):
  if r is None:
    return 'not run'
  ref = r['reference']
  at = f'{ref["gib"]:.2f} GiB' if ref['fits'] else 'no'
  star = '*' if r.get('rejudged') else ''
  est = f' (est. {estimate})' if estimate is not None and not resolved(r) else ''
  if not r['max_batch']:
    return (f'{at}; {r["first_failing"]} not, smaller not tried*' if star else
            f'{at}; none fits')
  if not r['first_failing']:
    return f'{at}; >= {r["max_batch"]}{est}'
  return f'{at}; {r["max_batch"]} fits, {r["first_failing"]} not{star}{est}'


def _carry_gib(cell, chips=4):
  """Arithmetic: RealFormer's float32 carries of every layer, per chip at the reference
  batch: layers x batch per chip x heads x T^2 x 4 bytes."""
  from configs import pretrain
  layers, _, heads, _ = pretrain.SIZES[cell['size']]
  return layers * REFERENCE_BATCH / chips * heads * cell['length'] ** 2 * 4 / 1024 ** 3


def markdown(args):
  rows, estimates = {}, {}
  with open(args.out) as f:
    for l in f:
      if l.strip():
        raw = json.loads(l)
        r = rejudged(raw)
        rows[key(r['cell'])] = r
        estimates[key(r['cell'])] = estimated_max(raw)
  get = lambda **c: rows.get(key(c))
  est = lambda r: estimates.get(key(r['cell'])) if r else None
  out = ['Each cell: GiB per chip at global batch 128 (32 per chip; "no" = does not fit), '
         'then the largest global batch that compiled and fitted and the smallest that did '
         'not (the largest batch lies between). The slice\'s HBM is what a program may use '
         '(the compiler\'s "available HBM"); a cell marked * was re-judged against it from '
         'its stored compile (judged against the nominal HBM when it was made).', '',
         '| slice (HBM) | length | mesh | size | ' + ' | '.join(VARIANTS) + ' |',
         '|---|---|---|---|' + '---|' * len(VARIANTS)]
  for target in SLICES:
    gen = target.split(':')[0]
    from realformer.tools import launch
    for length, _ in LENGTHS:
      for mesh in MESHES[::-1]:
        for size in SIZES:
          cells_ = [get(target=target, size=size, variant=v, length=length, mesh=mesh)
                    for v in VARIANTS]
          if all(c is None for c in cells_):
            continue
          text = ['' if v.endswith('bf16carry') and mesh != 'fsdp' else _cell(c, est(c))
                  for v, c in zip(VARIANTS, cells_)]
          out.append(f'| {target} ({launch.USABLE_HBM_GIB[gen]} GiB) | {length} | {mesh} | '
                     f'{size} | '
                     + ' | '.join(text) + ' |')
  out += ['', "RealFormer's extra memory over Post-LN as the compiler sees it (fsdp mesh, "
          'global batch 128), against the size of the float32 carries if all were kept for the '
          'backward pass (layers x 32 x heads x T^2 x 4 bytes per chip), and what a bfloat16 '
          'carry '
          '(`model.residual_dtype=bfloat16`) changes:', '',
          '| slice | length | size | Post-LN GiB | RealFormer GiB | extra | carry arithmetic '
          '| bf16 carry GiB | largest fitting batch found: Post-LN / RealFormer / bf16 carry |',
          '|---|---|---|---|---|---|---|---|---|']
  for target in SLICES:
    for length, _ in LENGTHS:
      for size in SIZES:
        c = dict(target=target, size=size, length=length, mesh='fsdp')
        pl, rf, bf = (get(variant=v, **c) for v in ('postln', 'realformer',
                                                     'realformer+bf16carry'))
        if pl is None or rf is None:
          continue
        g = lambda r: (f'{r["reference"]["gib"]:.2f}' if r and r['reference']['fits']
                       else 'no' if r else 'not run')
        extra = (f'{rf["reference"]["gib"] - pl["reference"]["gib"]:+.2f}'
                 if pl['reference']['fits'] and rf['reference']['fits'] else '')
        mb = lambda r: ('not run' if not r else str(r['max_batch']) if resolved(r) or
                        est(r) is None else f'{r["max_batch"]} (est. {est(r)})')
        out.append(f'| {target} | {length} | {size} | {g(pl)} | {g(rf)} | {extra} | '
                   f'{_carry_gib(dict(c, variant="realformer")):.2f} | {g(bf)} | '
                   f'{mb(pl)} / {mb(rf)} / {mb(bf)} |')
  done = len(rows)
  total = len(list(cells()))
  ratios = [r['reference']['flop_ratio'] for r in rows.values() if r['reference']['fits']]
  seconds = [r['seconds'] / max(r['compiles'], 1) for r in rows.values()]
  out += ['', f'{done} of {total} cells compiled ({sum(r["compiles"] for r in rows.values())} '
          f'compiles, median {sorted(seconds)[len(seconds) // 2]:.0f} s each on the 2-core '
          f'box, two at a time). Compiled matmul FLOPs / flops_per_example over every '
          f'reference compile that fitted: {min(ratios):.4f} to {max(ratios):.4f}.'
          if ratios else f'{done} of {total} cells compiled.']
  if os.path.exists(checks_path(args.out)):
    with open(checks_path(args.out)) as f:
      checks = [json.loads(l) for l in f if l.strip()]
    right = sum(c['right'] for c in checks)
    out += ['', f'"est.": the largest multiple of 64 under the usable HBM on the line through '
            f'the cell\'s two compiles (`estimated_max`), for cells whose search stopped '
            f'before it was one unit wide. Checked by compiling {len(checks)} of them at the '
            f'estimate and at 64 more (`--check_estimates`): {right} of {len(checks)} fitted '
            f'at the estimate and not above it (' + '; '.join(
                f'{c["cell"]["target"]} {c["cell"]["size"]} {c["cell"]["variant"]} '
                f'{c["cell"]["length"]} {c["cell"]["mesh"]}: {c["estimate"]} '
                f'{"right" if c["right"] else "wrong"}' for c in checks) + ').']
  print('\n'.join(out))


def _read_cells(path: str) -> dict:
  """{key: the stored cell, re-judged against the usable HBM} of a results file."""
  with open(path) as f:
    raws = [json.loads(l) for l in f if l.strip()]
  return {key(r['cell']): rejudged(r) for r in raws}


def compare(args):
  """Each cell of --out beside the same cell of --before (another table's results: other
  code, other versions): GiB per chip at the reference batch, and the largest batch found."""
  before, after = _read_cells(args.before), _read_cells(args.out)
  gib = lambda r: f'{r["reference"]["gib"]:.2f}' if r['reference']['fits'] else 'no'
  found = lambda r: (f'{r["max_batch"]}' + (f' ({r["first_failing"]} not)' if
                                             r['first_failing'] else ' (larger not tried)'))
  out = [f'| slice | length | mesh | size | variant | GiB at batch {REFERENCE_BATCH}: before '
         '| after | largest batch found: before | after |', '|---|---|---|---|---|---|---|---|---|']
  for cell in cells():
    k = key(cell)
    if k in after and k in before:
      b, a = before[k], after[k]
      out.append(f'| {cell["target"]} | {cell["length"]} | {cell["mesh"]} | {cell["size"]} | '
                 f'{cell["variant"]} | {gib(b)} | {gib(a)} | {found(b)} | {found(a)} |')
  print('\n'.join(out))


def checks_path(out: str) -> str:
  return os.path.splitext(out)[0] + '_estimates.jsonl'


def check_estimates(args):
  """Compile unresolved cells at their estimate and at one unit (64) more: the estimate is
  right when the first fits and the second does not. Cells are taken one per (slice,
  length), the widest bracket first; finished checks are kept (rerunning continues)."""
  from realformer.tools import launch
  done = {}
  if os.path.exists(checks_path(args.out)):
    with open(checks_path(args.out)) as f:
      done = {key(json.loads(l)['cell']) for l in f if l.strip()}
  with open(args.out) as f:
    raws = [json.loads(l) for l in f if l.strip()]
  picked, seen = [], set()
  candidates = [(r, estimated_max(r)) for r in raws
                if not resolved(rejudged(r)) and estimated_max(r)]
  width = lambda r: (rejudged(r)['first_failing'] or 10 ** 6) - rejudged(r)['max_batch']
  for raw, estimate in sorted(candidates, key=lambda c: -width(c[0])):
    group = (raw['cell']['target'], raw['cell']['length'])
    if args.check_cells:  # named cells, e.g. v4:2x2x1|base|realformer|128|fsdp
      if key(raw['cell']) in args.check_cells.split(','):
        picked.append((raw, estimate))
    elif group not in seen and len(picked) < args.check_estimates:
      seen.add(group)
      picked.append((raw, estimate))
  targets = {}
  for raw, estimate in picked:
    cell = raw['cell']
    if key(cell) in done:
      continue
    if cell['target'] not in targets:
      targets[cell['target']] = launch.tpu_target(cell['target'])
    config = make_config(cell)
    config.train.eval_steps = 0  # the train step alone, whose figure each cell stores (the
    # table's verdicts also compiled the evaluation step: train.eval_steps as configured)
    fits = {}
    for batch in (estimate, estimate + MULTIPLE):
      report, _ = launch.compile_step(config, targets[cell['target']], batch)
      fits[batch] = {'fits': report.fits, 'gib': report.total_bytes / launch.GiB,
                     'refusal': report.refusal}
    line = {'cell': cell, 'estimate': estimate, 'compiled': fits,
            'right': fits[estimate]['fits'] and not fits[estimate + MULTIPLE]['fits']}
    with open(checks_path(args.out), 'a') as f:
      f.write(json.dumps(line) + '\n')
    print(key(cell), estimate, line['right'], flush=True)


if __name__ == '__main__':
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--out', required=True)
  p.add_argument('--shard', default='0/1', help='i/n: run every n-th cell from i')
  p.add_argument('--only', default='',
                 help='cells whose fields have these values, e.g. '
                 'target=v5p:2x2x1,mesh=fsdp,length=512 (the fields of key())')
  p.add_argument('--markdown', action='store_true', help='print the table from --out')
  p.add_argument('--before', default='',
                 help='with --markdown: print each cell of --out beside its result in this '
                 'file instead (e.g. a table compiled before a change)')
  p.add_argument('--check_estimates', type=int, default=0,
                 help='compile this many unresolved cells at their estimated largest batch '
                 'and 64 more, one per slice and length')
  p.add_argument('--check_cells', default='',
                 help='with --check_estimates: these cells (comma-separated keys '
                 'target|size|variant|length|mesh) instead of one per slice and length')
  a = p.parse_args()
  if a.markdown and not a.check_estimates:
    compare(a) if a.before else markdown(a)
  else:
    from realformer.train import compile_cache  # pylint: disable=g-import-not-at-top
    compile_cache.disable()  # compile-only TPU targets: nothing to load a cached program into
    check_estimates(a) if a.check_estimates else run(a)
