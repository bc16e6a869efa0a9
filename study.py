r"""The papers' claims, tested in one resumable command per part on the embedded speeches:

  python study.py budget   --root R   # claim 2's budget: the cheapest (layers, length, steps)
                                      # whose held-out MLM accuracy is 2x the majority baseline
  python study.py compare  --root R   # claims 2 and 3: five variants x 3 seeds at that budget
  python study.py compare  --root R --minutes auto   # claim 2 at equal wall-clock time
  python study.py finetune --root R   # claim 4: the pretrained encoders vs random init
  python study.py stability --root R  # claim 1: a 12-layer encoder over peak lr x warm-up

Each part is a sweep (realformer/tools/sweep.py): one train.py / finetune.py run per workdir under
R/<part>/, finished runs skipped, interrupted ones resumed, so rerunning a command resumes it
and two processes can share a part (per-run locks). The budget and compare parts pretrain on
the speeches less the 47 that the fine-tuning task of part 4 holds out (R/era/, written by
data/sotu.py), so the fine-tuning dev sentences are never seen in pretraining. compare reads
the budget from R/budget.json (explicit --steps/--layers/--seq_len/--batch/--learning_rate
win). `--print_only --target tpu|slurm` prints the launch commands instead of running.

Writes, per part: summary.{md,csv} (mean, median, spread over seeds), claims.md (the tables
of docs/study.md, each number from a run's metrics.jsonl), learning_curves.png,
attention/ (seed 0) and attention_seeds.md (every seed), finetune.md, stability.{md,png};
--figures DIR copies the figures. R may be a gs:// URL (storage.py: the runs, their records
and every report live in the bucket). docs/study.md has the budget of the whole study (about
2.5 hours of 2 CPU cores, part by part) and the results.
"""

import collections
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import types

from absl import flags

from data import pretraining as objectives
from realformer import cli
from realformer import storage
from realformer.tools import analysis
from realformer.tools import finetune_grid
from realformer.tools import sweep
from realformer.train import metrics_jsonl
from realformer.train.run_dir import RunDir

VARIANTS = ('postln', 'preln', 'realformer', 'synth_random_vanilla', 'synth_dense_vanilla')
REPO = os.path.dirname(os.path.abspath(__file__))
BUDGET_FILE = 'budget.json'
# compare's settings when neither a flag nor R/budget.json gives them.
COMPARE_DEFAULTS = {'steps': 150, 'layers': 4, 'seq_len': 64, 'batch': 32,
                    'learning_rate': 2e-3}
# The papers' orderings (claim 2), each tested as "first above second".
CLAIMED_ORDER = (('realformer', 'postln'), ('postln', 'preln'), ('realformer', 'preln'))


def _open(path, mode: str = 'r', **kw):
  """A file of the study's root (a folder or a gs:// URL: storage.py) opened as open() would."""
  return storage.path(path).open(mode, **kw)


def _copy(src, dest: str) -> None:
  """Copies the file or object `src` to the local file `dest` (into it, if a folder)."""
  if os.path.isdir(dest):
    dest = os.path.join(dest, storage.path(src).name)
  data = storage.path(src).read_bytes()
  with open(dest, 'wb') as f:
    f.write(data)


def corpus_settings(args) -> list:
  """data.sources for the pretraining parts: the speeches less the fine-tuning task's held-out
  ones (R/era/pretraining_corpus.txt, written once), or the whole embedded corpus."""
  if args.corpus == 'embedded':
    return ['data.sources=embedded']
  era = (storage.join(args.root, 'era') if args.print_only or args.report_only else
         era_task(args.root))
  return [f'data.sources=files:{storage.join(era, "pretraining_corpus.txt")}']


def print_era_note(args):
  """--print_only: the launches read R/era, which the printing machine does not write."""
  if args.corpus == 'era' or args.part == 'finetune':
    if storage.is_url(args.root):
      print(f'# first, where the runs can read it: python -c "import study; '
            f'study.era_task({args.root!r})"')
    else:
      print(f'# first, where the runs can read it: python -c "from data import sotu; '
            f'sotu.write_era_task({storage.join(args.root, "era")!r})"')


def era_task(root: str) -> str:
  """R/era: the fine-tuning task (SST-2 layout) and its pretraining corpus, written once (to a
  temporary folder renamed into place, so a second study process never reads half of it)."""
  from data import sotu  # pylint: disable=g-import-not-at-top
  out = storage.join(root, 'era')
  storage.check_location(out, '--root')  # written to a folder renamed into place
  if not storage.path(storage.join(out, 'pretraining_corpus.txt')).exists():
    if storage.is_url(out):  # uploaded, the corpus (which the check above reads) last
      tmp = tempfile.mkdtemp(prefix='realformer-era-')
      try:
        sotu.write_era_task(tmp)
        corpus = os.path.join(tmp, 'pretraining_corpus.txt')
        with open(corpus, 'rb') as f:
          text = f.read()
        os.unlink(corpus)
        storage.copy_tree(tmp, out)
        storage.path(storage.join(out, 'pretraining_corpus.txt')).write_bytes(text)
      finally:
        shutil.rmtree(tmp, ignore_errors=True)
      return out
    os.makedirs(root, exist_ok=True)
    tmp = f'{out}.tmp-{os.getpid()}'
    sotu.write_era_task(tmp)
    try:
      os.rename(tmp, out)
    except OSError:  # another process was first: its copy is the same
      shutil.rmtree(tmp, ignore_errors=True)
  return out


def fixed_settings(args) -> list:
  """The settings every variant shares. With --minutes, the equal wall-clock view: every run
  trains that long (train.time_budget_minutes; --steps x 3 is then only an upper bound and the
  warm-up a tenth of the time), so a slower variant gets fewer steps."""
  steps = args.steps * 3 if args.minutes else args.steps
  fixed = objective_settings(args) + [f'train.num_steps={steps}', f'train.batch_size={args.batch}',
           f'model.num_layers={args.layers}', f'data.max_seq_length={args.seq_len}',
           f'model.max_len={max(args.seq_len, 128)}',
           f'optimizer.learning_rate={args.learning_rate}',
           f'optimizer.warmup_steps={-1 if args.minutes else max(1, args.steps // 10)}',
           f'train.log_every_steps={max(1, args.steps // 20)}',
           f'train.eval_every_steps={max(1, args.steps // 4)}',
           f'train.eval_steps={args.eval_steps}', f'data.eval_fraction={args.eval_fraction}',
           f'train.checkpoint_every_steps={args.steps}'] + corpus_settings(args)
  return fixed + ([f'train.time_budget_minutes={args.minutes}'] if args.minutes else [])


# What a report is made from, copied by --record into a folder that can be kept with the
# docs (each run's metrics and settings, each part's tables and figures; never checkpoints,
# prepared data or predictions, which can be regenerated and are large).
RECORD_RUN_FILES = (RunDir.METRICS, RunDir.CONFIG, RunDir.RESULTS, RunDir.TIME_SPENT,
                    RunDir.DIVERGED, RunDir.OVERRIDES, RunDir.MACHINE, RunDir.DONE)
