r"""The fine-tuning grid of the paper's practice, for one task or all of GLUE, over seeds.

  python -m realformer.tools.finetune_grid --tasks rte,mrpc --root /tmp/grid \
      --init_checkpoint /tmp/bert_tiny --data_dir /data/glue --seeds 5
  python -m realformer.tools.finetune_grid --tasks glue ... --print_only --target slurm
  python -m realformer.tools.finetune_grid --tasks rte --root /tmp/grid --summarize_only

Every (encoder, learning rate, batch size, epochs, seed) of every task is one finetune.py run
(--init_checkpoint repeated: several encoders, each named in its runs' folders) in
<root>/<task>/<its grid values and other varying overrides> (realformer.tools.sweep names, skips
finished runs and resumes interrupted ones, so a grid can be extended in the same root; a
run with other fixed overrides (another --set) gets a folder of its own, named by them; a
run that failed before its first checkpoint gives its folder to the next call's settings; a
run whose loss became nan/inf is marked so, counted as failed and not run again), run here
one after another, or printed as launch commands for a cluster (--print_only). The summary
(<root>/results.md and .csv: the --tasks and every other task the root holds) gives each
setting's median over seeds of the task's headline metric (the BERT paper's: MCC for CoLA, F1 for MRPC/QQP, Spearman for STS-B, accuracy
elsewhere; SQuAD F1), a failed seed (diverged, or a headline that is not finite: a
regression's constant predictions have no correlation) counting below every score, and the
mean, min and max of the scored seeds; it marks the best setting of each task by that
median. A setting is the grid's values and any other override that differs between the
task's runs; unfinished runs are counted and left out. --submission Z.zip also zips GLUE's
test predictions for the benchmark's server: each task's from its best setting's seed of the
best dev score (the BERT paper chose its restarts on dev), and names the files it lacks.
Tasks: GLUE names (cola, sst2, ..., `glue` = all nine; mnli's runs also evaluate mismatched,
in their results.json, and predict AX; the summary reads matched), squad/v1.1, squad/v2.0
(`squad` = both), ner/conll2003 (`ner`), tsv/<name> (a task of your own, its columns and
labels given with --set tsv.<key>=...), or <kind>/<name> of any kind in
realformer/finetune/tasks/.
"""

import json
import math
import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence

from absl import flags

from realformer import cli
from realformer import storage
from realformer.tools import sweep
from realformer.train import checkpoints
from realformer.train.run_dir import RunDir

GRID_KEYS = ('optimizer.learning_rate', 'batch_size', 'num_epochs')
PROGRAM = 'finetune.py'


def config_arg(task: str) -> str:
  """'rte' -> configs/finetune.py:glue/rte; 'squad/v1.1' stays."""
  name = task if '/' in task else f'glue/{task}'
  return f'configs/finetune.py:{name}'


def expand_tasks(tasks: str) -> List[str]:
  """--tasks -> the runs' tasks: a GLUE name (rte), or <kind>/<name> of a kind in
  realformer/finetune/tasks/ (squad/v1.1, tsv/topics); a kind alone (glue, squad) is every
  task it names. Each task once, in the order first named."""
  from realformer.finetune import registry  # pylint: disable=g-import-not-at-top
  kinds = registry.kinds()
  names = []
  for t in tasks.split(','):
    if t in kinds and registry.get(t).names():
      names += [n if t == 'glue' else f'{t}/{n}' for n in registry.get(t).names()]
      continue
    if t in kinds:
      raise ValueError(f'--tasks {t}: the kind {t} takes any task name; name yours, '
                       f'--tasks {t}/<name>')
    kind, _, name = t.partition('/') if '/' in t else ('glue', '', t)
    known = registry.get(kind).names() if kind in kinds else None
    if known is None or not name or (known and name not in known and
                                     not registry.get(kind).takes_any_name):
      glue = registry.get('glue').names()
      raise ValueError(f'unknown task {t!r}; use GLUE names ({", ".join(glue)}), glue (all '
                       f'{len(glue)}), or <kind>/<name> of a kind of '
                       f'realformer/finetune/tasks/ ({", ".join(kinds)}): squad/v1.1, '
                       f'tsv/<name> (a task of your own: --set tsv.labels=... and its '
                       f'--data_dir), ...')
    names.append(name if kind == 'glue' else t)  # glue/rte is rte (one root, one row)
  return list(dict.fromkeys(names))  # a task named twice (glue,rte) runs once


