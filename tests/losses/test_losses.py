"""Every loss against its docstring formula computed by hand (plain `math`, never skipped), and against TRL's own
code on random log-probs where TRL implements it (skipped when TRL is not installed)."""

import importlib.util
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from fastdpo.config import TrainConfig
from fastdpo.dpo.beta import BetaSchedule
from fastdpo.errors import FastDPOError
from fastdpo.losses import LOSSES, LossInputs, LossParams, at, loss_inputs, step_view, total_loss
from fastdpo.model.seqlogps import SeqLogps, summarise, token_offsets

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed")

# ---------------------------------------------------------------- hand math

# three pairs: policy / reference log-prob sums and completion token counts; the policy's log-prob of the prompt's
# tokens after its first and their count (ORPO's NLL)
PAIRS = [
    dict(pc=-5.0, pr=-7.0, rc=-6.0, rr=-6.5, nc=4, nr=5, pp=-9.0, np=3),
    dict(pc=-8.0, pr=-6.0, rc=-7.5, rr=-6.2, nc=6, nr=3, pp=0.0, np=0),
    dict(pc=-3.0, pr=-9.0, rc=-4.0, rr=-8.0, nc=2, nr=7, pp=-14.0, np=5),
]
BETA, EPS = 0.5, 0.1


def ls(z):
    return -math.log1p(math.exp(-z)) if z > 0 else z - math.log1p(math.exp(z))


def sig(z):
    return 1 / (1 + math.exp(-z))


def inputs(pairs=PAIRS, ref=True):
    t = lambda k: torch.tensor([p[k] for p in pairs], dtype=torch.float32)
    n = lambda k: torch.tensor([p[k] for p in pairs])
    return LossInputs(t("pc"), t("pr"), t("rc") if ref else None, t("rr") if ref else None, n("nc"), n("nr"),
                      prompt_logps=t("pp"), prompt_tokens=n("np"))


def h(p):
    return (p["pc"] - p["rc"]) - (p["pr"] - p["rr"])


def lr(p):
    return p["pc"] - p["rc"], p["pr"] - p["rr"]


MEAN_NC = sum(p["nc"] for p in PAIRS) / len(PAIRS)
MEAN_NP = sum(p["np"] for p in PAIRS) / len(PAIRS)


def log1mexp(t):
    return math.log(1 - math.exp(t))


def aot_hand(pairs, paired):
    if paired:
        a = sorted(p["pc"] - p["pr"] for p in pairs)
        b = sorted(p["rc"] - p["rr"] for p in pairs)
    else:
        a = sorted(lr(p)[0] for p in pairs)
        b = sorted(lr(p)[1] for p in pairs)
    return [-(1 - EPS) * ls(BETA * (x - y)) - EPS * ls(-BETA * (x - y)) for x, y in zip(a, b)]


