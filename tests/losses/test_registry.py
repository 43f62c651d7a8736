"""The loss registry: every --loss_type name with its traits, in the order the losses are defined; a loss registers
itself with one decorator; config checks names and traits against the registry without loading it up front."""

import subprocess
import sys

import pytest

from fastdpo.config import F_DIVERGENCE_TYPES, TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.losses import F_DIVERGENCES, LOSS_METRICS, LOSSES, loss, mean_logp_rewards, needs_prompt_targets
from fastdpo.losses.reference_free import orpo_metrics

# name: (needs_reference, f_divergence, sorts_step, mean_logps, prompt_nll, unpaired, kl_completions, listwise)
TRAITS = {
    "sigmoid": (True, True, False, False, False, False, False, False),
    "robust": (True, True, False, False, False, False, False, False),
    "ipo": (True, True, False, False, False, False, False, False),
    "hinge": (True, True, False, False, False, False, False, False),
    "exo_pair": (True, True, False, False, False, False, False, False),
    "nca_pair": (True, False, False, False, False, False, False, False),
    "bco_pair": (True, False, False, False, False, False, False, False),
    "sppo_hard": (True, False, False, False, False, False, False, False),
    "aot": (True, False, True, False, False, False, False, False),
    "aot_unpaired": (True, False, True, False, False, False, False, False),
    "apo_zero": (True, False, False, False, False, False, False, False),
    "apo_down": (True, False, False, False, False, False, False, False),
    "discopop": (True, True, False, False, False, False, False, False),
    "sigmoid_norm": (True, True, False, False, False, False, False, False),
    "sft": (False, True, False, False, False, False, False, False),
    "simpo": (False, False, False, True, False, False, False, False),
    "cpo": (False, False, False, False, False, False, False, False),
    "orpo": (False, False, False, True, True, False, False, False),
    "kto": (True, False, False, False, False, True, True, False),
    "apo_zero_unpaired": (True, False, False, False, False, True, False, False),
    "plackett_luce": (True, False, False, False, False, False, False, True),
}


def test_every_loss_with_its_traits_in_order():
    got = {name: (sp.needs_reference, sp.f_divergence, sp.sorts_step, sp.mean_logps, sp.prompt_nll, sp.unpaired,
                  sp.kl_completions, sp.listwise) for name, sp in LOSSES.items()}
    assert list(got.items()) == list(TRAITS.items())


def test_every_f_divergence_type_has_a_function():
    assert set(F_DIVERGENCES) == set(F_DIVERGENCE_TYPES)


def test_orpo_logs_its_own_metrics():
    assert LOSS_METRICS == {"orpo": (("nll_loss", "log_odds_ratio", "log_odds_chosen"), orpo_metrics)}


def test_traits_the_step_reads():
    assert mean_logp_rewards(["simpo"]) and mean_logp_rewards(["orpo"]) and not mean_logp_rewards(["cpo"])
    assert not mean_logp_rewards(["simpo", "sigmoid"])  # with a reference the rewards are sums
    assert needs_prompt_targets(["sigmoid", "orpo"]) and not needs_prompt_targets(["simpo", "sft"])


def test_a_new_loss_is_one_decorated_function():
    """Registered where it is defined, the loss is a --loss_type the config accepts, with its traits."""

    @loss("twice_margin", needs_reference=False)
    def twice_margin(x, p):
        return -2 * (x.policy_chosen - x.policy_rejected)

    try:
        cfg = TrainConfig(model="m", dataset=["d"], loss_type="twice_margin")
        cfg.validate()
        assert cfg.loss_terms() == [("twice_margin", 1.0)] and not cfg.needs_reference()
        assert LOSSES["twice_margin"].fn is twice_margin
        with pytest.raises(AssertionError, match="registered twice"):
            loss("twice_margin")(twice_margin)
    finally:
        del LOSSES["twice_margin"]
    with pytest.raises(FastDPOError, match="'twice_margin' is unknown"):
        TrainConfig(model="m", dataset=["d"], loss_type="twice_margin").loss_terms()


def test_the_f_divergence_message_names_the_losses_in_order():
    cfg = TrainConfig(model="m", dataset=["d"], loss_type="nca_pair", f_divergence_type="js_divergence")
    with pytest.raises(FastDPOError, match=r"\(sigmoid, robust, ipo, hinge, exo_pair, discopop, sigmoid_norm, sft\)"):
        cfg.validate()


def test_config_loads_the_losses_only_to_check_them():
    """Importing the config (as `fastdpo --help` does) loads neither the losses nor torch."""
    code = ("import sys, fastdpo.config; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('fastdpo.losses')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

