r"""Sweeps from the command line: run them, print their launch commands, summarise them.

  python sweep.py run --root /tmp/sweep --config configs/pretrain.py:postln,tiny \
      --sweep model.variant=postln,preln,realformer,synth_random_vanilla \
      --sweep optimizer.learning_rate=1e-4,2e-4 --seeds 3 --set train.num_steps=2000
  python sweep.py print --target tpu ... (same arguments)   # one gcloud command per run
  python sweep.py print --target multislice ...             # the same, on $QR's slices
  python sweep.py print --target slurm ...                  # one sbatch line per run
  python sweep.py summarize --root /tmp/sweep               # markdown + CSV over seeds

`--sweep key=v1,v2` values are swept (product over all --sweep flags and the seeds),
`--set key=value` is fixed for every run, `--sweep_file F.py` adds a big_vision-style
get_hyper(h) (see realformer/tools/sweep.py). Each run lives in <root>/<its overrides>; finished
runs are skipped, interrupted ones resume, and one whose loss became nan/inf is marked
(diverged.json) and not run again. SIGTERM or Ctrl-C stops the run in progress, which saves,
and the sweep (exit 75: run the same command to go on). `--program finetune.py` sweeps
fine-tuning.
`--root` may be a gs:// URL (the runs, their overrides, logs and the summary live there).
"""

import sys

from absl import flags

from realformer import cli
from realformer import storage
from realformer.run_names import RunNames
from realformer.tools import sweep


COMMANDS = {'run': 'run every unfinished run, one after another',
            'print': 'print a launch script instead of running',
            'summarize': 'final metrics of all runs, over seeds'}


def _define(cmd):
  def define(f):
    flags.DEFINE_string('root', None, 'directory holding one workdir per run', flag_values=f,
                        required=True)
    if cmd == 'summarize':
      flags.DEFINE_string('metrics', None,
                          'comma-separated metrics to summarise, <split>/<name> as '
                          'metrics.jsonl logs them (default: pretraining\'s MLM accuracy '
                          'and loss, its majority baseline and NSP\'s accuracy; of '
                          'fine-tuning runs their last dev evaluation, e.g. dev_rte/accuracy)',
                          flag_values=f)
      flags.DEFINE_string('out', None, 'prefix of .md/.csv (default <root>/summary)',
                          flag_values=f)
      return
    flags.DEFINE_string('config', 'configs/pretrain.py:postln,tiny', 'the config file',
                        flag_values=f)
    flags.DEFINE_string('program', 'train.py', 'train.py or finetune.py', flag_values=f)
    flags.DEFINE_multi_string('sweep', [], 'KEY=V1,V2: values swept (repeat for a product)',
                              flag_values=f)
    flags.DEFINE_multi_string('set', [], 'KEY=VALUE: fixed for every run (repeat)',
                              flag_values=f)
    flags.DEFINE_string('sweep_file', None, 'a python file defining get_hyper(h)',
                        flag_values=f)
    flags.DEFINE_integer('seeds', 1, 'seeds per setting', flag_values=f)
    if cmd == 'print':
      flags.DEFINE_enum('target', 'local', list(sweep.TARGETS), 'where the runs launch',
                        flag_values=f)
  return define


def main(argv=None):
  cmd, argv = cli.command(argv, COMMANDS, 'sweep.py')
  args, _ = cli.parse_tool_flags(_define(cmd), argv, prog=f'sweep.py {cmd}', doc=__doc__)
  args.cmd = cmd

  if args.cmd == 'summarize':
    rows = sweep.collect(args.root, args.metrics.split(',') if args.metrics else None)
    if not rows:
      raise ValueError(f'--root {args.root} holds no runs of a sweep (folders with '
                       f'{RunNames.OVERRIDES}); pass the --root that sweep.py run was given')
    metrics = sweep.check_metrics(rows, list(rows[0]['metrics']), given=bool(args.metrics))
    header, table = sweep.summarize(rows, metrics)
    out = args.out or storage.join(args.root, 'summary')
    markdown = sweep.to_markdown(header, table)
    storage.write_text(out + '.md', markdown)
    storage.write_text(out + '.csv', sweep.to_csv(header, table))
    print(markdown + f'\n(written to {out}.md and {out}.csv)')
    return 0
  sweep.check_program(args.program, args.config)
  runs = sweep.expand(args.sweep, args.set, args.seeds, args.sweep_file,
                      types=sweep.field_types(args.config))
  sweep.check_keys(args.config, runs, here=args.cmd != 'print',
                   flags='--sweep/--set' + ('/--sweep_file' if args.sweep_file else ''))
  # Every --sweep key names the runs, also one given a single value: a sweep extended one
  # value at a time into the same root gives each value a folder of its own.
  swept = [sweep.assignment_key(assignment) for assignment in args.sweep]
  if args.cmd == 'print':
    print(sweep.launch_script(runs, root=args.root, program=args.program, config=args.config,
                              target=args.target, always=swept), end='')
    return 0
  # A run whose loss became nan/inf is a result of its settings: marked, and left out of
  # later calls, which would only repeat it.
  root = sweep.absolute(args.root)
  gone = sweep.diverged(root, runs, swept, sweep.program_and_config(args.program, args.config))
  before = [n for n, g in zip(sweep.folder_names(root, runs, swept), gone) if g]
  for name in before:
    print(f'{name}: diverged (nan/inf) before, not run again (its diverged.json says where; '
          'delete it to run it again)')
  codes = sweep.run_all([r for r, g in zip(runs, gone) if not g], root=root,
                        program=args.program, config=args.config, always=swept)
  failed, diverged = sweep.failed_or_diverged(root, codes)
  # Runs another sweep process held may have finished meanwhile (two processes on one root).
  elsewhere = [n for n, c in codes.items() if c == sweep.RUNNING_ELSEWHERE
               and not sweep.is_done(storage.join(root, n))]
  finished = sum(1 for n, c in codes.items() if c == 0 or
                 (c == sweep.RUNNING_ELSEWHERE and n not in elsewhere))
  print(f'{finished}/{len(runs)} runs finished' +
        (f'; failed: {", ".join(failed)}' if failed else '') +
        (f'; diverged (nan/inf; not run again): {", ".join(before + diverged)}'
         if diverged or before else '') +
        (f'; run by another sweep process: {", ".join(elsewhere)}' if elsewhere else ''))
  return 1 if failed or elsewhere else 0


if __name__ == '__main__':
  sys.exit(cli.run_main(main))