RECORD_SUFFIXES = ('.md', '.csv', '.json', '.png')
RECORD_SKIP_DIRS = (RunDir.CHECKPOINTS, RunDir.DATA, RunDir.PREDICTIONS, RunDir.BEST,
                    RunDir.FINAL, 'era')


def record(args, part_root: str) -> None:
  """--record DIR: DIR/<part>/... mirrors part_root with only the files the reports read (and
  R/budget.json), so every number of docs/study.md stays traceable after the runs' root is
  gone. Rerunning overwrites the copies; files of runs no longer there are kept; a record
  that holds a run of the same name with other settings (another study) is refused."""
  if not args.record:
    return
  dest_root = os.path.join(args.record, os.path.relpath(part_root, args.root))
  for dirpath, dirnames, filenames in storage.walk(part_root):  # never two studies in one
    dirnames[:] = [d for d in dirnames if d not in RECORD_SKIP_DIRS]
    dest = os.path.join(dest_root, os.path.relpath(dirpath, part_root))
    if RunDir.OVERRIDES in filenames and os.path.exists(os.path.join(dest, RunDir.OVERRIDES)):
      differ = sweep.other_run(dest, _overrides(dirpath))
      if differ:
        raise ValueError(f'--record {args.record}: {dest} holds a run of other settings '
                         f'({"; ".join(differ)}), which this record would replace beside the '
                         'rest of that study; record into another folder, or delete that one')
  copied = 0
  for dirpath, dirnames, filenames in storage.walk(part_root):
    dirnames[:] = sorted(d for d in dirnames if d not in RECORD_SKIP_DIRS)
    is_run = RunDir.OVERRIDES in filenames or RunDir.RESULTS in filenames
    dest = os.path.join(dest_root, os.path.relpath(dirpath, part_root))
    for name in filenames:
      if name in RECORD_RUN_FILES if is_run else name.endswith(RECORD_SUFFIXES):
        os.makedirs(dest, exist_ok=True)
        _copy(storage.join(dirpath, name), dest)
        copied += 1
    if is_run and RunDir.DONE not in filenames and sweep.is_done(dirpath, _overrides(dirpath)):
      # judged finished by its checkpoint, which the record leaves out: the marker says so
      os.makedirs(dest, exist_ok=True)
      with open(os.path.join(dest, RunDir.DONE), 'w'):
        pass
  if storage.path(storage.join(args.root, BUDGET_FILE)).exists():
    _copy(storage.join(args.root, BUDGET_FILE), args.record)
  print(f'recorded {copied} files of {part_root} under {dest_root}')


def _overrides(workdir: str) -> dict:
  path = storage.join(workdir, RunDir.OVERRIDES)
  if not storage.path(path).exists():
    return {}
  with _open(path) as f:
    return json.load(f)


def held_out(workdir: str) -> dict:
  """The final evaluation of a pretraining run, with the majority baseline and their ratio."""
  final = sweep.final_metrics(workdir)
  if 'eval/mlm_accuracy' not in final:
    return {}
  out = {k.split('/', 1)[1]: v for k, v in final.items()}
  base = out.get('mlm_majority_accuracy')
  out['ratio'] = out['mlm_accuracy'] / base if base else None
  return out


def folders(root: str, runs, always=()) -> list:
  """Each run's folder under root, as sweep.run_all finds it (a folder an earlier, narrower
  sweep made for the same run is that run's)."""
  return sweep.folder_names(root, runs, always)


def pretraining_config(args) -> str:
  """The config file of the study's pretraining runs (its variants by override)."""
  return os.path.join(REPO, 'configs', 'pretrain.py') + f':postln,{args.size}'


FINETUNE_CONFIG = os.path.join(REPO, 'configs', 'finetune.py') + ':glue/sst2'


def finished(workdir: str, run=None, config: str = '') -> bool:
  """The run in `workdir` finished, and it is `run` (not one of other settings that the
  folder holds: an earlier study at another budget, or, given the `config` it runs with, of
  another model size, whose numbers are not this one's)."""
  return (not (run and sweep.other_run(workdir, run, command_of(config))) and
          sweep.is_done(workdir, run))


def command_of(config: str):
  """What a run of the study's `config` records in command.json (None without a config)."""
  program = 'finetune.py' if 'finetune.py' in config else 'train.py'
  return sweep.program_and_config(program, config) if config else None


def spread(values, digits: int = 4) -> str:
  """'mean (min-max)' of the values that exist, '-' if none."""
  values = [v for v in values if v is not None]
  if not values:
    return '-'
  if f'{min(values):.{digits}f}' == f'{max(values):.{digits}f}':  # (as printed)
    return f'{statistics.mean(values):.{digits}f}'
  return (f'{statistics.mean(values):.{digits}f} '
          f'({min(values):.{digits}f}-{max(values):.{digits}f})')


# The fewest paired seeds that decide an ordering: with n a side, a named side above the
# other on all of them happens by chance once in C(2n, n) (3 seeds: one in 20; 2: one in 6;
# 1: one in 2).
MIN_PAIRED_SEEDS = 3


def ordering(per_variant: dict, first: str, second: str, lower: bool = False) -> str:
  """Whether `first` is above (lower: below) `second` beyond the spread over the seeds both
  ran (same seed: same held-out batches and data): held when every such seed of `first` is
  beyond every such seed of `second`, reversed when the other way round, else undecided
  (also with fewer than MIN_PAIRED_SEEDS of them); with the paired count."""
  a, b = per_variant.get(first, {}), per_variant.get(second, {})
  if not a or not b:
    return 'not run'
  sign = -1 if lower else 1
  seeds = sorted(set(a) & set(b))  # (a seed one side lacks is no evidence either way)
  if not seeds:
    return f'undecided (no seed run by both {first} and {second})'
  wins = sum(sign * (a[s] - b[s]) > 0 for s in seeds)
  sa, sb = [sign * a[s] for s in seeds], [sign * b[s] for s in seeds]
  verdict = 'held' if min(sa) > max(sb) else 'reversed' if max(sa) < min(sb) else 'undecided'
  few = len(seeds) < MIN_PAIRED_SEEDS
  return (f'{"undecided" if few else verdict} ({first} {"below" if lower else "ahead"} on '
          f'{wins} of {len(seeds)} paired seeds'
          f'{f"; a verdict needs {MIN_PAIRED_SEEDS}" if few else ""})')


