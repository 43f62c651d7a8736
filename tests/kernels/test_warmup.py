"""Building the kernels ahead (`fastdpo.kernels.warmup`): the launches built while a run loads are those training
makes, a failed build turns the kernels off, and on CUDA a fused stack built ahead builds nothing more for any
micro-batch length."""

import pytest
import torch
import transformers
from data_helpers import random_pairs
from interpreter_helpers import interpreted, rel, run_interpreted

from fastdpo.data.pack import pack_pairs, pad_pairs, split_micro_batches
from fastdpo.kernels import fp8, gather_rows, launch, logprob_head, lora, rms_norm, rope, swiglu, warmup
from fastdpo.model.backend import Backend, choose_backend, prepare_packed, sequence_logps
from fastdpo.model.fused import fuse_layers

OPS = (rms_norm, swiglu, rope, logprob_head, gather_rows, lora, fp8)


def test_warmup_under_the_interpreter():
    run_interpreted(__file__)


def record_launches(monkeypatch, seen: set) -> None:
    """Record in `seen` each launch the ops make, by kernel, argument dtypes and compile-time constants (what makes
    Triton build a kernel anew, short of integer specialisation), before making it."""

    def recorded(kernel, grid, *args, num_warps=4, **constexprs):
        dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
        seen.add((kernel.__name__, dtypes, tuple(sorted({"num_warps": num_warps, **constexprs}.items()))))
        return launch.launch(kernel, grid, *args, num_warps=num_warps, **constexprs)

    for op in OPS:
        monkeypatch.setattr(op, "launch", recorded)


@interpreted
@pytest.mark.parametrize("kind", ["full", "lora", "fp8", "fp8_base"])
def test_the_builds_ahead_are_the_builds_training_uses(model_dirs, monkeypatch, kind):
    """Every kernel a fused model launches in training (the varlen path's stand-in, policy forward and backward, a
    no-grad forward; full fine-tuning, LoRA with dropout on every linear layer, --fp8's products whose norms and
    SwiGLU write e4m3 copies, or LoRA on an FP8 base) was built ahead by `_launches` for that model's config: same
    kernel, argument dtypes and constants. A launch with other constants would be built again in the first step."""
    from model_helpers import varlen_stand_in

    from fastdpo.model import attention
    from fastdpo.model.load import load_model

    monkeypatch.setattr(attention, "_varlen_kernel", varlen_stand_in)
    model = load_model(str(model_dirs("qwen3")), torch.bfloat16, torch.device("cpu"))
    lora_run = kind in ("lora", "fp8_base")
    if kind == "fp8":  # before the kernels, as training sets them up
        from fastdpo.model.fp8 import convert_to_fp8_training

        convert_to_fp8_training(model, "rowwise")
    if kind == "fp8_base":  # before the kernels and LoRA, as training sets them up
        from fastdpo.model.fp8 import convert_to_fp8_base

        assert convert_to_fp8_base(model)
    fuse_layers(model, use_kernels=True)
    if lora_run:
        from peft import LoraConfig, get_peft_model

        from fastdpo.model.lora import fuse_lora

        model = get_peft_model(model, LoraConfig(r=4, lora_dropout=0.1, target_modules="all-linear")).train()
        assert fuse_lora(model)
    built, used = set(), set()
    record_launches(monkeypatch, built)
    config = model.config
    for thunk in warmup._launches(warmup.norm_widths(config), torch.bfloat16, torch.device("cpu"),
                                  warmup.head_size(config), lora=lora_run, dropout_rank=4 if lora_run else 0,
                                  fp8=kind == "fp8", fp8_base=kind == "fp8_base"):
        thunk()
    record_launches(monkeypatch, used)
    backend = Backend("varlen")
    prepare_packed(model, backend)
    batch = pack_pairs(random_pairs(3, model.config.vocab_size, seed=6), 1)
    seq, _ = sequence_logps(model, batch, backend)
    seq.sum().backward()
    with torch.no_grad():
        sequence_logps(model, batch, backend)
    product = "_silu_mul_fwd_fp8" if kind == "fp8" else "_silu_mul_fwd"  # --fp8: the e4m3-writing build alone
    assert {name for name, *_ in used} >= {"_rms_fwd", "_rms_bwd", product, "_silu_mul_bwd", "_rope", "_logp_fwd",
                                            "_logp_bwd", "_gather_rows_bwd"}
    if kind == "fp8":  # the e4m3 copies written by the norm (its QUANT build) and by the MLP's product
        assert ("_rms_fwd", True) in {(name, dict(c).get("QUANT")) for name, _, c in used}
    if kind in ("fp8", "fp8_base"):  # rows quantised by the kernel, and rows times the weight's scales (x's grad)
        assert {(name, dict(c).get("HAS_COL")) for name, _, c in used} >= {("_quantise_rows", False),
                                                                           ("_quantise_rows", True)}
    if lora_run:  # the adapters' dropout on its kernels
        assert {name for name, *_ in used} >= {"_lora_drop_down", "_lora_drop_dx", "_lora_drop_da"}
    assert used <= built, sorted(used - built)


