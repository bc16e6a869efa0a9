r"""Checkpoint interop: HF BERT and TF1 BERT / RealFormer checkpoints <-> our encoder.

  python -m realformer.tools.interop import-hf --src /path/to/hf_bert_dir --out /tmp/minilm
  python -m realformer.tools.interop import-tf1 --ckpt /ckpt/model.ckpt-1000000 \
      --bert_config /ckpt/bert_config.json --vocab /ckpt/vocab.txt --out /tmp/rf_base \
      --variant postln|realformer [--cased] [--gelu erf|tanh]
  (either import with --encoder_only: the encoder alone, its pretraining heads left out)
  python -m realformer.tools.interop export-hf --workdir /tmp/minilm --out /tmp/minilm_hf
  python -m realformer.tools.interop export-tf1 --workdir /tmp/rf_base --out /tmp/rf_base_tf1
  (either export with --encoder_only: the encoder alone)

An import writes a params-only workdir that fine-tuning and `train.init_checkpoint` read
like any other (realformer/train/checkpoints.py):
  <out>/checkpoints/0/state   {'step': 0, 'params': {'encoder', ['mlm_head'], ['nsp_head']}}
  <out>/config.json           configs/pretrain.py's config with the checkpoint's sizes;
                              data.tokenizer = <out>/vocab.txt
  <out>/vocab.txt, <out>/tokenizer_config.json   the WordPiece vocabulary and its casing
The heads are imported when the checkpoint has them (HF `cls.predictions.*`,
`cls.seq_relationship.*`; TF1 `cls/...`). The name mapping is in docs/interop.md and in
`name_map` below, the one place the code keeps it.

Layouts: torch Linear weights are [out, in] and are transposed into flax's [in, out]
kernels; TF1 kernels are already [in, out], except BERT's NSP `output_weights` [2, D]. Our
query/key/value/out kernels are 2-D ([D, H*dh], heads reshaped inside the attention), so
they map one to one without reshapes. The word embeddings and the MLM output bias are padded
with zeros to a multiple of model.vocab_pad_multiple (and unpadded on export). HF's
hidden_act 'gelu' is the exact erf GELU, 'gelu_new' (and its aliases) the tanh approximation:
model.gelu 'erf' or 'tanh'. A TF1 bert_config's hidden_act 'gelu' is either, by the code
that trained it (import-tf1 --gelu, or the config's own "gelu" key that export-tf1 writes;
TF1_GELU has the defaults). RealFormer's use_running_mean is read too.

Reading safetensors needs only `safetensors` + NumPy; pytorch_model.bin needs torch; TF1
checkpoints, read or written, need TensorFlow (the CPU build is enough).
"""

import dataclasses
import functools
import json
import os
import re
import shutil
import socket
import stat
import tempfile
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from absl import flags
from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from data import tokenizer as tokenizer_lib
from data import wordpiece
from realformer import cli
from realformer import models
from realformer import storage
from realformer.model.spec import resolve
from realformer.train import checkpoints
from realformer.train.run_dir import RunDir

HF_CONFIG = 'config.json'
HF_SAFETENSORS = 'model.safetensors'
HF_SAFETENSORS_INDEX = 'model.safetensors.index.json'
HF_TORCH_BIN = 'pytorch_model.bin'
VOCAB = 'vocab.txt'
HF_TOKENIZER_JSON = 'tokenizer.json'  # a fast tokenizer; transformers 5 saves no vocab.txt
# Prefixes of tensor names that give away another architecture than BERT.
_FOREIGN_PREFIXES = {
    'roberta': 'RoBERTa', 'albert': 'ALBERT', 'electra': 'ELECTRA', 'distilbert': 'DistilBERT',
    'deberta': 'DeBERTa', 'xlm-roberta': 'XLM-RoBERTa', 'xlmroberta': 'XLM-RoBERTa',
    'camembert': 'CamemBERT', 'mpnet': 'MPNet', 'longformer': 'Longformer',
    'transformer': 'a non-BERT transformer'}
# HF tensors that are derived from others or are buffers: never needed.
_HF_IGNORED = ('embeddings.position_ids', 'cls.predictions.decoder.weight',
               'cls.predictions.decoder.bias')
# TF1 variables that are training state, not weights.
_TF1_IGNORED_SUFFIXES = ('/adam_m', '/adam_v', '/Adam', '/Adam_1', 'global_step',
                         '/Momentum', '/accumulator')

# How a tensor is laid out in each format (ours are flax [in, out] kernels):
#   linear     torch [out, in] (transposed); TF1 [in, out]
#   linear_t   torch [out, in] and TF1 [out, in] (BERT's NSP output_weights [2, D])
#   vocab      rows indexed by the vocabulary: padded to the padded vocab size with zeros
#   same       identical in every format


@dataclasses.dataclass(frozen=True)
class Entry:
  """One parameter: our path under `params`, its HF and TF1 names, how it is laid out."""
  ours: Tuple[str, ...]
  hf: str   # without the 'bert.' prefix of BertForPreTraining for encoder tensors
  tf1: str
  kind: str
  group: str  # 'encoder' | 'mlm_head' | 'nsp_head' (our top-level key)


def _dense(ours, hf, tf1, group, kind='linear'):
  return [Entry(ours + ('kernel',), f'{hf}.weight', f'{tf1}/kernel', kind, group),
          Entry(ours + ('bias',), f'{hf}.bias', f'{tf1}/bias', 'same', group)]


def _layer_norm(ours, hf, tf1, group):
  return [Entry(ours + ('scale',), f'{hf}.weight', f'{tf1}/gamma', 'same', group),
          Entry(ours + ('bias',), f'{hf}.bias', f'{tf1}/beta', 'same', group)]


def name_map(num_layers: int, *, heads: Sequence[str] = ('mlm_head', 'nsp_head')
             ) -> List[Entry]:
  """Every parameter of a Post-LN / RealFormer encoder (+ the named heads), in order."""
  enc = ('encoder',)
  entries = [
      Entry(enc + ('embeddings', 'word_embeddings', 'embedding'),
            'embeddings.word_embeddings.weight', 'bert/embeddings/word_embeddings', 'vocab',
            'encoder'),
      Entry(enc + ('embeddings', 'position_embeddings', 'embedding'),
            'embeddings.position_embeddings.weight', 'bert/embeddings/position_embeddings',
            'same', 'encoder'),
      Entry(enc + ('embeddings', 'token_type_embeddings', 'embedding'),
            'embeddings.token_type_embeddings.weight', 'bert/embeddings/token_type_embeddings',
            'same', 'encoder'),
  ]
  entries += _layer_norm(enc + ('embeddings', 'layer_norm'), 'embeddings.LayerNorm',
                         'bert/embeddings/LayerNorm', 'encoder')
  for i in range(num_layers):
    ours, hf, tf1 = enc + (f'layers_{i}',), f'encoder.layer.{i}', f'bert/encoder/layer_{i}'
    for proj in ('query', 'key', 'value'):
      entries += _dense(ours + ('attention', proj), f'{hf}.attention.self.{proj}',
                        f'{tf1}/attention/self/{proj}', 'encoder')
    entries += _dense(ours + ('attention', 'out'), f'{hf}.attention.output.dense',
                      f'{tf1}/attention/output/dense', 'encoder')
    entries += _layer_norm(ours + ('attention_layer_norm',), f'{hf}.attention.output.LayerNorm',
                           f'{tf1}/attention/output/LayerNorm', 'encoder')
    entries += _dense(ours + ('mlp', 'intermediate'), f'{hf}.intermediate.dense',
                      f'{tf1}/intermediate/dense', 'encoder')
    entries += _dense(ours + ('mlp', 'output'), f'{hf}.output.dense', f'{tf1}/output/dense',
                      'encoder')
    entries += _layer_norm(ours + ('mlp_layer_norm',), f'{hf}.output.LayerNorm',
                           f'{tf1}/output/LayerNorm', 'encoder')
  entries += _dense(enc + ('pooler',), 'pooler.dense', 'bert/pooler/dense', 'encoder')
  if 'mlm_head' in heads:
    entries += _dense(('mlm_head', 'transform'), 'cls.predictions.transform.dense',
                      'cls/predictions/transform/dense', 'mlm_head')
    entries += _layer_norm(('mlm_head', 'layer_norm'), 'cls.predictions.transform.LayerNorm',
                           'cls/predictions/transform/LayerNorm', 'mlm_head')
    entries.append(Entry(('mlm_head', 'output_bias'), 'cls.predictions.bias',
                         'cls/predictions/output_bias', 'vocab', 'mlm_head'))
  if 'nsp_head' in heads:
    entries.append(Entry(('nsp_head', 'kernel'), 'cls.seq_relationship.weight',
                         'cls/seq_relationship/output_weights', 'linear_t', 'nsp_head'))
    entries.append(Entry(('nsp_head', 'bias'), 'cls.seq_relationship.bias',
                         'cls/seq_relationship/output_bias', 'same', 'nsp_head'))
  return entries