def grid(learning_rates: Sequence[float], batch_sizes: Sequence[int],
         epochs: Sequence[int], seeds: int, fixed: Dict[str, Any],
         init_checkpoints: Sequence[str] = ('',)) -> List[sweep.Run]:
  """The product of the encoders (init_checkpoints), the grid and the seeds; `fixed`
  overrides go into every run. A grid that names a run twice (1e-5 and 1e-05; a --set of a
  grid key; an encoder given twice) is an error."""
  if seeds < 1:
    raise ValueError(f'--seeds={seeds}: need at least one seed')
  clash = sorted(k for k in fixed if k in GRID_KEYS + ('seed', 'init_checkpoint'))
  if clash:
    raise ValueError(f'--set {clash[0]}: the grid sets it (--learning_rates, --batch_sizes, '
                     '--epochs, --seeds, --init_checkpoint); give its values there')
  h = sweep.Hyper
  runs = h.product([h.sweep('init_checkpoint', init_checkpoints),
                    h.sweep('optimizer.learning_rate', learning_rates),
                    h.sweep('batch_size', batch_sizes), h.sweep('num_epochs', epochs),
                    [fixed], h.sweep('seed', range(seeds))])
  names = sweep.run_names(runs, always=GRID_KEYS)
  if len(set(names)) != len(names):
    raise ValueError('the grid repeats a run (a value given twice); check --learning_rates, '
                     '--batch_sizes, --epochs and --init_checkpoint')
  return runs


def task_root(root: str, task: str) -> str:
  return storage.join(root, task.replace('/', '_'))


def collect(root: str, task: str = '') -> List[Dict[str, Any]]:
  """{'run': its overrides, 'state', 'headline', 'folder'} of every run under the root of
  `task`: state 'done' (its results.json's headline, by today's rule: _headline),
  'diverged' (its loss became nan/inf: sweep.mark_diverged) or 'unfinished' (headline None
  for both)."""
  rows = []
  folder = storage.path(root)
  for name in sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []:
    run = folder / name
    if not (run / RunDir.OVERRIDES).exists():
      continue
    done = (run / RunDir.RESULTS).exists()
    state = ('done' if done else
             'diverged' if (run / RunDir.DIVERGED).exists() else 'unfinished')
    rows.append({'run': _read_json(run / RunDir.OVERRIDES), 'state': state, 'folder': name,
                 'headline': _headline(_read_json(run / RunDir.RESULTS), task) if done else None})
  return rows


def _headline(results: Dict[str, Any], task: str):
  """A finished run's headline: a GLUE task's recomputed from its dev metrics by today's
  rule (a run of before STS-B's headline became Spearman recorded Pearson), else as
  recorded."""
  from data import glue  # pylint: disable=g-import-not-at-top
  from realformer.finetune import metrics  # pylint: disable=g-import-not-at-top
  dev = (results.get('dev') or {}).get(task)
  if task in glue.TASKS and isinstance(dev, dict) and glue.get_task(task).metric in dev:
    return metrics.headline(task, dev)
  return results['headline']


def _read_json(path) -> Dict[str, Any]:
  try:
    return json.loads(path.read_text())
  except ValueError as e:
    raise ValueError(f'{path} is not readable JSON ({e}); delete its run\'s folder (the grid '
                     'runs it again) or restore the file') from None


def _fmt(value):
  return repr(value) if isinstance(value, float) else value  # 2e-05, not 0.0000


def _in_order(key):
  """A sort key for a row's settings: numbers by value, before text (a run without a value
  for one of them: '')."""
  return [(0, v, '') if isinstance(v, (int, float)) else (1, 0, str(v)) for v in key]


