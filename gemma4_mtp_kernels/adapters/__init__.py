"""Engine adapters: the ops called over an inference engine's own tensors and layouts, views only.

    from gemma4_mtp_kernels.adapters import vllm   # vLLM's paged KV layouts, metadata and logits rows

(The Hugging Face adapter lives with the decode loop: `gemma4_mtp.hf.accelerate`.)
"""