def specialisation(kernel, args: tuple) -> tuple:
    """What Triton builds a kernel anew for, argument by argument (`launch._arg_key`: a tensor's dtype and 16-byte
    alignment, an int's equality to 1 and divisibility by 16), the arguments it does not specialise on left out."""
    plain = set(kernel.kwargs.get("do_not_specialize") or ())
    return tuple("-" if name in plain else launch._arg_key(a) for name, a in zip(kernel.arg_names, args))


# the tiny vision-language dirs need transformers 5's PIL image processors (the oldest transformers supported has none)
RUN_KINDS = ["full", "lora"] + (["vision"] if hasattr(transformers, "Qwen2VLImageProcessorPil") else [])


@interpreted
@pytest.mark.parametrize("train_type", RUN_KINDS)
def test_a_whole_run_with_its_certificate_builds_nothing_after_the_builds_ahead(tmp_path, model_dirs, monkeypatch,
                                                                                train_type):
    """A run's first step, its certificate's forwards (the float32 head's and the reference's) and its last record
    launch only kernels the loading thread built: same kernel, constants and Triton specialisation (alignment,
    integer arguments). A launch outside them would be compiled in the first step of a machine with empty caches.
    vision: a Qwen2.5-VL full fine-tune on rows with images, its vision tower trained (whose norms are RMSNorms of
    the tower's own width)."""
    import inspect
    import threading

    from data_helpers import easy_rows, write_jsonl

    from fastdpo.config import TrainConfig
    from fastdpo.training import setup
    from fastdpo.training.loop import train

    built, used, by_certificate = set(), set(), set()

    def recorded(kernel, grid, *args, num_warps=4, **constexprs):
        key = (kernel.fn.__name__, specialisation(kernel, args), tuple(sorted({"num_warps": num_warps,
                                                                                **constexprs}.items())))
        if threading.current_thread().name == "fastdpo-kernel-builds":
            built.add(key)
        else:
            used.add(key)
            if any(f.filename.endswith("certificate.py") for f in inspect.stack(context=0)):
                by_certificate.add(key[0])
        return launch.launch(kernel, grid, *args, num_warps=num_warps, **constexprs)

    for op in OPS:
        monkeypatch.setattr(op, "launch", recorded)
    monkeypatch.setattr(warmup, "_builds", {})  # built by this run's loading thread, not an earlier test's
    monkeypatch.setattr(setup, "kernels_wanted", lambda *a: True)  # as on CUDA: the kernels, built ahead
    if train_type == "vision":
        from vlm_helpers import build_vlm_dir, image_rows

        model = build_vlm_dir(tmp_path / "vlm", "qwen2_5_vl")
        data = write_jsonl(tmp_path / "data.jsonl", image_rows(tmp_path))
        kw = dict(freeze_vit=False, freeze_aligner=False)
    else:
        model, data = model_dirs("qwen3"), write_jsonl(tmp_path / "data.jsonl", easy_rows(8, seed=4))
        kw = dict(train_type=train_type)
    cfg = TrainConfig(model=str(model), dataset=[str(data)], output_dir=str(tmp_path / "run"), device="cpu",
                      torch_dtype="bfloat16", max_steps=1, per_device_train_batch_size=4, save_steps=0,
                      disable_progress=True, **kw)
    train(cfg, progress=False)
    assert {"_rms_fwd", "_silu_mul_fwd", "_logp_fwd"} <= by_certificate  # the certificate ran on the kernels
    assert {"_rms_bwd", "_silu_mul_bwd", "_logp_bwd"} <= {name for name, *_ in used}  # and the step trained on them
    assert used <= built, sorted(used - built)
    assert len(warmup._builds) == 1  # the widths read from config.json before loading are the loaded model's


@interpreted
def test_ready_waits_for_the_build_and_a_failed_build_turns_the_kernels_off(monkeypatch):
    monkeypatch.setattr(warmup, "_builds", {})
    monkeypatch.setattr(launch, "_failed", [])
    thread = warmup.build_ahead([64, 16], torch.bfloat16, torch.device("cpu"), 16)
    assert thread is not None and warmup.build_ahead([64, 16], torch.bfloat16, torch.device("cpu"), 16) is thread
    assert warmup.ready([64, 16], torch.bfloat16, torch.device("cpu"), 16) is None and launch.available(torch.zeros(1))

    def broken(*a):
        raise RuntimeError("ptxas fatal: unsupported architecture\nmore")

    monkeypatch.setattr(warmup, "_build", broken)
    why = warmup.ready([32], torch.bfloat16, torch.device("cpu"))
    assert why == "RuntimeError: ptxas fatal: unsupported architecture"
    assert not launch.available(torch.zeros(1))  # nothing uses them once a build failed


