"""The name of every file and folder of a run directory, in one place: the layout.

RunDir (train/run_dir.py) presents these names to programs and readers; the modules below it
that write a run's files (train/checkpoints.py, machine.py, workdir.py; data/pipeline.py,
which prepares into data/) take theirs from here.

  .lock                 the run's holder (host, pid, program, start); see workdir.Lock (a
                        leased object on gs://: storage.Lease)
  config.json           the run's full config (model, data.tokenizer, ...)
  vocab.txt, tokenizer_config.json, or <name>.model
                        a copy of the files of data.tokenizer, beside each config.json that
                        names one (a pretraining run's, an import's, best/'s and final/'s:
                        checkpoints.keep_tokenizer)
  checkpoints/<step>/   Orbax checkpoints: state (step, params, opt_state) and data (the input
                        stream's position, pretraining only)
  metrics.jsonl         one JSON line per logged step and split (metrics_jsonl)
  events.out.tfevents.* TensorBoard events (metrics.TensorBoardWriter)
  machine.jsonl         one line per start: processor, cores, jax, devices (machine.facts)
  time_spent.json       {step: seconds} of a time-budgeted run (train.time_budget_minutes)
  length_buckets.json   the compiled sequence lengths of a fine-tuning run, their settings and
                        a checksum of its training examples (a resume on others is refused)
  best/                 params of the best evaluation so far, params-only, + config.json and
                        results.json (fine-tuning)
  final/                params of a finished run whose optimizer state was dropped
  predictions/          test-set predictions (fine-tuning; GLUE's and tsv tasks' dev/ holds
                        each dev set's predictions with the model's logits)
  results.json          the finished run's summary (fine-tuning)
  data/                 prepared pretraining shards when data.prepared_dir is empty
  A run that a sweep or a grid started (realformer/tools/sweep.py) also holds:
  overrides.json        the overrides that name it in its sweep
  command.json          its program and config file (a folder is never resumed by another)
  log.txt               the program's output
  DONE                  written once the program exited 0
  LOCK                  the sweep process running it (a flock, or a lease on gs://)
  diverged.json         the run's loss became nan/inf: a study or a grid runs it no more
                        (tools/sweep.mark_diverged)
"""


class RunNames:
  """File and folder names inside a run directory (see the module docstring)."""
  LOCK = '.lock'
  CONFIG = 'config.json'
  CHECKPOINTS = 'checkpoints'
  METRICS = 'metrics.jsonl'
  MACHINE = 'machine.jsonl'
  TIME_SPENT = 'time_spent.json'
  LENGTH_BUCKETS = 'length_buckets.json'
  BEST = 'best'
  FINAL = 'final'
  PREDICTIONS = 'predictions'
  RESULTS = 'results.json'
  DATA = 'data'
  OVERRIDES = 'overrides.json'
  COMMAND = 'command.json'
  LOG = 'log.txt'
  DONE = 'DONE'
  SWEEP_LOCK = 'LOCK'
  DIVERGED = 'diverged.json'
