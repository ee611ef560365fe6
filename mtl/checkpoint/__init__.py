"""What a run writes and reads back: its checkpoint folders (``folder``: step_<N>/, the manifest, verification,
resume=auto), the sharded model and optimizer state (``train_state``) and the non-finite checks on what is saved
(``finite``). Below the run (mtl/run/) and the setup (mtl/setup/): it imports the config's low part and below."""
