"""The trainer: its config (:mod:`treetrain.trainer.config`) and the RL loop (:mod:`treetrain.trainer.loop`)."""