def attention_over_seeds(root: str, runs, names, codes) -> str:
  """Claim 3 on every finished run, not one checkpoint: per variant, the attention entropy
  (nats; mean over layers, heads and real query positions, and in the last layer, where the
  paper sees the largest gap) and the JS divergence between layers (mean over adjacent pairs
  and over all pairs), each as the mean over seeds (min-max), and the claimed orderings
  (RealFormer lower) beyond that spread. Writes attention_seeds.{json,md}."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  per_variant = {}
  for run, name in zip(runs, names):
    if codes.get(name) != 0:
      continue
    r = analysis.analyze_run(storage.join(root, name))
    pairs = np.asarray(r.get('js_all_pairs', [[0.0]]))
    upper = pairs[np.triu_indices(len(pairs), 1)]
    per_variant.setdefault(run['model.variant'], {})[run['seed']] = {
        'entropy': float(np.mean(r['entropy_mean'])), 'entropy_last': r['entropy_mean'][-1],
        'js_adjacent': float(np.mean(r['js_adjacent'])) if r['js_adjacent'] else None,
        'js_all_pairs': float(upper.mean()) if upper.size else None}
  keys = ('entropy', 'entropy_last', 'js_adjacent', 'js_all_pairs')
  lines = ['| variant | seeds | attention entropy (nats) | entropy, last layer | '
           'JS, adjacent layers | JS, all layer pairs |', '|---|---|---|---|---|---|']
  for variant, seeds in per_variant.items():
    lines.append(f'| {variant} | {len(seeds)} | ' +
                 ' | '.join(spread([v[k] for v in seeds.values()]) for k in keys) + ' |')
  lines += ['', 'Claimed (RealFormer lower; held: every seed below every seed of the other):',
            '']
  for key, label in zip(keys, ('entropy', 'last-layer entropy', 'adjacent-layer JS',
                               'JS over all layer pairs')):
    values = {v: {s: m[key] for s, m in seeds.items() if m[key] is not None}
              for v, seeds in per_variant.items()}
    lines += [f'- {label}: realformer < {other}: '
              f'{ordering(values, "realformer", other, lower=True)}'
              for other in ('postln', 'preln')]
  table = '\n'.join(lines) + '\n'
  with _open(storage.join(root, 'attention_seeds.json'), 'w') as f:
    json.dump(per_variant, f, indent=1)
  with _open(storage.join(root, 'attention_seeds.md'), 'w') as f:
    f.write(table)
  return table


def curves(root: str, runs, names, out_path: str, config: str = ''):
  """Train loss and held-out MLM accuracy against step, mean over the finished seeds with a
  min-max band."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  series, baselines = {}, []
  for run, name in zip(runs, names):
    path = storage.join(root, name, RunDir.METRICS)
    if not storage.path(path).exists() or not finished(storage.join(root, name), run, config):
      continue  # (an unfinished run would cut the mean short and end in a false final dot)
    records = list(metrics_jsonl.read_jsonl(path, 'train').values()) + list(
        metrics_jsonl.read_jsonl(path, 'eval').values())  # (skips a line cut short by a kill)
    baselines += [r['mlm_majority_accuracy'] for r in records
                  if r.get('split') == 'eval' and 'mlm_majority_accuracy' in r][-1:]
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
      line, = ax.plot(steps, values.mean(0), label=variant)
      ax.fill_between(steps, values.min(0), values.max(0), alpha=0.2)
      ends = [max(p) for p in per_seed]
      if any(end != steps[-1] for end in ends):  # the seeds stopped at different steps (equal
        ax.plot(ends, [p[end] for p, end in zip(per_seed, ends)], linestyle='none',  # time):
                marker='o', markersize=4, color=line.get_color())  # each seed's last value
    ax.set_xlabel('step')
    ax.set_ylabel(f'{key[0]} {key[1]}')
    ax.grid(alpha=0.3)
  if baselines:  # the majority predictor on the held-out batches, and the budget's target
    for factor, style in ((1, ':'), (2, '--')):
      axes[1].axhline(factor * float(np.mean(baselines)), color='gray', linestyle=style,
                      label=f'{factor}x majority baseline' if factor > 1 else
                      'majority baseline')
  if axes[1].get_legend_handles_labels()[0]:  # (no finished run yet: nothing to name)
    axes[1].legend(fontsize=8)
  fig.tight_layout()
  analysis.save_png(fig, storage.path(out_path))
  plt.close(fig)


# ------------------------------------------------------------------------- stability
# Claim 1 (RealFormer): residual attention stabilises training where Post-LN is fragile. A
# deep, narrow encoder over a grid of peak learning rates (x2 apart) and warm-up (none or a
# short one), one run per cell; a cell diverged when the loss became nan/inf (train.py stops
# with an error) or the last logged loss is above the first; a loss that went half a nat
# above a random model's (ln vocabulary + ln 2) and came back is shown as a spike.

STABILITY_AXES = ('model.variant', 'optimizer.learning_rate', 'optimizer.warmup_steps')
# The default grid, one command: peak rates from 5e-4 (5x BERT's) to 0.128, x2 apart, each
# without warm-up; with the short warm-up too up to --warmup_max_lr (4e-3), the rates where
# warm-up is the usual practice (the large ones are where Post-LN breaks first without it):
# 3 variants x (9 + 4) = 39 runs.
STABILITY_RATES = '5e-4,1e-3,2e-3,4e-3,8e-3,1.6e-2,3.2e-2,6.4e-2,1.28e-1'


def objective_settings(args) -> list:
  """config.objective where it is not BERT's (a study of RoBERTa's: --objective mlm); left
  out for BERT's, so that the runs of studies made before the flag are the same runs."""
  objective = getattr(args, 'objective', 'mlm_nsp')
  return [] if objective == 'mlm_nsp' else [f'objective={objective}']


def stability_fixed(args):
  return objective_settings(args) + [
      f'train.num_steps={args.steps}', f'train.batch_size={args.batch}',
      f'model.num_layers={args.layers}', f'data.max_seq_length={args.seq_len}',
      f'model.max_len={max(args.seq_len, 128)}', 'model.scan_layers=True',
      f'train.log_every_steps={args.log_every}', f'train.eval_every_steps={args.steps}',
      'train.eval_steps=4', f'train.checkpoint_every_steps={args.steps}']


def stability_cell(workdir: str, run=None, config: str = '') -> dict:
  """{'status': 'diverged' | 'rose' | 'ok' | 'missing', 'final', 'start', 'step'} of a run
  (finished as sweep.is_done judges it: its DONE marker, or its checkpoint at its last step
  or at its spent time budget, e.g. a run whose sweep process was killed as it finished)."""
  marker = storage.join(workdir, RunDir.DIVERGED)
  if sweep.is_diverged(workdir, run, command_of(config)):
    with _open(marker) as f:
      return dict(json.load(f), status='diverged')
  path = storage.join(workdir, RunDir.METRICS)
  if not storage.path(path).exists() or not finished(workdir, run, config):
    return {'status': 'missing'}
  losses = [(step, r['loss']) for step, r in sorted(metrics_jsonl.read_jsonl(path).items())
            if 'loss' in r]
  cell = {'final': losses[-1][1], 'step': losses[-1][0],
          'peak': max(loss for _, loss in losses)}
  # The start: the first logged loss (a mean over the first log_every steps, which may hold an
  # early spike), or a random model's loss, ln(vocabulary) (+ ln 2 with NSP), if lower.
  cell['start'] = losses[0][1]
  config = storage.join(workdir, RunDir.CONFIG)
  if storage.path(config).exists():
    with _open(config) as f:
      stored = json.load(f)
    nsp = objectives.objective(stored.get('objective', 'mlm_nsp')).next_sentence
    cell['chance'] = math.log(stored['model']['vocab_size']) + nsp * math.log(2)
    cell['start'] = min(cell['start'], cell['chance'])
  cell['status'] = 'rose' if cell['final'] > cell['start'] else 'ok'
  return cell


