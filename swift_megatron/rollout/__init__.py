"""Rollout engines: the RolloutEngine protocol the trainer talks to (engine.py) and its
implementations: the embedded transformers engine (hf.py), vLLM inside every training process
(vllm_colocate.py), remote `megatron rollout` servers (server.py, client.py); factory.py picks
one from the flags, weight_sync.py buckets the weight stream, vllm_compat.py isolates what
differs between vLLM versions. The trainer does not know which engine it talks to."""
