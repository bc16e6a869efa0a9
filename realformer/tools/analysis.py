"""Attention analysis as in the RealFormer paper (He et al. 2020, section 4.3).

From a pretraining workdir's newest checkpoint, on held-out text, through the public
contract (`model.apply(..., capture_attention=True)`):
  - per layer and head, the distribution of attention entropy  H(p) = -sum_k p_k ln p_k  of
    every (example, real query position): lower is sparser. The paper's Figure 4 draws each
    head's distribution, the heads of a layer ordered by their medians
    (attention_entropy_heads.png); attention_entropy.png pools the heads of a layer;
  - the Jensen-Shannon divergence between the attention distributions of two layers,
    JS(p, q) = (KL(p || m) + KL(q || m)) / 2 with m = (p + q) / 2, averaged over examples,
    heads and real query positions, for adjacent layers and all pairs: lower is closer.
Natural logarithms throughout (JS lies in [0, ln 2]). Padding keys carry no probability
(the mask) and padding queries are left out.
"""

import io
import json
import os
import zlib
from typing import Dict, List, Optional, Sequence

import jax
import ml_collections
import numpy as np
from absl import logging

from realformer import models
from realformer import storage
from realformer.run_names import RunNames
from realformer.model.spec import resolve
from realformer.train import checkpoints


def _xlogx(p):
  return np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)


def attention_entropy(probs: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """probs [B, H, T, T], mask [B, T] (1 = real) -> entropies of the real queries, flat."""
  p = np.asarray(probs, np.float64)
  ent = -_xlogx(p).sum(-1)                                   # [B, H, T]
  real = np.broadcast_to(np.asarray(mask, bool)[:, None, :], ent.shape)
  return ent[real]


def head_entropies(probs: np.ndarray, mask: np.ndarray, by_median: bool = True
                   ) -> List[np.ndarray]:
  """probs [B, H, T, T], mask [B, T] -> per head, the entropies of its real queries, the
  heads ordered by their medians (ascending), as the paper's Figure 4 draws them
  (by_median=False: in head order)."""
  p = np.asarray(probs, np.float64)
  ent = -_xlogx(p).sum(-1)                                   # [B, H, T]
  real = np.asarray(mask, bool)
  heads = [ent[:, h][real] for h in range(ent.shape[1])]
  return sorted(heads, key=np.median) if by_median else heads


def js_divergence(p: np.ndarray, q: np.ndarray, mask: np.ndarray) -> float:
  """Mean JS divergence between [B, H, T, T] attentions over heads and real queries."""
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  m = (p + q) / 2
  kl = lambda a: (_xlogx(a) - np.where(a > 0, a * np.log(np.where(m > 0, m, 1.0)), 0.0)).sum(-1)
  js = (kl(p) + kl(q)) / 2                                   # [B, H, T]
  real = np.broadcast_to(np.asarray(mask, bool)[:, None, :], js.shape)
  return float(js[real].mean())


def js_matrix(attention: Sequence[np.ndarray], mask: np.ndarray) -> np.ndarray:
  n = len(attention)
  out = np.zeros((n, n))
  for i in range(n):
    for j in range(i + 1, n):
      out[i, j] = out[j, i] = js_divergence(attention[i], attention[j], mask)
  return out


def load_run(workdir: str):
  """(config, encoder, encoder params, step) of the newest checkpoint of a workdir.

  Only state/params/encoder is read, so pretraining runs and params-only imports both work.
  """
  config = ml_collections.ConfigDict(checkpoints.read_pretraining_config(workdir))
  model = models.build(config.model, head='encoder')
  t = config.data.max_seq_length
  batch = {k: np.zeros((1, t), np.int32) for k in ('input_ids', 'segment_ids',
                                                    'attention_mask')}
  abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), batch))['params']
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          jax.tree.map(lambda x: getattr(x, 'value', x), abstract,
                                       is_leaf=lambda x: hasattr(x, 'value')))
  step_dir = checkpoints.resolve_step_dir(workdir)
  params, missing = checkpoints.restore_params(step_dir, abstract, subtree=('encoder',))
  if missing:
    raise ValueError(f'checkpoint in {workdir} lacks {missing[:3]}...; is it a pretraining '
                     'run of this codebase (params/encoder/...)?')
  return config, model, params, int(os.path.basename(step_dir))


