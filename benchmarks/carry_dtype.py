r"""Does RealFormer learn the same with its carried scores in bfloat16? One resumable sweep
(model.residual_dtype float32 and bfloat16 x seeds) and the comparison, seed by seed.

  python benchmarks/carry_dtype.py --root /tmp/carry          # run (or resume) the sweep
  python benchmarks/carry_dtype.py --root /tmp/carry --report # the table only

The runs: a deep, narrow RealFormer (12 scanned layers, the tiny width: hidden 128, 2 heads,
MLP 512) in bfloat16 activations, as it trains on accelerators, so that the carry sums the
scores of many layers; 1000 steps of 32 pairs of 64 tokens of the embedded speeches (the
study's corpus, written to <root>/era), AdamW at 1e-3 with 100 warm-up steps and linear
decay, BERT's dropout. Each seed trains twice, once per carry dtype: the same initial
weights, batches and dropout masks, so the two differ only by the carry's rounding. The
report sets their difference beside the spread between seeds: held-out MLM loss and
accuracy at the end, and the training loss along the way. Two processes may share a root
(the sweep's per-run locks). Results: BENCHMARKS.md ("RealFormer's carry in bfloat16").
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

CARRIES = ('float32', 'bfloat16')
SETTINGS = (
    'model.dtype=bfloat16', 'model.num_layers=12', 'model.scan_layers=True',
    'model.max_len=128', 'data.max_seq_length=64', 'data.eval_fraction=0.03',
    'train.batch_size=32', 'train.num_steps=1000', 'train.log_every_steps=50',
    'train.eval_every_steps=250', 'train.eval_steps=16', 'train.checkpoint_every_steps=1000',
    'optimizer.learning_rate=0.001', 'optimizer.warmup_steps=100')


def run_sweep(root: str, seeds: int) -> None:
  corpus = os.path.join(root, 'era', 'pretraining_corpus.txt')
  if not os.path.exists(corpus):
    from data import sotu  # pylint: disable=g-import-not-at-top
    sotu.write_era_task(os.path.join(root, 'era'))
  argv = [sys.executable, 'sweep.py', 'run', '--root', os.path.join(root, 'runs'),
          '--config', 'configs/pretrain.py:realformer,tiny',
          '--sweep', 'model.residual_dtype=' + ','.join(CARRIES), '--seeds', str(seeds)]
  for setting in SETTINGS + (f'data.sources=files:{corpus}',):
    argv += ['--set', setting]
  subprocess.run(argv, cwd=_REPO, check=True)


def _records(workdir: str):
  """metrics.jsonl's records (the lines of a step merged, a resume's stretch dropped)."""
  from realformer.train import metrics_jsonl  # pylint: disable=g-import-not-at-top
  return metrics_jsonl.records(os.path.join(workdir, 'metrics.jsonl'))


def read_runs(root: str) -> dict:
  """{(carry, seed): metrics.jsonl records} of the finished runs under <root>/runs."""
  runs = {}
  folder = os.path.join(root, 'runs')
  for name in sorted(os.listdir(folder)):
    workdir = os.path.join(folder, name)
    if not os.path.exists(os.path.join(workdir, 'DONE')):
      continue
    with open(os.path.join(workdir, 'overrides.json'), encoding='utf-8') as f:
      run = json.load(f)
    runs[(run['model.residual_dtype'], int(run['seed']))] = _records(workdir)
  return runs


def _last(records, split: str) -> dict:
  return [r for r in records if r.get('split') == split][-1]


def _curve(records) -> dict:
  return {r['step']: r['loss'] for r in records if r.get('split') == 'train' and 'loss' in r}


def _spread(values) -> float:
  return max(values) - min(values)


def report(runs: dict) -> str:
  seeds = sorted(s for c, s in runs if c == CARRIES[0] and (CARRIES[1], s) in runs)
  if not seeds:
    return 'no seed has finished both runs yet'
  lines = ['| seed | eval MLM loss, float32 / bfloat16 carry | difference | eval MLM accuracy, '
           'float32 / bfloat16 | difference | largest training-loss difference (logged '
           'means of 50 steps) |', '|---|---|---|---|---|---|']
  diffs = {'mlm_loss': [], 'mlm_accuracy': [], 'curve': []}
  for seed in seeds:
    a, b = (_last(runs[(c, seed)], 'eval') for c in CARRIES)
    ca, cb = (_curve(runs[(c, seed)]) for c in CARRIES)
    curve = max(abs(ca[s] - cb[s]) for s in ca if s in cb)
    for k in ('mlm_loss', 'mlm_accuracy'):
      diffs[k].append(b[k] - a[k])
    diffs['curve'].append(curve)
    lines.append(f'| {seed} | {a["mlm_loss"]:.4f} / {b["mlm_loss"]:.4f} | '
                 f'{b["mlm_loss"] - a["mlm_loss"]:+.4f} | {a["mlm_accuracy"]:.4f} / '
                 f'{b["mlm_accuracy"]:.4f} | {b["mlm_accuracy"] - a["mlm_accuracy"]:+.4f} | '
                 f'{curve:.4f} |')
  every = sorted(s for c, s in runs if c == CARRIES[0])  # the float32 runs, paired or not
  f32 = [_last(runs[(CARRIES[0], s)], 'eval') for s in every]
  curves = [_curve(runs[(CARRIES[0], s)]) for s in every]
  steps = sorted(set.intersection(*(set(c) for c in curves)))
  lines += ['', f'Over {len(seeds)} seeds, bfloat16 minus float32: eval MLM loss mean '
            f'{statistics.mean(diffs["mlm_loss"]):+.4f} (largest '
            f'{max(diffs["mlm_loss"], key=abs):+.4f}), accuracy mean '
            f'{statistics.mean(diffs["mlm_accuracy"]):+.4f} (largest '
            f'{max(diffs["mlm_accuracy"], key=abs):+.4f}). Between the float32 runs of '
            f'different seeds ({len(every)}): eval MLM loss spread '
            f'{_spread([r["mlm_loss"] for r in f32]):.4f}, '
            f'accuracy spread {_spread([r["mlm_accuracy"] for r in f32]):.4f}, training-loss '
            f'spread at a logged step up to '
            f'{max(_spread([c[s] for c in curves]) for s in steps):.4f}.']
  return '\n'.join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--root', required=True)
  p.add_argument('--seeds', type=int, default=3)
  p.add_argument('--report', action='store_true', help='only the table of what has finished')
  args = p.parse_args()
  if not args.report:
    run_sweep(args.root, args.seeds)
  print(report(read_runs(args.root)))


if __name__ == '__main__':
  main()