def summarize(task: str, rows: Sequence[Dict[str, Any]]) -> List[List[Any]]:
  """One row per setting: task, lr, batch, epochs; n (finished runs), failed (of those, the
  diverged and those whose headline is not finite: a regression's constant predictions have
  no correlation), unfinished (left out); the median over the n, a failed run counting below
  every score ('failed' where the median falls on one: a setting that fails some seeds does
  not win on the median of the others); the mean, min and max of the scored runs; 'best' on
  the setting of the highest median (of each encoder, where the runs have several; of equal
  medians the first is 'best (tied)', the others 'tied'); the
  setting's other overrides that differ between the task's runs (a grid extended in its
  root with another --set: never averaged with the first)."""
  others, settings = _settings(rows)
  table = []
  for key, runs in settings:
    finished = [r for r in runs if r['state'] != 'unfinished']
    scores = [_score(r) for r in finished]
    scored = [x for x in scores if x > -math.inf]
    median = _median(runs)
    stats = [statistics.mean(scored), min(scored), max(scored)] if scored else [''] * 3
    shown = (median if median is not None else
             'failed' if finished else '')
    grid_values = [_fmt(x) for x in key[:len(GRID_KEYS)]]
    other = ','.join(f'{k}={_fmt(x)}' for k, x in zip(others, key[len(GRID_KEYS):])
                     if x != '')
    table.append([task, *grid_values, len(finished), len(scores) - len(scored),
                  len(runs) - len(finished), shown, *stats, '', other])
  # The best setting of each encoder (a grid over several --init_checkpoint compares them).
  encoder = (lambda key: key[len(GRID_KEYS) + others.index('init_checkpoint')]
             ) if 'init_checkpoint' in others else (lambda key: '')
  for init in dict.fromkeys(encoder(key) for key, _ in settings):
    members = [i for i, (key, _) in enumerate(settings) if encoder(key) == init]
    best = _best_setting([settings[i] for i in members])
    if best is not None:
      ties = [i for i in members if i != members[best]
              and _median(settings[i][1]) == _median(settings[members[best]][1])]
      table[members[best]][-2] = 'best (tied)' if ties else 'best'
      for i in ties:
        table[i][-2] = 'tied'
  return table


def _settings(rows):
  """(the other overrides that differ between the runs, [(setting, its runs)] in order)."""
  others = [k for k in sweep.varying_keys([r['run'] for r in rows])
            if k not in GRID_KEYS + ('seed',)]
  groups = {}
  for row in rows:
    key = tuple(row['run'].get(k, '') for k in GRID_KEYS + tuple(others))
    groups.setdefault(key, []).append(row)
  return others, sorted(groups.items(), key=lambda item: _in_order(item[0]))


def _score(row) -> float:
  """A finished run's headline; -inf for a failed one (diverged, or not finite)."""
  ok = row['state'] == 'done' and math.isfinite(row['headline'])
  return row['headline'] if ok else -math.inf


def _median(runs):
  """The median score of a setting's finished runs, or None (none finished, or it falls on
  a failed run)."""
  scores = [_score(r) for r in runs if r['state'] != 'unfinished']
  median = statistics.median(scores) if scores else None
  return median if median is not None and math.isfinite(median) else None


def _best_setting(settings):
  """The index of the setting of the highest median (the first of equals), or None."""
  medians = [_median(runs) for _, runs in settings]
  scored = [(m, -i) for i, m in enumerate(medians) if m is not None]
  return -max(scored)[1] if scored else None


def best_run(rows):
  """The run a submission takes: of the best setting (summarize's), the seed with the best
  dev headline (the BERT paper's restarts, chosen on dev); None without a scored run."""
  _, settings = _settings(rows)
  best = _best_setting(settings)
  if best is None:
    return None
  return max(settings[best][1], key=_score)


