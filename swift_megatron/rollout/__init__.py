"""Rollout engines: the RolloutEngine protocol the trainer talks to (engine.py) and its
implementations: the embedded transformers engine (hf.py); vLLM engines come with the vLLM
issue. The trainer does not know which engine it talks to."""
