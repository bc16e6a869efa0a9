"""The package's layers (docs/design.md): no import cycle between modules or between packages,
synthesizer/ uses only realformer.layers, data/ no training code, the library no configs/.

Imports are read from the source (every `import` statement, those inside functions too), so a
lazy import that closes a cycle counts."""

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = ('realformer', 'synthesizer', 'data')
OURS = LIBRARY + ('configs',)


def _modules():
  """{module name: path} of the library's modules and the two programs."""
  found = {'train': os.path.join(REPO, 'train.py'),
           'finetune': os.path.join(REPO, 'finetune.py')}
  for top in LIBRARY:
    for root, _, files in os.walk(os.path.join(REPO, top)):
      for name in files:
        if name.endswith('.py'):
          rel = os.path.relpath(os.path.join(root, name), REPO)[:-3].replace(os.sep, '.')
          found[rel[:-len('.__init__')] if rel.endswith('.__init__') else rel] = (
              os.path.join(root, name))
  return found


MODULES = _modules()


def _imports(module: str):
  """The modules of ours that `module` imports (resolving `from package import module`)."""
  tree = ast.parse(open(MODULES[module]).read())
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names = [f'{node.module}.{a.name}' if f'{node.module}.{a.name}' in MODULES
               else node.module for a in node.names]
    else:
      continue
    out.update(n for n in names if n.split('.')[0] in OURS and n != module)
  return out


GRAPH = {m: _imports(m) for m in MODULES}


def _package(module: str) -> str:
  """The package a module belongs to: realformer.train.trainer -> realformer.train; the
  modules directly in realformer/ form the package realformer."""
  if module in ('train', 'finetune'):
    return 'programs'
  if module.split('.')[0] == 'configs':
    return 'configs'
  is_package = os.path.basename(MODULES.get(module, '')) == '__init__.py'
  return module if is_package else module.rpartition('.')[0] or module


def _cycle(graph):
  """One cycle of the graph as a list of nodes, or None."""
  state, stack = {}, []

  def visit(node):
    state[node] = 'open'
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 'open':
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    state[node] = 'done'
    stack.pop()
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_no_import_cycle_between_modules():
  assert _cycle(GRAPH) is None, ' -> '.join(_cycle(GRAPH))


def test_no_import_cycle_between_packages():
  packages = {}
  for module, imported in GRAPH.items():
    edges = packages.setdefault(_package(module), set())
    edges.update(_package(m) for m in imported if _package(m) != _package(module))
  assert _cycle(packages) is None, ' -> '.join(_cycle(packages))


@pytest.mark.parametrize('prefix,allowed', [
    ('synthesizer', ('realformer.layers',)),
    ('data', ('realformer.cli', 'realformer.config_checks', 'realformer.model.spec',
              'realformer.run_names', 'realformer.storage')),
    ('realformer.layers', ()),
    ('realformer.model', ('realformer.layers', 'synthesizer')),
])
def test_lower_layers_import_only_what_is_below_them(prefix, allowed):
  for module, imported in GRAPH.items():
    if module == prefix or module.startswith(prefix + '.'):
      for m in imported:
        if m.split('.')[0] == prefix.split('.')[0] and m.startswith(prefix):
          continue  # within the package
        if m.split('.')[0] == 'data' and prefix == 'data':
          continue
        assert any(m == a or m.startswith(a + '.') for a in allowed), (
            f'{module} imports {m}; {prefix} may import only {allowed}')


def test_the_library_never_imports_configs():
  for module, imported in GRAPH.items():
    if module.split('.')[0] in LIBRARY:
      assert not any(m.split('.')[0] == 'configs' for m in imported), module


def test_the_cycle_check_can_fail():
  assert _cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
  assert _cycle({'a': {'b'}, 'b': set()}) is None
