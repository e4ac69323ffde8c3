"""p2pswarm's build backend: setuptools, plus libggml built into ``p2pswarm/_native/`` first.

Why a backend and not a setup.py command: ``pip install -e .``, ``pip install .`` and a wheel build
all come through these hooks, and an editable install needs the libraries in the source tree (where
the package is imported from), which a build_py/build_ext step would not put there. The sdist and
the metadata do not need libggml, so those hooks are setuptools' own.
"""
from __future__ import annotations

import sys
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (every other hook is setuptools')

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_ggml


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + build_ggml.build_requires()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + build_ggml.build_requires()


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    build_ggml.build_for_install()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    build_ggml.build_for_install()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