HAND = {
    "sigmoid": lambda p: -(1 - EPS) * ls(BETA * h(p)) - EPS * ls(-BETA * h(p)),
    "robust": lambda p: (-(1 - EPS) * ls(BETA * h(p)) + EPS * ls(-BETA * h(p))) / (1 - 2 * EPS),
    "ipo": lambda p: ((lr(p)[0] / p["nc"] - lr(p)[1] / p["nr"]) - 1 / (2 * BETA)) ** 2,
    "hinge": lambda p: max(0.0, 1 - BETA * h(p)),
    "exo_pair": lambda p: (sig(BETA * h(p)) * (ls(BETA * h(p)) - math.log(1 - EPS))
                           + sig(-BETA * h(p)) * (ls(-BETA * h(p)) - math.log(EPS))),
    "nca_pair": lambda p: -ls(BETA * lr(p)[0]) - 0.5 * ls(-BETA * lr(p)[0]) - 0.5 * ls(-BETA * lr(p)[1]),
    "bco_pair": lambda p: -ls(BETA * lr(p)[0]) - ls(-BETA * lr(p)[1]),
    "sppo_hard": lambda p: (lr(p)[0] - 1 / (2 * BETA)) ** 2 + (lr(p)[1] + 1 / (2 * BETA)) ** 2,
    "apo_zero": lambda p: 1 - sig(BETA * lr(p)[0]) + sig(BETA * lr(p)[1]),
    "apo_down": lambda p: sig(BETA * lr(p)[0]) + 1 - sig(BETA * (lr(p)[0] - lr(p)[1])),
    "discopop": lambda p: (-ls(BETA * h(p)) * (1 - sig(BETA * h(p) / 0.05)) + math.exp(-BETA * h(p)) * sig(BETA * h(p) / 0.05)),
    "sigmoid_norm": lambda p: -ls(BETA * (lr(p)[0] / p["nc"] - lr(p)[1] / p["nr"])),
    "sft": lambda p: -p["pc"] / MEAN_NC,
    "simpo": lambda p: (-(1 - EPS) * ls(BETA * (p["pc"] / p["nc"] - p["pr"] / p["nr"]) - 0.7)
                        - EPS * ls(-(BETA * (p["pc"] / p["nc"] - p["pr"] / p["nr"]) - 0.7))),
    "cpo": lambda p: (-(1 - EPS) * ls(BETA * (p["pc"] - p["pr"])) - EPS * ls(-BETA * (p["pc"] - p["pr"]))
                      + 0.3 * -p["pc"] / MEAN_NC),
    "plackett_luce": lambda p: -ls(BETA * h(p)),  # each pair a ranking of two: sigmoid DPO
    "orpo": lambda p: (-(p["pp"] + p["pc"]) / (MEAN_NC + MEAN_NP) - 0.2 * ls(
        (p["pc"] / p["nc"] - p["pr"] / p["nr"]) - (log1mexp(p["pc"] / p["nc"]) - log1mexp(p["pr"] / p["nr"])))),
}
PARAMS = LossParams(beta=BETA, label_smoothing=EPS, simpo_gamma=0.7, cpo_alpha=0.3, orpo_alpha=0.2)


# unpaired rows (KTO): "chosen" is the row's completion; labels, the round's KL estimate z and the label weights
LABELS, KL, W_D, W_U = [True, False, True], 0.3, 1.4, 0.6
UNPAIRED_HAND = {
    "kto": lambda p, good: (W_D * (1 - sig(BETA * (lr(p)[0] - KL))) if good
                            else W_U * (1 - sig(BETA * (KL - lr(p)[0])))),
    "apo_zero_unpaired": lambda p, good: W_D * (1 - sig(BETA * lr(p)[0])) if good else W_U * sig(BETA * lr(p)[0]),
}


def test_every_registered_loss_has_a_hand_test():
    assert set(HAND) | {"aot", "aot_unpaired"} | set(UNPAIRED_HAND) == set(LOSSES)