# ----------------------------------------------------------------------------------------
# Model config and the target parameter shapes.
# ----------------------------------------------------------------------------------------

# hidden_act names and the GELU each computes (model.gelu). TF1's 'gelu' depends on the code
# that trained the checkpoint, so its importer says which (import-tf1 --gelu).
HF_GELUS = {'gelu': 'erf', 'gelu_python': 'erf', 'gelu_new': 'tanh',
            'gelu_pytorch_tanh': 'tanh', 'gelu_fast': 'tanh'}
EXPORT_ACT = {'erf': 'gelu', 'tanh': 'gelu_new'}


def model_config_from_bert(bert: dict, *, variant: str = 'postln', source: str = 'config',
                           tf1_gelu: Optional[str] = None) -> ml_collections.ConfigDict:
  """An HF config.json / TF1 bert_config.json dict -> our full run config (config.model set).

  tf1_gelu: for a TF1 bert_config, the GELU ('erf' or 'tanh') its hidden_act 'gelu' means;
  None reads hidden_act as HF names it."""
  required = ('vocab_size', 'hidden_size', 'num_hidden_layers', 'num_attention_heads',
              'intermediate_size')
  missing = [k for k in required if k not in bert]
  if missing:
    raise ValueError(f'{source} lacks {", ".join(missing)}; it is not a BERT config')
  act = bert.get('hidden_act', 'gelu')
  gelus = {'gelu': tf1_gelu} if tf1_gelu else HF_GELUS
  if tf1_gelu and act in HF_GELUS and act not in gelus:  # (an HF name: its form is --gelu's)
    raise ValueError(f'{source} has hidden_act={act!r}, an HF name; a TF1 BERT config says '
                     f'"gelu" and --gelu erf|tanh says which one it computed: set hidden_act '
                     f'to "gelu" and pass --gelu {HF_GELUS[act]}')
  if act not in gelus:
    raise ValueError(f'{source} has hidden_act={act!r}; our encoder implements GELU only '
                     f'({", ".join(gelus)}), so the outputs would differ')
  running_mean = bool(bert.get('use_running_mean', False))
  if running_mean and variant != 'realformer':
    raise ValueError(f'{source} has use_running_mean=true, a RealFormer setting; import it '
                     'as --variant realformer')
  position = bert.get('position_embedding_type', 'absolute')
  if position != 'absolute':
    raise ValueError(f'{source} has position_embedding_type={position!r}; only learned '
                     'absolute positions are implemented')
  config = cli.load_config(f'configs/pretrain.py:{variant},base')
  m = config.model
  m.num_layers = int(bert['num_hidden_layers'])
  m.hidden_size = int(bert['hidden_size'])
  m.num_heads = int(bert['num_attention_heads'])
  m.mlp_dim = int(bert['intermediate_size'])
  m.vocab_size = int(bert['vocab_size'])
  m.max_len = int(bert.get('max_position_embeddings', 512))
  m.type_vocab_size = int(bert.get('type_vocab_size', 2))
  # TF1 BERT's layer_norm (tf.contrib) uses epsilon 1e-12, as does HF's default.
  m.layer_norm_eps = float(bert.get('layer_norm_eps', 1e-12))
  m.initializer_range = float(bert.get('initializer_range', 0.02))
  m.dropout_rate = float(bert.get('hidden_dropout_prob', 0.1))
  m.attention_dropout_rate = float(bert.get('attention_probs_dropout_prob', 0.1))
  m.gelu = gelus[act]
  m.running_mean = running_mean  # the official RealFormer code's option for deep models
  config.data.max_seq_length = min(config.data.max_seq_length, m.max_len)
  try:
    resolve(m)  # validates (e.g. hidden_size divisible by num_heads)
  except ValueError as e:
    raise ValueError(f'{source} describes no encoder this codebase builds ({e}, in our '
                     'config\'s names); pass the checkpoint\'s own config') from None
  return config


def abstract_params(model_config, head: str = 'pretraining') -> dict:
  """ShapeDtypeStructs of the model's unboxed params (nothing allocated)."""
  model = models.build(model_config, head=head)
  batch = {k: jnp.zeros((1, 2), jnp.int32) for k in ('input_ids', 'segment_ids',
                                                      'attention_mask')}
  variables = jax.eval_shape(model.init, jax.random.key(0), batch)
  return nn.meta.unbox(variables)['params']


