"""The three `keras_pipe.verify` reports of docs/exactness.md are what
verify prints today: each documented call is run again and its report
compared with the page's, line by line (numbers to 3 significant digits,
those under 1e-4 only as float rounding; the rows of the variable table as
a set, since rows at rounding level can trade places). The seed is the
suite's, 1234.
"""

import os
import re

import keras
import pytest

import keras_pipe
from tests import test_sparse_gradients as sparse
from tests import test_verify

pytestmark = pytest.mark.slow  # trains models: the full suite's tier

PAGE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs",
                    "exactness.md")
CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def documented_reports():
    """The page's ``` blocks that start with a verify report."""
    text = open(PAGE, encoding="utf-8").read()
    return [block for block in re.findall(r"```\n(.*?)```", text, re.S)
            if block.startswith("keras_pipe.verify:")]


def _report_one(devices):
    # An Embedding over token ids and a learned position table.
    keras.utils.set_random_seed(1234)
    x, y = sparse._data(tokens=True)
    return keras_pipe.verify(sparse._model(tokens=True), x, y, loss=CE,
                             optimizer="adam", num_micro_batches=4,
                             schedule="zb_h2", devices=devices[:2], steps=3)


def _report_two(devices):
    keras.utils.set_random_seed(1234)
    x, y = test_verify._batch()
    model = test_verify._mlp(keras.layers.BatchNormalization(name="bn"))
    with pytest.warns(UserWarning, match="BatchNormalization"):
        return keras_pipe.verify(model, x, y, loss=CE, optimizer="adam",
                                 num_micro_batches=2, devices=devices[:2])


def _report_three(devices):
    keras.utils.set_random_seed(1234)
    x, y = test_verify._batch()
    model = test_verify._mlp(test_verify.BatchCentered(name="centered"))
    return keras_pipe.verify(model, x, y, loss=CE, optimizer="adam",
                             num_micro_batches=2, devices=devices[:2])


def _rounded(line):
    """The line with every number at 3 significant digits, and those under
    1e-4 (float rounding, which another build may round otherwise) as
    `~0`."""
    def number(match):
        value = float(match.group(0))
        return "~0" if abs(value) < 1e-4 else f"{value:.3g}"
    return re.sub(r"(?<![\w/])-?\d+\.?\d*(?:e[-+]?\d+)?(?![\w/])", number,
                  " ".join(line.split()))


def _split(text):
    """(lines before the variable table, the table's rows as a set),
    numbers rounded."""
    lines = [_rounded(line) for line in text.strip("\n").splitlines()]
    head = next(i for i, line in enumerate(lines)
                if line.split()[:1] == ["variable"])
    return lines[:head + 1], set(lines[head + 1:])


@pytest.mark.parametrize("index,run", [
    (0, _report_one), (1, _report_two), (2, _report_three)])
def test_documented_report_is_printed_today(devices, index, run):
    documented = documented_reports()
    assert len(documented) == 3
    printed = str(run(devices))
    assert _split(printed) == _split(documented[index]), printed
