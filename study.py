r"""The papers' comparison in one command: pretrain Post-LN, Pre-LN, RealFormer and two
Synthesizer mixtures at the same size and budget on the embedded corpus, several seeds each,
then report held-out MLM and NSP accuracy, learning curves and the attention analysis.

  python study.py --root /tmp/study --seeds 2 --steps 150 --batch 16 --seq_len 64 \
      --figures docs/figures                     # ~40 minutes on 2 busy CPU cores
  python study.py --root /tmp/study --print_only --target tpu      # launch commands instead

The budget (tiny width: 4 layers, 128 hidden, 2 heads; 150 steps of 16 sequences of 64
tokens) only fits a CPU; the numbers it gives and what they can show are in docs/study.md.
Raise --steps, --batch, --seq_len, --size for a real comparison on accelerators.

Writes <root>/summary.{md,csv} (mean, median, spread over seeds), <root>/learning_curves.png
and <root>/attention/ (entropy violins, JS heatmaps, numbers) from seed 0 of each variant.
Runs that finished are skipped; rerunning the command resumes an interrupted study.
"""

import argparse
import json
import os
import shutil

from realformer import analysis
from realformer import sweep
from realformer import cli

VARIANTS = ('postln', 'preln', 'realformer', 'synth_random_vanilla', 'synth_dense_vanilla')
REPO = os.path.dirname(os.path.abspath(__file__))


def budget(args):
  """The fixed settings every variant shares."""
  return [f'train.num_steps={args.steps}', f'train.batch_size={args.batch}',
          f'model.num_layers={args.layers}', f'data.max_seq_length={args.seq_len}',
          f'model.max_len={max(args.seq_len, 128)}',
          f'optimizer.learning_rate={args.learning_rate}',
          f'optimizer.warmup_steps={max(1, args.steps // 10)}',
          f'train.log_every_steps={max(1, args.steps // 20)}',
          f'train.eval_every_steps={max(1, args.steps // 4)}', 'train.eval_steps=8',
          f'train.checkpoint_every_steps={args.steps}']


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


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--root', required=True)
  p.add_argument('--variants', default=','.join(VARIANTS))
  p.add_argument('--size', default='tiny')
  p.add_argument('--seeds', type=int, default=2)
  p.add_argument('--steps', type=int, default=150)
  p.add_argument('--batch', type=int, default=16)
  p.add_argument('--layers', type=int, default=4)
  p.add_argument('--seq_len', type=int, default=64)
  p.add_argument('--learning_rate', type=float, default=1e-3)
  p.add_argument('--print_only', action='store_true')
  p.add_argument('--target', default='local', choices=('local', 'tpu', 'slurm'))
  p.add_argument('--figures', default=None, help='also copy the figures here (e.g. docs/figures)')
  args = p.parse_args(argv)

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
  if args.figures:
    os.makedirs(args.figures, exist_ok=True)
    shutil.copy(os.path.join(args.root, 'learning_curves.png'), args.figures)
    for name in ('attention_entropy.png', 'attention_js.png'):
      if os.path.exists(os.path.join(attention_dir, name)):
        shutil.copy(os.path.join(attention_dir, name), args.figures)
  return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == '__main__':
  raise SystemExit(cli.run_main(main))
