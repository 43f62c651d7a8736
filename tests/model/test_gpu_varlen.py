"""The varlen backend on CUDA: FlashAttention's variable-length kernel against the float32 computation, and one
compiled graph for every micro-batch length. Run on a CUDA device: `pytest -m gpu tests/model/test_gpu_varlen.py`."""

import pytest
import torch
from data_helpers import easy_rows, random_pairs, write_jsonl
from gpu_helpers import logps_and_grads, qwen3, rel

from fastdpo.data.pack import pack_pairs, pad_pairs, split_micro_batches
from fastdpo.model.backend import Backend, choose_backend, prepare_packed, sequence_logps
from fastdpo.model.memory import compile_layers

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("compiled", [False, True])
def test_varlen_bf16_matches_the_float32_padded_reference(compiled):
    """bf16 varlen against separate (padded) forwards in float32 on the same weights: the error is bf16's."""
    pairs = random_pairs(12, 151936, seed=0, max_prompt=300, max_comp=300)
    groups = split_micro_batches(pairs, 2048, 0)
    ref_model = qwen3(torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False
    slow, g_slow = logps_and_grads(ref_model, [pad_pairs(g) for g in groups], Backend("padded"))
    model = qwen3(torch.bfloat16)
    model.train()
    backend = choose_backend(model, "auto", True, torch.device("cuda"))
    assert backend.name == "varlen"
    prepare_packed(model, backend)
    if compiled:
        compile_layers(model, dynamic=True)
    fast, g_fast = logps_and_grads(model, [pack_pairs(g, 1) for g in groups], backend)
    assert rel(fast, slow) < 1e-2
    worst = max(rel(g_fast[n], g_slow[n]) for n in g_slow)
    assert worst < 5e-2, worst


def test_varlen_prompt_targets_match_the_float32_padded_reference():
    """ORPO's prompt targets through bf16 varlen against the float32 padded path on the same weights, with the
    gradient of an NLL over prompt + chosen."""
    from fastdpo.model.seqlogps import completion_logps

    pairs = random_pairs(8, 151936, seed=3, max_prompt=300, max_comp=200)
    groups = split_micro_batches(pairs, 2048, 0)

    def run(model, batches, backend):
        model.zero_grad()
        outs = []
        for batch in batches:
            out = completion_logps(model, batch.to("cuda"), backend)
            (out.prompt + out.sums[: batch.num_pairs]).sum().backward()
            outs.append(out.prompt.detach().float())
        return torch.cat(outs), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}

    torch.backends.cuda.matmul.allow_tf32 = False
    slow, g_slow = run(qwen3(torch.float32), [pad_pairs(g, prompt_targets=True) for g in groups], Backend("padded"))
    model = qwen3(torch.bfloat16)
    model.train()
    backend = choose_backend(model, "auto", True, torch.device("cuda"))
    assert backend.name == "varlen"
    prepare_packed(model, backend)
    fast, g_fast = run(model, [pack_pairs(g, 1, prompt_targets=True) for g in groups], backend)
    assert rel(fast, slow) < 1e-2
    worst = max(rel(g_fast[n], g_slow[n]) for n in g_slow)
    assert worst < 5e-2, worst


def test_varlen_sliding_window_matches_dense():
    model = qwen3(torch.bfloat16, sliding_window=64, use_sliding_window=True, layer_types=["sliding_attention"] * 4)
    backend = choose_backend(model, "auto", True, torch.device("cuda"))
    assert backend.name == "varlen" and backend.window == 64
    pairs = random_pairs(4, 151936, seed=2, max_prompt=200, max_comp=150)
    prepare_packed(model, backend)
    fast, _ = logps_and_grads(model, [pack_pairs(pairs, 1)], backend)
    dense = Backend("dense", 64)
    prepare_packed(model, dense)
    slow, _ = logps_and_grads(model, [pack_pairs(pairs, 1)], dense)
    assert rel(fast, slow) < 1e-2


def test_one_compiled_graph_serves_every_length():
    """After the first micro-batches (with and without grad), new lengths build nothing."""
    import torch._dynamo

    torch._dynamo.reset()
    model = qwen3(torch.bfloat16, layers=2)
    model.train()
    backend = Backend("varlen")
    prepare_packed(model, backend)
    compile_layers(model, dynamic=True)
    counts = []
    for seed in range(6):
        pairs = random_pairs(3 + seed, 151936, seed=seed, max_prompt=400, max_comp=300)
        batch = pack_pairs(pairs, 1).to("cuda")
        seq, _ = sequence_logps(model, batch, backend)
        seq.sum().backward()
        with torch.no_grad():
            sequence_logps(model, batch, backend)
        counts.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert counts[-1] == counts[1], counts  # lengths 3-6 compiled nothing new