@pytest.mark.parametrize("name", sorted(UNPAIRED_HAND))
def test_unpaired_loss_by_hand(name):
    import dataclasses

    x = dataclasses.replace(inputs(), labels=torch.tensor(LABELS), kl=torch.full((3,), KL))
    got = LOSSES[name].fn(x, LossParams(beta=BETA, desirable_weight=W_D, undesirable_weight=W_U))
    want = torch.tensor([UNPAIRED_HAND[name](p, good) for p, good in zip(PAIRS, LABELS)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def plackett_luce_by_hand(rewards: list[float]) -> float:
    """-log P(order) of rewards listed best first: the product over positions k of exp(r_k) / sum_{j>=k} exp(r_j)."""
    return -sum(r - math.log(sum(math.exp(q) for q in rewards[k:])) for k, r in enumerate(rewards))


def test_plackett_luce_equals_the_likelihood_by_hand_on_random_rankings():
    """Random rankings of 2 to 6 completions given as their adjacent pairs: each ranking's pairs sum to -log P of
    its order (the likelihood's product written out), and P over all K! orders of a ranking sums to 1."""
    import itertools

    g = torch.Generator().manual_seed(0)
    sizes = [2, 5, 3, 6, 4]
    pol = [torch.randn(k, generator=g, dtype=torch.float64) * 3 for k in sizes]
    ref = [torch.randn(k, generator=g, dtype=torch.float64) * 3 for k in sizes]
    # adjacent pairs (y_k, y_k+1) of each ranking, consecutive
    pc = torch.cat([p[:-1] for p in pol]).float()
    pr = torch.cat([p[1:] for p in pol]).float()
    rc = torch.cat([r[:-1] for r in ref]).float()
    rr = torch.cat([r[1:] for r in ref]).float()
    n = torch.ones_like(pc, dtype=torch.long)
    x = LossInputs(pc, pr, rc, rr, n, n, rankings=[k - 1 for k in sizes])
    per_pair = LOSSES["plackett_luce"].fn(x, LossParams(beta=BETA))
    at = 0
    for k, p, r in zip(sizes, pol, ref):
        rewards = (BETA * (p - r)).tolist()
        assert float(per_pair[at: at + k - 1].sum()) == pytest.approx(plackett_luce_by_hand(rewards), rel=1e-5)
        at += k - 1
        if k <= 5:
            total = sum(math.exp(-plackett_luce_by_hand([rewards[i] for i in order]))
                        for order in itertools.permutations(range(k)))
            assert total == pytest.approx(1.0, rel=1e-9)


def test_plackett_luce_is_sigmoid_dpo_for_pairs():
    """K = 2: the same loss and the same gradients as sigmoid DPO on random log-probs."""
    g = torch.Generator().manual_seed(1)
    t = [torch.randn(7, generator=g, requires_grad=True) for _ in range(4)]
    n = torch.ones(7, dtype=torch.long)
    pl = LOSSES["plackett_luce"].fn(LossInputs(*t, n, n, rankings=[1] * 7), LossParams(beta=0.7))
    grads_pl = torch.autograd.grad(pl.sum(), t)
    dpo = LOSSES["sigmoid"].fn(LossInputs(*t, n, n), LossParams(beta=0.7))
    grads_dpo = torch.autograd.grad(dpo.sum(), t)
    torch.testing.assert_close(pl, dpo, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads_pl, grads_dpo):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(HAND))
def test_loss_by_hand(name):
    got = LOSSES[name].fn(inputs(ref=LOSSES[name].needs_reference), PARAMS)
    want = torch.tensor([HAND[name](p) for p in PAIRS])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["aot", "aot_unpaired"])
def test_aot_by_hand(name):
    got = LOSSES[name].fn(inputs(), PARAMS)
    # the per-pair split differs from the sorted order; the step's loss is their sum
    assert got.sum().item() == pytest.approx(sum(aot_hand(PAIRS, name == "aot")), rel=1e-5)


@pytest.mark.parametrize("name", ["aot", "aot_unpaired"])
def test_aot_over_micro_batches_equals_whole_step(name):
    """Sorting couples the pairs of a step: split into micro-batches with the step view, the summed loss and every
    gradient equal those of the whole step sorted at once."""
    g = torch.Generator().manual_seed(0)
    base = {k: -torch.rand(7, generator=g) * 10 for k in ("pc", "pr", "rc", "rr")}
    n = torch.randint(1, 9, (7,), generator=g)

    def make(sl):
        leaves = {k: base[k][sl].clone().requires_grad_(k in ("pc", "pr")) for k in base}
        return leaves, LossInputs(leaves["pc"], leaves["pr"], leaves["rc"], leaves["rr"], n[sl], n[sl])

    whole_leaves, whole = make(slice(None))
    LOSSES[name].fn(whole, PARAMS).sum().backward()
    parts = [make(slice(0, 3)), make(slice(3, 7))]
    view = step_view([x for _, x in parts])
    total = 0.0
    for (_, x), off in zip(parts, (0, 3)):
        x.step = at(view, off, x.policy_chosen.numel())
        loss = LOSSES[name].fn(x, PARAMS).sum()
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(LOSSES[name].fn(make(slice(None))[1], PARAMS).sum().item(), rel=1e-6)
    for k in ("pc", "pr"):
        got = torch.cat([parts[0][0][k].grad, parts[1][0][k].grad])
        torch.testing.assert_close(got, whole_leaves[k].grad)


