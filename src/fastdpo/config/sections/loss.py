"""The loss section: which preference losses, their weights, beta and each loss's own settings. The losses
themselves, with their traits, register where they are defined (`fastdpo.losses`)."""

from __future__ import annotations

from dataclasses import dataclass

from fastdpo.config.fields import Section, check_choice, option
from fastdpo.errors import FastDPOError

F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


def registered_losses() -> dict:
    """The losses by --loss_type name, with their traits (`fastdpo.losses.LOSSES`: each loss registers itself where
    it is defined). Imported on use, not at the top of this module: the losses load torch, and `fastdpo --help` must
    not. The import points down the floors (the losses sit below config)."""
    from fastdpo.losses import LOSSES

    return LOSSES


@dataclass
class LossSection(Section):
    """The objective: the loss terms and every setting a loss reads."""

    name = "loss"
    title = "Loss"

    loss_type: str = option("sigmoid", "Preference loss, or several comma-separated (sigmoid,sft); see the README's table.")
    loss_weights: str = option("", "Comma-separated weights of the --loss_type terms (default 1 each), e.g. 1,0.1.")
    beta: float = option(0.1, "DPO beta (strength of the KL constraint; IPO's tau; SimPO/CPO's temperature).")
    label_smoothing: float = option(0.0, "Label smoothing eps in [0, 0.5): cDPO (sigmoid; TRL 1.16's sigmoid ignores it), "
                                    "robust, exo_pair, aot, simpo, cpo.")
    rpo_alpha: float = option(0.0, "Weight of the NLL(chosen) term (RPO); 0 disables.")
    ld_alpha: float = option(1.0, "LD-DPO: weight of completion tokens past the length both completions share (1 = off).")
    f_divergence_type: str = option("reverse_kl", "f-DPO divergence: reverse_kl|forward_kl|js_divergence|alpha_divergence.")
    f_alpha_divergence_coef: float = option(0.5, "alpha of --f_divergence_type alpha_divergence.")
    use_weighting: bool = option(False, "WPO: weight each pair by the policy's length-normalised probability of both answers.")
    discopop_tau: float = option(0.05, "DiscoPOP temperature tau.")
    simpo_gamma: float = option(0.5, "SimPO target reward margin gamma.")
    cpo_alpha: float = option(1.0, "CPO: weight of the NLL(chosen) term.")
    orpo_alpha: float = option(0.1, "ORPO: weight lambda of the odds-ratio term. Its NLL term is TRL's ORPOTrainer's: the "
                               "token mean over the step's chosen sequences, prompt and completion.")
    desirable_weight: float = option(1.0, "KTO / apo_zero_unpaired: weight of each desirable row's loss (TRL's and "
                                     "ms-swift's flag).")
    undesirable_weight: float = option(1.0, "KTO / apo_zero_unpaired: weight of each undesirable row's loss.")
    beta_schedule: str = option("constant", "constant|kl_adaptive: lower beta while the policy drifts far from the reference.")
    beta_kl_target: float = option(0.5, "kl_adaptive: drift (mean |log-ratio| per token, nats) above which beta is lowered.")
    beta_kl_window: int = option(100, "kl_adaptive: optimizer steps in the running mean of the drift.")
    beta_min_ratio: float = option(0.5, "kl_adaptive: beta never goes below this fraction of --beta.")

    def loss_terms(self) -> list[tuple[str, float]]:
        """[(loss name, weight)] from --loss_type and --loss_weights (comma strings, or YAML lists)."""
        raw = self.loss_type if isinstance(self.loss_type, list) else str(self.loss_type).split(",")
        names = [str(n).strip() for n in raw if str(n).strip()]
        if not names:
            raise FastDPOError("--loss_type is empty. Give a loss name, e.g. sigmoid.")
        losses = registered_losses()
        for name in names:
            if name not in losses:
                raise FastDPOError(f"--loss_type {name!r} is unknown. Choose from: {', '.join(sorted(losses))}.")
        w = self.loss_weights
        raw_w = w if isinstance(w, list) else [w] if isinstance(w, (int, float)) else str(w).split(",")
        raw_w = [x for x in raw_w if str(x).strip()]
        try:
            weights = [float(x) for x in raw_w] or [1.0] * len(names)
        except ValueError:
            raise FastDPOError(f"--loss_weights {w!r}: expected comma-separated numbers, e.g. 1,0.1.") from None
        if len(weights) != len(names):
            raise FastDPOError(f"--loss_weights has {len(weights)} values for {len(names)} losses in --loss_type "
                               f"{','.join(names)}. Give one weight per loss.")
        return list(zip(names, weights))

    def trains_rankings(self) -> bool:
        """Whether the loss trains on rankings (plackett_luce) rather than on independent pairs."""
        losses = registered_losses()
        return any(losses[name].listwise for name, _ in self.loss_terms())

    def trains_unpaired(self) -> bool:
        """Whether the loss trains on unpaired rows (kto, apo_zero_unpaired) rather than on pairs."""
        losses = registered_losses()
        return any(losses[name].unpaired for name, _ in self.loss_terms())

    def needs_reference(self) -> bool:
        losses = registered_losses()
        return any(losses[name].needs_reference for name, _ in self.loss_terms())

    def validate_loss(self) -> None:
        if not 0 <= self.label_smoothing < 0.5:
            raise FastDPOError(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}.")
        if self.beta <= 0:
            raise FastDPOError(f"--beta must be > 0, got {self.beta}.")
        losses = registered_losses()
        specs = {name: losses[name] for name, _ in self.loss_terms()}
        check_choice("f_divergence_type", self.f_divergence_type, F_DIVERGENCE_TYPES)
        if self.f_divergence_type != "reverse_kl" and not all(sp.f_divergence for sp in specs.values()):
            ok = ", ".join(n for n, sp in losses.items() if sp.f_divergence)
            raise FastDPOError(f"--f_divergence_type {self.f_divergence_type} is defined only for the losses built on "
                               f"the reward difference ({ok}). Drop it or change --loss_type.")
        if self.use_weighting and any(sp.sorts_step for sp in specs.values()):
            raise FastDPOError("--use_weighting does not apply to aot / aot_unpaired (they sort pairs, so per-pair "
                               "weights would not line up). Drop one of them.")
        if "exo_pair" in specs and self.label_smoothing <= 0:
            raise FastDPOError("--loss_type exo_pair needs --label_smoothing > 0 (the EXO paper uses 1e-3).")
        if not 0 <= self.ld_alpha <= 1:
            raise FastDPOError(f"--ld_alpha must be in [0, 1] (1 = plain DPO), got {self.ld_alpha}.")
        if self.discopop_tau <= 0:
            raise FastDPOError(f"--discopop_tau must be > 0, got {self.discopop_tau}.")
        for name in ("rpo_alpha", "cpo_alpha", "orpo_alpha"):
            if getattr(self, name) < 0:
                raise FastDPOError(f"--{name} must be >= 0, got {getattr(self, name)}.")
        unpaired = [name for name, sp in specs.items() if sp.unpaired]
        listwise = [name for name, sp in specs.items() if sp.listwise]
        if unpaired or listwise:
            self._validate_alone((unpaired + listwise)[0], len(specs), "unpaired rows" if unpaired else "rankings")
        if unpaired:
            for flag in ("desirable_weight", "undesirable_weight"):
                if not getattr(self, flag) > 0:
                    raise FastDPOError(f"--{flag} must be > 0, got {getattr(self, flag)}.")
        elif self.desirable_weight != 1.0 or self.undesirable_weight != 1.0:
            raise FastDPOError("--desirable_weight / --undesirable_weight weigh the rows of an unpaired loss (kto, "
                               f"apo_zero_unpaired); --loss_type {self.loss_type} trains on pairs. Drop them.")
        check_choice("beta_schedule", self.beta_schedule, ("constant", "kl_adaptive"))
        if self.beta_schedule == "kl_adaptive":
            if not self.needs_reference():
                raise FastDPOError("--beta_schedule kl_adaptive follows the policy-reference log-ratio, but "
                                   f"--loss_type {self.loss_type} is reference-free. Use --beta_schedule constant.")
            if self.beta_kl_window < 1 or not 0 < self.beta_min_ratio <= 1 or self.beta_kl_target < 0:
                raise FastDPOError("kl_adaptive needs --beta_kl_window >= 1, --beta_min_ratio in (0, 1] and "
                                   "--beta_kl_target >= 0.")

    def _validate_alone(self, name: str, terms: int, data: str) -> None:
        """An unpaired loss (KTO) or a listwise one (Plackett-Luce) trains alone, with none of the pair losses'
        settings."""
        if terms > 1:
            raise FastDPOError(f"--loss_type {self.loss_type}: {name} trains on {data} and cannot be combined with "
                               "other losses. Give it alone.")
        pair_only = {"rpo_alpha": self.rpo_alpha != 0, "ld_alpha": self.ld_alpha != 1.0,
                     "use_weighting": self.use_weighting, "label_smoothing": self.label_smoothing != 0,
                     "beta_schedule": self.beta_schedule != "constant"}
        given = [flag for flag, on in pair_only.items() if on]
        if given:
            raise FastDPOError(f"--loss_type {name} trains on {data}; --{', --'.join(given)} "
                               f"{'applies' if len(given) == 1 else 'apply'} to pairwise losses only. Drop "
                               f"{'it' if len(given) == 1 else 'them'}.")
