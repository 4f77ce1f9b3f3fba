"""How omni-shapes-tiny was made, and how its prompt adherence is measured: the procedural shapes world
(``shapes``), its caption grammar and vocabulary (``captions``), the pixel-reading adherence scorer (``scorer``)
and the training script (``python -m omni_models.training.train``).

Serving never needs this package: ``omni_models.load``, the pipeline and its decoding import nothing from it.
"""