def _data_folder(workdir: str, config) -> str:
  """The folder whose data ensure_prepared reads the held-out examples from: the run's own
  (config.data.prepared_dir, or the <run>/data that training prepared, for the run whose
  folder, checkpoints/ or step folder `workdir` is); else (best/, final/, an import, a run
  whose data/ was deleted) a folder of this host's cache named by the preparation's
  settings, so that nothing is written into the folder analysed."""
  from data import prepare  # pylint: disable=g-import-not-at-top
  run = checkpoints.owning_run(storage.path(workdir)) or storage.path(workdir)
  if config.data.prepared_dir or (run / RunNames.DATA / prepare.METADATA).exists():
    return str(run)  # (ensure_prepared: config.data.prepared_dir, else <run>/data)
  key = json.dumps(prepare.fingerprint(config), sort_keys=True)
  return os.path.join(storage.cache_dir('analysis'), storage.cache_key(key))


def heldout_batch(workdir: str, config, num_examples: int) -> Dict[str, np.ndarray]:
  """Held-out examples (the eval split), with the masked tokens put back."""
  from data import pipeline  # pylint: disable=g-import-not-at-top
  from data import tokenizer as tokenizer_lib
  prepared = pipeline.ensure_prepared(config, _data_folder(workdir, config),
                                      reader=(0, 1),  # the whole eval split
                                      splits=('eval',))
  from data import prepare  # pylint: disable=g-import-not-at-top
  held_out = prepare.read_metadata(prepared)['counts']['eval']
  if num_examples > held_out:
    raise ValueError(f'--num_examples={num_examples}: the eval split of {prepared} holds '
                     f'{held_out} examples; give at most {held_out}')
  tok = tokenizer_lib.load_for_config(config.data)
  it = pipeline.make_pretraining_iterator(config.data, tok, prepared, split='eval',
                                          global_batch_size=num_examples, seed=0)
  batch = next(it)
  ids = batch['input_ids'].copy()
  for row, pos, lab, w in zip(ids, batch['masked_lm_positions'], batch['masked_lm_ids'],
                              batch['masked_lm_weights']):
    row[pos[w > 0]] = lab[w > 0]
  return {'input_ids': ids, 'segment_ids': batch['segment_ids'],
          'attention_mask': batch['attention_mask']}


def text_of(batch: Dict[str, np.ndarray]) -> dict:
  """What a batch of examples is, for a report: how many, their length, a CRC32 of their
  token ids (runs analysed on the same text have the same)."""
  ids = np.ascontiguousarray(batch['input_ids'], np.int32)
  return {'num_examples': int(ids.shape[0]), 'max_seq_length': int(ids.shape[1]),
          'crc': f'{zlib.crc32(ids.tobytes()):08x}'}


def analyze_runs(workdirs: Sequence[str], num_examples: int = 32) -> List[dict]:
  """analyze_run of each workdir, on one text wherever they can share it: the held-out
  examples of the first run of each tokenizer, vocabulary size, length and kind of instance
  (sentence pairs, or one segment: config.objective) are every such run's (a run's own preparation holds out other documents where its seed or objective
  differ, and a comparison would mix the models with their texts). Each result's 'text'
  says which it was (text_of, and 'from': the workdir whose held-out examples)."""
  texts, results = {}, []
  for workdir in workdirs:
    config = ml_collections.ConfigDict(checkpoints.read_pretraining_config(workdir))
    from data import pretraining  # pylint: disable=g-import-not-at-top
    key = (config.data.get('tokenizer') or '', int(config.model.vocab_size),
           int(config.data.max_seq_length), pretraining.of_config(config).instances_name)
    if key not in texts:
      texts[key] = (workdir, heldout_batch(workdir, config, num_examples))
    source, batch = texts[key]
    result = analyze_run(workdir, num_examples, batch=batch)
    result['text']['from'] = source
    results.append(result)
  return results


# Examples the analysis takes through the model at a time: it holds one chunk's attention
# ([layers, chunk, heads, T, T], and its float64 copies), not the whole batch's (BERT-large at
# length 512: about 13 GB for 32 examples at once); the figures are the same (each chunk's
# entropies in order, the JS means weighted by their real queries).
CHUNK = 8


