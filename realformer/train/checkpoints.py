"""Orbax checkpoints of a run: saving, complete-step detection, restoring, partial restores.

  <run>/checkpoints/<step>/state    {'step', 'params', 'opt_state'} (StandardSave); a
                                    params-only checkpoint has {'step', 'params'}
  <run>/checkpoints/<step>/data     the input iterator's state (pretraining)

Orbax writes a step into a temporary directory and renames it when every host has finished
(on gs://, where a rename copies every object, it writes the step in place and finalizes it
with its commit file instead), and lists only finalized steps, so a step left half-written by
a crash is never restored (it is removed at the next start). Paths are local folders or
gs:// URLs (realformer/storage.py). A params-only restore (an init checkpoint: a run directory,
its checkpoints/ directory or one step directory) is partial: parameters the checkpoint lacks
are reported for the caller to keep fresh, extra ones are ignored. A checkpoint that does not
match the model (a missing or reshaped parameter) is a one-line ValueError naming the
parameter, raised before anything is read. The restart order that uses these is the
trainer's (realformer/train/trainer.py).
"""

import json
import re
from typing import Any, Callable, List, Optional, Tuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax.core import meta

from realformer import storage
from realformer.run_names import RunNames
from realformer.train import distributed

_RUN_FILES = frozenset(v for k, v in vars(RunNames).items() if k.isupper())

# Orbax writes this into a step as the last act before the rename that finalizes it (on
# gs://: as the act that finalizes it); a step directory without it (e.g. a partial copy of
# a workdir, or a step cut short on gs://) is not complete.
COMMIT_FILE = 'commit_success.txt'


def make_manager(workdir: str, *, keep: Optional[int] = 3, read_only: bool = False,
                 item_names=('state', 'data'),
                 fence: Optional[Callable[[], None]] = None) -> ocp.CheckpointManager:
  """The run's CheckpointManager at <workdir>/checkpoints: async saves, keep the last `keep`.

  fence: called on orbax's thread just before a step is finalized (its commit file written,
  or its folder renamed into place); raising there leaves the step uncommitted, and the
  older steps it would have replaced in place. A run passes one that raises once its lock
  is no longer its own, so that a save begun before a take-over never lands in the new
  holder's directory."""
  directory = storage.path(workdir) / RunNames.CHECKPOINTS
  remote = storage.is_url(workdir)
  if remote and not read_only:  # (the other processes list the folder once it is done)
    distributed.on_process_zero(lambda: _remove_uncommitted(directory),
                                f'delete the uncommitted checkpoints in {directory}')
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=not read_only, read_only=read_only,
      # In a bucket, orbax's own clean-up deletes in the background while its constructor
      # lists the folder, which vanishes with its last object: done above, before it.
      cleanup_tmp_directories=not read_only and not remote,
      enable_async_checkpointing=not read_only,
      temporary_path_class=None if fence is None else _fenced(directory, fence))
  manager = ocp.CheckpointManager(directory, item_names=item_names, options=options)
  # Several processes: jax's preemption sync counts the training loop's checks
  # (workdir.StopSignal); orbax would feed it each save's step number as well.
  manager.reached_preemption = lambda step: False
  return manager


def _remove_uncommitted(directory) -> None:
  """Deletes the steps in a bucket's checkpoint folder that were never committed (a run
  killed during a save), before a manager lists it."""
  try:
    steps = [d for d in directory.iterdir()
             if d.name.isdigit() or '.orbax-checkpoint-tmp' in d.name]
  except FileNotFoundError:
    return
  for step_dir in steps:
    if not is_complete(step_dir):
      logging.warning('deleting uncommitted checkpoint %s (no %s)', step_dir, COMMIT_FILE)
      step_dir.rmtree()


