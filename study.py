r"""The papers' comparison in one command: pretrain Post-LN, Pre-LN, RealFormer and two
Synthesizer mixtures at the same size and budget on the embedded corpus, several seeds each,
then report held-out MLM and NSP accuracy, learning curves and the attention analysis.

  python study.py --root /tmp/study --seeds 2 --steps 150 --batch 16 --seq_len 64 \
      --figures docs/figures                     # ~40 minutes on 2 busy CPU cores
  python study.py --root /tmp/study --print_only --target tpu      # launch commands instead
  python study.py stability --root /tmp/study --figures docs/figures
      # claim 1: Post-LN, Pre-LN, RealFormer at 12 layers over peak lr x warm-up

The budget (tiny width: 4 layers, 128 hidden, 2 heads; 150 steps of 16 sequences of 64
tokens) only fits a CPU; the numbers it gives and what they can show are in docs/study.md.
Raise --steps, --batch, --seq_len, --size for a real comparison on accelerators.

Writes <root>/summary.{md,csv} (mean, median, spread over seeds), <root>/learning_curves.png
and <root>/attention/ (entropy violins, JS heatmaps, numbers) from seed 0 of each variant.
Runs that finished are skipped; rerunning the command resumes an interrupted study.
"""

import argparse
import json
import math
import os
import re
import shutil

from realformer import analysis
from realformer import sweep
from realformer import cli

VARIANTS = ('postln', 'preln', 'realformer', 'synth_random_vanilla', 'synth_dense_vanilla')
REPO = os.path.dirname(os.path.abspath(__file__))


def budget(args):
  """The fixed settings every variant shares. With --minutes, the equal wall-clock view:
  every run trains that long (train.time_budget_minutes; --steps is then an upper bound and
  the warm-up a tenth of the time), so a slower variant gets fewer steps."""
  fixed = [f'train.num_steps={args.steps}', f'train.batch_size={args.batch}',
           f'model.num_layers={args.layers}', f'data.max_seq_length={args.seq_len}',
           f'model.max_len={max(args.seq_len, 128)}',
           f'optimizer.learning_rate={args.learning_rate}',
           f'optimizer.warmup_steps={-1 if args.minutes else max(1, args.steps // 10)}',
           f'train.log_every_steps={max(1, args.steps // 20)}',
           f'train.eval_every_steps={max(1, args.steps // 4)}', 'train.eval_steps=8',
           f'train.checkpoint_every_steps={args.steps}']
  return fixed + ([f'train.time_budget_minutes={args.minutes}'] if args.minutes else [])


def attention_over_seeds(root: str, runs, names, codes) -> str:
  """Claim 3 on every finished run, not one checkpoint: per variant, the mean attention
  entropy (over layers, heads and real tokens) and the mean JS divergence between adjacent
  layers, each as the mean over seeds with (min-max). Writes attention_seeds.{json,md}."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  per_variant = {}
  for run, name in zip(runs, names):
    if codes.get(name) != 0:
      continue
    r = analysis.analyze_run(os.path.join(root, name))
    per_variant.setdefault(run['model.variant'], []).append(
        {'seed': run['seed'], 'entropy': float(np.mean(r['entropy_mean'])),
         'js_adjacent': float(np.mean(r['js_adjacent'])) if r['js_adjacent'] else None})
  lines = ['| variant | seeds | attention entropy (nats) | JS, adjacent layers |',
           '|---|---|---|---|']

  def spread(values):
    values = [v for v in values if v is not None]
    if not values:
      return '-'
    return f'{np.mean(values):.4f} ({min(values):.4f}-{max(values):.4f})'

  for variant, rows in per_variant.items():
    lines.append(f'| {variant} | {len(rows)} | {spread([r["entropy"] for r in rows])} | '
                 f'{spread([r["js_adjacent"] for r in rows])} |')
  table = '\n'.join(lines) + '\n'
  with open(os.path.join(root, 'attention_seeds.json'), 'w') as f:
    json.dump(per_variant, f, indent=1)
  with open(os.path.join(root, 'attention_seeds.md'), 'w') as f:
    f.write(table)
  return table


def curves(root: str, runs, names, out_path: str):
  """Train loss and held-out MLM accuracy against step, mean over seeds with min-max band."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  series = {}
  for run, name in zip(runs, names):
    path = os.path.join(root, name, 'metrics.jsonl')
    if not os.path.exists(path):
      continue
    with open(path) as f:
      records = [json.loads(line) for line in f]
    for split, metric in (('train', 'loss'), ('eval', 'mlm_accuracy')):
      points = {r['step']: r[metric] for r in records if r.get('split') == split and metric in r}
      series.setdefault((split, metric), {}).setdefault(run['model.variant'], []).append(points)
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
  for ax, key in zip(axes, (('train', 'loss'), ('eval', 'mlm_accuracy'))):
    for variant, per_seed in series.get(key, {}).items():
      steps = sorted(set.intersection(*(set(p) for p in per_seed)))
      if not steps:
        continue
      values = np.array([[p[s] for s in steps] for p in per_seed])
      ax.plot(steps, values.mean(0), label=variant)
      ax.fill_between(steps, values.min(0), values.max(0), alpha=0.2)
    ax.set_xlabel('step')
    ax.set_ylabel(f'{key[0]} {key[1]}')
    ax.grid(alpha=0.3)
  axes[1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out_path, dpi=110)
  plt.close(fig)