def stability_report(cells, variants, rates, warmups, out_dir: str, seeds=(0,),
                     settings: str = '') -> str:
  """The table (markdown; a row per seed where there are several), under a line of the
  runs' `settings` and what a cell says, and the figure of the first seed: one panel per
  variant, learning rate on x, a random model's loss drawn. cells: by (variant, rate,
  warm-up, seed)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  def show(c):
    if c['status'] == 'diverged':
      return f'NaN at {c["step"]}'
    if c['status'] == 'missing':
      return '(not run)'
    if c['status'] == 'not in the grid':
      return '-'
    spiked = c.get('chance') and c['peak'] > c['chance'] + 0.5  # a transient: recovered
    return (f'{c["final"]:.3f}' + (' (rose)' if c['status'] == 'rose' else '') +
            (f' (spiked to {c["peak"]:.1f})' if spiked else ''))

  several = len(seeds) > 1
  lines = [(f'{settings}; ' if settings else '') + 'each cell the last logged train loss: '
           '"(rose)" above its start, "(spiked to x)" a loss past a random model\'s + 0.5 '
           'that recovered, "NaN at k" the step it diverged.', '',
           '| variant | warm-up steps | ' + ('seed | ' if several else '') +
           ' | '.join(f'lr {r:g}' for r in rates) + ' |',
           '|---|---|' + ('---|' if several else '') + '---|' * len(rates)]
  for v in variants:
    for w in warmups:
      for seed in seeds:
        lines.append(f'| {v} | {w} | ' + (f'{seed} | ' if several else '') +
                     ' | '.join(show(cells[v, r, w, seed]) for r in rates) + ' |')
  first = seeds[0]
  cells = {(v, r, w): cell for (v, r, w, seed), cell in list(cells.items()) if seed == first}
  cells = collections.defaultdict(lambda: {'status': 'not in the grid'}, cells)
  fig, axes = plt.subplots(1, len(variants), figsize=(4 * len(variants), 3.4), sharey=True)
  axes = axes if len(variants) > 1 else [axes]
  finals = [c['final'] for c in cells.values() if 'final' in c]
  top = max(finals) * 1.05 if finals else 1.0
  chance = next((c['chance'] for c in cells.values() if c.get('chance')), None)
  for ax, v in zip(axes, variants):
    for w in warmups:
      xs = [r for r in rates if 'final' in cells[v, r, w]]
      line, = ax.plot(xs, [cells[v, r, w]['final'] for r in xs], marker='o',
                      label=f'warm-up {w}')
      bad = [r for r in rates if cells[v, r, w]['status'] == 'diverged']
      ax.plot(bad, [top] * len(bad), marker='x', linestyle='none', color=line.get_color(),
              markersize=10)
    if chance is not None:
      ax.axhline(chance, color='grey', linestyle=':', linewidth=1, label='a random model')
    ax.set_xscale('log', base=2)
    ax.set_xticks(rates, [f'{r:g}' for r in rates], rotation=45, fontsize=7)
    ax.minorticks_off()
    ax.set_title(f'{v} (seed {first})' if several else v)
    ax.set_xlabel('peak learning rate')
    ax.grid(alpha=0.3)
  axes[0].set_ylabel('final train loss (x: nan/inf)')
  axes[-1].legend(fontsize=8)
  fig.tight_layout()
  analysis.save_png(fig, storage.path(storage.join(out_dir, 'stability.png')))
  plt.close(fig)
  table = '\n'.join(lines) + '\n'
  with _open(storage.join(out_dir, 'stability.md'), 'w') as f:
    f.write(table)
  return table


def stability(args) -> int:
  variants = args.variants.split(',')
  rates = [float(r) for r in args.learning_rates.split(',')]
  warmups = [int(w) for w in args.warmups.split(',')]
  root = storage.join(args.root, 'stability')
  runs = [r for r in sweep.expand([f'model.variant={",".join(variants)}',
                                    f'optimizer.learning_rate={args.learning_rates}',
                                    f'optimizer.warmup_steps={args.warmups}'],
                                   stability_fixed(args), args.seeds)
          if not r['optimizer.warmup_steps'] or
          r['optimizer.learning_rate'] <= args.warmup_max_lr * (1 + 1e-9)]
  names = folders(root, runs, STABILITY_AXES)
  config = pretraining_config(args)
  if args.print_only:
    print(sweep.launch_script(runs, root=root, program='train.py', always=STABILITY_AXES,
                              config=f'configs/pretrain.py:postln,{args.size}',
                              target=args.target), end='')
    return 0
  if args.report_only and not any(storage.path(storage.join(root, n)).is_dir() for n in names):
    raise ValueError(f'no run of this grid under {root}; run study.py stability without '
                     '--report_only first (with the same options)')
  gone = sweep.diverged(root, runs, STABILITY_AXES, command_of(config))
  codes = {} if args.report_only else sweep.run_all(
      [r for r, g in zip(runs, gone) if not g], root=root,
      program=os.path.join(REPO, 'train.py'), config=config, always=STABILITY_AXES)
  failed, _ = sweep.failed_or_diverged(root, codes)
  cells = collections.defaultdict(lambda: {'status': 'not in the grid'})
  for run, name in zip(runs, names):
    cells[run['model.variant'], run['optimizer.learning_rate'], run['optimizer.warmup_steps'],
          run['seed']] = stability_cell(storage.join(root, name), run, config)
  table = stability_report(
      cells, variants, rates, warmups, root, seeds=sorted({run['seed'] for run in runs}),
      settings=(f'{args.steps} steps of {args.batch} sequences of {args.seq_len} tokens, '
                f'{args.layers} layers of the {args.size} size, objective {args.objective}'))
  print(table)
  if args.figures:
    os.makedirs(args.figures, exist_ok=True)
    _copy(storage.join(root, 'stability.png'), args.figures)
  record(args, root)
  if failed:
    print(f'{len(failed)} runs failed for another reason than a nan/inf loss: {failed}')
  return 1 if failed else 0


# ---------------------------------------------------------------------------- budget
# Claim 2 needs models past the unigram plateau, where every variant sits after a few hundred
# steps. The search trains the reference variant (seed 0) at candidate budgets, cheapest
# first (layers x length x steps), and stops at the first whose final held-out MLM accuracy
# is at least --target_ratio times the majority baseline on the same held-out batches
# (train.py's eval/mlm_majority_accuracy: always predicting the most frequent masked token).

BUDGET_AXES = ('model.num_layers', 'data.max_seq_length', 'train.num_steps')
# What else a budget was found with, recorded in R/budget.json: compare refuses other values.
BUDGET_CONTEXT = ('corpus', 'size', 'eval_steps', 'eval_fraction', 'objective')


def _ints(text: str, flag: str) -> list:
  """Comma-separated positive whole numbers, or a one-line error naming --flag."""
  try:
    values = [int(v) for v in text.split(',')]
    if min(values) < 1:
      raise ValueError
    return values
  except ValueError:
    raise ValueError(f'--{flag}={text}: give comma-separated positive whole numbers') from None


def budget_order(candidate) -> tuple:
  """Sort key of a (layers, seq_len, steps) budget: its cost, then fewer steps."""
  layers, seq_len, steps = candidate
  return layers * seq_len * steps, steps


def budget_candidates(args) -> list:
  """(layers, seq_len, steps), cheapest first."""
  grid = [(l, t, n) for l in _ints(args.budget_layers, 'budget_layers')
          for t in _ints(args.budget_seq_lens, 'budget_seq_lens')
          for n in _ints(args.budget_steps, 'budget_steps')]
  return sorted(grid, key=budget_order)


def budget_table(root: str, found) -> str:
  """Every finished budget run under root (this search's and earlier ones), cheapest first."""
  rows = []
  for name in sorted(p.name for p in storage.path(root).iterdir()):
    workdir = storage.join(root, name)
    if not (storage.path(storage.join(workdir, RunDir.OVERRIDES)).exists() and
            sweep.is_done(workdir)):
      continue
    with _open(storage.join(workdir, RunDir.OVERRIDES)) as f:
      run = json.load(f)
    r = held_out(workdir)
    if r:
      rows.append(([run[k] for k in BUDGET_AXES], run['model.variant'], r, workdir))
  lines = ['| layers | length | steps | variant | held-out MLM accuracy | majority baseline | '
           'ratio |', '|---|---|---|---|---|---|---|']
  for (layers, seq_len, steps), variant, r, workdir in sorted(
      rows, key=lambda row: budget_order(row[0])):
    mark = ' **chosen**' if found and workdir == found['run'] else ''
    lines.append(f'| {layers} | {seq_len} | {steps} | {variant} | {r["mlm_accuracy"]:.4f} | '
                 f'{r["mlm_majority_accuracy"]:.4f} | {r["ratio"]:.2f}{mark} |')
  return '\n'.join(lines) + '\n'


def budget_search(args) -> int:
  root = storage.join(args.root, 'budget')
  config = pretraining_config(args)
  found, scripts = None, []
  for layers, seq_len, steps in budget_candidates(args):
    cand = types.SimpleNamespace(**dict(vars(args), layers=layers, seq_len=seq_len,
                                        steps=steps, minutes=0))
    runs = sweep.expand([f'model.variant={args.reference}'], fixed_settings(cand), 1)
    if args.print_only:
      scripts.append(sweep.launch_script(runs, root=root, program='train.py',
                                         config=f'configs/pretrain.py:postln,{args.size}',
                                         target=args.target, always=BUDGET_AXES))
      continue
    name = folders(root, runs, BUDGET_AXES)[0]
    codes = sweep.run_all(runs, root=root, program=os.path.join(REPO, 'train.py'),
                          config=config, always=BUDGET_AXES)
    if codes[name] != 0:  # failed, or another study process holds it: the order matters
      _, gone = sweep.failed_or_diverged(root, {name: codes[name]})
      print(f'the budget run {root}/{name} ' + (
          'holds a run with other settings (run_all said which); give the study its own '
          '--root' if codes[name] == sweep.OTHER_RUN else
          'is being run by another study process; run the same command once it is done'
          if codes[name] == sweep.RUNNING_ELSEWHERE else
          f'diverged (its loss became nan/inf; see its log.txt), which running it again '
          f'repeats: search with a lower --learning_rate (it was {args.learning_rate}) and '
          'another --root' if gone else
          f'did not finish here (exit {codes[name]}); see its log.txt, then run the same '
          'command again to resume'))
      return 1
    result = dict(held_out(storage.join(root, name)), layers=layers, seq_len=seq_len,
                  steps=steps, run=storage.join(root, name))
    if result.get('ratio') and result['ratio'] >= args.target_ratio:
      found = result
      break
  if args.print_only:
    print('# candidates, cheapest first: the budget is the first whose final eval/'
          f'mlm_accuracy is {args.target_ratio}x eval/mlm_majority_accuracy')
    print_era_note(args)
    print(''.join(scripts), end='')
    return 0
  table = budget_table(root, found)
  with _open(storage.join(root, 'budget.md'), 'w') as f:
    f.write(table)
  print(table)
  if found is None:
    record(args, root)
    print(f'no candidate reached {args.target_ratio}x the majority baseline: add larger '
          '--budget_steps (or --budget_layers, --budget_seq_lens)')
    return 1
  chosen = {'layers': found['layers'], 'seq_len': found['seq_len'], 'steps': found['steps'],
            'batch': args.batch, 'learning_rate': args.learning_rate,
            **{key: getattr(args, key, 'mlm_nsp') for key in BUDGET_CONTEXT},
            'reference': args.reference, 'target_ratio': args.target_ratio,
            'evidence': {k: found[k] for k in ('run', 'mlm_accuracy', 'mlm_majority_accuracy',
                                                'ratio')}}
  with _open(storage.join(args.root, BUDGET_FILE), 'w') as f:
    json.dump(chosen, f, indent=1)
  record(args, root)
  print(f'budget: {found["layers"]} layers, length {found["seq_len"]}, {found["steps"]} steps '
        f'(written to {storage.join(args.root, BUDGET_FILE)}; compare reads it)')
  return 0


# --------------------------------------------------------------------------- compare

def resolve_budget(args) -> dict:
  """Fills compare's unset settings from R/budget.json, else COMPARE_DEFAULTS."""
  path = storage.join(args.root, BUDGET_FILE)
  found = {}
  if storage.path(path).exists():
    with _open(path) as f:
      found = json.load(f)
  unset = [key for key in COMPARE_DEFAULTS if getattr(args, key) is None]
  if unset and not found:
    print(f'no {BUDGET_FILE} in {args.root} (study.py budget writes it there): '
          + ', '.join(f'--{key} {COMPARE_DEFAULTS[key]}' for key in unset) + ' by default',
          file=sys.stderr)  # (stdout may be a printed launch script)
  for key in unset:
    setattr(args, key, found.get(key, COMPARE_DEFAULTS[key]))
  # The budget holds for the data and model it was searched on (older records lack some).
  given = lambda key: getattr(args, key, 'mlm_nsp')
  if found:  # a budget recorded before --objective was searched under BERT's
    found.setdefault('objective', 'mlm_nsp')
  differ = [f'--{key} {found[key]} (given {given(key)})' for key in BUDGET_CONTEXT
            if key in found and found[key] != given(key)]
  if differ:
    raise ValueError(f'{path} was searched with {", ".join(differ)}: its budget says nothing '
                     'of these settings; give those, or search again (study.py budget) with '
                     'a --root of their own')
  return found


def compare_runs(args, minutes: float = 0.0):
  """(runs, names, root) of the variants x seeds at the budget (equal time: its own root)."""
  view = types.SimpleNamespace(**dict(vars(args), minutes=minutes))
  runs = sweep.expand([f'model.variant={args.variants}'], fixed_settings(view), args.seeds)
  root = storage.join(args.root, 'equal_time' if minutes else 'compare')
  return runs, folders(root, runs), root


def training_seconds(workdir: str, steps: int) -> float:
  """Training time of a finished run at its steady rate: steps / the median logged steps/s
  (the first window, which compiles, left out)."""
  records = metrics_jsonl.read_jsonl(storage.join(workdir, RunDir.METRICS))
  rates = [r['steps_per_sec'] for _, r in sorted(records.items()) if 'steps_per_sec' in r]
  return steps / statistics.median(rates[1:] or rates)


def equal_minutes(args) -> float:
  """--minutes auto: the reference variant's median training time in the steps view."""
  runs, names, root = compare_runs(args)
  seconds = [training_seconds(storage.join(root, n), args.steps) for r, n in zip(runs, names)
             if r['model.variant'] == args.reference and
             finished(storage.join(root, n), r, pretraining_config(args))]
  if not seconds:
    raise ValueError(f'--minutes auto takes the time of {args.reference} in {root}: run '
                     '`study.py compare` (the steps view) first, or give --minutes M')
  return round(statistics.median(seconds) / 60, 2)


def claims_report(args, runs, names, root, minutes: float) -> str:
  """Claim 2's table and orderings (markdown), from each run's final evaluation."""
  per_variant, rows = {}, {}
  for run, name in zip(runs, names):
    workdir = storage.join(root, name)
    r = held_out(workdir) if finished(workdir, run, pretraining_config(args)) else {}
    if r:
      per_variant.setdefault(run['model.variant'], {})[run['seed']] = r['mlm_accuracy']
      rows.setdefault(run['model.variant'], []).append(dict(
          r, steps=sweep.last_step(workdir),
          steps_per_sec=args.steps / training_seconds(workdir, args.steps)))
  view = (f'equal wall-clock time: {minutes} minutes of training per run' if minutes else
          f'equal steps: {args.steps} steps per run')
  objective = getattr(args, 'objective', 'mlm_nsp')
  # The pair task's accuracy (NSP, or ALBERT's sentence order under mlm_sop: the nsp_
  # metrics), for an objective that has one.
  pairs = {'mlm_nsp': 'NSP', 'mlm_sop': 'SOP'}.get(objective, 'pair task') if (
      objectives.objective(objective).next_sentence) else None
  pair_column = [f'{pairs} accuracy'] * bool(pairs)
  lines = [f'{view}; objective {objective}; {args.layers} layers, length {args.seq_len}, '
           f'batch {args.batch}, peak lr {args.learning_rate:g}. Mean over seeds (min-max).',
           '', '| ' + ' | '.join(['variant', 'seeds', 'steps', 'held-out MLM accuracy',
                                  'x majority baseline', 'held-out MLM loss', *pair_column,
                                  'steps/s']) + ' |', '|---' * (7 + len(pair_column)) + '|']
  for variant in args.variants.split(','):
    got = rows.get(variant, [])
    pair = [spread([r.get('nsp_accuracy') for r in got])] * bool(pairs)
    lines.append('| ' + ' | '.join([
        variant, str(len(got)), spread([r['steps'] for r in got], 0),
        spread([r['mlm_accuracy'] for r in got]), spread([r['ratio'] for r in got], 2),
        spread([r['mlm_loss'] for r in got]), *pair,
        spread([r['steps_per_sec'] for r in got], 2)]) + ' |')
  base = [r['mlm_majority_accuracy'] for got in rows.values() for r in got]
  pair_base = [r.get('nsp_majority_accuracy') for got in rows.values() for r in got]
  lines += ['', f'Majority baseline on the held-out batches: {spread(base)}' +
            (f', {pairs}\'s {spread(pair_base)}' if pairs else '') + ' (per seed; the '
            'same batches for every variant of a seed).', '',
            'Orderings (held: every seed of the first above every seed of the second):', '']
  lines += [f'- {a} > {b}: {ordering(per_variant, a, b)}' for a, b in CLAIMED_ORDER]
  return '\n'.join(lines) + '\n'


def compare(args) -> int:
  resolve_budget(args)
  minutes = 0.0
  if args.minutes:
    minutes = equal_minutes(args) if args.minutes == 'auto' else float(args.minutes)
  runs, names, root = compare_runs(args, minutes)
  config = pretraining_config(args)
  if args.print_only:
    print_era_note(args)
    print(sweep.launch_script(runs, root=root, program='train.py',
                              config=f'configs/pretrain.py:postln,{args.size}',
                              target=args.target), end='')
    return 0
  if minutes:
    print(f'equal wall-clock time: {minutes} minutes of training per run (run these one at '
          'a time on an otherwise idle machine: the time decides the steps)')
  if args.report_only:  # the finished runs there are, nothing run
    codes = {n: 0 for r, n in zip(runs, names)
             if finished(storage.join(root, n), r, config)}
    if not codes:
      raise ValueError(f'no finished run under {root}; run study.py compare without '
                       '--report_only first (with the same options)')
  else:
    codes = sweep.run_all(runs, root=root, program=os.path.join(REPO, 'train.py'),
                          config=config)
  metrics = ['eval/mlm_accuracy', 'eval/mlm_majority_accuracy', 'eval/mlm_loss',
             'eval/nsp_accuracy', 'train/loss']
  header, table = sweep.summarize(sweep.collect(root, metrics), metrics)
  with _open(storage.join(root, 'summary.md'), 'w') as f:
    f.write(sweep.to_markdown(header, table))
  with _open(storage.join(root, 'summary.csv'), 'w') as f:
    f.write(sweep.to_csv(header, table))
  report = claims_report(args, runs, names, root, minutes)
  curves(root, runs, names, storage.join(root, 'learning_curves.png'), config)
  first = [(r['model.variant'], n) for r, n in zip(runs, names)
           if r['seed'] == 0 and codes.get(n) == 0]
  results = analysis.analyze_runs([storage.join(root, n) for _, n in first])
  attention_dir = storage.join(root, 'attention')
  if results:
    analysis.write_report(results, attention_dir, [v for v, _ in first])
    report += '\nAttention (claim 3), every seed: mean (min-max) over seeds\n\n'
    report += attention_over_seeds(root, runs, names, codes)
  with _open(storage.join(root, 'claims.md'), 'w') as f:
    f.write(report)
  print(report)
  if args.figures:
    os.makedirs(args.figures, exist_ok=True)
    prefix = 'equal_time_' if minutes else ''
    _copy(storage.join(root, 'learning_curves.png'),
          os.path.join(args.figures, f'{prefix}learning_curves.png'))
    for name in ('attention_entropy.png', 'attention_entropy_heads.png', 'attention_js.png'):
      if storage.path(storage.join(attention_dir, name)).exists():
        _copy(storage.join(attention_dir, name), os.path.join(args.figures, prefix + name))
  record(args, root)
  return 0 if all(c == 0 for c in codes.values()) else 1


# -------------------------------------------------------------------------- finetune
# Claim 4: each pretrained encoder of compare (every variant, every seed) fine-tuned on the
# era task (data/sotu.py: dating a speech sentence before / from 1900; its dev speeches are
# not in the pretraining corpus), against the same architecture from random init, fine-tuning
# seed = pretraining seed.

def finetune_runs(args, workdir: str, seed: int, scratch: bool) -> dict:
  return {'init_checkpoint': workdir, 'from_scratch': scratch,
          'data_dir': storage.join(args.root, 'era'), 'max_seq_length': 64,
          'batch_size': args.ft_batch, 'num_epochs': args.ft_epochs,
          'optimizer.learning_rate': args.ft_learning_rate, 'seed': seed}


def dev_accuracy(workdir: str):
  path = storage.join(workdir, RunDir.RESULTS)
  if not storage.path(path).exists():
    return None
  with _open(path) as f:
    return json.load(f)['headline']


def finetune(args) -> int:
  resolve_budget(args)
  runs, names, root = compare_runs(args)
  config = FINETUNE_CONFIG
  scores, codes, script = {}, {}, []
  for run, name in zip(runs, names):
    pretrained = storage.join(root, name)
    if not args.print_only and not finished(pretrained, run, pretraining_config(args)):
      print(f'{name}: not pretrained yet (study.py compare), left out')
      continue
    for arm in ('pretrained', 'scratch'):
      ft = [finetune_runs(args, pretrained, run['seed'], arm == 'scratch')]
      ft_root = storage.join(args.root, 'finetune', arm, name)
      if args.print_only:
        script.append(sweep.launch_script(ft, root=ft_root, program='finetune.py',
                                          config='configs/finetune.py:glue/sst2',
                                          target=args.target))
        continue
      if not args.report_only:
        codes.update({f'{arm}/{name}/{k}': c for k, c in sweep.run_all(
            ft, root=ft_root, program=os.path.join(REPO, 'finetune.py'),
            config=config).items()})
      ft_dir = storage.join(ft_root, folders(ft_root, ft)[0])
      acc = dev_accuracy(ft_dir) if finished(ft_dir, ft[0], config) else None
      scores.setdefault(arm, {}).setdefault(run['model.variant'], {})[run['seed']] = acc
      if acc is not None and scores.get('majority') is None:  # (the same dev set for all)
        scores['majority'] = finetune_grid.dev_majority(ft_dir)
    scores.setdefault('mlm', {}).setdefault(run['model.variant'], {})[run['seed']] = (
        held_out(pretrained).get('mlm_accuracy'))
  if args.print_only:
    print_era_note(args)
    print(''.join(script), end='')
    return 0
  if not scores and not args.report_only:
    raise ValueError(f'no run under {args.root} is pretrained yet: run study.py compare '
                     'first (with the same --root, --variants and --seeds)')
  if args.report_only and not any(v is not None for arm in ('pretrained', 'scratch')
                                  for seeds in scores.get(arm, {}).values()
                                  for v in seeds.values()):
    raise ValueError(f'no finished fine-tuning run under {storage.join(args.root, "finetune")}; '
                     'run study.py finetune without --report_only first (with the same options)')
  report = finetune_report(args, scores)
  storage.path(storage.join(args.root, 'finetune')).mkdir(parents=True, exist_ok=True)
  with _open(storage.join(args.root, 'finetune', 'finetune.md'), 'w') as f:
    f.write(report)
  print(report)
  record(args, storage.join(args.root, 'finetune'))
  return 0 if all(c == 0 for c in codes.values()) else 1


def finetune_report(args, scores: dict) -> str:
  """Dev accuracy per variant (pretrained, random init, the paired gain, and the encoder's
  held-out MLM accuracy from compare beside it), and the orderings after fine-tuning."""
  pre, scratch, mlm = (scores.get(k, {}) for k in ('pretrained', 'scratch', 'mlm'))
  majority = scores.get('majority')
  chance = (f'; always predicting the majority label: {majority:.4f}' if majority is not None
            else '')
  lines = [f'era task dev accuracy (396 sentences{chance}), lr {args.ft_learning_rate:g}, '
           f'batch {args.ft_batch}, {args.ft_epochs} epochs; mean over seeds (min-max).', '',
           '| variant | seeds | pretrained | random init | gain (paired by seed) | '
           'the encoder\'s held-out MLM accuracy |', '|---|---|---|---|---|---|']
  clean, gain_lines = {}, []
  for variant in args.variants.split(','):
    p, s = pre.get(variant, {}), scratch.get(variant, {})
    gains = [p[k] - s[k] for k in p if p[k] is not None and s.get(k) is not None]
    clean[variant] = {k: v for k, v in p.items() if v is not None}
    lines.append(f'| {variant} | {len(clean[variant])} | {spread(list(p.values()))} | '
                 f'{spread(list(s.values()))} | {spread(gains)} | '
                 f'{spread(list(mlm.get(variant, {}).values()))} |')
    arms = {'pretrained': clean[variant],
            'random init': {k: v for k, v in s.items() if v is not None}}
    gain_lines.append(f'- {variant}: pretrained > random init: '
                      f'{ordering(arms, "pretrained", "random init")}')
  lines += ['', 'Orderings of the pretrained encoders after fine-tuning (as in claim 2):', '']
  lines += [f'- {a} > {b}: {ordering(clean, a, b)}' for a, b in CLAIMED_ORDER]
  lines += ['', 'Pretraining against random init, per variant:', ''] + gain_lines
  return '\n'.join(lines) + '\n'


PARTS = ('budget', 'compare', 'finetune', 'stability')


def _define(f):
  """The study's flags (absl, as train.py's)."""
  string, integer, number = flags.DEFINE_string, flags.DEFINE_integer, flags.DEFINE_float
  string('root', None, 'the folder of the study\'s runs', flag_values=f, required=True)
  string('variants', None, f'default {",".join(VARIANTS)} (stability: postln,preln,realformer)',
         flag_values=f)
  string('size', 'tiny', 'the width (configs/pretrain.py sizes)', flag_values=f)
  integer('seeds', None, 'default 3 (stability: 1)', flag_values=f)
  integer('steps', None, 'default: R/budget.json, else 150 (stability: 300)', flag_values=f)
  integer('batch', None, 'default: R/budget.json, else 32 (stability: 16)', flag_values=f)
  integer('layers', None, 'default: R/budget.json, else 4 (stability: 12)', flag_values=f)
  integer('seq_len', None, 'default: R/budget.json, else 64', flag_values=f)
  number('learning_rate', None, 'default: R/budget.json, else 2e-3', flag_values=f)
  flags.DEFINE_enum('objective', 'mlm_nsp', list(objectives.OBJECTIVES),
                    'the pretraining objective of every run (config.objective): ' + '; '.join(
                        f'{n}, {o.about}' for n, o in objectives.OBJECTIVES.items()),
                    flag_values=f)
  flags.DEFINE_enum('corpus', 'era', ['era', 'embedded'],
                    'era: the speeches less those the fine-tuning task holds out; embedded: '
                    'all of them', flag_values=f)
  integer('eval_steps', 16, 'held-out batches per evaluation', flag_values=f)
  number('eval_fraction', 0.03, 'share of the documents held out for the evaluation',
         flag_values=f)
  string('minutes', '', 'compare at equal wall-clock time: each run trains this long '
         '(train.time_budget_minutes); "auto": the reference variant\'s median training time '
         'in the steps view', flag_values=f)
  string('reference', 'postln', 'the variant the budget is found for', flag_values=f)
  flags.DEFINE_boolean('print_only', False, 'print the launch commands instead of running '
                       '(their run folders are made in --root, as sweep.py makes them: print '
                       'with the settings you will run)',
                       flag_values=f)
  flags.DEFINE_enum('target', 'local', list(sweep.TARGETS), 'where --print_only\'s '
                    'commands launch', flag_values=f)
  string('figures', None, 'also copy the figures here (e.g. docs/figures)', flag_values=f)
  string('record', None, 'also copy what the reports are made from (each run\'s metrics.jsonl, '
         'config and results, the tables; no checkpoints) to DIR/<part>/, e.g. '
         'docs/study_runs, so the numbers stay traceable once R is gone', flag_values=f)
  # budget: the candidates, tried cheapest first
  string('budget_layers', '4', 'budget: candidate depths', flag_values=f)
  string('budget_seq_lens', '64', 'budget: candidate lengths', flag_values=f)
  string('budget_steps', '500,1000,2000,4000', 'budget: candidate step counts', flag_values=f)
  number('target_ratio', 2.0, 'budget: held-out MLM accuracy over the majority baseline to '
         'reach', flag_values=f)
  # finetune: one setting for every encoder
  number('ft_learning_rate', 3e-4, 'finetune: the learning rate', flag_values=f)
  integer('ft_epochs', 10, 'finetune: epochs', flag_values=f)
  integer('ft_batch', 16, 'finetune: batch size', flag_values=f)
  # stability (defaults for that part: --layers 12 --steps 300)
  string('learning_rates', STABILITY_RATES, 'stability: peak learning rates, each twice the '
         'one before by default', flag_values=f)
  string('warmups', '0,30', 'stability: warm-up steps, none and a short one (10% of 300 '
         'steps) by default', flag_values=f)
  number('warmup_max_lr', 4e-3, 'stability: runs with warm-up only at peak rates up to this '
         '(every rate runs without); inf: the whole cross product', flag_values=f)
  integer('log_every', 10, 'stability: steps between logged losses', flag_values=f)
  flags.DEFINE_boolean('report_only', False, 'stability, compare, finetune: only the tables '
                       '(and figures) of the runs there are, nothing run', flag_values=f)


def main(argv=None):
  args, words = cli.parse_tool_flags(
      _define, argv, prog='study.py', doc=__doc__, positional=('part',))
  args.part = words.get('part', 'compare')
  if args.part not in PARTS:
    cli.fail(f'unknown part {args.part!r}; choose one of {", ".join(PARTS)} (budget: the '
             'cheapest budget past the unigram plateau; compare: the variants at that budget, '
             'the default; finetune: the pretrained encoders on the era task; stability: the '
             'learning-rate x warm-up grid of a deep encoder)')
  if args.minutes and args.minutes != 'auto':
    try:
      if float(args.minutes) <= 0:
        raise ValueError
    except ValueError:
      cli.fail(f'--minutes {args.minutes}: give a positive number of minutes or auto')
  if args.minutes and args.part != 'compare':
    cli.fail('--minutes is for the compare part')
  if args.seeds is not None and args.seeds < 1:
    raise ValueError(f'--seeds={args.seeds}: need at least one seed')
  for name in ('steps', 'batch', 'layers', 'seq_len', 'eval_steps', 'ft_epochs', 'ft_batch',
               'log_every'):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      raise ValueError(f'--{name}={getattr(args, name)}: give a positive number')
  for name, kind in (('learning_rates', float), ('warmups', int)):
    try:
      if any(kind(x) < 0 for x in getattr(args, name).split(',')):
        raise ValueError
    except ValueError:
      raise ValueError(f'--{name} {getattr(args, name)!r}: give comma-separated '
                       f'{"numbers" if kind is float else "whole numbers"} >= 0, e.g. '
                       f'{STABILITY_RATES if name == "learning_rates" else "0,30"}') from None
  if args.report_only and args.part == 'budget':
    cli.fail('--report_only is for the stability, compare and finetune parts')
  if args.learning_rate is not None and args.learning_rate <= 0:
    raise ValueError(f'--learning_rate={args.learning_rate}: give a positive peak rate')
  if args.target_ratio <= 0:
    raise ValueError(f'--target_ratio={args.target_ratio}: give a positive multiple of the '
                     'majority baseline (the default, 2, is twice it)')
  for name in ('budget_layers', 'budget_seq_lens', 'budget_steps'):
    _ints(getattr(args, name), name)  # (positive whole numbers, or one line)
  from configs import pretrain  # pylint: disable=g-import-not-at-top
  if args.variants is not None and '' in [v.strip() for v in args.variants.split(',')]:
    raise ValueError(f'--variants {args.variants!r} names an empty variant; give names joined '
                     f'by commas, e.g. {",".join(VARIANTS)}')
  unknown = [v for v in (args.variants or '').split(',') if v and v not in pretrain.VARIANTS]
  if unknown or args.reference not in pretrain.VARIANTS:
    raise ValueError(f'unknown variant {(unknown or [args.reference])[0]!r} in --variants or '
                     f'--reference; choose from {", ".join(pretrain.VARIANTS)}')
  if args.size not in pretrain.SIZES:
    raise ValueError(f'--size {args.size!r}: choose one of {", ".join(pretrain.SIZES)}')
  if args.part == 'stability':
    for key, value in {'variants': 'postln,preln,realformer', 'layers': 12, 'steps': 300,
                       'seeds': 1, 'batch': 16, 'seq_len': 64}.items():
      if getattr(args, key) is None:
        setattr(args, key, value)
    return stability(args)
  args.variants = args.variants or ','.join(VARIANTS)
  args.seeds = args.seeds or 3
  if args.part == 'budget':
    for key in ('batch', 'learning_rate'):
      if getattr(args, key) is None:
        setattr(args, key, COMPARE_DEFAULTS[key])
    return budget_search(args)
  return compare(args) if args.part == 'compare' else finetune(args)


if __name__ == '__main__':
  raise SystemExit(cli.run_main(main))
