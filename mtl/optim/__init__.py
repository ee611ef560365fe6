"""The optimiser's own rules, over the strategies and the metrics below it: ``plateau`` (the learning rate that follows
the validation delta-m, ``optim.scheduler=plateau``) and ``layer_groups`` (per-layer learning-rate groups,
``optim.layer_decay`` and the backbones' block settings). The setup (mtl/setup/) builds the optimiser from them."""
