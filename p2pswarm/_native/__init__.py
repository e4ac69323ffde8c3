"""Where ``pip install`` puts the libggml it builds (``libp2pswarm-ggml-base`` and
``libp2pswarm-ggml-cpu``, by ``native/build_ggml.py``): the ggml kernel loads them from here first.

The libraries are build output, not source (git ignores them); a package directory so that
setuptools ships them inside the p2pswarm package, in wheels and in editable installs alike.
"""