def _get(tree: dict, path: Tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree: dict, path: Tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


# ----------------------------------------------------------------------------------------
# Conversion between a flat {name: array} checkpoint and our params tree.
# ----------------------------------------------------------------------------------------

def _source_shape(entry: Entry, target: Tuple[int, ...], vocab_size: int, fmt: str):
  """The shape the checkpoint must have for a target (our) shape."""
  if entry.kind == 'vocab':
    return (vocab_size,) + tuple(target[1:])
  if entry.kind == 'linear_t' or (entry.kind == 'linear' and fmt == 'hf'):
    return tuple(target[::-1])
  return tuple(target)


def _to_ours(entry: Entry, x: np.ndarray, target: Tuple[int, ...], fmt: str) -> np.ndarray:
  x = np.asarray(x, dtype=np.float32)
  if entry.kind == 'vocab':
    pad = [(0, target[0] - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    return np.pad(x, pad)
  if entry.kind == 'linear_t' or (entry.kind == 'linear' and fmt == 'hf'):
    return np.ascontiguousarray(x.T)
  return x


def _from_ours(entry: Entry, x: np.ndarray, vocab_size: int, fmt: str) -> np.ndarray:
  x = np.asarray(x, dtype=np.float32)
  if entry.kind == 'vocab':
    return np.ascontiguousarray(x[:vocab_size])
  if entry.kind == 'linear_t' or (entry.kind == 'linear' and fmt == 'hf'):
    return np.ascontiguousarray(x.T)
  return np.ascontiguousarray(x)


def convert_to_params(tensors: Dict[str, np.ndarray], model_config, *, fmt: str,
                      source: str, heads: Sequence[str]) -> Tuple[dict, set]:
  """Flat checkpoint tensors -> (our params tree {'encoder', [heads]} of float32 NumPy
  arrays, the names of the tensors used).

  fmt: 'hf' (names without 'bert.') or 'tf1'. A missing tensor or a shape that does not
  match the config is a ValueError naming the tensor (the pooler alone may be missing, as in
  HF models saved without one: it is then initialized like BERT's, N(0, initializer_range)).
  """
  target = abstract_params(model_config)
  vocab_size = int(model_config.vocab_size)
  params: dict = {}
  used = set()
  for entry in name_map(int(model_config.num_layers), heads=heads):
    name = entry.hf if fmt == 'hf' else entry.tf1
    shape = tuple(_get(target, entry.ours).shape)
    if name not in tensors:
      if entry.ours[:2] == ('encoder', 'pooler'):
        logging.warning('%s has no %s: the pooler is initialized fresh', source, name)
        rng = np.random.default_rng(0)
        value = (rng.normal(0.0, model_config.initializer_range, shape).astype(np.float32)
                 if entry.ours[-1] == 'kernel' else np.zeros(shape, np.float32))
        _set(params, entry.ours, value)
        continue
      raise ValueError(f'{source} has no tensor {name!r} (needed for our '
                       f'{"/".join(entry.ours)}); is it a BERT checkpoint with '
                       f'{model_config.num_layers} layers as its config says?')
    x = tensors[name]
    want = _source_shape(entry, shape, vocab_size, fmt)
    if tuple(x.shape) != want:
      raise ValueError(f'{source}: tensor {name!r} has shape {tuple(x.shape)} but the config '
                       f'implies {want}; the checkpoint and its config do not match')
    _set(params, entry.ours, _to_ours(entry, x, shape, fmt))
    used.add(name)
  return params, used


def convert_from_params(params: dict, model_config, *, fmt: str = 'hf') -> Dict[str, np.ndarray]:
  """Our params tree -> flat tensors in HF (without 'bert.') or TF1 naming, vocab unpadded.
  A parameter the mapping has no place for (a model changed beyond BERT) is an error: the
  export would compute without it."""
  heads = [h for h in ('mlm_head', 'nsp_head') if h in params]
  out, mapped = {}, set()
  for entry in name_map(int(model_config.num_layers), heads=heads):
    x = np.asarray(_get(params, entry.ours))
    out[entry.hf if fmt == 'hf' else entry.tf1] = _from_ours(
        entry, x, int(model_config.vocab_size), fmt)
    mapped.add(entry.ours)
  paths = {tuple(getattr(k, 'key', k) for k in path)
           for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
  extra = sorted('/'.join(p) for p in paths - mapped if p[0] in ('encoder',) + tuple(heads))
  if extra:
    raise ValueError(f'{len(extra)} parameters have no place in BERT\'s {fmt.upper()} layout '
                     f'(e.g. {extra[0]}); this encoder is not a BERT and cannot be exported')
  return out


# ----------------------------------------------------------------------------------------
# Writing an imported workdir.
# ----------------------------------------------------------------------------------------

def write_workdir(out: str, params: dict, config: ml_collections.ConfigDict, vocab: str,
                  normalization: dict) -> str:
  """<out>/vocab.txt (+ tokenizer_config.json with the `normalization` settings:
  do_lower_case, strip_accents, tokenize_chinese_chars), config.json and checkpoints/0/state.

  Written into a sibling folder <out>.import-<host>-<pid> and renamed to `out` when complete,
  so `out` is never half-made, whatever stops the import (kill -9 included); such a folder
  left by a dead import on this host is removed by the next import to the same `out`.
  A gs:// `out` is written in place: its checkpoint is committed by Orbax's commit file, so
  an import cut short leaves no complete checkpoint there (and `out` is then not empty: a
  new import refuses it until it is deleted)."""
  out = _new_out(out)
  tokenizer = wordpiece.WordPieceTokenizer.load(vocab)  # checks the special tokens
  if tokenizer.vocab_size != config.model.vocab_size:
    raise ValueError(f'{vocab} has {tokenizer.vocab_size} pieces but the checkpoint\'s config '
                     f'says vocab_size={config.model.vocab_size}; pass the vocab.txt that '
                     'belongs to the checkpoint')
  tokenizer_config = json.dumps(dict(normalization, tokenizer_class='BertTokenizer'))
  if storage.is_url(out):
    storage.upload(vocab, storage.join(out, VOCAB))
    storage.write_text(storage.join(out, wordpiece.TOKENIZER_CONFIG), tokenizer_config)
    config.data.tokenizer = storage.join(out, VOCAB)
    step_dir = checkpoints.save_params(out, params, config, step=0)
    logging.info('wrote %s', step_dir)
    return step_dir
  _remove_dead_imports(out)
  tmp = f'{out}.import-{socket.gethostname()}-{os.getpid()}'
  try:
    os.makedirs(tmp)
    shutil.copyfile(vocab, os.path.join(tmp, VOCAB))
    with open(os.path.join(tmp, wordpiece.TOKENIZER_CONFIG), 'w') as f:
      f.write(tokenizer_config)
    config.data.tokenizer = os.path.join(out, VOCAB)  # where it will be
    step = os.path.relpath(checkpoints.save_params(tmp, params, config, step=0), tmp)
    if os.path.isdir(out):
      os.rmdir(out)  # the empty folder _new_out allowed (an error if it filled meanwhile)
    os.rename(tmp, out)
  except OSError as e:
    shutil.rmtree(tmp, ignore_errors=True)
    if os.path.exists(out) and os.listdir(out):
      raise ValueError(f'--out {out} was filled by something else during the import; choose '
                       'a new --out') from e
    raise
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  step_dir = os.path.join(out, step)
  logging.info('wrote %s', step_dir)
  return step_dir


def _remove_dead_imports(out: str) -> None:
  """The <out>.import-<this host>-<pid> folders of imports that were killed."""
  prefix = f'{os.path.basename(out)}.import-{socket.gethostname()}-'
  parent = os.path.dirname(out)
  for name in os.listdir(parent) if os.path.isdir(parent) else []:
    pid = name[len(prefix):]
    if name.startswith(prefix) and pid.isdigit() and not _pid_alive(int(pid)):
      logging.warning('removing %s, left by an import that was stopped',
                      os.path.join(parent, name))
      shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def _new_out(out: str) -> str:
  """An import writes a new workdir: `out` must not exist or be an empty folder."""
  storage.check_location(out, '--out')  # a local import is committed by a folder rename
  if storage.is_url(out):
    if storage.path(out).exists() and any(storage.path(out).iterdir()):
      raise ValueError(f'--out {out} exists and is not empty (an import cut short leaves its '
                       'objects there: delete them to import into it); choose a new --out')
    return out.rstrip('/')
  out = os.path.abspath(out)
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise ValueError(f'--out {out} exists and is not an empty directory; choose a new --out')
  return out


# The files of an HF checkpoint folder that an import reads (a gs:// --src is copied locally).
_HF_FILES = (HF_CONFIG, VOCAB, HF_TOKENIZER_JSON, wordpiece.TOKENIZER_CONFIG, HF_SAFETENSORS,
             HF_SAFETENSORS_INDEX, HF_TORCH_BIN)


def _local_file(path: str) -> str:
  """`path` itself, or for a gs:// object this host's checked copy of it (storage.local_copy);
  a URL that names no object is returned as given (the caller's check reports it)."""
  if not storage.is_url(path) or not storage.path(path).is_file():
    return path
  folder, _, name = path.rstrip('/').rpartition('/')
  return os.path.join(storage.local_copy(folder, [name], kind='interop'), name)


def _local_files(folder: str, keep: Callable[[str], bool]) -> str:
  """A local folder holding the files of `folder` that `keep` accepts: `folder` itself, or
  for a gs:// folder this host's checked copy of them."""
  if not storage.is_url(folder) or not storage.path(folder).is_dir():
    return folder
  names = [p.name for p in storage.path(folder).iterdir() if keep(p.name)]
  return storage.local_copy(folder, names, kind='interop')


def _capitals(vocab: str) -> Tuple[List[str], bool]:
  """wordpiece.capitalised of a vocab.txt's pieces."""
  with open(vocab, encoding='utf-8', errors='replace') as f:
    return wordpiece.capitalised([line.rstrip('\n') for line in f])


def _check_vocab(vocab: str, do_lower_case: bool) -> None:
  """The vocabulary exists, and its pieces agree with --cased: a vocabulary with many
  capitalised pieces is a cased one (lower-cased input would never use them), an error
  without --cased; --cased with none is only warned about (a cased vocabulary of a script
  without capitals keeps its combining marks with --cased)."""
  if not os.path.isfile(vocab):
    raise FileNotFoundError(f'vocabulary {vocab!r} not found; pass the checkpoint\'s vocab.txt')
  capitals, cased = _capitals(vocab)
  if do_lower_case and cased:
    raise ValueError(f'{vocab} holds {len(capitals)} pieces with capitals (e.g. '
                     f'{capitals[:3]}): a cased vocabulary; pass --cased')
  if not do_lower_case and not capitals:
    logging.warning('%s has no piece with a capital: an uncased vocabulary, unless its script '
                    'has no capitals; without --cased the input is lower-cased and its '
                    'accents stripped', vocab)


# ----------------------------------------------------------------------------------------
# HF.
# ----------------------------------------------------------------------------------------

def _foreign_architecture(names) -> Optional[str]:
  for name in names:
    prefix = name.split('.', 1)[0].lower()
    if prefix in _FOREIGN_PREFIXES:
      return _FOREIGN_PREFIXES[prefix]
  return None


def read_hf_tensors(src: str) -> Dict[str, np.ndarray]:
  """All tensors of an HF checkpoint directory as NumPy float arrays, names as stored.

  model.safetensors (or a sharded model.safetensors.index.json) is read with
  safetensors.numpy; pytorch_model.bin needs torch (imported only then).
  """
  single = os.path.join(src, HF_SAFETENSORS)
  index = os.path.join(src, HF_SAFETENSORS_INDEX)
  if os.path.isfile(single) or os.path.isfile(index):
    from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
    from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top

    def load(path):
      try:
        return load_file(path)
      except SafetensorError as e:
        raise ValueError(f'{path} is not a readable safetensors file ({e}); download it '
                         'again (an interrupted download or a Git LFS pointer reads so)'
                         ) from None
    if os.path.isfile(single):
      return dict(load(single))
    try:
      with open(index) as f:
        files = sorted(set(json.load(f)['weight_map'].values()))
    except (ValueError, KeyError, TypeError, AttributeError):
      raise ValueError(f'{index} is not a safetensors index (JSON with a weight_map); '
                       'download it again') from None
    tensors = {}
    for name in files:
      tensors.update(load(os.path.join(src, name)))
    return tensors
  binary = os.path.join(src, HF_TORCH_BIN)
  if os.path.isfile(binary):
    try:
      import torch  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ImportError(f'{binary} is a PyTorch pickle and reading it needs torch '
                        '(pip install torch), or convert it to model.safetensors') from None
    state = torch.load(binary, map_location='cpu', weights_only=True)
    return {k: v.float().numpy() if v.is_floating_point() else v.numpy()
            for k, v in state.items()}
  raise FileNotFoundError(f'{src} has neither {HF_SAFETENSORS} nor {HF_TORCH_BIN}; pass an HF '
                          'checkpoint directory')


def _normalize_hf_names(tensors: Dict[str, np.ndarray], source: str) -> Dict[str, np.ndarray]:
  """Strip BertFor*'s 'bert.' prefix; old checkpoints' LayerNorm gamma/beta -> weight/bias."""
  foreign = _foreign_architecture(tensors)
  if foreign:
    raise ValueError(f'{source} holds tensors of {foreign} (e.g. '
                     f'{next(n for n in tensors if _foreign_architecture([n]))!r}), not of '
                     'BERT; only BERT checkpoints can be imported')
  out = {}
  for name, x in tensors.items():
    if name.startswith('bert.'):
      name = name[len('bert.'):]
    if name.endswith('LayerNorm.gamma'):
      name = name[:-len('gamma')] + 'weight'
    elif name.endswith('LayerNorm.beta'):
      name = name[:-len('beta')] + 'bias'
    out[name] = x
  if 'embeddings.word_embeddings.weight' not in out:
    raise ValueError(f'{source} has no embeddings.word_embeddings.weight (first tensors: '
                     f'{sorted(tensors)[:3]}); it is not a BERT checkpoint')
  return out


def _present_heads(names, mlm_prefix: str, nsp_prefix: str) -> List[str]:
  heads = []
  if any(n.startswith(mlm_prefix) for n in names):
    heads.append('mlm_head')
  if any(n.startswith(nsp_prefix) for n in names):
    heads.append('nsp_head')
  return heads


_LAYER = re.compile(r'encoder[./]layer[._](\d+)[./]')  # HF encoder.layer.N., TF1 encoder/layer_N/


def _check_unused(tensors, used, ignored: Callable[[str], bool], source: str,
                  num_layers: int) -> None:
  """Encoder layers the config does not count are an error (they would be dropped); other
  tensors left over are warned about."""
  unused = sorted(n for n in tensors if n not in used and not ignored(n))
  layers = {int(m.group(1)) for m in map(_LAYER.search, unused) if m}
  if layers and max(layers) >= num_layers:
    raise ValueError(f'{source} holds {max(layers) + 1} encoder layers but its config says '
                     f'num_hidden_layers={num_layers}; pass the config that belongs to the '
                     'checkpoint')
  if unused:
    logging.warning('%s: %d tensors not imported, e.g. %s', source, len(unused), unused[:5])


def _hf_config_path(src: str) -> str:
  """src's config.json; a one-line error, naming a subfolder that has one, where it has none."""
  path = os.path.join(src, HF_CONFIG)
  if os.path.isfile(path):
    return path
  inside = (sorted(d for d in os.listdir(src) if os.path.isfile(os.path.join(src, d, HF_CONFIG)))
            if os.path.isdir(src) else [])
  where = f' (its subfolder {os.path.join(src, inside[0])} has one)' if inside else ''
  raise FileNotFoundError(f'{src} has no {HF_CONFIG}{where}; pass an HF checkpoint directory '
                          '(config.json, model.safetensors or pytorch_model.bin, vocab.txt)')


def load_hf(src: str, encoder_only: bool = False
            ) -> Tuple[dict, ml_collections.ConfigDict, dict]:
  """An HF BERT directory -> (params, run config, its tokenizer's normalisation settings:
  do_lower_case, strip_accents, tokenize_chinese_chars), nothing written; `encoder_only`
  leaves out its pretraining heads (cls.*)."""
  config_path = _hf_config_path(src)
  try:
    with open(config_path) as f:
      bert = json.load(f)
  except ValueError as e:
    raise ValueError(f'{config_path} is not readable JSON ({e}); pass an HF checkpoint '
                     'directory with its own config.json') from None
  if not isinstance(bert, dict):
    raise ValueError(f'{config_path} is not an HF model config (a JSON object); pass an HF '
                     'checkpoint directory with its own config.json')
  model_type = bert.get('model_type', 'bert')
  if model_type != 'bert':
    raise ValueError(f'{config_path} has model_type={model_type!r}; only BERT checkpoints '
                     "(model_type 'bert') can be imported")
  for key, what in (('is_decoder', 'a causal decoder (BertLMHeadModel)'),
                    ('add_cross_attention', 'an encoder-decoder half with cross-attention')):
    if bert.get(key):
      raise ValueError(f'{config_path} has {key}=true: {what}, not the bidirectional encoder '
                       'this codebase trains; import a BERT encoder checkpoint')
  config = model_config_from_bert(bert, variant='postln', source=config_path)
  source = f'HF checkpoint {src}'
  tensors = _normalize_hf_names(read_hf_tensors(src), source)
  if encoder_only:
    tensors = {n: t for n, t in tensors.items() if not n.startswith('cls.')}
  heads = _present_heads(tensors, 'cls.predictions.', 'cls.seq_relationship.')
  decoder = tensors.get('cls.predictions.decoder.weight')
  if decoder is not None and not np.array_equal(
      decoder, tensors['embeddings.word_embeddings.weight']):
    raise ValueError(f'{source} has an MLM decoder (cls.predictions.decoder.weight) that is '
                     'not the word embeddings (tie_word_embeddings false); our MLM head ties '
                     'them, so its logits would differ: import the encoder alone '
                     '(import-hf --encoder_only)')
  params, used = convert_to_params(tensors, config.model, fmt='hf', source=source, heads=heads)
  _check_unused(tensors, used, lambda n: n in _HF_IGNORED, source, config.model.num_layers)
  return params, config, wordpiece.read_normalization(src)


def import_hf(src: str, out: str, encoder_only: bool = False) -> str:
  """Import an HF BERT checkpoint directory into a params-only workdir; returns its step dir.
  `src` and `out` may be gs:// URLs; `encoder_only` leaves out its pretraining heads."""
  _new_out(out)
  src = _local_files(src, lambda n: n in _HF_FILES or (n.startswith('model-') and
                                                       n.endswith('.safetensors')))
  if not os.path.isdir(src):
    raise FileNotFoundError(f'--src {src} ' + ('is a file' if os.path.exists(src) else
                                                'not found') +
                            ': pass the folder of an HF BERT checkpoint '
                            '(config.json, model.safetensors or pytorch_model.bin, vocab.txt)')
  _hf_config_path(src)  # (before the tokenizer files: is it a checkpoint at all?)
  with tempfile.TemporaryDirectory(prefix='realformer-vocab-') as tmp:
    vocab = os.path.join(src, VOCAB)
    if not os.path.isfile(vocab) and os.path.isfile(os.path.join(src, HF_TOKENIZER_JSON)):
      vocab = vocab_from_tokenizer_json(os.path.join(src, HF_TOKENIZER_JSON),
                                        os.path.join(tmp, VOCAB))
    if not os.path.isfile(vocab):
      raise FileNotFoundError(f'{src} has no {VOCAB} or {HF_TOKENIZER_JSON}; put the '
                              'checkpoint\'s tokenizer files (of its hub repository) beside its '
                              'config.json')
    params, config, normalization = load_hf(src, encoder_only)
    capitals, cased = _capitals(vocab)
    if not capitals and not normalization['do_lower_case']:
      logging.warning('%s has no piece with a capital, an uncased vocabulary, yet %s says '
                      'do_lower_case false: imported so (as transformers reads it), a word '
                      'with a capital becomes [UNK] unless its script has none; if the '
                      'checkpoint lower-cases, set do_lower_case true there and import again',
                      vocab, wordpiece.TOKENIZER_CONFIG)
    if cased and normalization['do_lower_case'] and not os.path.isfile(
        os.path.join(src, wordpiece.TOKENIZER_CONFIG)):
      logging.warning('%s holds %d pieces with capitals (e.g. %s), a cased vocabulary, and '
                      '%s has no %s to say so: imported lower-casing (BertTokenizer\'s '
                      'default), which never reaches them; put the checkpoint\'s %s '
                      '(do_lower_case: false) beside its config.json and import again',
                      vocab, len(capitals), capitals[:3], src, wordpiece.TOKENIZER_CONFIG,
                      wordpiece.TOKENIZER_CONFIG)
    return write_workdir(out, params, config, vocab, normalization)


def vocab_from_tokenizer_json(path: str, out: str) -> str:
  """Write the vocab.txt of a WordPiece tokenizer.json (what transformers 5 saves in its
  place): its pieces in id order. Returns `out`."""
  try:
    with open(path, encoding='utf-8') as f:
      model = json.load(f).get('model') or {}
  except (ValueError, AttributeError) as e:
    raise ValueError(f'{path} is not a tokenizer.json ({e}); put the checkpoint\'s vocab.txt '
                     'beside it') from None
  if model.get('type') != 'WordPiece' or not isinstance(model.get('vocab'), dict):
    raise ValueError(f'{path} is a {model.get("type")!r} tokenizer, not BERT\'s WordPiece; '
                     'only BERT checkpoints can be imported')
  by_id = {int(i): piece for piece, i in model['vocab'].items()}
  if sorted(by_id) != list(range(len(model['vocab']))):
    raise ValueError(f'{path}: the WordPiece ids are not 0..{len(model["vocab"]) - 1}, each once; '
                     'put the checkpoint\'s vocab.txt beside it')
  with open(out, 'w', encoding='utf-8') as f:
    f.writelines(by_id[i] + '\n' for i in range(len(by_id)))
  return out


# ----------------------------------------------------------------------------------------
# TF1 (google-research/bert and the official RealFormer release).
# ----------------------------------------------------------------------------------------

def tf1_prefix(path: str) -> str:
  """A TF1 checkpoint's prefix from the prefix or one of its files (model.ckpt.index,
  model.ckpt.data-00000-of-00001, model.ckpt.meta -> model.ckpt)."""
  return re.sub(r'\.(index|meta|data-\d+-of-\d+)$', '', path)


def _tensorflow(purpose: str):
  """TensorFlow, imported without its C++ start-up lines (oneDNN's notice, absl's): it only
  reads or writes tensors here, and our errors say what went wrong in one line."""
  for variable in ('TF_CPP_MIN_LOG_LEVEL', 'TF_ENABLE_ONEDNN_OPTS'):
    os.environ.setdefault(variable, '3' if variable == 'TF_CPP_MIN_LOG_LEVEL' else '0')
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError(f'{purpose} needs tensorflow (pip install tensorflow-cpu)') from None
  return tf


def read_tf1_tensors(prefix: str) -> Dict[str, np.ndarray]:
  """All variables of a TF1 checkpoint (prefix such as model.ckpt-1000000, or one of its
  files) except optimizer slots and the step counter."""
  prefix = tf1_prefix(prefix)
  tf = _tensorflow('reading a TF1 checkpoint')

  def damaged(e):  # a truncated .index or .data-* file (DataLossError, ...)
    return ValueError(f'the TF checkpoint {prefix!r} is damaged ({str(e).splitlines()[0]}); '
                      'download or copy its .index and .data-* files again')
  try:
    reader = tf.train.load_checkpoint(prefix)
  except (ValueError, tf.errors.NotFoundError) as e:
    raise FileNotFoundError(f'no TF checkpoint at {prefix!r} ({str(e).splitlines()[0]}); pass '
                            'the prefix, e.g. .../bert_model.ckpt (without .index)') from None
  except tf.errors.OpError as e:
    raise damaged(e) from None
  try:
    names = reader.get_variable_to_shape_map()
    return {n: reader.get_tensor(n) for n in names
            if not any(n.endswith(s) for s in _TF1_IGNORED_SUFFIXES)}
  except tf.errors.OpError as e:
    raise damaged(e) from None


# What a TF1 checkpoint's hidden_act 'gelu' computed, by default: Google's released BERT
# checkpoints were trained before google-research/bert's gelu became the tanh approximation
# (February 2019); the official RealFormer code computes that approximation.
TF1_GELU = {'postln': 'erf', 'realformer': 'tanh'}


def load_tf1(prefix: str, bert_config: str, *, variant: str, gelu: Optional[str] = None,
             encoder_only: bool = False) -> Tuple[dict, ml_collections.ConfigDict]:
  """A TF1 BERT-format checkpoint + bert_config.json -> (params, run config). `variant`:
  'postln' (google-research/bert's checkpoints) or 'realformer' (the RealFormer paper's); the
  variable names are the same, so only the caller can tell. `gelu`: what the checkpoint's
  hidden_act 'gelu' computed, 'erf' or 'tanh' (None: the bert_config's 'gelu', which
  export-tf1 writes, else TF1_GELU[variant]). `encoder_only` leaves out its pretraining heads
  (cls/*)."""
  if variant not in TF1_GELU:
    raise ValueError(f'variant {variant!r}: a TF1 BERT-format checkpoint is a Post-LN encoder, '
                     "imported as 'realformer' (residual attention) or 'postln'")
  if not os.path.isfile(bert_config):
    raise FileNotFoundError(f'bert_config {bert_config!r} not found; pass the checkpoint\'s '
                            'bert_config.json')
  try:
    with open(bert_config) as f:
      bert = json.load(f)
  except (ValueError, UnicodeDecodeError) as e:
    raise ValueError(f'--bert_config {bert_config} is not readable JSON ({e}); pass the '
                     'checkpoint\'s bert_config.json') from None
  if not isinstance(bert, dict):
    raise ValueError(f'--bert_config {bert_config} is not a BERT config (a JSON object); pass '
                     'the checkpoint\'s bert_config.json')
  gelu = gelu or bert.get('gelu') or TF1_GELU[variant]
  if gelu not in ('erf', 'tanh'):
    raise ValueError(f'gelu {gelu!r}: choose erf or tanh')
  config = model_config_from_bert(bert, variant=variant, source=bert_config, tf1_gelu=gelu)
  source = f'TF1 checkpoint {prefix}'
  tensors = read_tf1_tensors(prefix)
  if encoder_only:
    tensors = {n: t for n, t in tensors.items() if not n.startswith('cls/')}
  if any(n.startswith('bert/encoder/transformer/') or 'embedding_hidden_mapping_in' in n
         for n in tensors):
    raise ValueError(f'{source} holds tensors of ALBERT (shared layer groups), not of BERT; '
                     'only BERT / RealFormer checkpoints can be imported')
  if 'bert/embeddings/word_embeddings' not in tensors:
    raise ValueError(f'{source} has no bert/embeddings/word_embeddings (first variables: '
                     f'{sorted(tensors)[:3]}); it is not a BERT-format checkpoint')
  heads = _present_heads(tensors, 'cls/predictions/', 'cls/seq_relationship/')
  params, used = convert_to_params(tensors, config.model, fmt='tf1', source=source,
                                   heads=heads)
  _check_unused(tensors, used, lambda n: False, source, config.model.num_layers)
  return params, config


def import_tf1(prefix: str, bert_config: str, vocab: str, out: str, *,
               variant: str, do_lower_case: bool = True, gelu: Optional[str] = None,
               encoder_only: bool = False) -> str:
  """Import a TF1 BERT / RealFormer checkpoint into a params-only workdir (each path may be a
  gs:// URL); `encoder_only` leaves out its pretraining heads."""
  _new_out(out)
  prefix = tf1_prefix(prefix.rstrip('/'))
  folder, _, name = prefix.rpartition('/')
  if storage.is_url(prefix):  # the prefix's .index and .data-* objects
    prefix = os.path.join(_local_files(folder, lambda n: n.startswith(name + '.')), name)
  vocab, bert_config = _local_file(vocab), _local_file(bert_config)
  _check_vocab(vocab, do_lower_case)
  params, config = load_tf1(prefix, bert_config, variant=variant, gelu=gelu,
                            encoder_only=encoder_only)
  return write_workdir(out, params, config, vocab,
                       dict(wordpiece.NORMALIZATION, do_lower_case=do_lower_case))


# ----------------------------------------------------------------------------------------
# Export: to HF, and to TF1.
# ----------------------------------------------------------------------------------------

def check_exportable(model_config, fmt: str = 'hf') -> None:
  """HF's BertModel is a Post-LN encoder with dot-product attention and nothing more; a TF1
  checkpoint is that (google-research/bert's modeling.py) or RealFormer, the same encoder
  with residual attention (the official release's realformer.py)."""
  spec = resolve(model_config)
  lacks = ([f'{spec.block} blocks (BERT\'s are post_ln)'] if spec.block != 'post_ln'
           else [])
  if spec.residual_attention and fmt == 'hf':
    lacks.append('residual attention (each layer adds the previous layer\'s scores)')
  if tuple(spec.attention) != ('dot',):
    lacks.append(f'attention {"+".join(spec.attention)} (BERT\'s is the dot product)')
  if fmt != 'hf':  # (the dot product otherwise plain: residual attention is RealFormer's)
    spec = dataclasses.replace(spec, residual_attention=False)
    if float(model_config.layer_norm_eps) != 1e-12:  # (tf.contrib's layer_norm, fixed)
      lacks.append(f'model.layer_norm_eps={model_config.layer_norm_eps} (BERT\'s TF1 code '
                   'computes its LayerNorms with 1e-12)')
  if lacks or not spec.plain_dot_product:
    exported = ('only Post-LN encoders whose attention is the dot product alone (variant '
                'postln, as its preset has it) can be exported' if fmt == 'hf' else
                'only Post-LN encoders whose attention is the dot product alone, with or '
                'without residual attention (variants postln and realformer, as their '
                'presets have them), can be exported')
    if fmt == 'hf' and len(lacks) == 1 and lacks[0].startswith('residual'):
      exported += ' (a RealFormer exports as a TF1 checkpoint for its official code: export-tf1)'
    raise ValueError(
        f'model variant {spec.variant!r} cannot be represented by '
        f'{"HF BertModel" if fmt == "hf" else "a TF1 BERT checkpoint"}: it has '
        f'{" and ".join(lacks) or "more than dot-product attention"}; {exported}')


def hf_config(model_config, architecture: str, pad_token_id: int = 0) -> dict:
  m = model_config
  return {
      'architectures': [architecture], 'model_type': 'bert',
      'vocab_size': int(m.vocab_size), 'hidden_size': int(m.hidden_size),
      'num_hidden_layers': int(m.num_layers), 'num_attention_heads': int(m.num_heads),
      'intermediate_size': int(m.mlp_dim), 'hidden_act': EXPORT_ACT[m.get('gelu', 'erf')],
      'hidden_dropout_prob': float(m.dropout_rate),
      'attention_probs_dropout_prob': float(m.attention_dropout_rate),
      'max_position_embeddings': int(m.max_len), 'type_vocab_size': int(m.type_vocab_size),
      'initializer_range': float(m.initializer_range), 'layer_norm_eps': float(m.layer_norm_eps),
      'pad_token_id': int(pad_token_id), 'position_embedding_type': 'absolute',
      'tie_word_embeddings': True,
  }


# The transformers class whose weights are exactly the encoder and these heads.
HF_ARCHITECTURES = {(): 'BertModel', ('mlm_head',): 'BertForMaskedLM',
                    ('nsp_head',): 'BertForNextSentencePrediction',
                    ('mlm_head', 'nsp_head'): 'BertForPreTraining',
                    ('classifier',): 'BertForSequenceClassification',
                    ('span_head',): 'BertForQuestionAnswering',
                    ('token_classifier',): 'BertForTokenClassification'}
# A fine-tuned task's head (realformer/finetune/: GLUE's classifier on the pooled [CLS],
# SQuAD's start and end logits per token, NER's tag logits per token) -> its name in those
# classes (a linear layer's weight [out, in] and bias, as ours transposed).
TASK_HEADS = {'classifier': 'classifier', 'span_head': 'qa_outputs',
              'token_classifier': 'classifier'}
# The same heads in google-research/bert's scripts (run_classifier.py's output_weights
# [labels, D] and output_bias; run_squad.py's cls/squad/output_weights [2, D], start then end):
# '<name>_weights' and '<name>_bias'.
TF1_TASK_HEADS = {'classifier': 'output', 'span_head': 'cls/squad/output'}
# The classes that transformers builds without BERT's pooler (add_pooling_layer=False).
WITHOUT_POOLER = ('BertForMaskedLM', 'BertForQuestionAnswering', 'BertForTokenClassification')


def _check_export_out(out: str, reader: str = 'transformers') -> None:
  """An export writes a folder of its format's files: never into a file or a workdir of this
  project, nor beside other files (a loader would read a stale tokenizer.json, a sharded index
  or another export's vocab.txt with the new weights)."""
  path = storage.path(out)
  if path.exists() and not path.is_dir():
    raise ValueError(f'--out {out} is a file; export to a new or empty directory')
  if (path / RunDir.CHECKPOINTS).is_dir() or (path / RunDir.LOCK).exists():
    raise ValueError(f'--out {out} is a workdir of this project (it holds checkpoints); '
                     'export to another directory')
  held = sorted(p.name for p in path.iterdir()) if path.exists() else []
  if held:
    raise ValueError(f'--out {out} already holds {", ".join(held[:3])}'
                     f'{", ..." if len(held) > 3 else ""}, which {reader} would read beside '
                     'the export; export to a new or empty directory')


def _exported(workdir: str, encoder_only: bool, fmt: str
              ) -> Tuple[ml_collections.ConfigDict, dict, List[str]]:
  """What an export of `workdir` writes: (its run config, its params as NumPy arrays with the
  layers unrolled, the heads among them in HF_ARCHITECTURES' order). A fine-tuning kind's
  head goes as the class the kind declares (FinetuneTask.hf_architecture, recorded in best/
  and final/), a head of one's own is refused, and `encoder_only` takes the encoder alone."""
  config = ml_collections.ConfigDict(checkpoints.read_pretraining_config(workdir))
  check_exportable(config.model, fmt)
  stored = checkpoints.stored_tree(checkpoints.resolve_step_dir(workdir))['params']
  if 'encoder' not in stored:
    raise ValueError(f'checkpoint of {workdir} has no encoder parameters (it has '
                     f'{sorted(stored)}); pass a pretraining or import workdir')
  finetuned = config.get('finetuned') or {}
  other = sorted(set(stored) - {'encoder', 'mlm_head', 'nsp_head', *TASK_HEADS})
  own = other[0] if other else (
      f'{finetuned["kind"]}/{finetuned["task"]}' if finetuned and
      not finetuned.get('hf_architecture') else None)
  if own and not encoder_only:
    raise ValueError(f'the checkpoint of {workdir} holds a head that BERT\'s {fmt.upper()} '
                     f'layout has no place for ({own}: a task of one\'s own); exports take '
                     'pretraining\'s heads, GLUE\'s classifier, SQuAD\'s span head and '
                     'NER\'s tagger: pass --encoder_only to export the encoder alone')
  heads = ([] if encoder_only else
           [h for h in ('mlm_head', 'nsp_head', *TASK_HEADS) if h in stored])
  declared = finetuned.get('hf_architecture')
  if declared and heads and HF_ARCHITECTURES.get(tuple(heads)) != declared:
    why = ('which the export does not write (it writes ' +
           ', '.join(sorted(set(HF_ARCHITECTURES.values()))) + ')'
           if declared not in HF_ARCHITECTURES.values() else
           f'whose head is not the checkpoint\'s {heads}')
    raise ValueError(f'the checkpoint of {workdir} is a fine-tuning ({finetuned["kind"]}) that '
                     f'declares {declared}, {why}; pass --encoder_only to export the encoder '
                     'alone')
  if tuple(heads) not in HF_ARCHITECTURES:
    raise ValueError(f'the checkpoint of {workdir} holds the heads {heads}, which no one BERT '
                     'model holds together')
  if 'nsp_head' in heads and config.get('objective') == 'mlm_sop':
    logging.warning('%s was pretrained with ALBERT\'s sentence-order prediction: its NSP '
                    'head, exported as BERT\'s next-sentence classifier (as ALBERT\'s code '
                    'names it too), says whether A and B are in order (0) or swapped (1)',
                    workdir)
  unrolled = config.model.copy_and_resolve_references()  # (BERT's layers: a scanned
  unrolled.scan_layers = False                            # checkpoint's are laid out so)
  target = abstract_params(unrolled)
  target = {k: target[k] for k in ['encoder'] + heads if k in target}  # no fresh params
  for head in set(heads) & set(TASK_HEADS):  # its shape (its number of labels) as stored
    target[head] = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
                                dict(stored[head]))
  params, _ = checkpoints.restore_params(workdir, target)
  return config, jax.tree.map(np.asarray, params), heads


def _copy_vocab(config, out: str) -> Optional[wordpiece.WordPieceTokenizer]:
  """The run's WordPiece vocab.txt copied into `out`, and its tokenizer; None, with a
  warning, for a sentencepiece run (BERT's tokenizers cannot read its model)."""
  named = (config.data.get('tokenizer', '') if 'data' in config else '') or (
      'the shipped sentencepiece model')
  tokenizer_path = tokenizer_lib.local_files(named) if named.endswith('.txt') else ''
  if tokenizer_path and not os.path.isfile(tokenizer_path):
    raise FileNotFoundError(f'the run\'s vocabulary {tokenizer_path} is not there; put it back '
                            '(or a copy in the workdir beside config.json, with its '
                            'tokenizer_config.json) to export it with the weights')
  if not tokenizer_path:
    logging.warning('the run\'s tokenizer (%s) is not a WordPiece vocab.txt: exported weights '
                    'only (BERT\'s tokenizers cannot read a sentencepiece model)', named)
    return None
  shutil.copyfile(tokenizer_path, os.path.join(out, VOCAB))
  return wordpiece.WordPieceTokenizer.load(tokenizer_path)


def _through_local_folder(reader: str):
  """An export into a new or empty folder (_check_export_out: `reader` is what would read
  files left there), a gs:// `out` too: written into a local folder, then uploaded."""
  def decorate(export: Callable[[str, str, bool], str]):
    @functools.wraps(export)
    def exported(workdir: str, out: str, encoder_only: bool = False) -> str:
      _check_export_out(out, reader)
      if not storage.is_url(out):
        return export(workdir, os.path.abspath(out), encoder_only)
      folder = tempfile.mkdtemp(prefix='realformer-export-')
      try:
        export(workdir, folder, encoder_only)
        storage.copy_tree(folder, out)
      finally:
        shutil.rmtree(folder, ignore_errors=True)
      return out
    return exported
  return decorate


@_through_local_folder('transformers')
def export_hf(workdir: str, out: str, encoder_only: bool = False) -> str:
  """A workdir (pretraining run or import; or a fine-tuning run's best/ or final/) -> an HF
  directory that `transformers.BertModel.from_pretrained(out)` loads, and the class that
  holds its heads (HF_ARCHITECTURES: BertForPreTraining with both of pretraining's,
  BertForSequenceClassification with GLUE's classifier, BertForQuestionAnswering with
  SQuAD's span head, BertForTokenClassification with NER's tags): config.json,
  model.safetensors, and vocab.txt when the run used a WordPiece one. A fine-tuning kind's
  head is exported as the class the kind declares (FinetuneTask.hf_architecture, recorded in
  best/ and final/); a head of one's own is refused, and `encoder_only` exports the encoder
  alone (BertModel) from any workdir.
  `workdir` and `out` may be gs:// URLs (the files are written locally, then uploaded)."""
  config, params, heads = _exported(workdir, encoder_only, 'hf')
  model_config, finetuned = config.model, config.get('finetuned') or {}
  task = {h: params.pop(h) for h in set(heads) & set(TASK_HEADS)}
  flat = convert_from_params(params, model_config, fmt='hf')
  if heads:
    flat = {(n if n.startswith('cls.') else 'bert.' + n): x for n, x in flat.items()}
  for head, weights in task.items():
    flat[f'{TASK_HEADS[head]}.weight'] = np.ascontiguousarray(weights['kernel'].T)
    flat[f'{TASK_HEADS[head]}.bias'] = weights['bias']
  architecture = HF_ARCHITECTURES[tuple(heads)]
  if architecture in WITHOUT_POOLER:
    flat = {n: x for n, x in flat.items() if not n.startswith('bert.pooler.')}

  os.makedirs(out, exist_ok=True)
  tokenizer = _copy_vocab(config, out)
  if tokenizer:
    with open(os.path.join(out, wordpiece.TOKENIZER_CONFIG), 'w') as f:
      json.dump(dict(tokenizer.normalization, tokenizer_class='BertTokenizer',
                     model_max_length=int(model_config.max_len)), f)
  hf = hf_config(model_config, architecture, tokenizer.pad_id if tokenizer else 0)
  for head in set(task) & {'classifier', 'token_classifier'}:  # (GLUE's STS-B: one label,
    labels = int(task[head]['bias'].shape[0])                   # a regression)
    names = [str(n) for n in finetuned.get('labels') or ()]  # (the run's, in id order)
    if len(names) != labels or len(set(names)) != labels:
      names = [f'LABEL_{i}' for i in range(labels)]
    hf['id2label'] = {str(i): n for i, n in enumerate(names)}
    hf['label2id'] = {n: i for i, n in enumerate(names)}
    if head == 'classifier':
      hf['problem_type'] = ('regression' if labels == 1 else
                            'single_label_classification')
  with open(os.path.join(out, HF_CONFIG), 'w') as f:
    json.dump(hf, f, indent=2, sort_keys=True)
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  weights = os.path.join(out, HF_SAFETENSORS)
  save_file(flat, weights, metadata={'format': 'pt'})
  # safetensors writes its file 0600: readable as config.json is (the umask's), to share.
  os.chmod(weights, stat.S_IMODE(os.stat(os.path.join(out, HF_CONFIG)).st_mode))
  return out


TF1_CKPT = 'bert_model.ckpt'
TF1_CONFIG = 'bert_config.json'
# The label order of google-research/bert's run_classifier.py processors where it is not
# ours (its output_weights' rows come in that order): MNLI's, by (kind, task).
TF1_LABELS = {('glue', 'mnli'): ('contradiction', 'entailment', 'neutral')}


def tf1_bert_config(model_config) -> dict:
  """bert_config.json as google-research/bert's BertConfig and the official RealFormer code
  read it; 'hidden_act' is their "gelu", whichever form their code computes, and 'gelu' says
  which this encoder computed (import-tf1 reads it back)."""
  m = model_config
  config = {
      'vocab_size': int(m.vocab_size), 'hidden_size': int(m.hidden_size),
      'num_hidden_layers': int(m.num_layers), 'num_attention_heads': int(m.num_heads),
      'intermediate_size': int(m.mlp_dim), 'hidden_act': 'gelu', 'gelu': m.get('gelu', 'erf'),
      'hidden_dropout_prob': float(m.dropout_rate),
      'attention_probs_dropout_prob': float(m.attention_dropout_rate),
      'max_position_embeddings': int(m.max_len), 'type_vocab_size': int(m.type_vocab_size),
      'initializer_range': float(m.initializer_range),
      'layer_norm_eps': float(m.layer_norm_eps)}
  if resolve(m).residual_attention:
    config['use_running_mean'] = bool(m.get('running_mean', False))
  return config


@_through_local_folder('BERT\'s scripts')
def export_tf1(workdir: str, out: str, encoder_only: bool = False) -> str:
  """A Post-LN or RealFormer workdir (as export_hf takes it) -> a TF1 checkpoint of BERT's
  variable names, which google-research/bert's scripts and the official RealFormer code load
  as their init_checkpoint: bert_model.ckpt.index and .data-00000-of-00001 (the encoder, its
  pretraining heads under cls/, GLUE's classifier as run_classifier.py's output_weights and
  output_bias, SQuAD's span head as run_squad.py's cls/squad/output_*), bert_config.json
  (with use_running_mean for RealFormer, and a classifier's labels in the order of its rows:
  run_classifier.py's for MNLI, TF1_LABELS), and vocab.txt when the run used a WordPiece
  one. Written by TensorFlow's own SaveV2 (needs tensorflow, the CPU build is enough);
  `workdir` and `out` may be gs:// URLs."""
  tf = _tensorflow('writing a TF1 checkpoint')
  config, params, heads = _exported(workdir, encoder_only, 'tf1')
  if set(heads) - {'mlm_head', 'nsp_head', *TF1_TASK_HEADS}:
    raise ValueError(f'the checkpoint of {workdir} holds a token classifier (NER), which '
                     'google-research/bert\'s scripts have no place for; export-hf writes it '
                     '(BertForTokenClassification), or pass --encoder_only')
  task = {h: params.pop(h) for h in set(heads) & set(TASK_HEADS)}
  flat = convert_from_params(params, config.model, fmt='tf1')
  bert_config = tf1_bert_config(config.model)
  for head, weights in task.items():
    kernel, bias = weights['kernel'], weights['bias']
    if head == 'classifier':
      finetuned = config.get('finetuned') or {}
      labels = [str(n) for n in finetuned.get('labels') or ()]
      theirs = TF1_LABELS.get((finetuned.get('kind'), finetuned.get('task')))
      if theirs and sorted(theirs) == sorted(labels):  # rows in their processor's order
        order = [labels.index(n) for n in theirs]
        kernel, bias, labels = kernel[:, order], bias[order], list(theirs)
      if len(labels) == bias.shape[0]:
        bert_config['labels'] = labels
    flat[f'{TF1_TASK_HEADS[head]}_weights'] = np.ascontiguousarray(kernel.T)
    flat[f'{TF1_TASK_HEADS[head]}_bias'] = np.ascontiguousarray(bias)
  os.makedirs(out, exist_ok=True)
  names = sorted(flat)
  with tf.device('/cpu:0'):
    tf.raw_ops.SaveV2(prefix=os.path.join(out, TF1_CKPT), tensor_names=names,
                      shape_and_slices=[''] * len(names),
                      tensors=[tf.constant(flat[n]) for n in names])
  tokenizer = _copy_vocab(config, out)
  if tokenizer and not tokenizer.normalization.get('do_lower_case', True):
    logging.warning('the vocabulary is cased: pass --do_lower_case=False to BERT\'s scripts')
  with open(os.path.join(out, TF1_CONFIG), 'w') as f:
    json.dump(bert_config, f, indent=2, sort_keys=True)
  return out


# ----------------------------------------------------------------------------------------
# Command line.
# ----------------------------------------------------------------------------------------

COMMANDS = {'import-hf': 'HF BERT directory -> params-only workdir',
            'import-tf1': 'TF1 BERT / RealFormer checkpoint -> workdir',
            'export-hf': 'Post-LN workdir -> HF directory',
            'export-tf1': 'Post-LN or RealFormer workdir -> TF1 checkpoint'}


def _define(command):
  def define(f):
    if command == 'import-hf':
      flags.DEFINE_string('src', None, 'config.json, model.safetensors|pytorch_model.bin, '
                          'vocab.txt', flag_values=f, required=True)
    elif command == 'import-tf1':
      flags.DEFINE_string('ckpt', None, 'the checkpoint: its prefix (.../bert_model.ckpt) or '
                          'any of its files (.index, .data-*, .meta)', flag_values=f,
                          required=True)
      flags.DEFINE_string('bert_config', None, 'bert_config.json', flag_values=f,
                          required=True)
      flags.DEFINE_string('vocab', None, 'vocab.txt', flag_values=f, required=True)
      flags.DEFINE_enum('variant', None, ['postln', 'realformer'],
                        'the checkpoint\'s encoder: postln for google-research/bert\'s, '
                        'realformer for the RealFormer paper\'s (their variable names are '
                        'the same)', flag_values=f, required=True)
      flags.DEFINE_boolean('cased', False, 'the vocabulary is cased', flag_values=f)
      flags.DEFINE_enum('gelu', None, ['erf', 'tanh'],
                        "what the checkpoint's hidden_act 'gelu' computed: erf for Google's "
                        'released BERT checkpoints (the default with postln), tanh for '
                        'google-research/bert since February 2019 and the official RealFormer '
                        'code (the default with realformer)', flag_values=f)
    else:
      flags.DEFINE_string('workdir', None, 'a Post-LN workdir' if command == 'export-hf' else
                          'a Post-LN or RealFormer workdir', flag_values=f, required=True)
    flags.DEFINE_boolean('encoder_only', False,
                         'import the encoder alone, leaving out the pretraining heads (an MLM '
                         'decoder not tied to the embeddings, say)' if command.startswith(
                             'import') else
                         'export the encoder alone (BertModel), leaving out any head'
                         if command == 'export-hf' else
                         'export the encoder alone (bert/*), leaving out any head',
                         flag_values=f)
    flags.DEFINE_string('out', None, 'the new workdir' if command.startswith('import') else
                        f'the new {"HF" if command == "export-hf" else "TF1"} directory',
                        flag_values=f, required=True)
  return define


def describe_import(step_dir: str) -> str:
  """One line on what an import wrote into `step_dir`: the encoder's shape and vocabulary,
  and which of the checkpoint's heads came with it (read from the files written)."""
  model = checkpoints.read_pretraining_config(step_dir)['model']
  params = checkpoints.stored_tree(step_dir)['params']
  heads = [k for k in sorted(params) if k != 'encoder']
  if 'pooler' in params['encoder']:
    heads.insert(0, 'pooler')
  lacking = [h for h in ('mlm_head', 'nsp_head') if h not in heads]
  return (f'imported {model["variant"]}: {model["num_layers"]} layers of '
          f'{model["hidden_size"]} ({model["num_heads"]} heads, MLP {model["mlp_dim"]}), a '
          f'vocabulary of {model["vocab_size"]}, {model["max_len"]} positions; with '
          f'{", ".join(heads) or "no head (the encoder alone)"}' +
          (f'; no {" or ".join(lacking)}: pretraining from it draws '
           f'{"them" if len(lacking) > 1 else "it"} fresh' if lacking else ''))


def describe_tf1_export(out: str) -> str:
  """One line on what export-tf1 wrote, and the GELU that TF1 code computes for it."""
  bert = json.loads((storage.path(out) / TF1_CONFIG).read_text())
  variant = 'realformer' if 'use_running_mean' in bert else 'postln'
  line = (f'exported {variant}: {bert["num_hidden_layers"]} layers of {bert["hidden_size"]} '
          f'({bert["num_attention_heads"]} heads), a vocabulary of {bert["vocab_size"]}, '
          f'{bert["max_position_embeddings"]} positions')
  if bert['gelu'] == 'erf':
    line += ('; its GELU is the erf form, which google-research/bert\'s modeling.py (since '
             'February 2019) and the official RealFormer code approximate with tanh')
  return line


def main(argv=None) -> None:
  prog = 'python -m realformer.tools.interop'
  command, argv = cli.command(argv, COMMANDS, prog)
  args, _ = cli.parse_tool_flags(_define(command), argv, prog=f'{prog} {command}', doc=__doc__)
  args.command = command
  with cli.warnings_only():
    if args.command.startswith('import'):
      step_dir = (import_hf(args.src, args.out, args.encoder_only)
                  if args.command == 'import-hf' else
                  import_tf1(args.ckpt, args.bert_config, args.vocab, args.out,
                             variant=args.variant, do_lower_case=not args.cased,
                             gelu=args.gelu, encoder_only=args.encoder_only))
      print(describe_import(step_dir))
      print(step_dir)
    elif args.command == 'export-hf':
      print(export_hf(args.workdir, args.out, encoder_only=args.encoder_only))
    else:
      out = export_tf1(args.workdir, args.out, encoder_only=args.encoder_only)
      print(describe_tf1_export(out))
      print(out)


if __name__ == '__main__':
  cli.run_main(main)