@interpreted
def test_launches_are_pruned_to_the_kind_of_training():
    def kinds(lora):
        return sorted((f.func.__name__, f.args[-1]) for f in warmup._launches([32], torch.float32, torch.device("cpu"),
                                                                              8, lora)
                      if f.func.__name__ in ("rms_norm_backward", "silu_mul_backward"))

    assert kinds(False) == [("rms_norm_backward", True), ("silu_mul_backward", True)]  # full: weights train, plain down
    assert kinds(True) == [("rms_norm_backward", False), ("silu_mul_backward", False), ("silu_mul_backward", True)]
    assert len(kinds(None)) == 4


def built(fn) -> int:
    """Kernels Triton has built for the jitted `fn` (its per-device caches; older releases call them `cache`)."""
    caches = getattr(fn, "device_caches", None)
    if caches is not None:
        return sum(len(c[0]) for c in caches.values())
    return sum(len(c) for c in fn.cache.values())


@pytest.mark.gpu
def test_a_fused_stack_matches_the_float32_padded_reference_and_builds_nothing_per_length():
    """Built ahead (as training does while it loads), the kernels serve micro-batches of every length without a
    single further build."""
    from gpu_helpers import logps_and_grads, qwen3

    kernels = {"_rms_fwd": rms_norm._rms_fwd, "_rms_bwd": rms_norm._rms_bwd, "_silu_mul_fwd": swiglu._silu_mul_fwd,
               "_silu_mul_bwd": swiglu._silu_mul_bwd, "_rope": rope._rope}
    pairs = random_pairs(24, 151936, seed=0, max_prompt=300, max_comp=300)
    groups = split_micro_batches(pairs[:12], 2048, 0)
    torch.backends.cuda.matmul.allow_tf32 = False
    slow, g_slow = logps_and_grads(qwen3(torch.float32), [pad_pairs(g) for g in groups], Backend("padded"))
    model = qwen3(torch.bfloat16).train()
    warmup.build_ahead([1024, 128], torch.bfloat16, torch.device("cuda"), 128).join()
    builds = {k: built(fn) for k, fn in kernels.items()}
    assert set(fuse_layers(model, use_kernels=True)) == {"Qwen3RMSNorm", "Qwen3MLP", "Qwen3Attention"}
    backend = choose_backend(model, "auto", True, torch.device("cuda"))
    prepare_packed(model, backend)
    fast, g_fast = logps_and_grads(model, [pack_pairs(g, 1) for g in groups], backend)
    assert rel(fast, slow) < 1e-2
    worst = max(rel(g_fast[n], g_slow[n]) for n in g_slow)
    assert worst < 5e-2, worst
    more = split_micro_batches(pairs[12:], 1536, 0)
    logps_and_grads(model, [pack_pairs(g, 1) for g in more], backend)
    with torch.no_grad():  # the reference's forward
        sequence_logps(model, pack_pairs(more[0], 1).to("cuda"), backend)
    lengths = {pack_pairs(g, 1).num_tokens for g in groups + more}
    assert len(lengths) >= 4 and {k: built(fn) for k, fn in kernels.items()} == builds, lengths


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.05, 0.1, 0.3])
def test_lora_dropout_built_ahead_serves_every_drop_probability(p):
    """The LoRA dropout kernels built ahead (at p = 0.5) serve a run's own p and any row count: no further build
    (the drop threshold, p x 2^16, is not specialised on)."""
    kernels = {"_lora_drop_down": lora._lora_drop_down, "_lora_drop_dx": lora._lora_drop_dx,
               "_lora_drop_da": lora._lora_drop_da}
    warmup.build_ahead([1024, 128], torch.bfloat16, torch.device("cuda"), 128, lora=True, dropout_rank=16).join()
    builds = {k: built(fn) for k, fn in kernels.items()}
    assert all(builds.values()), builds
    a = torch.randn(16, 1024, dtype=torch.bfloat16, device="cuda")
    for m in (37, 512, 1001):
        x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
        t = lora.lora_dropout_down(x, a, 7, p)
        lora.lora_dropout_input_grad(t, a, 7, p, 2.0)
        lora.lora_dropout_weight_grad(t, x, 7, p)
    torch.cuda.synchronize()
    assert {k: built(fn) for k, fn in kernels.items()} == builds
