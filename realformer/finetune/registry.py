"""Fine-tuning tasks by kind: `configs/finetune.py:<kind>/<name>` runs the FinetuneTask
registered as <kind>.

A kind is one module of realformer/finetune/tasks/ (glue.py, squad.py, tsv.py, ner.py) whose
FinetuneTask subclass is decorated with `@register('<kind>')`; the module is imported when
its kind is first asked for. A task of one's own is one more module there (or a class
registered by code that runs before the config is read, as a test does): nothing else
lists the kinds (a kind's own config fields are listed with every field's in
tests/data/config_keys.json).
"""

import importlib
import pkgutil
from typing import Dict, List

from realformer import cli

_TASKS = 'realformer.finetune.tasks'
_REGISTERED: Dict[str, type] = {}


def register(kind: str):
  """Class decorator: the FinetuneTask that `configs/finetune.py:<kind>/...` runs."""
  if not kind or '/' in kind:
    raise ValueError(f'a fine-tuning task kind is one word, not {kind!r}')

  def add(cls):
    known = _REGISTERED.get(kind)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__,
                                                                        cls.__qualname__):
      raise ValueError(f'two fine-tuning tasks are registered as {kind!r}: '
                       f'{known.__module__}.{known.__qualname__} and '
                       f'{cls.__module__}.{cls.__qualname__}')
    cls.kind = kind
    _REGISTERED[kind] = cls
    return cls
  return add


def kinds() -> List[str]:
  """Every kind: those registered and the modules of realformer/finetune/tasks/ (but for
  helpers whose name starts with _)."""
  package = importlib.import_module(_TASKS)
  return sorted(set(_REGISTERED) | {m.name for m in pkgutil.iter_modules(package.__path__)
                                    if not m.name.startswith('_')})


def get(kind: str) -> type:
  """The FinetuneTask class of `kind`, its module imported if needed; an unknown kind is a
  one-line error listing the known ones."""
  if kind not in _REGISTERED and kind in kinds():
    try:
      importlib.import_module(f'{_TASKS}.{kind}')
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(cli.code_error(f'realformer/finetune/tasks/{kind}.py', e)) from e
    if kind not in _REGISTERED:
      raise ValueError(f'realformer/finetune/tasks/{kind}.py registers no task as {kind!r}; '
                       f"decorate its FinetuneTask with @register('{kind}')")
  if kind not in _REGISTERED:
    raise ValueError(f'no fine-tuning task kind {kind!r}; choose one of '
                     f'{", ".join(kinds())} (realformer/finetune/tasks/<kind>.py)')
  return _REGISTERED[kind]
