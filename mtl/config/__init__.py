"""What a run is asked to do, as plain data (the low part of the config): the keys, their types, defaults and
documentation (``keys``), YAML reading (``yaml_read``), overrides, merging and moved keys (``load``), the keys a run
reads (``read_rules``, ``effective``); ``schema`` is their public face. Imports nothing of mtl above
``mtl.registry``: the checks that know the plug-ins are in ``mtl.setup``."""