def _fenced(directory, fence: Callable[[], None]):
  """Orbax's own way of finalizing a step in `directory` (a commit file on gs://, a rename
  on a local disk), with `fence` called first."""
  base = ocp.path.atomicity_defaults.get_default_temporary_path_class(directory)

  class Fenced(base):  # pylint: disable=missing-class-docstring
    async def finalize(self, *args, **kwargs):
      fence()
      return await super().finalize(*args, **kwargs)

  return Fenced


def is_complete(step_dir) -> bool:
  return (storage.path(step_dir) / COMMIT_FILE).exists()


def complete_steps(workdir) -> List[int]:
  """The finalized steps in <workdir>/checkpoints, oldest first (read-only; no manager)."""
  return _complete_steps_in(storage.path(workdir) / RunNames.CHECKPOINTS)


def _complete_steps_in(folder) -> List[int]:
  """The finalized steps in a folder of steps (an epath), oldest first; [] without it."""
  try:  # listed, not asked is_dir(): gcsfs answers False for a storage that does not answer,
    entries = list(folder.iterdir())  # which would read as "no checkpoint" (a restart from 0)
  except (FileNotFoundError, NotADirectoryError):
    return []
  return sorted(int(d.name) for d in entries
                if re.fullmatch(r'[0-9]+', d.name) and is_complete(d))


def has_complete_step(workdir) -> bool:
  """Whether <workdir>/checkpoints holds a finalized step (read-only; no manager)."""
  return bool(complete_steps(workdir))


def delete_step(manager: ocp.CheckpointManager, step: int) -> None:
  """Deletes a step so that a kill at any moment leaves no step that looks complete: the
  commit marker goes first (orbax removes the folder in no particular order; a step left
  without its state but with its marker would be restored and fail). A collective with
  several processes (process 0 removes the marker: distributed.on_process_zero)."""
  marker = storage.path(manager.directory) / str(step) / COMMIT_FILE
  distributed.on_process_zero(lambda: marker.unlink(missing_ok=True), f'delete {marker}')
  manager.delete(step)


def latest_complete_step(manager: ocp.CheckpointManager) -> Optional[int]:
  """The newest finalized step with orbax's commit marker (None: no checkpoint), as process
  0 found it (agreed_step). Incomplete step directories newer than it are deleted."""
  newest = None
  for step in sorted(manager.all_steps(), reverse=True):
    step_dir = storage.path(manager.directory) / str(step)
    if is_complete(step_dir):
      newest = step
      break
    logging.warning('deleting incomplete checkpoint %s (no %s)', step_dir, COMMIT_FILE)
    manager.delete(step)  # else a later save of this step number would be refused
  return agreed_step(newest)


def agreed_step(step: Optional[int]) -> Optional[int]:
  """`step` as process 0 found it, on every process (called by all): hosts list a folder at
  different moments (a run still training commits and deletes steps in between) or through
  different caches, and restoring different steps would mix them silently."""
  agreed = distributed.from_process_zero(-1 if step is None else step)
  return None if agreed < 0 else agreed


def write_config(workdir, config) -> str:
  """<workdir>/config.json, replaced whole (storage.write_text), by process 0 (the first
  write of a run's start: with several processes all of them stop if it fails,
  distributed.on_process_zero), and beside it the files of its data.tokenizer
  (keep_tokenizer)."""
  path = storage.path(workdir) / RunNames.CONFIG
  distributed.on_process_zero(
      lambda: storage.write_text(path, config.to_json_best_effort(indent=2, sort_keys=True)),
      f'write {path}')
  keep_tokenizer(workdir, config)
  return str(path)


def read_config(workdir) -> dict:
  return json.loads((storage.path(workdir) / RunNames.CONFIG).read_text())


def owning_run(path):
  """The run folder whose checkpoints/ folder, or one step of it, `path` (an epath) is;
  None for any other folder."""
  if path.name == RunNames.CHECKPOINTS:
    return path.parent
  if path.name.isdigit() and path.parent.name == RunNames.CHECKPOINTS:
    return path.parent.parent
  return None


