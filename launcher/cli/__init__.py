"""The ``dlaunch`` command."""