def test_training_on_cuda_defaults_to_varlen(tmp_path, model_dirs):
    from fastdpo import TrainConfig, train

    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(16))
    cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(tmp_path / "o"),
                      max_steps=2, per_device_train_batch_size=4, torch_dtype="bfloat16")
    summary = train(cfg, progress=False)
    assert summary["backend"] == "varlen"
    assert summary["last"]["loss"] > 0


@pytest.mark.parametrize("window", [None, 64])
def test_the_direct_flash_ops_equal_torch_s_varlen_attn(window):
    """`attention._Flash` (the aten ops called directly) against torch's `varlen_attn` on the same inputs: the same
    forward kernel, so the same output; the backward's dq adds with atomics, so its grads agree to rounding."""
    from torch.nn.attention.varlen import varlen_attn

    from fastdpo.model import attention

    assert attention._flash_ops()
    g = torch.Generator(device="cuda").manual_seed(0)
    q_lens, k_lens = [300, 41, 700, 5], [300, 290, 700, 60]  # the second and fourth: rejected over prompt keys
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), 16, 128, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    k = torch.randn(sum(k_lens), 8, 128, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    v = torch.randn(sum(k_lens), 8, 128, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    w = torch.randn(sum(q_lens), 16, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    left = -1 if window is None else window - 1
    kw = {"enable_gqa": True} if "enable_gqa" in attention._varlen_api()[1] else {}
    want = varlen_attn(q, k, v, cu_q, cu_k, 1024, 1024, scale=0.1, window_size=(left, 0), **kw)
    g_want = torch.autograd.grad((want.float() * w).sum(), (q, k, v))
    got = attention._varlen_kernel(q, k, v, cu_q, cu_k, 1024, 1024, 0.1, window)
    g_got = torch.autograd.grad((got.float() * w).sum(), (q, k, v))
    assert torch.equal(got, want)
    with torch.no_grad():
        assert torch.equal(attention._varlen_kernel(q, k, v, cu_q, cu_k, 1024, 1024, 0.1, window), want)
    for a, b in zip(g_got, g_want):
        assert rel(a, b) < 1e-2
    other = attention._varlen_kernel(q, k, v, cu_q, cu_k, 1024, 1024, 0.1, 16 if window is None else None)
    assert not torch.equal(other, want)  # the window reaches the kernel


def test_the_varlen_backward_writes_no_zeroed_copy_of_q_k_or_v():
    """The attention function takes q, k and v out of their batch of one by views: the backward runs no
    selection's backward, which writes the gradient into a zeroed tensor of the input's shape (three copies per
    layer, and a fourth when the value's gradient then needs reshaping)."""
    pairs = random_pairs(4, 151936, seed=1, max_prompt=100, max_comp=100)
    model = qwen3(torch.bfloat16, layers=2)
    model.train()
    backend = choose_backend(model, "auto", True, torch.device("cuda"))
    prepare_packed(model, backend)
    batch = pack_pairs(pairs, 1).to("cuda")
    seq, _ = sequence_logps(model, batch, backend)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        seq.sum().backward()
    names = [e.name for e in prof.events()]
    assert any("_flash_attention_backward" in n for n in names)  # the path under test ran
    assert "aten::select_backward" not in names


@pytest.mark.parametrize("name", ["varlen", "flex"])
def test_prompt_groups_on_cuda_match_the_float32_padded_reference(name):
    """Pairs sharing prompts and completions, packed as groups of up to 5 completions (the keys' gather then adds a
    prompt key's several gradient rows itself), bf16 on the varlen and flex kernels against separate float32 rows."""
    import random

    from fastdpo.data.tokenize import TokenizedPair

    rng = random.Random(0)
    words = lambda n: [rng.randrange(10, 151000) for _ in range(n)]  # noqa: E731
    pairs = []
    for _ in range(6):
        prompt, best = words(rng.randint(100, 400)), words(rng.randint(20, 200))
        pairs += [TokenizedPair(prompt, best, words(rng.randint(20, 200)), 0) for _ in range(rng.randint(1, 4))]
    for i, p in enumerate(pairs):
        p.index = i
    groups = split_micro_batches(pairs, 4096, 0, group=True)
    ref_model = qwen3(torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False
    slow, g_slow = logps_and_grads(ref_model, [pad_pairs(g) for g in groups], Backend("padded"))
    model = qwen3(torch.bfloat16)
    model.train()
    backend = choose_backend(model, name, True, torch.device("cuda")).grouping(True)
    prepare_packed(model, backend)
    batches = [pack_pairs(g, 128 if name == "flex" else 1, group=True) for g in groups]
    assert any(b.seq_alias is not None for b in batches) and any(max(map(len, b.pair_lengths)) > 3 for b in batches)
    fast, g_fast = logps_and_grads(model, batches, backend)
    assert rel(fast, slow) < 1e-2
    worst = max(rel(g_fast[n], g_slow[n]) for n in g_slow)
    assert worst < 5e-2, worst