def read_pretraining_config(workdir: str) -> dict:
  """config.json of a workdir that holds an encoder (train.py, an import, or a
  fine-tuning run's best/ and final/), or of the run whose checkpoints/ folder or step
  folder `workdir` is, with a one-line error for anything else."""
  run = storage.path(workdir)
  if not storage.is_file(run / RunNames.CONFIG):  # a run's checkpoints/ folder, or a step
    run = owning_run(run) or run
  path = run / RunNames.CONFIG
  if not storage.is_file(path):
    if kind := _foreign(run):
      raise FileNotFoundError(_import_first(workdir, kind))
    raise FileNotFoundError(f'{workdir} has no {RunNames.CONFIG}: pass a workdir written by '
                            'train.py or realformer.tools.interop')
  try:
    config = read_config(run)
  except (ValueError, UnicodeDecodeError) as e:
    raise ValueError(f'{path} is not valid JSON ({e}); pass a workdir written by train.py '
                     'or realformer.tools.interop') from None
  fine_tuning = isinstance(config, dict) and 'task' in config  # (finetune.py's; no pretraining key)
  if isinstance(config, dict) and 'model_type' in config:
    raise ValueError(_import_first(workdir, 'hf'))
  if fine_tuning or not isinstance(config, dict) or not isinstance(config.get('model'), dict):
    what = ('a fine-tuning run (its config.json is finetune.py\'s)' if fine_tuning else
            f'not a pretraining config ({RunNames.CONFIG} has no model section)')
    raise ValueError(f'{workdir} is {what}: pass a pretraining workdir, or a fine-tuning '
                     'run\'s best/ or final/ folder')
  data = config.get('data')
  tokenizer = data.get('tokenizer') if isinstance(data, dict) else None
  if tokenizer:
    # A workdir that keeps its own vocabulary (keep_tokenizer) reads that one, also moved
    # or copied since: the path it stored may be gone, or another import's now.
    beside = kept_tokenizer(str(run), tokenizer)
    if beside:
      data['tokenizer'] = beside
  return config


# ---- The tokenizer a run directory keeps beside its config.json (an import's vocab.txt,
# a run's copy of its data.tokenizer): its params stand for that vocabulary's pieces.

def kept_tokenizer(workdir: str, tokenizer: str) -> Optional[str]:
  """The copy of data.tokenizer `tokenizer` that the run directory keeps beside its
  config.json (by the file's name), or None."""
  name = tokenizer.rstrip('/').rpartition('/')[2]
  if not tokenizer or name in _RUN_FILES:
    return None
  beside = storage.join(str(workdir), name)
  return beside if storage.is_file(beside) else None


def keep_tokenizer(workdir: str, config) -> None:
  """Copies the files of config.data.tokenizer beside <workdir>/config.json (process 0; a
  collective where the config names a tokenizer file), so that the run directory stands
  alone: the vocabulary its params stand for, with its casing (a tokenizer_config.json
  left by another tokenizer is removed), still there when the folder it came from is
  moved or deleted (an import's); readers of the workdir take the copy
  (read_pretraining_config), and a resume whose data.tokenizer is gone reads it
  (trainer.train). A file of a run's own name is never written."""
  data = config.get('data') if hasattr(config, 'get') else None
  tokenizer = data.get('tokenizer') if data is not None and hasattr(data, 'get') else None
  if not tokenizer:
    return

  def copy():
    if not storage.is_file(tokenizer):
      return
    from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
    sources = tokenizer_lib.files(tokenizer)
    for source in sources:
      name = source.rstrip('/').rpartition('/')[2]
      dest = storage.path(storage.join(str(workdir), name))
      if name in _RUN_FILES:
        continue
      content = storage.path(source).read_bytes()
      if not (dest.is_file() and dest.read_bytes() == content):
        storage.write_bytes(dest, content)
    from data.wordpiece import TOKENIZER_CONFIG  # pylint: disable=g-import-not-at-top
    casing = storage.path(storage.join(str(workdir), TOKENIZER_CONFIG))
    if tokenizer.endswith('.txt') and len(sources) == 1 and casing.is_file():
      casing.unlink()  # (another vocabulary's: this one lower-cases, BertTokenizer's default)

  distributed.on_process_zero(copy, f'copy {tokenizer} into {workdir}')


