"""The trainer: the RL loop (:mod:`.loop`), its checkpoints (:mod:`.checkpoints`) and the tree vs
flat comparison (:mod:`.compare`); its config is :mod:`treetrain.config`."""