@pytest.mark.parametrize("kind,f", [
    ("forward_kl", lambda t: 1 - math.exp(-t)),
    ("js_divergence", lambda t: math.log(2) + ls(t)),
    ("alpha_divergence", lambda t: (math.exp(-0.5 * t) - 1) / -0.5),
])
def test_f_divergence_scores_by_hand(kind, f):
    p = LossParams(beta=BETA, f_divergence_type=kind, f_alpha_divergence_coef=0.5)
    got = LOSSES["sigmoid"].fn(inputs(), p)
    want = [-ls(BETA * (f(lr(q)[0]) - f(lr(q)[1]))) for q in PAIRS]
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_combination_and_rpo_by_hand():
    """--loss_type sigmoid,sft --loss_weights 1,0.1 (MPO) and --rpo_alpha."""
    p = LossParams(beta=BETA)
    got = total_loss(inputs(), p, [("sigmoid", 1.0), ("sft", 0.1)], rpo_alpha=0.5)
    want = [-ls(BETA * h(q)) + 0.1 * -q["pc"] / MEAN_NC + 0.5 * -q["pc"] / MEAN_NC for q in PAIRS]
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-6)
    # summed over the step and divided by its pairs, the NLL is the token mean over the step's chosen tokens
    nll = total_loss(inputs(), p, [("sft", 1.0)]).mean().item()
    assert nll == pytest.approx(-sum(q["pc"] for q in PAIRS) / sum(q["nc"] for q in PAIRS), rel=1e-6)


# one pair laid out token by token, tokens of the two sequences interleaved to show order does not matter
TOK = torch.tensor([-1.0, -4.0, -2.0, -5.0, -3.0])
SEQ = torch.tensor([0, 1, 0, 1, 0])  # chosen: -1, -2, -3; rejected: -4, -5
LENGTHS = torch.tensor([3, 2])


def test_token_offsets_and_ld_dpo_by_hand():
    assert token_offsets(SEQ, 2).tolist() == [0, 0, 1, 1, 2]
    s = summarise(TOK, SEQ, LENGTHS)
    assert s.sums.tolist() == [-6.0, -9.0]
    assert s.shared.tolist() == [-3.0, -9.0]  # min(3, 2) = 2 shared tokens
    ref = SeqLogps(torch.tensor([-5.0, -8.0]), torch.tensor([-2.5, -8.0]))
    x = loss_inputs(s, ref, LENGTHS, ld_alpha=0.5)
    assert x.policy_chosen.item() == -3.0 + 0.5 * -3.0  # shared + alpha * tail
    assert x.ref_chosen.item() == -2.5 + 0.5 * -2.5
    assert x.policy_rejected.item() == -9.0
    assert x.chosen_nll_logps.item() == -6.0  # the NLL is never length-weighted


def test_token_offsets_match_a_plain_loop_on_random_layouts():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        n_seqs = int(torch.randint(1, 9, (1,), generator=g))
        seq = torch.randint(0, n_seqs, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g)
        seen: dict[int, int] = {}
        expected = []
        for s in seq.tolist():
            expected.append(seen.get(s, 0))
            seen[s] = seen.get(s, 0) + 1
        assert token_offsets(seq, n_seqs).tolist() == expected


