"""dlaunch: a declarative, YAML-configured training launcher for PyTorch.

The tf.distribute-style API lives in :mod:`launcher.distribute`; the ``dlaunch``
command lives in :mod:`launcher.cli`.
"""

__version__ = "0.1.0"
