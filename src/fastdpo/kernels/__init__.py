"""The Triton kernels, one op per file: each file holds its op's `@triton.jit` kernels, their launchers and the
autograd Functions that call them (with the eager torch path the Function takes where the kernels do not serve).

- `rms_norm`: RMSNorm, one pass each way.
- `swiglu`: silu(gate) * up, alone or into a plain down projection (the product rebuilt in the backward).
- `rope`: rotary embeddings of q and k.
- `logprob_head`: token log-probs through the output head, a chunk of the vocabulary's logits at a time.
- `gather_rows`: the backward of a row gather that takes each row once or twice (the varlen keys).
- `lora`: the LoRA linear's three-GEMM forward, and the dropout kernels that apply its mask in registers.
- `fp8`: a frozen linear held in FP8 (e4m3, row-wise scales), its product and input gradient through
  `torch._scaled_mm` (no Triton: an emulation in float32 where that does not serve).
- `adamw`: the fused AdamW step, stochastic rounding included, for every tensor of a dtype in one launch.
- `launch`: what every launcher shares (whether the kernels serve a tensor, the launch itself, block sizes).
- `warmup`: building a model's kernels on a background thread while the run loads.

This floor imports only torch, Triton and `fastdpo.errors`: the modules above it (`model`, `optim`) decide where
the ops run. Triton is optional: without it (the CPU wheel of torch brings none) the modules import, define no
kernels, and every Function takes its torch path."""
