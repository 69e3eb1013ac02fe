"""The C-extension build of keras_pipe (the rest is in pyproject.toml).

The bind shim (`keras_pipe/distributed/_bind.c`, see
`keras_pipe/distributed/bind.py`) is compiled
here, as an extension module of the package, so that it ships in the wheel;
its SHA-256 is written next to it (`_bind.sha256`) and checked before it is
loaded.
"""

import hashlib
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_SHIM = "keras_pipe.distributed._bind"


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
                    build_py.get_package_dir("keras_pipe.distributed"),
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
EXTENSIONS = [Extension(_SHIM, sources=["keras_pipe/distributed/_bind.c"],
                        libraries=["dl"])] \
    if sys.platform.startswith("linux") else []

# Metadata, dependencies and extras are in pyproject.toml; this file only
# adds the extension and the build step that records its hash.
setup(ext_modules=EXTENSIONS, cmdclass={"build_ext": BuildExt})