def test_wpo_weights_by_hand():
    lss = torch.tensor([-0.5, -1.0, -0.2, -2.0, -0.3])  # log sum_v p_v^2 at each token
    s = summarise(TOK, SEQ, LENGTHS, lss)
    w_c = ((-1 + 0.5) + (-2 + 0.2) + (-3 + 0.3)) / 3
    w_r = ((-4 + 1.0) + (-5 + 2.0)) / 2
    x = loss_inputs(s, s, LENGTHS)
    assert x.pair_weights.item() == pytest.approx(math.exp(w_c + w_r), rel=1e-6)
    got = total_loss(x, LossParams(beta=BETA), [("sigmoid", 1.0)])
    assert got.item() == pytest.approx(-ls(0.0) * math.exp(w_c + w_r), rel=1e-6)


def test_adaptive_beta_by_hand():
    b = BetaSchedule(0.2, "kl_adaptive", target=0.5, window=2, min_ratio=0.5)

    def step(drift_per_token):
        tokens = torch.tensor([2])
        x = LossInputs(torch.tensor([drift_per_token * 2]), torch.tensor([-drift_per_token * 2]), torch.zeros(1),
                       torch.zeros(1), tokens, tokens)
        b.observe(x)
        b.step()
        return float(b.value())

    assert step(0.3) == pytest.approx(0.2)  # in range: beta unchanged
    assert step(1.5) == pytest.approx(0.2 * (1 - 0.2 * (0.9 - 0.5)))  # mean of the window (0.3, 1.5) = 0.9
    assert step(10.0) == pytest.approx(0.1)  # 1 - 0.2 * 5.25 < 0.5: held at the floor, 0.5 * beta
    step(0.1)
    assert step(0.1) == pytest.approx(0.2)  # back in range: restored
    assert BetaSchedule(0.2).value() == 0.2


@pytest.mark.parametrize("kw,needle", [
    (dict(loss_type="exo_pair"), "label_smoothing > 0"),
    (dict(loss_type="nca_pair", f_divergence_type="js_divergence"), "f_divergence_type"),
    (dict(loss_type="sigmoid,sft", loss_weights="1"), "one weight per loss"),
    (dict(loss_type="sigmoid,sft", loss_weights="1,x"), "comma-separated numbers"),
    (dict(loss_type="sigmoid,bogus"), "'bogus' is unknown"),
    (dict(loss_type="aot", use_weighting=True), "use_weighting"),
    (dict(loss_type="simpo", beta_schedule="kl_adaptive"), "reference-free"),
    (dict(sync_ref_model=True, train_type="lora"), "full fine-tuning"),
    (dict(sync_ref_model=True, precompute_ref_log_probs=True), "cannot be precomputed"),
    (dict(ld_alpha=1.5), "ld_alpha"),
    (dict(adapters="x"), "--train_type lora"),
    (dict(ref_adapters="x", ref_model="y"), "not both"),
])
def test_bad_loss_settings_are_user_errors(kw, needle):
    with pytest.raises(FastDPOError, match=needle.replace("(", r"\(")):
        TrainConfig(model="m", dataset=["d"], **kw).validate()


def test_loss_terms_from_yaml_lists():
    cfg = TrainConfig(model="m", dataset=["d"], loss_type=["sigmoid", "sft"], loss_weights=[1, 0.1])
    assert cfg.loss_terms() == [("sigmoid", 1.0), ("sft", 0.1)]
    assert TrainConfig(model="m", dataset=["d"], loss_type="simpo").needs_reference() is False


# ---------------------------------------------------------------- TRL's own code on random log-probs


