"""Serving imports no training code: loading, generating and decoding leave omni_models.training unimported."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import sys
import omni_models
pipe = omni_models.load("omni-shapes-tiny")
request = omni_models.GenerationRequest(prompt="a red circle", num_inference_steps=1, seed=0)
jobs = pipe.prepare(omni_models.resolve_request(pipe.info, request))
pipe.allocate_kv_caches_for(jobs, block_size=16)
pipe.start(jobs)
pipe.step(jobs)
pipe.decode(jobs)
pipe("a blue square", num_inference_steps=1, seed=0)
print(sorted(name for name in sys.modules if name.startswith("omni_models.training")))
"""


def test_generating_and_decoding_import_no_training_module():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