def save(manager: ocp.CheckpointManager, step: int, state_tree: dict,
         extra_items: Optional[dict] = None, *, force: bool = False) -> bool:
  """Start an async save of {'step','params','opt_state'} as item 'state', beside
  `extra_items` ({name: Orbax save args}, e.g. the data iterator's 'data')."""
  items = {'state': ocp.args.StandardSave(state_tree), **(extra_items or {})}
  return manager.save(step, args=ocp.args.Composite(**items), force=force)


def save_params(workdir: str, params, config, step: int = 0) -> str:
  """A params-only checkpoint (state = {'step', 'params'}) + config.json, e.g. for weights
  imported from elsewhere; init_checkpoint and fine-tuning read it like any other."""
  write_config(workdir, config)
  manager = make_manager(workdir, keep=None, item_names=('state',))
  save(manager, step, {'step': step, 'params': params}, force=True)
  manager.wait_until_finished()
  manager.close()
  return str(storage.path(manager.directory) / str(step))


def _path_str(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k))))
                  for k in path)


def _shapes(tree) -> dict:
  """{'a/b/c': shape} for every array-like leaf (arrays, ShapeDtypeStructs, metadata)."""
  is_leaf = lambda x: hasattr(x, 'shape') and not isinstance(x, dict)
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  return {_path_str(p): tuple(x.shape) for p, x in leaves if hasattr(x, 'shape')}


def stored_tree(step_dir: str) -> Any:
  """The tree of array metadata (shape, dtype) of <step_dir>/state, without reading arrays."""
  meta = ocp.PyTreeCheckpointer().metadata(storage.path(step_dir) / 'state')
  return getattr(meta, 'item_metadata', meta)


def check_matches(step_dir: str, target: dict, *, allow_missing: bool = False,
                  either_layout: bool = False) -> list:
  """Compare a checkpoint's state with the model's abstract target, before reading arrays.

  Returns the target paths the checkpoint lacks (allowed only with allow_missing); raises a
  ValueError naming the first parameter whose shape differs or that is missing, or an
  encoder parameter of the checkpoint that the model has no place for (a model of another
  config, which would run without it: a mixture's weights, say, of a component since
  declared a bias). Heads the model lacks are left behind (a fine-tuning's encoder alone).
  either_layout: the encoder's layers may be stacked in one and unrolled in the other
  (params that restore_params restores; a resumed state's layout is its run's own).
  """
  if either_layout:
    target = _as_stored_layers(step_dir, target)[0]
  stored = _shapes(stored_tree(step_dir))
  wanted_paths = _shapes(target)
  encoders = {p.rsplit('/encoder/', 1)[0] for p in wanted_paths if '/encoder/' in p}
  unused = sorted((p for p in stored if p not in wanted_paths and any(
      p.startswith(e + '/encoder/') for e in encoders)),
                  key=lambda p: (not p.startswith('params/'), p))  # params first
  if unused:
    why = ('; a component of model.attention is now declared `mixed = False` (a bias), '
           'where the code that wrote it mixed it'
           if all(p.rpartition('/')[2] == 'mixture_logits' for p in unused) else '')
    raise ValueError(f'checkpoint {step_dir} does not match the model: it holds {unused[0]}, '
                     f'which the model has no place for ({len(unused)} such){why}; use the '
                     'config.json of the run that wrote it')
  missing = []
  wanted = sorted(_shapes(target).items(), key=lambda kv: not kv[0].startswith('params/'))
  for path, shape in wanted:  # params first: their names are the ones a user knows
    if path not in stored:
      missing.append(path)
    elif stored[path] != shape:
      if path.endswith('position_embeddings/embedding') and stored[path][1:] == shape[1:]:
        fix = (f'set --config.model.max_len={stored[path][0]} (a table longer than '
               'data.max_seq_length is fine)' if stored[path][0] > shape[0] else
               'a position table does not grow; train the first run with '
               f'--config.model.max_len={shape[0]} (BERT keeps its 512 positions from the '
               'first phase, at length 128, on; the tiny preset has 128)')
        raise ValueError(f'checkpoint {step_dir} has {stored[path][0]} positions, this model '
                         f'{shape[0]} (model.max_len): {fix}')
      raise ValueError(f'checkpoint {step_dir} does not match the model: {path} has shape '
                       f'{stored[path]} in the checkpoint but {shape} in the model; use the '
                       f'config.json of the run that wrote it')
  if missing and not allow_missing:
    raise ValueError(f'checkpoint {step_dir} does not match the model: it has no {missing[0]}'
                     f' ({len(missing)} missing); use the config.json of the run that wrote it')
  return missing


