"""Row binding of the AR stage: the request id of a song's uncond row.

vLLM compacts and reorders its persistent batch on every finish and preemption, so nothing that lives across
steps is keyed by batch row: songs are keyed by their explicit ``cfg_pair_id``, and rows are bound to songs afresh
every step (``omni_models.music._vllm``). A song's two requests are ``{pair_id}`` (cond) and
``{pair_id}{CFG_UNCOND_SUFFIX}`` (uncond).
"""

from __future__ import annotations

CFG_UNCOND_SUFFIX = "__cfg_uncond"
