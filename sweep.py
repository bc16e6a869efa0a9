r"""Sweeps from the command line: run them, print their launch commands, summarise them.

  python sweep.py run --root /tmp/sweep --config configs/pretrain.py:postln,tiny \
      --sweep model.variant=postln,preln,realformer,synth_random_vanilla \
      --sweep optimizer.learning_rate=1e-4,2e-4 --seeds 3 --set train.num_steps=2000
  python sweep.py print --target tpu ... (same arguments)   # one gcloud command per run
  python sweep.py print --target slurm ...                  # one sbatch line per run
  python sweep.py summarize --root /tmp/sweep               # markdown + CSV over seeds

`--sweep key=v1,v2` values are swept (product over all --sweep flags and the seeds),
`--set key=value` is fixed for every run, `--sweep_file F.py` adds a big_vision-style
get_hyper(h) (see realformer/tools/sweep.py). Each run lives in <root>/<its overrides>; finished
runs are skipped and interrupted ones resume. `--program finetune.py` sweeps fine-tuning.
`--root` may be a gs:// URL (the runs, their overrides, logs and the summary live there).
"""

import sys

from realformer import cli
from realformer import storage
from realformer.tools import sweep


def _add_run_args(p):
  p.add_argument('--root', required=True, help='directory holding one workdir per run')
  p.add_argument('--config', default='configs/pretrain.py:postln,tiny')
  p.add_argument('--program', default='train.py')
  p.add_argument('--sweep', action='append', default=[], metavar='KEY=V1,V2')
  p.add_argument('--set', action='append', default=[], metavar='KEY=VALUE')
  p.add_argument('--sweep_file', default=None)
  p.add_argument('--seeds', type=int, default=1)


def main(argv=None):
  parser = cli.ArgumentParser(description=__doc__.split('\n')[0])
  sub = parser.add_subparsers(dest='cmd', required=True)
  _add_run_args(sub.add_parser('run', help='run every unfinished run, one after another'))
  pp = sub.add_parser('print', help='print a launch script instead of running')
  _add_run_args(pp)
  pp.add_argument('--target', default='local', choices=('local', 'tpu', 'slurm'))
  ps = sub.add_parser('summarize', help='final metrics of all runs, over seeds')
  ps.add_argument('--root', required=True)
  ps.add_argument('--metrics', default='eval/mlm_accuracy,eval/nsp_accuracy,eval/loss')
  ps.add_argument('--out', default=None, help='prefix of .md/.csv (default <root>/summary)')
  args = parser.parse_args(argv)

  if args.cmd == 'summarize':
    metrics = args.metrics.split(',')
    header, table = sweep.summarize(sweep.collect(args.root, metrics), metrics)
    out = args.out or storage.join(args.root, 'summary')
    markdown = sweep.to_markdown(header, table)
    storage.write_text(out + '.md', markdown)
    storage.write_text(out + '.csv', sweep.to_csv(header, table))
    print(markdown + f'\n(written to {out}.md and {out}.csv)')
    return 0
  runs = sweep.expand(args.sweep, args.set, args.seeds, args.sweep_file)
  sweep.check_keys(args.config, runs)
  if args.cmd == 'print':
    print(sweep.launch_script(runs, root=args.root, program=args.program, config=args.config,
                              target=args.target), end='')
    return 0
  codes = sweep.run_all(runs, root=args.root, program=args.program, config=args.config)
  failed = [n for n, c in codes.items() if c and c != sweep.RUNNING_ELSEWHERE]  # OTHER_RUN too
  elsewhere = [n for n, c in codes.items() if c == sweep.RUNNING_ELSEWHERE]
  print(f'{list(codes.values()).count(0)}/{len(codes)} runs finished' +
        (f'; failed: {", ".join(failed)}' if failed else '') +
        (f'; run by another sweep process: {", ".join(elsewhere)}' if elsewhere else ''))
  return 1 if failed or elsewhere else 0


if __name__ == '__main__':
  sys.exit(cli.run_main(main))
