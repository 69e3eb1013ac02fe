"""Packaging for keras_pipe.

The bind shim (`keras_pipe/_bind.c`, see `keras_pipe/bind.py`) is compiled
here, as an extension module of the package, so that it ships in the wheel;
its SHA-256 is written next to it (`_bind.sha256`) and checked before it is
loaded.
"""

import hashlib
import os
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

_SHIM = "keras_pipe._bind"


def _record(path):
    """Writes the SHA-256 of the shim at `path` to `_bind.sha256` beside it."""
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    record = os.path.join(os.path.dirname(path), "_bind.sha256")
    with open(record, "w", encoding="utf-8") as f:
        f.write(digest + "\n")


class BuildExt(build_ext):
    """Builds the extensions, then records the SHA-256 of the bind shim."""

    def build_extension(self, ext):
        super().build_extension(ext)
        if ext.name == _SHIM:
            _record(self.get_ext_fullpath(ext.name))

    def copy_extensions_to_source(self):
        # `pip install -e .`: the shim is copied into the source tree.
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            if ext.name == _SHIM:
                _record(os.path.join(
                    build_py.get_package_dir("keras_pipe"),
                    os.path.basename(self.get_ext_filename(ext.name))))

    def get_outputs(self):
        outputs = super().get_outputs()
        for ext in self.extensions:
            if ext.name == _SHIM:
                outputs.append(os.path.join(
                    os.path.dirname(self.get_ext_fullpath(ext.name)),
                    "_bind.sha256"))
        return outputs


# The shim rewrites ELF relocations: Linux only. Elsewhere workers and
# clients refuse to start unless told to listen on every interface.
EXTENSIONS = [Extension(_SHIM, sources=["keras_pipe/_bind.c"],
                        libraries=["dl"])] \
    if sys.platform.startswith("linux") else []

setup(
    name="keras_pipe",
    version="0.1.0",
    description="GPipe pipeline parallelism for Keras 3 on TensorFlow.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["keras_pipe", "keras_pipe.*"]),
    ext_modules=EXTENSIONS,
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.10",
    install_requires=[
        "tensorflow==2.21.*",
        "keras==3.15.*",
        "numpy>=1.26,<3",
    ],
    extras_require={
        "tests": ["pytest>=8,<10", "pytest-timeout>=2.3",
                  "pytest-xdist>=3.5,<4"],
        # keras-hub's WordPiece tokenizer runs on tensorflow-text, pinned to
        # the TensorFlow release above.
        "examples": ["tensorflow-datasets==4.9.*", "matplotlib>=3.8",
                     "keras-hub==0.32.*", "tensorflow-text==2.21.*",
                     "sacrebleu>=2.4,<3", "tensorboard==2.21.*"],
        # `python -m tools.benchmarks`: its peer part runs torch pipelining
        # (a CPU wheel: pip install torch==2.13.0 --index-url
        # https://download.pytorch.org/whl/cpu). Never in `tests`.
        "bench": ["torch==2.13.0", "matplotlib>=3.8"],
    },
)