def write_submission(root: str, tasks: Sequence[str], out: str) -> str:
  """The GLUE benchmark's submission zip at `out` (a path or gs:// URL): for each GLUE task
  of `tasks`, the predictions/ files (glue.SUBMISSION) of its best_run, at the zip's top
  level. Returns what went in and which of the benchmark's files are missing."""
  import io  # pylint: disable=g-import-not-at-top
  import zipfile  # pylint: disable=g-import-not-at-top
  from data import glue  # pylint: disable=g-import-not-at-top
  files, lines = {}, []
  for task in tasks:
    if task not in glue.SUBMISSION:
      continue  # (not a GLUE task: SQuAD and a task of one's own have no such benchmark)
    rows = collect(task_root(root, task), task)
    if len({str(r['run'].get('init_checkpoint', '')) for r in rows}) > 1:
      raise ValueError(f'{task}\'s runs fine-tune several encoders (--init_checkpoint); a '
                       'submission is one encoder\'s: summarize a root of its runs alone')
    run = best_run(rows)
    if run is None:
      lines.append(f'{task}: no scored run')
      continue
    folder = storage.path(task_root(root, task)) / run['folder'] / RunDir.PREDICTIONS
    have = [s for s in glue.SUBMISSION[task] if (folder / f'{s}.tsv').exists()]
    for stem in have:
      files[stem] = (folder / f'{stem}.tsv').read_bytes()
    lines.append(f'{task}: {run["folder"]} (dev {run["headline"]:.4f}): '
                 f'{", ".join(f"{s}.tsv" for s in have) or "no predictions (no test.tsv?)"}')
  if not files:
    if not any(t in glue.SUBMISSION for t in tasks):
      raise ValueError(f'--submission zips GLUE\'s test predictions, and --tasks '
                       f'{",".join(tasks)} has no GLUE task; name them (--tasks glue for all)')
    raise ValueError(f'no GLUE test predictions under {root} for --tasks '
                     f'{",".join(tasks)}; the runs write predictions/ when their data has '
                     'test.tsv')
  buf = io.BytesIO()
  with zipfile.ZipFile(buf, 'w', zipfile.ZIP_DEFLATED) as z:
    for stem in sorted(files):
      z.writestr(f'{stem}.tsv', files[stem])
  storage.path(out).parent.mkdir(parents=True, exist_ok=True)
  storage.path(out).write_bytes(buf.getvalue())
  missing = [s for stems in glue.SUBMISSION.values() for s in stems if s not in files]
  lines.append(f'wrote {out} ({len(files)} files)' + (
      f'; the benchmark takes all 11: missing {", ".join(missing)}' if missing else ''))
  return '\n'.join(lines)


HEADER = ['task', 'learning_rate', 'batch_size', 'num_epochs', 'n', 'failed', 'unfinished',
          'median', 'mean', 'min', 'max', 'best', 'other overrides']


def tasks_in(root: str) -> List[str]:
  """The tasks whose runs the grid's root holds (each run's command.json names its config)."""
  found = []
  folder = storage.path(root)
  for task_dir in sorted(folder.iterdir(), key=lambda p: p.name) if folder.is_dir() else []:
    for run in sorted(task_dir.iterdir(), key=lambda p: p.name) if task_dir.is_dir() else []:
      try:
        config = json.loads((run / RunDir.COMMAND).read_text())['config']
      except (OSError, ValueError, KeyError, TypeError):
        continue
      name = config.partition(':')[2]
      task = name[len('glue/'):] if name.startswith('glue/') else name
      if task and task.replace('/', '_') == task_dir.name:
        found.append(task)
        break
  return found


def headline_metric(root: str, task: str) -> str:
  """The name of a task's headline metric: what its finished runs recorded, else a GLUE or
  SQuAD task's by name (runs from before results.json named it), else 'headline'."""
  from data import glue  # pylint: disable=g-import-not-at-top
  from realformer.finetune import metrics  # pylint: disable=g-import-not-at-top
  folder = storage.path(task_root(root, task))
  for run in sorted(folder.iterdir(), key=lambda p: p.name) if folder.is_dir() else []:
    try:
      return json.loads((run / RunDir.RESULTS).read_text())['headline_metric']
    except (OSError, ValueError, KeyError, TypeError):
      continue
  if task in glue.TASKS:
    return glue.get_task(task).metric
  return metrics.SQUAD_HEADLINE.get(task, 'headline')


def dev_majority(workdir, task: str = '', metric: str = 'accuracy') -> Optional[float]:
  """The dev `metric` of always predicting the dev set's most frequent label, as a finished
  fine-tuning run recorded it in results.json (majority_<metric>): of `task` (tsv/<name>'s
  by <name>), or of its first dev set; None where it recorded none (regressions, SQuAD, runs
  of before the field)."""
  key = f'majority_{metric}'
  try:
    dev = json.loads((storage.path(workdir) / RunDir.RESULTS).read_text())['dev']
    sets = [dev.get(task) or dev[task.rpartition('/')[2]]] if task else list(dev.values())
    return next(float(s[key]) for s in sets if isinstance(s, dict) and key in s)
  except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration):
    return None


