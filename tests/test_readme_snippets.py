"""Every ```python snippet of the READMEs and of the docs pages runs.

How a snippet is made runnable (prelude, substitutions, SavedModels) is in
`tests/support/snippets.py`. The snippets that serve an export of an example
that `tests/test_examples.py` trains and exports run there, on that export.
A snippet that appears twice (the README's example is also the getting
started page's) runs once, under its first place.
"""

import pytest

from tests.support import snippets

pytestmark = pytest.mark.slow  # the fast tier: `-m "not slow"`

SERVED = {code for example in snippets.EXAMPLES
          for codes in snippets.serving(example).values() for code in codes}
HERE = []
for _name, _k, _code in snippets.SNIPPETS:
    if _code not in SERVED and _code not in {c for _, _, c in HERE}:
        HERE.append((_name, _k, _code))


def test_the_readmes_and_docs_pages_have_python_snippets():
    names = {name for name, _, _ in snippets.SNIPPETS}
    assert set(snippets.READMES) <= names
    assert {"docs/getting-started.md", "docs/guide/schedules.md",
            "docs/guide/saving.md"} <= names
    assert names <= set(snippets.FILES)


def test_each_example_has_a_serving_snippet_run_by_its_test():
    """The snippets left out here are run by tests/test_examples.py."""
    for example in snippets.EXAMPLES:
        assert snippets.serving(example), example
    here = {code for _, _, code in HERE}
    assert all(code in SERVED or code in here
               for _, _, code in snippets.SNIPPETS)


@pytest.mark.parametrize("name,index,code", HERE,
                         ids=[f"{n}#{k}" for n, k, _ in HERE])
def test_snippet_runs(name, index, code, tmp_path):
    del name, index  # In the test's id.
    snippets.run(code, str(tmp_path))