def _layer_attention(params, i: int, name: str):
  """Layer i's attention param (or params) `name`, from unrolled layers_<i> or scanned
  `layers` (stacked along a first axis of layers)."""
  if 'layers' in params:
    return jax.tree.map(lambda x: np.asarray(x)[i], params['layers']['attention'][name])
  return params[f'layers_{i}']['attention'][name]


def mixture_weights(params, spec) -> Optional[List[Dict[str, float]]]:
  """Each layer's learned mixture weights, {component: weight} (the softmax of its
  mixture_logits, in spec.mixture's order: the Synthesizer paper's diagnostic of what a
  mixture chose), from the encoder's params (unrolled layers_<i>, or scanned `layers`);
  None where the encoder mixes nothing."""
  if not spec.mixture:
    return None
  logits = np.stack([np.asarray(_layer_attention(params, i, 'mixture_logits'), np.float64)
                     for i in range(spec.num_layers)])
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return [dict(zip(spec.mixture, map(float, row))) for row in weights]


def random_maps(params, spec, length: int) -> Optional[List[np.ndarray]]:
  """Each layer's attention by its learned Random table alone over the first `length`
  positions, [length, length] float64: the softmax over the keys of the table's logits
  (Factorized Random's R1 R2^T), averaged over the heads (the Synthesizer paper's figure of
  the learned Random weights); None for an encoder without a Random component. The table is
  input-independent, so this is what the component attends whatever the text."""
  name = next((c for c in spec.attention if c in ('random', 'factorized_random')), None)
  if name is None:
    return None
  maps = []
  for i in range(spec.num_layers):
    table = _layer_attention(params, i, f'synth_{name}')
    if name == 'random':
      logits = np.asarray(table['random_logits'], np.float64)[:, :length, :length]
    else:
      r1, r2 = (np.asarray(table[f'random_factor_{k}'], np.float64)[:, :length]
                for k in (1, 2))
      logits = np.einsum('hik,hjk->hij', r1, r2)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    maps.append((probs / probs.sum(-1, keepdims=True)).mean(0))
  return maps


def analyze_run(workdir: str, num_examples: int = 32, batch=None) -> dict:
  config, model, params, step = load_run(workdir)
  batch = batch if batch is not None else heldout_batch(workdir, config, num_examples)
  entropies, by_head, js_sum, queries = None, None, 0.0, 0
  for start in range(0, len(batch['input_ids']), CHUNK):
    part = {k: v[start:start + CHUNK] for k, v in batch.items()}
    out = model.apply({'params': params}, part, deterministic=True, capture_attention=True)
    attention = [np.asarray(a) for a in out.attention]
    mask = part['attention_mask']
    chunk = [attention_entropy(a, mask) for a in attention]
    chunk_heads = [head_entropies(a, mask, by_median=False) for a in attention]
    entropies = chunk if entropies is None else [np.concatenate(e) for e in zip(entropies,
                                                                               chunk)]
    by_head = chunk_heads if by_head is None else [
        [np.concatenate(h) for h in zip(layer, more)] for layer, more in zip(by_head,
                                                                             chunk_heads)]
    real = int(np.asarray(mask, bool).sum())
    if real:
      js_sum, queries = js_sum + js_matrix(attention, mask) * real, queries + real
  pairs = js_sum / max(queries, 1)
  heads = [sorted(layer, key=np.median) for layer in by_head]
  by_head = [[float(np.median(h)) for h in layer] for layer in by_head]
  objective = config.get('objective', 'mlm_nsp')
  spec = resolve(config.model)
  variant = spec.name
  return {'variant': variant if objective == 'mlm_nsp' else f'{variant} ({objective})',
          'workdir': workdir, 'step': step,
          'mixture_weights': mixture_weights(params, spec),
          'random_maps': random_maps(params, spec, batch['input_ids'].shape[1]),
          'entropies': entropies,
          'head_entropies': heads,
          'entropy_mean': [float(e.mean()) for e in entropies],
          'entropy_head_medians': [[float(np.median(h)) for h in layer] for layer in heads],
          'entropy_median_by_head': by_head,  # (the same medians, in head order)
          'text': dict(text_of(batch), **{'from': workdir}),
          'js_adjacent': [float(pairs[i, i + 1]) for i in range(len(attention) - 1)],
          'js_all_pairs': pairs.tolist()}