def random_layout(b=5, seed=0):
    """Random per-token log-probs of B pairs: TRL's padded tensors and our per-token tensors of the same numbers."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(1, 5, (b,), generator=g)
    clen = torch.randint(1, 9, (2 * b,), generator=g)  # chosen 0..B-1, rejected B..2B-1
    width = int((plen.repeat(2) + clen).max())
    mask = torch.zeros(2 * b, width, dtype=torch.long)
    for r in range(2 * b):
        p = int(plen[r % b])
        mask[r, p : p + int(clen[r])] = 1
    shift = mask[:, 1:]
    pol = -torch.rand(2 * b, width - 1, generator=g, dtype=torch.float64) * 3 * shift
    ref = (pol + torch.randn(2 * b, width - 1, generator=g, dtype=torch.float64) * 0.4) * shift
    ref = ref.clamp(max=-1e-3) * shift
    lss = -(0.2 + torch.rand(2 * b, width - 1, generator=g, dtype=torch.float64)) * shift
    rows, cols = shift.nonzero(as_tuple=True)  # row-major: each sequence's tokens in order
    ours = dict(pol=pol[rows, cols].float(), ref=ref[rows, cols].float(), lss=lss[rows, cols].float(), seq=rows,
                lengths=shift.sum(1))
    return dict(mask=mask, pol=pol.float(), ref=ref.float(), lss=lss.float()), ours


class FakeLM(torch.nn.Module):
    """Stands in for TRL's fused-head model output: per-token log-probs at completion positions, zero elsewhere."""

    def __init__(self, log_probs, log_sum_sq):
        super().__init__()
        self.log_probs, self.log_sum_sq = log_probs, log_sum_sq
        self.is_gradient_checkpointing = False

    def forward(self, **kw):
        shape = self.log_probs.shape
        return SimpleNamespace(log_probs=self.log_probs, log_sum_sq_probs=self.log_sum_sq,
                               entropy=torch.zeros(shape), mean_logits=torch.zeros(shape),
                               is_top1=torch.zeros(shape, dtype=torch.bool), aux_loss=None)


def trl_dpo_loss(t, loss_types, weights=None, **kw) -> float:
    from trl.trainer.dpo_trainer import DPOTrainer

    acc = SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x,
                          unwrap_model=lambda m: m)
    policy = FakeLM(t["pol"], t["lss"])
    fake = SimpleNamespace(
        accelerator=acc, model=policy, ref_model=FakeLM(t["ref"], t["lss"]), precompute_ref_logps=False,
        beta=kw.get("beta", 0.1), loss_types=loss_types, loss_weights=weights or [1.0] * len(loss_types),
        ld_alpha=kw.get("ld_alpha"), f_divergence_type=kw.get("f_divergence_type", "reverse_kl"),
        f_alpha_divergence_coef=kw.get("f_alpha_divergence_coef", 0.5), label_smoothing=kw.get("label_smoothing", 0.0),
        use_weighting=kw.get("use_weighting", False), aux_loss_enabled=False,
        args=SimpleNamespace(discopop_tau=kw.get("discopop_tau", 0.05), gradient_checkpointing_kwargs=None),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )
    inputs = {"input_ids": torch.ones_like(t["mask"]), "attention_mask": torch.ones_like(t["mask"]),
              "completion_mask": t["mask"]}
    return float(DPOTrainer._compute_loss(fake, policy, inputs, False))


def our_loss(o, loss_types, weights=None, **kw) -> float:
    params = LossParams(**{k: v for k, v in kw.items() if k in LossParams.__dataclass_fields__})
    pol = summarise(o["pol"], o["seq"], o["lengths"], o["lss"] if kw.get("use_weighting") else None)
    ref = None
    if any(LOSSES[n].needs_reference for n in loss_types):
        ref = summarise(o["ref"], o["seq"], o["lengths"])
    ld = kw.get("ld_alpha")
    x = loss_inputs(pol, ref, o["lengths"], ld_alpha=1.0 if ld is None else ld)
    return float(total_loss(x, params, list(zip(loss_types, weights or [1.0] * len(loss_types)))).mean())


