"""Where the README's test command spends its time: the seconds of each test module (the sum
of its tests' setup, call and teardown, from pytest's JUnit XML) and the whole run's wall time.

  python -m pytest -q -n 2 tests --junitxml=/tmp/suite.xml    # the README's command, plus XML
  python benchmarks/test_suite_time.py /tmp/suite.xml [/tmp/suite_before.xml]

With a second file, a column for each and their ratio (modules sorted by the first file's
time). Under -n 2 the modules' seconds add up to about twice the wall time (two workers).
"""

import argparse
import collections
import xml.etree.ElementTree as ET


def module_seconds(path: str) -> tuple[dict[str, float], float, int]:
  """{test module: seconds}, the run's wall seconds and its number of tests."""
  root = ET.parse(path).getroot()
  suite = root if root.tag == 'testsuite' else root.find('testsuite')
  seconds = collections.Counter()
  for case in suite.iter('testcase'):
    if case.get('classname'):  # (a test whose worker crashed is an empty entry)
      seconds[case.get('classname').split('.')[-1]] += float(case.get('time') or 0)
  return dict(seconds), float(suite.get('time')), int(suite.get('tests'))


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('xml', nargs='+', help="pytest's --junitxml files (one or two)")
  args = p.parse_args()
  runs = [module_seconds(path) for path in args.xml]
  first = runs[0][0]
  names = sorted(set().union(*(r[0] for r in runs)), key=lambda m: -first.get(m, 0))
  header = '| module | ' + ' | '.join(f'{path} (s)' for path in args.xml)
  print(header + (' | ratio |' if len(runs) == 2 else ' |'))
  print('|---' * (len(runs) + 1 + (len(runs) == 2)) + '|')
  for name in names:
    cells = [r[0].get(name) for r in runs]
    row = f'| {name} | ' + ' | '.join('-' if c is None else f'{c:.0f}' for c in cells)
    if len(runs) == 2:
      row += f' | {cells[1] / cells[0]:.2f}' if cells[0] and cells[1] is not None else ' | -'
    print(row + ' |')
  for label, index in (('tests', 2), ('wall', 1)):
    row = f'| **{label}** | ' + ' | '.join(
        f'{r[index]}' if index == 2 else f'{r[index]:.0f}' for r in runs)
    if len(runs) == 2:
      row += f' | {runs[1][index] / runs[0][index]:.2f}'
    print(row + ' |')


if __name__ == '__main__':
  main()