def _folder_label(workdir: str) -> str:
  """A workdir's last folder; a sweep's (`model.variant=realformer,optimizer.learning_rate=
  0.0001,seed=0`) without its variant and with each key's last part (learning_rate=0.0001,
  seed=0)."""
  name = os.path.basename(os.path.normpath(workdir))
  parts = [p.partition('=') for p in name.split(',')]
  if not all(sep for _, sep, _ in parts):
    return name
  return ','.join(f'{key.rpartition(".")[2]}={value}' for key, _, value in parts
                  if key != 'model.variant') or name


def default_labels(results: Sequence[dict]) -> List[str]:
  """Each run's variant (with its objective where it is not BERT's); runs of one variant
  are told apart by their workdir's last folder (a sweep's by the values it names beside the
  variant; where those match too, by their place in the list)."""
  labels = [r['variant'] for r in results]
  shared = {v for v in labels if labels.count(v) > 1}
  labels = [f'{r["variant"]} ({_folder_label(r["workdir"])})'
            if r['variant'] in shared else r['variant'] for r in results]
  return [f'{label} #{i + 1}' if labels.count(label) > 1 else label
          for i, label in enumerate(labels)]


def write_report(results: List[dict], out_dir: str, labels: Sequence[str] = None) -> dict:
  """Violin plots of entropy per layer, box plots per head (ordered by median within each
  layer), JS heatmaps, numbers as JSON and markdown."""
  labels = list(labels or default_labels(results))
  if len(set(labels)) != len(labels):
    raise ValueError(f'the labels {labels} repeat one; give each --workdir its own --label')
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  out = storage.path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  n = len(results)
  fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3), sharey=True, squeeze=False)
  for ax, r, label in zip(axes[0], results, labels):
    ax.violinplot(r['entropies'], showmedians=True)
    ax.set_title(label)
    ax.set_xlabel('layer')
    ax.set_xticks(range(1, len(r['entropies']) + 1))
  axes[0][0].set_ylabel('attention entropy (nats)')
  fig.tight_layout()
  save_png(fig, out / 'attention_entropy.png')
  plt.close(fig)
  _plot_head_entropies(plt, results, labels, out / 'attention_entropy_heads.png')
  vmax = max(max(max(row) for row in r['js_all_pairs']) for r in results) or 1.0
  fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3), squeeze=False)
  for ax, r, label in zip(axes[0], results, labels):
    layers = len(r['js_all_pairs'])
    im = ax.imshow(np.array(r['js_all_pairs']), vmin=0, vmax=vmax, cmap='viridis',
                   extent=(0.5, layers + 0.5, layers + 0.5, 0.5))  # layers 1..n, as above
    ax.set_xticks(range(1, layers + 1))
    ax.set_yticks(range(1, layers + 1))
    ax.set_title(label)
    ax.set_xlabel('layer')
    ax.set_ylabel('layer')
  fig.subplots_adjust(wspace=0.45)
  fig.colorbar(im, ax=axes[0].tolist(), label='JS divergence (nats)')
  save_png(fig, out / 'attention_js.png')
  plt.close(fig)
  tables = [(label, r['random_maps']) for label, r in zip(labels, results)
            if r.get('random_maps')]
  if tables:
    _plot_random_maps(plt, tables, out / 'attention_random.png')
  numbers = {label: {k: r.get(k) for k in ('variant', 'workdir', 'step', 'text',
                                       'entropy_mean', 'entropy_head_medians',
                                       'entropy_median_by_head', 'js_adjacent',
                                       'js_all_pairs', 'mixture_weights')}
             for label, r in zip(labels, results)}
  storage.write_text(out / 'attention.json', json.dumps(numbers, indent=1))
  lines = ['| run | step | mean entropy per layer (nats) | JS adjacent layers | '
           'mean JS all pairs |', '|---|---|---|---|---|']
  for label, r in zip(labels, results):
    m = np.array(r['js_all_pairs'])
    off = m[~np.eye(len(m), dtype=bool)].mean() if len(m) > 1 else 0.0
    lines.append(f'| {label} | {r.get("step", "")} | '
                 f'{", ".join(f"{e:.3f}" for e in r["entropy_mean"])} | '
                 f'{", ".join(f"{j:.4f}" for j in r["js_adjacent"])} | {off:.4f} |')
  mixed = [(label, r['mixture_weights']) for label, r in zip(labels, results)
           if r.get('mixture_weights')]
  if mixed:
    lines += ['\nMixture weights (the softmax of each layer\'s mixture logits; 1/n each at '
              'initialisation):', '', '| run | layer | weights |', '|---|---|---|']
    lines += [f'| {label} | {i} | ' + ', '.join(f'{c} {w:.3f}' for c, w in layer.items()) + ' |'
              for label, weights in mixed for i, layer in enumerate(weights, 1)]
  if tables:
    lines.append('\nattention_random.png: each layer\'s learned Random table as attention '
                 '(the softmax of its logits over the keys, averaged over the heads; the same '
                 'for every text) for ' + ', '.join(label for label, _ in tables) + '.')
  texts = {}
  for label, r in zip(labels, results):
    if r.get('text'):
      texts.setdefault(tuple(sorted((k, str(v)) for k, v in r['text'].items())),
                       (r['text'], []))[1].append(label)
  for text, runs in texts.values():
    lines.append(f'\nText{"" if len(texts) == 1 else " of " + ", ".join(runs)}: '
                 f'{text["num_examples"]} held-out examples of {text["from"]} at length '
                 f'{text["max_seq_length"]} (token ids CRC32 {text["crc"]})')
  if len(texts) > 1:
    lines.append('\nThe runs were analysed on different texts (their tokenizers, vocabulary '
                 'sizes, lengths or objectives\' instances differ): their numbers differ by '
                 'the text too.')
  if len({r['step'] for r in results}) > 1:
    steps = ', '.join(f'{label} {r["step"]}' for label, r in zip(labels, results))
    said = (f'The runs were analysed at different steps ({steps}): their numbers differ by '
            'training too.')
    lines.append(f'\n{said}')
    logging.warning('%s', said)
  storage.write_text(out / 'attention.md', '\n'.join(lines) + '\n')
  return numbers


