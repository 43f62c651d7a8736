"""`fastdpo train --help` shows every flag's default; LoRA left without --learning_rate gets a rate that moves an
adapter (5e-6), and a full fine-tune's rate given to LoRA is warned about."""

import logging

import pytest

from fastdpo.cli import build_parser, main
from fastdpo.config import TrainConfig, build_config


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the text
    for needle in ("[default: right]", "(see --truncation_strategy). [default: 2048]",
                   "[default: 5e-7 (full), 5e-6 (lora, qlora)]", "DPO beta (strength of the KL constraint; IPO's tau; "
                   "SimPO/CPO's temperature). [default: 0.1]", "[default: sigmoid]", "[default: false]"):
        assert needle in out, needle
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "[default: eval_output]" in capsys.readouterr().out


def parse(*flags):
    return build_config(build_parser().parse_args(["train", "--model", "m", "--dataset", "d", *flags]), TrainConfig)


def test_lora_gets_a_learning_rate_that_trains(caplog):
    assert TrainConfig().learning_rate == 5e-7 and TrainConfig(train_type="lora").learning_rate == 5e-6
    assert parse("--train_type", "qlora").learning_rate == 5e-6
    assert parse("--train_type", "lora", "--learning_rate", "2e-5").learning_rate == 2e-5
    caplog.set_level(logging.WARNING, logger="fastdpo")
    parse("--train_type", "lora", "--learning_rate", "5e-7").validate_training()
    assert "--learning_rate 5e-07 with --train_type lora: LoRA adapters start at zero" in caplog.text
    caplog.clear()
    parse("--train_type", "lora").validate_training()
    parse("--learning_rate", "5e-7").validate_training()
    assert "LoRA adapters start at zero" not in caplog.text