def restore(manager: ocp.CheckpointManager, step: int, abstract_state: dict,
            extra_items: Optional[dict] = None) -> Tuple[dict, dict]:
  """Restore {'step','params','opt_state'} into the target's shardings, and the
  `extra_items` ({name: Orbax restore args}): (state tree, {name: restored item})."""
  step_dir = str(storage.path(manager.directory) / str(step))
  check_matches(step_dir, abstract_state)
  extra_items = extra_items or {}
  items = {'state': ocp.args.StandardRestore(abstract_state), **extra_items}
  restored = manager.restore(step, args=ocp.args.Composite(**items))
  return restored['state'], {name: restored[name] for name in extra_items}


def unreadable(workdir: str, step: int, e: BaseException) -> BaseException:
  """The error for a complete checkpoint (its commit file written) of the run in `workdir`
  that cannot be read back: `e` itself where object storage failed (its own one line) or
  memory ran out (the state does not fit, which no other step would change), else a one-line
  ValueError naming the step, why, and the step a resume takes once it is moved out of
  checkpoints/ (nothing is deleted: the older steps stay as they are)."""
  if (storage.fault(e) is not None or not isinstance(e, Exception)
      or isinstance(e, MemoryError) or 'Out of memory' in str(e)):
    return e
  step_dir = storage.join(workdir, RunNames.CHECKPOINTS, str(step))
  older = [s for s in complete_steps(workdir) if s < step]
  *_, root = storage.chain(e)  # the first error (a library wraps the reader's in its own)
  reason = (str(root).strip().splitlines() or [''])[0].split('; ')[0].split(' [source ')[0]
  reason = reason.removeprefix(f'checkpoint {step_dir} ')[:300]
  return ValueError(
      f'checkpoint {step_dir} cannot be read back ({type(root).__name__}: {reason}): a file of '
      'it is damaged or missing (or the model changed since it was written); move that folder '
      f'out of {RunNames.CHECKPOINTS}/ (to {storage.join(workdir, f"unreadable-{step}")}, '
      'say) to ' + (f'resume from step {older[-1]}' if older else 'train from the start'))