def _plot_random_maps(plt, tables, path) -> None:
  """One row per run, one panel per layer: its Random table's attention (random_maps)."""
  layers = max(len(maps) for _, maps in tables)
  fig, axes = plt.subplots(len(tables), layers, figsize=(2.2 * layers, 2.3 * len(tables)),
                           squeeze=False)
  for row, (label, maps) in zip(axes, tables):
    for i, ax in enumerate(row):
      ax.set_xticks([])
      ax.set_yticks([])
      if i >= len(maps):
        ax.axis('off')
        continue
      ax.imshow(maps[i], cmap='viridis')
      ax.set_title(f'{label}, layer {i + 1}' if i == 0 else f'layer {i + 1}', fontsize=8)
    row[0].set_ylabel('query')
  for ax in axes[-1]:
    ax.set_xlabel('key')
  fig.tight_layout()
  save_png(fig, path)
  plt.close(fig)


def _plot_head_entropies(plt, results, labels, path) -> None:
  """One row per run: each layer's heads as box plots side by side, ordered by median."""
  n = len(results)
  width = max(len(r['head_entropies']) * (len(r['head_entropies'][0]) + 1) for r in results)
  fig, axes = plt.subplots(n, 1, figsize=(max(6.0, 0.12 * width), 2.6 * n), sharey=True,
                           squeeze=False)
  for ax, r, label in zip(axes[:, 0], results, labels):
    heads = r['head_entropies']
    num_heads = len(heads[0])
    centers = []
    for layer, layer_heads in enumerate(heads):
      start = layer * (num_heads + 1)
      ax.boxplot(layer_heads, positions=[start + h for h in range(num_heads)], widths=0.7,
                 showfliers=False, manage_ticks=False)
      centers.append(start + (num_heads - 1) / 2)
    ax.set_xticks(centers)
    ax.set_xticklabels([str(i + 1) for i in range(len(heads))])
    ax.set_title(f'{label}: heads of each layer, ordered by median')
    ax.set_ylabel('entropy (nats)')
  axes[-1, 0].set_xlabel('layer')
  fig.tight_layout()
  save_png(fig, path)
  plt.close(fig)


def save_png(fig, path) -> None:
  """The figure as a PNG at the epath `path` (a file or an object: rendered in memory, written
  whole)."""
  buf = io.BytesIO()
  fig.savefig(buf, format='png', dpi=110)
  path.write_bytes(buf.getvalue())
