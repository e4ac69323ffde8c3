"""Only here to tell setuptools the wheel holds native code (libggml in p2pswarm/_native/), so it is
tagged for this platform rather than as pure Python; everything else is in pyproject.toml."""
from setuptools import setup
from setuptools.dist import Distribution


class _BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(distclass=_BinaryDistribution)