def resolve_step_dir(path: str) -> str:
  """A workdir, its checkpoints/ dir or one step dir -> the step dir to read (newest step,
  as process 0 found it). With several processes a checkpoint that some process cannot
  read (a folder on one host's own disk) is a one-line error on every process."""
  try:
    folder, steps, error = *_step_folder(storage.path(path)), None
  except FileNotFoundError as e:
    folder, steps, error = None, [], e
  if jax.process_count() > 1:  # what each process sees: 0 nothing, 1 a step, 2 a run's steps
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    seen = np.ravel(multihost_utils.process_allgather(
        np.int32(0 if error is not None else 1 if steps is None else 2)))
    blind = [i for i, kind in enumerate(seen) if not kind]
    if blind and len(blind) < len(seen) or len(set(seen) - {0}) > 1:
      raise FileNotFoundError(
          f'checkpoint {path} is not the same folder on every process (none on process '
          f'{", ".join(map(str, blind)) or "-"} of {len(seen)}: a folder on one host\'s own '
          'disk?); put it where every host reads it: a shared file system or a gs:// bucket')
  if error is not None:
    raise error
  if steps is None:
    return str(folder)
  newest = agreed_step(steps[-1] if steps else None)
  if newest is None:
    kind = _foreign(folder)
    if kind:
      raise FileNotFoundError(_import_first(path, kind))
    raise FileNotFoundError(f'no complete checkpoint under {folder}; pass a workdir, its '
                            f'checkpoints/ directory or a step directory')
  return str(folder / str(newest))


def _foreign(path) -> Optional[str]:
  """Which other codebase's weights `path` (an epath) holds: 'hf' (a folder whose
  config.json has a model_type), 'tf1' (a folder holding a checkpoint's .index, or a TF1
  checkpoint's prefix, .index, .meta or .data file, as import-tf1 --ckpt takes them), else
  None."""
  if not path.is_dir():
    tf1 = (re.search(r'\.(index|meta|data-\d+-of-\d+)$', path.name) and path.exists()
           or path.parent.joinpath(path.name + '.index').exists())
    return 'tf1' if tf1 else None
  try:
    if 'model_type' in read_config(path):
      return 'hf'
  except (OSError, ValueError, TypeError):
    pass
  return 'tf1' if any(path.glob('*.ckpt*.index')) else None


def _import_first(path, kind: str) -> str:
  """The error for another codebase's weights where a workdir of ours was wanted."""
  how = (f'import-hf --src {path} --out WORKDIR' if kind == 'hf' else
         'import-tf1 --ckpt PREFIX ... (docs/interop.md)')
  return (f'{path} is a {"Hugging Face" if kind == "hf" else "TF1"} checkpoint, not a workdir '
          f'of ours: import it first (python -m realformer.tools.interop {how}) and pass the '
          'WORKDIR it writes')


def _step_folder(path):
  """(path, None) for a step dir; else (the folder of steps, its complete steps, oldest
  first). A path that is neither is a FileNotFoundError; a storage that refuses or does not
  answer raises its own error (storage.is_dir), not that one."""
  if storage.is_dir(path / 'state'):
    return path, None
  if storage.is_dir(path / RunNames.CHECKPOINTS):
    path = path / RunNames.CHECKPOINTS
  if not storage.is_dir(path):
    if kind := _foreign(path):
      raise FileNotFoundError(_import_first(path, kind))
    raise FileNotFoundError(f'checkpoint {path} does not exist; pass a workdir, its '
                            f'checkpoints/ directory or a step directory')
  return path, _complete_steps_in(path)