def majority_baseline(root: str, task: str, metric: str) -> Optional[float]:
  """dev_majority of `metric` in the task's first run that recorded it (the dev set is the
  same for all)."""
  folder = storage.path(task_root(root, task))
  runs = sorted(folder.iterdir(), key=lambda p: p.name) if folder.is_dir() else []
  return next((m for m in (dev_majority(run, task, metric) for run in runs) if m is not None),
              None)


def write_summary(root: str, tasks: Sequence[str]) -> str:
  """results.md and .csv of `tasks` and of every other task whose runs the root holds (a
  grid of one task into the root of another's keeps both in the table); results.md names
  each task's headline metric above the table, and below it the majority baseline's in that
  metric for the classification tasks (a setting that scores it learnt nothing: MRPC's F1
  of about 0.81)."""
  tasks = list(tasks) + [t for t in tasks_in(root) if t not in tasks]
  table = []
  for task in tasks:
    table += summarize(task, collect(task_root(root, task), task))
  headlines = {task: headline_metric(root, task) for task in tasks}
  named = '; '.join(f'{task}: {metric}' for task, metric in headlines.items())
  baselines = [(task, majority_baseline(root, task, metric))
               for task, metric in headlines.items()]
  baselines = ', '.join(f'{task} {b:.4f}' for task, b in baselines if b is not None)
  several = any('init_checkpoint=' in row[-1] for row in table)  # (encoders compared)
  markdown = (f'median, mean, min and max of each task\'s headline metric ({named})' +
              ('; "best" marks each encoder\'s best setting' if several else '') + '\n\n' +
              sweep.to_markdown(HEADER, table) +
              (f'\nThe headline metric of always predicting the majority label: {baselines}\n'
               if baselines else ''))
  storage.write_text(storage.join(root, 'results.md'), markdown)
  storage.write_text(storage.join(root, 'results.csv'), sweep.to_csv(HEADER, table))
  return markdown


def _define(f):
  flags.DEFINE_string('tasks', None, 'comma-separated; glue = all nine', flag_values=f,
                      required=True)
  flags.DEFINE_string('root', None, 'one folder per task, one workdir per run', flag_values=f,
                      required=True)
  flags.DEFINE_multi_string('init_checkpoint', [], 'the pretraining (or import) workdir; '
                            'repeat to fine-tune several encoders in one grid (each its own '
                            'rows)', flag_values=f)
  flags.DEFINE_string('data_dir', '', "the tasks' data: GLUE TSV or SQuAD JSON folder ('' = "
                      'tfds), a CoNLL or TSV folder (needed)', flag_values=f)
  flags.DEFINE_list('learning_rates', ['1e-5', '2e-5', '3e-5', '4e-5', '5e-5'],
                    'comma-separated', flag_values=f)
  flags.DEFINE_list('batch_sizes', ['16', '32'], 'comma-separated', flag_values=f)
  flags.DEFINE_list('epochs', ['2', '3', '4'], 'comma-separated', flag_values=f)
  flags.DEFINE_integer('seeds', 5, 'seeds per setting', flag_values=f)
  flags.DEFINE_multi_string('set', [], 'KEY=VALUE: another fixed override, e.g. --set '
                            'max_seq_length=128 (repeat)', flag_values=f)
  flags.DEFINE_boolean('print_only', False, 'print launch commands instead', flag_values=f)
  flags.DEFINE_enum('target', 'local', ['local', 'tpu', 'slurm'], 'where --print_only\'s '
                    'commands launch', flag_values=f)
  flags.DEFINE_boolean('summarize_only', False, 'only the results table of the runs there are',
                       flag_values=f)
  flags.DEFINE_string('submission', None, 'also write the GLUE benchmark\'s submission zip '
                      'here: each GLUE task\'s test predictions from its best setting\'s best '
                      'dev seed', flag_values=f)


def _numbers(args, name, kind):
  try:
    values = [kind(v) for v in getattr(args, name)]
    if values:
      return values
  except ValueError:
    pass
  cli.fail(f'--{name}={",".join(getattr(args, name))}: give comma-separated '
           f'{"numbers" if kind is float else "whole numbers"}')