TRL_LOSSES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]
TRL_CASES = (
    [([n], {"label_smoothing": 0.1 if n in ("exo_pair", "robust", "aot", "aot_unpaired") else 0.0}) for n in TRL_LOSSES]
    + [([n], {"f_divergence_type": f, "label_smoothing": 0.01 if n == "exo_pair" else 0.0})
       for n in ("sigmoid", "ipo", "hinge", "exo_pair", "discopop", "sigmoid_norm")
       for f in ("forward_kl", "js_divergence", "alpha_divergence")]
    + [(["sigmoid"], {"ld_alpha": 0.3}), (["ipo"], {"ld_alpha": 0.0}), (["apo_zero"], {"ld_alpha": 0.5}),
       (["sigmoid"], {"use_weighting": True}), (["bco_pair"], {"use_weighting": True}),
       (["sigmoid", "bco_pair", "sft"], {"weights": [0.8, 0.2, 1.0]}), (["sigmoid", "sft"], {"weights": [1.0, 0.1]}),
       (["sigmoid"], {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.8, "beta": 0.3})]
)


@needs_trl
@pytest.mark.parametrize("names,kw", TRL_CASES, ids=lambda v: str(v))
def test_equals_trl_dpo_trainer(names, kw):
    kw = {"beta": 0.4, **kw}
    weights = kw.pop("weights", None)
    for seed in range(3):
        t, o = random_layout(seed=seed)
        want = trl_dpo_loss(t, names, weights, **kw)
        assert our_loss(o, names, weights, **kw) == pytest.approx(want, rel=2e-5, abs=1e-6)


@needs_trl
@pytest.mark.parametrize("name", ["simpo", "cpo"])
def test_equals_trl_cpo_trainer(name):
    from trl.experimental.cpo import CPOTrainer

    _, o = random_layout(seed=4)
    pol = summarise(o["pol"], o["seq"], o["lengths"])
    x = loss_inputs(pol, None, o["lengths"])
    b = x.policy_chosen.numel()
    p = LossParams(beta=0.7, label_smoothing=0.05, simpo_gamma=0.4, cpo_alpha=0.3)
    fake = SimpleNamespace(alpha=0.0, beta=p.beta, label_smoothing=p.label_smoothing, simpo_gamma=p.simpo_gamma,
                           loss_type="simpo" if name == "simpo" else "sigmoid",
                           accelerator=SimpleNamespace(device=torch.device("cpu")))
    n_c, n_r = o["lengths"][:b], o["lengths"][b:]
    # CPOTrainer averages log-probs over tokens for simpo, sums them for sigmoid; it adds cpo_alpha * NLL(chosen)
    args = (x.policy_chosen / n_c, x.policy_rejected / n_r) if name == "simpo" else (x.policy_chosen, x.policy_rejected)
    want = CPOTrainer.cpo_loss(fake, *args)[0].mean()
    if name == "cpo":
        want = want + p.cpo_alpha * -x.policy_chosen.sum() / n_c.sum()
    assert float(LOSSES[name].fn(x, p).mean()) == pytest.approx(float(want), rel=1e-5)


@needs_trl
def test_equals_trl_orpo_trainer():
    from trl.experimental.orpo import ORPOTrainer

    _, o = random_layout(seed=5)
    seqs = summarise(o["pol"], o["seq"], o["lengths"])
    b = o["lengths"].numel() // 2
    g = torch.Generator().manual_seed(5)
    n_p = torch.randint(0, 6, (b,), generator=g)
    seqs.prompt = -torch.rand(b, generator=g) * n_p * 3  # a prompt's log-prob, 0 without prompt targets
    x = loss_inputs(seqs, None, o["lengths"], prompt_lengths=n_p)
    n_c, n_r = o["lengths"][:b], o["lengths"][b:]
    fake = SimpleNamespace(beta=0.25, accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses = ORPOTrainer.odds_ratio_loss(fake, x.policy_chosen / n_c, x.policy_rejected / n_r)[0]
    # ORPOTrainer: the NLL's token mean over the chosen sequences' prompt and completion - mean(lambda * ls(log odds))
    want = -(seqs.prompt.sum() + x.policy_chosen.sum()) / (n_p.sum() + n_c.sum()) - losses.mean()
    got = LOSSES["orpo"].fn(x, LossParams(orpo_alpha=0.25)).mean()
    assert float(got) == pytest.approx(float(want), rel=1e-5)
