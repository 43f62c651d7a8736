"""TRL's DPOTrainer with FSDP2 through HF/accelerate on several GPUs, on a model dir and anchor rows written by
`benchmarks/make_shape.py`: the TRL side of the multi-GPU comparison (`benchmarks/multi_gpu.sh`, part trl8b).

    torchrun --nproc_per_node 2 benchmarks/trl_fsdp.py /tmp/q8 /tmp/anchor8.jsonl --per_device 4 --steps 10

Same settings as fastdpo's run where TRL has them: bf16, beta 0.1, lr 1e-6, max_length 2048, activation
checkpointing (FSDP's own), the reference log-probs precomputed (`--precompute`, the default), Liger when installed
and `--liger`. Rank 0 prints `RESULT {json}`: pairs/s over the measured steps (all GPUs), peak GiB (largest rank)."""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("dataset")
    p.add_argument("--per_device", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--precompute", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--liger", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--output_dir", default="/tmp/trl_fsdp")
    a = p.parse_args()

    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # from the file, with its cache in output_dir: TRL's precomputed reference is written next to the dataset's
    # cache files and read by every rank, which an in-memory dataset's per-process temporary dir does not allow
    data = load_dataset("json", data_files=a.dataset, split="train", cache_dir=os.path.join(a.output_dir, "cache"))
    n = a.per_device * world * (a.steps + a.warmup)
    if len(data) < n:
        raise SystemExit(f"{a.dataset} has {len(data)} rows; {n} are needed ({a.steps + a.warmup} steps of "
                         f"{a.per_device} pairs on {world} ranks).")
    # the whole model on this rank's GPU before FSDP shards it. Loading with a device_map would attach accelerate's
    # dispatch hooks, which move each layer's inputs to the device the map named and trip over the sharded forward
    # (seen with a one-device map too); a plain load and a move leave no hooks.
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:  # tensors TRL makes on "cuda" before accelerate picks the device land on this rank's GPU, not GPU 0
        torch.cuda.set_device(local)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16 if cuda else torch.float32,
                                                 attn_implementation="sdpa")
    if cuda:
        model.to(f"cuda:{local}")
    assert not any(hasattr(m, "_hf_hook") for m in model.modules()), "accelerate dispatch hooks on the model"
    wrap = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("DecoderLayer")})
    kw = dict(output_dir=a.output_dir, per_device_train_batch_size=a.per_device, gradient_accumulation_steps=1,
              max_steps=a.steps + a.warmup, learning_rate=1e-6, logging_steps=1000, save_strategy="no", report_to=[],
              bf16=cuda, max_length=2048, beta=0.1, remove_unused_columns=False, seed=0,
              precompute_ref_log_probs=a.precompute, use_liger_kernel=a.liger, use_cpu=not cuda,
              # under FSDP TRL loads its own reference for the precompute, with device_map "auto" unless told: that
              # spreads it over all GPUs with dispatch hooks; loaded on the CPU, FSDP2 moves its shards to this GPU
              model_init_kwargs={"device_map": None},
              gradient_checkpointing=False,  # TRL's default; FSDP's own checkpointing below replaces it
              fsdp="full_shard auto_wrap",
              fsdp_config={"version": 2, "activation_checkpointing": True, "transformer_layer_cls_to_wrap": wrap})
    import dataclasses

    fields = {f.name for f in dataclasses.fields(DPOConfig)}
    args = DPOConfig(**{k: v for k, v in kw.items() if k in fields})
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter())
            if len(times) > 1 and int(os.environ.get("RANK", "0")) == 0:  # as it goes: a later failure keeps these
                print(f"STEP {len(times)} {times[-1] - times[-2]:.3f} s", flush=True)

    trainer = DPOTrainer(model=model, args=args, train_dataset=data.select(range(n)),
                         processing_class=AutoTokenizer.from_pretrained(a.model), callbacks=[Timer()])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    dt = times[-1] - times[a.warmup - 1]
    # on the GPU: the process group's default backend there is NCCL, which takes no CPU tensors
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0],
                        device=f"cuda:{local}" if cuda else "cpu")
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps({"impl": "trl-fsdp" + ("-liger" if a.liger else ""), "gpus": world,
                                      "pairs_per_s": round(a.per_device * world * a.steps / dt, 2),
                                      "peak_gib_per_gpu": round(float(peak), 2), "steps": a.steps}), flush=True)


if __name__ == "__main__":
    main()
