"""ConfigError, the exception of a bad configuration, in a module of its own.

Why here and not in config.py, which raises most of them: ddptrain/update/choose.py refuses
update-path combinations with it too, and config.py's ``load_config`` calls ``choose``; both
importing this module keeps the import graph acyclic. ``ddptrain.config.ConfigError`` and
``ddptrain.ConfigError`` are this class.
"""


class ConfigError(ValueError):
    """A configuration problem; the message names the file and/or key at fault."""