# ------------------------------------------------------------------------- stability
# Claim 1 (RealFormer): residual attention stabilises training where Post-LN is fragile. A
# deep, narrow encoder over a grid of peak learning rates (x2 apart) and warm-up (none or a
# short one), one run per cell; a cell diverged when the loss became nan/inf (train.py stops
# with an error) or the last logged loss is above the first; a loss that went half a nat
# above a random model's (ln vocabulary + ln 2) and came back is shown as a spike.

STABILITY_AXES = ('model.variant', 'optimizer.learning_rate', 'optimizer.warmup_steps')
DIVERGED = 'diverged.json'  # written into a run whose loss became nan/inf: not rerun


def stability_fixed(args):
  return [f'train.num_steps={args.steps}', f'train.batch_size={args.batch}',
          f'model.num_layers={args.layers}', f'data.max_seq_length={args.seq_len}',
          f'model.max_len={max(args.seq_len, 128)}', 'model.scan_layers=True',
          f'train.log_every_steps={args.log_every}', f'train.eval_every_steps={args.steps}',
          'train.eval_steps=4', f'train.checkpoint_every_steps={args.steps}']


def stability_cell(workdir: str) -> dict:
  """{'status': 'diverged' | 'rose' | 'ok' | 'missing', 'final', 'start', 'step'} of a run."""
  marker = os.path.join(workdir, DIVERGED)
  if os.path.exists(marker):
    with open(marker) as f:
      return dict(json.load(f), status='diverged')
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path) or not os.path.exists(os.path.join(workdir, sweep.DONE)):
    return {'status': 'missing'}
  with open(path) as f:
    losses = [(r['step'], r['loss']) for r in map(json.loads, f)
              if r.get('split') == 'train' and 'loss' in r]
  start, final = losses[0][1], losses[-1][1]
  cell = {'status': 'rose' if final > start else 'ok', 'start': start, 'final': final,
          'step': losses[-1][0], 'peak': max(loss for _, loss in losses)}
  config = os.path.join(workdir, 'config.json')
  if os.path.exists(config):  # a random model's loss: ln(vocabulary) + ln 2 (MLM + NSP)
    with open(config) as f:
      cell['chance'] = math.log(json.load(f)['model']['vocab_size']) + math.log(2)
  return cell


def mark_diverged(workdir: str) -> bool:
  """After a failed run: True (and the marker written) when its loss became nan/inf."""
  log = os.path.join(workdir, 'log.txt')
  if not os.path.exists(log):
    return False
  with open(log, errors='replace') as f:
    tail = f.read()[-4000:]
  match = re.search(r'(loss|gradient norm) became (nan|inf|-inf) at step (\d+)', tail)
  if not match:
    return False
  with open(os.path.join(workdir, DIVERGED), 'w') as f:
    json.dump({'what': match.group(1), 'value': match.group(2),
               'step': int(match.group(3))}, f)
  return True