def main(argv=None):
  args, _ = cli.parse_tool_flags(_define, argv, prog='python -m realformer.tools.finetune_grid',
                                 doc=__doc__)
  args.learning_rates = _numbers(args, 'learning_rates', float)
  args.batch_sizes = _numbers(args, 'batch_sizes', int)
  args.epochs = _numbers(args, 'epochs', int)

  tasks = expand_tasks(args.tasks)
  if args.print_only and args.target == 'tpu' and not storage.is_url(args.root):
    raise ValueError(f'--root {args.root} is a local folder, which each TPU worker would have '
                     'a copy of; give a gs:// URL for runs on a pod slice')
  if args.submission and args.print_only:
    raise ValueError('--submission with --print_only: the runs have not run here; once they '
                     'have, run the grid again with --summarize_only --submission')
  failed, elsewhere, diverged = [], [], []  # (the runs of this call: none to summarize)
  if not args.summarize_only:
    def local(path: str) -> str:  # runs start in the repository root: local paths absolute
      keep = (not path or storage.is_url(path) or path.startswith('hf:') or
              '.py:' in path or path.endswith('.py'))  # hf: data, a config file
      return path if keep else os.path.abspath(path)
    inits = [local(p) for p in args.init_checkpoint] or ['']
    fixed = {'data_dir': local(args.data_dir)}
    types = {}  # each --set value read as its field's type, as sweep.py reads it
    for task in tasks:
      types.update(sweep.field_types(config_arg(task)))
    for assignment in sweep.parse_assignments(args.set, multi=False, types=types):
      fixed.update(assignment[0])
    for init in inits if not args.print_only and not fixed.get('from_scratch') else ():
      if not init:
        raise ValueError('--init_checkpoint is required: the train.py or import workdir whose '
                         'encoder the grid fine-tunes (or --set from_scratch=True)')
      if not (storage.path(init) / RunDir.CONFIG).is_file():
        raise ValueError(f'--init_checkpoint={init!r} is not a train.py or import workdir (no '
                         'config.json); pass one, or --set from_scratch=True')
      # (a fine-tuning run's own folder, say, refused here rather than by each of its runs)
      checkpoints.read_pretraining_config(init)
    if (not args.print_only and args.data_dir and not args.data_dir.startswith('hf:') and
        not storage.path(args.data_dir).is_dir()):
      raise FileNotFoundError(f'--data_dir={args.data_dir!r} is not a directory')
    runs = grid(args.learning_rates, args.batch_sizes, args.epochs, args.seeds, fixed, inits)
    axes = GRID_KEYS + (('init_checkpoint',) if len(inits) > 1 else ())  # what names a run
    for task in tasks:  # every task's config takes the --set keys, before any run starts
      sweep.check_keys(config_arg(task), runs, here=not args.print_only, flags='--set')
    if args.print_only:
      for task in tasks:
        print(sweep.launch_script(runs, root=task_root(args.root, task), program=PROGRAM,
                                  config=config_arg(task), target=args.target, always=axes),
              end='')
      return 0
    # A run that diverged (its loss became nan/inf) is a result of its settings: left out of
    # later calls, which would only repeat it.
    to_run = {task: [r for r, gone in zip(runs, sweep.diverged(
        task_root(args.root, task), runs, axes,
        sweep.program_and_config(PROGRAM, config_arg(task)))) if not gone] for task in tasks}
    total, before = sum(map(len, to_run.values())), 0
    for task in tasks:
      root = task_root(args.root, task)
      codes = sweep.run_all(to_run[task], root=root, program=PROGRAM, config=config_arg(task),
                            always=axes, counted=(before, total), label=f'{task}/')
      before += len(to_run[task])
      task_failed, task_diverged = sweep.failed_or_diverged(root, codes)
      failed += [f'{task}/{n}' for n in task_failed]
      diverged += [f'{task}/{n}' for n in task_diverged]
      elsewhere += [f'{task}/{n}' for n, c in codes.items() if c == sweep.RUNNING_ELSEWHERE]
    if diverged:
      print(f'diverged (nan/inf; failed in the table, not run again): {", ".join(diverged)}')
    if failed:
      print(f'failed runs: {", ".join(failed)}')
    if elsewhere:
      print(f'run by another grid process (not in the table yet): {", ".join(elsewhere)}')
  print(write_summary(args.root, tasks))
  print(f'(written to {args.root}/results.md and {args.root}/results.csv)')
  if args.submission:
    print(write_submission(args.root, tasks, args.submission))
  return 1 if failed or elsewhere else 0


if __name__ == '__main__':
  sys.exit(cli.run_main(main))
