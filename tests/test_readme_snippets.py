"""Every ```python snippet of README.md and examples/README.md runs.

How a snippet is made runnable (prelude, substitutions, SavedModels) is in
`tests/support/snippets.py`. The snippets that serve an export of an example that
`tests/test_examples.py` trains and exports run there, on that export.
"""

import pytest

from tests.support import snippets

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`

SERVED = {code for example in snippets.EXAMPLES
          for codes in snippets.serving(example).values() for code in codes}
HERE = [(name, k, code) for name, k, code in snippets.SNIPPETS
        if code not in SERVED]


def test_the_readmes_have_python_snippets():
    assert {name for name, _, _ in snippets.SNIPPETS} == set(snippets.FILES)


def test_each_example_has_a_serving_snippet_run_by_its_test():
    """The snippets left out here are run by tests/test_examples.py."""
    for example in snippets.EXAMPLES:
        assert snippets.serving(example), example
    assert len(SERVED) + len(HERE) == len(snippets.SNIPPETS)


@pytest.mark.slow
@pytest.mark.parametrize("name,index,code", HERE,
                         ids=[f"{n}#{k}" for n, k, _ in HERE])
def test_snippet_runs(name, index, code, tmp_path):
    del name, index  # In the test's id.
    snippets.run(code, str(tmp_path))