def stability_report(cells, variants, rates, warmups, out_dir: str) -> str:
  """The table (markdown) and the figure: one panel per variant, learning rate on x."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  def show(c):
    if c['status'] == 'diverged':
      return f'NaN at {c["step"]}'
    if c['status'] == 'missing':
      return '(not run)'
    spiked = c.get('chance') and c['peak'] > c['chance'] + 0.5  # a transient: recovered
    return (f'{c["final"]:.3f}' + (' (rose)' if c['status'] == 'rose' else '') +
            (f' (spiked to {c["peak"]:.1f})' if spiked else ''))

  lines = ['| variant | warm-up steps | ' + ' | '.join(f'lr {r:g}' for r in rates) + ' |',
           '|---|---|' + '---|' * len(rates)]
  for v in variants:
    for w in warmups:
      lines.append(f'| {v} | {w} | ' + ' | '.join(show(cells[v, r, w]) for r in rates) + ' |')
  fig, axes = plt.subplots(1, len(variants), figsize=(4 * len(variants), 3.4), sharey=True)
  axes = axes if len(variants) > 1 else [axes]
  finals = [c['final'] for c in cells.values() if 'final' in c]
  top = max(finals) * 1.05 if finals else 1.0
  for ax, v in zip(axes, variants):
    for w in warmups:
      xs = [r for r in rates if 'final' in cells[v, r, w]]
      line, = ax.plot(xs, [cells[v, r, w]['final'] for r in xs], marker='o',
                      label=f'warm-up {w}')
      bad = [r for r in rates if cells[v, r, w]['status'] == 'diverged']
      ax.plot(bad, [top] * len(bad), marker='x', linestyle='none', color=line.get_color(),
              markersize=10)
    ax.set_xscale('log', base=2)
    ax.set_title(v)
    ax.set_xlabel('peak learning rate')
    ax.grid(alpha=0.3)
  axes[0].set_ylabel('final train loss (x: nan/inf)')
  axes[-1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, 'stability.png'), dpi=110)
  plt.close(fig)
  table = '\n'.join(lines) + '\n'
  with open(os.path.join(out_dir, 'stability.md'), 'w') as f:
    f.write(table)
  return table


def stability(args) -> int:
  variants = args.variants.split(',')
  rates = [float(r) for r in args.learning_rates.split(',')]
  warmups = [int(w) for w in args.warmups.split(',')]
  root = os.path.join(args.root, 'stability')
  runs = sweep.expand([f'model.variant={",".join(variants)}',
                       f'optimizer.learning_rate={args.learning_rates}',
                       f'optimizer.warmup_steps={args.warmups}'],
                      stability_fixed(args), args.seeds)
  names = sweep.run_names(runs, always=STABILITY_AXES)
  config = os.path.join(REPO, 'configs', 'pretrain.py') + f':postln,{args.size}'
  if args.print_only:
    print(sweep.launch_script(runs, root=root, program='train.py', always=STABILITY_AXES,
                              config=f'configs/pretrain.py:postln,{args.size}',
                              target=args.target), end='')
    return 0
  todo = [r for r, n in zip(runs, names)
          if not os.path.exists(os.path.join(root, n, DIVERGED))]
  codes = {} if args.report_only else sweep.run_all(
      todo, root=root, program=os.path.join(REPO, 'train.py'), config=config,
      always=STABILITY_AXES)
  failed = [n for n, c in codes.items() if c not in (0, sweep.RUNNING_ELSEWHERE) and
            not mark_diverged(os.path.join(root, n))]
  cells = {}
  for run, name in zip(runs, names):
    if run['seed'] == 0:
      cells[run['model.variant'], run['optimizer.learning_rate'],
            run['optimizer.warmup_steps']] = stability_cell(os.path.join(root, name))
  table = stability_report(cells, variants, rates, warmups, root)
  print(table)
  if args.figures:
    os.makedirs(args.figures, exist_ok=True)
    shutil.copy(os.path.join(root, 'stability.png'), args.figures)
  if failed:
    print(f'{len(failed)} runs failed for another reason than a nan/inf loss: {failed}')
  return 1 if failed else 0


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('part', nargs='?', default='compare', choices=('compare', 'stability'),
                 help='compare: the variants at one budget (default); stability: the '
                 'learning-rate x warm-up grid of a deep encoder')
  p.add_argument('--root', required=True)
  p.add_argument('--variants', default=None,
                 help=f'default {",".join(VARIANTS)} (stability: postln,preln,realformer)')
  p.add_argument('--size', default='tiny')
  p.add_argument('--seeds', type=int, default=None, help='default 2 (stability: 1)')
  p.add_argument('--steps', type=int, default=None, help='default 150 (stability: 300)')
  p.add_argument('--batch', type=int, default=16)
  p.add_argument('--layers', type=int, default=None, help='default 4 (stability: 12)')
  p.add_argument('--seq_len', type=int, default=64)
  p.add_argument('--learning_rate', type=float, default=1e-3)
  p.add_argument('--minutes', type=float, default=0.0,
                 help='compare at equal wall-clock time: each run trains this long '
                 '(train.time_budget_minutes); use its own --root')
  p.add_argument('--print_only', action='store_true')
  p.add_argument('--target', default='local', choices=('local', 'tpu', 'slurm'))
  p.add_argument('--figures', default=None, help='also copy the figures here (e.g. docs/figures)')
  stab = p.add_argument_group('stability (defaults for that part: --layers 12 --steps 300)')
  stab.add_argument('--learning_rates', default='5e-4,1e-3,2e-3,4e-3')
  stab.add_argument('--warmups', default='0,30', help='warm-up steps, e.g. none and short')
  stab.add_argument('--log_every', type=int, default=10)
  stab.add_argument('--report_only', action='store_true',
                    help='only the table and figure of the runs there are (cells not run '
                    'are marked so)')
  args = p.parse_args(argv)
  stable = args.part == 'stability'
  defaults = {'variants': 'postln,preln,realformer' if stable else ','.join(VARIANTS),
              'layers': 12 if stable else 4, 'steps': 300 if stable else 150,
              'seeds': 1 if stable else 2}
  for key, value in defaults.items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  if stable:
    return stability(args)

  config = os.path.join(REPO, 'configs', 'pretrain.py') + f':postln,{args.size}'
  program = os.path.join(REPO, 'train.py')
  runs = sweep.expand([f'model.variant={args.variants}'], budget(args), args.seeds)
  names = sweep.run_names(runs)
  if args.print_only:
    print(sweep.launch_script(runs, root=args.root, program='train.py',
                              config=f'configs/pretrain.py:postln,{args.size}',
                              target=args.target), end='')
    return 0
  codes = sweep.run_all(runs, root=args.root, program=program, config=config)
  metrics = ['eval/mlm_accuracy', 'eval/nsp_accuracy', 'eval/mlm_loss', 'train/loss']
  header, table = sweep.summarize(sweep.collect(args.root, metrics), metrics)
  with open(os.path.join(args.root, 'summary.md'), 'w') as f:
    f.write(sweep.to_markdown(header, table))
  with open(os.path.join(args.root, 'summary.csv'), 'w') as f:
    f.write(sweep.to_csv(header, table))
  curves(args.root, runs, names, os.path.join(args.root, 'learning_curves.png'))
  first = [(r['model.variant'], n) for r, n in zip(runs, names)
           if r['seed'] == 0 and codes.get(n) == 0]
  results = [analysis.analyze_run(os.path.join(args.root, n)) for _, n in first]
  attention_dir = os.path.join(args.root, 'attention')
  if results:
    analysis.write_report(results, attention_dir, [v for v, _ in first])
  print(sweep.to_markdown(header, table))
  if results:
    with open(os.path.join(attention_dir, 'attention.md')) as f:
      print(f.read())
    print(attention_over_seeds(args.root, runs, names, codes))
  if args.figures:
    os.makedirs(args.figures, exist_ok=True)
    shutil.copy(os.path.join(args.root, 'learning_curves.png'), args.figures)
    for name in ('attention_entropy.png', 'attention_js.png'):
      if os.path.exists(os.path.join(attention_dir, name)):
        shutil.copy(os.path.join(attention_dir, name), args.figures)
  return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == '__main__':
  raise SystemExit(cli.run_main(main))
