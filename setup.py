"""Packaging for keras_pipe."""

from setuptools import find_packages, setup

setup(
    name="keras_pipe",
    version="0.1.0",
    description="GPipe pipeline parallelism for Keras 3 on TensorFlow.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["keras_pipe", "keras_pipe.*"]),
    python_requires=">=3.10",
    install_requires=[
        "tensorflow==2.21.*",
        "keras==3.15.*",
        "numpy>=1.26,<3",
    ],
    extras_require={
        "tests": ["pytest>=8,<10", "pytest-timeout>=2.3"],
        # keras-hub's WordPiece tokenizer runs on tensorflow-text, pinned to
        # the TensorFlow release above.
        "examples": ["tensorflow-datasets==4.9.*", "matplotlib>=3.8",
                     "keras-hub==0.32.*", "tensorflow-text==2.21.*",
                     "sacrebleu>=2.4,<3", "tensorboard==2.21.*"],
    },
)