def restore_params(path: str, abstract_params: Any, *, subtree: Tuple[str, ...] = ()
                   ) -> Tuple[Any, list]:
  """Params-only partial restore from any checkpoint written here (or by interop imports).

  abstract_params: ShapeDtypeStructs of the params to fill (with shardings; without, they
  land on the first local device; flax's boxed leaves, as model.init's abstract tree has
  them, are unboxed), placed at
  state/params/<subtree...> in the checkpoint (e.g. subtree=('encoder',) to restore only
  the encoder into a fine-tuning model). Returns (params, missing paths): what the
  checkpoint lacks is None in the returned tree and listed, for the caller to keep fresh.
  """
  step_dir = resolve_step_dir(path)
  target = meta.unbox(abstract_params)
  for key in reversed(subtree):
    target = {key: target}
  target = {'params': target}
  default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = jax.tree.map(lambda x: x if getattr(x, 'sharding', None) is not None else
                        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=default), target)
  wanted = target
  target, relayout = _as_stored_layers(step_dir, target)
  missing = set(check_matches(step_dir, target, allow_missing=True))
  present = jax.tree_util.tree_map_with_path(
      lambda p, x: None if _path_str(p) in missing else x, target)
  restored = ocp.PyTreeCheckpointer().restore(
      storage.path(step_dir) / 'state',
      args=ocp.args.PyTreeRestore(item=present, partial_restore=True,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(
                                      present)))
  params = relayout(restored, wanted)['params']
  for key in subtree:
    params = params[key]
  if missing:
    logging.warning('init checkpoint %s lacks %d parameters (None in the tree returned; a run '
                    'keeps their fresh values): %s', step_dir,
                    len(missing), sorted(missing)[:10])
  return params, sorted(missing)


def _as_stored_layers(step_dir: str, target: dict) -> Tuple[dict, Callable]:
  """(the target with its encoder's layers laid out as the checkpoint stores them, a function
  of (what was restored in that layout, the target) that lays them out as the target has
  them). model.scan_layers stacks the layers' parameters ('layers' [L, ...], each leading
  axis unsharded); unrolled they are 'layers_0' ... 'layers_{L-1}'. A run restores either
  layout into either (a fine-tuning that scans the layers of an unrolled pretraining, a
  second phase that stops scanning them); the arrays stay sharded as the target asks."""
  encoder = target['params'].get('encoder')
  if not isinstance(encoder, dict):
    return target, lambda restored, _: restored
  stored = stored_tree(step_dir).get('params', {}).get('encoder', {})
  stacked = 'layers' in encoder
  if stacked == ('layers' in stored) or not ('layers' in stored or 'layers_0' in stored):
    return target, lambda restored, _: restored
  if stacked:
    num_layers = jax.tree.leaves(encoder['layers'])[0].shape[0]
    per_layer = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=_spec_shifted(x, -1)),
        encoder['layers'])
    laid = {k: v for k, v in encoder.items() if k != 'layers'}
    laid.update({f'layers_{i}': per_layer for i in range(num_layers)})
  else:
    num_layers = sum(1 for k in encoder if re.fullmatch(r'layers_\d+', k))
    laid = {k: v for k, v in encoder.items() if not re.fullmatch(r'layers_\d+', k)}
    laid['layers'] = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((num_layers,) + x.shape, x.dtype,
                                       sharding=_spec_shifted(x, 1)), encoder['layers_0'])

  # (eager ops, whose programs are cached by shape: one compile per distinct parameter
  # shape, not one per layer and parameter)
  def relayout(restored, wanted):
    enc, want = restored['params']['encoder'], wanted['params']['encoder']
    if stacked:
      layers = [enc.pop(f'layers_{i}') for i in range(num_layers)]
      enc['layers'] = jax.tree.map(
          lambda w, *xs: None if any(x is None for x in xs) else jax.device_put(
              jax.numpy.stack(xs), w.sharding),
          want['layers'], *layers, is_leaf=lambda x: x is None)
    else:
      layers = enc.pop('layers')
      for i in range(num_layers):
        enc[f'layers_{i}'] = jax.tree.map(
            lambda w, x, i=i: None if x is None else jax.device_put(
                jax.lax.dynamic_index_in_dim(x, i, keepdims=False), w.sharding),
            want[f'layers_{i}'], layers, is_leaf=lambda x: x is None)
    return restored

  return ({**target, 'params': {**target['params'], 'encoder': laid}}, relayout)


def _spec_shifted(x, by: int):
  """x's sharding for its array with a leading (layer) axis added (by=1, unsharded) or
  removed (by=-1)."""
  sharding = x.sharding
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  spec = tuple(sharding.spec)
  spec = (None,) + spec if by > 0 else spec[1:]
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
