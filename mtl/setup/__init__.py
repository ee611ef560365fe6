"""A run's setup, above the plug-ins: its config checked against them (``checks``: ``load_run_config``; ``reads``,
``multi_input``, ``resume``) and the run's pieces built from it (``build``; a trained model's files:
``model_files``). Imports the checkpoint, the plug-ins and the config's low part; the run (mtl/run/) imports it."""
